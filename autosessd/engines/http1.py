"""A small HTTP/1.1 client for the adapter's own calls to the engine: GET /slots, slot
actions, /tokenize and the like. Each is a short JSON exchange on loopback, made on every
turn; aiohttp's client costs ~0.8 ms a call here against ~0.2 ms for the exchange itself
(bench: a GET /slots to llama-server, 1.0 ms median through aiohttp, 0.23 ms on a kept-alive
stream), and that was most of what the switch back added beyond the engine's restore.

What it speaks: plain http (an https engine URL keeps aiohttp: LlamaServer decides), one
request at a time per connection, kept alive while the server allows it; responses with a
Content-Length, chunked, or ended by the server closing. A request sent on a kept-alive
connection that the server had closed meanwhile (its idle timeout, a restart) is sent once
more on a new connection when no byte of an answer came back, as aiohttp's pool does (the
engine never saw it). A timeout or a cancellation closes the connection (never reused
half-read). The gate's forwarding of clients' requests stays on aiohttp (upstream.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
import socket
import time
from urllib.parse import urlsplit

MAX_HEADER = 64 * 1024  # bytes of a response's status line and headers
MAX_BODY = 256 * 1024 * 1024  # a body beyond this is refused (GET /slots of thousands of slots fits)
# Connections kept alive for reuse. Each open one holds one of llama-server's HTTP threads
# (max(n_parallel + 4, cores - 1) of them; it closes a connection idle for 5 s): the turn's
# calls run one at a time, a save behind or a /tokenize may overlap one.
IDLE_KEPT = 2
IDLE_MAX_S = 4.0  # a connection idle this long is not reused (llama-server closes them at 5 s)
_timeout = getattr(asyncio, "timeout", None)  # 3.11+
_STATUS = re.compile(r"[1-5][0-9][0-9]")


class HTTPError(Exception):
    """The exchange failed: no connection, or it broke (the message says which)."""

    def __init__(self, message: str, connect: bool = False):
        super().__init__(message)
        self.connect = connect  # the connection could not be made at all


class _Conn:
    """One connection: a non-blocking socket the loop's sock_* calls read and write, and
    what was read of it beyond the last answer. Not asyncio's streams: their reader, protocol
    and transport sit between the socket and the parser on every call (bench/restore_floor.py
    measures what each layer adds to a restore)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self.idle_since = time.monotonic()
        self.got_any = False  # a byte of the current answer came

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def closed_by_peer(self) -> bool:
        """At EOF, or sent bytes nobody asked for (either way not reusable). A peek, no wait."""
        if self.buf:
            return True
        try:
            self.sock.recv(1, socket.MSG_PEEK)  # b"": at EOF; a byte: not an answer of ours
        except (BlockingIOError, InterruptedError):
            return False  # nothing to read: open and quiet
        except OSError:
            pass  # reset
        return True

    async def fill(self) -> None:
        data = await asyncio.get_running_loop().sock_recv(self.sock, 65536)
        if not data:
            raise EOFError("the connection closed")
        self.got_any = True
        self.buf += data

    async def until(self, sep: bytes, limit: int, what: str = "the response's headers") -> bytes:
        """Everything up to and including sep (at most limit bytes before it)."""
        start = 0
        while True:
            i = self.buf.find(sep, start)
            if i > limit or (i < 0 and len(self.buf) > limit):
                raise HTTPError(f"{what} beyond {limit:,} bytes")
            if i >= 0:
                out = bytes(self.buf[:i + len(sep)])
                del self.buf[:i + len(sep)]
                return out
            start = max(0, len(self.buf) - len(sep) + 1)
            await self.fill()

    async def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self.fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def to_end(self) -> bytes:
        while True:
            try:
                await self.fill()
            except EOFError:
                out, self.buf = bytes(self.buf), bytearray()
                return out
            if len(self.buf) > MAX_BODY:
                raise HTTPError("a body beyond the bound")


