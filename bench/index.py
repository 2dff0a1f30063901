#!/usr/bin/env python3
"""Issue 11's measurements: knowing session files by their tokens, and what it costs.

    python bench/index.py                    every part
    python bench/index.py --only lookup,cost lookup | start | tokens | turns | cost | reuse | prefix | turn | split
    BENCH_INDEX_FILES=10,100 BENCH_INDEX_TOKENS=1000,4000   a smaller grid

  lookup  the prefix lookup at 1k/4k/16k/32k tokens × 10/100/1,000 files, three ways:
          autosessd.store.index (token lists sorted per model: bisect + neighbours), a scan of
          every file's token list, and a hash chain per 64-token block (exact in the last
          block by reading the file's header there); time of one lookup and memory held
  start   building the index at start: reading every header vs the cache, cache size
  tokens  (real engine) do /apply-template + /tokenize give exactly the saved file's first
          tokens? for a plain chat, a system prompt, a multi-turn conversation
  turns   (real engine) a conversation going on, replies sent back as text: does the next
          prompt extend the file saved after the reply, or depart inside the reply?
  cost    (real engine) the two calls at 1k/4k/16k tokens, idle and beside a running prefill
  reuse   (real engine) a file restored, then a prompt that departs from it in the middle:
          how much timings.cache_n reuses, with --swa-full and without
  prefix  (real engine) a shared system prompt: restoring another task's file vs a file that
          holds exactly the prefix
  turn    (real engine) what a switching turn adds on the request's path: the request's tokens
          + encode + lookup at 1k/4k/16k tokens × 10/100/1,000 files, and the prefix probe
  split   (real engine, real daemon) a new conversation's system prompt read on its own and
          saved (the split): its cost, and the next conversation's first request after a restart

Prints Markdown tables; writes bench/results/index-<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from index_common import ROOT  # first: it puts this checkout and tests/ on sys.path
from index_engine import part_cost, part_tokens, part_turn, part_turns, t_cost, t_tokens, t_turn, t_turns
from index_files import part_lookup, part_start, t_lookup, t_start
from index_restore import part_prefix, part_reuse, part_split, t_prefix, t_reuse, t_split


PARTS = {
    "lookup": ("Prefix lookup: one lookup's time and the memory held", part_lookup, t_lookup),
    "start": ("Index at start: headers vs cache", part_start, t_start),
    "tokens": ("Do /apply-template + /tokenize give the saved file's tokens?", part_tokens, t_tokens),
    "turns": ("A conversation going on: does the next prompt extend the saved file?", part_turns, t_turns),
    "cost": ("Cost of /apply-template + /tokenize", part_cost, t_cost),
    "reuse": ("Restore, then a prompt that departs in the middle", part_reuse, t_reuse),
    "prefix": ("A shared system prompt after a restart: the task's file vs a file of the prefix", part_prefix,
               t_prefix),
    "turn": ("What a switching turn adds: the request's tokens and the lookup", part_turn, t_turn),
    "split": ("A shared system prompt through autosessd: the split's cost, and after a restart", part_split,
              t_split),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(PARTS))
    args = ap.parse_args()
    started = dt.datetime.now().isoformat(timespec="seconds")
    results: dict[str, Any] = {"date": started, "host": socket.gethostname(), "cpus": os.cpu_count(), "parts": {}}
    tables = []
    for name in args.only.split(","):
        title, fn, table = PARTS[name.strip()]
        print(f"bench/index: {name}: {title} ...", flush=True)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"autosessd-index-{name}-") as tmp:
            r = fn(Path(tmp))
        r["seconds"] = round(time.monotonic() - t0, 1)
        results["parts"][name] = r
        tables.append(f"### {title}\n\n{table(r)}\n")
    dest = ROOT / "bench" / "results" / f"index-{dt.date.today().isoformat()}-{socket.gethostname()}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        old = json.loads(dest.read_text())
        old["parts"].update(results["parts"])
        results = {**old, "date": started}
    dest.write_text(json.dumps(results, indent=1))
    print(f"\n## bench/index.py, {started}, {results['host']}: {results['cpus']} CPUs\n")
    print("\n".join(tables))
    print(f"results: {dest.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
