"""The control stream (DESIGN §3): a line protocol for engines other than llama-server.

    → SAVE /abs/path/to/file        ← OK {"n_tokens": N, "n_bytes": B, "ms": T}
    → RESTORE /abs/path/to/file     ← OK {"n_tokens": N, "n_bytes": B, "ms": T}
    → STATUS                        ← OK {"model": "...", "healthy": true,
                                          "slots": [{"id": 0, "is_processing": false, "n_tokens": N}]}
    any command                     ← ERR <message>

One command per connection, one reply line per command. The engine has one
conversation state, so SAVE and RESTORE carry no slot. llama-server's field names
(n_saved/n_written/timings.save_ms, n_restored/n_read/timings.restore_ms) are
accepted too.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from ..base.config import parse_address
from .base import (EngineBadAnswer, EngineInfo, EngineRefused, EngineTimeout, EngineUnreachable, RestoreResult,
                   SaveResult, SlotState)

MAX_REPLY = 1 << 20


class ControlStream:
    kind = "control-stream"
    magic = None

    def __init__(self, address: str, directory: str, timeout_s: float = 120.0):
        self.address = address
        self._family, self._target = parse_address(address)
        self.directory = directory
        self.timeout_s = timeout_s

    async def close(self) -> None:
        pass

    async def _command(self, line: str, timeout_s: float | None = None) -> dict[str, Any]:
        if "\n" in line or "\r" in line:
            raise EngineRefused(f"refusing to send a command with a line break: {line!r:.100}")
        timeout = timeout_s or self.timeout_s
        async def exchange() -> bytes:
            if self._family == "unix":
                reader, writer = await asyncio.open_unix_connection(self._target, limit=MAX_REPLY)
            else:
                reader, writer = await asyncio.open_connection(*self._target, limit=MAX_REPLY)
            try:
                writer.write(line.encode() + b"\n")
                await writer.drain()
                return await reader.readline()
            finally:
                writer.close()

        try:
            reply = await asyncio.wait_for(exchange(), timeout)
        except asyncio.TimeoutError:
            raise EngineTimeout(f"the engine at {self.address} did not answer {line.split()[0]} "
                                f"within {timeout:g} s") from None
        except ValueError as e:  # a reply line over MAX_REPLY
            raise EngineBadAnswer(f"bad reply from {self.address}: {e}") from None
        except OSError as e:
            raise EngineUnreachable(f"cannot reach the engine at {self.address}: {e.strerror or e}") from None
        if not reply.endswith(b"\n"):
            raise EngineBadAnswer(f"the engine at {self.address} closed the stream without a reply line")
        text = reply.decode("utf-8", "replace").rstrip("\r\n")
        if text.startswith("ERR"):
            raise EngineRefused(f"{line.split()[0]} answered: {text[3:].strip() or '(no message)'}")
        if not text.startswith("OK"):
            raise EngineBadAnswer(f"reply is neither OK nor ERR: {text[:200]!r}")
        body = text[2:].strip() or "{}"
        try:
            data = json.loads(body)
        except ValueError:
            raise EngineBadAnswer(f"OK reply carries no JSON object: {body[:200]!r}") from None
        if not isinstance(data, dict):
            raise EngineBadAnswer(f"OK reply carries {type(data).__name__}, not an object")
        return data

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    async def save(self, slot: int, name: str) -> SaveResult:
        d = await self._command(f"SAVE {self._path(name)}")
        try:
            return SaveResult(n_tokens=int(d.get("n_tokens", d.get("n_saved"))),
                              n_bytes=int(d.get("n_bytes", d.get("n_written"))),
                              ms=float(d.get("ms", (d.get("timings") or {}).get("save_ms", 0.0))))
        except (TypeError, ValueError):
            raise EngineBadAnswer(f"SAVE answered without n_tokens/n_bytes: {d!r:.200}") from None

    async def restore(self, slot: int, name: str) -> RestoreResult:
        d = await self._command(f"RESTORE {self._path(name)}")
        try:
            return RestoreResult(n_tokens=int(d.get("n_tokens", d.get("n_restored"))),
                                 n_bytes=int(d.get("n_bytes", d.get("n_read"))),
                                 ms=float(d.get("ms", (d.get("timings") or {}).get("restore_ms", 0.0))))
        except (TypeError, ValueError):
            raise EngineBadAnswer(f"RESTORE answered without n_tokens/n_bytes: {d!r:.200}") from None

    async def erase(self, slot: int) -> int:
        raise EngineRefused("the control stream has no command to empty a slot")

    async def slots(self) -> list[SlotState]:
        d = await self._command("STATUS")
        try:
            return [SlotState(id=int(s.get("id", 0)), is_processing=bool(s.get("is_processing")),
                              n_tokens=int(s.get("n_tokens") or 0)) for s in d.get("slots") or []]
        except (TypeError, ValueError, AttributeError):
            raise EngineBadAnswer(f"STATUS answered malformed slots: {d!r:.200}") from None

    async def health(self) -> bool:
        d = await self._command("STATUS", timeout_s=min(self.timeout_s, 5.0))
        return bool(d.get("healthy", True))

    async def info(self) -> EngineInfo:
        d = await self._command("STATUS")
        model = str(d.get("model") or "unknown")
        return EngineInfo(model=model, model_name=model, total_slots=max(1, len(d.get("slots") or [0])))
