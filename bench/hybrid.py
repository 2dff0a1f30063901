"""Scenario 16: the models people run now, on the real engine (issue 47): a hybrid of Qwen3.5's
shape (full attention and Gated DeltaNet layers) and gpt-oss-20b's attention (a 128-token window
every other layer, run with --swa-full as doctor asks: without it llama-server b11434 reuses no
restore of a window model at all, alone or with autosessd), a conversation A of ~6k tokens.

For each: A, then B on the one slot (a switch), then A's next turn whose reply comes back as other
text (the departure templates that drop earlier reasoning make), then that request again (a retry),
then after an engine restart. Two competitors, each in its own engines:
  alone       llama-server with its own save of A's slot after its turn and its restore before A's
              next request (what a script or a client calling the slot API does)
  autosessd   the gate: each save taken one token before its prompt's end (sessions/rewind.py)
The table: what the engine reused (cache_n of the prompt) and the time to first token."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import demo
from run_common import Run, conv, ctl, going_on

SIZE = 6000
MODELS = (("qwen35", "MODEL_QWEN35", False), ("gptoss", "MODEL_GPTOSS", True))  # name, path key, --swa-full


def _post(port: int, path: str, body: dict) -> Any:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1200) as r:
        return json.load(r)


def _row(r: dict) -> dict:
    return {"cache_n": r["cache_n"], "prompt": r["prompt"], "ttft_s": round(r["ttft"], 3)}


def _one(run: Run, path: str, swa_full: bool, with_autosessd: bool) -> dict[str, Any]:
    eng = run.engine(model=path, swa_full=swa_full, ctx=16384)
    port = eng["port"]
    a = conv(SIZE, "box")
    b = conv(SIZE // 4, "jar")
    d = run.daemon(eng) if with_autosessd else None
    via = d["port"] if d else port

    def switch() -> None:
        """B on the slot, then A back: by the engine's own save and restore when alone."""
        if d is None:
            _post(port, "/slots/0?action=save", {"filename": "a.bin"})
        demo.ask(via, b)
        if d is None:
            _post(port, "/slots/0?action=restore", {"filename": "a.bin"})

    first = demo.ask(via, a)
    nxt = going_on(a, "Something else entirely.", "Why that one?")
    switch()
    ret = demo.ask(via, nxt)
    switch()
    retry = demo.ask(via, nxt)
    run.stop(eng["proc"])
    eng2 = run.engine(model=path, swa_full=swa_full, ctx=16384, port=port, sessions=eng["sessions"])
    if d is None:
        _post(port, "/slots/0?action=restore", {"filename": "a.bin"})
    else:
        time.sleep(2)  # the daemon sees the engine back
    restart = demo.ask(via, nxt)
    out = {"first": _row(first), "return": _row(ret), "retry": _row(retry), "restart": _row(restart)}
    if d is not None:
        c = ctl(d["socket"], "status")["counters"]
        out["counters"] = {k: c[k] for k in ("rewinds", "rewinds_reread", "restores_reused", "restores_not_reused")}
    run.stop(eng2["proc"])
    if d is not None:
        run.stop(d["proc"])
    return out


def s16_hybrid(run: Run) -> dict[str, Any]:
    out: dict[str, Any] = {"size": SIZE, "models": {}}
    for name, key, swa_full in MODELS:
        if key not in run.paths:
            out["models"][name] = {"missing": f"scripts/fetch-engine gave no {key}"}
            continue
        out["models"][name] = {"swa_full": swa_full, "alone": _one(run, run.paths[key], swa_full, False),
                               "autosessd": _one(run, run.paths[key], swa_full, True)}
    return out


def t16(r: dict[str, Any]) -> str:
    rows = ["| model | request | engine alone: reused / prompt | TTFT | autosessd: reused / prompt | TTFT |",
            "|---|---|---:|---:|---:|---:|"]
    for name, m in r["models"].items():
        if "missing" in m:
            rows.append(f"| {name} | {m['missing']} | | | | |")
            continue
        for step, what in (("first", "A, first read"), ("return", "A's next turn after a switch (reply departs)"),
                           ("retry", "the same request again after a switch"), ("restart", "after an engine restart")):
            a, s = m["alone"][step], m["autosessd"][step]
            rows.append(f"| {name} | {what} | {a['cache_n']:,} / {a['prompt']:,} | {a['ttft_s']:.2f} s | "
                        f"{s['cache_n']:,} / {s['prompt']:,} | {s['ttft_s']:.2f} s |")
        c = m["autosessd"].get("counters")
        if c:
            rows.append(f"| {name} | autosessd's counters | | | {json.dumps(c)} | |")
    return "\n".join(rows)
