"""The HTTP gate (DESIGN §2): a reverse proxy in front of the engine that runs the turn
before a conversation request reaches it.

    client ──► gate ──► engine (always engine.url: the request's Host or an absolute-form
                                URI never chooses where it goes)

Every POST that can run on a slot takes the slot's FIFO (sessions.admit): conversation
requests (POST /v1/chat/completions, /chat/completions, /v1/messages, /v1/responses with
user text) run the turn (save → restore) first; the others (raw completions, infill,
embeddings, a chat with no user text) only have the held conversation saved, since they
replace what the slot holds. Either is forwarded untouched and the FIFO is released only
when the response has been delivered or the client went away. A client's own POST
/slots/... waits for the FIFO too, so a hand-made save never interleaves with a turn.
GETs and the POSTs that never touch a slot (SLOTLESS_POSTS) pass straight through.

Responses are forwarded as they arrive (SSE chunk by chunk, never buffered). After the
request, still holding the FIFO, the gate tells sessions how it ended (ok, rejected with
a 4xx, failed, cancelled, never reached the engine) with the response's
timings.cache_n, which verifies a restore; sessions reads the slot's token count itself.

A client that disconnects cancels the handler (aiohttp handler_cancellation), which
closes the upstream connection, so the engine stops generating. Its state is then
provisional; the FIFO is released once the engine's slot is idle again, so the next
turn never saves a half-finished state.

The engine restarting behind the gate is noticed by sessions.watch_engine (health, process
identity) and by the turn's own slot check; either resets what is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from .config import Config, parse_hostport
from .engines.base import EngineError
from .keys import conversation_key
from .sessions import Sessions, Ticket

log = logging.getLogger("autosessd")

CONVERSATION_PATHS = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/messages", "/v1/responses",
                                "/responses"})
# POSTs that never run on a slot (llama-server b11434's routes). Every other POST may touch a
# slot's KV cache — completions, infill, embeddings, rerank, and routes added later — so it
# passes the slot's FIFO: unknown routes err on the safe side.
SLOTLESS_POSTS = frozenset({"/tokenize", "/detokenize", "/apply-template", "/props", "/lora-adapters",
                            "/models", "/models/load", "/models/unload", "/tools", "/cors-proxy",
                            "/chat/completions/input_tokens", "/v1/chat/completions/input_tokens",
                            "/responses/input_tokens", "/v1/responses/input_tokens", "/v1/messages/count_tokens"})
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade", "host", "content-length"})
ENGINE_KEEPALIVE_S = 3.0
MAX_BODY = 1 << 30  # requests are read whole (the key is in the body); the engine sets the real limit


def gate_error(status: int, message: str, type_: str = "unavailable_error") -> web.Response:
    """An error the gate makes itself: OpenAI-shaped, and saying it came from autosessd."""
    body = {"error": {"message": f"autosessd: {message}", "type": type_, "code": status, "src": "autosessd"}}
    return web.json_response(body, status=status)


def _forward_headers(headers: Any) -> dict[str, str]:
    drop = set(HOP_BY_HOP)
    for value in headers.getall("Connection", []):  # headers named by Connection are hop-by-hop too
        drop.update(v.strip().lower() for v in value.split(","))
    return {k: v for k, v in headers.items() if k.lower() not in drop}


class SSEWatcher:
    """Reads the last `timings`/`usage` out of a streamed response without holding it up."""

    def __init__(self) -> None:
        self._buf = b""
        self.timings: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        self.broken = False  # the engine broke off the response
        self.reached = False  # the engine answered (a status line came back)

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        if len(self._buf) > 1 << 20:  # a line this long carries nothing we read
            self._buf = b""
        for line in lines:
            if line.startswith(b"data:") and (b'"timings"' in line or b'"usage"' in line):
                with contextlib.suppress(ValueError):
                    self.take(json.loads(line[5:]))

    def take(self, d: Any) -> None:
        if not isinstance(d, dict):
            return
        if isinstance(d.get("timings"), dict):
            self.timings = d["timings"]
        for holder in (d, d.get("response"), d.get("message")):
            if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
                self.usage = holder["usage"]

    def numbers(self) -> tuple[int | None, int | None, int | None]:
        """(cache_n, prompt tokens, prompt + generated tokens) as the response gave them; None
        for what it did not say, or said as something other than a count."""
        t, u = self.timings or {}, self.usage or {}
        cache_n, prompt_n = _count(t.get("cache_n")), _count(t.get("prompt_n"))
        n_prompt = cache_n + (prompt_n or 0) if cache_n is not None else None
        total = _count(u.get("total_tokens"))
        if total is None:
            i, o = _count(u.get("input_tokens")), _count(u.get("output_tokens"))
            total = i + o if i is not None and o is not None else None
        return cache_n, n_prompt, total


def _count(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or v != int(v):
        return None
    return int(v)


def _slot_in_path(path: str) -> int | None:
    """/slots/3 → 3; anything else → None (the configured slot)."""
    tail = path[len("/slots/"):]
    return int(tail) if tail.isdigit() and len(tail) < 6 else None


class RequestLog:
    """The gate's JSONL request log (DESIGN §2), for a tail elsewhere. Rotation by rename
    (logrotate without copytruncate) is noticed at the next line: the file is reopened."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self._open()

    def _open(self) -> Any:
        return open(self.path, "a", buffering=1, encoding="utf-8")

    def write(self, **fields: Any) -> None:
        try:
            try:
                rotated = os.stat(self.path).st_ino != os.fstat(self._f.fileno()).st_ino
            except FileNotFoundError:
                rotated = True
            if rotated:
                self._f.close()
                self._f = self._open()
            self._f.write(json.dumps({"ts": round(time.time(), 3), **fields}) + "\n")
        except OSError as e:
            log.warning("gate: cannot write the request log %s: %s", self.path, e)

    def close(self) -> None:
        self._f.close()


