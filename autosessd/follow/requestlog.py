"""The JSONL request log (DESIGN §2): its line format, the writer (the gate) and the parser
(the tail), in one place so the two sides cannot drift apart.

    {"ts": 1764460000.12, "event": "start", "id": "r17", "slot": 0, "key": "<16 hex>"}
    {"ts": …, "event": "end", "id": "r17", "slot": 0, "n_tokens": 27174, "status": "ok"}
    (optional on an end: "cache_n", the response's timings.cache_n; "n_prompt", its
    usage.prompt_tokens)

A start may carry `messages` instead of `key` (the key is derived from them); status is
ok|error|cancelled; unknown fields are ignored.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.keys import is_key, messages_key

log = logging.getLogger("autosessd")


class RequestLogError(Exception):
    """The request log cannot be written (at start): the message names the key and the path."""


class RequestLog:
    """The gate's JSONL request log (DESIGN §2), for a tail elsewhere. Rotation by rename
    (logrotate without copytruncate) is noticed at the next line: the file is reopened."""

    def __init__(self, path: str):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = self._open()
        except OSError as e:
            raise RequestLogError(f"gate.request_log {path}: cannot open it for writing: "
                                  f"{e.strerror or e}") from None

    def _open(self) -> Any:
        return open(self.path, "a", buffering=1, encoding="utf-8")

    def write(self, **fields: Any) -> None:
        try:
            try:
                rotated = os.stat(self.path).st_ino != os.fstat(self._f.fileno()).st_ino
            except FileNotFoundError:
                rotated = True
            if rotated:
                self._f.close()
                self._f = self._open()
            self._f.write(json.dumps({"ts": round(time.time(), 3), **fields}) + "\n")
        except OSError as e:
            log.warning("gate: cannot write the request log %s: %s", self.path, e)

    def close(self) -> None:
        self._f.close()


class BadLine(ValueError):
    pass


@dataclass(frozen=True)
class LogEvent:
    event: str  # "start" | "end"
    id: str
    slot: int
    key: str | None = None
    n_tokens: int | None = None
    status: str | None = None
    cache_n: int | None = None  # end: the response's timings.cache_n, which verifies a restore
    # end: the response's usage.prompt_tokens: how much of n_tokens was the prompt, the rest the
    # reply. A file saved behind then knows its reply, and a request that sends that reply back
    # as other tokens (text re-tokenized) replaces the file instead of branching off it.
    n_prompt: int | None = None


def parse_line(line: bytes) -> LogEvent:
    """One request-log line → LogEvent, or BadLine saying why. Never anything else."""
    try:
        d = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadLine("not UTF-8") from None
    except (ValueError, RecursionError):
        raise BadLine("not JSON") from None
    if not isinstance(d, dict):
        raise BadLine("not a JSON object")
    event = d.get("event")
    if event not in ("start", "end"):
        raise BadLine(f"event must be start or end, got {str(event)[:32]!r}")
    rid = d.get("id")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise BadLine("missing id")
    slot = d.get("slot", 0)
    if not isinstance(slot, int) or isinstance(slot, bool) or slot < 0:
        raise BadLine("slot must be a whole number ≥ 0")
    if event == "start":
        if "key" in d:
            key = d["key"]
            if not is_key(key):
                raise BadLine("key is not 16 hex digits")
        elif "messages" in d:
            key = messages_key(d["messages"])
        else:
            key = None  # a request with no conversation: still a request on the slot
        return LogEvent("start", str(rid), slot, key=key)
    n = d.get("n_tokens")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise BadLine("n_tokens must be a whole number ≥ 0")
    status = d.get("status", "ok")
    if status not in ("ok", "error", "cancelled"):
        raise BadLine(f"status must be ok, error or cancelled, got {str(status)[:32]!r}")
    cache_n, n_prompt = d.get("cache_n"), d.get("n_prompt")
    for name, v in (("cache_n", cache_n), ("n_prompt", n_prompt)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise BadLine(f"{name} must be a whole number ≥ 0")
    if n_prompt is not None and n is not None and n_prompt > n:
        n_prompt = None  # the engine cut the context (a shift, a truncation): not the state's prompt
    return LogEvent("end", str(rid), slot, n_tokens=n, status=status, cache_n=cache_n, n_prompt=n_prompt)
