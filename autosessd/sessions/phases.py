"""Where a turn's time goes (issue 31): the phases of a turn, timed as it runs, and what status
and /metrics show of them. A switch back at real sizes should cost the engine's restore and
little else; when it does not, the phases say where the rest went.

    PHASES      each in ms of the request's wait: "look" (GET /slots), "facts" (the engine's
                facts read again after a restart), "wait" (finalizes that the decision must
                see: a save of the same temporary, or of the same file), "save" (the engine
                writing the outgoing conversation, then its checks), "tokens"
                (/apply-template + /tokenize beyond what the save hid), "fetch" (a download
                from the shared bucket), "launch" (the launch gate: an engine that empties
                idle slots), "assemble" (a file kept as token blocks, assembled into staging
                when no copy of it is there), "check" (the file's integrity: a stat, or a digest
                when it changed), "restore" (the engine reading the file), "prefix" (a shared
                prefix read on its own)
    timed       adds a block's time to a turn result's phases
    TurnTimes   per slot the last timed turn that saved or restored, with the engine's own
                prompt and reply times of its request (engine_prompt_ms, engine_reply_ms:
                its timings); the totals of every turn
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

PHASES = ("look", "facts", "wait", "save", "tokens", "fetch", "launch", "assemble", "check", "restore", "prefix")


@contextlib.contextmanager
def timed(result: Any, phase: str):
    """Adds the time of the block to result.phases[phase] (a report.TurnResult; nothing when
    result is None)."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        if result is not None:
            result.phases[phase] = result.phases.get(phase, 0.0) + (time.monotonic() - t0) * 1000


@dataclass
class TurnTimes:
    """Per slot, the last turn's phases that saved or restored (and the engine's own time on
    its request, once it ended); in total, every timed turn's phases. Status and /metrics."""

    last: dict[int, dict[str, Any]] = field(default_factory=dict)
    total_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    turns: int = 0

    def add(self, result: Any) -> None:
        """A turn's report.TurnResult, once it is done."""
        self.turns += 1
        for name, ms in result.phases.items():
            self.total_ms[name] = self.total_ms.get(name, 0.0) + ms
        if result.slot is not None and (result.saved or result.restored):
            self.last[result.slot] = {"key": result.key, "at": round(time.time(), 3), "ms": result.ms,
                                      **{k: round(v, 2) for k, v in result.phases.items()}}

    def engine_done(self, slot: int, key: str | None, timings: dict[str, Any] | None) -> None:
        """The engine's timings of the request that ran after the slot's last timed turn."""
        last = self.last.get(slot)
        if last is None or last["key"] != key or "engine_prompt_ms" in last or not timings:
            return
        for mine, theirs in (("engine_prompt_ms", "prompt_ms"), ("engine_reply_ms", "predicted_ms")):
            v = timings.get(theirs)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                last[mine] = round(float(v), 2)

    def status(self) -> dict[str, Any]:
        return {"turns": self.turns, "total_ms": {k: round(v, 2) for k, v in self.total_ms.items()},
                "last": {str(k): dict(v) for k, v in sorted(self.last.items())}}
