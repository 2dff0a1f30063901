"""The store of token blocks (issue 39): each token's KV kept once, under chained keys.

A save the engine wrote (a slot file, kvfile.py) is cut into blocks of BLOCK_TOKENS cells in
position order, the last one shorter. Block b of a conversation is keyed by

    key_0 = H("autosessd blocks", model fingerprint, the shape's fingerprint, BLOCK_TOKENS)
    key_b = H(key_{b-1}, the tokens of block b)          H: blake2b-128

so a key names exactly the KV of its tokens at their positions, after exactly those tokens
before them, for one model's cache of one shape: two conversations that share a prompt share
its blocks, and a block is written once whoever saves it first. (The bytes of the same tokens
computed as a prompt and as the engine's own reply differ a little; either is right for the
key, and the first written is kept.) A conversation is then a manifest (names.Meta with
`blocks`): its tokens, its shape and its blocks' keys, each with its cell count and digest.

    blocks/<k[:2]>/<key>.blk    64-byte header (MAGIC, cells, cell bytes, the key, the payload's
                                xxh3-128), then the payload: the cells' meta, K per layer, V per
                                layer (rows; transposed V dim by dim), for its cells

A file's tail (kvfile.py: a window model's window cache, a hybrid's recurrent state) is kept
the same way, once per save, as a block of 0 cells whose payload is the tail's bytes as the
engine wrote them, keyed by tail_key (its model, shape and digest): its manifest names it
beside its blocks (Meta.tail), so it lives, is pinned, swept and quarantined as a block is.

A block is written to a temporary of its own, fsynced, and linked to its name (a link never
replaces a block another save put there first; the loser's temporary goes); its directory is
fsynced (also by a save that found it already there) before its manifest names it. A block's
life has one owner, BlockStore: alive while a manifest names it or a save or a reader pins it,
removed only by its sweep. Before its bytes reach the engine a block's payload is checked
against its digest, unless the file is the one checked before (its inode, ctime and size): no
torn or damaged block is ever assembled, and only such evidence condemns a block.

Cutting a file into blocks and assembling one from them is cutting.py's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from ..base import files
from ..base.files import Hasher, Ident
from .kvfile import Shape
from .names import QUARANTINE, StoreError, fsync_dir

log = logging.getLogger("autosessd")

BLOCK_TOKENS = 128  # cells a block holds (bench/blocks.py, scenario 14: 64, 128, 256 and 1024 measured)
OPEN_AT_ONCE = 64  # blocks an assembly keeps open (one descriptor each); the others are opened per section
MAGIC_BLOCK = b"autosessd-blk-1\n"
HEADER = struct.Struct("<16sII16s16s8x")  # magic, cells, cell bytes, key, payload digest (raw xxh3-128)
DIR = "blocks"


class BadBlock(StoreError):
    """A block that is missing, torn or not what its manifest says: nothing is assembled from it."""


@dataclass(frozen=True)
class BlockRef:
    """A manifest's entry for one of its blocks."""

    key: str  # 32 hex digits
    n_cells: int
    digest: str  # files.DIGEST of its payload

    def to_list(self) -> list:
        return [self.key, self.n_cells, self.digest]

    @classmethod
    def from_list(cls, v: object) -> "BlockRef":
        if not isinstance(v, list) or len(v) != 3:
            raise ValueError("a block is [key, cells, digest]")
        key, n, digest = v
        if not isinstance(key, str) or len(key) != 32 or not all(c in "0123456789abcdef" for c in key) \
                or type(n) is not int or not 0 < n <= BLOCK_TOKENS * 16 or not isinstance(digest, str):
            raise ValueError(f"not a block reference: {v!r}")
        return cls(key, n, digest)


def chain(model: str, shape: Shape, tokens: bytes, n_cells: int, block_tokens: int | None = None) -> list[str]:
    """The keys of the blocks holding cells 0 … n_cells−1 whose tokens are `tokens` (encoded)."""
    block_tokens = block_tokens or BLOCK_TOKENS
    prev = hashlib.blake2b(b"autosessd blocks\0" + model.encode() + b"\0" + shape.fingerprint().encode() + b"\0"
                           + str(block_tokens).encode(), digest_size=16).digest()
    keys = []
    for start in range(0, n_cells, block_tokens):
        end = min(n_cells, start + block_tokens)
        prev = hashlib.blake2b(prev + tokens[4 * start:4 * end], digest_size=16).digest()
        keys.append(prev.hex())
    return keys


