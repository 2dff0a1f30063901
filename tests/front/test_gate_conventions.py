"""The gate as the tools around llama-server expect it (issue 22), in-process: a stub engine for
the slots (stub_engine.py) and a small HTTP engine in front of it that runs each chat on the stub,
as llama-server would, and answers with its timings.

    X-Autosessd-* headers   what autosessd did for the request; never on the engine's error answers
    keepalives              a streaming request that waits (a restore, the engine's first byte)
                            gets `: ping` comments and X-Accel-Buffering: no
    X-Conversation-Id       names the conversation before its first user message does;
                            X-SMG-Routing-Key too where gate.conversation_id_headers lists it
    b11434's routes         pass untouched (method, path, query, body, answer, timings), and those
                            that steer a running stream do not wait for the slot's FIFO
"""

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from autosessd.base.config import parse
from autosessd.front.gate import Gate
from autosessd.base.keys import conversation_id_key, conversation_key
from autosessd.sessions.facade import Sessions
from autosessd.store.directory import Store
from harness import free_port
from stub_engine import StubEngine

A = {"messages": [{"role": "user", "content": "conversation A " * 20}], "max_tokens": 4}
B = {"messages": [{"role": "user", "content": "conversation B " * 20}], "max_tokens": 4}
MS_PER_TOKEN = 2.0  # the engine's prompt rate in these tests


class SlowStub(StubEngine):
    restore_delay = 0.0

    async def restore(self, slot, name):
        await asyncio.sleep(self.restore_delay)
        return await super().restore(slot, name)


