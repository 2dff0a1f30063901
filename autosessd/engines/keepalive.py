"""SSE keepalives for a streaming request that waits: for its slot's FIFO, for the turn (a
restore, a save), for the engine's first byte (a model load in router mode, a long prompt).

Clients and proxies with idle timeouts (nginx's 60 s proxy_read_timeout, a browser's fetch, an
SDK's read timeout) cut a stream that says nothing for long. Once a streaming request has waited
`after_s` without a byte, the gate answers 200 with `text/event-stream` itself, `X-Accel-Buffering:
no` (nginx then passes each chunk as it comes) and `Cache-Control: no-cache`, and sends an SSE
comment, `: ping`, every `every_s` until the engine's stream begins; comments are ignored by every
SSE parser (the spec's lines starting with a colon). From then on the status line is sent: the
engine's stream is relayed into the same response, and an answer that is not a stream (an error
the engine gave, or the gate's own 502) is sent as one `data:` event carrying its JSON body, as
llama-server sends an error that happens mid-stream. What autosessd did for the request (the
X-Autosessd-* headers, too late for the headers now) is sent as comments of the same names.

A request that never waits that long is untouched: its status and headers are the engine's.
"""

from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable, TypeVar

from aiohttp import web

T = TypeVar("T")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PING = b": ping\n\n"


async def to_client(write: Awaitable[T]) -> T:
    """A write to the gate's client. The client's connection closing under it (aiohttp raises a
    ConnectionResetError, which is also a ClientConnectionError, the engine's kind) is the client
    gone: raised as the CancelledError a hang-up brings while the gate waits, and settled as
    that is (delivered if what the client was sent had the end of the engine's stream, cancelled
    if not)."""
    try:
        return await write
    except ConnectionError:
        raise asyncio.CancelledError() from None


class Keepalive:
    def __init__(self, request: web.Request, after_s: float, every_s: float | None = None):
        self.request = request
        self.after_s = after_s
        self.every_s = every_s or after_s
        loop = asyncio.get_running_loop()
        self._next = loop.time() + after_s  # when the next ping is due (one schedule across waits)
        self.resp: web.StreamResponse | None = None
        self.pings = 0

    @property
    def started(self) -> bool:
        """The gate has sent the status line and SSE headers itself."""
        return self.resp is not None

    async def wait(self, aw: Awaitable[T], orphan: Callable[[T], None] | None = None) -> T:
        """Await `aw`, pinging the client while it takes long. If the client goes away (this is
        cancelled) the awaited task is cancelled too; a result it produced all the same (a ticket
        granted just then) goes to `orphan`, so nothing is left held."""
        if self.after_s <= 0:
            return await aw
        task = asyncio.ensure_future(aw)
        loop = asyncio.get_running_loop()
        try:
            while True:
                await asyncio.wait({task}, timeout=max(0.0, self._next - loop.time()))
                if task.done():
                    return task.result()
                await self.ping()
                self._next = loop.time() + self.every_s
        except asyncio.CancelledError:
            if task.done() and not task.cancelled() and task.exception() is None and orphan is not None:
                orphan(task.result())
            task.cancel()
            raise

    async def ping(self) -> None:
        if self.resp is None:
            self.resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
            await to_client(self.resp.prepare(self.request))
        await to_client(self.resp.write(PING))
        self.pings += 1

    async def comments(self, headers: dict[str, str]) -> None:
        """What autosessd did, once the status line is gone: `: X-Autosessd-Restored: ...`."""
        if self.resp is not None and headers:
            await to_client(self.resp.write("".join(f": {k}: {v}\n" for k, v in headers.items()).encode() + b"\n"))

    async def answer(self, body: bytes) -> web.StreamResponse:
        """A whole answer (an error's JSON) sent as one SSE event, then the end of the stream."""
        assert self.resp is not None
        try:
            text = json.dumps(json.loads(body), separators=(",", ":"))
        except (ValueError, UnicodeDecodeError):
            text = json.dumps({"error": {"message": body.decode("utf-8", "replace")[:2000], "type": "server_error"}})
        await to_client(self.resp.write(f"data: {text}\n\n".encode()))
        await to_client(self.resp.write_eof())
        return self.resp
