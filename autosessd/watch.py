"""Engine restarts: /health going down and up, or another process on the engine's port.

Either way what the engine held is gone. The watch says so once (`on_restart`): the facade
then marks every slot lost, the launch gate forgets the primer and the engine's RAM cache,
and the inputs that care (the gate's connection pool, the tail's restore) are told.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable
from urllib.parse import urlsplit

import psutil

from .engines.base import EngineError

if TYPE_CHECKING:
    from .context import Context

log = logging.getLogger("autosessd")


def engine_identity(kind: str, url: str) -> tuple[int, float] | None:
    """(pid, start time) of the process listening on the engine's port, when it runs on this
    host and is visible to us; None otherwise. Blocking (psutil)."""
    u = urlsplit(url)
    if kind != "llama-server" or u.hostname not in ("127.0.0.1", "localhost", "::1"):
        return None
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid, psutil.Process(c.pid).create_time()
    except (psutil.Error, OSError):
        return None
    return None


class EngineWatch:
    def __init__(self, ctx: Context, on_restart: Callable[[str], Awaitable[None]], healthy: bool | None = None):
        self.ctx = ctx
        self.on_restart = on_restart
        self.healthy = healthy  # the last /health (status shows it); None: not asked yet

    def identity(self) -> tuple[int, float] | None:
        cfg = self.ctx.cfg.engine
        return engine_identity(cfg.kind, cfg.url)

    async def run(self, every_s: float = 2.0, identity_every_s: float = 10.0) -> None:
        """Until cancelled: /health every every_s, the port's process every identity_every_s."""
        loop = asyncio.get_running_loop()
        engine = self.ctx.engine
        identity = await loop.run_in_executor(None, self.identity)
        last_identity_check = time.monotonic()
        up_before = True
        while True:
            await asyncio.sleep(every_s)
            try:
                up = await engine.health()
            except EngineError:
                up = False
            self.healthy = up
            restarted = None
            if not up and up_before:
                log.warning("engine: %s is down", engine.address)
            elif up and not up_before:
                log.info("engine: %s is back", engine.address)
                restarted = "the engine restarted (health went down and up)"
            up_before = up
            if up and restarted is None and time.monotonic() - last_identity_check >= identity_every_s:
                last_identity_check = time.monotonic()
                ident = await loop.run_in_executor(None, self.identity)
                if ident and identity and ident != identity:
                    restarted = f"another engine process (pid {ident[0]}) took its port"
                identity = ident or identity
            if restarted:
                await self.on_restart(restarted)