class Client:
    def __init__(self, url: str):
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"not a plain http URL: {url}")
        self.host = u.hostname
        self.port = u.port or 80
        self.host_header = u.netloc
        self.base = u.path.rstrip("/")
        self._idle: list[_Conn] = []

    async def request(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
                      timeout_s: float) -> tuple[int, bytes]:
        """(status, body) of one exchange, within timeout_s (asyncio.TimeoutError beyond)."""
        if _timeout is None:  # Python 3.10: wait_for, a task more a call
            return await asyncio.wait_for(self._exchange(method, path, body, headers), timeout_s)
        async with _timeout(timeout_s):
            return await self._exchange(method, path, body, headers)

    async def _exchange(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
        lines = [f"{method} {self.base}{path} HTTP/1.1", f"Host: {self.host_header}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        elif method != "GET":
            lines.append("Content-Length: 0")
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")
        loop = asyncio.get_running_loop()
        for attempt in (1, 2):
            conn = self._kept() if attempt == 1 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect()  # the second try always on a new connection
            conn.got_any = False
            try:
                await loop.sock_sendall(conn.sock, data)
                status, keep, n, chunked = await self._head(conn)
                payload = await self._body(conn, n, chunked)
            except (ConnectionError, OSError, EOFError) as e:
                conn.close()
                if reused and not conn.got_any and attempt == 1:
                    self.drop()  # the others went the same way (an engine restart): new ones
                    continue  # a kept-alive connection closed under us: the server never saw it
                raise HTTPError(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
            except BaseException:  # a timeout, a cancellation, a malformed answer: never reuse it
                conn.close()
                raise
            if keep and len(self._idle) < IDLE_KEPT:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            else:
                conn.close()
            return status, payload
        raise AssertionError("unreachable")

    def _kept(self) -> _Conn | None:
        """A kept-alive connection still worth trying: not closed by the server (at EOF), and
        idle for less than the server's own keep-alive timeout (llama-server's: 5 s)."""
        while self._idle:
            conn = self._idle.pop()
            if time.monotonic() - conn.idle_since < IDLE_MAX_S and not conn.closed_by_peer():
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            try:
                ip = ipaddress.ip_address(self.host)
                addrs = [(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, (self.host, self.port))]
            except ValueError:
                infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
                addrs = [(family, addr) for family, _, _, _, addr in infos]
            error: OSError = OSError(f"{self.host} has no address")
            for family, addr in addrs:
                sock = socket.socket(family, socket.SOCK_STREAM)
                try:
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    await loop.sock_connect(sock, addr)
                    return _Conn(sock)
                except OSError as e:
                    sock.close()
                    error = e
                except BaseException:
                    sock.close()
                    raise
            raise error
        except OSError as e:
            raise HTTPError(e.strerror or str(e), connect=True) from None

    @staticmethod
    async def _head(conn: _Conn) -> tuple[int, bool, int | None, bool]:
        """(status, keep-alive, Content-Length, chunked)."""
        try:
            raw = await conn.until(b"\r\n\r\n", MAX_HEADER)
        except EOFError:
            if conn.got_any:
                raise HTTPError("the connection closed inside the response's headers") from None
            raise
        head = raw.decode("latin-1").split("\r\n")
        parts = head[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not _STATUS.fullmatch(parts[1]):
            raise HTTPError(f"not an HTTP/1 response: {head[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            return await Client._head(conn)  # an interim answer (100 Continue): the real one follows
        fields: dict[str, str] = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            if name:
                fields[name.strip().lower()] = value.strip()
        conn_field = fields.get("connection", "").lower()
        keep = parts[0] == "HTTP/1.1" and "close" not in conn_field or "keep-alive" in conn_field
        chunked = "chunked" in fields.get("transfer-encoding", "").lower()
        n = None
        if not chunked and "content-length" in fields:
            try:
                n = int(fields["content-length"])
            except ValueError:
                raise HTTPError(f"Content-Length {fields['content-length']!r}") from None
            if not 0 <= n <= MAX_BODY:
                raise HTTPError(f"a body of {n:,} bytes")
        if status in (204, 304):
            n, chunked = 0, False  # no body, whatever the headers say (RFC 9112 6.3)
        if n is None and not chunked:
            keep = False  # read to the end: the server closes
        return status, keep, n, chunked

    @staticmethod
    async def _body(conn: _Conn, n: int | None, chunked: bool) -> bytes:
        if n is not None:
            return await conn.exactly(n)
        if not chunked:
            return await conn.to_end()
        out = bytearray()
        while True:
            size_line = await conn.until(b"\r\n", 1024, "a chunk-size line")
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HTTPError(f"a chunk size {size_line[:20]!r}") from None
            if size == 0:
                while (await conn.until(b"\r\n", MAX_HEADER)) != b"\r\n":  # trailers
                    pass
                return bytes(out)
            if len(out) + size > MAX_BODY:
                raise HTTPError("a body beyond the bound")
            out += await conn.exactly(size)
            await conn.exactly(2)

    def drop(self) -> None:
        """Close the kept-alive connections (the engine restarted: new ones from now on)."""
        idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    async def close(self) -> None:
        self.drop()
