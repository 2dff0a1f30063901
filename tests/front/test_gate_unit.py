"""The gate in-process, with a stub engine behind Sessions: what needs no engine process."""

import asyncio
import contextlib
import logging
import threading
import time

import aiohttp
import pytest

from autosessd.base.config import parse
from autosessd.front.gate import Gate
from autosessd.sessions.facade import Sessions
from autosessd.store.directory import Store
from harness import free_port
from stub_engine import StubEngine


@pytest.fixture
async def gate(tmp_path, session_dir):
    port = free_port()
    cfg = parse(f'slot_save_path = "{session_dir}"\nstate_dir = "{tmp_path}"\n'
                f'[engine]\nurl = "http://127.0.0.1:{free_port()}"\n[gate]\nlisten = "127.0.0.1:{port}"\n'.encode())
    g = Gate(cfg, Sessions(cfg, StubEngine(session_dir), Store(session_dir), "m"))
    await g.start()
    yield g, f"http://127.0.0.1:{port}"
    await g.stop(1)


async def test_status_endpoint_runs_off_the_event_loop(gate):
    """status() scans the session directory (thousands of files on a busy machine): the loop
    that forwards every other request must not wait for it."""
    g, url = gate
    threads = []
    real = g.sessions.status
    g.sessions.status = lambda: threads.append(threading.current_thread()) or real()
    async with aiohttp.ClientSession() as c:
        async with c.get(url + "/autosessd/status") as r:
            assert r.status == 200 and (await r.json())["engine"]["model_fingerprint"] == "m"
    assert threads and threads[0] is not threading.main_thread()


async def test_every_counter_reaches_status_and_metrics(gate, tmp_path):
    """Issue 18: each counter autosessd keeps is in `status --json` (the control socket and
    GET /autosessd/status give the same object) and in GET /autosessd/metrics, with its value
    (saves_missed among them: the one README's Limits tells people to watch)."""
    import dataclasses

    from autosessd.sessions.report import Counters

    g, url = gate
    fields = dataclasses.fields(Counters)
    for i, f in enumerate(fields):  # a value of its own for each, so a mix-up shows
        setattr(g.sessions.counters, f.name, (i + 1) * 10 if f.type == "int" else (i + 1) * 10 + 0.5)
    async with aiohttp.ClientSession() as c:
        async with c.get(url + "/autosessd/status") as r:
            status = await r.json()
        async with c.get(url + "/autosessd/metrics") as r:
            metrics = await r.text()
    lines = set(metrics.splitlines())
    for i, f in enumerate(fields):
        want = getattr(g.sessions.counters, f.name)
        assert status["counters"][f.name] == want, f.name
        metric = f"autosessd_{f.metadata['metric']}"
        assert f"# TYPE {metric} counter" in lines, f.name
        # In the metric's base unit (seconds for the fields kept in ms), exactly.
        scaled = want * f.metadata["scale"]
        assert f"{metric} {scaled!r}" in lines or f"{metric} {scaled}" in lines, f.name
        assert metric.endswith("_total") and "millisecond" not in metric, f.name
    assert "autosessd_saves_missed_total 120" in lines
    names = [ln.split()[2] for ln in metrics.splitlines() if ln.startswith("# TYPE")]
    assert len(names) == len(set(names))  # one name per counter


@pytest.mark.parametrize("hangs_up", ["after-done", "before-done"])
async def test_a_client_whose_connection_closes_at_done_had_its_whole_answer(tmp_path, session_dir, caplog,
                                                                           monkeypatch, hangs_up):
    """The OpenAI SDK closes its stream at `data: [DONE]`. When the gate's next write to it comes
    before the handler is cancelled, that write fails ("Cannot write to closing transport", a
    ClientConnectionError): the client gone, not the engine breaking off its answer, and after
    [DONE] a delivered answer (shell-gpt through a busy gate: its verified restore had counted as
    not reused). A client gone before [DONE] reached it was not served. The close is made on cue
    here (no real client can time it): the client's transport is closed at the gate's first
    write after [DONE] (after-done) or at the write of [DONE] itself (before-done)."""
    from aiohttp import web

    from autosessd.engines.upstream import Upstream

    async def chat(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n')
        await asyncio.sleep(0.05)
        await resp.write(b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"timings":{"cache_n":0,'
                         b'"prompt_n":9}}\n\ndata: [DONE]\n\n')
        await asyncio.sleep(0.05)
        await resp.write(b": end\n\n")  # bytes after [DONE], then the response's own end
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    engine_port, gate_port = free_port(), free_port()
    await web.TCPSite(runner, "127.0.0.1", engine_port).start()
    sent_done: set[int] = set()  # the gate's responses that have written [DONE]

    def hang_up_if_due(resp, data: bytes = b"") -> None:
        t = resp._req.transport if resp._req is not None else None
        if t is None or t.get_extra_info("sockname")[1] != gate_port:
            return  # the engine's own responses are left alone
        if id(resp) in sent_done or (hangs_up == "before-done" and b"[DONE]" in data):
            t.close()

    real_write, real_eof = web.StreamResponse.write, web.StreamResponse.write_eof

    async def write(self, data):
        hang_up_if_due(self, bytes(data))
        await real_write(self, data)
        if b"[DONE]" in bytes(data):
            sent_done.add(id(self))

    async def write_eof(self, data=b""):
        hang_up_if_due(self)
        await real_eof(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write)
    monkeypatch.setattr(web.StreamResponse, "write_eof", write_eof)
    cfg = parse(f'slot_save_path = "{session_dir}"\nstate_dir = "{tmp_path}"\n'
                f'[engine]\nurl = "http://127.0.0.1:{engine_port}"\n[gate]\nlisten = "127.0.0.1:{gate_port}"\n'
                .encode())
    pool = Upstream(f"http://127.0.0.1:{engine_port}", 5)
    g = Gate(cfg, Sessions(cfg, StubEngine(session_dir), Store(session_dir), "m"), pool)
    await g.start()
    caplog.set_level(logging.DEBUG, logger="autosessd")
    try:
        body = {"messages": [{"role": "user", "content": "hello"}], "stream": True}
        got = b""
        with contextlib.suppress(aiohttp.ClientError):
            async with aiohttp.ClientSession() as c:
                async with c.post(f"http://127.0.0.1:{gate_port}/v1/chat/completions", json=body) as r:
                    async for chunk in r.content.iter_any():
                        got += chunk
        assert (b"data: [DONE]" in got) is (hangs_up == "after-done")
        deadline = time.monotonic() + 10
        while " ended " not in caplog.text and "went away" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.05)
        assert "broke off" not in caplog.text, caplog.text
        if hangs_up == "after-done":
            assert " ended ok" in caplog.text, caplog.text
        else:
            assert "went away" in caplog.text and " ended ok" not in caplog.text, caplog.text
    finally:
        await g.stop(1)
        await pool.close()
        await runner.cleanup()
