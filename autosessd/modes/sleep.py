"""llama-server --sleep-idle-seconds N: after N s without a task the engine frees its model,
and with it every slot's KV state; the next request loads the model again and re-reads every
conversation from its first token. Nothing is saved on the way down.

So autosessd saves first. Each slot's ticket released is activity (a request through the
gate or the hook ended, a command ran); once the engine has been idle for a little less than
N s (SAVE_MARGIN_S before the timer, at most half of it), every conversation worth saving is
saved (policy: the UNLOAD occasion; a file that already holds it is left alone). A save is a
task to the engine: its timer starts again, and the engine sleeps N s after the last save.
Then /props is asked (it neither wakes the engine nor moves its timer) until is_sleeping: the
slots hold nothing now, and each conversation's next request restores it from its file, as
after a restart. A request that comes first finds its conversation still in the slot.

What autosessd cannot see (requests that bypass the gate and the hook, the tails) wakes the
engine or keeps it awake without us knowing: the save is then early (harmless), and a sleep
seen later still marks the slots empty.

N comes from engine.sleep_idle_s, else from the engine's command line (a router's GET /models
args, the --exec child's, a local engine's process), else there is no timer to watch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable

from ..engines.base import EngineError
from ..engines.process import engine_command
from ..sessions.observe import SLEPT

if TYPE_CHECKING:
    from ..base.config import Config
    from ..sessions.facade import Sessions
    from ..sessions.slot import Slot

log = logging.getLogger("autosessd")

SAVE_MARGIN_S = 3.0  # the saves start this long before the engine's timer (at most half of it)
POLL_S = 0.5  # how often the idle time is checked, and /props asked while a sleep is due
GIVE_UP_AFTER = 3  # /props is asked until idle for this many timers; then the next activity


def find_seconds(cfg: Config, args: list[str] | None = None) -> float | None:
    """The engine's sleep timer: engine.sleep_idle_s, else its command line (args: a router
    model's; else the process on the engine's port, when it runs here). Blocking (psutil)."""
    if cfg.engine.sleep_idle_s is not None:
        return cfg.engine.sleep_idle_s or None
    if args is None:
        command = engine_command(cfg.engine.kind, cfg.engine.url)
        if command is None:
            return None
        args = command[0]
    return sleep_seconds(args)


def sleep_seconds(args: list[str]) -> float | None:
    """--sleep-idle-seconds N in an engine's arguments; None when absent or off (N < 0)."""
    for i, a in enumerate(args):
        v = args[i + 1] if a == "--sleep-idle-seconds" and i + 1 < len(args) else (
            a.split("=", 1)[1] if a.startswith("--sleep-idle-seconds=") else None)
        if v is not None:
            try:
                n = float(v)
            except ValueError:
                return None
            return n if n > 0 else None
    return None


class SleepWatch:
    def __init__(self, sessions: Sessions, seconds: float, up: Callable[[], bool] = lambda: True):
        """up: whether the engine runs now (behind a router: its model is loaded)."""
        self.sessions = sessions
        self.seconds = seconds
        self._up = up
        self.save_after = max(seconds / 2, seconds - SAVE_MARGIN_S)
        self._last = time.monotonic()  # the last activity we saw (the engine's timer started then)
        self._saved = False  # this idle stretch's saves are done
        self._asleep = False  # seen asleep since the last activity
        self._own = False  # our saves' tickets are not someone's activity
        self._task: asyncio.Task | None = None
        sessions.placement.on_release.append(self.touch)

    def touch(self, _slot: Slot | None = None) -> None:
        self._last = time.monotonic()
        if not self._own:
            self._saved = self._asleep = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())
        log.info("engine: %s sleeps after %g s idle: autosessd saves its conversations %g s into an idle "
                 "stretch, and restores them after it wakes", self.sessions.engine.address, self.seconds,
                 self.save_after)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def describe(self) -> dict:
        return {"sleep_idle_s": self.seconds, "asleep": self._asleep, "saved": self._saved}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the watch never dies of one bad answer
                log.warning("engine sleep: %s", e)

    async def step(self) -> None:
        if self._asleep or not self._up() or any(s.busy for s in self.sessions.slots.values()):
            return
        idle = time.monotonic() - self._last
        if not self._saved and idle >= self.save_after:
            await self._save()
            return
        if self._saved and idle < GIVE_UP_AFTER * self.seconds and await self._sleeping():
            await self._slept()

    async def before_turn(self, s: Slot) -> None:
        """A turn on slot s (its ticket held) after an idle stretch longer than the timer: the
        engine slept unless something we did not see kept it awake, and /props says which
        before the turn's own look wakes it. Asleep: s and every free slot hold nothing."""
        if self._asleep or time.monotonic() - self._last < self.seconds or not await self._sleeping():
            return
        for other in self.sessions.slots.values():
            if other is s or not other.busy:
                self.sessions.observer.lost(other, SLEPT)
        self._seen_asleep()

    def _seen_asleep(self) -> None:
        self._asleep = True
        self.sessions.counters.engine_sleeps += 1
        self.sessions.events.emit("engine_slept", after_s=round(time.monotonic() - self._last, 1))

    async def _sleeping(self) -> bool:
        try:
            return await self.sessions.engine.is_sleeping()
        except EngineError as e:
            log.debug("engine sleep: /props: %s", e)
            return False

    async def _save(self) -> None:
        s = self.sessions
        self._own = True
        try:
            saved = await s.commands.save_all_worth()
        finally:
            self._own = False
        self._saved = True
        s.counters.saves_before_sleep += saved
        if saved:
            log.info("auto sessions: %d conversation(s) saved before the engine's sleep", saved)

    async def _slept(self) -> None:
        """Asleep: with every ticket held (no turn in between), asked once more, and then
        every slot marked empty."""
        s = self.sessions
        self._own = True
        try:
            tickets = await s.admit_all()
            try:
                if not await self._sleeping():
                    return  # woken meanwhile (a request we did not see): the slots say what they hold
                for t in tickets:
                    s.observer.lost(s.placement.slot_of(t), SLEPT)
                self._seen_asleep()
            finally:
                for t in tickets:
                    t.release()
        finally:
            self._own = False
