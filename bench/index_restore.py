"""bench/index.py's parts on what a restored file gives the next request: a prompt that departs
from it in the middle, a shared system prompt (the task's file vs a file of the prefix), and
that prefix split off and saved through the real daemon, then restored after a restart."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path
from typing import Any

# First: it puts this checkout and tests/ on sys.path, so the autosessd measured is this one.
from index_common import chat, engine, facts, med

from autosessd.engines.llama_server import LlamaServer
from autosessd.store.runs import common_prefix
from autosessd.store.slotfile import encode, read_header


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
    Restoring C gives D nothing on Gemma 3 270M (C goes on more than its 512-token window past S). A file
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
