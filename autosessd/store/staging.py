"""The staging directory (issue 39): where the engine writes its saves and reads its restores
(its --slot-save-path, `slot_save_path`), as opposed to the store (`store_path`, the same
directory unless set) where autosessd keeps them durable. On tmpfs, the engine's whole-file
writes never reach the disk: only the blocks a save adds do.

What lives in staging besides the temporaries being written:

    hot copies    auto-<key>.bin of a conversation kept as blocks (the engine's own file, or one
                  assembled from blocks), kept within `budget` bytes, the least recently used
                  going first: a return finds its file there and restores it as is. Never
                  durable, never needed: one that is gone, or fails its check, is assembled again
    assembled     .autosessd-<key>.<hex>.asm.partial, the first n tokens of a conversation
                  assembled for one restore (a request sharing only part of it), removed after
    copies        with a separate store, a whole file's copy the engine reads (a sliding-window
                  model's save, a person's parked file), kept as a hot copy

Staging is an object the Store owns and hands what it needs: the block store, a reader of the
manifests, the one lock, and who holds a name. It keeps one record per copy (Copy): its
identity, its digest and the save it copies. A copy is trusted as it is when its identity is
the one recorded in this process's life for the save it copies; otherwise (after a restart: a
copy is never fsynced, a crash can leave it with the right size and holes in it) its digest is
checked against the save's before the engine reads it, and one that cannot be checked so (an
assembly's digest is its own) is assembled again.

stage(name, n) says which name the engine reads for a file: its copy when whole, else what it
assembles or copies. The blocks a manifest names are pinned in the same section as the
manifest is read, so no finalize of the same name and no sweep removes one before it is read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..base import files
from ..base.files import Ident
from . import blocks, cutting
from .blocks import BadBlock, BlockRef, BlockStore, OtherBlock, TailRef, Unreadable
from .kvfile import Shape
from .names import AUTO_BIN, TEMP_PREFIX, Meta, StoreError

log = logging.getLogger("autosessd")


class Refused(StoreError):
    """A file that may not be handed to the engine; bad: damaged (moved aside), not just absent
    or unreadable for now. cut: the session files whose manifests were cut back to the blocks
    before a damaged one (their first tokens are still restorable), by name."""

    def __init__(self, why: str, bad: bool = True, cut: tuple[str, ...] = ()):
        super().__init__(why)
        self.bad = bad
        self.cut = cut


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
    tail: bool = False  # a two-part save (kvfile.py): restored whole, its blocks and its tail


@dataclass(frozen=True)
class Copy:
    """A hot copy's one record: its bytes, the identity it had when this process made or
    checked it (None: found at start, not checked yet), its digest (None: not known) and the
    save it copies (the manifest's saved_at; None: not known)."""

    size: int
    ident: Ident | None = None
    digest: str | None = None
    of: float | None = None


# What Staging is given by its Store.
ReadManifest = Callable[[str], "tuple[Meta | None, Ident | None]"]  # key → (metadata, its file's identity)
# (block key, why, only this manifest or None: every one naming it) → the names cut back or removed
BadBlockFound = Callable[[str, str, "str | None"], "tuple[str, ...]"]


class Staging:
    """The staging directory's copies and assemblies (see the module's docstring). Every method
    is safe from any thread; the records under `lock` (the Store's), no I/O under it but the
    renames that take a name, and no unlink of a copy."""

    def __init__(self, directory: Path, store_dir: Path, block_store: BlockStore, read_manifest: ReadManifest,
                 lock: threading.RLock, mode: int, own: Callable[[int, Path], None],
                 holders: Callable[[str], int], bad_block: BadBlockFound, budget: int):
        """holders(name): how many hold the name now (Store.in_use, and a restore reading a
        temporary): a held copy is never let go. bad_block: what the Store does with a block
        found damaged (quarantine, its manifests cut back)."""
        self.dir = directory
        self.store_dir = store_dir
        self.blocks = block_store
        self._read_manifest = read_manifest
        self.lock = lock
        self.mode = mode
        self._own = own
        self._holders = holders
        self._bad_block = bad_block
        self.budget = budget
        self._copies: OrderedDict[str, Copy] = OrderedDict()  # least recently used first
        self.assembled_bytes = 0  # block bytes read to assemble files since the start
        self.assemblies = 0
        self.read_errors = 0  # assemblies that failed for an error of the process or the system

    def path(self, key: str) -> Path:
        return self.dir / f"auto-{key}.bin"

    # -- the copies ----------------------------------------------------------------------------
    def added(self, name: str, meta: Meta | None = None, digest: str | None = None, held: int = 0) -> None:
        """A copy just put in staging by this process: recorded (with the save it copies, as
        checked: meta.saved_at and digest, the save's own unless given), then the least recently
        used beyond the budget go — this one too when it does not fit, unless someone other
        than the caller (its `held` holds) holds it."""
        ident = files.regular_ident(self.dir / name)
        if ident is None:
            return
        with self.lock:
            self._copies[name] = Copy(ident.size, ident, digest or (meta.digest if meta else None),
                                      meta.saved_at if meta else None)
            self._copies.move_to_end(name)
        self.trim({name: held} if held else None)

    def cleanup(self) -> list[str]:
        """At start: staging's temporaries go (where staging is not the store: there the store's
        own cleanup has them); its copies stay as copies when their metadata says their size
        (their digest is checked before the engine reads one: whole()), the oldest first in the
        budget's order; any other copy goes. → what went."""
        removed = []
        try:
            names = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return removed
        found = []
        for name in names:
            path = self.dir / name
            if self.dir != self.store_dir and name.startswith(TEMP_PREFIX) and name.endswith(".partial"):
                if _unlink(path):
                    removed.append(f"{name} (leftover temporary in staging)")
                continue
            m = AUTO_BIN.match(name)
            if m is None:
                continue
            meta = self._read_manifest(m.group(1))[0]
            if self.dir == self.store_dir and (meta is None or not meta.in_blocks):
                continue  # a whole file: the store's own
            ident = files.regular_ident(path)
            if meta is None or ident is None or ident.size != meta.bytes:
                if _unlink(path):
                    removed.append(f"{name} (a copy in staging nothing vouches for)")
                continue
            found.append((ident, name))
        with self.lock:
            for ident, name in sorted(found, key=lambda x: x[0].ctime_ns):
                self._copies[name] = Copy(ident.size)  # trusted only after its digest (whole())
        self.trim()
        return removed

    def used(self, name: str) -> None:
        with self.lock:
            if name in self._copies:
                self._copies.move_to_end(name)

    def held(self, name: str) -> bool:
        return self._holders(name) > 0

    def registered(self, name: str) -> bool:
        with self.lock:
            return name in self._copies

    def drop_record(self, name: str) -> None:
        """The name is not a copy any more (the store's own whole file in its own directory)."""
        with self.lock:
            self._copies.pop(name, None)

    def set_aside(self, name: str) -> tuple[Path, int] | None:
        """Under lock: the copy out of the records and renamed aside (the caller unlinks it
        outside the lock: a multi-GB unlink on a disk is not held under it)."""
        rec = self._copies.pop(name, None)
        if rec is None:
            return None
        dead = self.dir / f"{TEMP_PREFIX}{name}.{uuid.uuid4().hex[:8]}.evicted.partial"
        try:
            os.rename(self.dir / name, dead)
        except FileNotFoundError:
            return None
        return dead, rec.size

    def _free(self, name: str, own: dict[str, int] | None) -> bool:
        return self._holders(name) <= (own or {}).get(name, 0)

    def _let_go(self, enough: Callable[[int], bool], own: dict[str, int] | None = None) -> int:
        """Copies let go, least recently used first, never one held (but by `own`'s holds),
        until enough(bytes freed so far). → bytes freed."""
        freed = 0
        while True:
            with self.lock:
                if enough(freed):
                    return freed
                victim = next((n for n in self._copies if self._free(n, own)), None)
                if victim is None:
                    return freed
                got = self.set_aside(victim)
            if got is not None:
                with contextlib.suppress(FileNotFoundError):
                    got[0].unlink()
                freed += got[1]

    def trim(self, own: dict[str, int] | None = None) -> int:
        """The least recently used copies removed until the rest fit the budget. own: holds of
        a name that are the caller's own (they do not keep it). → bytes removed."""
        return self._let_go(lambda _: sum(c.size for c in self._copies.values()) <= self.budget, own)

    def make_room(self, n_bytes: int) -> int:
        """Copies let go, least recently used first, until n_bytes are freed (a save needs the
        room): → bytes freed."""
        return self._let_go(lambda freed: freed >= n_bytes)

    def forget(self, name: str) -> int:
        """A copy dropped (its conversation removed): → its bytes. Only a recorded copy is
        removed, never the store's own whole file under the same name."""
        with self.lock:
            got = self.set_aside(name)
        if got is None:
            return 0
        with contextlib.suppress(FileNotFoundError):
            got[0].unlink()
        return got[1]

    def usage(self) -> dict[str, int]:
        with self.lock:
            return {"files": len(self._copies), "bytes": sum(c.size for c in self._copies.values()),
                    "budget": self.budget, "read_errors": self.read_errors}

    def whole(self, name: str, meta: Meta) -> str | None:
        """The copy of `name` is the save `meta` is: → its digest ("" when not known); None when
        it is not (or cannot be told: then it goes, and is assembled again)."""
        path = self.dir / name
        ident = files.regular_ident(path)
        if ident is None or ident.size != meta.bytes:
            return None
        with self.lock:
            rec = self._copies.get(name)
        if rec is not None and rec.ident == ident and rec.of == meta.saved_at:
            return rec.digest or ""
        if meta.digest is None:
            return None
        try:
            digest, now = files.digest_file(path)
        except OSError:
            return None
        if digest != meta.digest:
            if rec is not None:  # found at start or changed since: not this save's bytes
                log.info("auto sessions: the copy %s in staging is not its save's bytes: assembled again", name)
                self.forget(name)
            return None
        with self.lock:
            if name in self._copies:
                self._copies[name] = Copy(now.size, now, digest, meta.saved_at)
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
        key = m.group(1) if m else None
        meta, meta_ident, pins = self.pinned_manifest(key) if key else (None, None, [])
        try:
            if meta is None or not meta.in_blocks:
                if self.dir == self.store_dir:
                    return Staged(name, digest=meta.digest if meta is not None else None)
                return self._copy_in(name, meta)
            have = self.whole(name, meta)
            if have is not None:
                self.used(name)
                return Staged(name, digest=have or None, tail=bool(meta.tail))
            try:
                return self._assemble(name, key, meta, meta_ident, n_tokens)
            except Unreadable as e:  # an error of the process or the system: once more, then this restore fails
                log.info("auto sessions: assembling %s: %s; reading it again", name, e)
                try:
                    return self._assemble(name, key, meta, meta_ident, n_tokens)
                except Unreadable as e2:
                    with self.lock:
                        self.read_errors += 1
                    raise Refused(f"{name}: {e2} (the blocks are kept; the next restore reads them again)",
                                  bad=False) from None
        finally:
            self.blocks.unpin(pins)

    def pinned_manifest(self, key: str) -> tuple[Meta | None, Ident | None, list[str]]:
        """The manifest of `key` with its blocks pinned as it is: read (parsed, the first time)
        outside the lock, then under it looked at again (a stat: its parse is cached by its
        identity) and pinned only if it is still that file; read again if a save replaced it
        meanwhile. No save of the same name, no sweep, takes a block between the read and the pin."""
        while True:
            meta, ident = self._read_manifest(key)
            with self.lock:
                _, now = self._read_manifest(key)
                if now == ident:
                    keys = list(meta.block_keys) if meta is not None else []
                    return meta, ident, self.blocks.pin(keys)

    def _assemble(self, name: str, key: str, meta: Meta, meta_ident: Ident | None, n_tokens: int | None) -> Staged:
        t0 = time.monotonic()
        tokens = meta.tokens or b""
        n_all = len(tokens) // 4
        # A file with a tail is restored whole: its tail is the state at its last position only.
        want = n_all if n_tokens is None or meta.tail else max(1, min(n_tokens, n_all))
        cells = min(want, meta.n_cells)
        shape = Shape.from_json(meta.kv)
        refs = [BlockRef(*b) for b in meta.blocks]
        tail = TailRef(*meta.tail) if meta.tail else None
        tmp: Path | None = self.dir / f"{TEMP_PREFIX}{key}.{uuid.uuid4().hex[:8]}.asm.partial"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.mode)
            with os.fdopen(fd, "wb") as out:
                self._own(out.fileno(), tmp)
                digest = cutting.assemble(self.blocks, shape, tokens[:4 * want], refs, cells, out, tail)
        except BadBlock as e:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            bad = e.key if isinstance(e, OtherBlock) else \
                next((k for k in meta.block_keys if k in str(e)), None)
            # A whole block of other bytes condemns this manifest's tail only; damage, the block
            # and every manifest's tail from it.
            changed = self._bad_block(bad, str(e), key if isinstance(e, OtherBlock) else None) if bad else ()
            raise Refused(f"{name}: {e}" + (f" (cut back or removed: {', '.join(changed)})" if changed else ""),
                          cut=changed) from None
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        read = sum(blocks.payload_size(shape, r.n_cells)
                   for r in refs[:(cells + blocks.BLOCK_TOKENS - 1) // blocks.BLOCK_TOKENS]) + (tail.size if tail else 0)
        with self.lock:
            self.assembled_bytes += read
            self.assemblies += 1
        ms = (time.monotonic() - t0) * 1000
        if want >= n_all:
            size = os.path.getsize(tmp)
            with self.lock:  # kept as the copy only while nobody else holds the name (a finalize of
                # a newer save), its manifest is the one assembled, and it fits the budget
                if self._holders(name) <= 1 and size <= self.budget \
                        and files.regular_ident(self.store_dir / f"auto-{key}.json") == meta_ident:
                    os.replace(tmp, self.dir / name)
                    tmp = None
            if tmp is None:
                self.added(name, meta, digest)  # held by the caller until the engine read it: it stays till then
                return Staged(name, None, assembled=True, bytes_read=read, ms=ms, digest=digest, tail=tail is not None)
        return Staged(tmp.name, want, temporary=True, assembled=True, bytes_read=read, ms=ms, digest=digest,
                      tail=tail is not None)

    def unstage(self, staged: Staged) -> None:
        """After the engine read it: a temporary assembly goes."""
        if staged.temporary and staged.name.startswith(TEMP_PREFIX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir / staged.name)

    def _copy_in(self, name: str, meta: Meta | None) -> Staged:
        """A whole file of a separate store, copied into staging: kept as a copy when it fits the
        budget, else a temporary for this restore."""
        hot, src = self.dir / name, self.store_dir / name
        if meta is not None:
            have = self.whole(name, meta)
            if have is not None:
                self.used(name)
                return Staged(name, digest=have or None)
        if not src.exists():
            if hot.exists() and meta is None and not AUTO_BIN.match(name):
                return Staged(name)  # a person's file the engine wrote into staging itself
            raise Refused(f"{name} is not in {self.store_dir}", bad=False)
        tmp = self.dir / f"{TEMP_PREFIX}{name}.{uuid.uuid4().hex[:8]}.copy.partial"
        try:
            f, st = files.open_regular(src)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.mode)
            with f, os.fdopen(fd, "wb") as out:
                self._own(out.fileno(), tmp)
                while chunk := f.read(files.CHUNK):
                    out.write(chunk)
            if st.st_size > self.budget:  # read once, from a temporary that goes after the restore
                return Staged(tmp.name, temporary=True, digest=meta.digest if meta is not None else None)
            os.replace(tmp, hot)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        self.added(name, meta)  # held by the caller until the engine read it: it stays till then
        return Staged(name, digest=meta.digest if meta is not None else None)

    def block_paths(self, name: str, n_tokens: int | None = None) -> list[Path]:
        """The files a restore of `name` (its first n_tokens) would read: its copy when there is
        one, else its blocks (for warming them into the page cache)."""
        m = AUTO_BIN.match(name)
        meta = self._read_manifest(m.group(1))[0] if m else None
        if meta is None or not meta.in_blocks:
            return [self.dir / name] if (self.dir / name).exists() else [self.store_dir / name]
        if (self.dir / name).exists():
            return [self.dir / name]
        n = meta.n_cells if n_tokens is None or meta.tail else min(n_tokens, meta.n_cells)
        out, at = [], 0
        for key, cells, _ in meta.blocks:
            if at >= n:
                break
            out.append(self.blocks.path(key))
            at += cells
        if meta.tail:
            out.append(self.blocks.path(meta.tail[0]))
        return out


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return False
