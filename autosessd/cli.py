"""Entry points: `autosessd` (run, check-config) and `autosessctl`. Thin: parse flags, call run()."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, NoReturn

import click

from . import __version__
from .base import config as config_mod
from .base.config import ConfigError

# flag name → config key it overrides
RUN_FLAGS = {
    "engine_kind": "engine.kind",
    "engine_url": "engine.url",
    "engine_control": "engine.control",
    "slot": "engine.slot",
    "slot_save_path": "slot_save_path",
    "store_path": "store_path",
    "min_tokens": "auto_sessions_min_tokens",
    "keep": "auto_sessions_keep",
    "max_gb": "auto_sessions_max_gb",
    "socket": "control.socket",
    "gate": "gate.listen",
    "gate_request_log": "gate.request_log",
    "request_log": "tail.request_log",
    "engine_log": "engine.log",
    "state_dir": "state_dir",
    "idle_save_s": "idle_save_s",
    "stop_timeout_s": "stop_timeout_s",
}


def _load_or_exit(config_path: str | None, overrides: dict[str, Any]) -> config_mod.Config:
    try:
        return config_mod.load(config_path, overrides)
    except ConfigError as e:
        click.echo(f"autosessd: config error: {e}", err=True)
        sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="autosessd")
def autosessd_main() -> None:
    """Keeps long LLM conversations warm: saves and restores the engine's KV state
    around conversation switches and restarts."""


@autosessd_main.command(context_settings={"allow_interspersed_args": False})
@click.option("--config", "config_path", metavar="PATH", help="TOML config file (default: $AUTOSESSD_CONFIG, else "
              "$XDG_CONFIG_HOME/autosessd/autosessd.toml, else /etc/autosessd/autosessd.toml)")
@click.option("--engine-kind", type=click.Choice(config_mod.ENGINE_KINDS), help="engine.kind")
@click.option("--engine-url", metavar="URL", help="engine.url, e.g. http://127.0.0.1:8080")
@click.option("--engine-control", metavar="ADDR", help="engine.control: unix:/path or tcp:host:port")
@click.option("--slot", type=int, help="engine.slot")
@click.option("--slot-save-path", metavar="DIR", help="the engine's --slot-save-path")
@click.option("--store-path", metavar="DIR", help="store_path: where saves are kept durable (the disk), when the "
              "engine saves into a staging directory on tmpfs (--slot-save-path /dev/shm/...)")
@click.option("--min-tokens", metavar="N|auto", help="auto_sessions_min_tokens (default auto: by the engine's "
              "measured rates)")
@click.option("--keep", type=int, help="auto_sessions_keep")
@click.option("--max-gb", type=float, help="auto_sessions_max_gb")
@click.option("--socket", metavar="PATH", help="control.socket")
@click.option("--gate", metavar="HOST:PORT", help="gate.listen: run the HTTP gate there")
@click.option("--gate-request-log", metavar="PATH", help="gate.request_log: the gate writes a JSONL request log")
@click.option("--request-log", metavar="PATH", help="tail.request_log: follow a serving layer's request log")
@click.option("--engine-log", metavar="PATH",
              help="engine.log: follow llama-server's own log (its --log-file, text or --log-jsonl): save behind "
                   "and restore after engine restarts with nothing in front of the engine")
@click.option("--state-dir", metavar="DIR", help="state_dir: where what was held at the last stop is kept")
@click.option("--idle-save-s", type=float, help="idle_save_s: save a conversation once its slot is idle this long "
                                               "after a reply (0: off)")
@click.option("--stop-timeout-s", type=float, metavar="SECONDS", help="stop_timeout_s: the whole stop's deadline")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, help="the lowest level of line the daemon logs (to stderr)")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text: one line a record; json: one JSON object a line (for a log collector)")
@click.option("--exec", "exec_", is_flag=True,
              help="start the engine command given after -- as autosessd's child, on a private loopback port, "
                   "with the gate on the command's --host/--port (e.g. as llama-swap's cmd, --port ${PORT})")
@click.option("--exec-log", metavar="PATH", help="with --exec: append the engine's output to PATH (default: "
                                                 "autosessd's stderr)")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[-- ENGINE COMMAND...]")
def run(config_path: str | None, log_level: str, log_format: str, exec_: bool, exec_log: str | None,
        command: tuple[str, ...], **flags: Any) -> None:
    """Run the daemon in the foreground."""
    from . import daemon
    from .base import logs

    overrides = {RUN_FLAGS[k]: v for k, v in flags.items() if v is not None}
    child = None
    if exec_ or command or exec_log:
        overrides, child = _exec_plan(exec_, exec_log, command, overrides)
    cfg = _load_or_exit(config_path, overrides)
    if child is not None:
        cfg = config_mod.tmpfs_staging(cfg)
        child = _exec_child(cfg, child, exec_log)
    logs.setup_logging(log_level, log_format)
    exit_after_stop(daemon.run(cfg, config_path, overrides, child))


def _exec_plan(exec_: bool, exec_log: str | None, command: tuple[str, ...], overrides: dict[str, Any]
               ) -> tuple[dict[str, Any], Any]:
    """--exec: the config keys the engine command decides (the gate's address, the engine's
    URL, slot_save_path, the api key), and the command read. A usage error exits 2."""
    from .engines.child import ExecError, parse_command, private_port

    def usage(msg: str) -> NoReturn:
        click.echo(f"autosessd: {msg}", err=True)
        sys.exit(2)

    if not exec_:
        usage(f"{'--exec-log' if exec_log else 'an engine command (' + command[0] + ')'} is given only with --exec")
    for flag, key in (("--gate", "gate.listen"), ("--engine-url", "engine.url"), ("--engine-control", "engine.control")):
        if key in overrides:
            usage(f"{flag} and --exec: with --exec the gate listens on the engine command's --host/--port and the "
                  f"engine on a private port; leave {flag} out")
    if overrides.get("engine.kind", "llama-server") != "llama-server":
        usage("--exec runs llama-server: --engine-kind must be llama-server")
    try:
        cmd = parse_command(command, os.getcwd())
    except ExecError as e:
        usage(str(e))
    out = {**overrides, "gate.listen": list(cmd.listen), "engine.url": f"http://127.0.0.1:{private_port()}"}
    if cmd.slot_save_path is not None:
        flag = overrides.get("slot_save_path")
        if flag is not None and os.path.normpath(flag) != cmd.slot_save_path:
            usage(f"--slot-save-path {flag} and the engine command's --slot-save-path {cmd.slot_save_path} differ: "
                  f"give one of them")
        out["slot_save_path"] = cmd.slot_save_path
    if cmd.api_key is not None:
        out["engine.api_key"] = cmd.api_key
    return out, cmd


def _exec_child(cfg: config_mod.Config, cmd: Any, exec_log: str | None) -> Any:
    """The child to start, once the config is whole; a command that cannot run exits 2."""
    from urllib.parse import urlsplit

    from .engines.child import EngineChild, ExecError, find_executable

    if cfg.engine.kind != "llama-server":
        click.echo(f"autosessd: --exec runs llama-server, but {cfg.source} sets engine.kind = {cfg.engine.kind!r}",
                   err=True)
        sys.exit(2)
    try:
        program = find_executable(cmd.program)
    except ExecError as e:
        click.echo(f"autosessd: {e}", err=True)
        sys.exit(2)
    port = urlsplit(cfg.engine.url).port
    assert port is not None
    return EngineChild(cmd.argv(program, port, cfg.slot_save_path), exec_log)


def exit_after_stop(code: int) -> NoReturn:
    """The process's end, once daemon.run() has returned (its stop done within stop_timeout_s).

    The last resort for the shared bucket's threads: the interpreter's exit joins every
    ThreadPoolExecutor thread (concurrent.futures registers that join at exit), even after
    shutdown(wait=False), so a LIST, header GET, download or s3transfer part still waiting on
    a dead or slow bucket would hold the exit up to its read timeout, past the deadline the
    stop already spent. By now the saves are finalized and the uploads drained or left to the
    next start (the bucket lacks them): nothing of ours is left to write. So the logs are
    flushed and the process leaves with os._exit, without that join."""
    from .base import logs
    from .sessions.remote import bucket_threads_alive

    alive = bucket_threads_alive()
    if alive:
        logging.getLogger("autosessd").warning(
            "stop: %d shared-bucket thread(s) still waiting on the bucket (%s); exiting without them",
            len(alive), ", ".join(sorted(alive)[:4]))
        logs.stop_logging()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


@autosessd_main.command("check-config")
@click.option("--config", "config_path", metavar="PATH", help="TOML config file")
@click.option("--slot-save-path", metavar="DIR", help="as for run")
def check_config(config_path: str | None, slot_save_path: str | None) -> None:
    """Print the effective config (api_key masked), or what is wrong with it (exit 2)."""
    overrides = {"slot_save_path": slot_save_path} if slot_save_path else {}
    cfg = _load_or_exit(config_path, overrides)
    click.echo(json.dumps(cfg.masked(), indent=2))


def autosessctl_main() -> None:
    from .ctl import main

    main()
