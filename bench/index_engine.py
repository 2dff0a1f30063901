"""bench/index.py's parts on the real engine's tokens: do /apply-template + /tokenize give the
saved file's tokens, does a conversation going on extend its file, what the two calls cost, and
what they and the lookup add to a switching turn."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path
from typing import Any

# First: it puts this checkout and tests/ on sys.path, so the autosessd measured is this one.
from index_common import FILES, MODEL, VOCAB, chat, engine, facts, med, timed

from autosessd.engines.llama_server import LlamaServer
from autosessd.store.index import TokenIndex
from autosessd.store.runs import common_prefix
from autosessd.store.slotfile import build, encode, read_header


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
        from autosessd.sessions.prefix import SPLIT_MARK

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
