"""Owns what each engine slot holds, and applies the turn (policy.py) through the engine and the store.

What a slot holds is one state machine per slot (STYLE §13). Only this module moves it;
the gate, the tail and the control socket report what they saw through the methods below.

    EMPTY     holds nothing: a slot that never ran, or one a failed restore cleared
    SWITCHED  a request of `key` (None: a request without a conversation) was let
              through and its end is not seen yet; `prior` is what the slot held before
    HELD      holds conversation `key`, n_tokens of it (the engine's count); durable,
              or provisional after a cancelled request (a partial state)
    RESTORED  holds auto-<key>.bin as the engine restored it; the next response's
              timings.cache_n verifies that the engine reused it
    UNKNOWN   may hold anything (the engine restarted, a request or slot action that
              bypassed the FIFO, a person's file restored by hand, a request without a
              conversation): never saved under a key

Transitions (method → new state):

    turn(K)           save the held conversation if worth it, restore the file its tokens
                      choose (RESTORED, or EMPTY when the restore failed), maybe read a
                      shared prefix on its own (HELD: the prefix), then switched_to(K)
    switched_to(K)    → SWITCHED(K, prior = the state the request starts from)
    ended(ok)         → HELD(K, the engine's count, durable), and a RESTORED prior is verified
    ended(cancelled)  → HELD(K, provisional), or prior when the engine's slot did not change
    ended(error)      → prior when the engine's slot did not change (a rejected request holds
                        nothing new), otherwise UNKNOWN
    ended(not_run)    → prior (the request never reached the engine)
    a request without a conversation that ran → UNKNOWN
    _observe at the next turn: a SWITCHED whose end was not seen (turn hook: the serving
                      layer runs one request at a time) is settled as ended; a task the
                      engine ran that we did not let through, or another token count → lost
    lost(why)         → UNKNOWN

How the engine's truth is read: the token count from its save/restore answers and from
GET /slots (`n_prompt_tokens`), a request that bypassed the FIFO from the slot's task id
(`id_task`), a restore's reuse from `timings.cache_n` (gate), a request-log line's
`cache_n`, or GET /slots while the request runs (turn hook, tail: llama-server resets the
slot's counters when a request ends). An engine that hides its slots (--no-slots) leaves
counts to the responses and cannot show requests that bypass the gate.

Ordering, per engine slot:

    ticket = await sessions.admit(slot)     # the slot's FIFO: one turn + request at a time
    result = await sessions.turn(ticket, key, body=chat)   # save held → restore; never raises
    ... the request runs on the engine ...
    await sessions.ended(ticket.slot_id, key, status, ...)
    ticket.release()                        # safe twice

Every request that can touch a slot's KV passes its FIFO; one without a conversation
skips the restore, not the queue. The save must finish before the restore: both target
the same slot, and the restore replaces the state the save reads. asyncio.Lock wakes
waiters in FIFO order, so requests run in the order they arrived. A save returns to the
turn as soon as the engine has written the temporary and its size and header checked
out; the fsync/rename/metadata (store.finalize) runs in a worker thread off the
request's path, and a later restore or save of the same key waits for it.

Starts, on an engine that empties every idle slot whenever a request starts (a unified KV
cache with --cache-idle-slots: llama-server's defaults for -np auto). No start may come
between a restore and its request, nor between a request's end and its save (LaunchGate,
exclusive). A request pinned to an empty slot never looks in the engine's RAM cache, where
the emptied slots went (llama.cpp 28139): one whose conversation the engine may hold goes
alone, and an empty slot gets the primer first (may_launch, _prime).

Files by their tokens (DESIGN §9, issue 11). A turn with an OpenAI chat body asks the
engine for the request's tokens unless the request goes on from the held one (same key,
the held request's messages first: View.messages), and then

    save      the held conversation, named by its header's tokens (index.save_key): its
              line's file when it extends or replaces it, a branch name when another
              conversation of the same opener holds that file, nothing when a file holds it
              all already. Same key but tokens that depart (Occasion.BRANCH) is a switch too.
    restore   index.best: the file sharing the longest prefix with the request, if it shares
              min_tokens more than the slot already does (View.tokens); never by name
    prefix    a new conversation whose system prompt and tools reach min_tokens and which no
              file holds: read them on their own and save them as a prefix file (_split)

Without tokens (other APIs, images, the tail, a hook sending a key, an engine that cannot
tokenize) the key rule of DESIGN §1 decides, as before.

The shared bucket ([shared], DESIGN §9: shared.py is the tier, remote.py its catalog). An auto
file whose finalize succeeded (a conversation, a branch, a prefix; never a person's parked
name) is queued for upload, under its final name. At a restore, when nothing local is good
enough, the catalog is asked — no request to the bucket on the turn's path:

    by tokens the bucket's save sharing min_tokens more than the slot and the best local
              file (policy.plan_fetch_by_tokens); a save whose local copy is as new is skipped
    by key    its save of auto-<key>.bin when the local one is missing, unusable, or older
              and min_tokens shorter (policy.plan_fetch_by_key)

then the estimate (the measured download rate against the engine's prompt rate, a moving
average of timings.prompt_per_second) decides whether the download beats re-reading what
it adds. A download is claimed in Store.in_use from before it starts until the restore has
read the file (no prune removes it, no other download replaces it), indexed, and restored
as a local file is, verified by cache_n. One that fails or runs past download_timeout_s
leaves nothing under its name, and the turn goes on as if there were no bucket.

Every failure is caught here, logged as `auto sessions: <what>: <why>`, counted, and
turned into "do nothing": the request then runs exactly as it would without autosessd.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from urllib.parse import urlsplit

import psutil
from typing import Any, Awaitable, Callable

from . import __version__, gguf, policy, slotfile
from .config import Config
from .engines.base import Engine, EngineError, EngineRefused, SlotsHidden, SlotState
from .index import SavedFile, TokenIndex, common_prefix, comparable, decode, encode, prefix_key, save_key
from .keys import chat_signature, continues
from .policy import Fetch, FileInfo, Held, Occasion, Restore, RestoreFile, Save, SaveOutcome, Skip
from .remote import Remote
from .shared import AlreadyHere, Incompatible, RemoteSession, SharedError
from .store import AUTO_BIN, TEMP_PREFIX, Meta, Store, StoreError, auto_name, manual_name, temp_name

log = logging.getLogger("autosessd")

# Causes reported when a restore was not reused, most likely first.
NOT_REUSED_CAUSE = ("the engine did not reuse the restored state: a sliding-window model (Gemma 2/3, ...) "
                    "run without --swa-full, or a prompt that no longer starts with the saved conversation")
NO_KV_ROOM = "No available space in KV cache"  # llama-server's answer to a restore that does not fit
WATCH_EVERY_S = 0.025  # GET /slots while a request whose restore awaits verification runs (hook, tail)


_MARKERS = re.compile(r"<\|?[A-Za-z_][A-Za-z0-9_]*\|?>|\[/?INST\]|<<SYS>>|<</SYS>>")


def first_words(text: str, max_chars: int = 72) -> str:
    """A file's first tokens as a person reads them: the template's markers (`<bos>`,
    `<start_of_turn>`, `<|im_start|>`) left out, whitespace folded, cut at a word."""
    text = " ".join(_MARKERS.sub(" ", text).split())
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars].rsplit(" ", 1)[0] if " " in text[:max_chars] else text[:max_chars]
    return cut + " …"


def fmt_tokens(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def fmt_bytes(n: int) -> str:
    if n >= 100e6:
        return f"{n / 1e9:.2f} GB"
    if n >= 100e3:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e3:.1f} kB"


@dataclass
class Counters:
    turns: int = 0
    saves: int = 0
    restores: int = 0
    save_failures: int = 0
    restore_failures: int = 0
    skipped_min_tokens: int = 0
    skipped_no_file: int = 0
    skipped_model_mismatch: int = 0
    skipped_disk_full: int = 0
    skipped_engine_busy: int = 0
    saves_discarded: int = 0
    saves_missed: int = 0  # an engine that empties idle slots emptied one before its end could be saved
    restores_reused: int = 0
    restores_not_reused: int = 0
    restores_unverified: int = 0
    engine_resets: int = 0
    bytes_saved: int = 0
    bytes_restored: int = 0
    ms_saved: float = 0.0
    ms_restored: float = 0.0
    prefill_tokens_avoided: int = 0
    bad_log_lines: int = 0
    pruned_files: int = 0
    pruned_bytes: int = 0
    tokenized: int = 0  # turns that asked the engine for the request's tokens
    tokenize_failures: int = 0  # ... and got none (the key rule decided instead)
    restores_by_tokens: int = 0  # restores chosen by the tokens a file shares with the request
    saves_covered: int = 0  # saves dropped: a file already held the conversation and more
    saves_branched: int = 0  # conversations saved under a branch name (their opener's file is another one's)
    prefixes_saved: int = 0  # shared prefixes read on their own and saved (a new conversation's first request)
    fetched: int = 0  # saves downloaded from the shared bucket for a turn's restore
    fetch_failures: int = 0  # ... that failed or ran out of time (the request re-read its prompt)
    primed: int = 0  # requests pinned to an emptied slot that got the primer first (Sessions.may_launch)


class Phase(Enum):
    EMPTY = "empty"
    SWITCHED = "switched"
    HELD = "held"
    RESTORED = "restored"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class View:
    """What one slot holds, as far as autosessd knows (the module docstring has the states)."""

    phase: Phase
    key: str | None = None
    n_tokens: int | None = 0  # the engine's count; None when it cannot be read
    durable: bool = True
    restored: int | None = None  # RESTORED (and SWITCHED after it): tokens the engine should reuse, not yet verified
    prior: View | None = None  # SWITCHED: what the slot held when the request started
    why: str = ""  # UNKNOWN: how it came to be unknown
    # What the tokens say (issue 11); carried from SWITCHED to HELD when the request ran:
    # tokens    the start of what the slot holds, token for token (index.encode): all of it after
    #           a save or a restore, the prompt of the request that made it otherwise (not its reply)
    # messages  that request's chat signature (keys.chat_signature): a next request that goes on
    #           from it needs no tokens
    # file      the session file holding this conversation's latest saved state: what a save
    #           compares with (up to date?). RESTORED: the file restored
    # n_prompt  of n_tokens, the prompt of the last reply (a save records it: index.save_key)
    tokens: bytes | None = None
    messages: tuple[str, ...] | None = None
    file: str | None = None
    n_prompt: int | None = None

    def held(self) -> Held | None:
        """The conversation a save would write, when the slot holds one we can name."""
        if self.phase in (Phase.HELD, Phase.RESTORED) and self.key is not None:
            return Held(self.key, self.n_tokens, self.durable)
        return None

    @property
    def slot_tokens(self) -> int | None:
        """What GET /slots should show for this state, when we know it."""
        return 0 if self.phase is Phase.EMPTY else self.n_tokens if self.phase in (Phase.HELD, Phase.RESTORED) else None


UNKNOWN_AT_START = View(Phase.UNKNOWN, n_tokens=None, why="not seen since autosessd started")


@dataclass
class Slot:
    id: int
    view: View = UNKNOWN_AT_START
    holder: Ticket | None = None  # who has the slot's FIFO now (see Sessions._dispatch)
    placing: str | None = None  # the conversation a holder placed here, before its turn names it
    last_used: float = 0.0  # when a ticket was last handed out: the least recently used slot is taken first
    task_id: int | None = None  # the engine's id_task when we last looked: a new one means a request ran
    seen_cache_n: tuple[int, int] | None = None  # (task id, cache_n) read from GET /slots while it ran
    # The turn's look: (Sessions.starts before it, whether another slot's start was pending, what it saw)
    looked: tuple[int, bool, SlotState | None] | None = None
    start_pending: bool = False  # its request was sent, and not yet seen placed (running, or ended)
    place_watch: asyncio.Task | None = None  # ... what looks for it after its hold on the starts ended
    watcher: asyncio.Task | None = None
    holds_launch: str | None = None  # "shared" | "alone" | "exclusive": its ticket's hold on Sessions.launches

    @property
    def busy(self) -> bool:
        return self.holder is not None

    def holds(self, key: str) -> bool:
        """The conversation is on this slot: held, restored, running, or just placed here."""
        v = self.view
        return self.placing == key or (v.key == key and v.phase in (Phase.HELD, Phase.RESTORED, Phase.SWITCHED))


class LaunchGate:
    """When the engine may be made to start a request, for an engine that empties every idle
    slot whenever a request starts on any slot (a unified KV cache with --cache-idle-slots).

    Three kinds of hold:
      shared     a start: many may be in flight at once (sent, not yet seen running)
      alone      a start that needs its slot as it left it until it runs (a primed slot, or
                 one whose state the request reuses): no other start in flight meanwhile
      exclusive  a restore (until its own request has started) and the save of a
                 conversation whose request just ended: no start at all meanwhile
    Exclusive waiters go first: no new start is sent while one waits, or the end save would
    find its slot emptied by the starts queued behind it."""

    def __init__(self) -> None:
        self.shared = 0
        self.alone = False
        self.exclusive = False
        self.exclusive_waiting = 0
        self.alone_waiting = 0
        self._waiters: list[asyncio.Future] = []

    async def acquire(self, kind: str) -> None:
        if kind == "shared":
            while self.exclusive or self.alone or self.exclusive_waiting or self.alone_waiting:
                await self._wait()
            self.shared += 1
            return
        if kind == "alone":
            self.alone_waiting += 1
            try:
                while self.exclusive or self.alone or self.shared or self.exclusive_waiting:
                    await self._wait()
            finally:
                self.alone_waiting -= 1
            self.alone = True
            return
        self.exclusive_waiting += 1
        try:
            while self.exclusive or self.alone or self.shared:
                await self._wait()
        finally:
            self.exclusive_waiting -= 1
        self.exclusive = True

    def release(self, kind: str) -> None:
        if kind == "shared":
            self.shared -= 1
        elif kind == "alone":
            self.alone = False
        else:
            self.exclusive = False
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


class Ticket:
    """A place in one slot's FIFO, from Sessions.admit() or place(). Release is safe twice,
    so every path out of a request (delivered, failed, cancelled, settled later) may call it."""

    def __init__(self, sessions: Sessions, slot: Slot):
        self._sessions = sessions
        self._slot = slot
        self._released = False

    @property
    def slot_id(self) -> int:
        return self._slot.id

    @property
    def held(self) -> bool:
        return not self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._sessions._release(self._slot, self)

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


@dataclass(frozen=True)
class _Carry:
    """What a turn learned about the request it lets through (View.tokens, messages, file)."""

    tokens: bytes | None
    messages: tuple[str, ...] | None
    file: str | None


# Stands for the first user message's text when the template renders the part before it
# (Sessions._prefix_len): letters only, so that no template trims or escapes it.
SPLIT_MARK = "AutosessdPrefixEndsHere"


@dataclass
class TurnResult:
    key: str | None
    slot: int | None = None  # the slot the request runs on (pin it there when several)
    saved: dict[str, Any] | None = None
    restored: dict[str, Any] | None = None
    prefix: dict[str, Any] | None = None  # a shared prefix read and saved before the request
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)



class Events:
    """Recent events for `events`, and live followers. A follower that falls behind by
    more than its queue is dropped rather than slowing the daemon down."""

    def __init__(self, keep: int = 1000):
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self._followers: set[asyncio.Queue] = set()
        self._seq = 0

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        ev = {"seq": self._seq, "ts": round(time.time(), 3), "type": type_, **fields}
        self.recent.append(ev)
        for q in list(self._followers):
            try:
                q.put_nowait(ev)
            except asyncio.QueueFull:
                self._followers.discard(q)
                with contextlib.suppress(asyncio.QueueFull):
                    q.get_nowait()
                    q.put_nowait(None)  # None tells the follower it was dropped
        return ev

    @contextlib.contextmanager
    def follow(self, maxsize: int = 1000):
        q: asyncio.Queue = asyncio.Queue(maxsize)
        self._followers.add(q)
        try:
            yield q
        finally:
            self._followers.discard(q)




class _Claim:
    """A downloaded file's name held in Store.in_use from before its download until the
    restore that follows has read it. A download given up on (its time limit) keeps the name
    until its thread has ended: until then it may still rename a whole file into place."""

    def __init__(self, store: Store, name: str):
        self.store, self.name = store, name
        self.fut: asyncio.Future | None = None
        self._released = False
        store.acquire(name)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self.fut is not None and not self.fut.done():
            self.fut.add_done_callback(self._later)
        else:
            self.store.release(self.name)

    def _later(self, fut: asyncio.Future) -> None:
        if not fut.cancelled():
            fut.exception()  # already logged as given up; retrieved so asyncio does not say it again
        self.store.release(self.name)


class Sessions:
    def __init__(self, cfg: Config, engine: Engine, store: Store, model: str, model_name: str = "",
                 slots_visible: bool = True):
        self.cfg = cfg
        self.engine = engine
        self.store = store
        self.model = model
        self.model_name = model_name
        self.slots_visible = slots_visible  # False: the engine runs with --no-slots
        # The KV layout of this engine's state files (streams from the start probe; the rest from
        # its first save): a file of another layout cannot be loaded and is not restored.
        self.engine_layout: slotfile.KVLayout | None = None
        self.clears_idle_slots = False  # seen: the engine empties idle slots (unified KV + --cache-idle-slots)
        self.counters = Counters()
        self.events = Events()
        self.slots: dict[int, Slot] = {}
        self._waiters: list[_Waiter] = []  # for tickets, in arrival order
        self._idle_waiters: list[asyncio.Future] = []  # fifos_free
        self.launches = LaunchGate()  # engines that empty idle slots: when a request may start
        self.primer: str | None = None  # ... and the one-token state put into an emptied slot (_prime)
        self._primer_off = False  # ... not made: the model adds no BOS, or making it failed
        self.starts = 0  # requests the engine placed (seen running, or ended; a prefix read; an unplaced one)
        # Conversations that ran since the engine started: its RAM cache may hold them.
        self._ran: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.last_not_reused: dict[str, Any] | None = None
        # The token index (index.py) over the session files, from prepare(); None: not loaded,
        # and every restore follows the key rule. swa_window: the model's sliding window.
        self.index: TokenIndex | None = None
        self.swa_window: int | None = None
        self.last_restores: dict[int, dict[str, Any]] = {}  # per slot: the last restore, and its cache_n
        self._words: dict[str, tuple[Any, str]] = {}  # ls: a file's first words, by (inode, mtime, size)
        self.started_at = time.time()
        self.inputs: dict[str, Callable[[], Any]] = {}  # filled by the daemon: name → describe()
        self.engine_healthy: bool | None = None
        self._finalizing: dict[str, asyncio.Future] = {}
        self._prune_task: asyncio.Task | None = None
        self._free_target = 0  # bytes a refused save needed free; the next prune makes room
        # Called (awaited) after the engine came back from a restart; the tail restores then.
        self.on_engine_restart: list[Callable[[], Awaitable[None]]] = []
        # The shared bucket ([shared]; the daemon sets it): saves are uploaded after their
        # finalize, and a turn that finds nothing good enough locally asks its catalog.
        self.remote: Remote | None = None
        self.slot()  # the configured slot; add_slots() adds the engine's others

    # -- slots and their FIFOs ---------------------------------------------------
    def slot(self, slot_id: int | None = None) -> Slot:
        sid = self.cfg.engine.slot if slot_id is None else slot_id
        if sid not in self.slots:
            self.slots[sid] = Slot(sid)
        return self.slots[sid]

    def add_slots(self, n: int) -> None:
        """The engine runs n slots (0..n-1): all of them are driven."""
        for sid in range(n):
            self.slot(sid)

    async def admit(self, slot_id: int | None = None) -> Ticket:
        """Wait for one slot's FIFO (the configured slot by default). Whatever runs a turn, a
        request, a save or a restore on the slot holds a ticket until the engine is done with it."""
        return await self._take(_Waiter(asyncio.get_running_loop().create_future(), self.slot(slot_id).id, None))

    async def place(self, key: str | None) -> Ticket:
        """Choose the slot for a request of conversation `key` and wait for its FIFO: the slot
        that holds the conversation (it never runs on two slots at once), otherwise the least
        recently used free slot, one holding nothing worth keeping first (a request without a
        conversation never displaces a long one while another slot is free)."""
        if len(self.slots) <= 1:
            return await self.admit()
        return await self._take(_Waiter(asyncio.get_running_loop().create_future(), None, key))

    async def admit_all(self) -> list[Ticket]:
        """Every slot's FIFO, in slot order (no deadlock: nothing else takes two). For a request
        the engine places itself (embeddings and rerank cannot be pinned to a slot)."""
        tickets: list[Ticket] = []
        try:
            for sid in sorted(self.slots):
                tickets.append(await self.admit(sid))
        except BaseException:
            for t in tickets:
                t.release()
            raise
        return tickets

    def _try_admit(self, s: Slot) -> Ticket | None:
        """The slot's ticket if it is free now and nobody waits for it; never waits."""
        if s.busy or any(w.want == s.id for w in self._waiters):
            return None
        ticket = Ticket(self, s)
        s.holder, s.last_used = ticket, time.monotonic()
        return ticket

    async def _take(self, w: _Waiter) -> Ticket:
        self._waiters.append(w)
        self._dispatch()
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
            s.holder, s.placing, s.last_used = ticket, w.key, time.monotonic()
            w.future.set_result(ticket)

    def _choose(self, w: _Waiter) -> Slot | None:
        if w.want is not None:
            s = self.slot(w.want)
            return None if s.busy else s
        if w.key is not None:
            own = next((s for s in self.slots.values() if s.holds(w.key)), None)
            if own is not None:
                return None if own.busy else own
        free = [s for s in self.slots.values() if not s.busy]
        if not free:
            return None

        def worth_keeping(s: Slot) -> bool:
            held = s.view.held()
            return held is not None and (held.n_tokens is None or held.n_tokens >= self.cfg.auto_sessions_min_tokens)

        return min(free, key=lambda s: (worth_keeping(s), s.last_used, s.id))

    def _release(self, s: Slot, ticket: Ticket) -> None:
        if s.holder is ticket:
            if s.holds_launch:  # its request never got to start (not forwarded, cancelled)
                self.launches.release(s.holds_launch)
                s.holds_launch = None
            s.start_pending = False
            if s.place_watch is not None:
                s.place_watch.cancel()
                s.place_watch = None
            s.holder, s.placing = None, None
            for waiter in self._idle_waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self._idle_waiters.clear()
            self._dispatch()

    async def fifos_free(self) -> None:
        """Until no ticket is held on any slot (a stop waits for this, bounded by its caller)."""
        while any(s.busy for s in self.slots.values()):
            waiter = asyncio.get_running_loop().create_future()
            self._idle_waiters.append(waiter)
            await waiter

    async def ran_unplaced(self) -> None:
        """A request the engine placed itself has run, every slot's ticket held meanwhile: the
        slot it ran on (its task id moved) holds nothing autosessd can name."""
        self.starts += 1  # it ran: a start like any request
        for s in sorted(self.slots.values(), key=lambda x: x.id):
            st = await self._look(s)
            if st is None:
                self.lost(s.id, "a request the engine placed itself may have run on it (slots not visible)")
            elif st.task_id != s.task_id:
                s.task_id = st.task_id
                self.lost(s.id, "a request the engine placed itself (an embedding, a rerank) ran on it")

    def view(self, slot_id: int | None = None) -> View:
        return self.slot(slot_id).view

    async def engine_slot(self, slot_id: int) -> SlotState | None:
        """What the engine itself says of one slot (EngineError when it cannot say)."""
        return next((x for x in await self.engine.slots() if x.id == slot_id), None)

    async def _look(self, s: Slot) -> SlotState | None:
        """GET /slots for one slot; None when the engine hides its slots or cannot answer."""
        if not self.slots_visible:
            return None
        try:
            return await self.engine_slot(s.id)
        except SlotsHidden:
            self.slots_visible = False
            log.warning("engine: GET /slots is off now (--no-slots): token counts come from responses")
        except EngineError as e:
            log.debug("auto sessions: slot %d: cannot read the engine's slot: %s", s.id, e)
        return None

    # -- transitions (the only writers of Slot.view) ---------------------------
    def _set(self, s: Slot, view: View) -> None:
        if view.phase is not Phase.SWITCHED and view.prior is not None:
            view = dataclasses.replace(view, prior=None)
        if (view.phase, view.key) != (s.view.phase, s.view.key):
            log.debug("auto sessions: slot %d: %s %s → %s %s", s.id, s.view.phase.value, s.view.key or "",
                      view.phase.value, view.key or "")
        s.view = view

    def switched_to(self, slot_id: int | None, key: str | None) -> None:
        """A request of `key` (None: no conversation) starts on the slot now, whatever we do
        (after a turn, or seen in a request log)."""
        s = self.slot(slot_id)
        v = s.view
        if v.phase is Phase.SWITCHED:
            # Another request whose end was not seen is still ahead of this one on the slot.
            prior = v.prior if v.key == key else View(Phase.UNKNOWN, n_tokens=None,
                                                       why="two requests overlapped on the slot")
            restored = v.restored if v.key == key else None
        else:
            prior, restored = v, (v.restored if v.key == key else None)
        s.seen_cache_n = None
        self._set(s, View(Phase.SWITCHED, key, n_tokens=None, restored=restored, prior=prior))

    async def ended(self, slot_id: int | None, key: str | None, status: str, n_tokens: int | None = None,
                    cache_n: int | None = None, n_prompt: int | None = None, look: bool = True) -> None:
        """The request of `key` that switched_to announced has ended.

        status: ok | cancelled | error (the engine failed it part-way) | rejected (it answered
        4xx: it refused the request before running it) | not_run (it never reached the engine).
        n_tokens, cache_n, n_prompt: what the response or log line said; the engine's own
        GET /slots is read when `look` and preferred for the count."""
        s = self.slot(slot_id)
        if s.view.phase is Phase.SWITCHED and s.view.key == key:  # the end of the request that holds them
            if s.holds_launch:
                # Its start is no longer in flight (it ran, or it never will): others may start,
                # and the end save below takes the gate itself.
                self.launches.release(s.holds_launch)
                s.holds_launch = None
            if s.start_pending:
                if status in ("ok", "cancelled", "error"):
                    self._placed(s)
                s.start_pending = False  # a request refused or never sent empties nothing
        if key is not None and status in ("ok", "cancelled", "error"):
            self._ran[key] = None
            self._ran.move_to_end(key)
            if len(self._ran) > 10_000:
                self._ran.popitem(last=False)
        v = s.view
        if v.phase is not Phase.SWITCHED or v.key != key:
            log.debug("auto sessions: slot %d: end of %s ignored: the slot is %s %s now", s.id, key,
                      v.phase.value, v.key or "")
            return
        # On an engine that empties idle slots, the next start anywhere empties this one: when
        # its end may be saved, no start is sent from now until the save is done.
        min_tokens = max(1, self.cfg.auto_sessions_min_tokens)
        ran = key is not None and status == "ok" and (n_tokens is None or n_tokens >= min_tokens)
        after = v.prior.held() if status in ("not_run", "rejected") and v.prior is not None else None
        kept = after is not None and (after.n_tokens is None or after.n_tokens >= min_tokens)  # the prior stays
        hold = (self.clears_idle_slots and len(self.slots) > 1 and s.holder is not None and self.cfg.auto_sessions
                and (ran or kept))
        if hold:
            await self.launches.acquire("exclusive")
        try:
            await self._end(s, v, key, status, n_tokens, cache_n, n_prompt, look, hold)
        finally:
            if hold:
                self.launches.release("exclusive")

    async def _end(self, s: Slot, v: View, key: str | None, status: str, n_tokens: int | None, cache_n: int | None,
                   n_prompt: int | None, look: bool, save: bool) -> None:
        st = await self._look(s) if look and status != "not_run" else None
        if st is not None and st.is_processing:
            st = None  # the next request runs already (a log read late): this one's end is not visible
        self._settle(s, v, status, st, n_tokens, cache_n, n_prompt)
        if self.clears_idle_slots and s.view.phase is Phase.HELD and st is not None and st.n_tokens == 0:
            # Another request started between this one's end and our look, and the engine moved
            # this slot to its RAM cache: its latest state never reaches the disk.
            if n_tokens is not None and n_tokens >= max(1, self.cfg.auto_sessions_min_tokens):
                self.counters.saves_missed += 1
                log.warning("auto sessions: %s: another request started as it ended and the engine emptied its "
                            "slot before it could be saved (--no-cache-idle-slots keeps idle slots)",
                            auto_name(key or ""))
            self.lost(s.id, "the engine emptied the idle slot (moved to its RAM cache)")
            return
        if save:
            # The next request to start on any other slot empties this one: save it now, before
            # its ticket goes (the caller holds it), with no request starting meanwhile.
            held = s.view.held()
            await self._wait_files()
            step = policy.plan_save(held, Occasion.BEHIND, self.cfg.auto_sessions_min_tokens,
                                    self._held_info(s.view), self.model)
            if isinstance(step, Save) and held is not None:
                if await self._save(s, held, None) is SaveOutcome.NOT_TRIED and s.view.held() is None:
                    self.counters.saves_missed += 1  # a start sent before this end emptied the slot

    def lost(self, slot_id: int | None, why: str) -> None:
        """The slot's contents changed behind our back: hold nothing named, so the next
        request of the conversation restores it instead of trusting a state that is gone."""
        s = self.slot(slot_id)
        v = s.view
        named = v.key if v.phase in (Phase.HELD, Phase.RESTORED, Phase.SWITCHED) else None
        if named is not None:
            log.info("auto sessions: slot %d no longer holds %s (%s); the next request restores it", s.id,
                     named, why)
            self.events.emit("engine_reset", slot=s.id, key=named, why=why)
            self.counters.engine_resets += 1
        self._set(s, View(Phase.UNKNOWN, n_tokens=None, why=why))

    def _settle(self, s: Slot, v: View, status: str, st: SlotState | None, n_tokens: int | None,
                cache_n: int | None, n_prompt: int | None) -> None:
        """SWITCHED → what the slot holds after its request (the table in the docstring)."""
        prior = v.prior or View(Phase.UNKNOWN, n_tokens=None)
        if st is not None:
            s.task_id = st.task_id
        n = st.n_tokens if st is not None else n_tokens
        # The engine's slot shows what it showed before the request: the request changed nothing.
        unchanged = st is not None and prior.slot_tokens is not None and st.n_tokens == prior.slot_tokens
        if status == "not_run" or (status in ("error", "rejected", "cancelled") and unchanged):
            new = prior
        elif status == "rejected" and st is None and not self.slots_visible:
            new = prior  # cannot look; a 4xx from llama-server comes before anything runs
        elif status in ("error", "rejected"):
            new = View(Phase.UNKNOWN, n_tokens=None, why=f"a request of {v.key or 'no conversation'} failed part-way")
        elif v.key is None:
            new = View(Phase.UNKNOWN, n_tokens=None, why="a request without a conversation ran")
        elif status == "ok":
            new = View(Phase.HELD, v.key, n_tokens=n, tokens=v.tokens, messages=v.messages, file=v.file,
                       n_prompt=n_prompt if n_prompt is not None and (n is None or n_prompt <= n) else None)
        else:  # cancelled part-way: how much of the prompt it holds is not known
            new = View(Phase.HELD, v.key, n_tokens=n, durable=False, file=v.file)
        if v.restored is not None and v.key is not None and new.phase is Phase.HELD:
            if cache_n is None and s.seen_cache_n is not None:
                cache_n = s.seen_cache_n[1]
            self._verify(s, v.key, v.restored, cache_n, n_prompt, status)
        s.seen_cache_n = None
        self._set(s, new)

    def _verify(self, s: Slot, key: str, n_restored: int, cache_n: int | None, n_prompt: int | None,
                status: str) -> None:
        """A restore is verified by the engine's timings.cache_n, not assumed."""
        if cache_n is None:
            if status == "ok":
                self.counters.restores_unverified += 1
                log.info("auto sessions: could not see whether the engine reused %s (no cache_n)", auto_name(key))
            return
        reused = policy.restore_reused(n_restored, cache_n, n_prompt)
        last = self.last_restores.get(s.id)
        file = last["file"] if last is not None else auto_name(key)
        if last is not None:
            last.update(cache_n=cache_n, reused=reused)
        if reused:
            self.counters.restores_reused += 1
            self.counters.prefill_tokens_avoided += cache_n
            self.events.emit("restore_reused", slot=s.id, key=key, file=file, cache_n=cache_n, n_restored=n_restored)
            return
        self.counters.restores_not_reused += 1
        cause = NOT_REUSED_CAUSE
        # A regenerated answer's prompt is a little shorter than the restored state (which
        # holds the answer too); one under half of it was cut back by the client.
        if n_prompt is not None and n_prompt * 2 < n_restored:
            cause = (f"the prompt ({fmt_tokens(n_prompt)} tokens) is shorter than the restored conversation: "
                     f"the client cut it, and the engine read the prompt again instead of cutting its "
                     f"state back")
        self.last_not_reused = {"key": key, "file": file, "n_restored": n_restored, "cache_n": cache_n,
                                "at": time.time(), "likely_cause": cause}
        log.warning("auto sessions: restored %s tokens of %s but the engine reused %s (timings.cache_n): %s",
                    fmt_tokens(n_restored), file, fmt_tokens(cache_n), cause)
        self.events.emit("restore_not_reused", slot=s.id, key=key, file=file, cache_n=cache_n, n_restored=n_restored)

    async def _observe(self, s: Slot, result: TurnResult | None = None) -> bool:
        """Bring the slot's view up to date with the engine before acting on it (the caller
        holds the slot's ticket). False when a request we did not let through is running:
        a save now would wait for it and capture its state."""
        starts = self.starts
        pending = self._start_pending_besides(s)
        st = await self._look(s)
        s.looked = (starts, pending, st)
        v = s.view
        if st is not None and st.is_processing:
            msg = "slot busy with a request that did not come through autosessd"
            log.warning("auto sessions: skipped turn: %s", msg)
            if result is not None:
                result.skipped.append(msg)
            self.counters.skipped_engine_busy += 1
            self.lost(s.id, msg)
            return False
        if v.phase is Phase.SWITCHED:
            # Its end was not seen (turn hook): the serving layer runs one request at a time,
            # so it has ended; whether it ran at all, the engine's task id says.
            ran = st is None or st.task_id != s.task_id
            self._settle(s, v, "ok" if ran else "not_run", st, None, None, None)
        elif st is not None and v.phase in (Phase.HELD, Phase.RESTORED):
            # A slot that never ran a task does not report its count (right after a restore).
            counted = v.phase is Phase.HELD or st.task_id is not None
            if st.task_id != s.task_id:
                self.lost(s.id, "a request that did not come through autosessd ran on the slot")
            elif counted and st.n_tokens == 0 and v.n_tokens:
                self._emptied_by_engine(s)
            elif counted and v.n_tokens is not None and st.n_tokens != v.n_tokens:
                self.lost(s.id, f"its slot shows {st.n_tokens:,} tokens, {v.n_tokens:,} were held")
        if st is not None:
            s.task_id = st.task_id
        return True

    def _emptied_by_engine(self, s: Slot) -> None:
        """The slot lost its tokens without a task of its own: with a unified KV cache and
        --cache-idle-slots (llama-server's defaults for -np auto), every request that starts on
        any slot moves the idle slots to the engine's RAM cache and empties them."""
        if not self.clears_idle_slots and len(self.slots) > 1:
            self.clears_idle_slots = True
            log.warning("engine: %s empties idle slots whenever a request starts on another one (a unified KV "
                        "cache with --cache-idle-slots, the defaults of -np auto): autosessd now saves each "
                        "conversation when its request ends, not only when its slot is taken, and a conversation "
                        "whose request ends just as another starts can miss its save. Start llama-server with "
                        "--no-cache-idle-slots to keep idle slots (README: Several slots)", self.engine.address)
        self.lost(s.id, "the engine emptied the idle slot (moved to its RAM cache)")

    async def may_launch(self, ticket: Ticket) -> None:
        """Before a request is sent to the engine: when the engine empties idle slots at every
        request start, wait while a restore or an end save elsewhere needs the engine to start
        nothing else (LaunchGate); this request's start is then "in flight" until
        launch_started has seen it running (or, going alone, until the engine has taken it
        in). Requests start side by side otherwise.

        On such an engine llama-server looks for a pinned request's prompt in its RAM prompt
        cache only when the slot holds something (llama.cpp issue 28139), and what it emptied
        went there. Placing the request itself, the engine alone would find it. So a request
        whose turn restored nothing goes alone when the engine may hold its conversation: in
        its slot (a start in between would empty it), or in the RAM cache (a conversation that
        ran since the engine started); and when its slot is empty by then (the turn's look saw
        it empty, or a start was sent since), it gets the primer first (_prime), so that the
        engine looks. A new conversation starts side by side: the cache has nothing of it."""
        s = self._slot_of(ticket)
        looked, s.looked = s.looked, None
        await self._hold_starts(s, looked)
        s.start_pending = True  # sent right after this: pending until the engine shows it placed

    async def _hold_starts(self, s: Slot, looked: tuple[int, bool, SlotState | None] | None) -> None:
        if not (self.clears_idle_slots and len(self.slots) > 1) or s.holds_launch:
            return  # s.holds_launch: a restore holds the engine's starts, and its slot holds the state
        v = s.view
        key = v.key if v.phase is Phase.SWITCHED else None
        prior = v.prior if v.phase is Phase.SWITCHED else None
        here = key is not None and prior is not None and prior.key == key and prior.phase in (Phase.HELD,
                                                                                              Phase.RESTORED)
        if self._primer_off or key is None or looked is None or not (here or key in self._ran):
            await self.launches.acquire("shared")
            s.holds_launch = "shared"
            return
        await self.launches.acquire("alone")
        s.holds_launch = "alone"
        starts, pending, st = looked
        # A start placed since the turn's look, or one sent and not yet seen placed (it goes
        # before this one: the engine places its queue in order), empties this idle slot.
        emptied = starts != self.starts or pending or self._start_pending_besides(s)
        if not emptied:
            if st is None or st.is_processing or st.n_tokens:
                return
            if st.task_id is None and not (prior is UNKNOWN_AT_START or prior == View(Phase.EMPTY)):
                return  # a slot that never ran shows no count: it may hold a state a client restored
        # What the request starts from: nobody's (should it not run, nothing here is saved).
        self._set(s, dataclasses.replace(s.view, prior=View(Phase.UNKNOWN, n_tokens=None, why="holds the primer")))
        try:
            primed = await self._prime(s)
        except Exception as e:  # the request goes on, unprimed
            log.exception("auto sessions: slot %d: priming: %s", s.id, e)
            primed = False
        if primed:
            self.counters.primed += 1

    async def _prime(self, s: Slot) -> bool:
        """Put the primer into slot s, empty and held exclusively: a state of one token that
        no prompt starts with (the newline after BOS), saved once into the session directory
        (`.autosessd-primer.partial`, gone at stop) and restored from then on. The engine's
        RAM cache keeps it at most once (it stores no entry that one it holds contains), and a
        request shares nothing with it, so the engine replaces it with the cached prompt that
        shares the most with the request. Off for a model whose tokenizer adds no BOS (a
        prompt could start with the newline), and after a failure to make it."""
        if self.primer is not None:
            try:
                await self.engine.restore(s.id, self.primer)
                return True
            except EngineError as e:
                # A full KV cache, an engine that restarted with another model, a file gone:
                # make it again on this slot (a failed restore leaves the slot empty).
                log.info("auto sessions: slot %d: restoring the primer: %s; making it again", s.id, e)
                self._drop_primer()
        prefill = getattr(self.engine, "prefill", None)
        name = f"{TEMP_PREFIX}primer.partial"
        try:
            tokens = await self.engine.tokenize("\n")
            other = await self.engine.tokenize("x")
            if len(tokens) < 2 or len(other) < 2 or tokens[0] != other[0] or prefill is None:
                self._primer_off = True
                log.info("auto sessions: no primer: the model adds no BOS token (tokens for a newline: %s), so a "
                         "prompt may start with any token; requests to slots the engine emptied read their prompts "
                         "again", tokens)
                return False
            await prefill(s.id, tokens[1:2])
            self.starts += 1  # it ran: a start like any request, it emptied the other idle slots
            res = await self.engine.save(s.id, name)
            if res.n_tokens != 1:
                raise EngineError(f"the engine saved {res.n_tokens} tokens, not 1")
        except EngineError as e:
            self._primer_off = True
            (self.store.path / name).unlink(missing_ok=True)
            log.warning("auto sessions: no primer (%s): requests to slots the engine emptied read their prompts "
                        "again", e)
            return False
        with contextlib.suppress(OSError):
            os.chmod(self.store.path / name, self.store.mode)  # the engine wrote it
        self.primer = name
        log.info("auto sessions: primer %s made (one token): a request pinned to a slot the engine emptied is "
                 "served from the engine's RAM prompt cache, as it would be without autosessd", name)
        return True

    def _start_pending_besides(self, s: Slot) -> bool:
        """A request on another slot was sent and not yet seen placed: placed, it empties s."""
        return any(o.start_pending for o in self.slots.values() if o is not s)

    def _placed(self, s: Slot) -> None:
        """The engine placed s's request: it emptied every other idle slot."""
        if s.start_pending:
            s.start_pending = False
            self.starts += 1

    def _drop_primer(self) -> None:
        if self.primer is not None:
            with contextlib.suppress(OSError):
                (self.store.path / self.primer).unlink(missing_ok=True)
            self.primer = None

    async def launch_started(self, ticket: Ticket, bound_s: float = 2.0) -> None:
        """The request was sent: once the engine shows it running on its slot (a new task id),
        or after bound_s, other requests may start. Safe to call for any ticket.

        A start that goes alone needs only to be in the engine's task queue before the next
        one: the engine places queued requests in order, so the next one's start no longer
        empties this slot. The engine places requests only between its batches (seconds apart
        while it reads a long prompt), so such a hold ends after the time the engine takes to
        take a request in: 50 ms and 4 µs a token (its /tokenize runs at ~2.5 µs a token
        here). Should that not do, the request reads its prompt again, as without the primer.
        Whether it was placed is still watched (_until_placed): until then, other starts
        count this slot's neighbours as emptied."""
        s = self.slot(ticket.slot_id)
        if not s.holds_launch:
            return
        if s.holds_launch == "alone":
            tokens = s.view.tokens
            bound_s = min(bound_s, 0.05 + 4e-6 * (len(tokens) // 4 if tokens else 25_000))
        watch = asyncio.get_running_loop().create_task(self._until_placed(ticket, s))
        try:
            await asyncio.wait({watch}, timeout=bound_s)
        finally:
            if s.holder is ticket and s.holds_launch:
                self.launches.release(s.holds_launch)
                s.holds_launch = None
            if not watch.done():
                s.place_watch = watch  # it goes on: until the engine shows the request, or its end
                if s.holder is not ticket:
                    watch.cancel()

    async def _until_placed(self, ticket: Ticket, s: Slot) -> None:
        before = s.task_id
        deadline = time.monotonic() + 60
        # Until the request is seen running or ended (ended() confirms it) or its ticket went.
        while s.holder is ticket and s.start_pending and time.monotonic() < deadline:
            st = await self._look(s)
            if st is None:
                return
            if st.is_processing and st.task_id != before:
                self._placed(s)
                return
            await asyncio.sleep(0.01)

    def watch_request(self, slot_id: int | None) -> None:
        """A request whose end we will not see with its timings (turn hook, tail) starts on a
        restored slot: read GET /slots while it runs, for the cache_n that verifies the restore
        (llama-server clears it when the request ends)."""
        s = self.slot(slot_id)
        if s.view.restored is None or not self.slots_visible or (s.watcher and not s.watcher.done()):
            return
        s.watcher = asyncio.get_running_loop().create_task(self._watch(s, s.view.key, s.task_id))

    async def _watch(self, s: Slot, key: str | None, task_before: int | None) -> None:
        deadline = time.monotonic() + self.cfg.engine.timeout_s
        while time.monotonic() < deadline and s.view.phase is Phase.SWITCHED and s.view.key == key:
            try:
                st = await self.engine_slot(s.id)
            except EngineError:
                return
            if st is not None and st.task_id is not None and st.task_id != task_before:
                if not st.is_processing:
                    return  # ended between two looks: the restore stays unverified
                if st.n_cached is not None and (st.n_cached or st.n_tokens):
                    s.seen_cache_n = (st.task_id, st.n_cached)
                    return
            await asyncio.sleep(WATCH_EVERY_S)

    # -- the turn --------------------------------------------------------------
    async def turn(self, ticket: Ticket, key: str | None, sees_end: bool = True,
                   body: dict[str, Any] | None = None) -> TurnResult:
        """DESIGN §1 before a request of conversation `key` (None: a request without one,
        which skips the restore) on the ticket's slot. Never raises (cancellation aside): on
        any failure the request goes on. Ends with switched_to(key): the request runs next.
        sees_end=False (turn hook): its end will not be reported, so a restore is verified
        by watching the engine's slot instead. body: the request's OpenAI chat body (the gate,
        or the hook's messages), whose tokens choose what to restore (DESIGN §9); None: the
        key rule."""
        s = self._slot_of(ticket)
        s.looked = None  # this turn's own look, or none
        result = TurnResult(key=key, slot=s.id)
        t0 = time.monotonic()
        carry: _Carry | None = None
        if key is not None and self.cfg.auto_sessions:
            self.counters.turns += 1
        try:
            if self.cfg.auto_sessions and await self._observe(s, result):
                carry = await self._turn(s, key, result, body)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug must not fail the request either
            log.exception("auto sessions: turn for %s: %s", key, e)
            result.errors.append(f"internal error: {e}")
        finally:
            self.switched_to(s.id, key)
            if carry is not None:
                self._set(s, dataclasses.replace(s.view, tokens=carry.tokens, messages=carry.messages,
                                                 file=carry.file))
            result.ms = round((time.monotonic() - t0) * 1000, 2)
            if self.cfg.auto_sessions and (key is not None or result.saved or result.errors):
                self.events.emit("turn", **result.to_dict())
        if not sees_end:
            self.watch_request(s.id)
        if self.cfg.auto_sessions:
            self.schedule_prune()
        return result

    def _slot_of(self, ticket: Ticket) -> Slot:
        s = self.slot(ticket.slot_id)
        assert s.holder is ticket and ticket.held, "a turn needs the slot's ticket"
        return s

    async def _turn(self, s: Slot, key: str | None, result: TurnResult, body: dict[str, Any] | None = None
                    ) -> _Carry | None:
        v = s.view
        held = v.held()
        sig = chat_signature(body) if key is not None and body is not None else None
        same = key is not None and held is not None and held.key == key
        if same and (sig is None or continues(v.messages, sig)):
            # The same conversation going on: its count is updated when the request ends. No
            # tokens asked for: the request extends what the slot holds.
            return _Carry(v.tokens, sig, v.file)
        want = sig is not None and self.index is not None
        tokens = await self._request_tokens(body, result) if want and same else None
        if same and tokens is None:
            return _Carry(v.tokens, sig, v.file)  # the key rule: the same conversation
        if same and v.tokens and common_prefix(v.tokens, tokens) == len(v.tokens) // 4:
            # Other messages (a client that rewrites what it sent before), the same tokens:
            # the request still goes on from what the slot holds.
            return _Carry(v.tokens, sig, v.file)
        # Same first message, but its tokens depart from the held ones (another system prompt,
        # an edited message): the engine keeps only what they share, so it is a switch too.
        occasion = Occasion.BRANCH if same else Occasion.SWITCH if key is not None else Occasion.KEYLESS
        # At a switch the engine tokenizes the request while it saves the held conversation
        # (/tokenize does not wait for the slot): the save hides the tokens' cost.
        asking = asyncio.get_running_loop().create_task(self._request_tokens(body, result)) \
            if want and not same else None
        try:
            outcome = SaveOutcome.NOT_TRIED
            # A save of this conversation may still be finalizing (an end save): decide on the
            # file as it will be, not as it was, or the same state is saved twice.
            await self._wait_files()
            step = policy.plan_save(held, occasion, self.cfg.auto_sessions_min_tokens, self._held_info(v), self.model,
                                    key)
            if isinstance(step, Save):
                assert held is not None
                outcome = await self._save(s, held, result)
            elif isinstance(step, Skip):
                self._skipped(step, result)
            if asking is not None:
                tokens = await asking
        finally:
            if asking is not None and not asking.done():
                asking.cancel()
        if key is None:
            return None
        if tokens is None:
            return await self._restore_by_key(s, key, held, outcome, result, sig)
        assert body is not None and sig is not None
        return await self._restore_by_tokens(s, key, held, outcome, result, body, sig, tokens)

    async def _restore_by_key(self, s: Slot, key: str, held: Held | None, outcome: SaveOutcome, result: TurnResult,
                              sig: tuple[str, ...] | None) -> _Carry:
        """DESIGN §1 step 3: auto-<key>.bin, for requests whose tokens are not known; with a
        shared bucket, its save of that name first when the local one is missing or older."""
        file = await self._wait_file(key)
        claim = await self._from_bucket_by_key(key, held, outcome, file, result) if self.remote else None
        own = None
        try:
            if claim is not None:
                file = self._file_info(key)
            step = policy.plan_restore(held, key, outcome, file, self.model, self.cfg.auto_sessions_min_tokens,
                                       self.engine_layout)
            if isinstance(step, Restore):
                name = auto_name(key)
                if await self._restore(s, key, result, name):
                    meta = self.store.read_meta(key)
                    own = name if meta is not None and not meta.prefix and meta.line in (None, key) else None
                    self._record_restore(s, result, name, None, None, "key" if claim is None else "key, downloaded")
            elif isinstance(step, Skip):
                self._skipped(step, result)
        finally:
            if claim is not None:
                claim.release()
        return _Carry(None, sig, own)

    async def _restore_by_tokens(self, s: Slot, key: str, held: Held | None, outcome: SaveOutcome,
                                 result: TurnResult, body: dict[str, Any], sig: tuple[str, ...], tokens: bytes
                                 ) -> _Carry:
        """DESIGN §9: restore the file of this model sharing the longest prefix with the
        request's tokens, when it shares at least min_tokens more than the slot already does
        (the engine keeps that much of what the slot holds). Its name plays no part: a file
        under the request's own key that shares less is not restored. Files being written
        are left out (the slot holds them live); so are files the engine could not reuse
        after their sliding-window layers (swa_window)."""
        assert self.index is not None
        min_tokens = self.cfg.auto_sessions_min_tokens
        shared = self._shared(s.view, tokens)
        found = self.index.best(tokens, self.model, exclude=self._writing(), prefer=auto_name(key),
                                min_lcp=shared + max(min_tokens, 1), window=self.swa_window)
        claim = None
        if self.remote is not None:
            found, claim = await self._from_bucket_by_tokens(key, held, outcome, tokens, shared, found, result)
        step = policy.plan_restore_by_tokens(held, key, outcome, found, shared, min_tokens)
        own = None
        if isinstance(step, RestoreFile) and not self._loadable(step.name):
            step = Skip("restore", key, policy.LAYOUT_MISMATCH)
        if isinstance(step, RestoreFile):
            try:
                restored = await self._restore(s, key, result, step.name)
            finally:
                if claim is not None:
                    claim.release()  # read by the engine (or failed): prune may have it now
            if restored:
                meta = self._meta_of(step.name)
                entry = self.index.get(step.name)
                # The engine should now reuse `shared` tokens of it: what the next response's
                # cache_n is checked against.
                self._set(s, dataclasses.replace(s.view, restored=step.shared, file=step.name,
                                                 tokens=entry.tokens if entry is not None else None))
                own = step.name if self._own(key, step, meta) else None
                self.counters.restores_by_tokens += 1
                self._record_restore(s, result, step.name, step.shared, shared,
                                     "tokens" if claim is None else "tokens, downloaded", meta, len(tokens) // 4)
                shared = step.shared
            else:
                shared = 0  # llama-server cleared the slot
        else:
            if claim is not None:
                claim.release()
            if step.reason == policy.NO_MATCH:
                msg = (f"no restore for {key}: no file of this model shares {shared + max(min_tokens, 1):,} "
                       f"tokens with the request's {len(tokens) // 4:,} (the slot shares {shared:,})")
                result.skipped.append(msg)
                self.counters.skipped_no_file += 1
                log.debug("auto sessions: %s", msg)
            else:
                self._skipped(step, result)
        if not (outcome is SaveOutcome.FAILED and held is not None and held.durable):
            await self._split(s, key, body, tokens, shared, result)
        return _Carry(tokens, sig, own)

    # -- the shared bucket: a download before the restore (autosessd/remote.py) ----------------
    async def _from_bucket_by_tokens(self, key: str, held: Held | None, outcome: SaveOutcome, tokens: bytes,
                                     shared: int, found: tuple[str, int] | None, result: TurnResult
                                     ) -> tuple[tuple[str, int] | None, _Claim | None]:
        """The bucket's save sharing the longest prefix with the request, when it shares
        min_tokens more than the slot and the best local file (policy.plan_fetch_by_tokens) and
        its download beats re-reading: downloaded and indexed. → (what to restore, the claim
        on it), or (found, None): the local choice stands."""
        assert self.remote is not None and self.index is not None
        min_tokens = self.cfg.auto_sessions_min_tokens
        have = max(shared, found[1] if found is not None else 0)
        writing = self._writing()
        hit = self.remote.best(tokens, have + max(min_tokens, 1), self.swa_window, prefer=auto_name(key),
                               skip=lambda r: r.name in writing or self._have_locally(r))
        fetch = policy.plan_fetch_by_tokens(held, outcome, found, (hit[0].name, hit[1]) if hit else None, shared,
                                            min_tokens)
        if fetch is None or hit is None:
            return found, None
        claim = await self._fetch(hit[0], fetch, result)
        if claim is None:
            return found, None
        # The file's own tokens, now in the local index, decide (they are the object's).
        lcp = self.index.lcp(fetch.name, tokens)
        if lcp is None or lcp < have + max(min_tokens, 1):
            claim.release()
            return found, None
        return (fetch.name, lcp), claim

    async def _from_bucket_by_key(self, key: str, held: Held | None, outcome: SaveOutcome, file: FileInfo | None,
                                  result: TurnResult) -> _Claim | None:
        """The key rule with a bucket: its current save of auto-<key>.bin, downloaded when the
        local one is missing, unusable, or older and shorter (policy.plan_fetch_by_key) and
        the download beats re-reading. → the claim on the file, or None."""
        assert self.remote is not None
        save = self.remote.newest(auto_name(key))
        meta = self.store.read_meta(key) if file is not None else None
        fetch = policy.plan_fetch_by_key(held, key, outcome, file, meta.saved_at if meta else None,
                                         save.n_tokens if save else None, save.saved_at if save else None,
                                         self.model, self.cfg.auto_sessions_min_tokens, self.engine_layout)
        if fetch is None or save is None or save.name in self._writing():
            return None
        return await self._fetch(save, fetch, result)

    def _have_locally(self, r: RemoteSession) -> bool:
        """A local file of that name is as new as the bucket's save (the local index already
        weighed it): nothing to download."""
        m = AUTO_BIN.match(r.name)
        meta = self.store.read_meta(m.group(1)) if m else None
        return meta is not None and meta.saved_at >= r.saved_at

    async def _fetch(self, save: RemoteSession, fetch: Fetch, result: TurnResult) -> _Claim | None:
        """Download `save` for this turn's restore if the estimate says it beats re-reading
        the fetch.gain tokens it adds (logged either way). The request waits for it, at most
        download_timeout_s. → the claim on its name (held until the restore that follows has
        read it: no prune removes it, no other download replaces it), or None: the turn goes
        on without it, as if there were no bucket."""
        remote = self.remote
        assert remote is not None
        est = remote.shared.decide(save, remote.prefill_tokens_s, fetch.gain, self._restore_rate(),
                                   unreachable=remote.unreachable())
        if not est.worth:
            why = est.blocked or f"re-reading its {fetch.gain:,} tokens is faster"
            result.skipped.append(f"shared: {save.name} not downloaded: {why}")
            return None
        limit = remote.cfg.download_timeout_s
        claim = _Claim(self.store, save.name)
        t0 = time.monotonic()
        # "started": time.monotonic() when its thread took it up, or None when the turn gave up
        # before that (dict.setdefault is atomic: whichever comes first decides).
        state: dict[str, float | None] = {}
        try:
            # Downloads have their own threads (no LIST or prune ahead of them), and the
            # time limit counts from when the thread starts it.
            claim.fut = asyncio.get_running_loop().run_in_executor(remote.downloads, self._download, save, limit,
                                                                   state)
            # The thread stops itself at the limit, between two chunks; one read can take up
            # to read_timeout_s beyond it.
            end = t0 + limit + remote.cfg.read_timeout_s
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(claim.fut), max(0.0, end - time.monotonic()))
                    break
                except asyncio.TimeoutError:
                    began = state.setdefault("started", None)  # not started yet: it never will be
                    if began is None or began + limit + remote.cfg.read_timeout_s <= end:
                        raise
                    end = began + limit + remote.cfg.read_timeout_s
        except AlreadyHere as e:
            # Nothing came from the bucket: the local file is as new (a save finalized here
            # meanwhile); restore that, not counted or reported as a download.
            log.debug("auto sessions: shared: %s", e)
            return claim
        except Incompatible as e:
            claim.release()
            log.warning("auto sessions: shared: not downloaded: %s", e)
            result.skipped.append(f"shared: {e}")
            return None
        except (SharedError, OSError, asyncio.TimeoutError) as e:
            claim.release()
            why = str(e) or f"no answer within {limit:g} s (download_timeout_s)"
            self.counters.fetch_failures += 1
            log.warning("auto sessions: shared: %s from %s: %s; the request re-reads its prompt instead", save.name,
                        save.host, why)
            result.errors.append(f"shared: download of {save.name}: {why}")
            self.events.emit("download_failed", file=save.name, host=save.host, error=why)
            return None
        except BaseException:
            claim.release()
            raise
        self.counters.fetched += 1
        ms = (time.monotonic() - t0) * 1000
        self.events.emit("downloaded", file=save.name, host=save.host, n_tokens=save.n_tokens, bytes=save.bytes,
                         ms=round(ms, 2))
        result.skipped.append(f"shared: downloaded {save.name} ({fmt_bytes(save.bytes)}) from {save.host} in "
                              f"{ms:,.0f} ms")
        return claim

    def _download(self, save: RemoteSession, limit: float, state: dict[str, float | None]) -> None:
        """In a download thread: the download (the name claimed by the caller), at most `limit`
        seconds from now, then the index."""
        assert self.remote is not None
        began = state.setdefault("started", time.monotonic())
        if began is None:
            raise SharedError(f"download of {save.name}: the turn stopped waiting before it began")
        self.remote.shared.download(save, self.store, claimed=True, deadline=began + limit,
                                    layout=self.engine_layout)
        self._index_local(save.name)

    def _index_local(self, name: str) -> None:
        if self.index is not None:
            try:
                self.index.add_file(name, self.model)
            except (OSError, ValueError, slotfile.BadSlotFile) as e:
                raise SharedError(f"indexing the downloaded {name}: {e}") from None

    def _restore_rate(self) -> float | None:
        """Bytes per second of this engine's restores so far (the estimate adds the restore)."""
        c = self.counters
        return c.bytes_restored / (c.ms_restored / 1000) if c.ms_restored > 0 else None

    def prefill_seen(self, n_tokens: int | None, ms: float | None) -> None:
        """A response read n_tokens of prompt in ms (timings.prompt_n, prompt_ms): the
        engine's prompt rate, which the bucket's estimate weighs a download against."""
        if self.remote is not None:
            self.remote.saw_prefill(n_tokens, ms)

    async def _request_tokens(self, body: dict[str, Any] | None, result: TurnResult) -> bytes | None:
        """The request's prompt tokens from the engine (/apply-template + /tokenize: neither
        waits for the slot), or None: the key rule decides then."""
        get = getattr(self.engine, "prompt_tokens", None)
        if get is None or body is None:
            return None
        self.counters.tokenized += 1
        try:
            tokens = await get(body)
            if not tokens:
                raise ValueError("no tokens")
            return encode(tokens)
        except (EngineError, ValueError) as e:
            self.counters.tokenize_failures += 1
            log.info("auto sessions: no tokens for the request (%s): its key decides what to restore", e)
            result.skipped.append(f"tokens: {e}")
            return None

    def _shared(self, v: View, tokens: bytes) -> int:
        """Tokens the slot already shares with the request (the engine keeps them live). What
        the slot is known to start with may be only its last prompt: then this is a floor."""
        if v.phase not in (Phase.HELD, Phase.RESTORED):
            return 0
        known = v.tokens
        if known is None and v.file is not None and self.index is not None:
            e = self.index.get(v.file)
            known = e.tokens if e is not None and e.n_tokens == v.n_tokens else None
        return common_prefix(known, tokens) if known else 0

    def _writing(self) -> set[str]:
        return {auto_name(k) for k in self._finalizing}

    def _meta_of(self, name: str) -> Meta | None:
        m = AUTO_BIN.match(name)
        return self.store.read_meta(m.group(1)) if m else None

    @staticmethod
    def _own(key: str, step: RestoreFile, meta: Meta | None) -> bool:
        """Is the restored file this conversation's own (the request goes on from its prompt),
        so that it stays the conversation's file after the request (the up-to-date check)?
        Not a prefix, not another line's, not one the request departs from inside its prompt."""
        if meta is None or meta.prefix or meta.line not in (key, None):
            return False
        if meta.line is None and meta.key != key:
            return False
        return step.shared >= (meta.n_prompt if meta.n_prompt is not None else meta.n_tokens)

    def _record_restore(self, s: Slot, result: TurnResult, name: str, shared: int | None, slot_shared: int | None,
                        by: str, meta: Meta | None = None, n_prompt: int | None = None) -> None:
        """What status shows of the slot's last restore; _verify adds the engine's cache_n."""
        info = {"file": name, "chosen_by": by, "shared": shared, "slot_shared": slot_shared,
                "line": meta.line if meta is not None else None, "prefix": bool(meta is not None and meta.prefix)}
        if result.restored is not None:
            result.restored.update(info)
        self.last_restores[s.id] = {**(result.restored or {}), **info, "n_prompt": n_prompt, "cache_n": None,
                                    "reused": None, "at": round(time.time(), 3)}

    # -- a shared prefix, read on its own -----------------------------------------------
    async def _split(self, s: Slot, key: str, body: dict[str, Any], tokens: bytes, shared: int,
                     result: TurnResult) -> None:
        """A request that starts with a part before its first user message's text (a system
        prompt, tools) of at least min_tokens, which no file holds for the engine to reuse:
        read that part on its own first (POST /completion, n_predict 0) and save it as a
        prefix file, then let the request go on (it reuses the part live: nothing is read
        twice). A later conversation starting with it restores that file, also after an
        engine restart. Why not the conversation's own file: after a restore, a sliding-window
        model (Gemma 3) reuses a file only within its window of the file's end
        (index.best), and a conversation soon runs past that; a file ending where the prefix
        ends is reusable by every request that starts with it.

        Not when the slot already shares more than the prefix with the request: reading the
        prefix alone would cut that back."""
        min_tokens = max(self.cfg.auto_sessions_min_tokens, 1)
        prefill = getattr(self.engine, "prefill", None)
        if prefill is None or self.index is None or len(tokens) // 4 <= min_tokens:
            return
        if result.restored is not None and result.restored.get("prefix"):
            return  # a prefix file was just restored: it is the part
        n = await self._prefix_len(body, tokens)
        if n < min_tokens or shared > n:
            return
        head = tokens[:4 * n]
        if self.index.best(head, self.model, min_lcp=n, window=self.swa_window) is not None:
            return  # a file holds it
        pkey = prefix_key(head)
        if pkey in self._finalizing:
            return
        t0 = time.monotonic()
        # A start like any request: it empties the idle slots (one restored or primed and waiting
        # for its request among them), and another start would empty this one before its request
        # reuses the prefix.
        await self._keep_starts_out(s)
        try:
            pre = await prefill(s.id, decode(head))
        except EngineError as e:
            log.warning("auto sessions: reading the shared prefix (%s tokens) on its own: %s", fmt_tokens(n), e)
            result.errors.append(f"prefix of {fmt_tokens(n)} tokens: {e}")
            self._set(s, View(Phase.UNKNOWN, n_tokens=None, why="reading a shared prefix on its own failed"))
            return
        self.starts += 1  # it ran: a start like any request
        self.prefill_seen(pre.prompt_n, pre.ms)
        v = s.view
        if v.phase is Phase.RESTORED and v.restored is not None and v.key is not None:
            self._verify(s, v.key, v.restored, pre.cache_n, n, "ok")  # the prefill's timings show the reuse
        # The slot holds exactly the prefix now. Under the request's key, so that a request
        # that does not run leaves a state whose file is up to date (never saved again).
        self._set(s, View(Phase.HELD, key, n_tokens=n, tokens=head, n_prompt=n))
        sub = TurnResult(key=pkey)
        outcome = await self._save(s, Held(pkey, n, True), sub, prefix=head)
        result.errors += sub.errors
        ms = (time.monotonic() - t0) * 1000
        if outcome is not SaveOutcome.SAVED or sub.saved is None:
            return
        self._set(s, dataclasses.replace(s.view, file=sub.saved["file"]))
        self.counters.prefixes_saved += 1
        result.prefix = {"file": sub.saved["file"], "n_tokens": n, "cache_n": pre.cache_n, "prompt_n": pre.prompt_n,
                         "prefill_ms": round(pre.ms, 2), "save_ms": sub.saved["ms"], "ms": round(ms, 2)}
        log.info("auto sessions: read the first %s tokens of %s (its system prompt and tools) on their own and "
                 "saved them to %s: %.0f ms (%s tokens read in %.0f ms, %s reused; save %.0f ms)", fmt_tokens(n), key,
                 sub.saved["file"], ms, fmt_tokens(pre.prompt_n), pre.ms, fmt_tokens(pre.cache_n), sub.saved["ms"])
        self.events.emit("prefix_saved", slot=s.id, key=key, **result.prefix)

    async def _prefix_len(self, body: dict[str, Any], tokens: bytes) -> int:
        """How many of the request's tokens come before its first user message's text (0
        when nothing but the template's own few tokens does). The template renders the
        messages up to that one with a marker for its text; the tokens of what precedes the
        marker, as far as they agree with the request's, are the prefix."""
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return 0
        i = next((k for k, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "user"), None)
        if i is None or (i == 0 and not body.get("tools")):
            return 0
        probe = {k: v for k, v in body.items() if k not in ("messages", "stream")}
        probe["messages"] = [*msgs[:i], {**msgs[i], "content": SPLIT_MARK}]
        try:
            text = await self.engine.apply_template(probe)  # type: ignore[attr-defined]
            at = text.find(SPLIT_MARK)
            if at <= 0:
                return 0
            head = encode(await self.engine.tokenize(text[:at]))  # type: ignore[attr-defined]
        except (EngineError, ValueError) as e:
            log.debug("auto sessions: cannot find where the request's system prompt ends: %s", e)
            return 0
        return common_prefix(head, tokens)

    def _skipped(self, step: Skip, result: TurnResult | None) -> None:
        name = auto_name(step.key)
        msg = f"skipped {step.what} of {name}: {step.reason}"
        if result is not None:
            result.skipped.append(msg)
        counter = {policy.BELOW_MIN: "skipped_min_tokens", policy.NO_FILE: "skipped_no_file",
                   policy.MODEL_MISMATCH: "skipped_model_mismatch"}.get(step.reason)
        if counter:
            setattr(self.counters, counter, getattr(self.counters, counter) + 1)
        # "no file" is the normal first sight of a conversation: not worth an INFO line.
        (log.debug if step.reason in (policy.NO_FILE, policy.UP_TO_DATE) else log.info)("auto sessions: %s", msg)

    def _file_info(self, key: str) -> FileInfo | None:
        meta = self.store.read_meta(key)
        if meta is None:
            return None
        return FileInfo(meta.n_tokens, meta.model,
                        slotfile.KVLayout.from_fingerprint(meta.layout) if meta.layout else None)

    def _loadable(self, name: str) -> bool:
        """Whether this engine can load the file, by the KV layout its metadata records."""
        meta = self._meta_of(name)
        layout = slotfile.KVLayout.from_fingerprint(meta.layout) if meta is not None and meta.layout else None
        return layout is None or self.engine_layout is None or layout.compatible(self.engine_layout)

    def _held_info(self, v: View) -> FileInfo | None:
        """The file holding the slot's conversation as last saved or restored (View.file), for
        plan_save's up-to-date check; None when it has none (yet): it is saved, and the
        file's tokens then decide its name."""
        meta = self._meta_of(v.file) if v.file is not None else None
        return FileInfo(meta.n_tokens, meta.model) if meta else None

    async def _wait_file(self, key: str) -> FileInfo | None:
        pending = self._finalizing.get(key)
        if pending is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(pending)
        return self._file_info(key)

    async def _wait_files(self) -> None:
        """Every finalize in flight: a save's temporary is named by its line's key while its
        final name is chosen by comparing with the files of that line."""
        while self._finalizing:
            fut = next(iter(self._finalizing.values()))
            if fut.done():
                # Finished, and its done-callback (_finalized, which removes it) is queued on
                # the loop: awaiting a done future does not yield, so yield once for it to run
                # instead of spinning here for ever with the loop blocked.
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(Exception):
                await asyncio.shield(fut)

    def _saved_file(self, key: str) -> SavedFile | None:
        """auto-<key>.bin as index.save_key needs it: its tokens (the index's, else its header)
        and the prompt count its metadata recorded."""
        path = self.store.bin_path(key)
        meta = self.store.read_meta(key)
        e = self.index.get(auto_name(key)) if self.index is not None else None
        if e is not None and meta is not None and e.n_tokens == meta.n_tokens:
            return SavedFile(e.tokens, meta.n_prompt)
        try:
            header = slotfile.read_header(path)
        except FileNotFoundError:
            return None
        except (slotfile.BadSlotFile, OSError):
            return SavedFile(b"")  # not a state this engine wrote: ours to replace
        return SavedFile(encode(comparable(header.tokens)), meta.n_prompt if meta else None)

    # -- save --------------------------------------------------------------------
    async def _save(self, s: Slot, held: Held, result: TurnResult | None, target: str | None = None,
                    check: Callable[[], Awaitable[str | None]] | None = None,
                    prefix: bytes | None = None) -> SaveOutcome:
        """Save what slot s holds: the conversation of first-message key held.key (or the
        manual file `target`, or with `prefix` the shared prefix of key held.key, which must
        hold exactly those tokens).

        The engine writes a temporary named by held.key; its header (the tokens it holds)
        then decides the file (index.save_key): auto-<held.key>.bin when it extends or
        replaces what that file held, a branch name when it departs from another conversation
        of the same opener, no file at all when one already holds it and more.

        `check`, when given, runs after the engine wrote the temporary: a reason it returns
        means the state may not be the held conversation's, and the temporary is dropped."""
        key = held.key
        what = f"save to {target or auto_name(key)}"  # a conversation may then go to a branch name
        await self._wait_files()
        short = self.store.check_space(held.n_tokens or 0)
        if short:
            # The prune after this turn evicts the oldest auto files until the next save fits.
            self._free_target = max(self._free_target, self.store.space_needed(held.n_tokens or 0))
            self.counters.skipped_disk_full += 1
            self.counters.save_failures += 1
            return self._save_failed(what, short, key, result)
        t0 = time.monotonic()
        tmp = temp_name(key)
        self.events.emit("saving", slot=s.id, key=key, file=target, n_tokens=held.n_tokens)
        try:
            res = await self.engine.save(s.id, tmp)
        except EngineError as e:
            self.store.discard_temp(key)
            self.counters.save_failures += 1
            return self._save_failed(what, str(e), key, result)
        try:
            self.store.verify_temp(key, res.n_bytes, self.engine.magic)
            header = self._check_header(key, res.n_tokens)
        except StoreError as e:
            self.store.discard_temp(key)
            self.counters.save_failures += 1
            return self._save_failed(what, str(e), key, result)
        if res.n_tokens == 0:
            # The slot holds nothing: not a failed save but a state that is gone (an engine that
            # empties idle slots, a restart). Nothing held blocks the next restore.
            self.store.discard_temp(key)
            if result is not None:
                result.skipped.append(f"{what}: the engine's slot was empty (0 tokens saved)")
            log.info("auto sessions: %s: the engine's slot was empty (0 tokens saved)", what)
            if target is None:
                self.lost(s.id, "the engine's slot was empty when it was saved")
            return SaveOutcome.NOT_TRIED
        if held.n_tokens is None and target is None and res.n_tokens < self.cfg.auto_sessions_min_tokens:
            # The count could not be read before (no GET /slots): the engine's answer decides.
            self.store.discard_temp(key)
            self._skipped(Skip("save", key, policy.BELOW_MIN), result)
            return SaveOutcome.NOT_TRIED
        why = await check() if check is not None else None
        if why:
            self.store.discard_temp(key)
            self.counters.saves_discarded += 1
            log.warning("auto sessions: %s discarded: %s", what, why)
            self.events.emit("save_discarded", slot=s.id, key=key, why=why)
            return SaveOutcome.FAILED
        tokens = encode(comparable(header.tokens)) if header is not None else None
        # Where it goes: the header's tokens against the files of its line.
        line: str | None = key
        how = "key"  # an engine whose files do not show their tokens: by the key, as before
        file_key = key
        if prefix is not None:
            if tokens != prefix:
                self.store.discard_temp(key)
                self.counters.save_failures += 1
                return self._save_failed(what, f"the engine saved {res.n_tokens:,} tokens, not the prefix's "
                                               f"{len(prefix) // 4:,}", key, result)
            line, how = None, "prefix"
        elif target is None and tokens is not None:
            to = save_key(key, tokens, self._saved_file)
            file_key, how = to.key, to.why
            if to.why == "covered":
                self.store.discard_temp(key)
                self.counters.saves_covered += 1
                msg = (f"{what} not kept: {auto_name(to.key)} holds its {res.n_tokens:,} tokens and more")
                log.info("auto sessions: %s", msg)
                self.events.emit("save_covered", slot=s.id, key=key, file=auto_name(to.key), n_tokens=res.n_tokens)
                if result is not None:
                    result.skipped.append(msg)
                return SaveOutcome.SAVED  # the conversation is in a file: as good as saved
        final = target or auto_name(file_key)
        ms = (time.monotonic() - t0) * 1000
        v = s.view
        mine = target is None and prefix is None and v.key == key and v.phase in (Phase.HELD, Phase.RESTORED)
        n_prompt = v.n_prompt if mine and v.n_prompt is not None and v.n_prompt <= res.n_tokens else None
        layout = self._learn_layout(key)
        meta = Meta(key=file_key, n_tokens=res.n_tokens, bytes=res.n_bytes, saved_at=time.time(), model=self.model,
                    save_ms=round(res.ms, 2), line=line, n_prompt=len(prefix) // 4 if prefix is not None else n_prompt,
                    prefix=prefix is not None, layout=layout.fingerprint() if layout else None)
        self.store.acquire(final)
        try:
            fut = asyncio.get_running_loop().run_in_executor(None, self._finalize, key, meta, target, header)
        except BaseException:
            self.store.release(final)
            raise
        self._finalizing[file_key] = fut
        fut.add_done_callback(lambda f: self._finalized(key, file_key, final, f, meta if target is None else None))
        if mine:
            # The engine's count is the truth (a client's usage may differ by one), and the
            # header says token for token what the slot holds.
            self._set(s, dataclasses.replace(v, n_tokens=res.n_tokens, tokens=tokens, file=final))
        self.counters.saves += 1
        if how == "branch":
            self.counters.saves_branched += 1
        self.counters.bytes_saved += res.n_bytes
        self.counters.ms_saved += res.ms
        log.info("auto sessions: saved %s tokens (%s) to %s in %.0f ms%s", fmt_tokens(res.n_tokens),
                 fmt_bytes(res.n_bytes), final, ms,
                 f" (conversation {key}: {how})" if how not in ("key", "new", "extends") else "")
        info = {"key": key, "file": final, "n_tokens": res.n_tokens, "bytes": res.n_bytes,
                "engine_ms": round(res.ms, 2), "ms": round(ms, 2), "named": how}
        self.events.emit("saved", slot=s.id, **info)
        if result is not None:
            result.saved = info
        return SaveOutcome.SAVED

    def _check_header(self, key: str, n_saved: int) -> slotfile.SlotHeader | None:
        """The file's own header must agree with the engine's answer (llama-server files).
        Returns it: the tokens the file holds (None for engines whose files we cannot read)."""
        if self.engine.magic != slotfile.MAGIC_BYTES:
            return None
        path = self.store.temp_path(key)
        try:
            header = slotfile.read_header(path)
        except (slotfile.BadSlotFile, OSError) as e:
            raise StoreError(f"{path.name}: {e}") from None
        if header.n_tokens != n_saved:
            raise StoreError(f"{path.name} holds {header.n_tokens:,} tokens by its header, the engine reported "
                             f"{n_saved:,}")
        return header

    def _learn_layout(self, key: str) -> slotfile.KVLayout | None:
        """The KV layout of a state file this engine just wrote: it is the engine's layout."""
        if self.engine.magic != slotfile.MAGIC_BYTES:
            return None
        try:
            layout = slotfile.read_layout(self.store.temp_path(key))
        except (slotfile.BadSlotFile, OSError) as e:
            log.debug("auto sessions: KV layout of %s: %s", key, e)
            return None
        if self.engine_layout is None or self.engine_layout.v_trans is None:
            self.engine_layout = layout
        return layout

    def _finalize(self, key: str, meta: Meta, target: str | None, header: slotfile.SlotHeader | None) -> None:
        """In a worker thread: make the temporary of `key` final, then index it."""
        if target is None:
            self.store.finalize(key, meta)
            name, model = auto_name(meta.key), self.model
        else:
            self.store.finalize_manual(key, target)
            name, model = target, self.model  # parked by us: its model is known
        if self.index is not None and header is not None:
            try:
                self.index.add(name, header.tokens, model)
            except (OSError, ValueError) as e:  # the file is final either way; a rescan finds it
                log.warning("auto sessions: indexing %s: %s", name, e)

    def _finalized(self, key: str, file_key: str, final: str, fut: asyncio.Future, meta: Meta | None = None) -> None:
        """meta: an auto file's (a conversation, a branch, a prefix): uploaded to the shared
        bucket once final. People's parked names stay local."""
        if self._finalizing.get(file_key) is fut:
            del self._finalizing[file_key]
        self.store.release(final)
        exc = fut.exception() if not fut.cancelled() else None
        if exc is None and not fut.cancelled() and meta is not None and self.remote is not None:
            try:
                # Queued only: the worker thread uploads it (a newer save of the name replaces it).
                self.remote.shared.upload_later(self.store.bin_path(meta.key), meta)
            except SharedError as e:
                log.warning("auto sessions: shared: not uploading %s: %s", final, e)
        if exc is not None:
            self.counters.save_failures += 1
            self.store.discard_temp(key)
            if final == auto_name(file_key) and self.store.read_meta(file_key) is None:
                with contextlib.suppress(StoreError, OSError):
                    self.store.remove(file_key)
                if self.index is not None:
                    self.index.remove(final)
            log.error("auto sessions: finalize of %s: %s", final, exc)
            self.events.emit("save_failed", key=key, file=final, error=str(exc))

    def _save_failed(self, what: str, why: str, key: str, result: TurnResult | None) -> SaveOutcome:
        log.warning("auto sessions: %s: %s", what, why)
        self.events.emit("save_failed", key=key, error=why)
        if result is not None:
            result.errors.append(f"{what}: {why}")
        return SaveOutcome.FAILED

    # -- restore -----------------------------------------------------------------
    async def _restore(self, s: Slot, key: str | None, result: TurnResult | None, name: str | None = None) -> bool:
        """Restore auto-<key>.bin (or a person's file `name`, key None) into slot s."""
        name = name or auto_name(key or "")
        await self._keep_starts_out(s)  # another request starting in between would empty the restored slot
        t0 = time.monotonic()
        try:
            with self.store.using(name):
                try:
                    res = await self.engine.restore(s.id, name)
                except EngineRefused as e:
                    # A unified KV cache shared by every slot can be too full for the file; the
                    # engine never evicts another slot itself. Make room once, then try again.
                    if NO_KV_ROOM not in str(e) or not await self._make_room(s, name):
                        raise
                    res = await self.engine.restore(s.id, name)
        except EngineError as e:
            self.counters.restore_failures += 1
            log.warning("auto sessions: restore of %s: %s", name, e)
            self.events.emit("restore_failed", slot=s.id, key=key, file=name, error=str(e))
            if result is not None:
                result.errors.append(f"restore of {name}: {e}")
            if self.engine.kind == "llama-server":  # it clears the slot when a restore fails
                self._set(s, View(Phase.EMPTY))
            else:
                self.lost(s.id, f"the restore of {name} failed")
            return False
        ms = (time.monotonic() - t0) * 1000
        self.counters.restores += 1
        self.counters.bytes_restored += res.n_bytes
        self.counters.ms_restored += res.ms
        if key is not None:
            self._set(s, View(Phase.RESTORED, key, n_tokens=res.n_tokens, restored=res.n_tokens, file=name))
        else:
            # A person's file: what conversation it holds has no key, so it is never saved under one.
            self._set(s, View(Phase.UNKNOWN, n_tokens=res.n_tokens, why=f"{name} restored by hand"))
        log.info("auto sessions: restored %s tokens from %s in %.0f ms", fmt_tokens(res.n_tokens), name, ms)
        info = {"key": key, "file": name, "n_tokens": res.n_tokens, "bytes": res.n_bytes,
                "engine_ms": round(res.ms, 2), "ms": round(ms, 2)}
        self.events.emit("restored", slot=s.id, **info)
        if result is not None:
            result.restored = info
        return True

    async def _keep_starts_out(self, s: Slot) -> None:
        """Before a restore or a prefix read into slot s, on an engine that empties idle slots
        at every start: no other request starts until s's own has (launch_started, or the
        ticket's release)."""
        if self.clears_idle_slots and len(self.slots) > 1 and s.holder is not None and not s.holds_launch:
            await self.launches.acquire("exclusive")
            s.holds_launch = "exclusive"

    async def _make_room(self, s: Slot, name: str) -> bool:
        """Empty the least recently used other slot that is free now, saving its conversation
        first when worth it. False when there is none."""
        others = sorted((o for o in self.slots.values() if o is not s and not o.busy), key=lambda o: o.last_used)
        for o in others:
            ticket = self._try_admit(o)
            if ticket is None:
                continue
            try:
                held = o.view.held()
                await self._wait_files()
                step = policy.plan_save(held, Occasion.KEYLESS, self.cfg.auto_sessions_min_tokens,
                                        self._held_info(o.view), self.model)
                if isinstance(step, Save) and held is not None:
                    await self._save(o, held, None)
                n = await self.engine.erase(o.id)
                log.info("auto sessions: emptied slot %d (%s tokens) to make room in the KV cache for %s", o.id,
                         fmt_tokens(n), name)
                self.events.emit("slot_emptied", slot=o.id, why=f"room for {name}")
                self._set(o, View(Phase.EMPTY))
                return True
            except EngineError as e:
                log.warning("auto sessions: making room on slot %d for %s: %s", o.id, name, e)
                return False
            finally:
                ticket.release()
        return False

    # -- commands and the other inputs' occasions ------------------------------------
    async def park(self, slot_id: int | None = None, name: str | None = None) -> dict[str, Any]:
        """Save the held conversation now, whatever its size; with a name, to NAME.bin."""
        target = manual_name(name) if name is not None else None
        async with await self.admit(slot_id) as t:
            s = self._slot_of(t)
            if not await self._observe(s):
                raise StoreError(f"a request that did not come through autosessd is running on slot {s.id}")
            v = s.view
            held = v.held()
            if held is None and target is not None and v.phase is Phase.UNKNOWN:
                # What the slot holds has no key, but the person asked for it by name.
                held = Held(f"park-{s.id}", v.n_tokens, True)
            if held is None:
                raise StoreError(f"slot {s.id} holds no conversation autosessd can name ({v.phase.value}"
                                 f"{': ' + v.why if v.why else ''})")
            res = TurnResult(key=held.key)
            outcome = await self._save(s, held, res, target)
            await self._wait_file(held.key)
        if outcome is not SaveOutcome.SAVED:
            raise StoreError("; ".join(res.errors) or "save failed")
        return res.saved or {}

    async def restore_now(self, what: str, slot_id: int | None = None) -> dict[str, Any]:
        """Restore auto-<KEY>.bin or a manual NAME.bin into the slot."""
        from .keys import is_key

        if is_key(what):
            key: str | None = what
            name = auto_name(what)
            meta = self.store.read_meta(what)
            if meta is None:
                raise StoreError(f"no session {name} in {self.store.path}")
            if meta.model != self.model:
                raise StoreError(f"{name} was saved for another model ({meta.model}, engine has {self.model})")
        else:
            key, name = None, manual_name(what)
            if not (self.store.path / name).is_file():
                raise StoreError(f"no session {name} in {self.store.path}")
        async with await self.admit(slot_id) as t:
            s = self._slot_of(t)
            if not await self._observe(s):
                raise StoreError(f"a request that did not come through autosessd is running on slot {s.id}")
            res = TurnResult(key=key)
            # Like a switch: the held conversation is saved before the restore replaces it.
            held = s.view.held()
            step = policy.plan_save(held, Occasion.SWITCH if key else Occasion.KEYLESS,
                                    self.cfg.auto_sessions_min_tokens, self._held_info(s.view), self.model, key)
            if isinstance(step, Save) and held is not None:
                await self._save(s, held, res)
            if not await self._restore(s, key, res, name):
                raise StoreError("; ".join(res.errors))
        return res.restored or {}

    def forget(self, key: str) -> int:
        """Remove auto-<key>.bin. A slot still holding the conversation keeps it; it is
        saved again only if the conversation goes on (its file is gone, so not up to date)."""
        freed = self.store.remove(key)
        if self.index is not None:
            self.index.remove(auto_name(key))
        self.events.emit("forgot", key=key, bytes=freed)
        return freed

    async def save_held(self, slot_id: int | None = None, why: str = "stop") -> bool:
        """Save the held conversation if it reached min tokens and the engine is idle
        (a running request's state is partial). Used on a normal stop; the caller bounds it."""
        async with await self.admit(slot_id) as t:
            s = self._slot_of(t)
            st = await self._look(s)
            if st is not None and st.is_processing:
                log.warning("auto sessions: %s save skipped: a request is running on slot %d and its state "
                            "is partial", why, s.id)
                return False
            await self._observe(s)
            held = s.view.held()
            step = policy.plan_save(held, Occasion.STOP, self.cfg.auto_sessions_min_tokens,
                                    self._held_info(s.view), self.model)
            if held is None:
                log.info("auto sessions: %s: slot %d holds no conversation to save (%s)", why, s.id,
                         s.view.phase.value)
                return False
            if isinstance(step, Skip):
                log.info("auto sessions: %s: %s holds %s tokens: not saved (%s)", why, auto_name(held.key),
                         fmt_tokens(held.n_tokens), step.reason)
                return step.reason == policy.UP_TO_DATE
            outcome = await self._save(s, held, None)
        await self.drain()
        return outcome is SaveOutcome.SAVED

    async def save_behind(self, slot_id: int, check: Callable[[int | None], Awaitable[str | None]]) -> bool:
        """Tail: the held conversation's request ended and nothing else is in flight. Save it
        if its file is stale, keeping the file only if check(the slot's count before the save)
        finds that nothing else reached the slot meanwhile."""
        async with await self.admit(slot_id) as t:
            s = self._slot_of(t)
            st = await self._look(s)
            if st is not None and st.is_processing:
                return False
            held = s.view.held()
            step = policy.plan_save(held, Occasion.BEHIND, self.cfg.auto_sessions_min_tokens,
                                    self._held_info(s.view), self.model)
            if not isinstance(step, Save) or held is None:
                return False
            n_before = st.n_tokens if st is not None else None
            outcome = await self._save(s, held, None, check=lambda: check(n_before))
        return outcome is SaveOutcome.SAVED

    async def restore_behind(self, slot_id: int, key: str, check: Callable[[], Awaitable[str | None]]) -> bool:
        """Tail, after an engine restart: restore auto-<key>.bin if the turn's rules allow it,
        and trust it only if check() finds that no request reached the slot meanwhile (the
        engine defers a restore on a busy slot, so it may land after someone's request)."""
        async with await self.admit(slot_id) as t:
            s = self._slot_of(t)
            file = await self._wait_file(key)
            step = policy.plan_restore(None, key, SaveOutcome.NOT_TRIED, file, self.model,
                                       self.cfg.auto_sessions_min_tokens, self.engine_layout)
            if isinstance(step, Skip):
                self._skipped(step, None)
                return False
            if not await self._restore(s, key, None):
                return False
            why = await check()
            if why:
                log.warning("auto sessions: the restore of %s is not trusted: %s", auto_name(key), why)
                self.lost(s.id, why)
                return False
        return True

    # -- prune -------------------------------------------------------------------
    def schedule_prune(self) -> None:
        if self._prune_task is None or self._prune_task.done():
            self._prune_task = asyncio.get_running_loop().create_task(self._prune_quietly())

    async def _prune_quietly(self) -> None:
        try:
            await self.prune()
        except Exception as e:
            log.warning("auto sessions: prune: %s", e)

    async def prune(self, keep: int | None = None, max_gb: float | None = None,
                    dry_run: bool = False) -> dict[str, Any]:
        keep = self.cfg.auto_sessions_keep if keep is None else keep
        max_bytes = int((self.cfg.auto_sessions_max_gb if max_gb is None else max_gb) * 1e9)
        free_target, self._free_target = (0, self._free_target) if dry_run else (self._free_target, 0)
        plan = await asyncio.get_running_loop().run_in_executor(None, self.store.prune, keep, max_bytes, dry_run,
                                                                free_target)
        removed = [{"key": e.key, "file": e.name, "bytes": e.bytes} for e in plan.remove]
        if removed and not dry_run:
            self.counters.pruned_files += len(removed)
            self.counters.pruned_bytes += plan.freed
            for r in removed:
                log.info("auto sessions: pruned %s (%s)", r["file"], fmt_bytes(r["bytes"]))
                if self.index is not None:
                    self.index.remove(r["file"])
            self.events.emit("pruned", files=[r["file"] for r in removed], bytes=plan.freed)
            await self._save_index()
        return {"removed": removed, "freed": plan.freed, "dry_run": dry_run, "kept": len(plan.keep)}

    # -- the token index -----------------------------------------------------------
    async def prepare(self) -> None:
        """At start, after store.cleanup(): index the session files (from the cache in the
        state directory when their files did not change) and learn the model's sliding
        window. Without an index every restore follows the key rule."""
        loop = asyncio.get_running_loop()
        index = TokenIndex(self.store.path, self.cfg.effective_state_dir() / "index.cache")
        try:
            rep = await loop.run_in_executor(None, index.scan)
        except OSError as e:
            log.warning("auto sessions: cannot index %s (%s): files are restored by their key only", self.store.path, e)
            return
        self.index = index
        log.info("auto sessions: indexed %d session files in %.0f ms (cache: %s, %d from it, %d headers read)",
                 rep.files, rep.seconds * 1000, rep.cache, rep.from_cache, rep.read)
        for name, why in sorted(rep.skipped.items()):
            log.warning("auto sessions: not indexed: %s: %s", name, why)
        self.swa_window = await self._swa_window()

    async def _swa_window(self) -> int | None:
        """engine.swa_window when set (0: none), else the model file's sliding window."""
        if self.cfg.engine.swa_window is not None:
            return self.cfg.engine.swa_window or None
        if self.engine.kind != "llama-server":
            return None
        try:
            path = (await self.engine.info()).model_path
            if not path:
                raise ValueError("the engine does not say where its model file is (/props model_path)")
            n = await asyncio.get_running_loop().run_in_executor(None, gguf.sliding_window, path)
        except (EngineError, OSError, ValueError) as e:
            log.info("auto sessions: the model's sliding window is not known (%s); set engine.swa_window if it has "
                     "one (Gemma 2/3, ...), or restores of long files may not be reused", e)
            return None
        if n:
            log.info("auto sessions: the model has a sliding window of %s tokens: a file is restored only when it "
                     "holds fewer than that past what it shares with the request", fmt_tokens(n))
        return n or None

    async def _save_index(self) -> None:
        if self.index is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.index.save_cache)
        except OSError as e:
            log.warning("auto sessions: cannot write the index cache %s: %s", self.index.cache_path, e)

    async def close(self) -> None:
        """At stop, after drain(): keep the index for the next start."""
        await self._save_index()
        self._drop_primer()

    async def drain(self) -> None:
        """Wait for every background finalize and prune (at shutdown, and in tests)."""
        while self._finalizing or (self._prune_task and not self._prune_task.done()):
            pending = list(self._finalizing.values())
            if self._prune_task and not self._prune_task.done():
                pending.append(self._prune_task)
            await asyncio.gather(*pending, return_exceptions=True)

    # -- engine restarts -----------------------------------------------------------
    def engine_identity(self) -> tuple[int, float] | None:
        """(pid, start time) of the process listening on the engine's port, when it runs on
        this host and is visible to us; None otherwise. Blocking (psutil)."""
        u = urlsplit(self.cfg.engine.url)
        if self.cfg.engine.kind != "llama-server" or u.hostname not in ("127.0.0.1", "localhost", "::1"):
            return None
        port = u.port or (443 if u.scheme == "https" else 80)
        try:
            for c in psutil.net_connections("tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                    return c.pid, psutil.Process(c.pid).create_time()
        except (psutil.Error, OSError):
            return None
        return None

    async def watch_engine(self, every_s: float = 2.0, identity_every_s: float = 10.0) -> None:
        """Notice the engine restarting: /health going down and up, or another process on
        its port. Either way what it held is gone: reset, and tell on_engine_restart."""
        loop = asyncio.get_running_loop()
        identity = await loop.run_in_executor(None, self.engine_identity)
        last_identity_check = time.monotonic()
        up_before = True
        while True:
            await asyncio.sleep(every_s)
            try:
                up = await self.engine.health()
            except EngineError:
                up = False
            self.engine_healthy = up
            restarted = None
            if not up and up_before:
                log.warning("engine: %s is down", self.engine.address)
            elif up and not up_before:
                log.info("engine: %s is back", self.engine.address)
                restarted = "the engine restarted (health went down and up)"
            up_before = up
            if up and restarted is None and time.monotonic() - last_identity_check >= identity_every_s:
                last_identity_check = time.monotonic()
                ident = await loop.run_in_executor(None, self.engine_identity)
                if ident and identity and ident != identity:
                    restarted = f"another engine process (pid {ident[0]}) took its port"
                identity = ident or identity
            if restarted:
                for sid in list(self.slots):
                    self.lost(sid, restarted)
                self._drop_primer()  # the engine's: made again, by the new one, when next needed
                self._primer_off = False
                self._ran.clear()  # its RAM cache is gone
                for callback in list(self.on_engine_restart):
                    try:
                        await callback()
                    except Exception as e:
                        log.warning("engine restart handling: %s", e)

    # -- status ------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        entries = self.store.scan(with_meta=False)
        try:
            free = self.store.free_bytes()
        except OSError:
            free = None
        return {
            "version": __version__,
            "uptime_s": round(time.time() - self.started_at, 1),
            "auto_sessions": self.cfg.auto_sessions,
            "engine": {"kind": self.engine.kind, "url": self.engine.address, "healthy": self.engine_healthy,
                       "model": self.model_name, "model_fingerprint": self.model, "slots": len(self.slots) or 1,
                       "slots_visible": self.slots_visible},
            "slots": [{**self._slot_status(s), "file": s.view.file, "last_restore": self.last_restores.get(s.id)}
                      for s in sorted(self.slots.values(), key=lambda x: x.id)],
            "counters": asdict(self.counters),
            "last_not_reused": self.last_not_reused,
            "store": {"path": str(self.store.path), "auto_files": len(entries),
                      "auto_bytes": sum(e.bytes for e in entries), "free_bytes": free,
                      "min_tokens": self.cfg.auto_sessions_min_tokens, "keep": self.cfg.auto_sessions_keep,
                      "max_gb": self.cfg.auto_sessions_max_gb},
            "index": None if self.index is None else {"files": len(self.index), "skipped": len(self.index.skipped),
                                                      "swa_window": self.swa_window},
            "inputs": {name: describe() for name, describe in self.inputs.items()},
            "shared": None if self.remote is None else self.remote.status(),
        }

    @staticmethod
    def _slot_status(s: Slot) -> dict[str, Any]:
        v = s.view
        named = v.phase in (Phase.HELD, Phase.RESTORED, Phase.SWITCHED)
        return {"id": s.id, "state": v.phase.value, "held": v.key if named else None,
                "n_tokens": v.n_tokens if v.phase is not Phase.SWITCHED else None,
                "durable": v.durable if v.phase in (Phase.HELD, Phase.RESTORED) else None,
                "awaiting_verification": v.restored is not None, "busy": s.busy, "why": v.why or None}

    def ls(self) -> list[dict[str, Any]]:
        """Every session file: ours (auto: a conversation's, or a shared prefix) and people's
        (manual), newest first. `line`: the first-message key of the conversation an auto
        file holds; `words`: its first words, when ls_words() has read them. Blocking: rescans
        the index (people's files come and go without us)."""
        if self.index is not None:
            self.index.scan()
        held = {s.view.file for s in self.slots.values() if s.view.held() and s.view.file}
        rows = [{"name": e.name, "kind": "prefix" if e.meta and e.meta.prefix else "auto", "key": e.key,
                 "line": e.meta.line if e.meta else None, "bytes": e.bytes, "saved_at": e.saved_at,
                 "n_tokens": e.meta.n_tokens if e.meta else None,
                 "model_ok": bool(e.meta and e.meta.model == self.model), "held": e.name in held}
                for e in self.store.scan()]
        rows += [{"name": name, "kind": "manual", "key": None, "line": None, "bytes": size, "saved_at": mtime,
                  "n_tokens": None, "model_ok": None, "held": name in held}
                 for name, size, mtime in self.store.manual_files()]
        for r in rows:
            e = self.index.get(r["name"]) if self.index is not None else None
            if e is not None and r["n_tokens"] is None:
                r["n_tokens"] = e.n_tokens
            if e is not None and r["model_ok"] is None and e.model is not None:
                r["model_ok"] = e.model == self.model
            hit = self._words.get(r["name"])
            r["words"] = hit[1] if hit is not None and e is not None and hit[0] == e.ident else None
        return sorted(rows, key=lambda r: r["saved_at"], reverse=True)

    async def ls_words(self, n_tokens: int = 40, max_chars: int = 72) -> list[dict[str, Any]]:
        """ls() with each file's first words (its first tokens detokenized by the engine,
        the template's markers left out), so a person can tell conversations apart. Read
        once per file (by its inode, mtime and size) and kept; ls runs off the loop."""
        rows = await asyncio.get_running_loop().run_in_executor(None, self.ls)
        detokenize = getattr(self.engine, "detokenize", None)
        if detokenize is None or self.index is None:
            return rows
        for r in rows:
            e = self.index.get(r["name"])
            if r["words"] is not None or e is None or not e.tokens:
                continue
            try:
                text = await detokenize(decode(e.tokens[:4 * n_tokens]))
            except EngineError as err:
                log.debug("auto sessions: ls: cannot detokenize %s: %s", r["name"], err)
                break  # the engine is not answering: the rest would not fare better
            words = first_words(text, max_chars)
            self._words[r["name"]] = (e.ident, words)
            r["words"] = words
        live = {r["name"] for r in rows}
        for name in [n for n in self._words if n not in live]:
            del self._words[name]
        return rows

    # -- what was held at the last stop --------------------------------------------
    def state_file(self) -> Path:
        return self.cfg.effective_state_dir() / "held.json"

    def record_held(self) -> None:
        """Remember the held conversations (for a restore after a restart)."""
        data = {"model": self.model, "slots": {str(s.id): {"key": s.view.key, "n_tokens": s.view.n_tokens}
                                               for s in self.slots.values()
                                               if s.view.key and s.view.phase is not Phase.UNKNOWN}}
        path = self.state_file()
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("auto sessions: could not record the held conversation in %s: %s", path, e)

    def recorded_held(self) -> dict[int, str]:
        try:
            data = json.loads(self.state_file().read_text())
            if data.get("model") != self.model:
                return {}
            return {int(k): str(v["key"]) for k, v in data.get("slots", {}).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}
