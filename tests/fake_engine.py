"""A fake engine for what the real one cannot be made to do on cue.

It speaks enough of llama-server's HTTP API (health, props, models, slots, save/restore,
chat completions) and the control stream (SAVE/RESTORE/STATUS) to be driven by
autosessd, and misbehaves when asked to:

    --fault hang-save       save requests never answer
    --fault 500-save        save answers 500
    --fault bad-json-save   save answers 200 with a body that is not JSON
    --fault short-save      save writes fewer bytes than it reports
    --fault die-save        the process exits in the middle of writing a save
    --fault hang-restore / 500-restore / die-restore   the same for restore
    --fault slow-save=SECONDS   write the file slowly (for crash tests)
    --fault ignore-sigterm  SIGTERM does nothing (only SIGKILL stops it)
    --fault eof-s=SECONDS   a streamed chat's response ends that long after its [DONE]

A chat answer echoes the request (answer_for): a digest of its messages and the start of
its last user message. Faults apply to session files, not to autosessd's start probe. State
files have llama-server's header (autosessd/store/slotfile.py: magic "qsgg", the token list), then
the prompt text (its "KV state"), padded to --bytes-per-token per token. Saves write and
restores read every byte, in 8 MiB chunks, and report the time they took (as the engine's
save_ms / restore_ms): with a real model's size per token (an 8B model: 131072) the files are
gigabytes, moved at this disk's speed (bench/run.py scenario 11). Unlike llama-server, the
fake serves a chat while a slot action on the same slot is still running (the real engine
runs a slot's actions and requests in order).

    python tests/fake_engine.py --port P --dir D [--control unix:/path] [--fault F]

It also takes llama-server's own words for these (`--host H --port P --slot-save-path D`), so
autosessd can run it as its child (`autosessd run --exec -- python fake_engine.py ...`).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time

from aiohttp import web

from autosessd.store import slotfile

CHUNK = 8 << 20  # bytes a save writes, or a restore reads, at a time
FILL = b"\x01" * CHUNK


def answer_for(body: dict) -> str:
    """The fake's answer to a chat request: it depends on the request's messages (the
    conversation), so a test comparing answers sees whether the same conversation reached the
    engine. llama-server's answer depends on them too (and on sampling, fixed in tests)."""
    messages = body.get("messages") or body.get("input")
    digest = hashlib.sha1(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:12]
    last = ""
    for m in messages if isinstance(messages, list) else []:
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
            last = m["content"]
    return f"echo {digest}: {last[:40]}"