def tail_key(model: str, shape: Shape, digest: str) -> str:
    """The key a file's tail is kept under: its bytes' digest, for one model's files of one shape."""
    return hashlib.blake2b(b"autosessd tail\0" + model.encode() + b"\0" + shape.fingerprint().encode() + b"\0"
                           + _raw_digest(digest), digest_size=16).hexdigest()


@dataclass(frozen=True)
class TailRef:
    """A manifest's tail: the key it is kept under, its bytes, their digest."""

    key: str
    size: int
    digest: str


def payload_size(shape: Shape, n_cells: int) -> int:
    return n_cells * shape.cell_size()


def _digest_of(raw: bytes) -> str:
    return f"{files.DIGEST}:{raw.hex()}"


def _raw_digest(digest: str) -> bytes:
    prefix = files.DIGEST + ":"
    if not digest.startswith(prefix) or len(digest) != len(prefix) + 32:
        raise ValueError(f"not a {files.DIGEST} digest: {digest!r}")
    return bytes.fromhex(digest[len(prefix):])


class OtherBlock(BadBlock):
    """A whole block under the key (its payload is its own header's digest), but not the bytes
    the manifest recorded: the key's block was written again since (the same tokens' KV, other
    bytes). Nothing is wrong with the block; only that manifest cannot be assembled as it is."""

    def __init__(self, key: str, why: str):
        super().__init__(why)
        self.key = key


class NotTheFile(StoreError):
    """A file whose bytes are no longer those its metadata's digest says: never cut into blocks."""


class Unreadable(StoreError):
    """A block this process could not read for a reason of its own or of the system (too many
    open files, an I/O error, a permission): this restore fails, and the block, the manifests
    naming it and every other restore are left as they were. Never evidence against the block."""


