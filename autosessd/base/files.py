"""Reading files autosessd does not control, and the digest that says a session file is whole.

The session directory is shared with the engine and with people, the state directory with
whoever can write there: a name autosessd reads may be a FIFO (an open would block for ever),
a symlink to /dev/zero or out of the directory, or a file of any size. So every read of such a
file goes through open_regular():

    O_NOFOLLOW   a symlink is refused (ELOOP), never followed
    O_NONBLOCK   opening a FIFO or a device returns at once instead of waiting for a writer
    fstat        only a regular file is read (the fstat of the descriptor opened, not of a
                 name that may change between a stat and an open)
    a bound      metadata, caches and state files are read up to a size given by the caller

All of it blocks on disk I/O: callers run it in a worker thread, never on the event loop.

The digest (DIGEST, issue 19): xxh3-128 of the whole file, measured against sha256, blake2b
and blake3 by bench/digest.py (docs/guarantees.md, Integrity): several times faster than the others on
one core, so a finalize adds a fraction of the time the engine took to write the file, and a
download is checked while its bytes arrive. It guards against damage and truncation (a disk,
a copy, a peer's broken upload), not against someone who may write the directory or the
bucket: they could replace the metadata as well.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import xxhash

CHUNK = 1 << 20
META_MAX = 32 << 20  # metadata (a manifest holds its tokens: 4 bytes each) and small state files
DIGEST = "xxh3-128"


class NotRegular(OSError):
    """A name that is a symlink, a FIFO, a device or a directory, or a file over its bound."""


@dataclass(frozen=True)
class Ident:
    """What says a file is the one last checked: a new inode, size or ctime means it changed.
    The ctime, not the mtime: every write, truncate, chmod or rename moves it, and nobody
    can set it back (touch -d sets the mtime only)."""

    ino: int
    ctime_ns: int
    size: int

    @classmethod
    def of(cls, st: os.stat_result) -> "Ident":
        return cls(st.st_ino, st.st_ctime_ns, st.st_size)

    def to_list(self) -> list[int]:
        return [self.ino, self.ctime_ns, self.size]

    @classmethod
    def from_list(cls, value: object) -> "Ident | None":
        if isinstance(value, list) and len(value) == 3 and all(type(v) is int for v in value):
            return cls(*value)
        return None


def open_regular(path: str | Path, max_bytes: int | None = None,
                 follow_links: bool = False) -> tuple[BinaryIO, os.stat_result]:
    """Open a regular file for reading without following a link or waiting on a FIFO; with
    max_bytes, refuse one larger than that. NotRegular (an OSError) says why not.
    follow_links: a path a person configured (a request log) may be a link to a file."""
    try:
        fd = os.open(path, os.O_RDONLY | (0 if follow_links else os.O_NOFOLLOW) | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegular(errno.ELOOP, f"{Path(path).name} is a symbolic link: not read") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(errno.EINVAL, f"{Path(path).name} is not a regular file ({_kind(st.st_mode)}): not read")
        if max_bytes is not None and st.st_size > max_bytes:
            raise NotRegular(errno.EFBIG, f"{Path(path).name} has {st.st_size:,} bytes, more than the "
                                          f"{max_bytes:,} such a file may have: not read")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st
    except BaseException:
        os.close(fd)
        raise


def read_small(path: str | Path, max_bytes: int = META_MAX) -> bytes:
    """The whole of a small regular file (metadata, a cache, a state file), at most max_bytes."""
    f, st = open_regular(path, max_bytes)
    with f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew since the fstat
        raise NotRegular(errno.EFBIG, f"{Path(path).name} grew past {max_bytes:,} bytes while read")
    return data


def regular_ident(path: str | Path) -> Ident | None:
    """The Ident of a regular file at `path` (lstat: a link is not one); None otherwise."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return Ident.of(st) if stat.S_ISREG(st.st_mode) else None


class Hasher:
    """DIGEST over bytes fed in order: a download hashes its chunks as they arrive."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return f"{DIGEST}:{self._h.hexdigest()}"


def digest_file(path: str | Path) -> tuple[str, Ident]:
    """DIGEST of a whole regular file and the Ident it was read as (a file that changes while
    it is read gives another Ident at the end: OSError, since the digest says nothing then)."""
    f, st = open_regular(path)
    with f:
        digest = digest_fd(f.fileno())
        after = os.fstat(f.fileno())
    if Ident.of(after) != Ident.of(st):
        raise OSError(errno.EAGAIN, f"{Path(path).name} changed while its digest was computed")
    return digest, Ident.of(st)


def digest_fd(fd: int) -> str:
    """DIGEST of the whole file open as `fd`, read from its start (its offset untouched): for a
    file only the caller writes, whose digest needs no check that nobody changed it meanwhile."""
    h = Hasher()
    at = 0
    while data := os.pread(fd, CHUNK, at):
        h.update(data)
        at += len(data)
    return h.hexdigest()


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return f"mode {mode:o}"