class Gate:
    name = "gate"

    def __init__(self, cfg: Config, sessions: Sessions):
        self.cfg = cfg
        self.sessions = sessions
        self.host, self.port = parse_hostport(cfg.gate.listen or "127.0.0.1:0")
        self.upstream = cfg.engine.url.rstrip("/")
        self.request_log = RequestLog(cfg.gate.request_log) if cfg.gate.request_log else None
        self.client: aiohttp.ClientSession | None = None
        self._retired: list[aiohttp.ClientSession] = []
        self.runner: web.AppRunner | None = None
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task] = set()
        self.requests = 0
        self.errors_502 = 0

    # -- life ------------------------------------------------------------------
    async def _fresh_client(self) -> None:
        """New connections to the engine from now on. The old pool is retired, not closed:
        closing it would cut requests still streaming through it (closed at stop)."""
        if self.client is not None:
            self._retired.append(self.client)
        self.client = self._new_client()

    def _new_client(self) -> aiohttp.ClientSession:
        # No total timeout: a generation may run for minutes; connecting must be quick.
        timeout = aiohttp.ClientTimeout(total=None, connect=self.cfg.engine.timeout_s,
                                        sock_connect=self.cfg.engine.timeout_s)
        # llama-server (cpp-httplib) drops an idle kept-alive connection after 5 s; reusing one
        # just as it does fails the request, so ours are dropped sooner.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=ENGINE_KEEPALIVE_S)
        return aiohttp.ClientSession(timeout=timeout, auto_decompress=False, connector=connector)

    async def start(self) -> None:
        self.client = self._new_client()
        self.sessions.on_engine_restart.append(self._fresh_client)
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port, reuse_address=True)
        await site.start()
        if self.port == 0:  # tests ask for any free port
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("gate: listening on http://%s:%d, forwarding to %s", self.host, self.port, self.upstream)

    async def stop(self, grace_s: float) -> None:
        if self.runner is not None:
            # Stop taking connections, then give requests in flight a bounded time.
            for site in list(self.runner.sites):
                await site.stop()
            deadline = time.monotonic() + grace_s
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace_s)
                # A conversation's FIFO outlives its handler (bookkeeping after the last
                # byte, settling after a disconnect): wait until every slot is free.
                await asyncio.wait_for(self.sessions.fifos_free(), max(0.0, deadline - time.monotonic()))
            await self.runner.cleanup()
        for t in list(self._tasks):
            t.cancel()
        for client in [*self._retired, self.client]:
            if client is not None:
                await client.close()
        if self.request_log:
            self.request_log.close()

    def describe(self) -> dict[str, Any]:
        return {"listen": f"{self.host}:{self.port}", "upstream": self.upstream,
                "request_log": self.cfg.gate.request_log}

    def _spawn(self, coro: Any) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    # -- dispatch --------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path.startswith("/autosessd/"):
            return await self.own_endpoint(request)
        if request.content_length is not None and request.content_length > MAX_BODY:
            return gate_error(413, f"request body of {request.content_length:,} bytes is over the gate's limit of "
                                   f"{MAX_BODY:,}", "invalid_request_error")
        self.requests += 1
        self.in_flight += 1
        self._idle.clear()
        try:
            if request.method == "POST" and path.startswith("/slots/"):
                return await self.slot_action(request)
            if request.method == "POST" and path not in SLOTLESS_POSTS:
                return await self.kv_request(request)
            return await self.proxy(request, await request.read())
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def own_endpoint(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/autosessd/status" and request.method == "GET":
            return web.json_response(self.sessions.status())
        if request.path == "/autosessd/metrics" and request.method == "GET":
            return web.Response(text=self.metrics(), content_type="text/plain", charset="utf-8",
                                headers={"X-Content-Type-Options": "nosniff"})
        return gate_error(404, f"no such endpoint {request.path} (autosessd has /autosessd/status and "
                               f"/autosessd/metrics)", "not_found_error")

    # -- forwarding ------------------------------------------------------------
    async def proxy(self, request: web.Request, body: bytes, watcher: SSEWatcher | None = None
                    ) -> web.StreamResponse:
        """Forward one request to the engine and its response back, as it arrives."""
        assert self.client is not None
        url = self.upstream + request.rel_url.path_qs
        headers = _forward_headers(request.headers)
        data = body if body else None
        try:
            try:
                up = await self.client.request(request.method, url, headers=headers, data=data,
                                               allow_redirects=False)
            except aiohttp.ServerDisconnectedError:
                # A kept-alive connection the engine closed as we reused it (its idle timeout,
                # or a restart): it never saw the request. Once more on fresh connections.
                await self._fresh_client()
                up = await self.client.request(request.method, url, headers=headers, data=data,
                                               allow_redirects=False)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
            self.errors_502 += 1
            why = "timed out connecting" if isinstance(e, asyncio.TimeoutError) else str(e) or type(e).__name__
            return gate_error(502, f"cannot reach the engine at {self.upstream}: {why}")
        done = False
        resp: web.StreamResponse | None = None
        if watcher is not None:
            watcher.reached = True
        try:
            headers = _forward_headers(up.headers)
            streaming = "text/event-stream" in up.headers.get("Content-Type", "") or up.content_length is None
            if not streaming:
                data = await up.read()
                done = True
                if watcher is not None:
                    with contextlib.suppress(ValueError, UnicodeDecodeError):
                        watcher.take(json.loads(data))
                return web.Response(status=up.status, reason=up.reason, headers=headers, body=data)
            resp = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                if watcher is not None:
                    watcher.feed(chunk)
                await resp.write(chunk)
            done = True
            await resp.write_eof()
            return resp
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
            # The status line is already sent: the only honest signal left is to close the
            # client's connection without finishing the body.
            log.warning("gate: the engine at %s broke off a response to %s: %s", self.upstream, request.path,
                        e or type(e).__name__)
            if watcher is not None:
                watcher.broken = True
            if resp is None:  # nothing sent yet: a proper error answer is still possible
                self.errors_502 += 1
                return gate_error(502, f"the engine at {self.upstream} broke off its answer: {e}")
            if request.transport is not None:
                request.transport.close()
            return resp
        finally:
            if done:
                up.release()  # back to the pool: keep-alive to the engine
            else:
                up.close()  # unfinished: closing tells the engine to stop generating

    async def slot_action(self, request: web.Request) -> web.StreamResponse:
        """A client's own POST /slots/N?action=...: it waits for the slot's FIFO, so it never
        lands between a turn and its request."""
        body = await request.read()
        slot_id = _slot_in_path(request.path)
        async with await self.sessions.admit(slot_id) as ticket:
            resp = await self.proxy(request, body)
            if request.query.get("action") in ("restore", "erase") and resp.status < 400:
                # Someone else replaced what the slot holds.
                self.sessions.lost(ticket.slot_id, f"a client's POST {request.path_qs} through the gate")
            return resp

    async def kv_request(self, request: web.Request) -> web.StreamResponse:
        """A request that runs on a slot: it takes the slot's FIFO. One of a conversation gets
        the turn (save → restore) before it is forwarded; one without a conversation (a raw
        completion, an embedding, a chat with no user text) only the save of the held
        conversation, since it replaces what the slot holds. The FIFO is released once the
        response has been delivered, or the client went away and the engine stopped."""
        body = await request.read()
        key = None
        if request.path in CONVERSATION_PATHS:
            try:
                key = conversation_key(json.loads(body))
            except (ValueError, UnicodeDecodeError, RecursionError):
                key = None  # the engine answers a bad body itself
        s = self.sessions
        ticket = await s.admit()
        rid = uuid.uuid4().hex[:12]
        # The turn is shielded: a client leaving mid-save must not leave the engine's slot
        # half-way between two conversations while the FIFO moves on.
        turn_task = asyncio.get_running_loop().create_task(s.turn(ticket, key))
        forwarded = False
        watcher = SSEWatcher()
        try:
            await asyncio.shield(turn_task)
            if self.request_log:
                self.request_log.write(event="start", id=rid, slot=ticket.slot_id, key=key)
            forwarded = True
            # Not shielded: cancelling it (client gone) closes the upstream request.
            resp = await self.proxy(request, body, watcher)
        except asyncio.CancelledError:
            # The client went away. The FIFO is released by _settle_cancelled, once the
            # engine has stopped working on this request.
            self._spawn(self._settle_cancelled(ticket, key, rid, turn_task, forwarded))
            raise
        except BaseException:
            self._spawn(self._after(ticket, key, watcher, "error" if forwarded else "not_run", rid))
            raise
        # Delivered. The bookkeeping runs to its end even if the client hangs up now (a
        # streaming client often closes right after the last chunk), and releases the FIFO.
        if resp.status == 502 and not watcher.reached:
            status = "not_run"  # the gate could not reach the engine: nothing ran
        elif 400 <= resp.status < 500:
            status = "rejected"  # llama-server refuses a request (4xx) before it runs it
        else:
            status = "ok" if resp.status < 400 and not watcher.broken else "error"
        await asyncio.shield(self._spawn(self._after(ticket, key, watcher, status, rid)))
        return resp

    async def _after(self, ticket: Ticket, key: str | None, watcher: SSEWatcher, status: str, rid: str) -> None:
        """Still holding the FIFO: tell sessions how the request ended (it reads the slot
        itself), then release the FIFO whatever happens."""
        try:
            cache_n, n_prompt, n_tokens = watcher.numbers()
            log.debug("gate: %s ended %s: cache_n %s, prompt %s", key, status, cache_n, n_prompt)
            await self.sessions.ended(ticket.slot_id, key, status, n_tokens, cache_n, n_prompt)
            if self.request_log and status != "not_run":
                self.request_log.write(event="end", id=rid, slot=ticket.slot_id, n_tokens=n_tokens,
                                       status="ok" if status == "ok" else "error",
                                       **({"cache_n": cache_n} if cache_n is not None else {}))
        except Exception as e:  # the answer is delivered; bookkeeping must not turn it into an error
            log.exception("gate: bookkeeping after a request of %s: %s", key, e)
        finally:
            ticket.release()

    async def _settle_cancelled(self, ticket: Ticket, key: str | None, rid: str, turn_task: asyncio.Task,
                                forwarded: bool) -> None:
        """After a client disconnect: let the turn finish, wait (bounded) for the engine to
        stop generating, tell sessions (a partial state: provisional), then release the FIFO."""
        try:
            with contextlib.suppress(Exception):
                await turn_task
            if not forwarded:
                await self.sessions.ended(ticket.slot_id, key, "not_run")
                return
            deadline = time.monotonic() + self.cfg.engine.timeout_s
            while time.monotonic() < deadline:
                try:
                    st = await self.sessions.engine_slot(ticket.slot_id)
                except EngineError:
                    break
                if st is None or not st.is_processing:
                    break
                await asyncio.sleep(0.05)
            await self.sessions.ended(ticket.slot_id, key, "cancelled")
            if self.request_log:
                self.request_log.write(event="end", id=rid, slot=ticket.slot_id, n_tokens=None, status="cancelled")
        except Exception as e:
            log.exception("gate: settling a cancelled request of %s: %s", key, e)
        finally:
            ticket.release()

    # -- metrics ---------------------------------------------------------------
    def metrics(self) -> str:
        c = self.sessions.counters
        rows = [
            ("turns_total", "counter", "Turns run (requests with a conversation key)", c.turns),
            ("saves_total", "counter", "Conversations saved to auto-*.bin", c.saves),
            ("restores_total", "counter", "Conversations restored from auto-*.bin", c.restores),
            ("save_failures_total", "counter", "Saves that failed", c.save_failures),
            ("restore_failures_total", "counter", "Restores that failed", c.restore_failures),
            ("skipped_min_tokens_total", "counter", "Saves or restores skipped below min tokens",
             c.skipped_min_tokens),
            ("skipped_model_mismatch_total", "counter", "Restores skipped: file of another model",
             c.skipped_model_mismatch),
            ("skipped_disk_full_total", "counter", "Saves skipped: not enough free space", c.skipped_disk_full),
            ("restores_reused_total", "counter", "Restores the engine reused (timings.cache_n)", c.restores_reused),
            ("restores_not_reused_total", "counter", "Restores the engine did not reuse", c.restores_not_reused),
            ("engine_resets_total", "counter", "Held states dropped because the engine lost them", c.engine_resets),
            ("saved_bytes_total", "counter", "Bytes saved", c.bytes_saved),
            ("restored_bytes_total", "counter", "Bytes restored", c.bytes_restored),
            ("save_milliseconds_total", "counter", "Engine time spent saving", c.ms_saved),
            ("restore_milliseconds_total", "counter", "Engine time spent restoring", c.ms_restored),
            ("prefill_tokens_avoided_total", "counter", "Prompt tokens reused thanks to a restore",
             c.prefill_tokens_avoided),
            ("gate_requests_total", "counter", "Requests through the gate", self.requests),
            ("gate_upstream_errors_total", "counter", "Requests answered 502: engine unreachable", self.errors_502),
            ("gate_in_flight", "gauge", "Requests in flight through the gate", self.in_flight),
        ]
        out = []
        for name, kind, help_, value in rows:
            out += [f"# HELP autosessd_{name} {help_}", f"# TYPE autosessd_{name} {kind}",
                    f"autosessd_{name} {value:g}" if isinstance(value, float) else f"autosessd_{name} {value}"]
        return "\n".join(out) + "\n"
