#!/usr/bin/env python3
"""What a restore costs beyond the engine's own `restore_ms`, by client (issue 23): the floor
under scenario 4's *back* overhead. llama-server times only llama_state_seq_load_file; its
HTTP handling, the task queue and the answer come on top, whoever asks.

    python bench/restore_floor.py            a ~21k-token file, 50 restores per client
    FLOOR_TOKENS=5000 FLOOR_N=100 ...
    FLOOR_OUT=bench/results/restore-floor-<date>.json ...   the medians and quartiles, kept

One engine (-np 1, --cache-ram 0, --swa-full), one saved file restored again and again, the
clients interleaved restore by restore (drift hits them alike): a blocking socket (the
floor), the event loop's sock_* calls, autosessd's lean client (engines/http1.py) and its
LlamaServer.restore. Prints a Markdown table of the wall time beyond restore_ms, in ms."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "bench"), str(ROOT)]

import demo  # noqa: E402
from run_common import Run, conv  # noqa: E402
from run_costs import answer, blocking_call, restore_request  # noqa: E402  (scenario 4's plain client)

from autosessd.engines import http1  # noqa: E402
from autosessd.engines.llama_server import LlamaServer  # noqa: E402

TOKENS = int(os.environ.get("FLOOR_TOKENS", "21000"))
N = int(os.environ.get("FLOOR_N", "50"))
BODY = b'{"filename":"floor.bin"}'
RESTORE = restore_request("floor.bin")


def more(data: bytes) -> bytes:
    if not data:
        raise SystemExit("bench: the engine closed the connection (did it die?)")
    return data


def post(path: str, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)


async def measure(port: int, s: socket.socket) -> dict[str, list[float]]:
    loop = asyncio.get_running_loop()
    engine = LlamaServer(f"http://127.0.0.1:{port}")
    client = http1.Client(f"http://127.0.0.1:{port}")
    raw = socket.create_connection(("127.0.0.1", port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw.setblocking(False)

    async def blocking() -> float:
        t = time.perf_counter()
        r = blocking_call(s, RESTORE)
        return (time.perf_counter() - t) * 1000 - r["timings"]["restore_ms"]

    async def sock_calls() -> float:
        t = time.perf_counter()
        await loop.sock_sendall(raw, RESTORE)
        buf = b""
        while (r := answer(buf)) is None:
            buf += more(await loop.sock_recv(raw, 65536))
        return (time.perf_counter() - t) * 1000 - r["timings"]["restore_ms"]

    async def lean() -> float:
        t = time.perf_counter()
        _, body = await client.request("POST", "/slots/0?action=restore", BODY, {}, 120)
        return (time.perf_counter() - t) * 1000 - json.loads(body)["timings"]["restore_ms"]

    async def adapter() -> float:
        t = time.perf_counter()
        r = await engine.restore(0, "floor.bin")
        return (time.perf_counter() - t) * 1000 - r.ms

    ways = {"blocking socket (the floor)": blocking, "event loop sock_* calls": sock_calls,
            "autosessd's http1.Client": lean, "autosessd's LlamaServer.restore": adapter}
    out: dict[str, list[float]] = {k: [] for k in ways}
    try:
        for _ in range(N):
            for k, f in ways.items():
                out[k].append(await f())
    finally:
        raw.close()
        await client.close()
        await engine.close()
    return out


def main() -> int:
    paths = demo.fetch_engine("bench")
    with tempfile.TemporaryDirectory() as d:
        run = Run(Path(d), paths)
        try:
            port = run.engine(cache_ram=0)["port"]  # scenario 4's engine: -np 1, -c 32768, --swa-full
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            chat = json.dumps({"messages": conv(TOKENS, "floor"), "max_tokens": 4, "id_slot": 0}).encode()
            blocking_call(s, post("/v1/chat/completions", chat))
            saved = blocking_call(s, post("/slots/0?action=save", BODY))
            n = saved["n_saved"]  # what the file holds: the prompt and the few tokens answered
            res = asyncio.run(measure(port, s))
            s.close()
        finally:
            run.close()
    rows = {k: {"median_ms": statistics.median(v), "p25_ms": sorted(v)[len(v) // 4],
                "p75_ms": sorted(v)[3 * len(v) // 4]} for k, v in res.items()}
    if os.environ.get("FLOOR_OUT"):
        Path(os.environ["FLOOR_OUT"]).write_text(json.dumps({"tokens": n, "bytes": saved["n_written"], "n": N,
                                                              "beyond_restore_ms": rows}, indent=1) + "\n")
    print(f"restore of {n:,} tokens ({saved['n_written'] / 1e6:.1f} MB), {N} times per client, interleaved\n")
    print("| client | beyond restore_ms, median (ms) | p25–p75 (ms) |\n|---|---:|---|")
    for k, r in rows.items():
        print(f"| {k} | {r['median_ms']:.3f} | {r['p25_ms']:.3f}–{r['p75_ms']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
