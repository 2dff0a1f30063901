"""GET /health through the gate: can this host serve? A load balancer's health check (docs/several-hosts.md).

200 only when the engine answers its own /health with 200 and this autosessd is serving (its
start done, no stop begun); else 503 with a JSON reason. The engine's own answers pass as it
sent them (200 {"status":"ok"}, 503 "Loading model"), so a client of llama-server's /health
sees what it saw before; the gate adds 503s of its own (starting, stopping, the engine not
answering), never a 502: a health check asks whether to send requests here, and the answer is
no. Every answer names the host (X-Autosessd-Host), so a front door's operator can tell which
host a check reached.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from ..engines.upstream import Upstream, forward_headers, gate_error

TIMEOUT_S = 5.0  # the engine's /health answers at once; a load balancer's check gives up sooner still
# Hop-by-hop or body framing headers of the engine's answer that aiohttp sets again itself.
_REFRAMED = ("content-length", "content-encoding", "transfer-encoding")


async def answer(request: web.Request, pool: Upstream, upstream: str, not_ready: str | None,
                 host: str) -> web.Response:
    """The answer to a client's GET /health (not_ready: why autosessd is not serving, or None)."""
    if not_ready is not None:
        err = gate_error(503, f"not serving: {not_ready}")
    else:
        try:
            async with await pool.send("GET", request.rel_url.path_qs, headers=forward_headers(request.headers),
                                       timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as up:
                body = await up.read()
                headers = {k: v for k, v in forward_headers(up.headers).items() if k.lower() not in _REFRAMED}
                headers["X-Autosessd-Host"] = host
                return web.Response(status=up.status, body=body, headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            what = f"no answer within {TIMEOUT_S:g} s" if isinstance(e, asyncio.TimeoutError) else \
                str(e) or type(e).__name__
            err = gate_error(503, f"the engine at {upstream} does not answer /health: {what}")
    err.headers["X-Autosessd-Host"] = host
    return err
