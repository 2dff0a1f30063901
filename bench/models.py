#!/usr/bin/env python3
"""`make bench-models`: a model switch and back behind llama-server's router, alone and with
autosessd in front, side by side in one run.

    python bench/models.py
    BENCH_MODELS_SIZES=2000,8000 BENCH_MODELS_REPS=2

Two routers run at once (`--models-dir` with two aliases, ga and gb, of Gemma 3 270M;
`--models-max 1`, --swa-full, -c 16384 for each model's child): one alone, one with
autosessd's gate in front (min tokens 100). For each size and repetition, a fresh
conversation on ga, one short request to gb (ga is unloaded), and back to ga; each step runs
on one competitor after the other (their order flipped every repetition), so load from
other processes falls on both alike.

Per competitor and size: time to first token of the return to ga (the user's wait: from
sending a streamed request to its first content chunk), the share of its prompt the engine
reused (timings.cache_n), and the time to first token of the request to gb, which carries
the switch (gb's load; with autosessd also the save of ga's conversation before the unload).
Writes bench/results/models-<date>-<host>.json and prints a Markdown table.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))
import demo  # noqa: E402  (facts)
from harness import Daemon, Engine  # noqa: E402
from slots import ask  # noqa: E402  (a streamed request: TTFT and the engine's timings)

SIZES = [int(x) for x in os.environ.get("BENCH_MODELS_SIZES", "2000,8000").split(",")]
REPS = int(os.environ.get("BENCH_MODELS_REPS", "2"))
CTX = 16384
TOKENS_PER_FACT = 18  # Gemma 3's tokenizer on demo.facts()


def conversation(size: int, rep: int) -> list[dict[str, str]]:
    text = demo.facts(max(1, size // TOKENS_PER_FACT), f"box{size}x{rep}")
    return [{"role": "user", "content": text + "\nHow many marbles are in box 3?"}]


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="bench-models-"))
    comps: dict[str, dict[str, Any]] = {}
    try:
        for name, gated in (("router alone", False), ("autosessd + router", True)):
            d = work / name.replace(" ", "-").replace("+", "")
            sessions = d / "sessions"
            sessions.mkdir(parents=True)
            eng = Engine(sessions, ctx=CTX, slots=1, log_path=d / "engine.log",
                         router=(d / "models", ["ga", "gb"], 1)).start()
            daemon = Daemon(d, sessions, eng.url, min_tokens=100, timeout_s=300).start() if gated else None
            comps[name] = {"engine": eng, "daemon": daemon, "url": daemon.gate_url if daemon else eng.url, "rows": []}
        order = list(comps)
        for size in SIZES:
            for rep in range(REPS):
                a = conversation(size, rep)
                b = [{"role": "user", "content": f"Say hello, number {size}-{rep}."}]
                steps: dict[str, dict[str, Any]] = {n: {} for n in comps}
                for step, (model, messages) in enumerate((("ga", a), ("gb", b), ("ga", None))):
                    for n in order:
                        c = comps[n]
                        msgs = messages
                        if msgs is None:  # the return: the conversation so far, one more question
                            msgs = [*a, {"role": "assistant", "content": steps[n]["open"]["text"]},
                                    {"role": "user", "content": "And box 4?"}]
                        r = ask(c["url"], msgs, max_tokens=8, model=model)
                        steps[n][("open", "switch", "back")[step]] = r
                order.reverse()
                for n in comps:
                    s = steps[n]
                    comps[n]["rows"].append({"size": size, "rep": rep, "prompt": s["back"]["prompt"],
                                             "back_ttft": s["back"]["ttft"], "reused": s["back"]["reused"],
                                             "switch_ttft": s["switch"]["ttft"]})
                    print(f"{n}: {size} tokens rep {rep}: back {s['back']['ttft']:.2f} s "
                          f"(reused {s['back']['reused']:.0%}), switch {s['switch']['ttft']:.2f} s", flush=True)
    finally:
        for c in comps.values():
            if c["daemon"]:
                c["daemon"].stop()
            c["engine"].stop()
    out = {"date": dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
           "cpus": os.cpu_count(), "sizes": SIZES, "reps": REPS,
           "competitors": {n: c["rows"] for n, c in comps.items()}}
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    path = results / f"models-{dt.date.today()}-{platform.node()}.json"
    path.write_text(json.dumps(out, indent=1))
    print(table(out))
    print(f"\n(written to {path.relative_to(ROOT)})")
    return 0


def table(out: dict[str, Any]) -> str:
    lines = ["| conversation | competitor | back to ga: TTFT | reused | speedup | request to gb (the switch): TTFT |",
             "|---:|---|---:|---:|---:|---:|"]
    for size in out["sizes"]:
        alone = None
        for n, rows in out["competitors"].items():
            rs = [r for r in rows if r["size"] == size]
            back = statistics.median(r["back_ttft"] for r in rs)
            alone = back if alone is None else alone
            lines.append(f"| {statistics.median(r['prompt'] for r in rs):,.0f} tokens | {n} | {back:.2f} s | "
                         f"{statistics.median(r['reused'] for r in rs):.0%} | {alone / back:.1f}× | "
                         f"{statistics.median(r['switch_ttft'] for r in rs):.2f} s |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
