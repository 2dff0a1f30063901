#!/usr/bin/env python3
"""Issue 11's measurements: knowing session files by their tokens, and what it costs.

    python bench/index.py                    every part
    python bench/index.py --only lookup,cost lookup | start | tokens | turns | cost | reuse | prefix | turn | split
    BENCH_INDEX_FILES=10,100 BENCH_INDEX_TOKENS=1000,4000   a smaller grid

  lookup  the prefix lookup at 1k/4k/16k/32k tokens × 10/100/1,000 files, three ways:
          autosessd.index (token lists sorted per model: bisect + neighbours), a scan of
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
import asyncio
import datetime as dt
import gc
import hashlib
import json
import os
import random
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from autosessd.engines.llama_server import LlamaServer  # noqa: E402
from autosessd.index import TokenIndex, common_prefix, encode  # noqa: E402
from autosessd.slotfile import build, read_header  # noqa: E402

FILES = [int(x) for x in os.environ.get("BENCH_INDEX_FILES", "10,100,1000").split(",")]
TOKENS = [int(x) for x in os.environ.get("BENCH_INDEX_TOKENS", "1000,4000,16000,32000").split(",")]
VOCAB = 262_144  # Gemma 3's
MODEL = "m"


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- the two alternatives the index was measured against ----------------------------------
class Linear:
    """Every file's token list, compared one by one."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def add(self, name: str, data: bytes) -> None:
        self.files[name] = data

    def best(self, q: bytes) -> tuple[str, int] | None:
        top = max(((common_prefix(d, q), n) for n, d in self.files.items()), default=(0, ""))
        return (top[1], top[0]) if top[0] else None


class Chain:
    """A hash chain per 64-token block (h_i = H(h_{i-1} ‖ block i)); only the hashes are
    kept. The deepest block the query shares with some file is found by bisection over the
    query's own chain; the exact prefix inside the next block is read from each such file's
    header (one small read each)."""

    B = 64

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.by_hash: dict[bytes, set[str]] = {}
        self.names: set[str] = set()

    @classmethod
    def chain(cls, data: bytes) -> list[bytes]:
        out, h, step = [], b"", 4 * cls.B
        for i in range(0, len(data) - len(data) % step, step):
            h = hashlib.blake2b(h + data[i:i + step], digest_size=8).digest()
            out.append(h)
        return out

    def add(self, name: str, data: bytes) -> None:
        self.names.add(name)
        for h in self.chain(data):
            self.by_hash.setdefault(h, set()).add(name)

    def best(self, q: bytes) -> tuple[str, int] | None:
        qh = self.chain(q)
        lo, hi = -1, len(qh)  # qh[lo] present (or lo = -1), qh[hi] absent
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if qh[mid] in self.by_hash:
                lo = mid
            else:
                hi = mid
        cands = self.by_hash[qh[lo]] if lo >= 0 else self.names
        start = (lo + 1) * self.B  # tokens known to be shared
        best = None
        for name in cands:
            with open(self.dir / name, "rb") as f:
                f.seek(12 + 12 + 4 * start)  # magic, version, n_words; -1, 1, n_tokens
                block = f.read(4 * self.B)
            n = start + common_prefix(block, q[4 * start:4 * start + 4 * self.B])
            if best is None or n > best[1]:
                best = (name, n)
        return best if best and best[1] else None