class Fake:
    def __init__(self, directory: str, faults: list[str], model: str, bytes_per_token: int):
        self.dir = directory
        self.faults = set(f.split("=")[0] for f in faults)
        self.params = {f.split("=")[0]: f.split("=", 1)[1] for f in faults if "=" in f}
        self.model = model
        self.bytes_per_token = bytes_per_token
        self.tokens = 0  # tokens held by slot 0
        self.processing = False
        self.requests = 0
        self.last_prompt = ""
        self.task_id: int | None = None  # GET /slots id_task: the last request that ran

    def fault(self, name: str, filename: str) -> bool:
        return name in self.faults and "probe" not in filename

    # -- state files ------------------------------------------------------------
    async def save(self, path: str) -> dict:
        name = os.path.basename(path)
        if self.fault("hang-save", name):
            await asyncio.sleep(3600)
        if self.fault("500-save", name):
            raise web.HTTPInternalServerError(text=json.dumps({"error": {"message": "boom", "code": 500}}),
                                              content_type="application/json")
        prompt = self.last_prompt.encode()
        # The header in llama-server's layout (slotfile.py), its token ids standing for the
        # prompt's bytes; the "KV state" after it carries the prompt text for a restore.
        ids = list(prompt[: self.tokens]) + [0] * max(0, self.tokens - len(prompt))
        head = slotfile.build(ids, len(prompt).to_bytes(4, "little") + prompt)
        n_bytes = max(len(head), len(head) + self.tokens * self.bytes_per_token)
        t0 = time.monotonic()
        slow = float(self.params.get("slow-save", 0)) if "probe" not in name else 0
        with open(path, "wb") as f:
            f.write(head)
            body = n_bytes - len(head)
            die = self.fault("die-save", name)
            chunks = 20 if slow else (2 if die else 1)
            for i in range(chunks):
                part = body // chunks + (body % chunks if i == chunks - 1 else 0)
                while part > 0:  # never the whole state in memory at once
                    n = min(part, CHUNK)
                    f.write(FILL[:n])
                    part -= n
                f.flush()
                if die and i >= chunks // 2 - 1:
                    os._exit(9)  # half a file on disk, no answer
                if slow:
                    await asyncio.sleep(slow / chunks)
        reported = n_bytes + 100 if self.fault("short-save", name) else n_bytes
        return {"n_saved": self.tokens, "n_written": reported,
                "timings": {"save_ms": (time.monotonic() - t0) * 1000}}

    async def restore(self, path: str) -> dict:
        name = os.path.basename(path)
        if self.fault("hang-restore", name):
            await asyncio.sleep(3600)
        if self.fault("500-restore", name):
            raise web.HTTPInternalServerError(text='{"error": {"message": "boom"}}', content_type="application/json")
        if self.fault("die-restore", name):
            os._exit(9)
        t0 = time.monotonic()
        try:
            header = slotfile.read_header(path)
            with open(path, "rb") as f:
                f.seek(12 + 4 * (header.n_tokens + 4))
                prompt = f.read(int.from_bytes(f.read(4), "little")).decode(errors="replace")
                buf = bytearray(CHUNK)
                while f.readinto(buf):  # the rest of the "KV state", read as the engine reads it
                    pass
        except FileNotFoundError:
            self.tokens = 0
            raise web.HTTPBadRequest(text='{"error": {"message": "failed to open file"}}',
                                     content_type="application/json") from None
        except slotfile.BadSlotFile:
            self.tokens = 0
            raise web.HTTPBadRequest(text='{"error": {"message": "invalid slot save file"}}',
                                     content_type="application/json") from None
        self.tokens = header.n_tokens
        self.last_prompt = prompt
        return {"n_restored": self.tokens, "n_read": os.path.getsize(path),
                "timings": {"restore_ms": (time.monotonic() - t0) * 1000}}

    # -- HTTP -------------------------------------------------------------------
    async def slots_post(self, request: web.Request) -> web.Response:
        body = await request.json()
        path = os.path.join(self.dir, body["filename"])
        action = request.query.get("action")
        d = await (self.save(path) if action == "save" else self.restore(path))
        if action == "save" and self.fault("bad-json-save", body["filename"]):
            return web.Response(text="<html>not json", content_type="text/html")
        return web.json_response({"id_slot": 0, "filename": body["filename"], **d})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        self.requests += 1
        body = await request.json()
        text = json.dumps(body.get("messages") or body.get("input"))
        n_prompt = max(1, len(text) // 4)
        cached = n_prompt - 1 if self.last_prompt and text.startswith(self.last_prompt[: len(text)]) \
            and self.tokens >= n_prompt - 1 else 0
        self.task_id = (self.task_id or 0) + 1
        self.processing = True
        try:
            await asyncio.sleep(float(self.params.get("gen-s", 0.01)))
        finally:
            self.processing = False
        self.tokens = n_prompt + 4
        self.last_prompt = text
        # Its own time on the request (llama-server reports prompt_ms + predicted_ms; under a
        # name of its own here, so that nothing takes it for a prompt rate).
        usage = {"prompt_tokens": n_prompt, "completion_tokens": 5, "total_tokens": n_prompt + 5}
        timings = {"prompt_n": n_prompt - cached, "cache_n": cached, "predicted_n": 5,
                   "fake_ms": (time.monotonic() - t0) * 1000}
        if body.get("stream"):
            # As llama-server streams: the content, a last chunk with the finish reason, usage and
            # timings, then [DONE]. eof-s: the end of the response comes that much later (what a
            # client that closes at [DONE] races against).
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(("data: " + json.dumps({"choices": [{"index": 0, "delta": {
                "content": answer_for(body)}, "finish_reason": None}]}) + "\n\n").encode())
            await resp.write(("data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                                                     "usage": usage, "timings": timings}) + "\n\n").encode())
            await resp.write(b"data: [DONE]\n\n")
            await asyncio.sleep(float(self.params.get("eof-s", 0)))
            return resp
        return web.json_response({
            "choices": [{"message": {"role": "assistant", "content": answer_for(body)}}],
            "usage": usage, "timings": timings,
        })

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """SSE chunks stamped with their send time (bench: the delay a proxy adds per chunk)."""
        n = int(request.query.get("n", "50"))
        interval = float(request.query.get("interval_ms", "10")) / 1000
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await resp.write(f"data: {json.dumps({'i': i, 'sent': time.time()})}\n\n".encode())
            await asyncio.sleep(interval)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/bench/stream", self.stream)
        app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
        app.router.add_get("/props", lambda r: web.json_response(
            {"total_slots": 1, "model_path": f"/models/{self.model}.gguf"}))
        app.router.add_get("/v1/models", lambda r: web.json_response(
            {"data": [{"id": self.model, "meta": {"size": 1, "n_params": 2, "n_vocab": 3}}]}))
        app.router.add_get("/slots", lambda r: web.json_response(
            [{"id": 0, "is_processing": self.processing, "n_prompt_tokens": self.tokens, "id_task": self.task_id}]))
        app.router.add_post("/slots/{id}", self.slots_post)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    # -- control stream -----------------------------------------------------------
    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = (await reader.readline()).decode().rstrip("\n")
        cmd, _, arg = line.partition(" ")
        try:
            if cmd == "SAVE":
                d = await self.save(arg)
                reply = {"n_tokens": d["n_saved"], "n_bytes": d["n_written"], "ms": d["timings"]["save_ms"]}
            elif cmd == "RESTORE":
                d = await self.restore(arg)
                reply = {"n_tokens": d["n_restored"], "n_bytes": d["n_read"], "ms": 1.0}
            elif cmd == "STATUS":
                reply = {"model": self.model, "healthy": True,
                         "slots": [{"id": 0, "is_processing": self.processing, "n_tokens": self.tokens}]}
            else:
                writer.write(f"ERR unknown command {cmd!r}\n".encode())
                await writer.drain()
                writer.close()
                return
            writer.write(b"OK " + json.dumps(reply).encode() + b"\n")
        except web.HTTPException as e:
            writer.write(f"ERR {e.text}\n".encode())
        await writer.drain()
        writer.close()


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dir", "--slot-save-path", dest="dir", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--control")
    p.add_argument("--fault", action="append", default=[])
    p.add_argument("--model", default="fake-model")
    p.add_argument("--bytes-per-token", type=int, default=1000)
    a = p.parse_args()
    fake = Fake(a.dir, a.fault, a.model, a.bytes_per_token)
    if "ignore-sigterm" in fake.faults:
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    runner = web.AppRunner(fake.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, a.host, a.port).start()
    if a.control:
        await asyncio.start_unix_server(fake.control, a.control.removeprefix("unix:"))
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
