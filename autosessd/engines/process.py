"""The engine's process, when it runs on this host and is ours to read: who listens on its
port (a restart is another process there: watch.py) and with what command line (its
--sleep-idle-seconds, --cache-ram, -np and the like: sleep.py, checks.py, doctor.py)."""

from __future__ import annotations

from urllib.parse import urlsplit

import psutil


def engine_identity(kind: str, url: str) -> tuple[int, float] | None:
    """(pid, start time) of the process listening on the engine's port, when it runs on this
    host and is visible to us; None otherwise. Blocking (psutil)."""
    u = urlsplit(url)
    if kind != "llama-server" or u.hostname not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        return None
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid, psutil.Process(c.pid).create_time()
    except (psutil.Error, OSError):
        return None
    return None


def engine_command(kind: str, url: str) -> tuple[list[str], dict[str, str]] | None:
    """(argv, environment) of the process listening on the engine's port, when it runs on this
    host and is ours to read; None otherwise (the environment {} when only it is hidden).
    Blocking (psutil)."""
    ident = engine_identity(kind, url)
    if ident is None:
        return None
    try:
        p = psutil.Process(ident[0])
        args = p.cmdline()
    except (psutil.Error, OSError):
        return None
    try:
        env = p.environ()
    except (psutil.Error, OSError):
        env = {}
    return args, env
