"""Scenario 11 of `make bench`: switches at a real model's size, with and without saving while
the engine is idle (issue 23).

The fake engine (tests/fake_engine.py) holds 131,072 bytes of state a token, as an 8B model
(Llama 3.1 8B: 32 layers × 8 KV heads × 128 × 2 × f16), and writes and reads every byte of
its state files at this disk's speed, reporting its own save_ms / restore_ms. Two
conversations A and B of `size` GB each take turns on its one slot, one request each, with a
pause between requests long enough for a save and its finalize; every request adds to its
conversation, so the one going out is always newer than its file.

    switch saves     idle_save_s = 0: each switch saves the conversation going out, then
                     restores the one coming in (what autosessd did before issue 23)
    saved while idle idle_save_s = 1: the pause after each reply saves it; the switch restores
                     (also with idle_save_mb_per_min lifted: the default cap of 4,096 MB
                     a minute defers idle saves of two 4 GB conversations taking turns)

Per switch: the incoming request's wait (the turn's time in autosessd, and the client's time
to the answer less the fake's own time on the request, which it reports as llama-server
reports prompt_ms + predicted_ms), against the engine's restore time. The pause after each
reply lasts until every save is durable and, saving while idle, the reply's conversation is
saved (or the cap deferred it past a bound): how long that took is in the results (pause_s).
Then one conversation going on with pauses and no switch: what saving while idle writes
that the switch would not have (nothing, without it).

    BENCH_GB=1,4        the sizes (GB); BENCH_GB_REPS switches measured per size and mode
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BYTES_PER_TOKEN = 131072
CHARS_PER_TOKEN = 4  # the fake counts a prompt's tokens as its JSON text's length / 4
GEN_S = 0.01  # the fake's own time to "generate"
MIN_PAUSE_S = 2.0  # the least pause after a reply (idle_save_s is 1 s)
SIZES_GB = [float(x) for x in os.environ.get("BENCH_GB", "1,4").split(",")]
REPS = int(os.environ.get("BENCH_GB_REPS", "4"))


def _fake(run: Any, directory: Path) -> dict[str, Any]:
    import demo

    port = demo.free_port()
    p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fake_engine.py"), "--port", str(port), "--dir",
                          str(directory), "--bytes-per-token", str(BYTES_PER_TOKEN), "--fault", f"gen-s={GEN_S}"],
                         stdout=subprocess.PIPE, text=True)
    run.procs.append(p)
    assert p.stdout.readline().strip() == "ready"
    return {"proc": p, "port": port, "sessions": directory}


def _ask(port: int, messages: list[dict[str, str]]) -> tuple[float, dict[str, Any]]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.monotonic()
    c.request("POST", "/v1/chat/completions", json.dumps({"messages": messages}), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = json.loads(r.read())
    wait = time.monotonic() - t0
    c.close()
    assert r.status == 200, data
    return wait, data


def _conversation(n_tokens: int, topic: str) -> list[dict[str, str]]:
    # The fake's prompt is the JSON of the messages: n_tokens × 4 characters of it.
    return [{"role": "user", "content": f"{topic}: " + "x" * (n_tokens * CHARS_PER_TOKEN)}]


def _grown(messages: list[dict[str, str]], data: dict[str, Any], i: int) -> list[dict[str, str]]:
    return messages + [{"role": "assistant", "content": data["choices"][0]["message"]["content"]},
                       {"role": "user", "content": f"And then {i}?"}]


def _events(sock: Path) -> list[dict[str, Any]]:
    from autosessd import ctl

    return ctl.call(sock, "events", timeout=60, limit=1000)


def _counters(sock: Path) -> dict[str, Any]:
    from autosessd import ctl

    return ctl.call(sock, "status", timeout=60)["counters"]


def one(run: Any, size_gb: float, idle: bool, cap_mb: float | None = None) -> dict[str, Any]:
    """cap_mb: idle_save_mb_per_min (None: the default, 4,096)."""
    n_tokens = int(size_gb * 1e9 / BYTES_PER_TOKEN)
    sessions = run._dir(f"gb-{size_gb:g}-{'idle' if idle else 'switch'}")
    fake = _fake(run, sessions)
    extra = ["--idle-save-s", "1" if idle else "0"]
    if cap_mb is not None:
        conf = sessions.parent / f"gb-{size_gb:g}-cap.toml"
        conf.write_text(f'slot_save_path = "{sessions}"\nidle_save_mb_per_min = {cap_mb}\n')
        extra += ["--config", str(conf)]
    d = run.daemon(fake, extra, min_tokens=256)
    pauses: list[float] = []

    def pause() -> None:
        """The pause after a reply: until every save is durable (its finalize: fsync, digest,
        rename) and, saving while idle, the idle save of the reply's conversation is (or the
        cap deferred it past the bound)."""
        t0, idle_before = time.monotonic(), _counters(d["socket"])["idle_saves"]
        time.sleep(MIN_PAUSE_S)
        while time.monotonic() - t0 < MIN_PAUSE_S + size_gb * 8.0:
            evs = _events(d["socket"])
            saved = sum(e["type"] == "saved" for e in evs)
            final = sum(e["type"] in ("finalized", "save_failed") for e in evs)
            if saved == final and (not idle or _counters(d["socket"])["idle_saves"] > idle_before):
                break
            time.sleep(0.1)
        pauses.append(time.monotonic() - t0)

    convs = {"A": _conversation(n_tokens, "A"), "B": _conversation(n_tokens, "B")}
    for name in "AB":  # each once: A is saved when B comes, B while idle or not at all
        _, data = _ask(d["port"], convs[name])
        convs[name] = _grown(convs[name], data, 0)
        pause()
    waits, c0 = [], _counters(d["socket"])
    turns_before = len([e for e in _events(d["socket"]) if e["type"] == "turn"])
    for i in range(REPS):
        name = "AB"[i % 2]
        wait, data = _ask(d["port"], convs[name])
        waits.append(wait - data["timings"]["fake_ms"] / 1000)  # less the engine's own time on it
        convs[name] = _grown(convs[name], data, i + 1)
        pause()
    c1 = _counters(d["socket"])
    turns = [e for e in _events(d["socket"]) if e["type"] == "turn"][turns_before:]
    # The conversation held now going on, pauses between its requests, no switch.
    name = "AB"[(REPS - 1) % 2]
    going_on = []
    for i in range(2):
        wait, data = _ask(d["port"], convs[name])
        going_on.append(wait - data["timings"]["fake_ms"] / 1000)
        convs[name] = _grown(convs[name], data, REPS + i + 1)
        pause()
    c2 = _counters(d["socket"])
    run.close()
    shutil.rmtree(sessions, ignore_errors=True)
    restore_ms = [t["restored"]["engine_ms"] for t in turns if t.get("restored")]
    save_ms = [t["saved"]["engine_ms"] for t in turns if t.get("saved")]
    turn_ms = [t["ms"] for t in turns]
    return {"n_tokens": n_tokens, "state_bytes": n_tokens * BYTES_PER_TOKEN, "switches": len(turns),
            "turn_ms": turn_ms, "wait_ms": [w * 1000 for w in waits], "restore_ms": restore_ms,
            "switch_save_ms": save_ms, "saves_in_switches": len(save_ms),
            "bytes_per_switch": (c1["bytes_saved"] - c0["bytes_saved"]) / max(1, REPS),
            "bytes_per_turn_going_on": (c2["bytes_saved"] - c1["bytes_saved"]) / 2,
            "idle_saves": c2["idle_saves"], "pause_s": pauses,
            # The same request's wait without a switch (the gate's and the fake's HTTP, the
            # turn going on): what a switch adds is the wait beyond it.
            "wait_going_on_ms": [w * 1000 for w in going_on]}


def s11_gb(run: Any) -> dict[str, Any]:
    import statistics

    out: dict[str, Any] = {"bytes_per_token": BYTES_PER_TOKEN, "reps": REPS, "sizes": {}}
    need = 4 * max(SIZES_GB) * 1e9 + 2e9  # two conversations, a save's temporary, a margin
    free = shutil.disk_usage(run.work).free
    if free < need:
        out["skipped"] = f"{free / 1e9:.0f} GB free in {run.work}, the scenario needs {need / 1e9:.0f} GB"
        print(f"  skipped: {out['skipped']}", flush=True)
        return out
    for size in SIZES_GB:
        res = {}
        # The default cap (4,096 MB a minute) lets four 1 GB idle saves, or one 4 GB one,
        # through a minute: with two such conversations taking turns every few seconds the
        # switch saves the rest. "cap lifted" measures the mechanism alone.
        for mode, idle, cap in (("switch saves", False, None), ("saved while idle", True, None),
                                ("saved while idle, cap lifted", True, 1e6)):
            r = one(run, size, idle, cap)
            med = statistics.median
            r["summary"] = {"wait_ms": med(r["wait_ms"]), "turn_ms": med(r["turn_ms"]),
                            "restore_ms": med(r["restore_ms"]) if r["restore_ms"] else float("nan"),
                            "save_ms": med(r["switch_save_ms"]) if r["switch_save_ms"] else 0.0}
            sm = r["summary"]
            sm["wait_going_on_ms"] = med(r["wait_going_on_ms"])
            sm["wait_over_restore"] = sm["wait_ms"] / sm["restore_ms"]
            sm["added_over_restore"] = (sm["wait_ms"] - sm["wait_going_on_ms"]) / sm["restore_ms"]
            sm["turn_over_restore"] = sm["turn_ms"] / sm["restore_ms"]
            res[mode] = r
            print(f"  {size:g} GB, {mode}: wait {sm['wait_ms']:.0f} ms, "
                  f"restore {sm['restore_ms']:.0f} ms ({sm['wait_over_restore']:.2f}×)", flush=True)
        out["sizes"][f"{size:g}"] = res
    return out


def t11(r: dict[str, Any]) -> str:
    import statistics

    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    lines = [f"Fake engine at {r['bytes_per_token']:,} bytes a token (an 8B model), files written and read at this "
             f"disk's speed; two conversations taking turns on one slot, a pause after each reply; medians of "
             f"{r['reps']} switches. *wait*: the incoming request's time to its answer, less the fake's own time "
             f"on it; *turn*: autosessd's own time for the switch; *pause*: after a reply, until its saves were "
             f"durable.", "",
             "| state | mode | engine save ms (at the switch) | engine restore ms | turn ms | wait ms (no switch) | "
             "wait / restore | **added by the switch / restore** | pause s | written per switch | "
             "written per turn, no switch |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size, res in r["sizes"].items():
        for mode, d in res.items():
            s = d["summary"]
            lines.append(f"| {d['state_bytes'] / 1e9:.2f} GB ({d['n_tokens']:,} tok) | {mode} | "
                         f"{s['save_ms']:,.0f} ({d['saves_in_switches']} of {d['switches']}) | {s['restore_ms']:,.0f} | "
                         f"{s['turn_ms']:,.0f} | {s['wait_ms']:,.0f} ({s['wait_going_on_ms']:,.0f}) | "
                         f"{s['wait_over_restore']:.2f}× | **{s['added_over_restore']:.2f}×** | "
                         f"{statistics.median(d['pause_s']):.1f} | "
                         f"{d['bytes_per_switch'] / 1e9:.2f} GB | {d['bytes_per_turn_going_on'] / 1e9:.2f} GB |")
    lines += ["", "Target: saved while idle, the wait a switch adds ≤ 1.1× the engine's restore time (the wait "
              "less the same request's without a switch, in the same run)."]
    return "\n".join(lines)
