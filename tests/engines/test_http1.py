"""The adapter's lean HTTP/1.1 client (engines/http1.py) against a raw server that answers
the ways servers do: a length, chunks, a close; a kept-alive connection it closed meanwhile;
an answer cut short; one that never comes."""

import asyncio

import pytest

from autosessd.engines import http1
from autosessd.engines.base import EngineTimeout, EngineUnreachable
from autosessd.engines.llama_server import LlamaServer
from harness import free_port


async def serve(answers):
    """A server answering each request with the next of `answers` (raw bytes after the
    request was read; None: close the connection without a word). Returns (url, connections)."""
    conns = []
    queue = list(answers)

    async def handle(reader, writer):
        conns.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")), 0)
                await reader.readexactly(n)
                answer = queue.pop(0)
                if answer is None:
                    writer.close()
                    return
                if answer == "hang":
                    await asyncio.sleep(30)
                    return
                writer.write(answer)
                await writer.drain()
                if b"Connection: close" in answer:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    port = free_port()
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    return server, f"http://127.0.0.1:{port}", conns


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


async def test_lengths_chunks_and_a_close_are_read_and_a_kept_alive_connection_is_reused():
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n"
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{\"c\": 3}"
    server, url, conns = await serve([ok(b'{"x": 1}'), chunked, ok(b'{"y": 2}'), closing, ok(b"[]")])
    c = http1.Client(url)
    try:
        assert await c.request("GET", "/slots", None, {}, 5) == (200, b'{"x": 1}')
        assert await c.request("POST", "/t", b"{}", {}, 5) == (200, b'{"a": 1}')
        assert await c.request("GET", "/slots", None, {}, 5) == (200, b'{"y": 2}')
        assert len(conns) == 1  # one connection, kept alive
        assert await c.request("GET", "/x", None, {}, 5) == (200, b'{"c": 3}')
        assert await c.request("GET", "/slots", None, {}, 5) == (200, b"[]")
        assert len(conns) == 2  # the server closed the first: a new one
    finally:
        await c.close()
        server.close()


async def test_a_kept_alive_connection_the_server_closed_is_retried_once_on_a_new_one():
    server, url, conns = await serve([ok(b"1"), None, ok(b"2")])
    c = http1.Client(url)
    try:
        assert await c.request("GET", "/a", None, {}, 5) == (200, b"1")
        assert await c.request("GET", "/a", None, {}, 5) == (200, b"2")  # the server closed at the 2nd
        assert len(conns) == 2
    finally:
        await c.close()
        server.close()


async def test_an_answer_cut_short_a_silence_and_no_server_are_the_engines_errors():
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial"
    server, url, conns = await serve([cut + b"", "hang"])
    engine = LlamaServer(url, timeout_s=0.5)
    try:
        writer_closer = asyncio.get_running_loop().call_later(0.2, lambda: conns and conns[0].close())
        with pytest.raises(EngineUnreachable, match="lost the connection"):
            await engine.slots()
        writer_closer.cancel()
        with pytest.raises(EngineTimeout):
            await engine.slots()
    finally:
        await engine.close()
        server.close()
    nobody = LlamaServer(f"http://127.0.0.1:{free_port()}", timeout_s=2)
    with pytest.raises(EngineUnreachable, match="cannot reach"):
        await nobody.slots()
    await nobody.close()


async def test_a_refusal_is_read_as_the_aiohttp_path_reads_it():
    body = b'{"error": {"code": 400, "message": "failed to open file", "type": "invalid_request_error"}}'
    refusal = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    server, url, _ = await serve([refusal])
    engine = LlamaServer(url, timeout_s=5)
    try:
        from autosessd.engines.base import EngineRefused
        with pytest.raises(EngineRefused, match="failed to open file"):
            await engine.restore(0, "auto-x.bin")
    finally:
        await engine.close()
        server.close()


async def test_after_a_restart_every_kept_connection_is_dropped_and_a_204_has_no_body():
    """Two kept-alive connections, both dead after the engine restarted: the retry goes on a
    new connection, not on the second dead one. A 204 carries no body whatever it says."""
    no_content = b"HTTP/1.1 204 No Content\r\n\r\n"
    server, url, conns = await serve([ok(b"1"), ok(b"2"), None, ok(b"3"), no_content, ok(b"4")])
    c = http1.Client(url)
    try:
        first = asyncio.ensure_future(c.request("GET", "/a", None, {}, 5))
        second = asyncio.ensure_future(c.request("GET", "/a", None, {}, 5))
        assert sorted([(await first)[1], (await second)[1]]) == [b"1", b"2"]
        assert len(c._idle) == 2
        assert await c.request("GET", "/a", None, {}, 5) == (200, b"3")  # the server closed one: a new one
        assert len(conns) == 3
        assert await c.request("GET", "/b", None, {}, 5) == (204, b"")
        assert await c.request("GET", "/a", None, {}, 5) == (200, b"4")  # kept alive after the 204
    finally:
        await c.close()
        server.close()
