"""The one HTTP pool to the engine (autosessd/engines/upstream.py), against small in-process servers:
the gate and the adapter share connections, a connection the engine closed under us is
retried once, and a retired pool is closed once its last stream has ended."""

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from autosessd.base.config import parse
from autosessd.engines.llama_server import LlamaServer
from autosessd.front.gate import Gate
from autosessd.sessions.facade import Sessions
from autosessd.store.directory import Store
from autosessd.engines.upstream import Upstream
from harness import free_port
from stub_engine import StubEngine


async def until(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.01)


@pytest.fixture
async def engine_http():
    """A tiny HTTP engine: /slots answers JSON, /stream streams until released; every request's
    client port is recorded (one port = one connection)."""
    ports: list[int] = []
    release = asyncio.Event()

    async def slots(request):
        ports.append(request.transport.get_extra_info("peername")[1])
        return web.json_response([{"id": 0, "is_processing": False, "n_prompt_tokens": 0}])

    async def stream(request):
        ports.append(request.transport.get_extra_info("peername")[1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: {}\n\n")
        await release.wait()
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/slots", slots)
    app.router.add_get("/props", slots)
    app.router.add_get("/stream", stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", ports, release
    release.set()
    await runner.cleanup()


async def test_the_adapter_keeps_its_own_connection_and_the_gate_uses_the_pool(engine_http, tmp_path, session_dir):
    """The adapter's short calls go on its lean client (engines/http1.py: a fraction of
    aiohttp's cost a call), one kept-alive connection reused; the gate forwards on the pool,
    which the adapter's close leaves open (the stop save still needs it)."""
    url, ports, _ = engine_http
    pool = Upstream(url, 5)
    adapter = LlamaServer(url, timeout_s=5, pool=pool)
    gate_port = free_port()
    cfg = parse(f'slot_save_path = "{session_dir}"\nstate_dir = "{tmp_path}"\n[engine]\nurl = "{url}"\n'
                f'[gate]\nlisten = "127.0.0.1:{gate_port}"\n'.encode())
    gate = Gate(cfg, Sessions(cfg, StubEngine(session_dir), Store(session_dir), "m"), pool)
    await gate.start()
    try:
        await adapter.slots()
        async with aiohttp.ClientSession() as client:
            async with client.get(f"http://127.0.0.1:{gate_port}/props") as r:
                assert r.status == 200 and json.loads(await r.read())[0]["id"] == 0
        await adapter.slots()
        # The adapter's kept-alive connection carried both of its calls; the gate's, its own.
        assert len(ports) == 3 and ports[0] == ports[2] != ports[1], ports
    finally:
        await gate.stop(1)
        await adapter.close()
        assert pool.open_pools() == 1  # neither closed the shared pool: the stop save still needs it
        await pool.close()


async def test_retired_pool_is_closed_once_its_last_stream_ends(engine_http):
    url, _, release = engine_http
    pool = Upstream(url, 5)
    ex = await pool.send("GET", "/stream")
    assert await ex.resp.content.readline() == b"data: {}\n"
    old = ex.pool
    pool.retire()  # as after an engine restart
    idle = await pool.send("GET", "/slots")  # a new pool for new requests
    assert idle.pool is not old
    idle.finish(True)
    await asyncio.sleep(0.05)
    assert not old.session.closed  # still streaming through it
    release.set()
    assert (await ex.resp.read()).endswith(b"[DONE]\n\n")
    ex.finish(True)
    await until(lambda: old.session.closed)
    assert pool.open_pools() == 1  # only the current one
    # A retired pool nobody uses is closed at once.
    current = idle.pool
    pool.retire()
    await until(lambda: current.session.closed)
    await pool.close()


async def test_a_connection_the_engine_closed_is_retried_once_on_a_fresh_pool():
    """cpp-httplib closes a kept-alive connection after 5 s idle; a request written to it as
    it closes never reaches the engine. This server answers the first request on each
    connection and closes the connection, unanswered, at the second."""
    served = []

    async def conn(reader, writer):
        n = 0
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return  # the client closed it
            n += 1
            if n == 2:
                writer.close()
                return
            served.append(head.split(b" ")[1])
            body = b'{"ok": true}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()

    server = await asyncio.start_server(conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Upstream(f"http://127.0.0.1:{port}", 5)
    try:
        async with await pool.send("GET", "/a") as r:
            assert r.status == 200
        first = pool._current()
        # POST: aiohttp retries an idempotent GET by itself; a chat or slot action is a POST.
        async with await pool.send("POST", "/b") as r:  # meets the closed connection, then a fresh one
            assert r.status == 200 and await r.json() == {"ok": True}
        assert served == [b"/a", b"/b"]
        assert pool._current() is not first
        await until(lambda: first.session.closed)
    finally:
        await pool.close()
        server.close()


@pytest.mark.parametrize("stream, done_at", [
    # OpenAI chat: [DONE] after the last chunk (finish_reason, usage, timings)
    ([b'data: {"choices":[{"delta":{"content":"Hi"},"finish_reason":null}]}',
      b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"timings":{"cache_n":7,"prompt_n":3}}',
      b"data: [DONE]"], 2),
    # llama-server's /completion: every chunk says "stop", the last one true, with its timings
    ([b'data: {"content":"Hi","stop":false}', b'data: {"content":"","stop":true,"timings":{"cache_n":7,"prompt_n":3}}'],
     1),
    # the Responses API: its response.completed event
    ([b'event: response.output_text.delta', b'data: {"type":"response.output_text.delta","delta":"Hi"}',
      b"event: response.completed",
      b'data: {"type":"response.completed","response":{"usage":{"input_tokens":10,"output_tokens":1}}}'], 3),
])
def test_the_watcher_knows_when_the_engines_stream_is_over(stream, done_at):
    """What lets the gate count a client that hangs up right after the end of the engine's
    stream as served (the OpenAI SDK closes at [DONE]): over at the stream's last event, not
    before; a chunk is parsed only where it says something the watcher reads."""
    from autosessd.engines.upstream import SSEWatcher

    w = SSEWatcher()
    for i, line in enumerate(stream):
        w.feed(line + b"\n\n")
        assert w.finished is (i >= done_at), (i, line)