def workload(n_tokens: int, n_files: int, rng: random.Random) -> tuple[list[list[int]], list[int]]:
    """Files that all start with one system prompt (a quarter of them, at most 3,000 tokens:
    the agent case), then differ."""
    system = [rng.randrange(VOCAB) for _ in range(min(n_tokens // 4, 3000))]
    files = [system + [rng.randrange(VOCAB) for _ in range(n_tokens - len(system))] for _ in range(n_files)]
    return files, system


def timed(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return med(ts)


def part_lookup(work: Path) -> dict[str, Any]:
    rows = []
    rng = random.Random(11)
    for n_tokens in TOKENS:
        for n_files in FILES:
            files, system = workload(n_tokens, n_files, rng)
            d = work / f"lookup-{n_tokens}-{n_files}"
            d.mkdir()
            for i, t in enumerate(files):
                (d / f"f{i}.bin").write_bytes(build(t))
            # Query 1, a return: continues file j for 3/4 of its tokens, then departs.
            j = n_files // 2
            ret = files[j][:3 * n_tokens // 4] + [rng.randrange(VOCAB) for _ in range(n_tokens // 4)]
            # Query 2, a new conversation under the same system prompt: every file ties.
            new = system + [rng.randrange(VOCAB) for _ in range(n_tokens - len(system))]
            row: dict[str, Any] = {"tokens": n_tokens, "files": n_files}
            for kind in ("index", "linear", "chain"):
                def make():
                    if kind == "index":
                        s = TokenIndex(d)
                        for i, t in enumerate(files):
                            s.add(f"f{i}.bin", t, MODEL)
                        return s, lambda q: s.best(q, MODEL)
                    s = Linear() if kind == "linear" else Chain(d)
                    for i, t in enumerate(files):
                        s.add(f"f{i}.bin", encode(t))
                    return s, lambda q: s.best(encode(q))

                gc.collect()
                tracemalloc.start()  # slows allocation down: the build is timed apart
                base = tracemalloc.get_traced_memory()[0]
                s, lookup = make()
                mem = tracemalloc.get_traced_memory()[0] - base
                tracemalloc.stop()
                del s, lookup
                gc.collect()
                t0 = time.perf_counter()
                s, lookup = make()
                build_s = time.perf_counter() - t0
                got = lookup(ret)
                assert got == (f"f{j}.bin", 3 * n_tokens // 4), (kind, got)
                assert lookup(new)[1] == len(system), kind
                reps = 20 if kind == "linear" and n_files * n_tokens > 4e6 else 50
                row[kind] = {"build_s": build_s, "memory_bytes": mem,
                             "return_ms": 1e3 * timed(lambda: lookup(ret), reps),
                             "new_ms": 1e3 * timed(lambda: lookup(new), reps)}
                if kind == "index":  # the caller encodes a prompt once per turn
                    rb, nb = encode(ret), encode(new)
                    row[kind]["return_encoded_ms"] = 1e3 * timed(lambda: s.best(rb, MODEL), reps)
                    row[kind]["new_encoded_ms"] = 1e3 * timed(lambda: s.best(nb, MODEL), reps)
                del s, lookup
            row["encode_ms"] = 1e3 * timed(lambda: encode(ret), 50)
            rows.append(row)
            print(f"  lookup {n_tokens:,} tokens × {n_files:,} files: index {row['index']['return_ms']:.3f} ms, "
                  f"linear {row['linear']['return_ms']:.2f} ms, chain {row['chain']['return_ms']:.2f} ms", flush=True)
            for p in d.iterdir():
                p.unlink()
            d.rmdir()
    return {"rows": rows}


def t_lookup(r: dict[str, Any]) -> str:
    lines = ["| tokens/file | files | index: return / new (ms) | the same, query encoded (ms) | "
             "linear: return / new (ms) | chain: return / new (ms) | memory index / chain | build index (ms) | "
             "encode query (ms) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        i, li, c = row["index"], row["linear"], row["chain"]
        lines.append(f"| {row['tokens']:,} | {row['files']:,} | {i['return_ms']:.3f} / {i['new_ms']:.3f} | "
                     f"{i['return_encoded_ms']:.3f} / {i['new_encoded_ms']:.3f} | "
                     f"{li['return_ms']:.2f} / {li['new_ms']:.2f} | {c['return_ms']:.2f} / {c['new_ms']:.2f} | "
                     f"{i['memory_bytes'] / 1e6:.2f} MB / {c['memory_bytes'] / 1e6:.2f} MB | "
                     f"{1e3 * i['build_s']:.0f} | {row['encode_ms']:.2f} |")
    return "\n".join(lines)


def part_start(work: Path) -> dict[str, Any]:
    rows = []
    rng = random.Random(12)
    for n_tokens in TOKENS:
        for n_files in FILES:
            files, _ = workload(n_tokens, n_files, rng)
            d = work / f"start-{n_tokens}-{n_files}"
            d.mkdir()
            cache = work / f"start-{n_tokens}-{n_files}.cache"
            for i, t in enumerate(files):
                key = f"{i:016x}"
                p = d / f"auto-{key}.bin"
                p.write_bytes(build(t))
                (d / f"auto-{key}.json").write_text(json.dumps({"key": key, "bytes": p.stat().st_size,
                                                                "model": MODEL}))
            del files
            gc.collect()
            idx = TokenIndex(d, cache)
            r1 = idx.scan()
            t0 = time.perf_counter()
            idx.save_cache()
            save_s = time.perf_counter() - t0
            del idx
            gc.collect()
            idx2 = TokenIndex(d, cache)
            r2 = idx2.scan()
            assert r2.cache == "loaded" and r2.read == 0 and r2.files == n_files, r2
            t0 = time.perf_counter()
            idx2.scan()  # a rescan while running: a stat per file
            rescan_s = time.perf_counter() - t0
            rows.append({"tokens": n_tokens, "files": n_files, "headers_s": r1.seconds, "cache_s": r2.seconds,
                         "rescan_s": rescan_s, "save_s": save_s, "cache_bytes": cache.stat().st_size})
            print(f"  start {n_tokens:,} × {n_files:,}: headers {r1.seconds * 1e3:.0f} ms, "
                  f"cache {r2.seconds * 1e3:.0f} ms", flush=True)
            del idx2
            for p in d.iterdir():
                p.unlink()
            d.rmdir()
            cache.unlink()
    return {"rows": rows}


def t_start(r: dict[str, Any]) -> str:
    lines = ["| tokens/file | files | scan reading every header (ms) | scan from the cache (ms) | "
             "rescan, nothing changed (ms) | write the cache (ms) | cache size |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["rows"]:
        lines.append(f"| {x['tokens']:,} | {x['files']:,} | {1e3 * x['headers_s']:.0f} | {1e3 * x['cache_s']:.0f} | "
                     f"{1e3 * x['rescan_s']:.1f} | {1e3 * x['save_s']:.0f} | {x['cache_bytes'] / 1e6:.2f} MB |")
    return "\n".join(lines)


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


def part_tokens(work: Path) -> dict[str, Any]:
    d = work / "tokens"
    d.mkdir()
    e = engine(d)
    cases = {
        "user only, 1k": [{"role": "user", "content": facts(55) + "\nHow many marbles are in box 5?"}],
        "system + user": [{"role": "system", "content": "You are a pirate. Answer like one."},
                          {"role": "user", "content": "Hello"}],
        "multi-turn, 4 messages": [{"role": "system", "content": "You are terse."},
                                   {"role": "user", "content": facts(20)},
                                   {"role": "assistant", "content": "Noted: twenty facts."},
                                   {"role": "user", "content": "Which box is red?"}],
        "special-token text in a message": [{"role": "user", "content": "Explain <start_of_turn> and <bos>."}],
    }
    rows = []

    async def go():
        eng = LlamaServer(e.url, timeout_s=60)
        try:
            for i, (name, msgs) in enumerate(cases.items()):
                body = chat(msgs, max_tokens=12)
                toks = await eng.prompt_tokens(body)
                async with eng._client().post(e.url + "/v1/chat/completions", json=body) as r:
                    out = await r.json()
                saved = await eng.save(0, f"t{i}.bin")
                head = read_header(d / f"t{i}.bin").tokens
                rows.append({"case": name, "prompt_tokens": out["usage"]["prompt_tokens"], "tokenized": len(toks),
                             "file_tokens": len(head), "n_saved": saved.n_tokens,
                             "completion_tokens": out["usage"]["completion_tokens"],
                             "equal_prefix": list(head[:len(toks)]) == toks,
                             "lcp": common_prefix(encode(head), encode(toks))})
        finally:
            await eng.close()

    try:
        asyncio.run(go())
    finally:
        e.stop()
    for row in rows:
        print(f"  tokens: {row['case']}: equal={row['equal_prefix']} tokenized {row['tokenized']}, "
              f"file {row['file_tokens']}", flush=True)
    return {"rows": rows}


def t_tokens(r: dict[str, Any]) -> str:
    lines = ["| request | usage.prompt_tokens | apply-template + tokenize | file's header tokens (= n_saved) | "
             "completion tokens | tokenized == file's first tokens |", "|---|---:|---:|---:|---:|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['case']} | {x['prompt_tokens']:,} | {x['tokenized']:,} | {x['file_tokens']:,} "
                     f"(= {x['n_saved']:,}) | {x['completion_tokens']} | "
                     f"{'yes' if x['equal_prefix'] else 'NO, shares ' + str(x['lcp'])} |")
    return "\n".join(lines)


def part_turns(work: Path) -> dict[str, Any]:
    """A conversation going on: the client sends each reply back as text. Does the next
    prompt extend the file saved after the reply, or depart inside the reply (text sampled
    as uncommon tokens comes back as other tokens)? Sampled (temperature 0.8) and greedy."""
    d = work / "turns"
    d.mkdir()
    e = engine(d)
    rows = []

    async def go():
        eng = LlamaServer(e.url, timeout_s=300)
        try:
            for temperature in (0.0, 0.8):
                for conv in range(3):
                    msgs = [{"role": "system", "content": "You are a pirate."},
                            {"role": "user", "content": facts(10) + f" Tell me a story about box {conv}."}]
                    for turn in range(4):
                        body = {"messages": msgs, "temperature": temperature, "max_tokens": 60, "seed": 7 * conv + turn}
                        r = e.post("/v1/chat/completions", body)
                        await eng.save(0, "t.bin")
                        f = read_header(d / "t.bin").tokens
                        msgs = msgs + [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                                       {"role": "user", "content": "Go on."}]
                        nxt = await eng.prompt_tokens({"messages": msgs})
                        shared = common_prefix(encode(f), encode(nxt))
                        rows.append({"temperature": temperature, "prompt": r["usage"]["prompt_tokens"],
                                     "file": len(f), "shared": shared})
        finally:
            await eng.close()

    try:
        asyncio.run(go())
    finally:
        e.stop()
    return {"rows": rows}


def t_turns(r: dict[str, Any]) -> str:
    lines = ["| sampling | turns | next prompt extends the file | departs inside the reply | "
             "departs inside the prompt |",
             "|---|---:|---:|---:|---:|"]
    for temp in sorted({x["temperature"] for x in r["rows"]}):
        xs = [x for x in r["rows"] if x["temperature"] == temp]
        ext = sum(x["shared"] == x["file"] for x in xs)
        in_reply = sum(x["prompt"] <= x["shared"] < x["file"] for x in xs)
        lines.append(f"| temperature {temp:g} | {len(xs)} | {ext} | {in_reply} | {len(xs) - ext - in_reply} |")
    return "\n".join(lines)


def part_cost(work: Path) -> dict[str, Any]:
    d = work / "cost"
    d.mkdir()
    e = engine(d, ctx=34000)
    rows = []

    async def one(eng: LlamaServer, body: dict) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        text = await eng.apply_template(body)
        t1 = time.perf_counter()
        toks = await eng.tokenize(text)
        return 1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t1), len(toks)

    async def go():
        eng = LlamaServer(e.url, timeout_s=120)
        try:
            for size in (1000, 4000, 16000, 32000):
                body = chat([{"role": "user", "content": facts(size // 18) + "\nHow many marbles are in box 5?"}])
                await one(eng, body)  # a warm connection
                runs = [await one(eng, body) for _ in range(7)]
                rows.append({"target": size, "tokens": runs[0][2], "apply_ms": med([x[0] for x in runs]),
                             "tokenize_ms": med([x[1] for x in runs]),
                             "total_ms": med([x[0] + x[1] for x in runs]), "busy": False})
                print(f"  cost {runs[0][2]:,} tokens: {rows[-1]['total_ms']:.1f} ms", flush=True)
            # Beside a running request: a 16k prefill keeps the engine's slot (and both cores) busy.
            big = chat([{"role": "user", "content": facts(16000 // 18, "crate") + "\nWhich crate is red?"}], 4)
            small = chat([{"role": "user", "content": facts(4000 // 18) + "\nHow many marbles are in box 5?"}])
            done = threading.Event()

            def prefill():
                e.post("/v1/chat/completions", big, timeout=600)
                done.set()

            th = threading.Thread(target=prefill)
            th.start()
            await asyncio.sleep(0.5)  # the prefill has started (bench only: no assertion hangs on it)
            runs = []
            while not done.is_set() and len(runs) < 7:
                runs.append(await one(eng, small))
            th.join()
            if runs:
                rows.append({"target": 4000, "tokens": runs[0][2], "apply_ms": med([x[0] for x in runs]),
                             "tokenize_ms": med([x[1] for x in runs]), "total_ms": med([x[0] + x[1] for x in runs]),
                             "busy": True, "n": len(runs)})
        finally:
            await eng.close()

    try:
        asyncio.run(go())
    finally:
        e.stop()
    return {"rows": rows}


def t_cost(r: dict[str, Any]) -> str:
    lines = ["| prompt tokens | engine | /apply-template (ms) | /tokenize (ms) | both (ms) |",
             "|---:|---|---:|---:|---:|"]
    for x in r["rows"]:
        lines.append(f"| {x['tokens']:,} | {'busy with a 16k prefill' if x['busy'] else 'idle'} | "
                     f"{x['apply_ms']:.1f} | {x['tokenize_ms']:.1f} | {x['total_ms']:.1f} |")
    return "\n".join(lines)


def part_reuse(work: Path) -> dict[str, Any]:
    """A ~4k-token conversation P saved; the slot then holds another; P's file restored; then
    P with one fact edited at a fraction of the way through. cache_n against the prefix the
    prompt shares with the file (what the index predicts)."""
    n_facts = 4000 // 18
    question = "\nHow many marbles are in box 5?"
    p = chat([{"role": "user", "content": facts(n_facts) + question}])
    other = chat([{"role": "user", "content": facts(30, "jar") + "\nWhich jar is red?"}])
    edits = {"10%": int(0.1 * n_facts), "50%": n_facts // 2, "80%": int(0.8 * n_facts),
             "in the last 512 tokens": n_facts - 12, "none (the same prompt)": None}
    rows = []
    for swa_full in (True, False):
        d = work / f"reuse-{'swafull' if swa_full else 'noswafull'}"
        d.mkdir()
        e = engine(d, swa_full=swa_full)

        async def go():
            eng = LlamaServer(e.url, timeout_s=120)
            try:
                e.post("/v1/chat/completions", p)
                await eng.save(0, "p.bin")
                file_tokens = encode(read_header(d / "p.bin").tokens)
                n_file = len(file_tokens) // 4
                for label, at in edits.items():
                    body = chat([{"role": "user", "content": facts(n_facts, edit=at) + question}])
                    q = encode(await eng.prompt_tokens(body))
                    shared = common_prefix(file_tokens, q)
                    e.post("/v1/chat/completions", other)
                    await eng.restore(0, "p.bin")
                    restored = e.post("/v1/chat/completions", body)
                    # The same edit with P still in the slot (no save/restore): the engine alone.
                    e.post("/v1/chat/completions", p)
                    live = e.post("/v1/chat/completions", body)
                    rows.append({"swa_full": swa_full, "edit": label, "prompt": restored["usage"]["prompt_tokens"],
                                 "shared": shared, "file_tokens": n_file,
                                 "cache_n_restored": restored["timings"]["cache_n"],
                                 "cache_n_live": live["timings"]["cache_n"],
                                 "prompt_ms_restored": restored["timings"]["prompt_ms"]})
                    print(f"  reuse swa_full={swa_full} edit at {label}: shared {shared}, cache_n "
                          f"{rows[-1]['cache_n_restored']} (live {rows[-1]['cache_n_live']})", flush=True)
            finally:
                await eng.close()

        try:
            asyncio.run(go())
        finally:
            e.stop()
    return {"rows": rows}


def t_reuse(r: dict[str, Any]) -> str:
    lines = ["| engine | edit at | prompt tokens | file tokens | shared with the file | file past the prefix | "
             "cache_n after restore | prompt ms after restore | cache_n, P still in the slot |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["rows"]:
        lines.append(f"| {'--swa-full' if x['swa_full'] else 'no --swa-full'} | {x['edit']} | {x['prompt']:,} | "
                     f"{x['file_tokens']:,} | {x['shared']:,} | {x['file_tokens'] - x['shared']:,} | "
                     f"{x['cache_n_restored']:,} | {x['prompt_ms_restored']:,.0f} | {x['cache_n_live']:,} |")
    return "\n".join(lines)


def part_prefix(work: Path) -> dict[str, Any]:
    """The agent case: C = system prompt S (~2,900 tokens) + task 1, saved; D = S + task 2.
    Restoring C gives D nothing on Gemma 3 (C goes on more than 512 tokens past S). A file
    that ends right after S does: the slot made to hold exactly D's first tokens with
    /completion (the tokens themselves as the prompt, n_predict 0), saved, restored later."""
    d = work / "prefix"
    d.mkdir()
    e = engine(d)
    system = "You are a careful assistant. Rules: " + facts(160, "rule")
    c = chat([{"role": "system", "content": system},
              {"role": "user", "content": "Task one: " + facts(40, "box") + " Which box is red?"}])
    dd = chat([{"role": "system", "content": system},
               {"role": "user", "content": "Task two: " + facts(40, "jar") + " Which jar is blue?"}])
    other = chat([{"role": "user", "content": "Say hi."}])
    out: dict[str, Any] = {}

    async def go():
        eng = LlamaServer(e.url, timeout_s=600)
        try:
            e.post("/v1/chat/completions", c)
            await eng.save(0, "c.bin")
            c_tokens = encode(read_header(d / "c.bin").tokens)
            d_tokens = await eng.prompt_tokens(dd)
            shared = common_prefix(c_tokens, encode(d_tokens))
            out.update(c_file=len(c_tokens) // 4, d_prompt=len(d_tokens), shared=shared)
            e.post("/v1/chat/completions", other)
            await eng.restore(0, "c.bin")
            r = e.post("/v1/chat/completions", dd)
            out["after_c"] = {"cache_n": r["timings"]["cache_n"], "prompt_ms": r["timings"]["prompt_ms"]}
            e.post("/v1/chat/completions", other)
            t0 = time.perf_counter()
            r = e.post("/completion", {"prompt": d_tokens[:shared], "n_predict": 0, "cache_prompt": True, "id_slot": 0})
            saved = await eng.save(0, "s.bin")
            out["make_prefix"] = {"s": time.perf_counter() - t0, "prompt_n": r["timings"]["prompt_n"],
                                  "n_saved": saved.n_tokens, "bytes": saved.n_bytes, "save_ms": saved.ms}
            e.post("/v1/chat/completions", other)
            await eng.restore(0, "s.bin")
            r = e.post("/v1/chat/completions", dd)
            out["after_prefix"] = {"cache_n": r["timings"]["cache_n"], "prompt_ms": r["timings"]["prompt_ms"]}
        finally:
            await eng.close()

    try:
        asyncio.run(go())
    finally:
        e.stop()
    print(f"  prefix: after C cache_n {out['after_c']['cache_n']}, after the prefix file "
          f"{out['after_prefix']['cache_n']} of {out['shared']} shared", flush=True)
    return out


def t_prefix(r: dict[str, Any]) -> str:
    return "\n".join([
        f"C's file: {r['c_file']:,} tokens; D's prompt: {r['d_prompt']:,} tokens; shared (S): {r['shared']:,}\n",
        "| D's first request after | cache_n | prompt ms |", "|---|---:|---:|",
        f"| restoring C's file | {r['after_c']['cache_n']:,} | {r['after_c']['prompt_ms']:,.0f} |",
        f"| restoring a file of exactly S (made with /completion n_predict 0 + save: "
        f"{r['make_prefix']['n_saved']:,} tokens, {r['make_prefix']['bytes'] / 1e6:.1f} MB, "
        f"{r['make_prefix']['s']:.1f} s) | {r['after_prefix']['cache_n']:,} | {r['after_prefix']['prompt_ms']:,.0f} |"])


def part_turn(work: Path) -> dict[str, Any]:
    """What a switching turn adds on the request's path before any save or restore: the
    request's tokens from the engine (/apply-template + /tokenize), encoding them, and
    index.best over N files of this model (each shares a random part of the request's first
    half, as files of one agent's conversations do); and, for a new conversation with a
    system prompt, finding where that prompt ends (the prefix probe: one more
    /apply-template + /tokenize of the part before the first user message)."""
    d = work / "turn"
    d.mkdir()
    e = engine(d, ctx=20000)
    rows = []
    rng = random.Random(12)

    async def go():
        from autosessd.prefix import SPLIT_MARK

        eng = LlamaServer(e.url, timeout_s=120)
        try:
            for size in (1000, 4000, 16000):
                system = "You are a careful assistant. Rules: " + facts(size // 4 // 18, "rule")
                body = chat([{"role": "system", "content": system},
                             {"role": "user", "content": facts(3 * size // 4 // 18) + "\nWhich box is red?"}])
                probe = {**body, "messages": [body["messages"][0], {"role": "user", "content": SPLIT_MARK}]}
                tokens = await eng.prompt_tokens(body)
                tok_runs, probe_runs = [], []
                for _ in range(7):
                    t0 = time.perf_counter()
                    q = encode(await eng.prompt_tokens(body))
                    tok_runs.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    text = await eng.apply_template(probe)
                    common_prefix(encode(await eng.tokenize(text[:text.find(SPLIT_MARK)])), q)
                    probe_runs.append(time.perf_counter() - t0)
                for n_files in FILES:
                    fd = d / f"{size}-{n_files}"
                    fd.mkdir()
                    idx = TokenIndex(fd)
                    for i in range(n_files):
                        k = rng.randrange(len(tokens) // 2)
                        t = tokens[:k] + [rng.randrange(VOCAB) for _ in range(len(tokens) - k)]
                        (fd / f"f{i}.bin").write_bytes(build(t))
                        idx.add(f"f{i}.bin", t, MODEL)
                    q = encode(tokens)
                    look = timed(lambda: idx.best(encode(tokens), MODEL, min_lcp=100, window=512), 50)
                    assert idx.best(q, MODEL) is not None
                    rows.append({"tokens": len(tokens), "files": n_files, "tokens_ms": 1e3 * med(tok_runs),
                                 "lookup_ms": 1e3 * look, "probe_ms": 1e3 * med(probe_runs)})
                    print(f"  turn {len(tokens):,} tokens × {n_files:,} files: tokens {rows[-1]['tokens_ms']:.1f} ms "
                          f"+ lookup {rows[-1]['lookup_ms']:.2f} ms", flush=True)
                    for p in fd.iterdir():
                        p.unlink()
                    fd.rmdir()
        finally:
            await eng.close()

    try:
        asyncio.run(go())
    finally:
        e.stop()
    return {"rows": rows}


def t_turn(r: dict[str, Any]) -> str:
    lines = ["| prompt tokens | files | request's tokens from the engine (ms) | encode + lookup (ms) | "
             "turn adds (ms) | prefix probe, new conversations (ms) |", "|---:|---:|---:|---:|---:|---:|"]
    for x in r["rows"]:
        lines.append(f"| {x['tokens']:,} | {x['files']:,} | {x['tokens_ms']:.1f} | {x['lookup_ms']:.2f} | "
                     f"{x['tokens_ms'] + x['lookup_ms']:.1f} | {x['probe_ms']:.1f} |")
    return "\n".join(lines)


def part_split(work: Path) -> dict[str, Any]:
    """The shared prefix through the real daemon (gate, min tokens 100), against the engine
    alone, both --cache-ram 0. A new conversation C = S + task 1: its first request, where
    autosessd reads S on its own and saves it before forwarding C (the split), vs the same
    request to the engine alone. Then engine (and autosessd) restarted: D = S + task 2's
    first request, where autosessd restores the prefix file. Times are whole requests with
    max_tokens 1 (time to first token); S differs per repetition (no file holds it yet)."""
    from harness import Daemon, Engine

    reps = int(os.environ.get("BENCH_REPS", "3"))
    rows = []
    for size in (1500, 3000):
        r: dict[str, list] = {"c_engine": [], "c_gate": [], "d_engine": [], "d_gate": [], "split": [],
                              "split_total": [], "d_cache_n": [], "s_tokens": []}
        for rep in range(reps):
            system = f"Session {rep}. You are a careful clerk. Rules: " + facts(size // 18, "rule")
            c = chat([{"role": "system", "content": system},
                      {"role": "user", "content": "Task one: " + facts(40, "jar") + " Which jar is red?"}], 1)
            dd = chat([{"role": "system", "content": system},
                       {"role": "user", "content": "Task two: which rule holds the most marbles?"}], 1)
            for who in ("engine", "gate"):
                sd = work / f"split-{size}-{rep}-{who}"
                sd.mkdir()
                dtmp = work / f"d-{size}-{rep}"
                dtmp.mkdir(exist_ok=True)
                e = Engine(sd, log_path=work / f"engine-split-{size}-{rep}-{who}.log").start()
                dmn = None
                try:
                    if who == "gate":
                        dmn = Daemon(dtmp, sd, e.url).start()
                    t0 = time.perf_counter()
                    e.post("/v1/chat/completions", c, base=dmn.gate_url if dmn else None)
                    r[f"c_{who}"].append(time.perf_counter() - t0)
                    if dmn is not None:
                        dmn.stop()
                        line = next(x for x in dmn.logtext().splitlines() if "on their own and saved them" in x)
                        m = re.search(r": (\d+) ms \(([\d,]+) tokens read in (\d+) ms", line)
                        # What the split adds: all it took, less reading S (which C's request would do anyway).
                        r["split"].append(float(m.group(1)) - float(m.group(3)))
                        r["split_total"].append(float(m.group(1)))
                    e.restart()
                    if who == "gate":
                        dmn = Daemon(dtmp, sd, e.url).start()  # the same state directory: the index cache
                    t0 = time.perf_counter()
                    out = e.post("/v1/chat/completions", dd, base=dmn.gate_url if dmn else None)
                    r[f"d_{who}"].append(time.perf_counter() - t0)
                    if dmn is not None:
                        r["d_cache_n"].append(out["timings"]["cache_n"])
                        last = dmn.status()["slots"][0]["last_restore"]
                        assert last and last["prefix"], last
                        r["s_tokens"].append(last["shared"])
                finally:
                    if dmn is not None:
                        dmn.stop()
                    e.stop()
        row = {"size": size, **{k: med(v) for k, v in r.items() if v}, "n": reps}
        rows.append(row)
        print(f"  split S≈{size:,}: C engine {row['c_engine']:.2f} s, gate {row['c_gate']:.2f} s; D after restart "
              f"engine {row['d_engine']:.2f} s, gate {row['d_gate']:.2f} s (cache_n {row['d_cache_n']:,.0f})",
              flush=True)
    return {"rows": rows}


def t_split(r: dict[str, Any]) -> str:
    lines = ["| S (tokens) | C's first request: engine alone / gate (s) | split: reading S + saving (ms) | "
             "split adds (ms) | D's first request after a restart: engine alone / gate (s) | D reused (cache_n) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for x in r["rows"]:
        lines.append(f"| {x['s_tokens']:,.0f} | {x['c_engine']:.2f} / {x['c_gate']:.2f} | "
                     f"{x.get('split_total', float('nan')):,.0f} | {x['split']:,.0f} | "
                     f"{x['d_engine']:.2f} / {x['d_gate']:.2f} | {x['d_cache_n']:,.0f} |")
    return "\n".join(lines)


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
