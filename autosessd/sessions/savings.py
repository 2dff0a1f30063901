"""What autosessd spared its users, and the engine's measured rates behind the figure.

The figure people want is the prefill a restore spared them: the time the engine would have
spent reading those tokens again. autosessd never times that itself; it prices the tokens the
engine reported reusing with the engine's own timings of the prompts it did read.

    prefill   every response's timings (cache_n c, prompt_n p, prompt_ms) is a read of p tokens
              after c already in the slot. A token at position x costs a + 2·b·x ms (attention
              grows with the context), so a read costs  ms = a·p + b·((c+p)² − c²).  a, b ≥ 0
              are fitted by least squares over the last READS reads of at least MIN_READ tokens
              (one read: b = 0, the plain prompt rate).
    spared    a verified restore (observe.verify) whose response reused k tokens (cache_n) where
              the slot already shared s with the request spared reading tokens s..k:
              a·(k−s) + b·(k² − s²) ms, priced when it is verified. Tokens verified before any
              read was measured wait, as sums, for the first fit.
    save, restore  ms = f + r·bytes each (fitted the same way), and bytes per token from the
              saves: what policy.auto_min_tokens weighs against re-reading.

Since the start the figures are Counters (report.py); in total they are those plus what
earlier runs left in state_dir/savings.json, which also keeps the rates of each model, so the
first turns after a restart price and decide with them. Everything here is plain arithmetic
on values handed in; the file is written by flush() (the caller runs it off the loop).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from . import policy

log = logging.getLogger("autosessd")

READS = 64  # prompt reads kept per model for the fit
MIN_READ = 32  # fewer tokens than this say more about a request's overhead than the prompt rate
TRANSFERS = 32  # saves and restores kept per model
VERSION = 1
_WRITING = threading.Lock()  # flush() runs in executor threads
# The totals that survive a restart (Counters fields).
TOTALS = ("prefill_tokens_avoided", "ms_avoided", "restores_reused", "restores_not_reused", "restores_unverified")


def fit2(rows: Iterable[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Least squares for y = u·x1 + v·x2 with u, v ≥ 0 over rows (x1, x2, y); None without rows.
    A negative coefficient is dropped and the other fitted alone (the non-negative optimum)."""
    rows = [r for r in rows if r[0] > 0 or r[1] > 0]
    if not rows:
        return None
    s11 = sum(x1 * x1 for x1, _, _ in rows)
    s22 = sum(x2 * x2 for _, x2, _ in rows)
    s12 = sum(x1 * x2 for x1, x2, _ in rows)
    s1y = sum(x1 * y for x1, _, y in rows)
    s2y = sum(x2 * y for _, x2, y in rows)
    det = s11 * s22 - s12 * s12
    if det > 1e-9 * max(s11 * s22, 1e-300):
        u, v = (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det
        if u >= 0 and v >= 0:
            return u, v
    cands = []
    if s11 > 0:
        cands.append((max(0.0, s1y / s11), 0.0))
    if s22 > 0:
        cands.append((0.0, max(0.0, s2y / s22)))
    if not cands:
        return None
    return min(cands, key=lambda uv: sum((y - uv[0] * x1 - uv[1] * x2) ** 2 for x1, x2, y in rows))


@dataclass(frozen=True)
class Prefill:
    """ms to read tokens [c, c+p) of a prompt: a·p + b·((c+p)² − c²)."""

    a: float
    b: float
    reads: int

    def ms(self, start: int, end: int) -> float:
        return self.a * (end - start) + self.b * (end * end - start * start) if end > start else 0.0

    def tokens_per_s(self, at: int) -> float | None:
        """The prompt rate when reading from the start up to `at` tokens."""
        ms = self.ms(0, at)
        return at / ms * 1000 if ms > 0 else None


class Rates:
    """One model's measured rates (the engine's own timings)."""

    def __init__(self, data: dict[str, Any] | None = None):
        data = data or {}
        self.reads: deque[tuple[int, int, float]] = deque(_triples(data.get("reads")), READS)
        self.saves: deque[tuple[int, int, float]] = deque(_triples(data.get("saves")), TRANSFERS)
        self.restores: deque[tuple[int, int, float]] = deque(_triples(data.get("restores")), TRANSFERS)

    def to_dict(self) -> dict[str, Any]:
        return {"reads": list(self.reads), "saves": list(self.saves), "restores": list(self.restores)}

    def prefill(self) -> Prefill | None:
        ab = fit2((p, (c + p) ** 2 - c * c, ms) for c, p, ms in self.reads)
        return Prefill(ab[0], ab[1], len(self.reads)) if ab is not None and ab != (0.0, 0.0) else None

    @staticmethod
    def _transfer(rows: Iterable[tuple[int, int, float]]) -> tuple[float, float] | None:
        """(fixed ms, ms per byte) of a save or restore, from (tokens, bytes, ms) rows. One size
        alone cannot tell the two apart: then it is all per byte (large states are bandwidth)."""
        rb = fit2((float(b), 1.0, ms) for _, b, ms in rows)
        return None if rb is None else (rb[1], rb[0])

    def save(self) -> tuple[float, float] | None:
        return self._transfer(self.saves)

    def restore(self) -> tuple[float, float] | None:
        return self._transfer(self.restores)

    def bytes_per_token(self) -> float | None:
        n = sum(t for t, _, _ in self.saves)
        return sum(b for _, b, _ in self.saves) / n if n else None


def _triples(v: Any) -> list[tuple[int, int, float]]:
    out = []
    for row in v if isinstance(v, list) else []:
        if isinstance(row, list) and len(row) == 3 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                            and math.isfinite(x) and x >= 0 for x in row):
            out.append((int(row[0]), int(row[1]), float(row[2])))
    return out


