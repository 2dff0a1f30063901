"""autosessctl: steer a running autosessd over its control socket.

Exit codes (DESIGN §5): 0 done, 1 the daemon refused or the action failed, 2 usage,
3 the daemon is not running (no socket, or nobody answers: says where it looked),
4 permission denied. No traceback for any expected failure.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import click

from .base.config import ConfigError, default_socket_path
from .ctl_text import forgot, gb, show_bucket_prune, stored, show_doctor, show_event, show_status, table, tokens, when
from .front import protocol
from .front.protocol import Code, ProtocolError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_PERMISSION = 0, 1, 2, 3, 4


class CtlError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.exit_code = code


# A system service's socket (systemd/autosessd.service: --socket, RuntimeDirectory=autosessd).
SYSTEM_SOCKET = Path("/run/autosessd/autosessd.sock")


def socket_path(explicit: str | None) -> Path:
    """--socket, else the configured control.socket, else the default path; where nothing is at
    the default path but a system service's runtime directory exists, that service's socket (a
    user's plain `autosessctl status` then reaches the system service: as a member of
    control.group, or told why not)."""
    if explicit:
        return Path(explicit)
    from .base import config

    try:
        configured = config.load(None, {"slot_save_path": "/"}).control.socket
    except ConfigError:
        configured = None
    if configured:
        return Path(configured)
    path = default_socket_path()
    if path != SYSTEM_SOCKET and not os.path.lexists(path) and os.path.isdir(SYSTEM_SOCKET.parent):
        return SYSTEM_SOCKET
    return path


def connect(path: Path, timeout: float | None) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
    except FileNotFoundError:
        s.close()
        raise CtlError(EXIT_NOT_RUNNING, f"autosessd is not running: no socket at {path}") from None
    except ConnectionRefusedError:
        s.close()
        raise CtlError(EXIT_NOT_RUNNING, f"autosessd is not running: nobody answers at {path} (a stale socket)") \
            from None
    except PermissionError:
        s.close()
        raise CtlError(EXIT_PERMISSION, f"permission denied: {path} (run as the daemon's user, root, or a "
                                        f"member of control.group)") from None
    except OSError as e:
        s.close()
        if e.errno == errno.ENOTSOCK or e.errno == errno.ECONNREFUSED:
            raise CtlError(EXIT_NOT_RUNNING, f"autosessd is not running: {path} is not a live socket") from None
        raise CtlError(EXIT_FAILED, f"cannot connect to {path}: {e.strerror or e}") from None
    return s


def lines(s: socket.socket) -> Iterator[bytes]:
    buf = b""
    while True:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            raise CtlError(EXIT_FAILED, "the daemon did not answer in time") from None
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            if buf:
                yield buf
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line


def call(path: Path, cmd: str, timeout: float | None = 600, **args: Any) -> Any:
    """One request, one answer: the result, or CtlError with the exit code to use."""
    s = connect(path, timeout)
    with s:
        try:
            s.sendall(protocol.request(cmd, **args))
        except OSError:
            pass  # the daemon may have answered (refused) and closed: its answer is still there to read
        for line in lines(s):
            return unwrap(line)
    raise CtlError(EXIT_FAILED, f"the daemon at {path} closed the connection without an answer")


def unwrap(line: bytes) -> Any:
    try:
        reply = protocol.parse_reply(line)
    except ProtocolError as e:
        raise CtlError(EXIT_FAILED, e.message) from None
    if reply.get("ok"):
        return reply.get("result")
    error = reply.get("error") or {}
    code = error.get("code")
    message = error.get("message") or "failed"
    if code == Code.FORBIDDEN:
        raise CtlError(EXIT_PERMISSION, f"permission denied: {message}")
    raise CtlError(EXIT_FAILED, message)


# -- commands -------------------------------------------------------------------------
def common(f: Callable) -> Callable:
    """--socket and --json on every command (they may also come before the command)."""
    f = click.option("--json", "as_json", is_flag=True, default=None, help="print JSON instead of a table")(f)
    f = click.option("--socket", "sock", metavar="PATH", default=None, help="the daemon's control socket")(f)
    return click.pass_context(f)


class Ctx:
    def __init__(self, sock: str | None, as_json: bool):
        self.sock, self.as_json = sock, as_json

    def merged(self, sock: str | None, as_json: bool | None) -> "Ctx":
        return Ctx(sock or self.sock, self.as_json if as_json is None else as_json)

    @property
    def path(self) -> Path:
        return socket_path(self.sock)

    def out(self, result: Any, human: Callable[[Any], str]) -> None:
        click.echo(json.dumps(result, indent=2) if self.as_json else human(result))


def run(f: Callable[[], None]) -> None:
    try:
        f()
    except CtlError as e:
        click.echo(f"autosessctl: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # `autosessctl events -f | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--socket", "sock", metavar="PATH", help="the daemon's control socket "
              "(default: control.socket from the config, else $XDG_RUNTIME_DIR/autosessd/autosessd.sock, "
              "else a system service's /run/autosessd/autosessd.sock)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
@click.pass_context
def cli(ctx: click.Context, sock: str | None, as_json: bool) -> None:
    """Steer a running autosessd."""
    ctx.obj = Ctx(sock, as_json)


@cli.command()
@common
def status(ctx: click.Context, sock: str | None, as_json: bool | None) -> None:
    """What the daemon holds, knows and has done."""
    c = ctx.obj.merged(sock, as_json)
    run(lambda: c.out(call(c.path, "status", timeout=30), show_status))


MODEL = click.option("--model", metavar="ID", help="behind a llama-server router: the model (GET /models id)")


@cli.command()
@MODEL
@common
def ls(ctx: click.Context, model: str | None, sock: str | None, as_json: bool | None) -> None:
    """Session files, newest first (auto and manual); behind a router, each with its model."""
    c = ctx.obj.merged(sock, as_json)

    def human(rows: list[dict[str, Any]]) -> str:
        if not rows:
            return "no sessions"
        models = any("model" in r for r in rows)  # a router's: the model column
        return table([[r["name"] + (" *" if r["held"] else ""), r["kind"], r.get("line") or "-",
                       tokens(r["n_tokens"]), gb(r["bytes"]), stored(r), when(r["saved_at"]),
                       {True: "yes", False: "OTHER MODEL", None: "-"}[r["model_ok"]],
                       r.get("words") or (f"({r['why']})" if r["kind"] == "quarantined" else "")
                       or (f"(no words: {r['words_error']})" if r.get("words_error") else "")]
                      + ([r.get("model") or "-"] if models else [])
                      for r in rows], ["NAME", "KIND", "LINE", "TOKENS", "SIZE", "STORED", "SAVED", "THIS MODEL",
                                       "FIRST WORDS"]
                     + (["MODEL"] if models else []))

    run(lambda: c.out(call(c.path, "ls", timeout=60, model=model), human))


@cli.command()
@click.option("--name", metavar="NAME", help="save to NAME.bin, a manual file prune never touches")
@click.option("--slot", type=click.IntRange(min=0), help="the engine slot (default: engine.slot)")
@MODEL
@common
def park(ctx: click.Context, name: str | None, slot: int | None, model: str | None, sock: str | None,
         as_json: bool | None) -> None:
    """Save the held conversation now, whatever its size."""
    c = ctx.obj.merged(sock, as_json)
    run(lambda: c.out(call(c.path, "park", timeout=None, name=name, slot=slot, model=model),
                      lambda r: f"saved {tokens(r['n_tokens'])} tokens ({gb(r['bytes'])}) to {r['file']} "
                                f"in {r['ms']:,.0f} ms"))


@cli.command()
@click.argument("what", metavar="KEY|NAME")
@click.option("--slot", type=click.IntRange(min=0), help="the engine slot (default: engine.slot)")
@MODEL
@common
def restore(ctx: click.Context, what: str, slot: int | None, model: str | None, sock: str | None,
            as_json: bool | None) -> None:
    """Load auto-KEY.bin or NAME.bin into an engine slot (behind a router: of --model, loaded for it)."""
    c = ctx.obj.merged(sock, as_json)
    run(lambda: c.out(call(c.path, "restore", timeout=None, what=what, slot=slot, model=model),
                      lambda r: f"restored {tokens(r['n_tokens'])} tokens from {r['file']} in {r['ms']:,.0f} ms"))


@cli.command()
@click.option("--dry-run", is_flag=True, help="only say what would be removed")
@click.option("--keep", type=click.IntRange(min=0), help="keep this many (default: auto_sessions_keep, "
              "with --shared: shared.keep)")
@click.option("--max-gb", type=click.FloatRange(min=0), help="at most this much (default: auto_sessions_max_gb, "
              "with --shared: shared.max_gb)")
@click.option("--shared", is_flag=True, help="prune the shared bucket instead of the local directory (one host "
              "at a time, under its lease)")
@common
def prune(ctx: click.Context, dry_run: bool, keep: int | None, max_gb: float | None, shared: bool,
          sock: str | None, as_json: bool | None) -> None:
    """Remove old auto sessions (never a manual file, never one in use)."""
    c = ctx.obj.merged(sock, as_json)

    def human(r: dict[str, Any]) -> str:
        if r.get("shared"):
            return show_bucket_prune(r)
        verb = "would remove" if r["dry_run"] else "removed"
        out = [f"{verb} {x['file']} ({gb(x['bytes'])})" for x in r["removed"]]
        out.append(f"{'would free' if r['dry_run'] else 'freed'} {gb(r['freed'])}; {r['kept']} auto files kept")
        return "\n".join(out)

    run(lambda: c.out(call(c.path, "prune", timeout=None if shared else 600, dry_run=dry_run or None, keep=keep,
                           max_gb=max_gb, shared=shared or None), human))


@cli.command()
@click.argument("key")
@common
def forget(ctx: click.Context, key: str, sock: str | None, as_json: bool | None) -> None:
    """Forget conversation KEY for good: its files (branches too) removed, here and from the
    shared bucket (every host's saves of it), every slot holding it emptied, nothing restored
    after a restart; only a new request of KEY brings it back."""
    c = ctx.obj.merged(sock, as_json)
    run(lambda: c.out(call(c.path, "forget", key=key), forgot))


@cli.command()
@click.option("-f", "--follow", is_flag=True, help="keep printing events as they happen")
@click.option("-n", "--limit", type=click.IntRange(min=0), default=100, show_default=True,
              help="print at most this many of the recent events first")
@common
def events(ctx: click.Context, follow: bool, limit: int, sock: str | None, as_json: bool | None) -> None:
    """Recent events (saves, restores, skips, failures), or follow them live."""
    c = ctx.obj.merged(sock, as_json)

    def emit(ev: dict[str, Any]) -> None:
        click.echo(json.dumps(ev) if c.as_json else show_event(ev))

    def go() -> None:
        if not follow:
            for ev in call(c.path, "events", limit=limit):
                emit(ev)
            return
        s = connect(c.path, None)
        with s:
            s.sendall(protocol.request("events", follow=True, limit=limit))
            it = lines(s)
            first = next(it, None)
            if first is None:
                raise CtlError(EXIT_FAILED, "the daemon closed the connection")
            for ev in unwrap(first)["recent"]:
                emit(ev)
            for line in it:
                reply = protocol.parse_reply(line)
                if "event" in reply:
                    emit(reply["event"])
                    sys.stdout.flush()
                else:
                    unwrap(line)  # an error (overflow): raises with its message
            raise CtlError(EXIT_NOT_RUNNING, "autosessd stopped")

    run(go)


@cli.command()
@common
def doctor(ctx: click.Context, sock: str | None, as_json: bool | None) -> None:
    """The engine settings that cost reuse, each with its fix; where unreused restores departed."""
    c = ctx.obj.merged(sock, as_json)
    run(lambda: c.out(call(c.path, "doctor", timeout=120), show_doctor))


def main() -> None:
    cli(prog_name="autosessctl")
