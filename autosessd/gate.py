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
from typing import Any

from aiohttp import web

from .config import Config, parse_hostport
from .guard import Guard
from .keys import conversation_key
from .requestlog import RequestLog
from .placement import Ticket
from .sessions import Sessions
from .upstream import SSEWatcher, Upstream, gate_error

log = logging.getLogger("autosessd")

SETTLE_S = 10.0  # at a stop, for the bookkeeping of requests the stop cut
CONVERSATION_PATHS = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/messages", "/v1/responses",
                                "/responses"})
# Requests llama-server lets a client pin to a slot with "id_slot" (b11434): with several slots
# autosessd pins them where it placed them. Embeddings and rerank cannot be pinned.
PINNABLE_PATHS = CONVERSATION_PATHS | {"/completion", "/completions", "/v1/completions", "/infill"}
CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})  # OpenAI chat: matched by tokens
# POSTs that never run on a slot (llama-server b11434's routes). Every other POST may touch a
# slot's KV cache — completions, infill, embeddings, rerank, and routes added later — so it
# passes the slot's FIFO: unknown routes err on the safe side.
SLOTLESS_POSTS = frozenset({"/tokenize", "/detokenize", "/apply-template", "/props", "/lora-adapters",
                            "/models", "/models/load", "/models/unload", "/tools", "/cors-proxy",
                            "/chat/completions/input_tokens", "/v1/chat/completions/input_tokens",
                            "/responses/input_tokens", "/v1/responses/input_tokens", "/v1/messages/count_tokens"})


