"""Engine restarts: /health going down and up, or another process on the engine's port.

Either way what the engine held is gone. The watch says so once (`on_restart`): the facade
then marks every slot lost, the launch gate forgets the primer and the engine's RAM cache,
and the inputs that care (the gate's connection pool, the tails' restores) are told. The
engine's own log (enginetail.py) may show the same start first: `seen_in_log` reports it,
and each engine process is reported once, by whichever saw it first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable
from ..engines.base import EngineError
from ..engines.process import engine_identity

if TYPE_CHECKING:
    from .context import Context

log = logging.getLogger("autosessd")


class EngineWatch:
    def __init__(self, ctx: Context, on_restart: Callable[[str], Awaitable[None]], healthy: bool | None = None):
        self.ctx = ctx
        self.on_restart = on_restart
        self.healthy = healthy  # the last /health (status shows it); None: not asked yet
        # One restart, seen both here and in the engine's own log (enginetail.py), is reported
        # once: each side records the engine process it reported (pid, start time), and the
        # other does not report that process again. Without an identity (not visible here), the
        # watch does not report a down-and-up once the log reported a start since the watch
        # last saw the engine up.
        self._identity: tuple[int, float] | None = None  # the process on the engine's port, last seen
        self._by_log: tuple[int, float] | None = None
        self._by_watch: tuple[int, float] | None = None
        self._log_at = 0.0  # when the log last reported a start (monotonic)
        # The engine process autosessd found at its own start (the daemon sets it before the
        # inputs start): its start lines in the log are not a restart of anything autosessd knew
        # (issue 33: the pair restarted; the restore at start puts the slots back, once).
        self.at_start: tuple[int, float] | None = None

    def identity(self) -> tuple[int, float] | None:
        cfg = self.ctx.cfg.engine
        return engine_identity(cfg.kind, cfg.url)

    async def seen_in_log(self, why: str) -> bool:
        """The engine's own log shows a new engine process (its start): report it as a
        restart unless the watch already reported this very process. → reported now."""
        ident = await asyncio.get_running_loop().run_in_executor(None, self.identity)
        self._log_at = time.monotonic()
        self._by_log = ident
        if ident is not None and ident == self._by_watch:
            log.debug("engine: the restart its log shows was already seen (pid %d)", ident[0])
            return False
        if ident is not None and ident == self.at_start:
            log.debug("engine: its log shows the start of the process found at autosessd's own start (pid %d): "
                      "not a restart", ident[0])
            return False
        self._identity = ident or self._identity
        await self.on_restart(why)
        return True

    async def _report(self, why: str, ident: tuple[int, float] | None) -> None:
        if ident is not None and ident == self._by_log:
            log.debug("engine: %s, as its log showed already", why)
            return
        self._by_watch = ident
        await self.on_restart(why)

    async def run(self, every_s: float = 2.0, identity_every_s: float = 10.0) -> None:
        """Until cancelled: /health every every_s, the port's process every identity_every_s."""
        loop = asyncio.get_running_loop()
        engine = self.ctx.engine
        self._identity = await loop.run_in_executor(None, self.identity)
        last_identity_check = time.monotonic()
        up_before = True
        up_at = time.monotonic()  # when the engine was last seen up
        while True:
            await asyncio.sleep(every_s)
            try:
                up = await engine.health()
            except EngineError:
                up = False
            self.healthy = up
            if not up and up_before:
                log.warning("engine: %s is down", engine.address)
            elif up and not up_before:
                log.info("engine: %s is back", engine.address)
                ident = await loop.run_in_executor(None, self.identity)
                self._identity = ident or self._identity
                last_identity_check = time.monotonic()
                if ident is None and self._log_at >= up_at:
                    log.debug("engine: back after a start its log showed already")
                else:
                    await self._report("the engine restarted (health went down and up)", ident)
            if up:
                up_at = time.monotonic()
            up_before = up
            if up and time.monotonic() - last_identity_check >= identity_every_s:
                last_identity_check = time.monotonic()
                ident = await loop.run_in_executor(None, self.identity)
                if ident and self._identity and ident != self._identity:
                    self._identity = ident
                    await self._report(f"another engine process (pid {ident[0]}) took its port", ident)
                self._identity = ident or self._identity
