"""The daemon's log: records go to stderr through a thread of its own, and a turn's lines
are built a moment after it.

A write to stderr can stall for milliseconds (a file while the kernel writes back a big
save's dirty pages: 7 ms for one line in the bench's 21k switch, on the request's path),
so records are handed to a writer thread (the logging cookbook's "Dealing with handlers
that block") and the event loop never waits for it. The hand-off holds at most QUEUE_MAX
records: past that, while stderr stays blocked (a pipe nobody reads, a stalled journal), a
line is dropped and counted rather than kept in memory without end, and how many were lost
is said in their place once lines fit again (or at the stop).

Building a record costs too: ~0.2 ms for one line on a CPU that has just woken from the
engine's restore (the bench's VM; 5 us hot), more than any other step of the turn that
switches back. A turn logs its save and its restore with `soon`: the record is built
LATER_S after the call, when the request is on its way to the engine, with the time of the
call. Order is kept: a record logged meanwhile through the daemon's handler (autosessd's
loggers, aiohttp's warnings), on any thread, first writes what waits; the stop writes it
too. Without setup_logging (a test's own handlers), `soon` logs at once. (report.Events
defers a turn's events the same way; its readers, not a log handler, publish what waits.)
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import json
import logging
import logging.handlers
import queue
import sys
import threading
import time
from typing import Any

LATER_S = 0.001  # a turn's lines are built this long after it, once its request is on its way
QUEUE_MAX = 10_000  # records waiting for a blocked stderr (~1 KB each); more are dropped and counted


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        d = {"ts": round(record.created, 3), "level": record.levelname.lower(), "msg": record.getMessage()}
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d)


class _Writer(logging.handlers.QueueListener):
    """The thread that writes the log. Its stop waits a bounded time for what is queued: a
    stderr that blocks (a full pipe, a stalled journal) must not hold up the exit."""

    def stop(self, timeout_s: float = 2.0) -> None:
        if self._thread is not None:  # QueueListener's own thread attribute
            self.enqueue_sentinel()
            self._thread.join(timeout_s)
            self._thread = None


class _Handoff(logging.handlers.QueueHandler):
    """Hands each record to the writer thread as it is: its message merged now (its
    arguments may change once handed over), formatted there by the stream's own formatter
    (QueueHandler.prepare would format it here, once more). What `soon` holds goes first."""

    def handle(self, record: logging.LogRecord) -> bool:
        if _later or _flushing.locked():  # locked: another thread writes what waits; after it
            flush(timeout_s=2.0)
        return super().handle(record)

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record.msg, record.args = record.getMessage(), None
        return record

    def enqueue(self, record: logging.LogRecord | None) -> None:
        """At most QUEUE_MAX waiting (the module docstring); the first line with room again is
        preceded by how many were dropped, in their place. None: only that, if any (the stop)."""
        global _dropped
        with _dropped_lock:  # the check and the puts under one lock: two threads never both see room
            room = QUEUE_MAX - self.queue.qsize()
            # A line after drops needs room for two: the notice goes in its place first.
            if record is not None and (room <= 0 or (_dropped and room < 2)):
                _dropped += 1
                return
            n, _dropped = _dropped, 0
            if n:
                self.queue.put_nowait(logging.makeLogRecord({
                    "name": "autosessd", "levelno": logging.WARNING, "levelname": "WARNING",
                    "created": record.created if record is not None else time.time(),
                    "msg": f"log: {n:,} line(s) dropped here while stderr was blocked"}))
            if record is not None:
                self.queue.put_nowait(record)


_writer: _Writer | None = None
# What `soon` holds: (logger, level, msg, args, time said), in order.
_later: collections.deque[tuple[logging.Logger, int, str, tuple[Any, ...], float]] = collections.deque()
_flushing = threading.Lock()  # one writer of what waits at a time: it keeps its order
_here = threading.local()  # .busy: this thread writes what waits (its records pass _Handoff.handle)
_timer: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None
_dropped = 0  # records not queued since the queue was last below QUEUE_MAX
_dropped_lock = threading.Lock()


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """The daemon's log on stderr, written by a thread of its own (the module docstring)."""
    global _writer, _dropped
    # What no line of ours shows, not gathered for every record (the logging HOWTO's
    # "Optimization"): a turn logs on the request's path, and each costs a quarter less.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None  # no caller's file and line: no stack walk per record
    stream = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        stream.setFormatter(JsonFormatter())
    else:
        stream.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%dT%H:%M:%S"))
    stop_logging()
    _dropped = 0  # a count from an earlier setup is not this log's
    q: queue.SimpleQueue = queue.SimpleQueue()
    _writer = _Writer(q, stream)
    _writer.start()
    atexit.unregister(stop_logging)  # once, whatever the number of setups
    atexit.register(stop_logging)
    handler = _Handoff(q)
    root = logging.getLogger("autosessd")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    # aiohttp reports connection trouble on its own loggers: same handler, warnings and up.
    aio = logging.getLogger("aiohttp")
    aio.handlers[:] = [handler]
    aio.setLevel(logging.WARNING)
    aio.propagate = False


def stop_logging() -> None:
    """Write what waits and what the log's queue holds, and stop its writer (before the
    process leaves)."""
    global _writer
    flush(timeout_s=2.0)  # as bounded as the writer's stop: a flusher may be stuck on stderr
    if _writer is not None:
        for h in logging.getLogger("autosessd").handlers:
            if isinstance(h, _Handoff):
                h.enqueue(None)  # lines dropped since the last one written: said before the exit
        writer, _writer = _writer, None
        writer.stop()


def soon(logger: logging.Logger, level: int, msg: str, *args: Any) -> None:
    """logger.log(level, msg, *args), its record built LATER_S from now on the running event
    loop, in order with every other record (the module docstring). args: values that do not
    change (the message is merged when the record is built)."""
    global _timer
    if _writer is None:
        logger.log(level, msg, *args, stacklevel=2)
        return
    if not logger.isEnabledFor(level):
        return
    _later.append((logger, level, msg, args, time.time()))
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        flush()
        return
    if _timer is None or _timer[0] is not loop:  # none set, or one on a loop that has ended
        _timer = (loop, loop.call_later(LATER_S, _timed))


def _timed() -> None:
    global _timer
    _timer = None
    flush()


def flush(timeout_s: float | None = None) -> None:
    """Log what `soon` holds, in order, each with the time it was said. A record stays first
    in line until it is handed on: a thread that logs meanwhile waits for it (_Handoff)."""
    global _timer
    if getattr(_here, "busy", False):
        return  # a record of what waits, passing _Handoff.handle: the loop below writes the rest
    if not _flushing.acquire(timeout=-1 if timeout_s is None else timeout_s):
        return
    _here.busy = True
    try:
        while _later:
            logger, level, msg, args, said = _later[0]
            try:
                record = logger.makeRecord(logger.name, level, "(unknown file)", 0, msg, args, None,
                                           "(unknown function)")
                record.created = said
                record.msecs = int((said - int(said)) * 1000) + 0.0
                record.relativeCreated = (said - logging._startTime) * 1000
                logger.handle(record)
            finally:
                _later.popleft()
    finally:
        _here.busy = False
        _flushing.release()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        return
    if _timer is not None and _timer[0] is running:  # what waits is written: the next line waits LATER_S
        _timer[1].cancel()
        _timer = None