class BlockStore:
    """blocks/ under the store: the one owner of a block's life. Every method is safe from any
    thread; everything below is under `lock`, which is the Store's own (one lock for the
    directory: a manifest's rename and the naming of its blocks are one section).

    A block is alive while a manifest names it (name(), called in the section that renames the
    manifest) or a reader or a save pins it (pinned(): a save from before it looks for its
    blocks until its manifest names them; a restore from the moment it reads the manifest until
    the engine has read the file). Nothing is removed anywhere else than in sweep(): the blocks
    neither named nor pinned, looked at and renamed aside in one section, unlinked after it.
    Prune sweeps the whole directory; a removal sweeps the blocks it un-named.

    Only evidence about a block's own bytes condemns it (BadBlock: missing, its size, its
    header, its payload matching neither its manifest's digest nor its own header's); then
    quarantine() moves it aside with a note of why and of the manifests that named it. A whole
    block of other bytes than a manifest recorded (OtherBlock: written again under its key
    since) condemns only that manifest's tail. Any other error reading it is Unreadable."""

    def __init__(self, home: Path, mode: int = 0o600, lock: threading.RLock | None = None):
        self.home = home
        self.dir = home / DIR
        self.mode = mode
        self.lock = lock if lock is not None else threading.RLock()
        self._named: dict[str, tuple[str, ...]] = {}  # manifest key → the blocks it names
        self._dropped: set[str] = set()  # blocks a manifest stopped naming since the last sweep of them
        self._pins: Counter[str] = Counter()  # blocks a save or a reader holds
        self._checked: dict[str, tuple[Ident, str]] = {}  # key → (identity, digest) read whole lately
        self.bytes_written = 0  # bytes of blocks written since the start

    def path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.blk"

    # -- liveness ------------------------------------------------------------------------------
    def name(self, manifest: str, keys: Iterable[str] | None) -> None:
        """Manifest `manifest` names `keys` from now on (None or none: it names nothing, or is
        gone). The caller holds `lock` across the manifest's rename and this call."""
        keys = tuple(keys or ())
        with self.lock:
            old = self._named.pop(manifest, ())
            if keys:
                self._named[manifest] = keys
            self._dropped.update(set(old) - set(keys))

    def naming(self, manifest: str) -> tuple[str, ...]:
        with self.lock:
            return self._named.get(manifest, ())

    def manifests(self) -> dict[str, tuple[str, ...]]:
        """Every manifest's key → the blocks it names."""
        with self.lock:
            return dict(self._named)

    def manifests_naming(self, key: str) -> list[str]:
        with self.lock:
            return sorted(m for m, keys in self._named.items() if key in keys)

    def pin(self, keys: Iterable[str]) -> list[str]:
        """Hold `keys` (sweep leaves them) until unpin(the list returned)."""
        keys = list(keys)
        with self.lock:
            self._pins.update(keys)
        return keys

    def unpin(self, keys: list[str]) -> None:
        with self.lock:
            self._pins.subtract(keys)
            for k in keys:
                if self._pins[k] <= 0:
                    del self._pins[k]

    @contextlib.contextmanager
    def pinned(self, keys: Iterable[str]) -> Iterator[None]:
        held = self.pin(keys)
        try:
            yield
        finally:
            self.unpin(held)

    def sweep(self, candidates: Iterable[str] | None = None, dry_run: bool = False) -> tuple[int, int]:
        """Mark and sweep: the blocks (of `candidates`; None: every block there is) that no
        manifest names and nobody pins, removed. → (blocks, bytes)."""
        there = self.scan() if candidates is None else self._sizes(candidates)
        doomed: list[tuple[Path, int]] = []
        with self.lock:
            if candidates is None:
                self._dropped.clear()
            live = set(self._pins).union(*self._named.values())
            dead = [k for k in there if k not in live]
            if dry_run:
                return len(dead), sum(there[k] for k in dead)
            for k in dead:
                p = self.path(k)
                aside = p.parent / f".{k}.{uuid.uuid4().hex[:8]}.dead.partial"  # a crash's leftover: cleanup()
                try:
                    os.rename(p, aside)
                except FileNotFoundError:
                    continue
                self._checked.pop(k, None)
                doomed.append((aside, there[k]))
        for aside, _ in doomed:  # 32 MiB unlinks, not under the lock
            with contextlib.suppress(FileNotFoundError):
                aside.unlink()
        return len(doomed), sum(size for _, size in doomed)

    def sweep_dropped(self) -> tuple[int, int]:
        """sweep() of the blocks a manifest stopped naming since they were last swept (a removal,
        a save's old last block, a conversation saved whole after its blocks): no scan of the
        directory. → (blocks, bytes)."""
        with self.lock:
            dropped, self._dropped = self._dropped, set()
        return self.sweep(dropped)

    def _sizes(self, keys: Iterable[str]) -> dict[str, int]:
        out = {}
        for k in keys:
            with contextlib.suppress(FileNotFoundError):
                out[k] = os.lstat(self.path(k)).st_size
        return out

    # -- writing -----------------------------------------------------------------------------
    def info(self, key: str) -> tuple[int, str] | None:
        """(cells, digest) of the block stored under `key`, from its header; None: none."""
        try:
            f, st = files.open_regular(self.path(key))
        except (FileNotFoundError, files.NotRegular):  # a link or a FIFO at its name: no block (put replaces it)
            return None
        with f:
            head = f.read(HEADER.size)
        try:
            magic, n, _cb, raw_key, raw_digest = HEADER.unpack(head)
        except struct.error:
            return None
        if magic != MAGIC_BLOCK or raw_key.hex() != key:
            return None
        return n, _digest_of(raw_digest)

    def put(self, key: str, n_cells: int, cell_bytes: int, pieces: Iterable[memoryview | bytes]) -> tuple[str, int]:
        """Store a block unless one is stored under `key` already: → (the digest of the block
        stored under it now, bytes written: 0 when it was there). The caller holds a pin on
        `key` and fsyncs the directories it wrote into (sync) before a manifest names it."""
        have = self.info(key)
        if have is not None and have[0] == n_cells:
            return have[1], 0
        final = self.path(key)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # its own mode: as a parent it would be 0755
        final.parent.mkdir(exist_ok=True, mode=0o700)
        tmp = final.parent / f".{key}.{uuid.uuid4().hex[:8]}.partial"
        h = Hasher()
        written = 0
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.mode)
        try:
            with os.fdopen(fd, "wb", closefd=False) as out:
                out.write(b"\0" * HEADER.size)
                for piece in pieces:
                    h.update(piece)
                    out.write(piece)
                    written += len(piece)
                digest = h.hexdigest()
                out.seek(0)
                out.write(HEADER.pack(MAGIC_BLOCK, n_cells, cell_bytes, bytes.fromhex(key), _raw_digest(digest)))
                out.flush()
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        try:
            try:
                os.link(tmp, final)  # never over a block another save stored first
            except FileExistsError:
                have = self.info(key)
                if have is None or have[0] != n_cells:  # not a block: a leftover a person made? replaced
                    os.replace(tmp, final)
                    with self.lock:
                        self._checked.pop(key, None)
                        self.bytes_written += written + HEADER.size
                    return digest, written + HEADER.size
                return have[1], 0
        finally:
            tmp.unlink(missing_ok=True)
        with self.lock:
            self.bytes_written += written + HEADER.size
        return digest, written + HEADER.size

    def sync(self, keys: Iterable[str]) -> None:
        """fsync the directories the blocks `keys` are in (their names durable)."""
        for d in sorted({self.path(k).parent for k in keys}):
            fsync_dir(d)
        if self.dir.exists():
            fsync_dir(self.dir)

    # -- reading -------------------------------------------------------------------------------
    def _checked_as(self, key: str) -> tuple[Ident, str] | None:
        with self.lock:
            return self._checked.get(key)

    def _read_whole(self, key: str, ident: Ident, digest: str) -> None:
        with self.lock:
            self._checked[key] = (ident, digest)

    # -- the blocks there are ------------------------------------------------------------------
    def scan(self) -> dict[str, int]:
        """Every block file: key → bytes (names that are not blocks are left alone)."""
        out: dict[str, int] = {}
        try:
            subs = list(os.scandir(self.dir))
        except FileNotFoundError:
            return out
        for sub in subs:
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                continue
            with os.scandir(sub.path) as it:
                for d in it:
                    name = d.name
                    if name.endswith(".blk") and len(name) == 36 and name.startswith(sub.name):
                        with contextlib.suppress(FileNotFoundError):
                            out[name[:32]] = d.stat(follow_symlinks=False).st_size
        return out

    def usage(self) -> dict[str, int]:
        """What the blocks take: every block once, and those several manifests name."""
        there = self.scan()
        with self.lock:
            named = Counter(k for keys in self._named.values() for k in set(keys))
            manifests = len(self._named)
        return {"manifests": manifests, "blocks": len(there), "block_bytes": sum(there.values()),
                "shared_block_bytes": sum(size for k, size in there.items() if named.get(k, 0) > 1),
                "block_bytes_written": self.bytes_written}

    def cleanup(self) -> list[str]:
        """At start: the temporaries a crash left in the block directories, and blocks an
        earlier version set aside in quarantine/ (no note, never pruned), moved to the
        quarantine with one."""
        removed = self._old_quarantine()
        try:
            subs = list(os.scandir(self.dir))
        except FileNotFoundError:
            return removed
        for sub in subs:
            if not sub.is_dir(follow_symlinks=False):
                continue
            with os.scandir(sub.path) as it:
                for d in it:
                    if d.name.startswith(".") and d.name.endswith(".partial"):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(d.path)
                            removed.append(f"{DIR}/{sub.name}/{d.name} (leftover temporary)")
        return removed

    def _old_quarantine(self) -> list[str]:
        old = self.home / "quarantine"
        try:
            entries = list(os.scandir(old))
        except (FileNotFoundError, NotADirectoryError):
            return []
        done = []
        for e in entries:
            key = e.name.split(".")[0]
            if e.is_file(follow_symlinks=False) and len(key) == 32:
                qdir = self.home / QUARANTINE
                qdir.mkdir(mode=0o700, exist_ok=True)
                dest = qdir / f"block-{e.name}"
                note = {"name": f"block {key}", "why": "set aside by an earlier version (its note was not kept)",
                        "at": e.stat(follow_symlinks=False).st_mtime, "bytes": e.stat(follow_symlinks=False).st_size,
                        "block": key, "named_by": []}
                with open(dest.with_name(dest.name + ".why"), "x") as f:
                    f.write(json.dumps(note) + "\n")
                os.rename(e.path, dest)
                done.append(f"quarantine/{e.name} (moved to {QUARANTINE}/ with a note)")
        with contextlib.suppress(OSError):
            old.rmdir()
        return done

    def quarantine(self, key: str, why: str) -> str | None:
        """A block found damaged (BadBlock), moved into the store's quarantine with a note of why
        and of the manifests that named it (forget finds it by them). → its name there, None
        when it was not there. Its manifests are the caller's."""
        qdir = self.home / QUARANTINE
        qdir.mkdir(mode=0o700, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        dest = qdir / f"block-{key}.blk.{stamp}.{uuid.uuid4().hex[:6]}"
        with self.lock:
            named_by = sorted(m for m, keys in self._named.items() if key in keys)
        try:
            size: int | None = os.lstat(self.path(key)).st_size
        except FileNotFoundError:
            size = None
        # The note first (whole, fsynced), then the block: a crash between leaves a note whose
        # block is still in blocks/ (found damaged again), never a block nobody lists or forgets.
        note = {"name": f"block {key}", "why": why, "at": time.time(), "bytes": size, "block": key,
                "named_by": named_by}
        tmp = qdir / f".{dest.name}.why.partial"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(note) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest.with_name(dest.name + ".why"))
        with self.lock:
            try:
                os.rename(self.path(key), dest)
            except FileNotFoundError:
                size = None
            self._checked.pop(key, None)
        fsync_dir(qdir)
        return dest.name if size is not None else None
