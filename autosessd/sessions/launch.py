"""When the engine may be made to start a request: only on an engine that empties idle slots.

llama-server's defaults for -np auto (a unified KV cache with --cache-idle-slots) move every
idle slot to the engine's RAM prompt cache, and empty it, whenever a request starts on any
slot. `Launch.active` names that mode (it needs several slots); outside it every call here
returns at once and requests start side by side. Inside it:

  * no start between a restore (or a prefix read) and its own request, nor between a
    request's end and its end save: both hold NO_STARTS;
  * a request pinned to an empty slot never looks in the engine's RAM cache, where the
    emptied slots went (llama.cpp 28139). So a request whose conversation the engine may
    hold goes ALONE (no other start in flight until it is placed), and when its slot is
    empty by then it gets the primer first (a one-token state no prompt starts with: the
    engine then replaces it with the cached prompt sharing most with the request);
  * a new conversation starts SIDE_BY_SIDE with others: the cache has nothing of it. A
    request without a key (a raw /completion prompt) may be anyone's: it goes ALONE.

A start is "in flight" from before_send until the engine shows it placed (a new task id on
its slot, watched by sent()), or, going alone, until the engine has taken it in. Every
start autosessd knows of — a gate request the engine placed, a request it placed itself
(ran_unplaced), a prefill of autosessd's own — is counted once, by count_start (the only
writer of `starts`): the turn's look remembers `starts`, and a start counted since then
means the slot was emptied behind the look. (The hook's and the tail's requests are not
sent by autosessd and are not counted: the hook cannot promise what this module keeps.) Engine calls that start something (the primer's and a prefix's
prefill) go through prefill() here, which counts them.

Each hold belongs to one slot's ticket (Slot.launch_hold) and is released exactly once: when
the request is seen placed (sent), at its end (ended), or at the ticket's release (released)
for a request that never got to start. The end save's NO_STARTS is held by the end itself
(end_save_hold), not recorded on the slot. Lock order: a ticket first, then this gate.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from enum import Enum
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

from ..base import files
from ..engines.base import EngineError, PrefillResult, SlotState
from ..store.directory import TEMP_PREFIX
from .slot import Phase, Slot, View

if TYPE_CHECKING:
    from .context import Context
    from .placement import Ticket

log = logging.getLogger("autosessd")

RAN_KEPT = 10_000  # conversations remembered as possibly in the engine's RAM cache


class Hold(Enum):
    SIDE_BY_SIDE = "side by side"  # a start: many may be in flight at once (sent, not yet seen running)
    ALONE = "alone"  # a start that needs its slot as it left it until it runs: no other start meanwhile
    NO_STARTS = "no starts"  # a restore until its request started, an end save: no start at all meanwhile


class LaunchGate:
    """The three holds of the module docstring. NO_STARTS waiters go first: no new start is
    sent while one waits, or an end save would find its slot emptied by the starts queued
    behind it; ALONE waiters go before new SIDE_BY_SIDE starts."""

    def __init__(self) -> None:
        self.side_by_side = 0
        self.alone = False
        self.no_starts = False
        self.no_starts_waiting = 0
        self.alone_waiting = 0
        self._waiters: list[asyncio.Future] = []

    async def acquire(self, hold: Hold) -> None:
        if hold is Hold.SIDE_BY_SIDE:
            while self.no_starts or self.alone or self.no_starts_waiting or self.alone_waiting:
                await self._wait()
            self.side_by_side += 1
        elif hold is Hold.ALONE:
            self.alone_waiting += 1
            try:
                while self.no_starts or self.alone or self.side_by_side or self.no_starts_waiting:
                    await self._wait()
            finally:
                self.alone_waiting -= 1
            self.alone = True
        else:
            self.no_starts_waiting += 1
            try:
                while self.no_starts or self.alone or self.side_by_side:
                    await self._wait()
            finally:
                self.no_starts_waiting -= 1
            self.no_starts = True

    def release(self, hold: Hold) -> None:
        if hold is Hold.SIDE_BY_SIDE:
            self.side_by_side -= 1
        elif hold is Hold.ALONE:
            self.alone = False
        else:
            self.no_starts = False
        for f in self._waiters:
            if not f.done():
                f.set_result(None)
        self._waiters.clear()

    async def _wait(self) -> None:
        f = asyncio.get_running_loop().create_future()
        self._waiters.append(f)
        try:
            await f
        finally:
            if f in self._waiters:
                self._waiters.remove(f)


class Primer:
    """The one-token state put into an emptied slot before a request pinned there: the newline
    after BOS, which no prompt starts with. Saved once into the session directory
    (`.autosessd-primer.partial`, gone at stop) and restored from then on. The engine's RAM
    cache keeps it at most once (it stores no entry that one it holds contains), and a request
    shares nothing with it, so the engine replaces it with the cached prompt sharing the most
    with the request. Off for a model whose tokenizer adds no BOS (a prompt could start with
    the newline), and after a failure to make it. Like every file handed to the engine, it is
    restored only while it is the file the engine wrote (its size checked when made, its
    lstat before each restore; otherwise it is made again): llama-server aborts on a short one."""

    NAME = f"{TEMP_PREFIX}primer.partial"

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.name: str | None = None  # made: restore it
        self.ident: files.Ident | None = None  # its lstat once made and checked
        self.off = False

    async def put(self, slot_id: int, prefill: Callable[[int, list[int]], Awaitable[PrefillResult]]) -> bool:
        """Fill the (empty, held exclusively) slot with the primer; False when it is off."""
        engine, chat = self.ctx.engine, self.ctx.chat
        if self.name is not None and files.regular_ident(self.ctx.store.staging / self.name) != self.ident:
            log.warning("auto sessions: the primer %s changed since it was made (or is gone): made again", self.name)
            self.drop()
        if self.name is not None:
            try:
                await engine.restore(slot_id, self.name)
                return True
            except EngineError as e:
                # A full KV cache, an engine that restarted with another model, a file gone:
                # make it again on this slot (a failed restore leaves the slot empty).
                log.info("auto sessions: slot %d: restoring the primer: %s; making it again", slot_id, e)
                self.drop()
        path = self.ctx.store.staging / self.NAME
        try:
            if chat is None:
                raise EngineError("the engine cannot read a prompt into a slot")
            tokens = await chat.tokenize("\n")
            other = await chat.tokenize("x")
            if len(tokens) < 2 or len(other) < 2 or tokens[0] != other[0]:
                self.off = True
                log.info("auto sessions: no primer: the model adds no BOS token (tokens for a newline: %s), so a "
                         "prompt may start with any token; requests to slots the engine emptied read their prompts "
                         "again", tokens)
                return False
            await prefill(slot_id, tokens[1:2])
            res = await engine.save(slot_id, self.NAME)
            if res.n_tokens != 1:
                raise EngineError(f"the engine saved {res.n_tokens} tokens, not 1")
            ident = files.regular_ident(path)
            if ident is None or ident.size != res.n_bytes:  # a full disk: a short file aborts the engine
                raise EngineError(f"{self.NAME} is not the {res.n_bytes:,} bytes the engine reported writing")
        except EngineError as e:
            self.off = True
            path.unlink(missing_ok=True)
            log.warning("auto sessions: no primer (%s): requests to slots the engine emptied read their prompts "
                        "again", e)
            return False
        with contextlib.suppress(OSError):
            os.chmod(path, self.ctx.store.mode)  # the engine wrote it
        self.name, self.ident = self.NAME, files.regular_ident(path)  # after the chmod: its ctime
        log.info("auto sessions: primer %s made (one token): a request pinned to a slot the engine emptied is "
                 "served from the engine's RAM prompt cache, as it would be without autosessd", self.NAME)
        return True

    def drop(self) -> None:
        if self.name is not None:
            with contextlib.suppress(OSError):
                (self.ctx.store.staging / self.name).unlink(missing_ok=True)
            self.name = self.ident = None


class Launch:
    def __init__(self, ctx: Context, slots: dict[int, Slot], empties_idle: bool = False):
        """empties_idle: the start's probe saw the engine empty idle slots. look (set by the
        facade): the engine's GET /slots for one slot (observe.py)."""
        self.ctx = ctx
        self.slots = slots
        self.look: Callable[[Slot], Awaitable[SlotState | None]] | None = None
        self.gate = LaunchGate()
        self.primer = Primer(ctx)
        # Seen: the engine empties idle slots (unified KV + --cache-idle-slots); the start's
        # probe says so, or the first slot found emptied without a task of its own.
        self.empties_idle = empties_idle
        self._starts = 0  # requests the engine placed (count_start)
        # Conversations that ran since the engine started: its RAM cache may hold them.
        self._ran: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._watches: set[asyncio.Task] = set()

    @property
    def active(self) -> bool:
        """The engine empties every idle slot whenever a request starts on any of several."""
        return self.empties_idle and len(self.slots) > 1

    @property
    def starts(self) -> int:
        return self._starts

    def count_start(self) -> None:
        """The engine placed a request (seen running or ended, a prefill, an unplaced one): it
        emptied the other idle slots. The only writer of `starts`."""
        self._starts += 1

    async def prefill(self, slot_id: int, tokens: list[int]) -> PrefillResult:
        """Read tokens into a slot: a start like any request, counted."""
        assert self.ctx.chat is not None
        res = await self.ctx.chat.prefill(slot_id, tokens)
        self.count_start()
        return res

    # -- the turn's look ---------------------------------------------------------------
    def before_look(self, s: Slot) -> tuple[int, bool]:
        return self._starts, self._start_pending_besides(s)

    @staticmethod
    def looked(s: Slot, before: tuple[int, bool], st: SlotState | None) -> None:
        """The turn's look at the engine's slot, with what came before it (before_look)."""
        s.looked = (*before, st)

    @staticmethod
    def forget_look(s: Slot) -> None:
        """A turn begins: an earlier look (a command's) says nothing of its request."""
        s.looked = None

    def saw_empties_idle(self) -> bool:
        """A slot was found emptied without a task of its own; True when that is news."""
        if self.empties_idle or len(self.slots) <= 1:
            return False
        self.empties_idle = True
        return True

    def _start_pending_besides(self, s: Slot) -> bool:
        """A request on another slot was sent and not yet seen placed: placed, it empties s."""
        return any(o.start_pending for o in self.slots.values() if o is not s)

    # -- a request's start ---------------------------------------------------------------
    async def before_send(self, s: Slot) -> None:
        """Blocks on the gate: while a restore or an end save elsewhere needs the engine to
        start nothing else; going alone, while other starts are in flight. Then the request's
        start is in flight (pending until the engine shows it placed)."""
        looked, s.looked = s.looked, None
        await self._hold_starts(s, looked)
        s.start_pending = True  # sent right after this: pending until the engine shows it placed

    async def _hold_starts(self, s: Slot, looked: tuple[int, bool, SlotState | None] | None) -> None:
        if not self.active or s.launch_hold:
            return  # s.launch_hold: a restore holds the engine's starts, and its slot holds the state
        v = s.view
        switched = v.phase is Phase.SWITCHED
        key = v.key if switched else None
        prior = v.prior if switched else None
        here = key is not None and prior is not None and prior.key == key and prior.phase in (Phase.HELD,
                                                                                              Phase.RESTORED)
        # A request without a key (a raw /completion prompt) may be in the engine's RAM cache
        # as much as any: alone, without the primer on an emptied slot, it would never look.
        maybe_cached = (here or key in self._ran) if key is not None else switched
        if self.primer.off or looked is None or not maybe_cached:
            await self.gate.acquire(Hold.SIDE_BY_SIDE)
            s.launch_hold = Hold.SIDE_BY_SIDE
            return
        await self.gate.acquire(Hold.ALONE)
        s.launch_hold = Hold.ALONE
        if not s.ending(key):
            return  # lost while it waited (the engine restarted): nothing of it to keep or prime
        starts, pending, st = looked
        # A start placed since the turn's look, or one sent and not yet seen placed (it goes
        # before this one: the engine places its queue in order), empties this idle slot.
        emptied = starts != self._starts or pending or self._start_pending_besides(s)
        if not emptied:
            if st is None or st.is_processing or st.n_tokens:
                return
            if st.task_id is None and not (prior is not None and prior.never_ran):
                return  # a slot that never ran shows no count: it may hold a state a client restored
        # What the request starts from: nobody's (should it not run, nothing here is saved).
        s.note(prior=View(Phase.UNKNOWN, n_tokens=None, why="holds the primer"))
        try:
            primed = await self.primer.put(s.id, self.prefill)
        except Exception as e:  # the request goes on, unprimed
            log.exception("auto sessions: slot %d: priming: %s", s.id, e)
            primed = False
        if primed:
            self.ctx.counters.primed += 1

    def sent(self, ticket: Ticket, s: Slot, bound_s: float = 2.0) -> asyncio.Task | None:
        """The request was sent (or is about to be, this very step): its hold on the starts
        ends once the engine shows it running on its slot (a new task id), or after bound_s.
        Runs as a task of its own; safe to call for any ticket.

        A start that goes alone needs only to be in the engine's task queue before the next
        one: the engine places queued requests in order, so the next one's start no longer
        empties this slot. The engine places requests only between its batches (seconds apart
        while it reads a long prompt), so such a hold ends after the time the engine takes to
        take a request in: 50 ms and 4 µs a token (its /tokenize runs at ~2.5 µs a token
        here; 25,000 tokens assumed when the prompt's are not known, 0.15 s). Should that not
        do, the request reads its prompt again, as without the primer. Whether it was placed
        is still watched (_until_placed): until then, other starts count this slot's
        neighbours as emptied."""
        if not s.launch_hold:
            return None
        task = asyncio.get_running_loop().create_task(self._sent(ticket, s, bound_s))
        self._watches.add(task)
        task.add_done_callback(self._watches.discard)
        return task

    async def _sent(self, ticket: Ticket, s: Slot, bound_s: float) -> None:
        if s.launch_hold is Hold.ALONE:
            tokens = s.view.tokens
            n = len(tokens) // 4 if tokens else 25_000
            bound_s = min(bound_s, 0.05 + 4e-6 * n)
        watch = asyncio.get_running_loop().create_task(self._until_placed(ticket, s))
        try:
            await asyncio.wait({watch}, timeout=bound_s)
        finally:
            if s.owner is ticket and s.launch_hold:
                self.gate.release(s.launch_hold)
                s.launch_hold = None
            if not watch.done():
                if s.owner is ticket:
                    s.place_watch = watch  # it goes on: until the engine shows the request, or its end
                else:
                    watch.cancel()  # the ticket went (its release cancels a watch it knows of)

    async def _until_placed(self, ticket: Ticket, s: Slot, limit_s: float = 60.0) -> None:
        before = s.task_id
        deadline = time.monotonic() + limit_s
        # Until the request is seen running or ended (ended() confirms it) or its ticket went.
        while s.owner is ticket and s.start_pending and time.monotonic() < deadline:
            st = await self.look(s) if self.look is not None else None
            if st is None:
                return
            if st.is_processing and st.task_id != before:
                self._placed(s)
                return
            await asyncio.sleep(0.01)

    def _placed(self, s: Slot) -> None:
        """The engine placed s's request: it emptied every other idle slot."""
        if s.start_pending:
            s.start_pending = False
            self.count_start()

    # -- a request's end, a ticket's release ---------------------------------------------
    def ended(self, s: Slot, key: str | None, status: str, ours: bool) -> None:
        """The request of `key` ended with `status`. ours: it is the request the slot runs
        (its view is SWITCHED to it): its start is no longer in flight (it ran, or it never
        will), so its hold goes, and the end save takes the gate itself."""
        if ours:
            if s.launch_hold:
                self.gate.release(s.launch_hold)
                s.launch_hold = None
            if s.start_pending:
                if status in ("ok", "cancelled", "error"):
                    self._placed(s)
                s.start_pending = False  # a request refused or never sent empties nothing
        if key is not None and status in ("ok", "cancelled", "error"):
            self._ran[key] = None
            self._ran.move_to_end(key)
            if len(self._ran) > RAN_KEPT:
                self._ran.popitem(last=False)

    def released(self, s: Slot) -> None:
        """Its ticket was released (Placement.on_release): a hold its request never used goes."""
        if s.launch_hold:  # its request never got to start (not forwarded, cancelled)
            self.gate.release(s.launch_hold)
            s.launch_hold = None
        s.start_pending = False
        if s.place_watch is not None:
            s.place_watch.cancel()
            s.place_watch = None

    # -- holds for work on a slot ----------------------------------------------------------
    async def no_starts(self, s: Slot) -> None:
        """Before a restore or a prefix read into slot s (its ticket held): no other request
        starts until s's own has (sent, or the ticket's release)."""
        if self.active and s.owner is not None and not s.launch_hold:
            await self.gate.acquire(Hold.NO_STARTS)
            s.launch_hold = Hold.NO_STARTS

    @contextlib.asynccontextmanager
    async def end_save_hold(self, needed: bool) -> AsyncIterator[None]:
        """Around an end and its save: the next start on any other slot would empty this one."""
        if not needed:
            yield
            return
        await self.gate.acquire(Hold.NO_STARTS)
        try:
            yield
        finally:
            self.gate.release(Hold.NO_STARTS)

    def engine_restarted(self) -> None:
        self.primer.drop()  # the engine's: made again, by the new one, when next needed
        self.primer.off = False
        self._ran.clear()  # its RAM cache is gone

    def close(self) -> None:
        """At stop: the watches of starts still in flight end; the primer goes."""
        for task in list(self._watches):
            task.cancel()
        self.primer.drop()
