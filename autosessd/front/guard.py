"""The gate's front door: who may talk to it, how many at once, and how slowly.

    Host             While the gate listens on loopback only, it serves only requests whose
                     Host header names a loopback name or address (or gate.allowed_hosts): a
                     web page in the user's browser can otherwise reach it by DNS rebinding
                     (a name of the page's that resolves to 127.0.0.1). Refused with 403 in the
                     API's error shape, "src": "autosessd".
    connections      At most gate.max_connections open at once (default: what the process's
                     descriptor limit allows, two descriptors per request through the gate);
                     one more is answered 503 and closed at once.
    headers          A connection must send its request's headers within gate.header_timeout_s
                     of opening (and stay idle at most that long between requests): a client
                     that trickles them, or opens connections and sends nothing, is closed.
    floods           what is refused is counted, and logged once per FLOOD_LOG_S, not per
                     connection.

Hooks into aiohttp's Server by its connection_made/connection_lost callbacks (which its
RequestHandler calls for every connection); the gate's middleware marks a connection whose
request began (request_started).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import resource
import time
from typing import Any

from aiohttp import web

log = logging.getLogger("autosessd")

FLOOD_LOG_S = 10.0
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def raise_nofile() -> int:
    """Raise the soft limit on open descriptors to the hard one (systemd's default soft limit
    is 1,024); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, e)
    return soft


def default_max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, (soft - 256) // 2)  # 256 kept for session files, sockets and the engine's pool


def is_loopback_host(host: str) -> bool:
    """Host header value (name or address, with or without a port) names this machine's loopback."""
    h = host.strip().lower()
    if h.startswith("["):  # [::1]:8080
        h = h[1:h.find("]")] if "]" in h else h[1:]
    elif h.count(":") == 1:
        h = h.rsplit(":", 1)[0]
    if h in LOOPBACK_NAMES or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _raw(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": f"autosessd: {message}", "type": "unavailable_error", "code": status,
                                 "src": "autosessd"}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


class Guard:
    def __init__(self, listen: list[tuple[str, int]], allowed_hosts: tuple[str, ...] | None,
                 max_connections: int | None, header_timeout_s: float):
        self.loopback_only = all(is_loopback_host(h) for h, _ in listen)
        self.allowed = frozenset(h.lower() for h in allowed_hosts or ())
        self.max_connections = max_connections or default_max_connections()
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.refused = {"host": 0, "connections": 0, "header_timeout": 0}
        self._timers: dict[Any, asyncio.TimerHandle] = {}
        self._said_at = 0.0
        self._unsaid = 0

    # -- aiohttp's Server -------------------------------------------------------------
    def install(self, server: Any) -> None:
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self.open += 1
            if self.open > self.max_connections:
                self.refused["connections"] += 1
                self._flood(f"more than gate.max_connections = {self.max_connections:,} open at once")
                transport.write(_raw(503, "Service Unavailable", f"more than {self.max_connections:,} connections "
                                                                  f"are open (gate.max_connections)"))
                transport.close()
                return
            self._arm(handler, transport)

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            self.open -= 1
            timer = self._timers.pop(handler, None)
            if timer is not None:
                timer.cancel()
            lost(handler, exc)

        server.connection_made, server.connection_lost = connection_made, connection_lost

    def _arm(self, handler: Any, transport: asyncio.Transport) -> None:
        loop = asyncio.get_running_loop()
        self._timers[handler] = loop.call_later(self.header_timeout_s, self._expire, handler, transport)

    def _expire(self, handler: Any, transport: asyncio.Transport) -> None:
        self._timers.pop(handler, None)
        self.refused["header_timeout"] += 1
        self._flood(f"no request within gate.header_timeout_s = {self.header_timeout_s:g} s")
        if not transport.is_closing():
            transport.write(_raw(408, "Request Timeout", f"no request within {self.header_timeout_s:g} s "
                                                         f"(gate.header_timeout_s)"))
            transport.close()

    def request_started(self, request: web.BaseRequest) -> None:
        timer = self._timers.pop(request.protocol, None)
        if timer is not None:
            timer.cancel()

    def request_done(self, request: web.BaseRequest) -> None:
        """Idle from now until the next request's headers: the same limit."""
        transport = request.transport
        if transport is not None and not transport.is_closing() and request.protocol not in self._timers:
            self._arm(request.protocol, transport)

    # -- Host ---------------------------------------------------------------------------
    def host_refused(self, request: web.BaseRequest) -> str | None:
        """Why a request's Host is refused, or None."""
        if not self.loopback_only:
            return None
        host = request.headers.get("Host", "")
        name = host.strip().lower()
        bare = name.rsplit(":", 1)[0] if name.count(":") == 1 else name
        if is_loopback_host(host) or name in self.allowed or bare in self.allowed:
            return None
        self.refused["host"] += 1
        self._flood("requests whose Host is not this machine's (DNS rebinding?)")
        return (f"the gate listens on loopback and serves only requests for it; Host {host[:100]!r} is another "
                f"name (a web page reaching it through DNS rebinding?). A proxy in front of the gate with its "
                f"own name: list it in gate.allowed_hosts")

    # -- floods -----------------------------------------------------------------------------
    def _flood(self, what: str) -> None:
        self._unsaid += 1
        now = time.monotonic()
        if now - self._said_at >= FLOOD_LOG_S:
            log.warning("gate: refused %d connection(s) or request(s) in the last %g s: %s (said once per %g s)",
                        self._unsaid, FLOOD_LOG_S if self._said_at else 0, what, FLOOD_LOG_S)
            self._said_at, self._unsaid = now, 0

    def describe(self) -> dict[str, Any]:
        return {"open_connections": self.open, "max_connections": self.max_connections,
                "refused": dict(self.refused)}
