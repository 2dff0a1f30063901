"""Saving while the engine is idle (issue 23), so that a switch waits only for the restore.

With one slot, a switch saves the outgoing conversation before it restores the incoming one,
and the incoming request waits for both: at a real model's size (128 KiB a token, 27k tokens)
a 3.5 GB save comes first. So after a reply through the gate, once the slot has stayed idle
for `idle_save_s`, the conversation it holds is saved behind when it is worth a save and its
file lacks at least `idle_save_min_new_tokens` of it: a switch then finds the file up to date
(policy.plan_save: UP_TO_DATE) and goes straight to the restore.

Bounds, each a promise:

    switching slots      a pause saves only on a slot that switched conversations within
                         `idle_save_switched_s` (30 min): one conversation going on alone on its
                         slot is never switched away, and an idle save after each of its replies
                         would write its whole state every turn for nothing (issue 31: 2 GB a
                         turn at 16k tokens of an 8B model). Its first switch saves it at the switch
    one save per pause   a pause is the quiet after one request's end; it saves at most once
                         (deferred by the cap, it is tried again within the same pause), and
                         the next save needs another request and another pause
    a cap                idle saves write at most `idle_save_mb_per_min` in any minute, by the
                         size the store expects of the save (a save larger than the whole cap
                         runs only after a minute with none); a switch saves what was deferred
    others first         never while a request runs on another slot (llama-server writes a save on
                         its main loop, and every slot's generation stops for its time): the
                         pause waits until the other slots are free
    give way             never while another request holds or waits for the slot: the slot's
                         ticket comes from try_admit, which never waits, and a pause that finds
                         the slot taken saves nothing. A request that arrives during the save
                         waits for it (the engine cannot stop one): the price of saving behind,
                         at most one save's time, and only for a request that comes just then

Entry points, kept apart: ended(slot) starts a slot's pause (the gate's requests: the tail
and the engine log save behind every end already, and a turn hook's end is never seen);
save_now() saves every idle slot's conversation that is worth it now, without the pause (and,
unless asked, without the cap): for a caller that knows the slots' state is about to go (an
engine about to sleep). Both take the ticket by try_admit: lock order 1, nothing held before.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING, Any

from .policy import Occasion, Save, SaveOutcome, Skip
from .report import TurnResult, fmt_bytes, skipped
from .slot import Phase, Slot, View

if TYPE_CHECKING:
    from .context import Context
    from .launch import Launch
    from .observe import Observer
    from .placement import Placement
    from .saves import Saver

log = logging.getLogger("autosessd")

WINDOW_S = 60.0  # the cap counts the idle saves of the last minute
OTHERS_BUSY_S = 0.25  # how often a pause looks again while another slot runs a request


class IdleSaver:
    def __init__(self, ctx: Context, placement: Placement, observer: Observer, saver: Saver, launch: Launch):
        self.ctx = ctx
        self.placement = placement
        self.observer = observer
        self.saver = saver
        self.launch = launch
        self._pauses: dict[int, asyncio.Task] = {}  # slot id → its pause
        self._written: collections.deque[tuple[float, int]] = collections.deque()  # (time.monotonic(), bytes)
        self._one = asyncio.Lock()  # one idle save at a time: the disk is shared by every slot
        self._saving: set[int] = set()  # slots whose save is under way: never cancelled half-way
        self._closed = False
        self._ended_key: dict[int, str | None] = {}  # slot id → the conversation of its last end
        self._switched_at: dict[int, float] = {}  # slot id → time.monotonic() it last ended another one

    # -- the pause -------------------------------------------------------------------------
    def ended(self, s: Slot) -> None:
        """A request through the gate ended on slot s: its pause starts (replacing one running)."""
        cfg = self.ctx.cfg
        if self._closed or not cfg.auto_sessions or cfg.idle_save_s <= 0 or self.launch.active:
            return  # off; or an engine that empties idle slots: every end is saved already (sessions.ended)
        if s.id in self._saving:
            return  # cannot be: its save holds the slot's ticket, so no request ran on it
        old = self._pauses.pop(s.id, None)
        if old is not None:
            old.cancel()
        v = s.view
        if v.conversation() is None:
            return
        before = self._ended_key.get(s.id)
        if before is not None and before != v.key:
            self._switched_at[s.id] = time.monotonic()
        self._ended_key[s.id] = v.key
        task = asyncio.get_running_loop().create_task(self._pause(s, v))
        self._pauses[s.id] = task
        task.add_done_callback(lambda t: self._pauses.pop(s.id, None) if self._pauses.get(s.id) is t else None)

    async def _pause(self, s: Slot, v: View) -> None:
        try:
            await asyncio.sleep(self.ctx.cfg.idle_save_s)
            if not self.switching(s):
                self.ctx.counters.idle_saves_alone += 1
                log.debug("auto sessions: slot %d: not saved while idle: no switch on it in the last %.0f s "
                          "(idle_save_switched_s)", s.id, self.ctx.cfg.idle_save_switched_s)
                return
            while True:
                # llama-server writes a slot's state on its main loop: while it does, no other
                # slot generates. So a pause saves only while no other slot runs a request.
                while any(o.busy for o in self.placement.slots.values() if o is not s):
                    await asyncio.sleep(OTHERS_BUSY_S)
                wait = await self._save(s, v, capped=True, why="idle")
                if wait is None:
                    return
                self.ctx.counters.idle_saves_deferred += 1
                await asyncio.sleep(wait)  # the cap: tried again in this pause, if it lasts
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug must not end the loop's other work
            log.exception("auto sessions: slot %d: save while idle: %s", s.id, e)

    def switching(self, s: Slot) -> bool:
        """Whether slot s ended another conversation than its last within idle_save_switched_s
        (0: always true): only such a slot's conversation may be switched away soon."""
        window = self.ctx.cfg.idle_save_switched_s
        at = self._switched_at.get(s.id)
        return window <= 0 or (at is not None and time.monotonic() - at <= window)

    # -- save now --------------------------------------------------------------------------
    async def save_now(self, capped: bool = False) -> list[dict[str, Any]]:
        """Save every idle slot's conversation that is worth a save now (its file lacks
        idle_save_min_new_tokens of it), one after another, without waiting for a pause; a
        slot that is taken is left alone. capped: within the cap on bytes per minute (a slot
        over it is left for later). → per slot: {"slot", "saved": dict or None, "why": str}."""
        out = []
        for s in sorted(self.placement.slots.values(), key=lambda x: x.id):
            result = TurnResult(key=s.view.key, slot=s.id)
            wait = await self._save(s, None, capped, "now", result)
            why = "" if result.saved else (f"over the cap: {wait:.0f} s until it fits" if wait is not None else
                                           "; ".join(result.skipped + result.errors) or "nothing to save")
            out.append({"slot": s.id, "saved": result.saved, "why": why})
        return out

    # -- one save --------------------------------------------------------------------------
    async def _save(self, s: Slot, v: View | None, capped: bool, why: str,
                    result: TurnResult | None = None) -> float | None:
        """Save slot s's conversation if it is worth it and the slot is free: v, the view its
        pause began with (None: whatever it holds now). → seconds until the cap lets it go
        (deferred), or None: done (saved, or nothing to do)."""
        ctx = self.ctx
        result = result if result is not None else TurnResult(key=s.view.key, slot=s.id)
        if self._closed or not self._worth(s, v, result):
            return None
        need = ctx.store.estimate_bytes(s.view.n_tokens or 0) or 0
        wait = self._over_cap(need) if capped else None
        if wait is not None:
            return wait
        async with self._one:
            ticket = self.placement.try_admit(s)
            if ticket is None:
                result.skipped.append("the slot is taken: a request holds or waits for it")
                return None  # give way: this pause saves nothing
            self._saving.add(s.id)
            try:
                if not await self.observer.observe(s, result) or not self._worth(s, v, result):
                    return None
                step, outcome = await self.saver.save_if_worth(s, Occasion.IDLE, None, result)
                if isinstance(step, Skip):
                    skipped(ctx.counters, step, result)
            finally:
                self._saving.discard(s.id)
                ticket.release()
        if isinstance(step, Save) and outcome is SaveOutcome.SAVED and result.saved is not None:
            n_bytes = int(result.saved.get("bytes") or 0)
            self._written.append((time.monotonic(), n_bytes))
            ctx.counters.idle_saves += 1
            ctx.counters.bytes_saved_idle += n_bytes
            log.info("auto sessions: slot %d: saved while idle (%s): %s in %.0f ms", s.id, why,
                     fmt_bytes(n_bytes), result.saved.get("ms") or 0.0)
        return None

    def _worth(self, s: Slot, v: View | None, result: TurnResult) -> bool:
        """Still the pause's state (no request since), a conversation at rest, past the
        threshold of new tokens since its file was written."""
        now = s.view
        if v is not None and now is not v and not (now.phase is v.phase and now.key == v.key
                                                    and now.n_tokens == v.n_tokens and now.messages == v.messages):
            return False  # a request ran since the pause began (a save of it only changes its file)
        held = now.conversation()
        if held is None or now.phase not in (Phase.HELD, Phase.RESTORED) or held.n_tokens is None:
            return False
        info = self.saver.held_info(now)
        new = held.n_tokens - (info.n_tokens if info is not None and info.model == self.ctx.model else 0)
        if new < max(1, self.ctx.cfg.idle_save_min_new_tokens) and info is not None:
            result.skipped.append(f"its file lacks {max(new, 0):,} of its tokens, under idle_save_min_new_tokens")
            return False
        return held.n_tokens >= max(1, self.ctx.min_tokens)

    def _over_cap(self, need: int) -> float | None:
        """None when a save of `need` bytes fits in the cap now; else seconds until it does."""
        cap = self.ctx.cfg.idle_save_mb_per_min * 1e6
        now = time.monotonic()
        while self._written and self._written[0][0] <= now - WINDOW_S:
            self._written.popleft()
        used = sum(b for _, b in self._written)
        if not self._written or used + need <= cap:
            return None
        # The oldest save that must leave the window for this one to fit.
        left = used + need - cap
        for at, n in self._written:
            left -= n
            if left <= 0:
                return max(0.05, at + WINDOW_S - now)
        return max(0.05, self._written[-1][0] + WINDOW_S - now)

    # -- life -----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """For status (read from a worker thread: plain values only; the counters say the rest)."""
        cfg = self.ctx.cfg
        return {"after_s": cfg.idle_save_s, "min_new_tokens": cfg.idle_save_min_new_tokens,
                "mb_per_min": cfg.idle_save_mb_per_min, "switched_s": cfg.idle_save_switched_s,
                "switching_slots": sorted(s.id for s in list(self.placement.slots.values()) if self.switching(s)),
                "pausing": len(self._pauses),
                "on": cfg.auto_sessions and cfg.idle_save_s > 0 and not self.launch.active}

    def close(self) -> None:
        """No more pauses (the stop): those waiting end now; a save under way runs to its end
        (it holds the slot's ticket, which the stop waits for)."""
        self._closed = True
        for sid, task in list(self._pauses.items()):
            if sid not in self._saving:
                task.cancel()
