"""The request-log tail (DESIGN §2): learn what the engine ran from a serving layer's JSONL log.

Following the file (STYLE §8): the parent directory is watched (watchdog), and its events
are only wake-ups; a slow stat poll backs them up (inotify misses events on some mounts).
The follower remembers (dev, inode, offset):

    same inode, size ≥ offset   read the new complete lines
    same inode, size < offset   truncated in place (copytruncate): start again at 0
    another inode at the path   rotated by rename: finish the old handle, then the new file at 0
    no file                     wait for it
    same inode, size ≥ offset, the bytes before the offset changed
                                written again from its start (llama-server, at each of its
                                starts): start again at 0
      ... to NULs               truncated under a writer that goes on at its own offset: read
                                on, skipping the hole

Only complete lines are acted on; a partial last line waits for its newline. A line over
MAX_LINE is skipped up to its newline. Bad lines (not UTF-8, not JSON, wrong fields) are
counted in bad_log_lines and logged once per burst; rotations, truncations and a log found
missing or unreadable are counted (log_rotations, log_truncations, log_missing) and said
once each. (dev, inode, offset, the bytes before it) are written atomically to the state
directory after each batch, so a restart neither replays nor misses a line; the very first
start begins at the end of an existing log (its history is not happening now). All of this
is the class Following, which the engine-log tail (enginetail.py) shares; Tail below is the
request log's meaning of a line.

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
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ..engines.base import SlotState
from ..base.files import open_regular, read_small
from .requestlog import BadLine, LogEvent, parse_line
from ..sessions.facade import Sessions

log = logging.getLogger("autosessd")

MAX_LINE = 1 << 20
POLL_S = 1.0
MAX_IN_FLIGHT = 1024  # starts without an end kept at most (the oldest expires first)
IN_FLIGHT_TTL_S = 600.0  # a start older than this, with the engine's slot idle, has lost its end
BAD_LINE_LOG_EVERY_S = 10.0
SIG_BYTES = 64  # of the log just before the offset: tells a log written again from its start


class Follower:
    """Reads complete new lines of one log path across rotation and truncation.

    Besides (dev, inode, offset) it keeps the bytes just before the offset (up to SIG_BYTES),
    to notice a log written again from its start that has grown past the offset since it was
    last read: llama-server opens its --log-file for writing (truncating it) at every start.
    When those bytes are NULs, the file was truncated in place under a writer that went on at
    its own offset (copytruncate with a writer not in append mode): the offset stays, and the
    NUL run ahead of the writer's next line is skipped."""

    def __init__(self, path: Path, state_path: Path, what: str = "tail", hint: str = ""):
        self.path = path
        self.state_path = state_path
        self.what = what  # for messages
        self.hint = hint  # what to check when the log is missing
        self.fh: Any = None
        self.ident: tuple[int, int] | None = None
        self.offset = 0
        self.sig: bytes | None = None  # the bytes just before offset; None: not known
        self.buf = b""
        self.skipping = False  # inside a line over MAX_LINE
        self.too_long = 0
        self.rotations = 0  # a new file at the path (counted since the start)
        self.truncations = 0  # truncated, or written again from its start
        self.missing = 0  # found missing (at the start, or after it was there)
        self._present: bool | None = None
        self._unreadable = False
        self._load_state()

    def _load_state(self) -> None:
        try:
            d = json.loads(read_small(self.state_path))
            if d.get("path") == str(self.path):
                self.ident, self.offset = (int(d["dev"]), int(d["ino"])), int(d["offset"])
                self.sig = bytes.fromhex(d["sig"]) if isinstance(d.get("sig"), str) else None
        except (OSError, ValueError, KeyError, TypeError):
            pass

    def skip_existing(self) -> bool:
        """At a first start (no offset saved): begin at the end of the log as it is, so the
        history of a long-running serving layer is not replayed as if it happened now."""
        if self.ident is not None:
            return False
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                f.seek(max(0, st.st_size - SIG_BYTES))
                self.sig = f.read(SIG_BYTES)
        except OSError:
            return False  # a log that appears later is read from its start
        self.ident, self.offset = (st.st_dev, st.st_ino), st.st_size
        return True

    def save_state(self) -> None:
        if self.ident is None:
            return
        data = json.dumps({"path": str(self.path), "dev": self.ident[0], "ino": self.ident[1],
                           "offset": self.offset, "sig": self.sig.hex() if self.sig is not None else None})
        tmp = self.state_path.with_suffix(".tmp")
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(tmp, "w") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.state_path)
        except OSError as e:
            log.warning("%s: cannot record the log offset in %s: %s", self.what, self.state_path, e)

    def read(self) -> list[bytes]:
        """Complete lines added since the last call (blocking I/O: run in a thread)."""
        lines: list[bytes] = []
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        ident = (st.st_dev, st.st_ino) if st else None
        if st is None and self._present is not False:
            self.missing += 1
            log.warning("%s: %s does not exist%s; it is read as soon as it appears%s", self.what, self.path,
                        " (yet)" if self._present is None else " any more", self.hint)
        self._present = st is not None
        if self.fh is not None and ident != self.ident:
            lines += self._drain()  # rotated: what the old file still has comes first
            self._close()
            self.ident, self.offset, self.sig = None, 0, None
            self.rotations += 1
            log.info("%s: %s was rotated; reading the new file from its start", self.what, self.path)
        if st is None:
            return lines
        if self.fh is None:
            try:
                self.fh, _ = open_regular(self.path, follow_links=True)  # a FIFO is refused, not waited on
            except FileNotFoundError:
                return lines
            except PermissionError as e:
                if not self._unreadable:  # said once, until it is read again
                    self.missing += 1
                    log.warning("%s: cannot read %s: %s; tried again every %g s%s", self.what, self.path,
                                e.strerror or e, POLL_S, self.hint)
                self._unreadable = True
                return lines
            self._unreadable = False
            st = os.fstat(self.fh.fileno())
            new_ident = (st.st_dev, st.st_ino)
            if new_ident != self.ident:  # not the file the saved offset belongs to
                if self.ident is not None:  # rotated while we were not running
                    self.rotations += 1
                    log.info("%s: %s is another file than at the last stop (rotated); reading it from its start",
                             self.what, self.path)
                self.offset, self.sig = 0, None
            self.ident = new_ident
        if st.st_size < self.offset:
            log.info("%s: %s was truncated; reading it from the start", self.what, self.path)
            self.truncations += 1
            self.offset, self.sig, self.buf, self.skipping = 0, None, b"", False
        elif self.offset and self.sig:
            self._check_sig()
        lines += self._drain()
        return lines

    def _check_sig(self) -> None:
        self.fh.seek(self.offset - len(self.sig))
        seen = self.fh.read(len(self.sig))
        if seen == self.sig:
            return
        self.truncations += 1
        if seen.strip(b"\0") == b"":
            log.info("%s: %s was truncated in place and its writer went on at its own offset; reading on from "
                     "there", self.what, self.path)
            self.sig = seen
            return
        log.info("%s: %s was written again from its start; reading it from the start", self.what, self.path)
        self.offset, self.sig, self.buf, self.skipping = 0, None, b"", False

    def _consumed(self, data: bytes) -> None:
        self.offset += len(data)
        self.sig = ((self.sig or b"") + data)[-SIG_BYTES:]

    def _drain(self) -> list[bytes]:
        self.fh.seek(self.offset + len(self.buf))
        lines = []
        while True:
            chunk = self.fh.read(1 << 16)
            if not chunk:
                break
            self.buf += chunk
            while True:
                if self.buf[:1] == b"\0" and not self.skipping:
                    # A hole left by a truncation under a writer at its own offset: no line.
                    rest = self.buf.lstrip(b"\0")
                    self._consumed(self.buf[:len(self.buf) - len(rest)])
                    self.buf = rest
                nl = self.buf.find(b"\n")
                if nl < 0:
                    if len(self.buf) > MAX_LINE:  # no end in sight: drop it, skip to its newline
                        self._consumed(self.buf)
                        self.buf = b""
                        if not self.skipping:
                            self.too_long += 1
                        self.skipping = True
                    break
                line, self.buf = self.buf[:nl], self.buf[nl + 1:]
                self._consumed(line + b"\n")
                if self.skipping:
                    self.skipping = False  # the tail end of an over-long line
                    continue
                if len(line) > MAX_LINE:
                    self.too_long += 1
                    continue
                lines.append(line)
        return lines

    def _close(self) -> None:
        if self.fh is not None:
            self.fh.close()
        self.fh, self.buf, self.skipping = None, b"", False


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
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
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
        while True:
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
