"""The one HTTP client pool to the engine (DESIGN §8): the gate forwards clients' requests
through it and the llama-server adapter makes its own calls through it.

Keep-alive: llama-server (cpp-httplib) closes a kept-alive connection after 5 s idle, and a
request written to a connection just as the engine closes it fails. Our idle connections are
dropped after KEEPALIVE_S, before the engine's, and a request that still meets a closed
connection (ServerDisconnectedError before any answer: the engine never saw it) is sent once
more on a fresh pool.

Pools: a fresh pool replaces the current one (that retry, or an engine restart). The old one
is retired, not closed: requests streaming through it go on, and it is closed once the last
of them has finished.

    pool.users   exchanges open on the pool (sent, body not yet read to its end or closed)
    retire       current pool → retired; closed now if no users, else at its last finish
    close        (at stop) every pool
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any, Callable

import aiohttp
from aiohttp import web

from .keepalive import to_client

if TYPE_CHECKING:
    from .keepalive import Keepalive

log = logging.getLogger("autosessd")

# Below llama-server's 5 s keep-alive timeout (cpp-httplib's CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND).
KEEPALIVE_S = 3.0
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade", "host", "content-length"})


def gate_error(status: int, message: str, type_: str = "unavailable_error") -> web.Response:
    """An error the gate makes itself: OpenAI-shaped, and saying it came from autosessd."""
    body = {"error": {"message": f"autosessd: {message}", "type": type_, "code": status, "src": "autosessd"}}
    return web.json_response(body, status=status)


def forward_headers(headers: Any) -> dict[str, str]:
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
        self.status: int | None = None  # its status (the client may have had the gate's 200 already)
        # The engine's stream said it was over ([DONE], a last chunk with "stop": true, a Responses
        # stream's response.completed): the client has the whole answer, even if it hangs up now.
        self.finished = False

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        if len(self._buf) > 1 << 20:  # a line this long carries nothing we read
            self._buf = b""
        for line in lines:
            # Parsed only where it says something read here (not every chunk: /completion's each
            # carry "stop":false, and a chunk's parse would cost every token its microseconds).
            if line.startswith(b"data:") and (b'"timings"' in line or b'"usage"' in line or b'"stop":true' in line
                                              or b'"stop": true' in line or b"response.completed" in line):
                with contextlib.suppress(ValueError):
                    self.take(json.loads(line[5:]))
            elif line.rstrip() == b"data: [DONE]":
                self.finished = True

    def take(self, d: Any) -> None:
        if not isinstance(d, dict):
            return
        if d.get("stop") is True or d.get("type") == "response.completed":
            self.finished = True
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


    def ended_as(self, sent: int | None) -> str:
        """How a forwarded request ended, for sessions: by the engine's status (with keepalives
        the client had the gate's 200 already; `sent`: the status the gate answered)."""
        code = self.status if self.status is not None else sent
        if not self.reached or code is None:
            return "not_run"  # the gate could not reach the engine: nothing ran
        if 400 <= code < 500:
            return "rejected"  # llama-server refuses a request (4xx) before it runs it
        return "ok" if code < 400 and not self.broken else "error"

    def prefill(self) -> tuple[int | None, float | None]:
        """(prompt tokens read, in ms): timings.prompt_n and prompt_ms, the engine's prompt rate."""
        t = self.timings or {}
        ms = t.get("prompt_ms")
        ok = isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms == ms and ms > 0
        return _count(t.get("prompt_n")), float(ms) if ok else None


