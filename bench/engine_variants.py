#!/usr/bin/env python3
"""Prefill speed of llama-server builds side by side: what scripts/fetch-engine's default variant is chosen by.

    python bench/engine_variants.py native=/path/to/llama-server portable=/other/llama-server [--runs 7]

Starts every binary once (-t 2, --cache-ram 0, the Gemma 3 270M model fetch-engine caches), then
sends the same ~2.6k-token prompt to each in turn, A/B/A/B, so that load from other processes
falls on all of them alike. Each prompt starts with the run's number, so nothing is reused
(timings.prompt_n is checked). Prints prompt tokens/s (timings.prompt_per_second) per run, the
median per binary, and the 1-minute load average at each run; in brackets, tokens per CPU second
of the engine process, which other load disturbs far less than wall time (spinning at ggml's
barriers counts, so it is a lower bound on the instruction set's own gain).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import demo  # noqa: E402  (free_port, wait_http, facts)
import psutil  # noqa: E402

CACHE = Path(os.environ.get("AUTOSESSD_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autosessd")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binaries", nargs="+", help="NAME=PATH of a llama-server")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=str(CACHE / "models" / "gemma-3-270m-q4_k_m.gguf"), help="(fetch-engine's)")
    args = ap.parse_args()
    named = dict(b.split("=", 1) for b in args.binaries)
    model = args.model
    body = demo.facts(150, "crate") + "\nWhich crate holds the most marbles?"
    procs, ports = {}, {}
    try:
        for name, path in named.items():
            port = demo.free_port()
            procs[name] = subprocess.Popen([path, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", "1",
                                            "-c", "4096", "--cache-ram", "0", "-t", str(args.threads), "--no-webui"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            ports[name] = port
            demo.wait_http(port, "/health", procs[name], name)
        rates: dict[str, list[float]] = {name: [] for name in named}
        per_cpu: dict[str, list[float]] = {name: [] for name in named}
        print(f"| run | {' | '.join(named)} | load avg (1 min) |")
        print(f"|---:|{'---:|' * len(named)}---:|")
        for run in range(args.runs):
            row, load = [], os.getloadavg()[0]
            for name in named:
                cpu0 = sum(psutil.Process(procs[name].pid).cpu_times()[:2])
                r = post(ports[name], {"prompt": f"Run {run}. {body}", "n_predict": 1, "cache_prompt": False})
                cpu = sum(psutil.Process(procs[name].pid).cpu_times()[:2]) - cpu0
                t = r["timings"]
                assert t["prompt_n"] > 2000, f"{name} reused the prompt ({t['prompt_n']} tokens read)"
                rates[name].append(t["prompt_per_second"])
                per_cpu[name].append(t["prompt_n"] / cpu)
                row.append(f"{t['prompt_per_second']:.0f} tok/s [{t['prompt_n'] / cpu:.0f}/CPU s]")
            print(f"| {run + 1} | {' | '.join(row)} | {load:.2f} |", flush=True)
        print(f"| median | {' | '.join(f'{statistics.median(rates[n]):.0f} tok/s [{statistics.median(per_cpu[n]):.0f}/CPU s]' for n in named)} | |")
        print(f"\n{args.runs} runs of {t['prompt_n']} prompt tokens each, -t {args.threads}, {os.cpu_count()} CPUs")
    finally:
        for p in procs.values():
            p.terminate()
            p.wait()
    return 0


def post(port: int, body: dict) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
    return json.loads(c.getresponse().read())


if __name__ == "__main__":
    sys.exit(main())
