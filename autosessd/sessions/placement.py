"""Tickets: one FIFO per engine slot, and where a conversation's request is placed.

Whatever runs a turn, a request, a save or a restore on a slot holds that slot's ticket
until the engine is done with it; calls that change a slot take the ticket, not a slot id.
Invariants:

  * one ticket per slot at a time; each slot's waiters are served in arrival order, and a
    waiter whose slot is busy keeps its place while later waiters take other slots;
  * a conversation never runs on two slots at once: its requests wait for the slot that
    holds it (held, restored, running, or just placed there);
  * `admit_all` takes every slot in id order (no deadlock: nothing else waits for a second
    slot); `try_admit` is the only way to take a second slot while holding one, and it never
    waits.

Placement: the slot that holds the conversation; otherwise the least recently used free
slot, one holding nothing worth keeping (below min tokens) first, so a request without a
conversation never displaces a long one while another slot is free. A request without a
conversation key (a raw /completion prompt: a client such as a text-completion frontend
sends its whole chat as one prompt, growing each turn) goes to the free slot whose last
keyless prompt shares the most with its own, more than a tenth of it, as llama-server picks
a slot by prompt similarity; pinned to the least recently used one instead, it would read
its prompt again on every other turn.
"""

from __future__ import annotations

import array
import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from .slot import Slot

log = logging.getLogger("autosessd")


PROMPT_KEPT = 1 << 18  # characters (or token ids) of a keyless prompt compared