def _count(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or v != int(v):
        return None
    return int(v)


class _Pool:
    def __init__(self, session: aiohttp.ClientSession):
        self.session = session
        self.users = 0
        self.retired = False


class Exchange:
    """One request's response, borrowed from a pool until finish()."""

    def __init__(self, upstream: "Upstream", pool: _Pool, resp: aiohttp.ClientResponse):
        self.upstream, self.pool, self.resp = upstream, pool, resp
        self._finished = False

    def finish(self, complete: bool) -> None:
        """complete: the body was read to its end, and the connection goes back to the pool
        (keep-alive). Otherwise it is closed: for a generation, that tells the engine to stop."""
        if self._finished:
            return
        self._finished = True
        if complete:
            self.resp.release()
        else:
            self.resp.close()
        self.pool.users -= 1
        self.upstream._close_if_idle(self.pool)

    async def __aenter__(self) -> aiohttp.ClientResponse:
        return self.resp

    async def __aexit__(self, exc_type: Any, *_: Any) -> None:
        self.finish(exc_type is None)


class Upstream:
    """The engine's HTTP pool. Created outside the event loop; its pools on first use."""

    def __init__(self, url: str, connect_timeout_s: float):
        self.url = url.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self._pool: _Pool | None = None
        self._retired: set[_Pool] = set()
        self._closing: set[asyncio.Task] = set()
        self.errors_502 = 0  # forwards answered 502: the engine could not be reached

    # -- pools -------------------------------------------------------------------
    def _current(self) -> _Pool:
        if self._pool is None:
            # No total timeout: a generation may run for minutes; connecting must be quick.
            # Callers with a deadline (the adapter) give their own timeout per request.
            timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s,
                                            sock_connect=self.connect_timeout_s)
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
            # No cookie jar: one engine pool serves every client of the gate.
            self._pool = _Pool(aiohttp.ClientSession(timeout=timeout, auto_decompress=False, connector=connector,
                                                     cookie_jar=aiohttp.DummyCookieJar()))
        return self._pool

    def retire(self) -> None:
        """New connections from now on (the engine restarted, or closed one under us)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.retired = True
            self._retired.add(pool)
            self._close_if_idle(pool)

    async def renewed(self) -> None:
        """For sessions.on_engine_restart."""
        self.retire()

    def _close_if_idle(self, pool: _Pool) -> None:
        if pool.retired and pool.users == 0 and pool in self._retired:
            self._retired.discard(pool)
            t = asyncio.get_running_loop().create_task(pool.session.close())
            self._closing.add(t)
            t.add_done_callback(self._closing.discard)

    def open_pools(self) -> int:
        """Pools not yet closed (for tests: a retired pool goes once idle)."""
        return len(self._retired) + (self._pool is not None) + len(self._closing)

    async def close(self) -> None:
        pools = [*self._retired, *([self._pool] if self._pool else [])]
        self._pool, self._retired = None, set()
        for pool in pools:
            await pool.session.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    # -- requests ----------------------------------------------------------------
    async def send(self, method: str, path: str, **kw: Any) -> Exchange:
        """Send a request (aiohttp's request() keywords); the caller finishes the Exchange
        (or uses it as `async with`). Raises aiohttp's errors."""
        for attempt in (1, 2):
            pool = self._current()
            pool.users += 1
            try:
                resp = await pool.session.request(method, self.url + path, allow_redirects=False, **kw)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                # A kept-alive connection the engine closed as we reused it (its idle timeout,
                # or a restart): it never saw the request (whole). Once more on fresh connections.
                # A connection that cannot be made at all is not retried here.
                if isinstance(e, aiohttp.ClientConnectorError):
                    pool.users -= 1
                    self._close_if_idle(pool)
                    raise
                pool.users -= 1
                if self._pool is pool:
                    self.retire()
                else:
                    self._close_if_idle(pool)
                if attempt == 2:
                    raise
                continue
            except BaseException:
                pool.users -= 1
                self._close_if_idle(pool)
                raise
            return Exchange(self, pool, resp)
        raise AssertionError("unreachable")

    async def forward(self, request: web.Request, body: bytes, watcher: SSEWatcher | None = None,
                      decorate: Callable[[int, SSEWatcher | None], dict[str, str]] | None = None,
                      early: Keepalive | None = None) -> web.StreamResponse:
        """Forward one client request to the engine and its response back, as it arrives.

        decorate(status, watcher): headers of the gate's own to add to a successful answer (the
        engine's error answers are left as they are); a whole answer's body is read first, so the
        watcher has its timings then. early: the request's keepalives (keepalive.py), which ping
        while the engine has not answered, and may have sent the status line already."""
        headers = forward_headers(request.headers)
        try:
            send = self.send(request.method, request.rel_url.path_qs, headers=headers, data=body or None)
            ex = await (early.wait(send, orphan=lambda x: x.finish(False)) if early is not None else send)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
            self.errors_502 += 1
            why = "timed out connecting" if isinstance(e, asyncio.TimeoutError) else str(e) or type(e).__name__
            err = gate_error(502, f"cannot reach the engine at {self.url}: {why}")
            return await early.answer(err.body) if early is not None and early.started else err
        up = ex.resp
        done = False
        resp: web.StreamResponse | None = None
        if watcher is not None:
            watcher.reached = True
            watcher.status = up.status
        try:
            headers = forward_headers(up.headers)
            # An answer that is not an event stream is read whole, also when it comes in chunks
            # with no length (llama-server's router relays its models' answers so): its
            # timings are then known, for the bookkeeping and the gate's own headers.
            streaming = "text/event-stream" in up.headers.get("Content-Type", "")
            if early is not None and early.started:
                resp = early.resp
                assert resp is not None
                if decorate is not None and up.status < 400:
                    await early.comments(decorate(up.status, watcher))
                if up.status >= 400 or "text/event-stream" not in up.headers.get("Content-Type", ""):
                    data = await up.read()  # an error (or a whole answer) where a stream was promised
                    done = True
                    if watcher is not None:
                        with contextlib.suppress(ValueError, UnicodeDecodeError):
                            watcher.take(json.loads(data))
                    return await early.answer(data)
            elif not streaming:
                data = await up.read()
                done = True
                if watcher is not None:
                    with contextlib.suppress(ValueError, UnicodeDecodeError):
                        watcher.take(json.loads(data))
                if decorate is not None and up.status < 400:
                    headers.update(decorate(up.status, watcher))
                return web.Response(status=up.status, reason=up.reason, headers=headers, body=data)
            else:
                if decorate is not None and up.status < 400:
                    headers.update(decorate(up.status, watcher))
                resp = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
                await to_client(resp.prepare(request))
            async for chunk in up.content.iter_any():
                await to_client(resp.write(chunk))
                if watcher is not None:  # what the client was sent: its [DONE] once written
                    watcher.feed(chunk)
            done = True
            await to_client(resp.write_eof())
            return resp
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
            # The status line is already sent: the only honest signal left is to close the
            # client's connection without finishing the body.
            log.warning("gate: the engine at %s broke off a response to %s: %s", self.url, request.path,
                        e or type(e).__name__)
            if watcher is not None:
                watcher.broken = True
            if resp is None:  # nothing sent yet: a proper error answer is still possible
                self.errors_502 += 1
                return gate_error(502, f"the engine at {self.url} broke off its answer: {e}")
            if request.transport is not None:
                request.transport.close()
            return resp
        finally:
            # Read to its end: back to the pool (keep-alive). Unfinished: closing the
            # connection tells the engine to stop generating.
            ex.finish(done)
