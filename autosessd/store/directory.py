"""The session directory (DESIGN §4): names, metadata, atomic finalize, scan, prune.

The directory is shared with the engine (unless store_path sets the store apart from the
engine's staging directory: staging.py). autosessd owns exactly `auto-<16 hex>.bin` and
`auto-<16 hex>.json`, its temporaries `.autosessd-*`, `blocks/` (blocks.py: a conversation kept
as token blocks, its metadata the manifest and its .bin, if any, a copy) and
`.autosessd-quarantine/`; every other file is a person's and is never touched.

How a save becomes visible (no torn `auto-*.bin`, ever): saving.py, Store's save path.

Before a restore, check_whole() says whether the file is still the one saved: a regular
file (never a link), its size that of its metadata, always; and when its identity (inode,
mtime, size) is not the one its digest was last checked at, its digest again (a file copied
back from a backup, touched by a tool, or damaged in place). The engine aborts on a state
file one byte short: no file reaches it unchecked.

<key> is the conversation's first-message key; <target> is that key, or the branch key
sessions/facade.py chose from the file's tokens (branches.save_key) when another conversation of
the same first message holds auto-<key>.bin.

Both files hold a conversation (the state file its tokens, the metadata its key), so
every file autosessd makes visible is 0600, or 0640 with its group set to
control.group: the engine writes the state file under its own umask (often 0644), and
the mode is fixed before the rename, so no reader ever sees it open to others.

verify_temp runs before the turn goes on (it is a stat); finalize runs off the
request's path. A crash between the two renames leaves a .bin whose metadata is
missing or stale (its `bytes` differ from the file): `cleanup()` at start removes
such pairs, together with leftover temporaries and metadata without a .bin.

A download from the shared bucket (autosessd/shared/) comes in through install(): its
temporary, already whole and fsynced, and its metadata (fsynced to a temporary of its own
first) are renamed in place together under _lock, after a last look that nobody else holds
the name and that no local save at least as new is there; the directory is fsynced after
the lock is let go. See install() for what a crash leaves.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Iterator


from ..base import files
from ..base.files import Ident
from .installing import Installing
from .integrity import Integrity
from .names import (AUTO_BIN, AUTO_META, FILE_MODE, GROUP_FILE_MODE, QUARANTINE, QUARANTINE_KEEP_S, TEMP_PREFIX,  # noqa: F401
                    InUse, Meta, NewerHere, StoreError, auto_name, fsync_dir, manual_name, meta_name,
                    temp_name)  # names re-exported for callers
from .blocks import BlockStore
from .prune import Entry, PrunePlan, plan_prune
from .saving import Saving
from .staging import Staged, Staging
from .space import Space

log = logging.getLogger("autosessd")


class Store(Saving, Installing, Integrity, Space):
    """The session directory. Used from the event loop and from worker threads (finalize,
    prune, status, ls and the shared tier's downloads run in threads).

    Every method is safe from any thread. in_use and the metadata cache are read and
    changed only under _lock; acquire, release, using and users take it for a counter
    change. What else runs under _lock, and so bounds how long acquire() waits on the loop:
      remove()    the in_use check, one stat and one rename away (the unlink comes after):
                  once acquire(name) has returned, no prune or remove deletes that file
      install()   the in_use check, one metadata read and two renames: no acquire() and no
                  other install between the look and the renames
      scan()      the metadata cache's updates (no I/O)
      read_temp() one lstat; a finalize's rename of a temporary waits on _unread (releasing
                  _lock) until no restore reads it, then renames under it
      metadata    every rename of a metadata file and the naming of the blocks it names
                  (_named, BlockStore.name), so that a sweep sees a block named or pinned
      blocks, copies  a sweep's look at what is named or pinned and the renames aside of the
                  rest (BlockStore), or of a copy in staging beyond its budget (Staging); their
                  unlink comes after the lock
      stage()     the manifest's read and the pins of its blocks; whether an assembly may take
                  the copy's name (nobody else holds it, its manifest unchanged) and that rename

    The store is made of two objects it owns and wires: `blocks` (BlockStore: every block's
    life) and `hot` (Staging: the copies and assemblies in staging, given a manifest reader),
    both under this one lock. Saving (the save path, and install: a download's), Integrity (a
    whole file's checks, the quarantine, a damaged block's manifests cut back) and Space (a
    save's room) are the directory's own halves.
    Nothing fsyncs under _lock, and nothing large is unlinked under it. finalize takes no lock: a local save holds acquire(final)
    from before its finalize to after it, which is what install() looks for.
    """

    def __init__(self, path: str | Path, group: int | None = None, staging: str | Path | None = None,
                 blocks: bool = True, hot_budget: int = 4 << 30):
        """path: the store (store_path: manifests, blocks, whole files); staging: the engine's
        directory (slot_save_path; default: the store itself). group: the gid of control.group;
        files are then 0640 and belong to it. blocks: cut saves into token blocks where the
        engine's file allows it (blocks.py); hot_budget: bytes of hot copies kept in staging."""
        self.path = Path(path)
        self.staging = Path(staging) if staging is not None else self.path
        self.group = group
        self.mode = FILE_MODE if group is None else GROUP_FILE_MODE
        self._lock = threading.RLock()  # the directory's one lock (the class docstring)
        # Always there to read and clean up what is kept as blocks; `cut` says whether new saves
        # are cut into blocks (store_blocks): with it off, conversations kept so stay readable.
        # It owns every block's life: which manifests name it, who pins it, its removal.
        self.blocks: BlockStore | None = BlockStore(self.path, self.mode, self._lock)
        self.cut = blocks
        # The copies and assemblies in staging, given what they need of the directory.
        self.hot = Staging(self.staging, self.path, self.blocks, self._read_manifest, self._lock, self.mode,
                           self._own, self._holders, self._bad_block, hot_budget)
        self._mode_warned = False
        self.claim: int | None = None  # a tmpfs staging's claim, locked while this store uses it (places.claim)
        # Bytes per token of the densest file seen (None: not looked yet). Set by the first
        # scan with metadata, raised by every finalize: a save's space check reads it
        # instead of scanning the directory on the event loop.
        self._per_token: float | None = None
        # Names being written or read right now; prune never removes them. Under _lock.
        self.in_use: Counter[str] = Counter()
        # Temporaries the engine reads now (read_temp), by name: their finalize renames them only
        # once this count is back to 0. Under _lock; _unread is told of every release.
        self._temp_readers: Counter[str] = Counter()
        self._unread = threading.Condition(self._lock)
        # Parsed metadata by name, valid while the file's (inode, mtime, size) is unchanged: a scan
        # of thousands of sessions stats them instead of reading every JSON again.
        self._meta_cache: dict[str, tuple[Ident, Meta]] = {}
        # Files whose identity changed since their metadata's digest check, checked again this
        # run and found whole: name → (identity, digest).
        self._checked: dict[str, tuple[Ident, str]] = {}

    # -- blocks and staging: the objects the store is made of ----------------------------------
    @property
    def hot_budget(self) -> int:
        return self.hot.budget

    @hot_budget.setter
    def hot_budget(self, n: int) -> None:
        self.hot.budget = n

    def hot_path(self, key: str) -> Path:
        return self.hot.path(key)

    def stage(self, name: str, n_tokens: int | None = None) -> Staged:
        """What the engine reads for `name` (Staging.stage). The caller holds the name."""
        return self.hot.stage(name, n_tokens)

    def unstage(self, staged: Staged) -> None:
        self.hot.unstage(staged)

    def trim_hot(self) -> int:
        return self.hot.trim()

    def hot_copies(self) -> dict[str, int]:
        return self.hot.usage()

    def block_paths(self, name: str, n_tokens: int | None = None) -> list[Path]:
        return self.hot.block_paths(name, n_tokens)

    def usage(self) -> dict:
        """What the store holds (status): manifests and blocks (each once), and hot copies."""
        out: dict = self.blocks.usage() if self.blocks is not None else {}
        return {**out, "hot": self.hot.usage()}

    def block_refs(self) -> dict[str, int]:
        """How many manifests name each block."""
        out: Counter[str] = Counter()
        for keys in (self.blocks.manifests().values() if self.blocks is not None else ()):
            out.update(set(keys))
        return dict(out)

    def _holders(self, name: str) -> int:
        with self._lock:
            return self.in_use.get(name, 0) + self._temp_readers.get(name, 0)

    def _read_manifest(self, key: str) -> tuple[Meta | None, Ident | None]:
        """auto-<key>.json and its identity (None, None: none, or not readable)."""
        path = self.meta_path(key)
        try:
            ident = files.regular_ident(path)
            return (self._meta_at(path) if ident is not None else None), ident
        except (OSError, ValueError, KeyError, TypeError):
            return None, None

    def _named(self, key: str, meta: Meta | None) -> tuple[str, ...]:
        """auto-<key>.json is now `meta` (None: gone): the blocks it names are the block store's
        to know, and when it is a whole file in the store's own directory its .bin is the
        store's, no copy (the copies' budget never removes it). Under _lock, in the section that
        renamed the metadata. → the blocks it named before (a sweep of them may free some)."""
        keys = meta.block_keys if meta is not None else ()
        with self._lock:
            old = self.blocks.naming(key) if self.blocks is not None else ()
            if self.blocks is not None:
                self.blocks.name(key, keys)
            if not keys and meta is not None and self.staging == self.path:
                self.hot.drop_record(auto_name(key))
        return old

    # -- names -------------------------------------------------------------
    # -- names -------------------------------------------------------------
    def bin_path(self, key: str) -> Path:
        return self.path / auto_name(key)

    def meta_path(self, key: str) -> Path:
        return self.path / meta_name(key)

    def temp_path(self, key: str) -> Path:
        return self.staging / temp_name(key)

    def acquire(self, name: str) -> None:
        """Mark a name as being written or read: prune, remove and install leave it alone.
        Waits at most for one of the short sections under _lock (the class docstring)."""
        with self._lock:
            self.in_use[name] += 1

    def release(self, name: str) -> None:
        with self._lock:
            self.in_use[name] -= 1
            if self.in_use[name] <= 0:
                del self.in_use[name]

    def users(self, name: str) -> int:
        """How many holders the name has right now (acquire() counts one each)."""
        with self._lock:
            return self.in_use.get(name, 0)

    @contextlib.contextmanager
    def using(self, name: str) -> Iterator[None]:
        self.acquire(name)
        try:
            yield
        finally:
            self.release(name)

    def discard_temp(self, key: str) -> None:
        try:
            self.temp_path(key).unlink()
        except FileNotFoundError:
            pass

    # -- reading -----------------------------------------------------------
    def read_meta(self, key: str) -> Meta | None:
        """Metadata of auto-<key>.bin, or None when the pair is missing or disagrees (a .bin
        that is not a regular file has none). Read as files.read_small reads (a FIFO, a link
        or a huge file under the name is refused, never waited on), and cached by the
        metadata file's identity: a turn on the loop costs two lstats."""
        try:
            meta = self._meta_at(self.meta_path(key))
            if meta is not None and meta.key == key and meta.in_blocks:
                return meta  # a manifest: its blocks are the file; a .bin is only a copy
            ident = files.regular_ident(self.bin_path(key)) if meta is not None else None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if meta is None or ident is None or meta.key != key or meta.bytes != ident.size:
            return None
        return meta

    def _meta_at(self, path: Path) -> Meta | None:
        ident = files.regular_ident(path)
        if ident is None:
            return None
        with self._lock:
            hit = self._meta_cache.get(path.name)
        if hit is not None and hit[0] == ident:
            return hit[1]
        meta = Meta.from_json(files.read_small(path))
        with self._lock:
            self._meta_cache[path.name] = (ident, meta)
        return meta

    def scan(self, with_meta: bool = True) -> list[Entry]:
        """The auto files: whole files and block manifests. Without metadata (status, prune:
        sizes and ages are enough) a scan of 10,000 sessions costs half as much; an entry's age
        is then its file's mtime, and a manifest's blocks are the ones kept in memory."""
        entries = []
        metas: dict[str, Meta] = {}
        bins: dict[str, os.stat_result] = {}
        jsons: dict[str, os.stat_result] = {}
        try:
            it = os.scandir(self.path)
        except FileNotFoundError:
            return []
        uses = self.blocks.manifests() if self.blocks is not None else {}
        with it:
            for d in it:
                if m := AUTO_BIN.match(d.name):
                    try:
                        bins[m.group(1)] = d.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        pass
                elif m := AUTO_META.match(d.name):
                    try:
                        if m.group(1) in uses:
                            jsons[m.group(1)] = d.stat(follow_symlinks=False)
                        if with_meta:
                            metas[m.group(1)] = self._cached_meta(d)
                    except (OSError, ValueError, KeyError, TypeError):
                        pass
        if with_meta and len(self._meta_cache) > len(metas):
            live = {meta_name(k) for k in metas}
            with self._lock:  # another thread's scan may be adding to it
                self._meta_cache = {k: v for k, v in self._meta_cache.items() if k in live}
        for key, st in jsons.items():  # a manifest: its blocks hold it; a .bin of it is a copy
            meta = metas.get(key)
            if with_meta and (meta is None or not meta.in_blocks or meta.key != key):
                continue
            entries.append(Entry(key=key, bytes=meta.bytes if meta else 0, mtime=st.st_mtime, meta=meta,
                                 ident=(st.st_ino, st.st_mtime_ns, st.st_size), blocks=uses[key]))
        for key, st in bins.items():
            if key in jsons:
                continue
            meta = metas.get(key)
            if meta is not None and (meta.bytes != st.st_size or meta.key != key or meta.in_blocks):
                meta = None
            entries.append(Entry(key=key, bytes=st.st_size, mtime=st.st_mtime, meta=meta,
                                 ident=(st.st_ino, st.st_mtime_ns, st.st_size)))
        if with_meta:
            if self._per_token is None:
                self._per_token = 0.0  # looked: nothing saved yet
            for e in entries:
                if e.meta is not None:
                    self._saw(e.meta)
        return entries

    def _cached_meta(self, d: os.DirEntry) -> Meta:
        meta = self._meta_at(Path(d.path))
        if meta is None:
            raise ValueError(f"{d.name} is not a regular file")
        return meta

    def manual_files(self) -> list[tuple[str, int, float]]:
        """Other .bin files in the directory (parked by name, or saved by hand)."""
        out = []
        with os.scandir(self.path) as it:
            for d in it:
                if d.name.endswith(".bin") and not AUTO_BIN.match(d.name) and not d.name.startswith("."):
                    try:
                        st = d.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    out.append((d.name, st.st_size, st.st_mtime))
        return out

    # -- cleanup and removal -----------------------------------------------
    def cleanup(self) -> list[str]:
        """At start: remove leftover temporaries (the store's, staging's, the blocks'), metadata
        whose file is gone (a manifest's file is its blocks: it stays while they are all
        there), .bin files whose metadata is missing or stale (an interrupted finalize), copies
        in staging nothing vouches for, and blocks no manifest names. Learns the manifests'
        blocks and the hot copies. Returns what went."""
        removed: list[str] = []
        self._per_token = self._per_token or 0.0
        names = set(os.listdir(self.path))
        blocks_there = self.blocks.scan() if self.blocks is not None else {}
        damaged: list[tuple[str, str]] = []  # manifests naming a missing block: cut back to before it
        for name in sorted(names):
            why = None
            if name.startswith(TEMP_PREFIX) and name.endswith(".partial"):
                why = "leftover temporary"
            elif m := AUTO_META.match(name):
                key = m.group(1)
                try:
                    meta = self._meta_at(self.path / name)
                except (OSError, ValueError, KeyError, TypeError):
                    meta = None
                if meta is not None and meta.key == key and meta.in_blocks:
                    self._named(key, meta)
                    self._saw(meta)
                    missing = [k for k in meta.block_keys if k not in blocks_there]
                    if missing:
                        damaged.append((key, missing[0]))
                elif auto_name(key) not in names:
                    why = "metadata without a session file"
            elif m := AUTO_BIN.match(name):
                meta = self.read_meta(m.group(1))
                if meta is None:
                    why = "no valid metadata (interrupted save)"
                    self._unlink(self.meta_path(m.group(1)))
                elif meta.in_blocks:
                    if self.staging != self.path:  # a whole file of it from before its blocks
                        why = "a whole file its blocks replaced"
                else:
                    self._saw(meta)  # the start's look at every file primes the space estimate
            if why and self._unlink(self.path / name):
                removed.append(f"{name} ({why})")
        for key, missing in damaged:
            self._unlink(self.bin_path(key))  # its copy there holds the blocks it lost
            if self._cut_back(key, missing):
                removed.append(f"{meta_name(key)}'s blocks from {missing} on (the block is missing)")
        removed += self.hot.cleanup()
        if self.blocks is not None:
            removed += self.blocks.cleanup()
            n, freed = self.blocks.sweep()
            if n:
                removed.append(f"{n} block(s) no manifest names ({freed:,} bytes)")
        if removed:
            fsync_dir(self.path)
        return removed

    def remove(self, key: str, ident: tuple[int, int, int] | None = None) -> int:
        """Remove conversation `key`: auto-<key>.bin and its metadata (bin first: no session
        without metadata is ever left for a reader), or a manifest (first: its name is gone at
        once), its copy in staging, and the blocks no other manifest names. Returns the bytes
        freed. Refuses a file in use, and with `ident` (inode, mtime_ns, size), a file that is
        not that one (saved again since the caller looked: of the .bin, or of a manifest)."""
        doomed = self.path / f"{TEMP_PREFIX}{key}.removing.partial"  # a leftover goes at the next start
        with self._lock:  # no acquire() between the check and the rename away
            in_blocks = self.blocks is not None and bool(self.blocks.naming(key))
            path = self.meta_path(key) if in_blocks else self.bin_path(key)
            if auto_name(key) in self.in_use:
                raise StoreError(f"{auto_name(key)} is being written or read")
            try:
                st = path.stat()
                if ident is not None and (st.st_ino, st.st_mtime_ns, st.st_size) != ident:
                    raise StoreError(f"{auto_name(key)} was saved again since it was planned for removal")
                size = st.st_size
                os.rename(path, doomed)  # the name is gone at once; a multi-GB unlink is not held under the lock
                self._named(key, None)
            except FileNotFoundError:
                size = 0
        self._unlink(doomed)
        if self.blocks is not None:
            # Its blocks, and those its earlier saves named (a last block since replaced, blocks
            # before a whole save), that nothing else names or pins: forget leaves none of them.
            size += self.blocks.sweep_dropped()[1]
        if in_blocks:
            size += self.hot.forget(auto_name(key))
            self._unlink(self.bin_path(key))  # a copy in the same directory, not recorded yet
        else:
            self._unlink(self.meta_path(key))
            if self.staging != self.path:
                size += self.hot.forget(auto_name(key))
        return size

    def copies_on_store_disk(self) -> int:
        """Bytes of the copies in staging that lie on the store's filesystem (staging is the
        store, or a directory of the same disk): they count in the store's budget."""
        try:
            same = os.stat(self.staging).st_dev == os.stat(self.path).st_dev
        except OSError:
            return 0
        return self.hot.usage()["bytes"] if same else 0

    def prune(self, keep: int, max_bytes: int, dry_run: bool = False, free_target: int = 0) -> PrunePlan:
        """Apply plan_prune (in a worker thread: see the class docstring); free_target: bytes
        that should be free on the disk afterwards. Blocks count once, whichever conversations
        share them. Copies in staging on the store's disk count in max_bytes and go first,
        always: a conversation is removed only for what the durable files alone exceed, and for
        what a refused save needs beyond what the copies freed. Then the blocks nothing names or
        pins are swept. Returns what was really removed."""
        must_free = max(0, free_target - self.free_bytes()) if free_target else 0
        if must_free and not dry_run and self.copies_on_store_disk():  # copies on tmpfs free memory, not disk
            must_free = max(0, must_free - self.hot.make_room(must_free))
        with self._lock:
            in_use = set(self.in_use)  # a snapshot: the loop changes in_use meanwhile
        block_bytes = self.blocks.scan() if self.blocks is not None else {}
        plan = plan_prune(self.scan(with_meta=False), keep, max_bytes, in_use, must_free, block_bytes)
        if dry_run:
            return plan
        copies = self.copies_on_store_disk()
        if copies:
            kept = plan.kept_bytes
            if kept + copies > max_bytes:
                self.hot.make_room(kept + copies - max_bytes)
        removed, kept_entries = [], list(plan.keep)
        for e in plan.remove:
            try:
                self.remove(e.key, e.ident)
                removed.append(e)
            except StoreError:  # taken into use, or saved again, since the plan: kept
                kept_entries.append(e)
        if self.blocks is not None:
            self.blocks.sweep()  # the blocks no manifest names any more (a save's old last block, say)
        self.prune_quarantine(QUARANTINE_KEEP_S)
        return PrunePlan(remove=removed, keep=kept_entries, block_bytes=plan.block_bytes)

    @staticmethod
    def _unlink(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            if e.errno in (errno.EISDIR, errno.EPERM):
                return False
            raise