def keyless_prompt(body: Any) -> str | bytes | None:
    """The prompt of a raw completion request (a string, or one list of token ids, packed as
    4-byte ints so that comparing two is a memcmp), its first PROMPT_KEPT characters or
    tokens: what placement compares. None for anything else."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, str) and prompt:
        return prompt[:PROMPT_KEPT]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        try:
            return array.array("i", prompt[:PROMPT_KEPT]).tobytes()
        except OverflowError:
            return None
    return None


def shared_length(a: str | bytes | None, b: str | bytes) -> int:
    """How long a prefix two prompts of one kind share (0 for prompts of two kinds): a binary
    search over slices, each comparison at C speed (in characters, or bytes of token ids)."""
    if a is None or type(a) is not type(b):
        return 0
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Ticket:
    """A place in one slot's FIFO, from Placement.admit() or place(). Release is safe twice,
    so every path out of a request (delivered, failed, cancelled, settled later) may call it."""

    def __init__(self, placement: Placement, slot: Slot):
        self._placement = placement
        self._slot = slot
        self._released = False
        self._then: list[Callable[[], None]] = []

    @property
    def slot_id(self) -> int:
        return self._slot.id

    @property
    def active(self) -> bool:
        return not self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._placement._release(self._slot, self)
            for then in self._then:
                then()

    def then(self, fn: Callable[[], None]) -> None:
        """fn() once the ticket is released (a router's count of a model's requests in flight);
        at once if it was."""
        if self._released:
            fn()
        else:
            self._then.append(fn)

    async def __aenter__(self) -> Ticket:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.release()


@dataclass(eq=False)
class _Waiter:
    """A request for a ticket: a given slot (`want`), or a placement for conversation `key`
    (None: a request without one)."""

    future: asyncio.Future
    want: int | None
    key: str | None
    prompt: str | bytes | None = None  # a keyless request's prompt (keyless_prompt)


class Placement:
    def __init__(self, default_slot: int, min_tokens: Callable[[], int]):
        """min_tokens: the running config's auto_sessions_min_tokens (a reload changes it)."""
        self.slots: dict[int, Slot] = {}
        self._default = default_slot
        self._min_tokens = min_tokens
        self._waiters: list[_Waiter] = []  # for tickets, in arrival order
        self._idle_waiters: list[asyncio.Future] = []  # fifos_free
        # Called with the slot when its ticket is released (launch.py drops the ticket's hold).
        self.on_release: list[Callable[[Slot], None]] = []
        # Called with a conversation's key when its request has to wait for a busy slot: the
        # time to warm its file (warm.py) before its turn restores it.
        self.on_wait: list[Callable[[str], None]] = []
        self.slot()

    def slot(self, slot_id: int | None = None) -> Slot:
        sid = self._default if slot_id is None else slot_id
        if sid not in self.slots:
            self.slots[sid] = Slot(sid)
        return self.slots[sid]

    def add_slots(self, n: int) -> None:
        """The engine runs n slots (0..n-1): all of them are driven."""
        for sid in range(n):
            self.slot(sid)

    def slot_of(self, ticket: Ticket) -> Slot:
        """The slot a ticket holds; a ticket that was released holds none."""
        s = self.slot(ticket.slot_id)
        if s.owner is not ticket or not ticket.active:
            raise RuntimeError(f"slot {s.id}: the call needs the slot's ticket, and this one was released")
        return s

    # -- taking tickets (each blocks on its slot's FIFO) --------------------------------
    async def admit(self, slot_id: int | None = None) -> Ticket:
        """Wait for one slot's FIFO (the configured slot by default)."""
        return await self._take(_Waiter(asyncio.get_running_loop().create_future(), self.slot(slot_id).id, None))

    async def place(self, key: str | None, prompt: str | bytes | None = None) -> Ticket:
        """Choose the slot for a request of conversation `key` and wait for its FIFO. prompt:
        a keyless request's prompt (keyless_prompt), for the slot that shares the most of it."""
        if len(self.slots) <= 1:  # the one slot, its FIFO; the key for on_wait
            return await self._take(_Waiter(asyncio.get_running_loop().create_future(), self.slot(None).id, key))
        like = prompt if key is None else None
        return await self._take(_Waiter(asyncio.get_running_loop().create_future(), None, key, like))

    async def admit_all(self) -> list[Ticket]:
        """Every slot's FIFO, in slot order. For a request the engine places itself (embeddings
        and rerank cannot be pinned to a slot)."""
        tickets: list[Ticket] = []
        try:
            for sid in sorted(self.slots):
                tickets.append(await self.admit(sid))
        except BaseException:
            for t in tickets:
                t.release()
            raise
        return tickets

    def try_admit(self, s: Slot) -> Ticket | None:
        """The slot's ticket if it is free now and nobody waits for it; never waits."""
        if s.busy or any(w.want == s.id for w in self._waiters):
            return None
        ticket = Ticket(self, s)
        s.owner, s.last_used = ticket, time.monotonic()
        return ticket

    async def fifos_free(self) -> None:
        """Until no ticket is held on any slot (a stop waits for this, bounded by its caller)."""
        while any(s.busy for s in self.slots.values()):
            waiter = asyncio.get_running_loop().create_future()
            self._idle_waiters.append(waiter)
            await waiter

    # -- the FIFOs -----------------------------------------------------------------------
    async def _take(self, w: _Waiter) -> Ticket:
        self._waiters.append(w)
        self._dispatch()
        if w.key is not None and not w.future.done():
            for hook in self.on_wait:
                try:
                    hook(w.key)
                except Exception as e:  # a hook's bug must not leave the waiter in the FIFO for ever
                    log.exception("auto sessions: while %s waits for a slot: %s", w.key, e)
        try:
            return await w.future
        except asyncio.CancelledError:
            if w in self._waiters:
                self._waiters.remove(w)
            elif w.future.done() and not w.future.cancelled():
                w.future.result().release()  # handed out as we were cancelled: give it back
            raise

    def _dispatch(self) -> None:
        """Hand free slots to waiters in arrival order; a waiter whose slot is busy keeps its
        place, and later waiters may take other slots meanwhile (each slot stays FIFO)."""
        for w in list(self._waiters):
            if w.future.done():
                self._waiters.remove(w)
                continue
            s = self._choose(w)
            if s is None:
                continue
            self._waiters.remove(w)
            ticket = Ticket(self, s)
            s.owner, s.placing, s.last_used = ticket, w.key, time.monotonic()
            s.keyless_prompt = w.prompt  # whatever else takes the slot replaces what it holds
            w.future.set_result(ticket)

    def _choose(self, w: _Waiter) -> Slot | None:
        if w.want is not None:
            s = self.slot(w.want)
            return None if s.busy else s
        if w.key is not None:
            own = next((s for s in self.slots.values() if s.has(w.key)), None)
            if own is not None:
                return None if own.busy else own
        free = [s for s in self.slots.values() if not s.busy]
        if not free:
            return None
        if w.prompt is not None:
            n, _, _, alike = max((shared_length(s.keyless_prompt, w.prompt), s.last_used, -s.id, s) for s in free)
            if n * 10 > len(w.prompt):
                return alike
        min_tokens = self._min_tokens()

        def worth_keeping(s: Slot) -> bool:
            held = s.view.conversation()
            return held is not None and (held.n_tokens is None or held.n_tokens >= min_tokens)

        return min(free, key=lambda s: (worth_keeping(s), s.last_used, s.id))

    def _release(self, s: Slot, ticket: Ticket) -> None:
        if s.owner is not ticket:
            return
        for hook in self.on_release:
            hook(s)
        s.owner, s.placing = None, None
        for waiter in self._idle_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._idle_waiters.clear()
        self._dispatch()
