"""One engine slot: what autosessd knows it holds, as one checked state machine (STYLE §13).

    EMPTY     holds nothing: a slot a failed restore or a make-room cleared
    SWITCHED  a request of `key` (None: a request without a conversation) was let through
              and its end is not seen yet; `prior` is what the slot held before it
    HELD      holds conversation `key`, n_tokens of it (the engine's count); durable, or
              provisional after a cancelled request (a partial state)
    RESTORED  holds a session file as the engine restored it; the next response's
              timings.cache_n verifies that the engine reused it
    UNKNOWN   may hold anything (the engine restarted, a request or slot action that bypassed
              the FIFO, a person's file restored by hand, a request without a conversation):
              never saved under a key. A slot not seen since autosessd started is UNKNOWN too.

Every change of a slot's view is one of these events, and `_change` refuses any other
(InvalidTransition: a bug, never a user's input):

    event            from                      to                      when
    START            any                       SWITCHED                a request starts (turn, a log line)
    NOTE             SWITCHED                  SWITCHED                what the turn learned (tokens, messages,
                                                                       file); the primer became the prior
    END              SWITCHED                  at rest                 its end was seen, or settled (settle())
    RESTORED         at rest                   RESTORED, UNKNOWN       a restore succeeded (UNKNOWN: a person's
                                                                       file, which has no key)
    RESTORE_FAILED   at rest                   EMPTY                   llama-server clears a slot it failed to fill
    ERASED           at rest                   EMPTY                   emptied to make room in the KV cache
    SAVED            HELD, RESTORED            the same phase          a save: the engine's count, the header's
                                                                       tokens, the file that now holds it
    PREFIX_READ      at rest                   HELD                    a shared prefix read on its own
    LOST             any                       UNKNOWN                 the engine's truth disagrees with the view:
                                                                       the one transition allowed from anywhere

("at rest": EMPTY, HELD, RESTORED, UNKNOWN — no request of ours in flight.) `prior` exists
only in SWITCHED and `restored` only in SWITCHED and RESTORED; _change drops them elsewhere.

Besides its view a Slot carries the coordination fields of the rooms that use it, each
written only by its owner: placement.py (owner, placing, last_used), launch.py
(launch_hold, start_pending, looked, place_watch), observe.py (task_id, seen_cache_n,
watcher). The view is read by all; only the methods below change it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable

from ..engines.base import SlotState
from .policy import Held

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger("autosessd")


class Phase(Enum):
    EMPTY = "empty"
    SWITCHED = "switched"
    HELD = "held"
    RESTORED = "restored"
    UNKNOWN = "unknown"


class Event(Enum):
    START = "start"
    NOTE = "note"
    END = "end"
    RESTORED = "restored"
    RESTORE_FAILED = "restore_failed"
    ERASED = "erased"
    SAVED = "saved"
    PREFIX_READ = "prefix_read"
    REWOUND = "rewound"
    LOST = "lost"


AT_REST = frozenset({Phase.EMPTY, Phase.HELD, Phase.RESTORED, Phase.UNKNOWN})
_ANY = frozenset(Phase)
SAME = None  # SAVED keeps the phase it finds

# event → (phases it may start from, phases it may lead to; SAME: the phase it started from)
TRANSITIONS: dict[Event, tuple[frozenset[Phase], frozenset[Phase] | None]] = {
    Event.START: (_ANY, frozenset({Phase.SWITCHED})),
    Event.NOTE: (frozenset({Phase.SWITCHED}), frozenset({Phase.SWITCHED})),
    Event.END: (frozenset({Phase.SWITCHED}), AT_REST),
    Event.RESTORED: (AT_REST, frozenset({Phase.RESTORED, Phase.UNKNOWN})),
    Event.RESTORE_FAILED: (AT_REST, frozenset({Phase.EMPTY})),
    Event.ERASED: (AT_REST, frozenset({Phase.EMPTY})),
    Event.SAVED: (frozenset({Phase.HELD, Phase.RESTORED}), SAME),
    Event.PREFIX_READ: (AT_REST, frozenset({Phase.HELD})),
    Event.REWOUND: (frozenset({Phase.HELD}), frozenset({Phase.HELD})),
    Event.LOST: (_ANY, frozenset({Phase.UNKNOWN})),
}


def allowed(event: Event, frm: Phase, to: Phase) -> bool:
    sources, targets = TRANSITIONS[event]
    return frm in sources and (to is frm if targets is SAME else to in targets)


class InvalidTransition(RuntimeError):
    """A code path asked for a change the table does not allow: a bug."""


@dataclass(frozen=True)
class View:
    """What one slot holds, as far as autosessd knows (the module docstring has the phases)."""

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
    # n_prompt  of n_tokens, the prompt of the last reply (a save records it: branches.save_key)
    # body      that request's chat body (kept only for a model with a sliding window or recurrent
    #           layers: rewind.py asks the engine for its prompt's tokens when the turn did not)
    tokens: bytes | None = None
    messages: tuple[str, ...] | None = None
    file: str | None = None
    n_prompt: int | None = None
    body: dict | None = dataclasses.field(default=None, compare=False, repr=False)
    # rewound  the slot was taken back to one token before its last prompt's end (rewind.py):
    #          a state the engine reuses where the longer one is not; saved as such
    rewound: bool = False

    def conversation(self) -> Held | None:
        """The conversation a save would write, when the slot holds one we can name."""
        if self.phase in (Phase.HELD, Phase.RESTORED) and self.key is not None:
            return Held(self.key, self.n_tokens, self.durable)
        return None

    @property
    def slot_tokens(self) -> int | None:
        """What GET /slots should show for this state, when we know it."""
        return 0 if self.phase is Phase.EMPTY else self.n_tokens if self.phase in (Phase.HELD, Phase.RESTORED) else None

    @property
    def never_ran(self) -> bool:
        """Not seen since autosessd started, or emptied: nothing a client restored by hand."""
        return self.why == NOT_SEEN or self.phase is Phase.EMPTY


NOT_SEEN = "not seen since autosessd started"
# Slot.task_id after a request ran whose task id autosessd did not see (an end read from a log
# with later lines behind it, settled without a look): the next look takes the engine's id as
# the slot's own instead of taking it for a request that bypassed autosessd. The engine's ids
# are never negative.
TASK_UNSEEN = -1
UNKNOWN_AT_START = View(Phase.UNKNOWN, n_tokens=None, why=NOT_SEEN)


@dataclass(frozen=True)
class Verify:
    """A restore the end of its request can verify: the engine should have reused `restored`
    tokens of conversation `key` (observe.py compares that with the response's cache_n)."""

    key: str
    restored: int
    cache_n: int | None  # read from GET /slots while the request ran (hook, tail), when the response had none


class Slot:
    def __init__(self, slot_id: int):
        self.id = slot_id
        self._view = UNKNOWN_AT_START
        # observe.py: the engine's id_task when we last looked (a new one means a request ran;
        # TASK_UNSEEN: ours ran, under an id not seen), and (task id, cache_n) read from GET /slots
        # while a request ran.
        self.task_id: int | None = None
        self.seen_cache_n: tuple[int, int] | None = None
        self.watcher: asyncio.Task | None = None
        # placement.py: who has the slot's FIFO now, the conversation it placed here before its
        # turn names it, and when a ticket was last handed out (least recently used first).
        self.owner: Any = None  # a placement.Ticket: the slot keeps it for placement.py, never reads it
        self.placing: str | None = None
        self.last_used = 0.0
        self.keyless_prompt: str | bytes | None = None  # the last request's, when it had no key
        # launch.py: the owner's hold on the engine's starts; its request sent and not yet seen
        # placed; the turn's look (starts before it, another start pending, what it saw); what
        # looks for the placement after the hold ended.
        self.launch_hold: Any = None  # a launch.Hold, kept for launch.py
        self.start_pending = False
        self.looked: tuple[int, bool, SlotState | None] | None = None
        self.place_watch: asyncio.Task | None = None
        # Told of every change of the view, after it (held.Recorder: what the slot held last).
        self.on_change: Callable[[Slot], None] | None = None

    def __repr__(self) -> str:
        return f"Slot({self.id}, {self._view.phase.value} {self._view.key or ''})"

    @property
    def view(self) -> View:
        return self._view

    @property
    def busy(self) -> bool:
        return self.owner is not None

    def has(self, key: str) -> bool:
        """The conversation is on this slot: held, restored, running, or just placed here."""
        v = self._view
        return self.placing == key or (v.key == key and v.phase in (Phase.HELD, Phase.RESTORED, Phase.SWITCHED))

    def at_rest(self) -> bool:
        return self._view.phase in AT_REST

    # -- the one writer -----------------------------------------------------------------
    def _change(self, event: Event, new: View) -> View:
        old = self._view
        if not allowed(event, old.phase, new.phase):
            raise InvalidTransition(f"slot {self.id}: {event.value} from {old.phase.value} to {new.phase.value}")
        if new.phase is not Phase.SWITCHED and new.prior is not None:
            new = dataclasses.replace(new, prior=None)
        if new.phase not in (Phase.SWITCHED, Phase.RESTORED) and new.restored is not None:
            new = dataclasses.replace(new, restored=None)
        if (new.phase, new.key) != (old.phase, old.key):
            log.debug("auto sessions: slot %d: %s %s → %s %s (%s)", self.id, old.phase.value, old.key or "",
                      new.phase.value, new.key or "", event.value)
        self._view = new
        if self.on_change is not None:
            try:
                self.on_change(self)
            except Exception as e:  # a record's bug must not stop the state machine
                log.exception("auto sessions: slot %d: recording its change: %s", self.id, e)
        return new

    # -- transitions ---------------------------------------------------------------------
    def start(self, key: str | None, tokens: bytes | None = None, messages: tuple[str, ...] | None = None,
              file: str | None = None, n_prompt: int | None = None, body: dict | None = None) -> None:
        """START: a request of `key` starts on the slot now, whatever we do (after a turn, with
        what the turn learned of it; or seen in a request log). n_prompt: its prompt's length,
        when the turn asked the engine for its tokens (the turn hook's requests report no end,
        so nothing else says how much of the state they leave is prompt)."""
        v = self._view
        if v.phase is Phase.SWITCHED:
            # Another request whose end was not seen is still ahead of this one on the slot.
            prior = v.prior if v.key == key else View(Phase.UNKNOWN, n_tokens=None,
                                                       why="two requests overlapped on the slot")
            restored = v.restored if v.key == key else None
        else:
            prior, restored = v, (v.restored if v.key == key else None)
        self.seen_cache_n = None
        self._change(Event.START, View(Phase.SWITCHED, key, n_tokens=None, restored=restored, prior=prior,
                                       tokens=tokens, messages=messages, file=file, n_prompt=n_prompt, body=body))

    def note(self, **changes: Any) -> None:
        """NOTE: what the turn learned of the request that runs next (SWITCHED only)."""
        self._change(Event.NOTE, dataclasses.replace(self._view, **changes))

    def ending(self, key: str | None) -> bool:
        """Compare (the first half of a compare-and-swap): is the slot running the request of
        `key` whose end this is? An end of anything else changes nothing."""
        return self._view.phase is Phase.SWITCHED and self._view.key == key

    def settle(self, status: str, st: SlotState | None, n_tokens: int | None, n_prompt: int | None,
               slots_visible: bool) -> Verify | None:
        """END: SWITCHED → what the slot holds after its request. status: ok | cancelled |
        error (failed part-way) | rejected (a 4xx before it ran) | not_run. st: the engine's
        slot right after the end (None: not read). Returns the restore to verify, if any."""
        v = self._view
        if v.phase is not Phase.SWITCHED:
            raise InvalidTransition(f"slot {self.id}: settle from {v.phase.value}")
        prior = v.prior or View(Phase.UNKNOWN, n_tokens=None)
        if n_prompt is None:
            n_prompt = v.n_prompt  # what the turn learned of the request's prompt
        n = st.n_tokens if st is not None else n_tokens
        # The engine's slot shows what it showed before the request: the request changed nothing.
        unchanged = st is not None and prior.slot_tokens is not None and st.n_tokens == prior.slot_tokens
        if status == "not_run" or (status in ("error", "rejected", "cancelled") and unchanged):
            new = prior
        elif status == "rejected" and st is None and not slots_visible:
            new = prior  # cannot look; a 4xx from llama-server comes before anything runs
        elif status in ("error", "rejected"):
            new = View(Phase.UNKNOWN, n_tokens=None, why=f"a request of {v.key or 'no conversation'} failed part-way")
        elif v.key is None:
            new = View(Phase.UNKNOWN, n_tokens=None, why="a request without a conversation ran")
        elif status == "ok":
            new = View(Phase.HELD, v.key, n_tokens=n, tokens=v.tokens, messages=v.messages, file=v.file,
                       n_prompt=n_prompt if n_prompt is not None and (n is None or n_prompt <= n) else None,
                       body=v.body)
        else:  # cancelled part-way: how much of the prompt it holds is not known
            new = View(Phase.HELD, v.key, n_tokens=n, durable=False, file=v.file)
        verify = None
        if v.restored is not None and v.key is not None and new.phase is Phase.HELD:
            seen = self.seen_cache_n[1] if self.seen_cache_n is not None else None
            verify = Verify(v.key, v.restored, seen)
        self.seen_cache_n = None
        self._change(Event.END, new)
        return verify

    def restored(self, key: str | None, n_tokens: int, file: str, expect: int | None = None,
                 tokens: bytes | None = None) -> None:
        """RESTORED: the engine restored `file` (n_tokens). key None: a person's file, whose
        conversation has no key — held as UNKNOWN, never saved under one. expect: the tokens
        the engine should reuse (all of it by default), checked against the next cache_n."""
        if key is None:
            self._change(Event.RESTORED, View(Phase.UNKNOWN, n_tokens=n_tokens, why=f"{file} restored by hand"))
        else:
            self._change(Event.RESTORED, View(Phase.RESTORED, key, n_tokens=n_tokens,
                                              restored=n_tokens if expect is None else expect, file=file,
                                              tokens=tokens))

    def restore_failed(self) -> None:
        """RESTORE_FAILED: llama-server clears a slot whose restore it refused."""
        self._change(Event.RESTORE_FAILED, View(Phase.EMPTY))

    def erased(self) -> None:
        """ERASED: emptied to make room in a KV cache all slots share."""
        self._change(Event.ERASED, View(Phase.EMPTY))

    def saved(self, *, n_tokens: int | None = None, tokens: bytes | None = None, file: str) -> None:
        """SAVED: the slot's conversation is in `file` now; the engine's count and the file's
        header (its tokens, token for token) replace ours where given."""
        v = self._view
        self._change(Event.SAVED, dataclasses.replace(v, n_tokens=v.n_tokens if n_tokens is None else n_tokens,
                                                      tokens=v.tokens if tokens is None else tokens, file=file))

    def prefix_read(self, key: str, n: int, head: bytes) -> None:
        """PREFIX_READ: the slot holds exactly a shared prefix of n tokens, read on its own
        before a request of `key`: under that key, so that a request that does not run leaves
        a state whose file is up to date (never saved again)."""
        self._change(Event.PREFIX_READ, View(Phase.HELD, key, n_tokens=n, tokens=head, n_prompt=n))

    def rewound(self, n: int, head: bytes) -> None:
        """REWOUND: the held conversation's slot holds its first n tokens (head) now, one
        token before its last prompt's end (rewind.py); the file it was saved to stays its."""
        v = self._view
        self._change(Event.REWOUND, View(Phase.HELD, v.key, n_tokens=n, tokens=head, file=v.file, rewound=True))

    def lost(self, why: str) -> str | None:
        """LOST (forced, from any phase): the slot's contents changed behind our back. Returns
        the conversation it no longer holds, if it named one."""
        v = self._view
        named = v.key if v.phase in (Phase.HELD, Phase.RESTORED, Phase.SWITCHED) else None
        self._change(Event.LOST, View(Phase.UNKNOWN, n_tokens=None, why=why))
        return named

    # -- reports ---------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        v = self._view
        named = v.phase in (Phase.HELD, Phase.RESTORED, Phase.SWITCHED)
        return {"id": self.id, "state": v.phase.value, "held": v.key if named else None,
                "n_tokens": v.n_tokens if v.phase is not Phase.SWITCHED else None,
                "durable": v.durable if v.phase in (Phase.HELD, Phase.RESTORED) else None,
                "awaiting_verification": v.restored is not None, "busy": self.busy, "why": v.why or None}
