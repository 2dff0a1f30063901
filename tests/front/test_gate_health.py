"""The gate as a front door's host (issue 41, docs/several-hosts.md), in-process: GET /health says
whether this host can serve (the engine's own answer when autosessd serves, the gate's 503 with
its reason otherwise, never a 502), and with [shared] each answer names the host and where its
conversation came from."""

import aiohttp
import pytest
from aiohttp import web

from autosessd.base.config import parse
from autosessd.front.gate import Gate
from autosessd.sessions.facade import Sessions
from autosessd.store.directory import Store
from harness import free_port
from stub_engine import StubEngine

CHAT = {"messages": [{"role": "user", "content": "conversation A " * 20}], "max_tokens": 4}


class Engine:
    def __init__(self, stub):
        self.stub = stub
        self.loading = False

    async def health(self, request):
        if self.loading:  # llama-server while it loads its model
            return web.json_response({"error": {"code": 503, "message": "Loading model",
                                                "type": "unavailable_error"}}, status=503)
        return web.json_response({"status": "ok"})

    async def chat(self, request):
        cache_n, n_prompt = self.stub.chat(await request.json(), "ok")
        return web.json_response({"choices": [{"message": {"content": "ok"}}],
                                  "timings": {"cache_n": cache_n, "prompt_n": n_prompt - cache_n}})


@pytest.fixture
async def gate(tmp_path, session_dir):
    engine = Engine(StubEngine(session_dir))
    app = web.Application()
    app.router.add_get("/health", engine.health)
    app.router.add_post("/v1/chat/completions", engine.chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    up, port = free_port(), free_port()
    await web.TCPSite(runner, "127.0.0.1", up).start()
    cfg = parse(f'slot_save_path = "{session_dir}"\nstate_dir = "{tmp_path}"\n'
                f'[engine]\nurl = "http://127.0.0.1:{up}"\n[gate]\nlisten = "127.0.0.1:{port}"\n'
                f'[shared]\nendpoint_url = "http://127.0.0.1:9"\nbucket = "b01"\nhost = "host-a"\n'.encode())
    why = {"now": None}
    g = Gate(cfg, Sessions(cfg, engine.stub, Store(session_dir), "stub-model"), not_ready=lambda: why["now"])
    await g.start()
    async with aiohttp.ClientSession() as client:
        yield f"http://127.0.0.1:{port}", client, engine, why, runner
    await g.stop(1)
    await runner.cleanup()


async def health(client, url):
    async with client.get(url + "/health") as r:
        return r.status, r.headers.get("X-Autosessd-Host"), await r.json()


async def test_health_is_the_engine_s_own_answer_while_autosessd_serves(gate):
    url, client, engine, _, _ = gate
    assert await health(client, url) == (200, "host-a", {"status": "ok"})
    engine.loading = True  # a client of llama-server's /health sees what it saw before
    status, host, body = await health(client, url)
    assert (status, host, body["error"]["message"]) == (503, "host-a", "Loading model")


async def test_health_is_503_with_a_reason_while_autosessd_starts_or_stops(gate):
    url, client, _, why, _ = gate
    for state in ("starting", "stopping (SIGTERM)"):
        why["now"] = state
        status, host, body = await health(client, url)
        assert (status, host, body["error"]["src"]) == (503, "host-a", "autosessd")
        assert state in body["error"]["message"]
    why["now"] = None
    assert (await health(client, url))[0] == 200


async def test_health_is_503_not_502_when_the_engine_does_not_answer(gate):
    url, client, _, _, runner = gate
    await runner.cleanup()  # the engine is gone
    status, host, body = await health(client, url)
    assert (status, host, body["error"]["src"]) == (503, "host-a", "autosessd")
    assert "does not answer /health" in body["error"]["message"]


async def test_with_shared_each_answer_names_the_host_and_where_the_conversation_came_from(gate):
    url, client, _, _, _ = gate
    async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
        assert (r.headers["X-Autosessd-Host"], r.headers["X-Autosessd-Conversation"]) == ("host-a", "local")
