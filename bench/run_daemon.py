"""bench/run.py scenarios 6 to 8, what the daemon costs off the request's path: how fast the
tail reacts to an `end` line, status, ls and the prune plan over a large session directory,
and its memory and idle CPU."""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from typing import Any

import psutil

from run_common import Run, ctl, med, pct


# -- 6. tail reaction ------------------------------------------------------------------------
def s6_tail(run: Run) -> dict[str, Any]:
    from autosessd.front import protocol

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
    from autosessd.base.config import parse
    from autosessd.sessions.facade import Sessions
    from autosessd.store.directory import Meta, Store
    from autosessd.store.prune import plan_prune

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
