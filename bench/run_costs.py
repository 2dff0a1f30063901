"""bench/run.py scenarios 4 and 5, what autosessd adds on a request's path: a turn's save and
restore against the disk (and a plain client's floor under it), and the gate on requests that
need no turn (latency, requests/s, streamed chunks)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from run_common import REPS, SIZES, SMALL_B, Run, conv, ctl, demo, going_on, med, pct


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
