"""The engine as autosessd's child (`autosessd run --exec -- llama-server ARGS…`).

What a process manager such as llama-swap starts is then autosessd, and autosessd starts the
engine behind its gate:

    the command's --host:--port     the gate listens there (llama-swap: --port ${PORT})
    127.0.0.1:<private port>        the engine listens there; engine.url points at it
    --slot-save-path                the command's own becomes slot_save_path; without one,
                                    slot_save_path is added to the command
    --api-key / --api-key-file      the first key becomes engine.api_key (autosessd's own
                                    calls need it; the clients' requests carry their own)

Life of the child, owned by the daemon (daemon.py):

    spawn     after the store check and a check that the gate's address is free (a port in
              use is found before a model is loaded); in a session of its own, so a signal
              to autosessd's process group (llama-swap sends SIGTERM to the whole group, a
              terminal's Ctrl-C reaches the group) does not stop the engine before the stop
              save; and on Linux with PR_SET_PDEATHSIG, so an autosessd killed outright
              (SIGKILL at the end of a stop timeout) takes the engine with it
    start     the usual start checks run against the child; one that exits first ends the
              start (exit 1), with its status
    run       a child that exits by itself ends autosessd with a log line and exit 1: the
              gate has no engine behind it, and the process manager must see its cmd died
    stop      after the stop save of every idle slot: SIGTERM to the child, SIGKILL to its
              process group at the stop's deadline (stop_timeout_s)

The command is parsed as llama-server parses it (common/arg.cpp, b11434): an option and its
value are two words (`--port=8080` is no option there), `_` in an option's name reads as
`-`, the last of repeated options wins, and a command-line option beats its environment
variable (LLAMA_ARG_PORT, LLAMA_ARG_HOST), so the private --port and --host given here win.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

log = logging.getLogger("autosessd")

# Options this module reads or replaces; each takes one value.
PORT, HOST, SLOT_SAVE_PATH, API_KEY, API_KEY_FILE = (
    "--port", "--host", "--slot-save-path", "--api-key", "--api-key-file")
_VALUED = (PORT, HOST, SLOT_SAVE_PATH, API_KEY, API_KEY_FILE)


class ExecError(Exception):
    """The command given to --exec cannot be run as autosessd's engine (usage: exit 2)."""


@dataclass(frozen=True)
class Command:
    """An engine command, read: what it asks for, and the words to run it with."""

    program: str  # as given
    rest: tuple[str, ...]  # its arguments without --port, --host and --slot-save-path
    listen: tuple[str, ...]  # HOST:PORT for the gate, one per --host address
    slot_save_path: str | None  # its own --slot-save-path, absolute; None: it has none
    api_key: str | None  # the first key of --api-key or --api-key-file

    def argv(self, executable: str, engine_port: int, slot_save_path: str) -> list[str]:
        """The words the child runs: the command's own, on a private loopback port, saving
        into slot_save_path."""
        return [executable, *self.rest, HOST, "127.0.0.1", PORT, str(engine_port), SLOT_SAVE_PATH, slot_save_path]


def _option(word: str) -> str:
    return word.replace("_", "-") if word.startswith("--") else word


def parse_command(words: Sequence[str], cwd: str) -> Command:
    """Read an engine command (pure but for --api-key-file, read when given). Raises ExecError."""
    if not words:
        raise ExecError("--exec needs the engine's command after --, e.g. "
                        "autosessd run --exec -- llama-server -m model.gguf --port 8080")
    program, args = words[0], list(words[1:])
    values: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        opt = _option(args[i])
        if opt in _VALUED:
            if i + 1 >= len(args):
                raise ExecError(f"the engine command ends with {args[i]} and no value after it")
            values[opt] = args[i + 1]  # the last one wins, as in llama-server
            if opt in (API_KEY, API_KEY_FILE):
                rest += args[i:i + 2]  # the engine keeps its keys
            i += 2
            continue
        rest.append(args[i])
        i += 1
    if PORT not in values:
        raise ExecError("the engine command has no --port: autosessd puts its gate on the port the command "
                        "names and gives the engine a private one (under llama-swap: --port ${PORT})")
    port_s = values[PORT]
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ExecError(f"the engine command's --port must be a number from 1 to 65535, got {port_s!r}")
    hosts = [h.strip() for h in values.get(HOST, "127.0.0.1").split(",") if h.strip()]
    if not hosts:
        raise ExecError(f"the engine command's --host names no address: {values[HOST]!r}")
    for h in hosts:
        if h.endswith(".sock"):
            raise ExecError(f"the engine command's --host {h} is a UNIX socket; the gate listens on TCP only: "
                            f"give --host an address (127.0.0.1)")
    listen = tuple(f"[{h}]:{port_s}" if ":" in h else f"{h}:{port_s}" for h in hosts)
    ssp = values.get(SLOT_SAVE_PATH)
    if ssp is not None:
        ssp = os.path.normpath(os.path.join(cwd, ssp))  # the engine reads it relative to its cwd: ours
    return Command(program, tuple(rest), listen, ssp, _api_key(values))


