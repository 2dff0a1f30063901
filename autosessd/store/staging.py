"""The staging directory (issue 39): where the engine writes its saves and reads its restores
(its --slot-save-path, `slot_save_path`), as opposed to the store (`store_path`, the same
directory unless set) where autosessd keeps them durable. On tmpfs, the engine's whole-file
writes never reach the disk: only the blocks a save adds do.

What lives in staging besides the temporaries being written:

    hot copies    auto-<key>.bin of a conversation kept as blocks (the engine's own file, or one
                  assembled from blocks), kept within `hot_budget` bytes, the least recently
                  used going first: a return finds its file there and restores it as is. Never
                  durable, never needed: one that is gone, or fails its check, is assembled again
    assembled     .autosessd-<key>.<hex>.asm.partial, the first n tokens of a conversation
                  assembled for one restore (a request sharing only part of it), removed after
    copies        with a separate store, a whole file's copy the engine reads (a sliding-window
                  model's save, a person's parked file), kept as a hot copy

stage(name, n) says which name the engine reads for a file: its hot copy when it is whole
(size, and digest unless it is the file checked before), else what it assembles or copies.
Store (directory.py) is this class and the directory; the attributes declared below are Store's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..base import files
from ..base.files import Ident
from . import blocks
from .blocks import BadBlock, BlockRef, BlockStore
from .kvfile import Shape
from .names import AUTO_BIN, TEMP_PREFIX, Meta, StoreError

log = logging.getLogger("autosessd")


class Refused(StoreError):
    """A file that may not be handed to the engine; bad: damaged (moved aside), not just absent."""

    def __init__(self, why: str, bad: bool = True):
        super().__init__(why)
        self.bad = bad


@dataclass(frozen=True)
class Staged:
    """What the engine reads for a restore: `name` in staging, holding `n_tokens` tokens of the
    file (None: all of it); temporary: assembled for this restore, removed after it; digest: of
    those very bytes (an assembly is in position order, not the engine's cache order: its digest
    is its own), None where not known."""

    name: str
    n_tokens: int | None = None
    temporary: bool = False
    assembled: bool = False
    bytes_read: int = 0  # block bytes read to assemble it (0: a copy as it was)
    ms: float = 0.0
    digest: str | None = None


class Staging:
    """Store's staging half (see the module's docstring). _hot holds only copies: never the
    store's own file (in the store's own directory, a whole file's .bin is the store's, and
    references._meta_changed takes it out of _hot when a save makes it so). _staged records each
    copy as checked: name → (its identity, the save it is a copy of (saved_at), its digest)."""

    path: Path
    staging: Path
    blocks: BlockStore | None
    mode: int
    _lock: threading.RLock
    in_use: Counter[str]
    _temp_readers: Counter[str]
    _uses: dict[str, tuple[str, ...]]

    if TYPE_CHECKING:  # the other rooms' own: a stub here could come before them in Store's MRO
        def meta_path(self, key: str) -> Path: ...
        def _meta_at(self, path: Path) -> Meta | None: ...
        def _own(self, fd: int, path: Path) -> None: ...
        def _drop_manifests_of(self, key: str) -> list[str]: ...

    def _staging_init(self, hot_budget: int) -> None:
        self.hot_budget = hot_budget
        self._hot: OrderedDict[str, int] = OrderedDict()  # name → bytes, least recently used first
        self._staged: dict[str, tuple[Ident, float, str | None]] = {}
        self.assembled_bytes = 0  # block bytes read to assemble files since the start
        self.assemblies = 0

    def hot_path(self, key: str) -> Path:
        return self.staging / f"auto-{key}.bin"

    # -- the hot copies ------------------------------------------------------------------------
    def _hot_added(self, name: str, meta: Meta | None = None, digest: str | None = None) -> None:
        """A copy just put in staging: counted (and, with the save it copies, recorded as checked),
        the least recently used beyond the budget go."""
        ident = files.regular_ident(self.staging / name)
        if ident is None:
            return
        with self._lock:
            self._hot[name] = ident.size
            self._hot.move_to_end(name)
            if meta is not None:
                self._staged[name] = (ident, meta.saved_at, digest or meta.digest)
        self.trim_hot()

    def hot_used(self, name: str) -> None:
        with self._lock:
            if name in self._hot:
                self._hot.move_to_end(name)

    def _set_aside(self, name: str) -> tuple[Path, int] | None:
        """Under _lock: the copy `name` out of _hot and renamed aside (the caller unlinks it
        outside the lock: a multi-GB unlink on a disk is not held under it)."""
        size = self._hot.pop(name, None)
        self._staged.pop(name, None)
        if size is None:
            return None
        dead = self.staging / f"{TEMP_PREFIX}{name}.{uuid.uuid4().hex[:8]}.evicted.partial"
        try:
            os.rename(self.staging / name, dead)
        except FileNotFoundError:
            return None
        return dead, size

    def trim_hot(self) -> int:
        """Remove the least recently used copies until they fit hot_budget; never one being
        written or read. → bytes removed."""
        freed = 0
        while True:
            with self._lock:
                if sum(self._hot.values()) <= self.hot_budget:
                    return freed
                victim = next((n for n in self._hot if not self.in_use.get(n) and not self._temp_readers.get(n)),
                              None)
                if victim is None:
                    return freed
                got = self._set_aside(victim)
            if got is not None:
                with contextlib.suppress(FileNotFoundError):
                    got[0].unlink()
                freed += got[1]

    def make_room_in_staging(self, n_bytes: int) -> int:
        """Copies let go, least recently used first, until n_bytes are freed (a save needs the
        room in staging): → bytes freed."""
        freed = 0
        while freed < n_bytes:
            with self._lock:
                victim = next((n for n in self._hot if not self.in_use.get(n) and not self._temp_readers.get(n)),
                              None)
                got = self._set_aside(victim) if victim is not None else None
            if victim is None:
                return freed
            if got is not None:
                with contextlib.suppress(FileNotFoundError):
                    got[0].unlink()
                freed += got[1]
        return freed

    def forget_hot(self, name: str) -> int:
        """A copy dropped (its conversation removed): → its bytes. Only a registered copy is
        removed, never the store's own whole file under the same name."""
        with self._lock:
            got = self._set_aside(name)
        if got is None:
            return 0
        with contextlib.suppress(FileNotFoundError):
            got[0].unlink()
        return got[1]

    def hot_copies(self) -> dict[str, int]:
        with self._lock:
            return {"files": len(self._hot), "bytes": sum(self._hot.values()), "budget": self.hot_budget}

    def _hot_whole(self, name: str, meta: Meta) -> str | None:
        """The copy of `name` in staging is the save its metadata is (its size, and the identity
        it was checked at for that very save, or its digest): → its digest ("" when not known);
        None when it is not."""
        path = self.staging / name
        ident = files.regular_ident(path)
        if ident is None or ident.size != meta.bytes:
            return None
        if meta.in_blocks and meta.ident == ident:
            return meta.digest or ""  # the engine's own file, kept by the finalize that wrote this manifest
        with self._lock:
            rec = self._staged.get(name)
        if rec is not None and rec[0] == ident and rec[1] == meta.saved_at:
            return rec[2] or ""
        if meta.digest is None:
            return None
        try:
            digest, now = files.digest_file(path)
        except OSError:
            return None
        if digest != meta.digest:
            return None
        with self._lock:
            self._staged[name] = (now, meta.saved_at, digest)
        return digest

    # -- what the engine reads -----------------------------------------------------------------
    def stage(self, name: str, n_tokens: int | None = None) -> Staged:
        """The name in staging the engine reads for session file `name` holding its first
        n_tokens tokens (None: all): its copy when whole, else assembled from its blocks (all of
        it: kept as the copy, unless someone else holds the name or its manifest changed
        meanwhile; fewer: a temporary for this restore), else (a separate store) copied from the
        store. The caller holds the name (Store.using). Blocking: run it in a thread. Refused:
        none can be read."""
        m = AUTO_BIN.match(name)
        meta_ident = files.regular_ident(self.meta_path(m.group(1))) if m else None
        meta = self._meta_at(self.meta_path(m.group(1))) if m else None
        if meta is None or not meta.in_blocks:
            if self.staging == self.path:
                return Staged(name, digest=meta.digest if meta is not None else None)
            return self._copy_in(name, meta)
        have = self._hot_whole(name, meta)
        if have is not None:
            self.hot_used(name)
            return Staged(name, digest=have or None)
        assert self.blocks is not None
        t0 = time.monotonic()
        tokens = meta.tokens or b""
        n_all = len(tokens) // 4
        want = n_all if n_tokens is None else max(1, min(n_tokens, n_all))
        cells = min(want, meta.n_cells)
        shape = Shape.from_json(meta.kv)
        refs = [BlockRef(*b) for b in meta.blocks]
        key = m.group(1)
        tmp = self.staging / f"{TEMP_PREFIX}{key}.{uuid.uuid4().hex[:8]}.asm.partial"
        try:
            with self.blocks.pinned(r.key for r in refs):
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.mode)
                with os.fdopen(fd, "wb") as out:
                    self._own(out.fileno(), tmp)
                    digest = blocks.assemble(self.blocks, shape, tokens[:4 * want], refs, cells, out)
        except BadBlock as e:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            gone = self._bad_block(e, refs)
            raise Refused(f"{name}: {e}" + (f" (removed: {', '.join(gone)})" if gone else "")) from None
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        read = sum(blocks.payload_size(shape, r.n_cells)
                   for r in refs[:(cells + blocks.BLOCK_TOKENS - 1) // blocks.BLOCK_TOKENS])
        with self._lock:
            self.assembled_bytes += read
            self.assemblies += 1
        ms = (time.monotonic() - t0) * 1000
        if want >= n_all:
            with self._lock:  # kept as the copy only while nobody else holds the name (a finalize of
                # a newer save) and its manifest is the one assembled: never over a newer file
                if self.in_use.get(name, 0) <= 1 and files.regular_ident(self.meta_path(key)) == meta_ident:
                    os.replace(tmp, self.staging / name)
                    tmp = None
            if tmp is None:
                self._hot_added(name, meta, digest)
                return Staged(name, None, assembled=True, bytes_read=read, ms=ms, digest=digest)
        return Staged(tmp.name, want, temporary=True, assembled=True, bytes_read=read, ms=ms, digest=digest)

    def unstage(self, staged: Staged) -> None:
        """After the engine read it: a temporary assembly goes."""
        if staged.temporary and staged.name.startswith(TEMP_PREFIX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.staging / staged.name)

    def _copy_in(self, name: str, meta: Meta | None) -> Staged:
        """A whole file of a separate store, copied into staging (kept as a copy)."""
        hot, src = self.staging / name, self.path / name
        if meta is not None:
            have = self._hot_whole(name, meta)
            if have is not None:
                self.hot_used(name)
                return Staged(name, digest=have or None)
        if not src.exists():
            if hot.exists() and meta is None and not AUTO_BIN.match(name):
                return Staged(name)  # a person's file the engine wrote into staging itself
            raise Refused(f"{name} is not in {self.path}", bad=False)
        tmp = self.staging / f"{TEMP_PREFIX}{name}.{uuid.uuid4().hex[:8]}.copy.partial"
        try:
            f, _ = files.open_regular(src)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.mode)
            with f, os.fdopen(fd, "wb") as out:
                self._own(out.fileno(), tmp)
                while chunk := f.read(files.CHUNK):
                    out.write(chunk)
            os.replace(tmp, hot)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        self._hot_added(name, meta)
        return Staged(name, digest=meta.digest if meta is not None else None)

    def _bad_block(self, e: BadBlock, refs: list[BlockRef]) -> list[str]:
        """A block that failed its check: moved aside, and the manifests naming it removed (they
        cannot be assembled); → their names."""
        key = next((r.key for r in refs if r.key in str(e)), None)
        if key is None or self.blocks is None:
            return []
        self.blocks.quarantine(key, self.path / "quarantine")
        log.warning("auto sessions: block %s moved aside: %s", key, e)
        return self._drop_manifests_of(key)

    def block_paths(self, name: str, n_tokens: int | None = None) -> list[Path]:
        """The files a restore of `name` (its first n_tokens) would read: its hot copy when there
        is one, else its blocks (for warming them into the page cache)."""
        m = AUTO_BIN.match(name)
        meta = self._meta_at(self.meta_path(m.group(1))) if m else None
        if meta is None or not meta.in_blocks or self.blocks is None:
            return [self.staging / name] if (self.staging / name).exists() else [self.path / name]
        if (self.staging / name).exists():
            return [self.staging / name]
        n = meta.n_cells if n_tokens is None else min(n_tokens, meta.n_cells)
        out, at = [], 0
        for key, cells, _ in meta.blocks:
            if at >= n:
                break
            out.append(self.blocks.path(key))
            at += cells
        return out
