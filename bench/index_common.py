"""What every part of bench/index.py shares: the grid (BENCH_INDEX_FILES, BENCH_INDEX_TOKENS),
timing, and the real engine's requests (facts, chat, engine). Importing it puts this checkout
and tests/ on sys.path (autosessd, harness)."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

FILES = [int(x) for x in os.environ.get("BENCH_INDEX_FILES", "10,100,1000").split(",")]
TOKENS = [int(x) for x in os.environ.get("BENCH_INDEX_TOKENS", "1000,4000,16000,32000").split(",")]
VOCAB = 262_144  # Gemma 3's
MODEL = "m"


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def timed(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return med(ts)


# -- with the real engine ---------------------------------------------------------------------
def facts(n: int, topic: str = "box", edit: int | None = None) -> str:
    colors = ["red", "blue", "green", "amber", "violet"]
    return " ".join(f"Fact {i}: the {colors[i % 5]} {topic} number {i} "
                    f"{'contains' if i == edit else 'holds'} {i * 7 % 13} marbles." for i in range(n))


def chat(messages: list[dict], max_tokens: int = 8) -> dict:
    return {"messages": messages, "temperature": 0, "max_tokens": max_tokens, "seed": 1}


def engine(d: Path, **kw):
    from harness import Engine

    return Engine(d, log_path=d.parent / f"engine-{d.name}.log", **kw).start()