def _api_key(values: dict[str, str]) -> str | None:
    """The key autosessd's own calls use: the first of --api-key (comma-separated), else the
    first line of --api-key-file that is not a comment (llama-server reads both this way)."""
    keys = [k for k in values.get(API_KEY, "").split(",") if k]
    if keys:
        return keys[0]
    path = values.get(API_KEY_FILE)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\r\n") for line in f.read(1 << 20).splitlines()]
    except (OSError, UnicodeDecodeError) as e:
        raise ExecError(f"the engine command's --api-key-file {path}: cannot read it: "
                        f"{getattr(e, 'strerror', None) or e}") from None
    return next((line for line in lines if line and not line.startswith("#")), None)


def find_executable(program: str) -> str:
    """The program's path, as exec would find it; ExecError naming what is wrong otherwise."""
    if os.sep in program:
        if not os.path.exists(program):
            raise ExecError(f"the engine command {program}: no such file")
        # access() alone says yes to root for any file with an x bit, or none on some systems.
        if not os.path.isfile(program) or not os.stat(program).st_mode & 0o111 or not os.access(program, os.X_OK):
            raise ExecError(f"the engine command {program}: not an executable file")
        return os.path.abspath(program)
    found = shutil.which(program)
    if found is None:
        raise ExecError(f"the engine command {program}: not found in PATH ({os.environ.get('PATH', '')})")
    return found


def private_port() -> int:
    """A free loopback port for the engine (the kernel's choice; the engine binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_free(hostport: tuple[str, int]) -> str | None:
    """None when the gate can listen there now, else why not (before the engine is started)."""
    host, port = hostport
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the gate binds
        try:
            s.bind((host, port))
        except OSError as e:
            return os.strerror(e.errno) if e.errno else str(e)
    return None


def describe_exit(rc: int) -> str:
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {-rc} ({signal.Signals(-rc).name})"
        return f"killed by signal {-rc}"
    return f"exit status {rc}"


def _pdeathsig():  # returns the preexec_fn, its libc call resolved before the fork
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def child_setup() -> None:
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call: nobody would stop us
            os._exit(1)

    return child_setup


class EngineChild:
    """The engine process: spawned, watched, stopped. Used by the daemon only."""

    def __init__(self, argv: Sequence[str], output: str | None = None):
        """output: a file the child's stdout and stderr are appended to; None: autosessd's stderr."""
        self.argv = list(argv)
        self.output = output
        self.proc: asyncio.subprocess.Process | None = None
        self._exited: asyncio.Task | None = None
        self.stopping = False  # the daemon asked it to stop: its exit is expected

    @property
    def name(self) -> str:
        return Path(self.argv[0]).name

    async def spawn(self) -> None:
        out = open(self.output, "ab") if self.output else None
        try:
            fd = out.fileno() if out else sys.stderr.fileno()
            # systemd's notify socket and watchdog are the main process's (autosessd's) alone.
            env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True,
                preexec_fn=_pdeathsig(), env=env)
        except OSError as e:
            raise ExecError(f"cannot run the engine command {self.argv[0]}: {e.strerror or e}") from None
        finally:
            if out:
                out.close()
        self._exited = asyncio.get_running_loop().create_task(self.proc.wait())
        log.info("engine: started %s (pid %d) on 127.0.0.1:%s: %s", self.name, self.proc.pid,
                 self.argv[self.argv.index(PORT) + 1], " ".join(self.argv))

    async def exited(self) -> int:
        """Waits until the child exits; its returncode (negative: the signal)."""
        assert self._exited is not None
        return await asyncio.shield(self._exited)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def stop(self, deadline_s: float) -> None:
        """SIGTERM, then SIGKILL to its process group once deadline_s has passed."""
        if self.proc is None:
            return
        self.stopping = True
        if self.alive():
            log.info("engine: stopping %s (pid %d): SIGTERM, SIGKILL in %.1f s if it is still running",
                     self.name, self.proc.pid, deadline_s)
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.exited(), max(0.0, deadline_s))
            except asyncio.TimeoutError:
                log.error("engine: %s (pid %d) still running at the stop's deadline (stop_timeout_s): SIGKILL",
                          self.name, self.proc.pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.exited(), 5.0)
        rc = self.proc.returncode
        if rc is not None:
            log.info("engine: %s (pid %d) stopped (%s)", self.name, self.proc.pid, describe_exit(rc))
