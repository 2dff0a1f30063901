"""Warming a session file into the page cache before the engine reads it (issue 31).

At 128 KiB a token a restore reads hundreds of MB to GB. From the page cache that is the
engine's copy alone (~0.2 s for 0.8 GB here); from the disk it is the disk's read time on top
(0.7 s cold for the same file). When autosessd knows which file a request will restore before
the engine reads it, it asks the kernel to read it (POSIX_FADV_WILLNEED over every 8 MiB of
it, in a worker thread; nothing waits for it), so that the restore finds it in memory:

    a request that waits   for its slot behind another conversation's request: the waiting
                           conversation's own file (placement, Sessions.place)
    the turn               the file a return's messages name (recall.py) while the outgoing
                           conversation is saved, or the one its tokens choose once the
                           engine has told them (the save hides both)
    a start                the files the slots held at the last stop (held.json): the
                           conversations most recently used, restored first after a restart

Bounds: a file is warmed only when it fits, with the files asked for in the last REPEAT_S (by any
model's Sessions behind a router: one record, Context.warmed), in half of the memory available
now (psutil), so warming never pushes the engine's own memory
out, and the same file (the same inode, size and
ctime) is not asked for again within REPEAT_S. Counted in status (warmed_files,
warmed_bytes, warm_skipped_memory). Where the platform has no posix_fadvise (macOS), nothing
is warmed and the restore reads from the disk as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Iterable

import psutil

from ..base import files
from ..store.directory import auto_name

if TYPE_CHECKING:
    from .context import Context
    from .placement import Placement
    from .saves import Saver

log = logging.getLogger("autosessd")

MEMORY_SHARE = 0.5  # a file is warmed only when it fits in this share of the memory available
REPEAT_S = 30.0  # the same file is not asked for again within this
CHUNK = 8 << 20  # bytes asked for per call (see _advise)


class Warmer:
    def __init__(self, ctx: Context, saver: Saver, placement: Placement):
        self.ctx = ctx
        self.saver = saver
        self.slots = placement.slots
        placement.on_wait.append(self.waiting)
        self._asked: dict[str, tuple[files.Ident, float]] = ctx.warmed  # name → (ident, when); the house's
        self.can = hasattr(os, "posix_fadvise")

    def waiting(self, key: str) -> None:
        """A request of `key` waits for a busy slot (Placement.on_wait): its conversation's own
        file, when no slot holds it live and it is this model's, is warmed while it waits."""
        if any(s.has(key) for s in self.slots.values()):
            return
        name = auto_name(key)
        f = self.saver.facts(name)
        if f.meta is not None and f.meta.model == self.ctx.model and f.pending is None:
            self.warm(name)

    def held_at_stop(self, names: Iterable[str]) -> None:
        """At start: the files the slots held at the last stop (held.json), restored first."""
        for name in sorted(set(names)):
            self.warm(name)

    def warm(self, name: str) -> bool:
        """Start reading `name` (in the session directory) into the page cache; on the loop,
        it only stats the file and hands the advice to a worker thread. False when it is not
        warmed: not a regular file, asked for lately, too large for the memory free, or a
        platform without readahead advice."""
        if not self.can:
            return False
        # What a restore of it reads: the file, its copy in staging, or its blocks (issue 39).
        found = [(p, i) for p in self.ctx.store.block_paths(name) if (i := files.regular_ident(p)) is not None]
        if not found or not sum(i.size for _, i in found):
            return False
        first = found[0][1]
        ident = files.Ident(first.ino, first.ctime_ns, sum(i.size for _, i in found))  # the set, by its first
        now = time.monotonic()
        last = self._asked.get(name)
        if last is not None and last[0] == ident and now - last[1] < REPEAT_S:
            return False
        # With the files asked for lately (still being read in, or just read): all of them must
        # fit, not each alone (the start warms every slot's file at once).
        recent = sum(i.size for n, (i, t) in self._asked.items() if n != name and now - t < REPEAT_S)
        if ident.size + recent > psutil.virtual_memory().available * MEMORY_SHARE:
            self.ctx.counters.warm_skipped_memory += 1
            log.debug("auto sessions: %s not warmed: %s bytes, with %s asked for lately more than %.0f%% of the "
                      "memory available", name, f"{ident.size:,}", f"{recent:,}", MEMORY_SHARE * 100)
            return False
        self._asked[name] = (ident, now)
        for old in [n for n, (_, t) in self._asked.items() if now - t >= REPEAT_S]:
            del self._asked[old]
        self.ctx.counters.warmed_files += 1
        self.ctx.counters.warmed_bytes += ident.size
        for path, one in found:
            try:
                asyncio.get_running_loop().run_in_executor(None, _advise, path, one)
            except RuntimeError:  # no loop (a test calling it directly): now
                _advise(path, one)
        return True


def _advise(path: os.PathLike, ident: files.Ident) -> None:
    """POSIX_FADV_WILLNEED over the whole file, if it is still the file that was asked for, one
    CHUNK at a time: Linux reads at most one readahead window per call (force_page_cache_ra caps
    it at the device's max_pages: seen here, one call over a 0.7 GB file brought 8 MB in; a loop
    of calls, 0.16 s of them, brought all of it within a second). A call blocks only while the
    disk's request queue is full, in this worker thread."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        log.debug("auto sessions: warming %s: %s", path, e)
        return
    try:
        st = os.fstat(fd)
        if st.st_ino == ident.ino and st.st_size == ident.size:
            for offset in range(0, st.st_size, CHUNK):
                os.posix_fadvise(fd, offset, CHUNK, os.POSIX_FADV_WILLNEED)
    except OSError as e:
        log.debug("auto sessions: warming %s: %s", path, e)
    finally:
        os.close(fd)
