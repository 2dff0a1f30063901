"""What every room of the house reads: the running config and the daemon's facts about its
engine, store and counters. One object, owned by the Sessions facade; a room takes it in its
constructor and keeps no copy of anything in it (a reload replaces `cfg`, a save teaches
`engine_layout`, the engine's answers turn `slots_visible` off)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .config import Config
from .engines.base import ChatEngine, Engine
from .report import Counters, Events, Histograms, RestoreLog
from .savings import Savings
from .store import Store

if TYPE_CHECKING:
    from .index import TokenIndex
    from .remote import Remote
    from .slotfile import KVLayout


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
    # and every restore follows the key rule. swa_window: the model's sliding window.
    index: TokenIndex | None = None
    swa_window: int | None = None
    remote: Remote | None = None  # the shared bucket ([shared]), when configured
    counters: Counters = field(default_factory=Counters)
    events: Events = field(default_factory=Events)
    restore_log: RestoreLog = field(default_factory=RestoreLog)
    histograms: Histograms = field(default_factory=Histograms)
    savings: Savings = field(default_factory=Savings)  # the engine's rates; what was spared

    @property
    def chat(self) -> ChatEngine | None:
        """The engine, when it can tokenize and prefill (the one place that asks)."""
        return self.engine if isinstance(self.engine, ChatEngine) else None

    @property
    def min_tokens(self) -> int:
        """auto_sessions_min_tokens in force: the number, or with "auto" the one the engine's
        measured rates call for (savings.py)."""
        value = self.cfg.auto_sessions_min_tokens
        return value if isinstance(value, int) else self.savings.min_tokens()[0]