class Savings:
    """The rates of the engine's current model, the threshold they make, and the totals."""

    def __init__(self, model: str = "", path: Path | None = None):
        self.model = model
        self.path = path
        self.models: dict[str, dict[str, Any]] = {}
        self.base: dict[str, float] = {k: 0 for k in TOTALS}  # what earlier runs left
        self.since: float = time.time()  # the first run the totals cover
        if path is not None:
            self._load(path)
        self.rates = Rates(self.models.get(model))
        self._unpriced: list[tuple[int, int]] = []  # (start, end) of reuses verified before any read
        self._version = 0
        self._threshold: tuple[int, int, str] | None = None  # (version, n, why)
        self._said: int | None = None
        self.dirty = False

    # -- persistence -----------------------------------------------------------------------
    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("auto sessions: %s: %s; the totals and rates start again", path, e)
            return
        if not isinstance(data, dict) or data.get("version") != VERSION:
            return
        total = data.get("total") if isinstance(data.get("total"), dict) else {}
        for k in TOTALS:
            v = total.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
                self.base[k] = v
        if isinstance(data.get("since"), (int, float)):
            self.since = float(data["since"])
        if isinstance(data.get("models"), dict):
            self.models = {k: v for k, v in data["models"].items() if isinstance(v, dict)}

    def for_model(self, model: str) -> Savings:
        """Another model's rates on the same file and totals (behind a router each model's
        Sessions has one; they share the counters, so the totals' base is read once, here)."""
        other = Savings(model)
        other.path, other.models, other.base, other.since = self.path, self.models, self.base, self.since
        other.rates = Rates(self.models.get(model))
        return other

    def switch_model(self, model: str) -> None:
        """The engine restarted with another model (facts.py): its rates from now on, the old
        one's kept for when it comes back."""
        if self.model:
            self.models[self.model] = self.rates.to_dict()
        self.model = model
        self.rates = Rates(self.models.get(model))
        self._changed()

    def flush(self, counters: Any) -> None:
        """Write the totals (earlier runs' plus this one's counters) and every model's rates.
        Blocking: a small file, written to a temporary and renamed (one writer at a time:
        behind a router every model's Savings writes the one file)."""
        if self.path is None:
            return
        self.dirty = False
        with _WRITING:
            if self.model:
                self.models[self.model] = self.rates.to_dict()
            data = {"version": VERSION, "since": self.since, "total": self.totals(counters),
                    "models": dict(self.models)}
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(json.dumps(data))
                os.replace(tmp, self.path)
            except OSError as e:
                log.warning("auto sessions: cannot write %s: %s", self.path, e)

    def totals(self, counters: Any) -> dict[str, float]:
        return {k: self.base[k] + getattr(counters, k) for k in TOTALS}

    # -- what the engine showed ------------------------------------------------------------
    def saw_read(self, cache_n: int | None, prompt_n: int | None, ms: float | None) -> None:
        """A response's timings: prompt_n tokens read after cache_n, in ms."""
        if prompt_n is None or ms is None or prompt_n < MIN_READ or not ms > 0 or not math.isfinite(ms):
            return
        self.rates.reads.append((cache_n or 0, prompt_n, float(ms)))
        self._changed()

    def saw_save(self, n_tokens: int, n_bytes: int, ms: float) -> None:
        if n_tokens >= MIN_READ and n_bytes > 0 and ms >= 0 and math.isfinite(ms):
            self.rates.saves.append((n_tokens, n_bytes, float(ms)))
            self._changed()

    def saw_restore(self, n_tokens: int, n_bytes: int, ms: float) -> None:
        if n_tokens >= MIN_READ and n_bytes > 0 and ms >= 0 and math.isfinite(ms):
            self.rates.restores.append((n_tokens, n_bytes, float(ms)))
            self._changed()

    def _changed(self) -> None:
        self._version += 1
        self.dirty = True

    # -- pricing ---------------------------------------------------------------------------
    def price(self, start: int, end: int) -> float | None:
        """ms the engine would have taken to read tokens [start, end); None before any read."""
        model = self.rates.prefill()
        return model.ms(start, end) if model is not None else None

    def spared(self, counters: Any, start: int, end: int) -> float | None:
        """A verified reuse of tokens [start, end): counted in counters (prefill_tokens_avoided,
        ms_avoided); → the ms, or None while no read has been measured (priced later)."""
        if end <= start:
            return 0.0
        counters.prefill_tokens_avoided += end - start
        self.dirty = True
        ms = self.price(start, end)
        if ms is None:
            self._unpriced.append((start, end))
            return None
        if self._unpriced:  # the first fit: what was verified before it
            ms_before = sum(self.price(a, b) or 0.0 for a, b in self._unpriced)
            counters.ms_avoided += ms_before
            self._unpriced.clear()
        counters.ms_avoided += ms
        return ms

    def unpriced_tokens(self) -> int:
        return sum(b - a for a, b in self._unpriced)

    # -- the threshold for auto_sessions_min_tokens = "auto" --------------------------------------
    def min_tokens(self) -> tuple[int, str]:
        """The threshold policy.auto_min_tokens chooses from the measured rates, and why."""
        cached = self._threshold
        if cached is not None and cached[0] == self._version:
            return cached[1], cached[2]
        r = self.rates
        n, why = policy.auto_min_tokens(self.rates.prefill(), r.save(), r.restore(), r.bytes_per_token())
        self._threshold = (self._version, n, why)
        if self._said is None or abs(n - self._said) > 0.1 * max(self._said, 1):
            log.info("auto sessions: min tokens %s (auto): %s", f"{n:,}", why)
            self._said = n
        return n, why

    def describe(self) -> dict[str, Any]:
        """The rates as status shows them."""
        model = self.rates.prefill()
        r = self.rates
        save, restore, bpt = r.save(), r.restore(), r.bytes_per_token()
        return {
            "prompt_reads": len(r.reads),
            "prompt_tokens_per_s": None if model is None else
            {str(n): round(model.tokens_per_s(n) or 0, 1) for n in (1000, 8000, 32000)},
            "prefill_ms_per_token": None if model is None else {"a": model.a, "b": model.b},
            "save_mb_per_s": _mb_s(save), "restore_mb_per_s": _mb_s(restore),
            "bytes_per_token": None if bpt is None else round(bpt, 1),
        }


def _mb_s(fr: tuple[float, float] | None) -> float | None:
    return None if fr is None or fr[1] <= 0 else round(1 / fr[1] / 1000, 1)
