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

GET /health is the front door's question (a load balancer's health check), health.py's answer.

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
from typing import Any, Callable

from aiohttp import web

from ..base.config import Config, parse_hostport
from ..base.keys import conversation_id_key, conversation_key, names_own_adapters
from ..engines.keepalive import Keepalive
from ..engines.upstream import SSEWatcher, Upstream, gate_error
from ..follow.requestlog import RequestLog
from ..modes.models import Router
from ..sessions import views
from ..sessions.facade import Sessions
from ..sessions.placement import Ticket, keyless_prompt
from ..sessions.report import TurnResult
from ..shared.bucket import default_host
from . import health
from .guard import Guard
from .routes import (CHAT_PATHS, CONVERSATION_PATHS, PINNABLE_PATHS, SLOTLESS_POSTS, model_of, several_tasks,
                     slot_in_path)

log = logging.getLogger("autosessd")

SETTLE_S = 10.0  # at a stop, for the bookkeeping of requests the stop cut
# The Prometheus text exposition format's content type.
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _url_host(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Gate:
    name = "gate"

    def __init__(self, cfg: Config, sessions: Sessions | None, pool: Upstream | None = None,
                 router: Router | None = None, not_ready: Callable[[], str | None] | None = None):
        """pool: the engine's HTTP pool, shared with the engine adapter (one is made when None).
        router: llama-server in router mode (models.py): each request goes to its model's
        Sessions, loaded first; sessions is then None. not_ready: why this autosessd is not
        serving (starting, stopping), or None; /health answers 503 while it says why."""
        self.cfg = cfg
        self.not_ready = not_ready or (lambda: None)
        # The name a front door's client sees in X-Autosessd-Host: [shared] host, else the
        # hostname. shared_host: the same, only with [shared] (one host needs no such headers).
        self.host_name = (cfg.shared.host if cfg.shared is not None else None) or default_host()
        self.shared_host = self.host_name if cfg.shared is not None else None
        self.sessions = sessions
        self.router = router
        self.house: Any = router if router is not None else sessions  # status, metrics, restarts
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
        self.house.on_engine_restart.append(self.pool.renewed)
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
                await asyncio.wait_for(self.house.fifos_free(), max(0.0, deadline - time.monotonic()))
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
        if path == "/health" and request.method == "GET":
            return await self.health(request)
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
            return web.json_response(await asyncio.get_running_loop().run_in_executor(None, self.house.status))
        if request.path == "/autosessd/metrics" and request.method == "GET":
            # It scans the session directory for its gauges: off the loop, as status is.
            text = await asyncio.get_running_loop().run_in_executor(None, self.metrics)
            return web.Response(body=text.encode(), headers={"Content-Type": METRICS_TYPE,
                                                             "X-Content-Type-Options": "nosniff"})
        return gate_error(404, f"no such endpoint {request.path} (autosessd has /autosessd/status and "
                               f"/autosessd/metrics)", "not_found_error")

    async def health(self, request: web.Request) -> web.StreamResponse:
        """GET /health: the front door's question (health.py)."""
        return await health.answer(request, self.pool, self.upstream, self.not_ready(), self.host_name)

    # -- forwarding ------------------------------------------------------------
    async def proxy(self, request: web.Request, body: bytes, watcher: SSEWatcher | None = None,
                    decorate: Any = None, early: Keepalive | None = None) -> web.StreamResponse:
        """Forward one request to the engine and its response back, as it arrives."""
        return await self.pool.forward(request, body, watcher, decorate, early)

    async def slot_action(self, request: web.Request) -> web.StreamResponse:
        """A client's own POST /slots/N?action=...: it waits for the slot's FIFO, so it never
        lands between a turn and its request."""
        body = await request.read()
        slot_id = slot_in_path(request.path)
        s = self.sessions
        if self.router is not None:
            model = model_of(body)
            s = self.router.sessions_of(model) if model is not None else None
            if s is None:  # a model not loaded (or none named): nothing of ours on its slots
                return await self.proxy(request, body)
        async with await s.admit(slot_id) as ticket:
            resp = await self.proxy(request, body)
            if request.query.get("action") in ("restore", "erase") and resp.status < 400:
                # Someone else replaced what the slot holds.
                s.lost(ticket, f"a client's POST {request.path_qs} through the gate")
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
        # The client's own id names the conversation when present (gate.conversation_id_headers,
        # in order: X-Conversation-Id, which llama-server's web UI sends and b11434 keys resumable
        # streams on; behind SMG also X-SMG-Routing-Key); else its first user message.
        key = (next((k for k in (conversation_id_key(request.headers.get(h))
                                 for h in self.cfg.gate.conversation_id_headers) if k), None)
               or conversation_key(parsed) if request.path in CONVERSATION_PATHS and not names_own_adapters(parsed)
               else None)
        # Only an OpenAI chat body has its tokens from the engine's /apply-template; the other
        # APIs' bodies keep the key rule.
        chat = parsed if request.path in CHAT_PATHS and isinstance(parsed, dict) else None
        # A streaming client is kept alive with SSE comments while it waits (keepalive.py).
        streams = isinstance(parsed, dict) and parsed.get("stream") is True
        ka = Keepalive(request, self.cfg.gate.keepalive_s) if streams and self.cfg.gate.keepalive_s > 0 else None
        if self.router is None:
            return await self._kv_request(request, body, parsed, key, chat, self.sessions, ka, None)
        # Its model loaded first (another put away when the router is at its limit); a model
        # autosessd does not keep, or none named: forwarded untouched.
        model = parsed.get("model") if isinstance(parsed, dict) else None
        s = await self._acquire(model, ka)
        if s is None:
            return await self.proxy(request, body, early=ka)
        handed: list[Ticket] = []
        try:
            return await self._kv_request(request, body, parsed, self.router.key(model, key), chat, s, ka,
                                          handed.append)
        finally:
            # The model's request counts as in flight until its ticket goes (which may be
            # after this handler: bookkeeping, a disconnect), or until now if it got none.
            if handed:
                handed[0].then(lambda: self.router.release(model))
            else:
                self.router.release(model)

    async def _acquire(self, model: Any, ka: Keepalive | None) -> Sessions | None:
        """The router's Sessions of the request's model. A client that leaves meanwhile does
        not stop the model switch (other requests may wait for it); the count of the model's
        requests it took is given back once it is done."""
        assert self.router is not None
        router = self.router
        task = asyncio.ensure_future(router.acquire(model))
        try:
            return await (ka.wait(asyncio.shield(task)) if ka else asyncio.shield(task))
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: None if t.cancelled() or t.exception() is not None or t.result() is None
                                   else router.release(model))
            raise

    async def _kv_request(self, request: web.Request, body: bytes, parsed: Any, key: str | None,
                          chat: dict | None, s: Sessions, ka: Keepalive | None,
                          hand: Callable[[Ticket], None] | None) -> web.StreamResponse:
        n_slots = len(s.slots)
        if n_slots > 1 and (request.path not in PINNABLE_PATHS or not isinstance(parsed, dict) or
                            several_tasks(parsed)):
            return await self.unplaced(request, body, s, ka)
        want = parsed.get("id_slot") if n_slots > 1 and isinstance(parsed, dict) else None
        release = lambda t: t.release()  # noqa: E731 - a ticket granted as the client left
        if isinstance(want, int) and not isinstance(want, bool) and want >= 0:
            # The client chose the slot (the engine wraps the id too).
            admit = s.admit(want % n_slots)
            ticket = await (ka.wait(admit, release) if ka else admit)
        else:
            place = s.place(key, keyless_prompt(parsed) if key is None else None)
            ticket = await (ka.wait(place, release) if ka else place)
            if n_slots > 1:
                # Pinned to the slot autosessd placed it on (and restored into): without it the
                # engine would pick a slot by prompt similarity.
                body = json.dumps({**parsed, "id_slot": ticket.slot_id}).encode()
        if hand is not None:
            hand(ticket)
        rid = uuid.uuid4().hex[:12]
        # The turn is shielded: a client leaving mid-save must not leave the engine's slot
        # half-way between two conversations while the FIFO moves on.
        turn_task = asyncio.get_running_loop().create_task(s.turn(ticket, key, body=chat))
        forwarded = False
        watcher = SSEWatcher()
        try:
            result = await (ka.wait(asyncio.shield(turn_task)) if ka else asyncio.shield(turn_task))
            await (ka.wait(s.before_send(ticket)) if ka else s.before_send(ticket))
            if self.request_log:
                self.request_log.write(event="start", id=rid, slot=ticket.slot_id, key=key)
            forwarded = True
            s.sent(ticket)
            # Not shielded: cancelling it (client gone) closes the upstream request.
            resp = await self.proxy(request, body, watcher, self._decorator(s, result, ticket.slot_id, self.shared_host),
                                    ka)
        except asyncio.CancelledError:
            if forwarded and watcher.finished:
                # The client hung up once it had the whole answer (the OpenAI SDK closes a stream
                # at its [DONE], before the response's own end): delivered, not cancelled.
                self._spawn(self._after(s, ticket, key, watcher, watcher.ended_as(None), rid))
                raise
            # The client went away. The FIFO is released by _settle_cancelled, once the
            # engine has stopped working on this request.
            self._spawn(self._settle_cancelled(s, ticket, key, rid, turn_task, forwarded))
            raise
        except BaseException:
            self._spawn(self._after(s, ticket, key, watcher, "error" if forwarded else "not_run", rid))
            raise
        # Delivered. The bookkeeping runs to its end even if the client hangs up now (a
        # streaming client often closes right after the last chunk), and releases the FIFO.
        await asyncio.shield(self._spawn(self._after(s, ticket, key, watcher, watcher.ended_as(resp.status), rid)))
        return resp

    @staticmethod
    def _decorator(s: Sessions, result: TurnResult, slot: int, host: str | None) -> Any:
        """What autosessd did for the request, as response headers (docs/getting-started.md, Response headers):
        only on the engine's successful answers (forward leaves its error answers alone)."""
        savings = s.ctx.savings
        # With [shared] (host set), behind a front door (docs/several-hosts.md): which host
        # answered, and whether the conversation was this host's or came from another host.
        if result.downloaded_from is not None:
            came = f"bucket {result.downloaded_from}"
        elif result.moved_from is not None:
            came = f"moved {result.moved_from}"
        else:
            came = "local"

        def decorate(status: int, watcher: SSEWatcher | None) -> dict[str, str]:
            h = {"X-Autosessd-Slot": str(slot)}
            if host is not None:
                h["X-Autosessd-Host"], h["X-Autosessd-Conversation"] = host, came
            if result.saved:
                h["X-Autosessd-Saved"] = f"{result.saved['n_tokens']} {result.saved['file']}"
            r = result.restored
            if r:
                h["X-Autosessd-Restored"] = f"{r['n_tokens']} {r['file']}"
                had = r.get("slot_shared") or 0
                cache_n = watcher.numbers()[0] if watcher is not None else None
                # A whole answer carries the engine's cache_n: what it reused. A stream's headers
                # go out before it: what the restore shares with the request, reused if all is well.
                reused = cache_n if cache_n is not None else r.get("shared") or r["n_tokens"]
                ms = savings.price(min(had, reused), reused)
                if ms is not None:
                    h["X-Autosessd-Est-Saved-Ms"] = str(round(ms))
            return h

        return decorate

    async def unplaced(self, request: web.Request, body: bytes, s: Sessions,
                       ka: Keepalive | None = None) -> web.StreamResponse:
        """With several slots, a request that cannot be pinned to one (embeddings, rerank,
        a batch of prompts, several completions, a body that is not a JSON object) runs
        wherever the engine puts it: it takes every slot's FIFO, the conversations worth saving
        are saved first, and afterwards the slot it ran on (its task id moved) holds nothing
        we can name."""
        tickets = await s.admit_all()
        # The saves run under the tickets to their end, whether the client stays or not; a
        # failure among them never fails the request.
        saves = asyncio.ensure_future(self._save_before_unplaced(s, tickets))
        forwarded = False
        try:
            await asyncio.shield(saves)
            forwarded = True
            return await self.proxy(request, body, early=ka)
        finally:
            await asyncio.shield(self._spawn(self._after_unplaced(s, tickets, saves, forwarded)))

    @staticmethod
    async def _save_before_unplaced(s: Sessions, tickets: list[Ticket]) -> None:
        try:
            await s.save_before_unplaced(tickets)
        except Exception as e:
            log.exception("gate: saving before an unplaced request: %s", e)

    async def _after_unplaced(self, s: Sessions, tickets: list[Ticket], saves: asyncio.Future,
                              forwarded: bool) -> None:
        try:
            await asyncio.shield(saves)  # the tickets outlive the saves made under them
            if forwarded:
                await s.ran_unplaced(tickets)
        except Exception as e:
            log.exception("gate: bookkeeping after an unplaced request: %s", e)
        finally:
            for t in tickets:
                t.release()

    async def _after(self, s: Sessions, ticket: Ticket, key: str | None, watcher: SSEWatcher, status: str,
                     rid: str) -> None:
        """Still holding the FIFO: tell sessions how the request ended (it reads the slot
        itself), then release the FIFO whatever happens."""
        try:
            cache_n, n_prompt, n_tokens = watcher.numbers()
            log.debug("gate: %s ended %s: cache_n %s, prompt %s", key, status, cache_n, n_prompt)
            await s.ended(ticket, key, status, n_tokens, cache_n, n_prompt)
            s.ctx.turn_times.engine_done(ticket.slot_id, key, watcher.timings)  # beside its turn's phases
            if status == "ok":
                s.prefill_seen(*watcher.prefill(), cache_n=cache_n)
            if self.request_log and status != "not_run":
                self.request_log.write(event="end", id=rid, slot=ticket.slot_id, n_tokens=n_tokens,
                                       status="ok" if status == "ok" else "error",
                                       **({"cache_n": cache_n} if cache_n is not None else {}),
                                       **({"n_prompt": n_prompt} if n_prompt is not None else {}))
        except Exception as e:  # the answer is delivered; bookkeeping must not turn it into an error
            log.exception("gate: bookkeeping after a request of %s: %s", key, e)
        finally:
            ticket.release()

    async def _settle_cancelled(self, s: Sessions, ticket: Ticket, key: str | None, rid: str, turn_task: asyncio.Task,
                                forwarded: bool) -> None:
        """After a client disconnect: let the turn finish, wait (bounded) for the engine to
        stop generating, tell sessions (a partial state: provisional), then release the FIFO."""
        log.debug("gate: %s: the client went away %s", key, "while the engine answered" if forwarded else
                  "before its request reached the engine")
        try:
            with contextlib.suppress(Exception):
                await turn_task
            if not forwarded:
                await s.ended(ticket, key, "not_run")
                return
            await s.wait_idle(ticket, self.cfg.engine.timeout_s)
            await s.ended(ticket, key, "cancelled")
            if self.request_log:
                self.request_log.write(event="end", id=rid, slot=ticket.slot_id, n_tokens=None, status="cancelled")
        except Exception as e:
            log.exception("gate: settling a cancelled request of %s: %s", key, e)
        finally:
            ticket.release()

    # -- metrics ---------------------------------------------------------------
    def metrics(self) -> str:
        """Every counter of Sessions (report.py, through views.py), and the gate's own."""
        return views.metrics(self.house, [
            ("gate_requests_total", "counter", "Requests through the gate", self.requests),
            ("gate_upstream_errors_total", "counter", "Requests answered 502: engine unreachable",
             self.pool.errors_502),
            ("gate_requests_in_flight", "gauge", "Requests in flight through the gate", self.in_flight),
        ])
