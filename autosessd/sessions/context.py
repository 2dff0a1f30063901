"""What every room of the house reads: the running config and the daemon's facts about its
engine, store and counters. One object, owned by the Sessions facade; a room takes it in its
constructor and keeps no copy of anything in it (a reload replaces `cfg`, a save teaches
`engine_layout`, the engine's answers turn `slots_visible` off)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from ..base.config import Config
from ..engines.base import ChatEngine, Engine
from ..store.directory import Store
from .phases import TurnTimes
from .report import Counters, Events, Histograms, RestoreLog
from .savings import Savings

MAX_TOKENS = 1 << 24

if TYPE_CHECKING:
    from pathlib import Path

    from ..store.index import TokenIndex
    from ..store.names import Meta
    from ..store.slotfile import KVLayout


class Bucket(Protocol):
    """The shared bucket ([shared]; remote.Remote) as the rooms below it use it."""

    def saw_prefill(self, n_tokens: int | None, ms: float | None) -> None: ...

    def engine_changed(self, model: str, max_tokens: int | None) -> None: ...

    def upload_later(self, path: Path, meta: Meta) -> None: ...

    def went_on(self, key: str, tokens: bytes | None, n_tokens: int | None, more: int) -> str | None: ...

    async def forget(self, names: set[str]) -> list[str]: ...

    def status(self) -> dict[str, Any]: ...


class Facts(Protocol):
    """Whether the facts above are the engine's since its last restart: facts.EngineFacts,
    which reads them again (and is set by whoever builds the Context: it reads and writes the
    Context itself)."""

    n_slots: int | None
    check_template: Callable[[], Awaitable[object]] | None
    generation: int
    off: str | None

    @property
    def usable(self) -> bool: ...

    async def ready(self, slot_id: int, probe: bool = True, patient: bool = False) -> bool: ...

    async def fresh(self, slot_id: int, probe: bool = True, patient: bool = False) -> bool: ...

    def restarted(self, why: str) -> None: ...

    def saved_here(self, generation: int) -> None: ...

    def saves_elsewhere(self, why: str, generation: int) -> None: ...


@dataclass(eq=False)
class Context:
    cfg: Config
    engine: Engine
    store: Store
    model: str  # the engine's model fingerprint: files of another are never restored
    model_name: str = ""
    slots_visible: bool = True  # False: the engine runs with --no-slots
    # The KV layout of this engine's state files (streams from the start probe; the rest from
    # its first save): a file of another layout cannot be loaded and is not restored.
    engine_layout: KVLayout | None = None
    # The token index (index.py) over the session files, from prepare(); None: not loaded,
    # and every restore follows the key rule. swa_window: the model's sliding window;
    # recurrent: part of its state is for the last token only (facts.model_memory).
    index: TokenIndex | None = None
    swa_window: int | None = None
    recurrent: bool = False
    remote: Bucket | None = None  # the shared bucket ([shared]), when configured
    n_ctx: int | None = None  # tokens one slot can hold: a file of more is never handed to the engine
    # The engine's chat template identity (EngineInfo.template): the seed of every keys.chain,
    # so a file's messages stand for its tokens only under the template that made them.
    template: str = ""
    # Set when the engine refused a restore or answered one with a 5xx: a failed restore can
    # leave written K/V behind that spoils later completions until the engine restarts
    # (llama.cpp #27068). {"at", "file", "error"}; cleared when the engine restarts.
    suspect: dict | None = None
    # Whether the facts above are the engine's since its last restart (facts.py).
    facts: Facts = field(init=False)
    counters: Counters = field(default_factory=Counters)
    events: Events = field(default_factory=Events)
    restore_log: RestoreLog = field(default_factory=RestoreLog)
    histograms: Histograms = field(default_factory=Histograms)
    turn_times: TurnTimes = field(default_factory=TurnTimes)  # where turns' time went (report.PHASES)
    savings: Savings = field(default_factory=Savings)  # the engine's rates; what was spared
    # Files asked into the page cache lately (warm.py), name → (identity, when): one memory
    # bound for the house, whatever model behind a router asked.
    warmed: dict = field(default_factory=dict)

    @property
    def chat(self) -> ChatEngine | None:
        """The engine, when it can tokenize and prefill (the one place that asks)."""
        return self.engine if isinstance(self.engine, ChatEngine) else None

    @property
    def rewinds(self) -> bool:
        """A save takes the slot back to one token before its prompt's end (rewind.py): a model
        whose memory cannot be rolled back (recurrent layers, a sliding window)."""
        return self.recurrent or self.swa_window is not None

    @property
    def reuse_window(self) -> int | None:
        """The window of runs.swa_usable: which files the engine can reuse for a request. 0 for
        a model with recurrent layers (only from a file's very end), else its sliding window."""
        return 0 if self.recurrent else self.swa_window

    @property
    def min_tokens(self) -> int:
        """auto_sessions_min_tokens in force: the number, or with "auto" the one the engine's
        measured rates call for (savings.py)."""
        value = self.cfg.auto_sessions_min_tokens
        return value if isinstance(value, int) else self.savings.min_tokens()[0]

    @property
    def max_tokens(self) -> int:
        """The most tokens a session file's header may claim before it is not even read: the
        engine's context, or 2^24 when it does not say (a header claiming 50 M tokens would
        otherwise cost gigabytes at every start)."""
        return self.n_ctx or MAX_TOKENS
