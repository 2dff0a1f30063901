"""Reading a log that grows, for the request-log tail and the engine-log tail.

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
start begins at the end of an existing log (its history is not happening now): Follower
below reads the lines, tail.Following (shared by both tails) watches, saves the state and acts.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ..base.files import open_regular, read_small

log = logging.getLogger("autosessd")

MAX_LINE = 1 << 20
POLL_S = 1.0
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
