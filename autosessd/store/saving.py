"""Store's save path (directory.py is Store and the directory; the attributes declared below
are Store's own): a save the engine wrote, checked, handed to a restore that cannot wait, and
made durable and visible (a save made elsewhere: installing.py).

How a save becomes visible (no torn `auto-*.bin`, ever):

    engine writes  .autosessd-<key>.partial           (a name no reader looks at)
    verify_temp    size == engine's n_written, header magic if the engine has one
    read_temp      (only while the finalize runs) the temporary held for a restore that
                   cannot wait for the fsync: the bytes are whole, and read from the page cache;
                   the finalize renames it only once every such reader let go (done_reading)
    finalize       digest (files.DIGEST, the bytes are in the page cache) → chmod(temp) →
                   fsync(temp) → rename to auto-<target>.bin once no restore reads the
                   temporary → fsync(dir) → metadata (with the digest and the file's identity)
                   to .autosessd-<target>.json.partial → fsync → rename → fsync(dir)

Nothing but the finalize changes the temporary's inode while it runs: no link to it is made
(a link or an unlink moves its ctime, which the digest and the recorded identity watch).
A try that fails after the digest leaves the bytes where they are (the temporary, or the
final name once renamed) and says the digest (Unfinished): the next try copies them into a
fresh temporary checked against it, instead of trusting a second fsync of the same file, which
can report success for pages the first one failed to write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import uuid
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ..base import files
from ..base.files import Ident
from . import blocks, cutting, kvfile
from .kvfile import KVFile
from .slotfile import MAGIC_BYTES
from .staging import Staging
from .names import (FILE_MODE, TEMP_PREFIX, Meta, StoreError, Unfinished, auto_name, fsync_dir,
                    manual_name)

log = logging.getLogger("autosessd")


class Saving:
    """Store's save path (see the module's docstring)."""

    path: Path
    staging: Path
    blocks: blocks.BlockStore | None
    group: int | None
    mode: int
    _mode_warned: bool
    _lock: threading.RLock
    _meta_cache: dict[str, tuple[Ident, Meta]]
    _temp_readers: Counter[str]
    _unread: threading.Condition

    hot: Staging
    cut: bool

    if TYPE_CHECKING:  # Store's own, and Space's: a stub here would come before them in Store's MRO
        def temp_path(self, key: str) -> Path: ...
        def bin_path(self, key: str) -> Path: ...
        def meta_path(self, key: str) -> Path: ...
        def hot_path(self, key: str) -> Path: ...
        def _named(self, key: str, meta: Meta | None) -> tuple[str, ...]: ...
        def read_meta(self, key: str) -> Meta | None: ...
        def _saw(self, meta: Meta) -> None: ...
        @staticmethod
        def _unlink(path: Path) -> bool: ...

    def verify_temp(self, key: str, n_written: int, magic: bytes | None = None) -> int:
        """The engine said it wrote n_written bytes to the temporary: check it did. Returns the
        temporary's inode (what read_temp hands a restore, and only that file)."""
        temp = self.temp_path(key)
        try:
            st = temp.stat()
        except FileNotFoundError:
            raise StoreError(f"the engine reported a save but {temp.name} is not in {self.path}") from None
        size = st.st_size
        if size != n_written:
            raise StoreError(f"{temp.name} has {size:,} bytes, the engine reported {n_written:,}")
        if magic:
            with open(temp, "rb") as f:
                head = f.read(len(magic))
            if head != magic:
                raise StoreError(f"{temp.name} does not start with the engine's magic {magic!r}")
        return st.st_ino

    def read_temp(self, key: str, ino: int, size: int) -> str | None:
        """The verified temporary of `key`, held for the engine to read while its finalize runs
        (a restore that does not wait for the fsync): the finalize renames it, or drops it after
        a failure, only once every reader let go (done_reading). None when the temporary is no
        longer that file (its inode or size differ, or the rename has come): the caller waits
        for the finalize and reads the final name instead."""
        temp = self.temp_path(key)
        with self._lock:
            try:
                st = os.lstat(temp)
            except FileNotFoundError:
                return None
            if st.st_ino != ino or st.st_size != size:
                return None
            self._temp_readers[temp.name] += 1
        return temp.name

    def done_reading(self, name: str) -> None:
        """A read_temp name, once the engine has read it."""
        with self._unread:
            self._temp_readers[name] -= 1
            if self._temp_readers[name] <= 0:
                del self._temp_readers[name]
            self._unread.notify_all()

    @contextlib.contextmanager
    def _unread_temp(self, temp: Path) -> Iterator[None]:
        """Holds _lock with no restore reading `temp` (waits for them, the lock let go meanwhile):
        a rename or unlink of it comes under this, never while the engine reads it by name."""
        with self._unread:
            self._unread.wait_for(lambda: not self._temp_readers.get(temp.name))
            yield

    def finalize(self, key: str, meta: Meta, digest: str | None = None) -> Meta:
        """Make the verified temporary of `key` durable as conversation meta.key (the same key,
        or the name branches.save_key chose for it): cut into token blocks with its manifest
        when it can be (the temporary then kept as the copy for a quick return,
        staging/auto-<key>.bin), else as the whole file auto-<key>.bin with its metadata; the
        digest of the engine's bytes with either. Returns the metadata written. Blocking.

        digest: what an earlier try read of these bytes before a later step of it failed
        (Unfinished.digest): the bytes are found where that try left them and checked against
        it; a whole file is copied into a fresh temporary first (a second fsync of the same
        file can report success for pages the first failed to write). A failure after the
        digest is raised as Unfinished, which carries it."""
        temp = self.temp_path(key)
        again = digest is not None
        if digest is None:
            digest, _ = files.digest_file(temp)  # the bytes are in the page cache now
        try:
            src = temp if temp.exists() or not again else self.hot_path(meta.key)  # a retry: where it is
            kv, why = self._cuttable(src)
            done = None
            if kv is not None:
                try:
                    done = self._finalize_blocks(key, meta, digest, kv, src, again)
                except (OSError, StoreError):
                    raise
                except Exception as e:  # cutting it went wrong (a bug, too little memory): kept whole
                    log.warning("auto sessions: %s kept whole: cutting it into blocks failed: %s", meta.key, e)
                    why = f"cutting it into blocks failed: {e}"
            if done is None:
                if again:
                    self._fresh_copy(key, meta.key, digest)
                done = self._finalize_whole(key, dataclasses.replace(meta, whole=why), digest)
            meta = done
        except OSError as e:
            raise Unfinished(e, digest) from e
        self._saw(meta)
        return meta

    def _cuttable(self, path: Path) -> tuple[KVFile | None, str | None]:
        """The file's layout when it is cut into blocks here; else (None, why it stays whole;
        None where there is no block store or the engine's files are not llama-server's)."""
        if self.blocks is None or not self.cut:
            return None, None
        with open(path, "rb") as f:
            if f.read(4) != MAGIC_BYTES:
                return None, None  # another engine's file (the control stream's): always whole
        try:
            return kvfile.parse(path), None
        except kvfile.NotSliceable as e:
            return None, str(e)

    def _finalize_whole(self, key: str, meta: Meta, digest: str) -> Meta:
        temp, final = self.temp_path(key), self.bin_path(meta.key)
        self._seal(temp)
        if self.staging != self.path:
            # The durable copy in the store, the engine's file kept in staging for a return.
            self._copy_durable(temp, final)
            with self._unread_temp(temp):
                os.replace(temp, self.hot_path(meta.key))
        else:
            with self._unread_temp(temp):
                os.replace(temp, final)
        fsync_dir(self.path)
        ident = files.regular_ident(final)  # after the rename, which moves the ctime
        meta = dataclasses.replace(meta, digest=digest, ident=ident, blocks=(), kv=None, tokens=None)
        self._write_meta(meta)
        if self.staging != self.path:
            self.hot.added(auto_name(meta.key), meta, held=1)  # checked: the engine's bytes, this save's digest
        return meta

    def _finalize_blocks(self, key: str, meta: Meta, digest: str, kv: KVFile, src: Path, again: bool) -> Meta:
        """Its blocks stored (those not stored yet; pinned from before the look until the
        manifest names them), then the engine's file kept as the copy for a quick return (not
        fsynced: the blocks are the durable copy; within the copies' budget), then the manifest:
        a crash before the manifest leaves blocks no manifest names (the next start sweeps them)
        and a copy without metadata (removed too). The blocks the manifest named before and no
        longer names (its last partial block, say) go at the next prune's sweep."""
        from .slotfile import encode

        temp, hot = self.temp_path(key), self.hot_path(meta.key)
        if again:
            now, _ = files.digest_file(src)
            if now != digest:
                raise StoreError(f"{src.name} no longer holds the bytes the engine saved")
        assert self.blocks is not None
        cells = encode(kv.tokens[:kv.n_cells])
        keys = blocks.chain(meta.model, kv.shape, cells, kv.n_cells)
        with self.blocks.pinned(keys):  # no sweep takes a block this manifest is about to name
            refs, tail, _ = cutting.split(self.blocks, kv, src, meta.model, keys)
            try:
                if src == temp:
                    fd = os.open(temp, os.O_RDONLY)
                    try:
                        self._own(fd, temp)
                    finally:
                        os.close(fd)
                    with self._unread_temp(temp):
                        os.replace(temp, hot)
                ident = files.regular_ident(hot)
                meta = dataclasses.replace(meta, digest=digest, ident=ident, whole=None,
                                           blocks=tuple((r.key, r.n_cells, r.digest) for r in refs),
                                           kv=kv.shape.to_json(), tokens=encode(kv.tokens),
                                           tail=(tail.key, tail.size, tail.digest) if tail else None)
                self._write_meta(meta)  # names its blocks: from here on they are named, pinned or not
            finally:
                if tail is not None:
                    self.blocks.unpin([tail.key])
        if self.staging != self.path:
            self._unlink(self.bin_path(meta.key))  # a whole file of it from before: the blocks hold it now
        # The caller (a finalize) holds the name: that hold does not keep a copy beyond the budget.
        self.hot.added(auto_name(meta.key), meta, digest, held=1)
        return meta

    def import_whole(self, key: str) -> str | None:
        """A whole auto file saved before the block store (or while it was off, or downloaded
        from the bucket), kept as blocks now when it can be cut: its bytes checked against its
        digest as they are cut (cutting.split: no damaged byte becomes a block later saves name;
        a file that fails is quarantined), its blocks stored, then its manifest written in place
        of its metadata, unless a save of it landed meanwhile (its metadata changed). In the
        store's own directory the .bin stays as its copy; in a separate store it goes. → what
        was done, for the log; None: nothing to do. Blocking."""
        if self.blocks is None or not self.cut:
            return None
        path, meta_path = self.bin_path(key), self.meta_path(key)
        ident0 = files.regular_ident(meta_path)
        meta = self._meta_at(meta_path) if ident0 is not None else None
        if meta is None or meta.key != key or meta.in_blocks or not kvfile.cut_now(meta.whole):
            return None
        if meta.digest is None:  # from before digests: nothing to tell damaged bytes by
            meta = dataclasses.replace(meta, whole="saved before digests: its bytes cannot be checked, so it is "
                                                   "not cut into blocks others would reuse")
            return f"{auto_name(key)} stays whole: {meta.whole}" if self._replace_meta(meta, ident0) else None
        bin_ident = files.regular_ident(path)
        if bin_ident is None or bin_ident.size != meta.bytes:
            return f"{auto_name(key)} not kept as blocks: it is missing or not its metadata's size"
        kv, why = self._cuttable(path)
        if kv is None:
            meta = dataclasses.replace(meta, whole=why or "not a llama-server slot file")
            if not self._replace_meta(meta, ident0):
                return None
            return f"{auto_name(key)} stays whole: {meta.whole}"
        from .slotfile import encode

        keys = blocks.chain(meta.model, kv.shape, encode(kv.tokens[:kv.n_cells]), kv.n_cells)
        with self.blocks.pinned(keys):
            before = self.blocks.bytes_written
            try:
                refs, tail, _ = cutting.split(self.blocks, kv, path, meta.model, keys, expect=meta.digest)
            except blocks.NotTheFile as e:
                moved = self.quarantine(auto_name(key), str(e), seen=bin_ident)
                return f"{auto_name(key)} not kept as blocks: {e}" + (f" (moved aside: {moved})" if moved else "")
            try:
                written = self.blocks.bytes_written - before
                meta = dataclasses.replace(meta, blocks=tuple((r.key, r.n_cells, r.digest) for r in refs),
                                           kv=kv.shape.to_json(), tokens=encode(kv.tokens), whole=None,
                                           ident=files.regular_ident(path),
                                           tail=(tail.key, tail.size, tail.digest) if tail else None)
                if not self._replace_meta(meta, ident0):
                    return None
            finally:
                if tail is not None:
                    self.blocks.unpin([tail.key])
        if self.staging != self.path:
            self._unlink(path)
        else:
            self.hot.added(auto_name(key), meta)
        return f"{auto_name(key)} kept as {len(meta.blocks)} blocks ({written:,} bytes written)"

    def _replace_meta(self, meta: Meta | None, ident0: Ident | None, key: str | None = None,
                      held_ok: bool = False) -> bool:
        """Write `meta` (None: remove the metadata of `key`) in place of the metadata whose
        identity was ident0, unless it changed (a save landed meanwhile) or, unless held_ok,
        someone holds the name: then nothing is written. → whether it was."""
        key = meta.key if meta is not None else key
        assert key is not None
        tmp = self.path / f"{TEMP_PREFIX}{key}.{uuid.uuid4().hex[:8]}.replace.json.partial"
        written = self._meta_temp(meta, tmp) if meta is not None else None
        try:
            with self._lock:
                if files.regular_ident(self.meta_path(key)) != ident0 or (not held_ok and auto_name(key) in self.in_use):
                    return False
                if meta is None:
                    os.rename(self.meta_path(key), tmp)  # the name gone; the file after the lock
                    self._named(key, None)
                else:
                    os.replace(tmp, self.meta_path(key))
                    self._remember_meta(key, written)
                    self._named(key, meta)
        finally:
            self._unlink(tmp)
        fsync_dir(self.path)
        return True

    def _copy_durable(self, src: Path, final: Path) -> None:
        """src's bytes as `final` in the store: a temporary of its own, fsynced, renamed."""
        tmp = self.path / f"{TEMP_PREFIX}{final.stem[5:]}.{uuid.uuid4().hex[:8]}.copy.partial"
        try:
            f, _ = files.open_regular(src)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.mode)
            with f, os.fdopen(fd, "wb") as out:
                self._own(out.fileno(), tmp)
                while chunk := f.read(files.CHUNK):
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, final)
        except BaseException:
            self._unlink(tmp)
            raise

    def _fresh_copy(self, key: str, file_key: str, digest: str) -> None:
        """The bytes an earlier finalize of `key` left (its temporary, or auto-<file_key>.bin
        when it had renamed them), copied into a fresh temporary whose digest must be `digest`,
        which then takes the temporary's name: the retry goes on from there."""
        temp = self.temp_path(key)
        src = temp
        if not src.exists():
            src = self.hot_path(file_key) if self.hot_path(file_key).exists() else self.bin_path(file_key)
        dst = self.staging / f"{TEMP_PREFIX}{key}.{uuid.uuid4().hex[:8]}.again.partial"
        h = files.Hasher()
        f, _ = files.open_regular(src)
        try:
            with f, open(dst, "xb") as out:
                while chunk := f.read(files.CHUNK):
                    h.update(chunk)
                    out.write(chunk)
            if h.hexdigest() != digest:
                raise StoreError(f"{src.name} no longer holds the bytes the engine saved (its digest is "
                                 f"{h.hexdigest()}, {digest} was read before the failure)")
            with self._unread_temp(temp):
                os.replace(dst, temp)
        except BaseException:
            self._unlink(dst)
            raise

    def drop_temp(self, key: str) -> None:
        """A failed finalize's temporary, once no restore reads it (blocking: run it in a thread)."""
        temp = self.temp_path(key)
        with self._unread_temp(temp):
            self._unlink(temp)

    def finalize_manual(self, key: str, name: str) -> None:
        """A parked session under a person's name: the same atomic rename, no metadata; with a
        separate store, its durable copy there and the engine's file kept in staging."""
        temp, final = self.temp_path(key), self.path / manual_name(name)
        self._seal(temp)
        if self.staging != self.path:
            self._copy_durable(temp, final)
            with self._unread_temp(temp):
                os.replace(temp, self.staging / manual_name(name))
            self.hot.added(manual_name(name), held=1)  # a copy: within the budget of copies (on tmpfs: memory)
        else:
            os.replace(temp, final)
        fsync_dir(self.path)

    def _seal(self, path: Path) -> None:
        """The engine's file: our mode (and group), then fsync. An engine running as another
        user keeps its file; a save is not failed for that, but it is said once."""
        fd = os.open(path, os.O_RDONLY)
        try:
            self._own(fd, path)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _own(self, fd: int, path: Path) -> None:
        try:
            if self.group is not None:
                os.fchown(fd, -1, self.group)
            os.fchmod(fd, self.mode)
        except PermissionError as e:
            if not self._mode_warned:
                self._mode_warned = True
                log.warning("auto sessions: cannot set mode %o on %s (%s): it keeps the engine's mode %o; run "
                            "the engine as autosessd's user, or with UMask=0077", self.mode, path.name,
                            e.strerror, os.fstat(fd).st_mode & 0o777)

    def _write_meta(self, meta: Meta) -> None:
        """The metadata (or manifest) whole in place; the blocks it names named in the same
        section as the rename (those it no longer names go at the next sweep)."""
        tmp = self.path / f"{TEMP_PREFIX}{meta.key}.json.partial"
        written = self._meta_temp(meta, tmp)
        with self._lock:
            os.replace(tmp, self.meta_path(meta.key))
            self._named(meta.key, meta)
        self._remember_meta(meta.key, written)
        fsync_dir(self.path)

    def _meta_temp(self, meta: Meta, tmp: Path) -> tuple[int, bytes]:
        """The metadata, whole and fsynced, under the temporary name tmp; (its inode, its bytes)."""
        data = meta.to_json()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            self._own(fd, tmp)  # the umask may have taken more than we asked, or less
            os.write(fd, data)
            os.fsync(fd)
            return os.fstat(fd).st_ino, data
        finally:
            os.close(fd)

    def _remember_meta(self, key: str, written: tuple[int, bytes]) -> None:
        """The metadata just renamed into place, cached under its identity after the rename
        (which moves the ctime): the next turn's read_meta is two lstats, not a read and a
        parse. Only if the file there is still the one written (its inode); cached as a
        reader would parse it (the bytes written, parsed here in the writer's thread)."""
        path = self.meta_path(key)
        ino, data = written
        with contextlib.suppress(OSError, ValueError):  # only a cache: the write is done
            ident = files.regular_ident(path)
            if ident is not None and ident.ino == ino:
                read = Meta.from_json(data)
                with self._lock:
                    self._meta_cache[path.name] = (ident, read)

    def write_meta(self, meta: Meta) -> None:
        """Write auto-<key>.json atomically, for a .bin put in place by other means (tests,
        tools); a local save writes it in finalize, a download in install."""
        self._write_meta(meta)