def _url_host(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _slot_in_path(path: str) -> int | None:
    """/slots/3 → 3; anything else → None (the configured slot)."""
    tail = path[len("/slots/"):]
    return int(tail) if tail.isdigit() and len(tail) < 6 else None


class Gate:
    name = "gate"

    def __init__(self, cfg: Config, sessions: Sessions, pool: Upstream | None = None):
        """pool: the engine's HTTP pool, shared with the engine adapter (one is made when None)."""
        self.cfg = cfg
        self.sessions = sessions
        # Every address in gate.listen is bound; host and port are the first (for messages).
        self.addresses = [parse_hostport(a) for a in cfg.gate.listen or ("127.0.0.1:0",)]
        self.host, self.port = self.addresses[0]
        self.upstream = cfg.engine.url.rstrip("/")
        self.request_log = RequestLog(cfg.gate.request_log) if cfg.gate.request_log else None
        self.max_body = int(cfg.gate.max_body_mb * 1e6)
        self._own_pool = pool is None
        self.pool = pool if pool is not None else Upstream(self.upstream, cfg.engine.timeout_s)
        self.runner: web.AppRunner | None = None
        self.guard = Guard(self.addresses, cfg.gate.allowed_hosts, cfg.gate.max_connections,
                           cfg.gate.header_timeout_s)
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task] = set()
        self.requests = 0

    # -- life ------------------------------------------------------------------
    async def start(self) -> None:
        # The engine restarted: its kept-alive connections are dead.
        self.sessions.on_engine_restart.append(self.pool.renewed)
        app = web.Application(client_max_size=self.max_body, middlewares=[self._front_door])
        app.router.add_route("*", "/{tail:.*}", self.handle)
        # shutdown_timeout: at a stop, requests in flight have had the gate's own grace by
        # the time the runner is cleaned up; aiohttp's default would add 60 s more.
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self.runner.setup()
        self.guard.install(self.runner.server)
        bound = []
        for i, (host, port) in enumerate(self.addresses):
            site = web.TCPSite(self.runner, host, port, reuse_address=True)
            try:
                await site.start()
            except OSError as e:  # stops the start (daemon: StartupError), the addresses bound so far closed
                await self.runner.cleanup()
                why = os.strerror(e.errno) if e.errno else str(e)
                raise OSError(f"gate.listen {_url_host(host, port)}: cannot listen there: {why}") from None
            if port == 0:  # tests ask for any free port
                port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
                self.addresses[i] = (host, port)
            bound.append(_url_host(host, port))
        self.host, self.port = self.addresses[0]
        log.info("gate: listening on %s, forwarding to %s", ", ".join(f"http://{b}" for b in bound), self.upstream)

    async def stop(self, grace_s: float) -> None:
        if self.runner is not None:
            # Stop taking connections, then give requests in flight a bounded time.
            for site in list(self.runner.sites):
                await site.stop()
            deadline = time.monotonic() + grace_s
            try:
                await asyncio.wait_for(self._idle.wait(), grace_s)
                # A conversation's FIFO outlives its handler (bookkeeping after the last
                # byte, settling after a disconnect): wait until every slot is free.
                await asyncio.wait_for(self.sessions.fifos_free(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                log.warning("gate: stop: %d request(s) still in flight after %g s: closing their connections",
                            self.in_flight, grace_s)
            await self.runner.cleanup()
        # Closing the connections cancelled the requests still in flight; their bookkeeping
        # (wait for the engine to stop, mark the state provisional, release the FIFO) must
        # land before the stop save reads what the slot holds. Bounded: the daemon's deadline.
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=SETTLE_S)
        for t in list(self._tasks):
            t.cancel()
        if self._own_pool:  # a shared pool outlives the gate: the stop save still needs it
            await self.pool.close()
        if self.request_log:
            self.request_log.close()

    def describe(self) -> dict[str, Any]:
        return {"listen": [_url_host(h, p) for h, p in self.addresses], "upstream": self.upstream,
                "request_log": self.cfg.gate.request_log, **self.guard.describe()}

    @web.middleware
    async def _front_door(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """guard.py: the request began (its headers are in); its Host names this machine."""
        self.guard.request_started(request)
        try:
            why = self.guard.host_refused(request)
            if why is not None:
                return gate_error(403, why, "permission_error")
            return await handler(request)
        finally:
            self.guard.request_done(request)

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
        if request.content_length is not None and request.content_length > self.max_body:
            return self._too_large(f"{request.content_length:,} bytes")
        self.requests += 1
        self.in_flight += 1
        self._idle.clear()
        try:
            if request.method == "POST" and path.startswith("/slots/"):
                return await self.slot_action(request)
            if request.method == "POST" and path not in SLOTLESS_POSTS:
                return await self.kv_request(request)
            return await self.proxy(request, await request.read())
        except web.HTTPRequestEntityTooLarge:
            # A chunked body (no Content-Length) ran over the limit while being read,
            # before the FIFO: nothing was forwarded.
            return self._too_large("more bytes")
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    def _too_large(self, size: str) -> web.Response:
        return gate_error(413, f"request body of {size} is over the gate's limit of {self.max_body:,} bytes "
                               f"(gate.max_body_mb = {self.cfg.gate.max_body_mb:g})", "invalid_request_error")

    async def own_endpoint(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/autosessd/status" and request.method == "GET":
            # status() scans the session directory: off the loop, as the control socket does.
            return web.json_response(await asyncio.get_running_loop().run_in_executor(None, self.sessions.status))
        if request.path == "/autosessd/metrics" and request.method == "GET":
            return web.Response(text=self.metrics(), content_type="text/plain", charset="utf-8",
                                headers={"X-Content-Type-Options": "nosniff"})
        return gate_error(404, f"no such endpoint {request.path} (autosessd has /autosessd/status and "
                               f"/autosessd/metrics)", "not_found_error")

    # -- forwarding ------------------------------------------------------------
    async def proxy(self, request: web.Request, body: bytes, watcher: SSEWatcher | None = None
                    ) -> web.StreamResponse:
        """Forward one request to the engine and its response back, as it arrives."""
        return await self.pool.forward(request, body, watcher)

    async def slot_action(self, request: web.Request) -> web.StreamResponse:
        """A client's own POST /slots/N?action=...: it waits for the slot's FIFO, so it never
        lands between a turn and its request."""
        body = await request.read()
        slot_id = _slot_in_path(request.path)
        async with await self.sessions.admit(slot_id) as ticket:
            resp = await self.proxy(request, body)
            if request.query.get("action") in ("restore", "erase") and resp.status < 400:
                # Someone else replaced what the slot holds.
                self.sessions.lost(ticket, f"a client's POST {request.path_qs} through the gate")
            return resp

    async def kv_request(self, request: web.Request) -> web.StreamResponse:
        """A request that runs on a slot: it takes the slot's FIFO. One of a conversation gets
        the turn (save → restore) before it is forwarded; one without a conversation (a raw
        completion, an embedding, a chat with no user text) only the save of the held
        conversation, since it replaces what the slot holds. The FIFO is released once the
        response has been delivered, or the client went away and the engine stopped."""
        body = await request.read()
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            parsed = None  # the engine answers a bad body itself
        key = conversation_key(parsed) if request.path in CONVERSATION_PATHS else None
        # Only an OpenAI chat body has its tokens from the engine's /apply-template; the other
        # APIs' bodies keep the key rule.
        chat = parsed if request.path in CHAT_PATHS and isinstance(parsed, dict) else None
        s = self.sessions
        n_slots = len(s.slots)
        if n_slots > 1 and (request.path not in PINNABLE_PATHS or not isinstance(parsed, dict)):
            return await self.unplaced(request, body)
        want = parsed.get("id_slot") if n_slots > 1 and isinstance(parsed, dict) else None
        if isinstance(want, int) and not isinstance(want, bool) and want >= 0:
            ticket = await s.admit(want % n_slots)  # the client chose the slot (the engine wraps the id too)
        else:
            ticket = await s.place(key)
            if n_slots > 1:
                # Pinned to the slot autosessd placed it on (and restored into): without it the
                # engine would pick a slot by prompt similarity.
                body = json.dumps({**parsed, "id_slot": ticket.slot_id}).encode()
        rid = uuid.uuid4().hex[:12]
        # The turn is shielded: a client leaving mid-save must not leave the engine's slot
        # half-way between two conversations while the FIFO moves on.
        turn_task = asyncio.get_running_loop().create_task(s.turn(ticket, key, body=chat))
        forwarded = False
        watcher = SSEWatcher(reply=chat is not None)
        try:
            await asyncio.shield(turn_task)
            await s.before_send(ticket)
            if self.request_log:
                self.request_log.write(event="start", id=rid, slot=ticket.slot_id, key=key)
            forwarded = True
            s.sent(ticket)
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

    async def unplaced(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """With several slots, a request that cannot be pinned to one (embeddings, rerank,
        a body that is not a JSON object) runs wherever the engine puts it: it takes every
        slot's FIFO, and afterwards the slot it ran on (its task id moved) holds nothing we
        can name."""
        tickets = await self.sessions.admit_all()
        try:
            return await self.proxy(request, body)
        finally:
            await asyncio.shield(self._spawn(self._after_unplaced(tickets)))

    async def _after_unplaced(self, tickets: list[Ticket]) -> None:
        try:
            await self.sessions.ran_unplaced(tickets)
        except Exception as e:
            log.exception("gate: bookkeeping after an unplaced request: %s", e)
        finally:
            for t in tickets:
                t.release()

    async def _after(self, ticket: Ticket, key: str | None, watcher: SSEWatcher, status: str, rid: str) -> None:
        """Still holding the FIFO: tell sessions how the request ended (it reads the slot
        itself), then release the FIFO whatever happens."""
        try:
            cache_n, n_prompt, n_tokens = watcher.numbers()
            log.debug("gate: %s ended %s: cache_n %s, prompt %s", key, status, cache_n, n_prompt)
            await self.sessions.ended(ticket, key, status, n_tokens, cache_n, n_prompt, watcher.reply())
            if status == "ok":
                self.sessions.prefill_seen(*watcher.prefill())
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
                await self.sessions.ended(ticket, key, "not_run")
                return
            await self.sessions.wait_idle(ticket, self.cfg.engine.timeout_s)
            await self.sessions.ended(ticket, key, "cancelled")
            if self.request_log:
                self.request_log.write(event="end", id=rid, slot=ticket.slot_id, n_tokens=None, status="cancelled")
        except Exception as e:
            log.exception("gate: settling a cancelled request of %s: %s", key, e)
        finally:
            ticket.release()

    # -- metrics ---------------------------------------------------------------
    def metrics(self) -> str:
        """Every counter of Sessions (report.py), and the gate's own."""
        return self.sessions.metrics([
            ("gate_requests_total", "counter", "Requests through the gate", self.requests),
            ("gate_upstream_errors_total", "counter", "Requests answered 502: engine unreachable",
             self.pool.errors_502),
            ("gate_in_flight", "gauge", "Requests in flight through the gate", self.in_flight),
        ])
