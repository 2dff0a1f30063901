"""The request-log tail (DESIGN §2): learn what the engine ran from a serving layer's JSONL log.

Following the file is follower.py's (the offset kept across restarts, rotation, truncation, a
log written again from its start). The class Following, which the engine-log tail
(enginetail.py) shares, watches the file and acts on its lines; Tail below is the request
log's meaning of a line.

What a line means for the slot is decided by Sessions, in the tail's own protocol (no
ticket, no launch hold): a `start` is observed_start (the engine switches now, whatever we
do), an `end` is observed_end, a compare-and-swap that settles the slot only while it runs
that request (its n_tokens and cache_n, or the engine's GET /slots when the line is the
newest one read); it never saves: the save behind below does, holding the slot's ticket. A start whose end never
comes expires after IN_FLIGHT_TTL_S once the engine's slot is idle (at most
MAX_IN_FLIGHT are kept), counted in status as in_flight_expired.

What the tail does with the lines — save behind, never across: a logged request has
already reached the engine, so the held conversation cannot be saved before the switch.
Instead, after `end` of K (status ok) with nothing else in flight, once the engine's slot
is idle, K is saved if its file is stale. llama-server defers a slot action on a busy
slot, so a save issued just as a new request arrives would capture that request's state
under K's name: the save goes to a temporary, and it is kept only if no other request
started meanwhile (per the log) and the slot still holds what it held before the save.
After an engine restart, the conversation held before it is restored once the engine is
idle and no request is in flight, and trusted by the same check: a request that started
meanwhile may have run before the (deferred) restore, which then replaced its state.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import time
from pathlib import Path
from typing import Any

from ..engines.base import SlotState
from ..sessions.facade import Sessions
from .follower import MAX_LINE, POLL_S, Follower
from .requestlog import BadLine, LogEvent, parse_line

log = logging.getLogger("autosessd")

MAX_IN_FLIGHT = 1024  # starts without an end kept at most (the oldest expires first)
IN_FLIGHT_TTL_S = 600.0  # a start older than this, with the engine's slot idle, has lost its end
BAD_LINE_LOG_EVERY_S = 10.0


class Following:
    """What both tails share (this one and the engine's own log, enginetail.py): following one
    file (the watch, the poll, batches of complete lines, their offset recorded after each
    batch), bad lines counted and logged once per burst, and one save-behind task per slot
    (an end that arrives while it runs asks for another pass). A subclass says what a line
    means (handle), what runs between batches (tick) and what a save behind does (_save_behind)."""

    name = "tail"
    what = "tail"  # in messages
    bad_counter = "bad_log_lines"  # the Counters field bad lines go to
    missing_hint = ""  # said when the log is missing

    def __init__(self, cfg: Any, sessions: Sessions, path: str, state_name: str):
        # Policy keys are read from sessions.cfg, which a reload replaces; cfg holds only
        # what needs a restart (the slot, the state directory).
        self.cfg = cfg
        self.sessions = sessions
        self.path = Path(path)
        digest = hashlib.sha1(str(self.path).encode()).hexdigest()[:12]
        self.state_path = cfg.effective_state_dir() / f"{state_name}-{digest}.json"
        self.follower = Follower(self.path, self.state_path, self.what, self.missing_hint)
        self.lines = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._observer: Any = None
        self._bad_burst = 0
        self._bad_logged_at = 0.0
        self._save_tasks: dict[int, asyncio.Task] = {}  # per slot
        self._save_wanted: set[int] = set()
        self._read_lock = asyncio.Lock()
        self._rotations = self._truncations = self._missing = 0  # the follower's, already counted

    # -- life ------------------------------------------------------------------
    async def start(self) -> None:
        if self.follower.skip_existing():
            log.info("%s: first start on %s: reading from its end (%s bytes are history)", self.what, self.path,
                     f"{self.follower.offset:,}")
            self.follower.save_state()
        self._start_watch()
        self._task = asyncio.get_running_loop().create_task(self._run())
        log.info("%s: following %s", self.what, self.path)

    def _start_watch(self) -> None:
        try:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer
        except ImportError:  # pragma: no cover - watchdog is a dependency; the poll still works
            return
        parent = self.path.parent
        if not parent.is_dir():
            log.warning("%s: %s does not exist yet; polling for it every %g s", self.what, parent, POLL_S)
            return
        loop = asyncio.get_running_loop()
        wake = self._wake
        target = str(self.path)

        class Wake(FileSystemEventHandler):
            def on_any_event(self, event: Any) -> None:
                if target in (getattr(event, "src_path", None), getattr(event, "dest_path", None)):
                    loop.call_soon_threadsafe(wake.set)

        self._observer = Observer()
        self._observer.schedule(Wake(), str(parent), recursive=False)
        self._observer.daemon = True
        self._observer.start()

    async def stop(self, grace_s: float) -> None:
        if self._observer is not None:
            self._observer.stop()
        self._stopping = True
        if self._task is not None:
            await cancel(self._task)
        pending = [t for t in self._save_tasks.values() if not t.done()]
        if pending:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(asyncio.gather(*pending, return_exceptions=True)), grace_s)
        self.follower.save_state()
        self.follower._close()
        if self._observer is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._observer.join, 2.0)

    # -- reading -----------------------------------------------------------------
    async def _run(self) -> None:
        while not self._stopping:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            self._wake.clear()
            try:
                await self.read_new_lines()
                await self.tick()
            except OSError as e:
                log.warning("%s: reading %s: %s", self.what, self.path, e)
            except Exception as e:  # a bug must not end the tail: the next lines may be fine
                log.exception("%s: acting on %s: %s", self.what, self.path, e)

    async def read_new_lines(self) -> None:
        """Read and act on what the log gained. One reader at a time: the follower's offset
        and buffer are not for two threads."""
        loop = asyncio.get_running_loop()
        async with self._read_lock:
            lines = await loop.run_in_executor(None, self.follower.read)
            f, c = self.follower, self.sessions.counters
            c.log_rotations += f.rotations - self._rotations
            c.log_truncations += f.truncations - self._truncations
            c.log_missing += f.missing - self._missing
            self._rotations, self._truncations, self._missing = f.rotations, f.truncations, f.missing
            if f.too_long:
                self._bad(f.too_long, f"a line over {MAX_LINE:,} bytes")
                f.too_long = 0
            for i, line in enumerate(lines):
                # Only the last line of a batch may look at the engine's slot: for an earlier
                # end, the slot already shows what the lines after it did.
                await self.handle(line, last=(i == len(lines) - 1))
            if lines:
                await loop.run_in_executor(None, self.follower.save_state)
        await self.after_batch()

    def _bad(self, n: int, why: str) -> None:
        self.sessions.counters.bump(self.bad_counter, n)
        self._bad_burst += n
        now = time.monotonic()
        if now - self._bad_logged_at >= BAD_LINE_LOG_EVERY_S:
            log.warning("%s: skipped %d bad line(s) in %s (latest: %s)", self.what, self._bad_burst, self.path, why)
            self._bad_logged_at, self._bad_burst = now, 0

    async def handle(self, line: bytes, last: bool = True) -> None:
        raise NotImplementedError

    async def tick(self) -> None:
        """Between batches (every POLL_S at least)."""

    async def after_batch(self) -> None:
        """After each batch's lines were acted on (outside the read lock)."""

    # -- save behind ---------------------------------------------------------------
    def _schedule_save_behind(self, slot: int) -> None:
        if not self.sessions.cfg.auto_sessions:  # auto_sessions = false (a reload may set it)
            return
        self._save_wanted.add(slot)
        task = self._save_tasks.get(slot)
        if task is None or task.done():
            self._save_tasks[slot] = asyncio.get_running_loop().create_task(self._save_behind_loop(slot))

    async def _save_behind_loop(self, slot: int) -> None:
        # An end that arrives while a save behind is running asks for another pass.
        while slot in self._save_wanted:
            self._save_wanted.discard(slot)
            await self._save_behind(slot)

    async def _save_behind(self, slot: int) -> None:
        raise NotImplementedError


class Tail(Following):
    name = "tail"
    what = "tail"
    bad_counter = "bad_log_lines"

    def __init__(self, cfg: Any, sessions: Sessions, path: str):
        super().__init__(cfg, sessions, path, "tail")
        self.in_flight: dict[str, tuple[LogEvent, float]] = {}  # id → (start, when it was read)
        self.in_flight_expired = 0
        self.starts_seen: collections.Counter[int] = collections.Counter()  # per slot: did a request begin
        self._last_held: dict[int, str] = {}  # per slot: the conversation its last request was of

    async def start(self) -> None:
        self._last_held = dict(self.sessions.last.keys())
        self.sessions.on_engine_restart.append(self._engine_restarted)
        await super().start()

    def describe(self) -> dict[str, Any]:
        return {"request_log": str(self.path), "lines": self.lines, "in_flight": len(self.in_flight),
                "in_flight_expired": self.in_flight_expired}

    async def tick(self) -> None:
        await self.expire_in_flight()

    async def handle(self, line: bytes, last: bool = True) -> None:
        self.lines += 1
        if not line.strip():
            return
        try:
            ev = parse_line(line)
        except BadLine as e:
            self._bad(1, str(e))
            return
        if ev.slot not in self.sessions.slots:
            self._bad(1, f"slot {ev.slot} is not one of the engine's {len(self.sessions.slots)}")
            return
        if ev.event == "start":
            self.starts_seen[ev.slot] += 1
            if len(self.in_flight) >= MAX_IN_FLIGHT:  # a serving layer that never logs ends
                oldest = next(iter(self.in_flight))
                await self._expire(oldest, "more than {:,} requests in flight".format(MAX_IN_FLIGHT))
            self.in_flight[ev.id] = (ev, time.monotonic())
            # The engine switches to this request now, whatever we do.
            self.sessions.observed_start(ev.slot, ev.key)
            if ev.key is not None:
                self._last_held[ev.slot] = ev.key
            return
        start, _ = self.in_flight.pop(ev.id, (None, 0.0))
        if start is None:
            return
        await self.sessions.observed_end(ev.slot, start.key, ev.status or "ok", ev.n_tokens, ev.cache_n, look=last,
                                         n_prompt=ev.n_prompt)
        if ev.status == "ok" and start.key is not None and not self._in_flight_on(ev.slot):
            self._schedule_save_behind(ev.slot)

    def _in_flight_on(self, slot: int) -> bool:
        return any(start.slot == slot for start, _ in self.in_flight.values())

    async def expire_in_flight(self, now: float | None = None) -> None:
        """A start whose end never comes (the serving layer crashed) would block every save
        behind and the restore after an engine restart: after IN_FLIGHT_TTL_S, with the
        engine's slot idle, it counts as a request that failed."""
        now = time.monotonic() if now is None else now
        old = [rid for rid, (_, at) in self.in_flight.items() if now - at >= IN_FLIGHT_TTL_S]
        for rid in old:
            start, _ = self.in_flight[rid]
            st = await self.sessions.look(start.slot)
            if st is not None and st.is_processing:
                continue  # something still runs there: it may be this one
            await self._expire(rid, f"no end logged within {IN_FLIGHT_TTL_S:g} s")

    async def _expire(self, rid: str, why: str) -> None:
        start, _ = self.in_flight.pop(rid)
        self.in_flight_expired += 1
        log.warning("tail: request %s in %s: %s; counted as failed", rid, self.path, why)
        await self.sessions.observed_end(start.slot, start.key, "error")

    # -- save behind ---------------------------------------------------------------
    async def _save_behind(self, slot: int) -> None:
        try:
            while True:  # wait for the engine to finish, unless another request is logged
                if self._in_flight_on(slot):
                    return
                st = await self.sessions.look(slot)
                if st is None or not st.is_processing:
                    break
                await asyncio.sleep(0.05)
            await self.sessions.save_behind(slot, self._still_ours(slot, self.starts_seen[slot]))
        except Exception as e:
            log.warning("tail: save behind: %s", e)

    def _still_ours(self, slot: int, starts_before: int) -> Any:
        async def check(before: SlotState | None = None) -> str | None:
            """Why the slot's state just saved or restored may not be what we think, or None.
            before: the engine's slot as a save behind saw it before the save."""
            with contextlib.suppress(OSError):
                await self.read_new_lines()
            if self.starts_seen[slot] != starts_before or self._in_flight_on(slot):
                return "a request started meanwhile"
            st = await self.sessions.look(slot)
            if st is not None and (st.is_processing or (before is not None and st.n_tokens != before.n_tokens)):
                return "the engine's slot changed meanwhile"
            return None

        return check

    # -- after an engine restart ---------------------------------------------------
    async def _engine_restarted(self) -> None:
        if not self.sessions.cfg.auto_sessions:
            return
        for slot, key in sorted(self._last_held.items()):
            if slot not in self.sessions.slots or self._in_flight_on(slot):
                continue
            st = await self.sessions.look(slot)
            if st is not None and (st.is_processing or st.n_tokens > 0):
                continue
            await self.sessions.restore_behind(slot, key, self._still_ours(slot, self.starts_seen[slot]))


async def cancel(task: asyncio.Task) -> None:
    """Cancel the task and wait for its end. On Python < 3.12, asyncio.wait_for can lose a
    cancel that arrives just as what it waits for completes (CPython bpo-42130): seen here as
    a stop that hung when the log was written as SIGTERM came. The cancel is repeated until
    the task has ended."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.cancelled() and task.exception() is not None:  # the tasks log their own failures
        log.debug("stopping a tail: %s", task.exception())
