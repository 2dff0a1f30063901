"""The control-socket protocol (DESIGN §5), shared by the daemon (control.py) and autosessctl.

One JSON object per line each way, UTF-8, at most MAX_REQUEST bytes per request line.

    → {"v": 1, "cmd": "status", "args": {}}
    ← {"ok": true, "result": ...}
    ← {"ok": false, "error": {"code": "...", "message": "..."}}

`events` with {"follow": true} answers {"ok": true, "result": {"following": true}} and
then one {"event": {...}} line per event until the client hangs up; a follower that
falls too far behind gets {"ok": false, "error": {"code": "overflow", ...}} and is closed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

VERSION = 1
MAX_REQUEST = 64 * 1024
IDLE_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 256


class Code:
    """Error codes; each says who should do what."""

    BAD_REQUEST = "bad_request"          # not a JSON object line, or missing/ill-typed fields
    TOO_LARGE = "too_large"              # request line over MAX_REQUEST
    UNKNOWN_COMMAND = "unknown_command"
    BAD_ARGS = "bad_args"                # an argument is missing, unknown or of the wrong type
    VERSION = "version_mismatch"         # the client speaks another protocol version
    FORBIDDEN = "forbidden"              # the peer's uid/gid may not use this socket
    BUSY = "busy"                        # too many connections
    TIMEOUT = "timeout"                  # connected and sent nothing in time
    NOT_FOUND = "not_found"              # no such session
    FAILED = "failed"                    # the action was tried and failed (message says why)
    OVERFLOW = "overflow"                # an event follower fell behind
    INTERNAL = "internal"


class ProtocolError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# command → {arg: (accepted types, required)}. Bools are never accepted as numbers.
COMMANDS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "status": {},
    "ls": {"model": ((str,), False)},
    # model: behind a llama-server router, the model whose slot it is (models.py)
    "park": {"name": ((str,), False), "slot": ((int,), False), "model": ((str,), False)},
    "restore": {"what": ((str,), True), "slot": ((int,), False), "model": ((str,), False)},
    # shared: prune the shared bucket (its own keep / max_gb), not the local directory
    "prune": {"dry_run": ((bool,), False), "keep": ((int,), False), "max_gb": ((int, float), False),
              "shared": ((bool,), False)},
    "forget": {"key": ((str,), True)},
    "turn": {"key": ((str,), False), "messages": ((list,), False), "slot": ((int,), False),
             "model": ((str,), False)},
    "events": {"follow": ((bool,), False), "limit": ((int,), False)},
    "doctor": {},
}


@dataclass(frozen=True)
class Request:
    cmd: str
    args: dict[str, Any]


def request(cmd: str, **args: Any) -> bytes:
    """A request line, as autosessctl sends it."""
    return encode({"v": VERSION, "cmd": cmd, "args": {k: v for k, v in args.items() if v is not None}})


def ok(result: Any) -> bytes:
    return encode({"ok": True, "result": result})


def err(code: str, message: str) -> bytes:
    return encode({"ok": False, "error": {"code": code, "message": message}})


def encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), default=str).encode() + b"\n"


def parse_request(line: bytes) -> Request:
    """A request line → Request, or ProtocolError saying what is wrong. Never anything else."""
    if len(line) > MAX_REQUEST:
        raise ProtocolError(Code.TOO_LARGE, f"request over {MAX_REQUEST} bytes")
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(Code.BAD_REQUEST, f"not JSON: {e}") from None
    except RecursionError:
        raise ProtocolError(Code.BAD_REQUEST, "not JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ProtocolError(Code.BAD_REQUEST, f"a request is a JSON object, got {type(obj).__name__}")
    v = obj.get("v", VERSION)
    if v != VERSION or isinstance(v, bool):
        raise ProtocolError(Code.VERSION, f"protocol version {v!r} is not supported (this daemon speaks {VERSION})")
    cmd = obj.get("cmd")
    if not isinstance(cmd, str):
        raise ProtocolError(Code.BAD_REQUEST, "missing \"cmd\" (a string)")
    if cmd not in COMMANDS:
        raise ProtocolError(Code.UNKNOWN_COMMAND, f"unknown command {cmd[:64]!r} (known: {', '.join(COMMANDS)})")
    args = obj.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError(Code.BAD_ARGS, f"\"args\" must be an object, got {type(args).__name__}")
    spec = COMMANDS[cmd]
    for name, value in args.items():
        if name not in spec:
            raise ProtocolError(Code.BAD_ARGS, f"{cmd}: unknown argument {name[:64]!r}")
        types, _ = spec[name]
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            want = " or ".join(t.__name__ for t in types)
            raise ProtocolError(Code.BAD_ARGS, f"{cmd}: {name} must be {want}, got {type(value).__name__}")
    for name, (_, required) in spec.items():
        if required and name not in args:
            raise ProtocolError(Code.BAD_ARGS, f"{cmd}: missing argument {name!r}")
    return Request(cmd, args)


def parse_reply(line: bytes) -> dict[str, Any]:
    """A reply line → dict with "ok"; ProtocolError when the daemon's answer is malformed."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError(Code.BAD_REQUEST, f"the daemon answered something that is not JSON: {line[:200]!r}") \
            from None
    if not isinstance(obj, dict) or ("ok" not in obj and "event" not in obj):
        raise ProtocolError(Code.BAD_REQUEST, f"the daemon answered an unexpected object: {line[:200]!r}")
    return obj