class Engine:
    """The HTTP side: chat runs on the stub (its slot keeps what it shares with the prompt)."""

    def __init__(self, stub):
        self.stub = stub
        self.seen: list[dict] = []
        self.header_delay = 0.0  # a model load in router mode: nothing comes back for a while
        self.hold = asyncio.Event()
        self.hold.set()

    async def chat(self, request):
        body = await request.json()
        await asyncio.sleep(self.header_delay)
        if body.get("fail"):
            return web.json_response({"error": {"code": 400, "message": "the request exceeds the available "
                                                 "context size", "type": "exceed_context_size_error"}}, status=400)
        cache_n, n_prompt = self.stub.chat(body, "ok")
        timings = {"cache_n": cache_n, "prompt_n": n_prompt - cache_n,
                   "prompt_ms": (n_prompt - cache_n) * MS_PER_TOKEN, "predicted_n": 2}
        usage = {"total_tokens": n_prompt + 2}
        if not body.get("stream"):
            return web.json_response({"choices": [{"message": {"content": "ok"}}], "timings": timings, "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\n')
        await self.hold.wait()
        await resp.write(b"data: " + json.dumps({"choices": [{"delta": {}}], "timings": timings,
                                                  "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    async def echo(self, request):
        """Any other route: says what it was sent, with timings as llama-server's answers carry."""
        self.seen.append({"method": request.method, "path": request.path, "query": request.query_string,
                          "body": (await request.read()).decode()})
        return web.json_response({"route": request.path, "timings": {"cache_n": 0, "prompt_n": 1}})

    def app(self):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_route("*", "/{tail:.*}", self.echo)
        return app


@pytest.fixture
async def gate(request, tmp_path, session_dir):
    """The gate before a stub engine; a test's indirect parameter adds lines to its [gate]."""
    stub = SlowStub(session_dir)
    engine = Engine(stub)
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    up = free_port()
    await web.TCPSite(runner, "127.0.0.1", up).start()
    port = free_port()
    cfg = parse(f'slot_save_path = "{session_dir}"\nstate_dir = "{tmp_path}"\nauto_sessions_min_tokens = 50\n'
                f'[engine]\nurl = "http://127.0.0.1:{up}"\n[gate]\nlisten = "127.0.0.1:{port}"\n'
                f'keepalive_s = 0.25\n{getattr(request, "param", "")}'.encode())
    g = Gate(cfg, Sessions(cfg, stub, Store(session_dir), "stub-model"))
    await g.start()
    async with aiohttp.ClientSession() as client:
        yield g, f"http://127.0.0.1:{port}", client, engine
    engine.hold.set()
    await g.stop(1)
    await runner.cleanup()


async def post(client, url, body, headers=None, path="/v1/chat/completions"):
    async with client.post(url + path, json=body, headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.read()


def autosessd_headers(h):
    return {k: v for k, v in h.items() if k.lower().startswith("x-autosessd")}


@pytest.mark.parametrize("stream", [False, True])
async def test_each_answer_says_what_autosessd_did(gate, stream):
    g, url, client, _ = gate
    a, b = {**A, "stream": stream}, {**B, "stream": stream}
    _, h1, _ = await post(client, url, a)
    assert autosessd_headers(h1) == {"X-Autosessd-Slot": "0"}  # nothing to do yet
    _, h2, _ = await post(client, url, b)
    saved = f"auto-{conversation_key(A)}.bin"
    assert "X-Autosessd-Saved" in h2, (h2, list(g.sessions.events.recent))
    n_a = int(h2["X-Autosessd-Saved"].split()[0])
    assert h2["X-Autosessd-Saved"] == f"{n_a} {saved}" and n_a > 50
    _, h3, _ = await post(client, url, a)
    assert h3["X-Autosessd-Restored"] == f"{n_a} {saved}"
    # The tokens the engine reused (or, for a stream, is about to), past what the slot shared with
    # the request, at the engine's measured rate (2 ms a token in these tests).
    last = g.sessions.restore_log.last[0]
    spared = last["cache_n"] - (last["slot_shared"] or 0)
    assert int(h3["X-Autosessd-Est-Saved-Ms"]) == pytest.approx(spared * MS_PER_TOKEN, rel=0.02)
    assert g.sessions.counters.ms_avoided == pytest.approx(spared * MS_PER_TOKEN)


async def test_no_autosessd_headers_on_the_engines_error_answers(gate):
    g, url, client, _ = gate
    await post(client, url, A)
    status, h, body = await post(client, url, {**B, "fail": True})  # a switch: A saved, then 400
    assert status == 400 and json.loads(body)["error"]["type"] == "exceed_context_size_error"
    assert autosessd_headers(h) == {}
    assert g.sessions.counters.saves == 1  # it did save; the error answer is the engine's own


async def read_stream(client, url, body, headers=None):
    lines = []
    async with client.post(url + "/v1/chat/completions", json=body, headers=headers or {}) as r:
        async for line in r.content:
            lines.append(line.decode())
        return r.status, dict(r.headers), lines


async def test_a_stream_that_waits_for_a_restore_gets_keepalives(gate):
    g, url, client, _ = gate
    await post(client, url, A)
    await post(client, url, B)
    g.sessions.engine.restore_delay = 1.0  # four keepalive periods
    status, h, lines = await read_stream(client, url, {**A, "stream": True})
    assert status == 200 and h["Content-Type"] == "text/event-stream" and h["X-Accel-Buffering"] == "no"
    first_data = next(i for i, ln in enumerate(lines) if ln.startswith("data:"))
    pings = [ln for ln in lines[:first_data] if ln == ": ping\n"]
    assert len(pings) >= 3
    # What autosessd did comes as comments of the headers' names (the headers were gone already).
    assert any(ln.startswith(f": X-Autosessd-Restored: ") and f"auto-{conversation_key(A)}.bin" in ln
               for ln in lines[:first_data])
    assert lines[-2] == "data: [DONE]\n" and any('"timings"' in ln for ln in lines)  # timings untouched
    assert g.sessions.counters.restores_reused == 1  # verified from the relayed stream's cache_n


async def test_keepalives_while_the_engine_loads_and_its_error_as_an_event(gate):
    g, url, client, engine = gate
    engine.header_delay = 0.8  # a model load: the engine sends nothing yet
    status, h, lines = await read_stream(client, url, {**A, "stream": True})
    assert status == 200 and h["X-Accel-Buffering"] == "no" and lines.count(": ping\n") >= 2
    assert lines[-2] == "data: [DONE]\n"
    # The engine refuses after the gate's 200 went out: its error arrives as one data event.
    status, _, lines = await read_stream(client, url, {**B, "stream": True, "fail": True})
    assert status == 200
    events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    assert events == [{"error": {"code": 400, "message": "the request exceeds the available context size",
                                 "type": "exceed_context_size_error"}}]
    assert not any("X-Autosessd" in ln for ln in lines)  # the engine's error: nothing of ours on it
    # The engine's 4xx counts as a refused request (the slot holds what it held), not as a success.
    assert g.sessions.view(0).key == conversation_key(A)


async def test_a_quick_stream_is_the_engines_own(gate):
    g, url, client, _ = gate
    status, h, lines = await read_stream(client, url, {**A, "stream": True})
    assert ": ping\n" not in lines and lines[0].startswith("data:")


async def test_x_conversation_id_names_the_conversation(gate, session_dir):
    g, url, client, _ = gate
    s = g.sessions
    await post(client, url, A, {"X-Conversation-Id": "chat-1"})
    assert s.view(0).key == conversation_id_key("chat-1") != conversation_key(A)
    # The same first message under another id is another conversation: a switch saves chat-1.
    _, h, _ = await post(client, url, A, {"X-Conversation-Id": "chat-2"})
    assert s.view(0).key == conversation_id_key("chat-2")
    assert h["X-Autosessd-Saved"].endswith(f"auto-{conversation_id_key('chat-1')}.bin")
    # Another first message under chat-2's id is still chat-2: the same line, no switch by key.
    await post(client, url, B, {"X-Conversation-Id": "chat-2"})
    assert s.view(0).key == conversation_id_key("chat-2")
    # Without the header the first message decides, as before.
    await post(client, url, B)
    assert s.view(0).key == conversation_key(B)


@pytest.mark.parametrize("gate", ['conversation_id_headers = ["X-Conversation-Id", "X-SMG-Routing-Key"]\n'],
                         indirect=True)
async def test_smgs_routing_key_names_the_conversation_where_the_gate_is_told_to(gate):
    """Behind SMG (docs/several-hosts.md): SMG routes by X-Conversation-Id but does not pass it on;
    it passes X-SMG-Routing-Key (checked with smg 1.13.0 and a worker that printed what it got).
    With that header listed, the same id under either is the same conversation."""
    g, url, client, _ = gate
    s = g.sessions
    await post(client, url, A, {"X-SMG-Routing-Key": "chat-1"})
    assert s.view(0).key == conversation_id_key("chat-1") != conversation_key(A)
    await post(client, url, B, {"X-Conversation-Id": "chat-1"})
    assert s.view(0).key == conversation_id_key("chat-1")
    # Both: the first listed wins.
    await post(client, url, A, {"X-Conversation-Id": "chat-2", "X-SMG-Routing-Key": "chat-1"})
    assert s.view(0).key == conversation_id_key("chat-2")
    # An empty one names nothing: the next one, or the first message, decides.
    await post(client, url, A, {"X-Conversation-Id": " ", "X-SMG-Routing-Key": "chat-1"})
    assert s.view(0).key == conversation_id_key("chat-1")
    await post(client, url, A, {"X-SMG-Routing-Key": ""})
    assert s.view(0).key == conversation_key(A)


async def test_smgs_routing_key_names_nothing_unless_listed(gate):
    """SMG's key may name a user (its own docs' example): by default the gate does not take it."""
    g, url, client, _ = gate
    await post(client, url, A, {"X-SMG-Routing-Key": "user-1234"})
    assert g.sessions.view(0).key == conversation_key(A)


ROUTES = [("POST", "/v1/responses", {"input": "hello", "max_output_tokens": 2}),
          ("POST", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
          ("POST", "/v1/chat/completions/input_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
          ("POST", "/v1/responses/input_tokens", {"input": "hi"}),
          ("POST", "/v1/chat/completions/control", {"id": "chatcmpl-1", "action": "reasoning_end"}),
          ("GET", "/v1/stream?conv_id=c1&from=0", None),
          ("POST", "/v1/streams/lookup", {"conversation_ids": ["c1"]}),
          ("DELETE", "/v1/stream?conv_id=c1", None),
          ("GET", "/models", None),
          ("POST", "/models/load", {"model": "m"}),
          ("POST", "/models/unload", {"model": "m"})]


@pytest.mark.parametrize("method, path, body", ROUTES)
async def test_b11434_routes_pass_untouched(gate, method, path, body):
    g, url, client, engine = gate
    data = json.dumps(body).encode() if body is not None else None
    async with client.request(method, url + path, data=data, headers={"Content-Type": "application/json"}) as r:
        answer = await r.json()
    assert r.status == 200 and answer == {"route": path.split("?")[0], "timings": {"cache_n": 0, "prompt_n": 1}}
    got = engine.seen[-1]
    assert (got["method"], got["path"], got["query"]) == (method, path.split("?")[0], path.partition("?")[2])
    assert got["body"] == (data or b"").decode()


async def test_steering_a_running_stream_does_not_wait_for_its_slot(gate):
    """/v1/chat/completions/control acts on a generation that is running: behind the slot's FIFO
    it would wait for that very generation to end."""
    g, url, client, engine = gate
    engine.hold.clear()  # the stream stays open after its first chunk
    async with client.post(url + "/v1/chat/completions", json={**A, "stream": True}) as running:
        await running.content.readline()
        status, _, _ = await asyncio.wait_for(post(client, url, {"id": "chatcmpl-1", "action": "reasoning_end"},
                                                   path="/v1/chat/completions/control"), 5)
        assert status == 200
        for path in ("/v1/streams/lookup",):
            status, _, _ = await asyncio.wait_for(post(client, url, {"conversation_ids": []}, path=path), 5)
            assert status == 200
        engine.hold.set()


async def test_a_client_that_leaves_during_keepalives_frees_its_slot(gate):
    g, url, client, _ = gate
    await post(client, url, A)
    await post(client, url, B)
    g.sessions.engine.restore_delay = 1.0
    async with aiohttp.ClientSession() as other:
        r = await other.post(url + "/v1/chat/completions", json={**A, "stream": True})
        assert await r.content.readline() == b": ping\n"
        r.close()  # gone mid-restore
    # The turn finishes, the request is settled as never sent, and the slot's FIFO moves on.
    status, _, _ = await asyncio.wait_for(post(client, url, B), 10)
    assert status == 200 and g.sessions.view(0).key == conversation_key(B)
