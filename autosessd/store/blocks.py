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

A block is written to a temporary of its own, fsynced, and linked to its name (a link never
replaces a block another save put there first; the loser's temporary goes); its directory is
fsynced (also by a save that found it already there) before its manifest names it. Before its bytes reach the engine a block's payload is
checked against its digest, unless the file is the one checked before (its inode, ctime and
size): no torn or damaged block is ever assembled. Blocks no manifest names are removed by
the prune (gc), never one a save or an assembly holds (pins).

assemble() writes a slot file of the first m tokens from a manifest's blocks: the engine's
header and payload with those tokens, one stream of min(m, cells) cells at positions 0…m−1,
the data per layer from each block in order, and the manifest's stream count.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import struct
import threading
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Sequence

import numpy as np

from ..base import files
from ..base.files import Hasher, Ident
from .kvfile import KVFile, Shape
from .names import StoreError, fsync_dir
from .slotfile import MAGIC, PAYLOAD_VERSION, TOKEN_NULL, VERSION

log = logging.getLogger("autosessd")

BLOCK_TOKENS = 128  # cells a block holds (bench/blocks.py, scenario 14: 64, 128, 256 and 1024 measured)
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


def payload_size(shape: Shape, n_cells: int) -> int:
    return n_cells * shape.cell_size()


def _digest_of(raw: bytes) -> str:
    return f"{files.DIGEST}:{raw.hex()}"


def _raw_digest(digest: str) -> bytes:
    prefix = files.DIGEST + ":"
    if not digest.startswith(prefix) or len(digest) != len(prefix) + 32:
        raise ValueError(f"not a {files.DIGEST} digest: {digest!r}")
    return bytes.fromhex(digest[len(prefix):])


# -- cutting a file -------------------------------------------------------------------------
def cut(kv: KVFile, arr: np.ndarray, start: int, end: int) -> Iterator[memoryview | bytes]:
    """The payload of the block of positions [start, end) of a file (`arr`: its bytes), its pieces
    in order (each a copy gathered by position: cells are in cache order in the file)."""
    sh = kv.shape
    idx = kv.order[start:end]
    n = kv.n_cells
    # Each piece a gathered copy, flat (a 2-D view's len() would count rows, not bytes).
    yield arr[kv.cells_at:kv.cells_at + n * sh.cell_bytes].reshape(n, sh.cell_bytes)[idx].reshape(-1).data
    for layer, at in zip(sh.layers, kv.k_at):
        yield arr[at:at + n * layer.k_row].reshape(n, layer.k_row)[idx].reshape(-1).data
    for layer, at in zip(sh.layers, kv.v_at):
        if sh.v_trans:
            yield arr[at:at + layer.n_embd_v * n * layer.v_row].reshape(layer.n_embd_v, n, layer.v_row)[:, idx, :] \
                .tobytes()
        else:
            yield arr[at:at + n * layer.v_row].reshape(n, layer.v_row)[idx].reshape(-1).data


class BlockStore:
    """blocks/ under the session directory (see the module's docstring). Used from worker
    threads; every method is safe from any thread. Pins and the checked cache under _lock."""

    def __init__(self, home: Path, mode: int = 0o600):
        self.dir = home / DIR
        self.mode = mode
        self._lock = threading.Lock()
        self._pins: Counter[str] = Counter()  # blocks a save or an assembly holds: gc leaves them
        self._checked: dict[str, tuple[Ident, str]] = {}  # key → (identity, digest) found whole lately

    def path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.blk"

    # -- pins --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def pinned(self, keys: Iterable[str]) -> Iterator[None]:
        keys = list(keys)
        with self._lock:
            self._pins.update(keys)
        try:
            yield
        finally:
            with self._lock:
                self._pins.subtract(keys)
                for k in keys:
                    if self._pins[k] <= 0:
                        del self._pins[k]

    # -- writing -----------------------------------------------------------------------------
    def info(self, key: str) -> tuple[int, str] | None:
        """(cells, digest) of the block stored under `key`, from its header; None: none."""
        try:
            f, st = files.open_regular(self.path(key))
        except FileNotFoundError:
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
        stored under it now, bytes written: 0 when it was there). The caller fsyncs the
        directories it wrote into (sync) before a manifest names the block."""
        have = self.info(key)
        if have is not None and have[0] == n_cells:
            return have[1], 0
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
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
                    return digest, written + HEADER.size
                return have[1], 0
        finally:
            tmp.unlink(missing_ok=True)
        return digest, written + HEADER.size

    def sync(self, keys: Iterable[str]) -> None:
        """fsync the directories the blocks `keys` are in (their names durable)."""
        for d in sorted({self.path(k).parent for k in keys}):
            fsync_dir(d)
        if self.dir.exists():
            fsync_dir(self.dir)

    # -- reading -------------------------------------------------------------------------------
    def opened(self, ref: BlockRef, shape: Shape) -> np.ndarray:
        """The payload of a block (a read-only map of the file, unmapped when the last view of
        it goes), checked: its header and size are the manifest's, and its payload's digest
        (unless this very file was checked before). BadBlock says what is wrong."""
        p = self.path(ref.key)
        try:
            f, st = files.open_regular(p)
        except FileNotFoundError:
            raise BadBlock(f"block {ref.key} is missing") from None
        except OSError as e:
            raise BadBlock(f"block {ref.key}: {e}") from None
        with f:
            size = payload_size(shape, ref.n_cells)
            if st.st_size != HEADER.size + size:
                raise BadBlock(f"block {ref.key} has {st.st_size:,} bytes, {HEADER.size + size:,} were written")
            try:
                magic, n, cb, raw_key, raw_digest = HEADER.unpack(f.read(HEADER.size))
            except struct.error:
                raise BadBlock(f"block {ref.key}'s header is cut short") from None
            if magic != MAGIC_BLOCK or raw_key.hex() != ref.key or n != ref.n_cells or cb != shape.cell_bytes \
                    or _digest_of(raw_digest) != ref.digest:
                raise BadBlock(f"block {ref.key}'s header is not the one its manifest names")
            arr = np.memmap(f, dtype=np.uint8, mode="r", offset=HEADER.size, shape=(size,))
        ident = Ident.of(st)
        with self._lock:
            known = self._checked.get(ref.key) == (ident, ref.digest)
        if not known:
            h = Hasher()
            h.update(arr.data)
            if h.hexdigest() != ref.digest:
                raise BadBlock(f"block {ref.key}'s bytes changed: its digest is {h.hexdigest()}")
            with self._lock:
                self._checked[ref.key] = (ident, ref.digest)
        return arr

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

    def set_aside(self, key: str) -> tuple[Path, int] | None:
        """The block renamed aside for the caller to unlink (its name gone at once, the unlink
        of 32 MiB not under any lock), unless a save or an assembly holds it: → (where, bytes)."""
        with self._lock:
            if self._pins.get(key):
                return None
            p = self.path(key)
            dead = p.parent / f".{key}.{uuid.uuid4().hex[:8]}.dead.partial"  # a crash's leftover: cleanup()
            try:
                size = p.stat().st_size
                os.rename(p, dead)
            except FileNotFoundError:
                return None
            self._checked.pop(key, None)
        return dead, size

    def cleanup(self) -> list[str]:
        """At start: the temporaries a crash left in the block directories."""
        removed = []
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

    def quarantine(self, key: str, qdir: Path) -> None:
        """A block found damaged, moved aside (the manifests naming it are the caller's)."""
        with contextlib.suppress(FileNotFoundError):
            qdir.mkdir(mode=0o700, exist_ok=True)
            os.rename(self.path(key), qdir / f"{key}.blk.{uuid.uuid4().hex[:6]}")
        with self._lock:
            self._checked.pop(key, None)


# -- assembling a file ---------------------------------------------------------------------------
def file_size(shape: Shape, n_tokens: int, n_cells: int) -> int:
    """Bytes of the slot file assemble() writes for n_tokens tokens over n_cells cells."""
    head = 12 + 4 * (4 + n_tokens)
    data = 16 + sum(12 + n_cells * x.k_row for x in shape.layers)
    data += sum(12 + (x.n_embd_v * n_cells * x.v_row if shape.v_trans else n_cells * x.v_row) for x in shape.layers)
    return head + 4 + 4 * shape.n_stream + n_cells * shape.cell_bytes + data  # n_stream, a count per stream


def assemble(store: BlockStore, shape: Shape, tokens: bytes, refs: Sequence[BlockRef], n_cells: int,
             out: BinaryIO) -> str:
    """Write to `out` the slot file of the first len(tokens)/4 tokens over the first n_cells
    cells of `refs` (each block checked first). → the file's digest. BadBlock: nothing usable."""
    n_tokens = len(tokens) // 4
    if n_cells > sum(r.n_cells for r in refs) or n_cells > n_tokens or n_tokens - n_cells > 1:
        raise BadBlock(f"{n_cells:,} cells from blocks of {sum(r.n_cells for r in refs):,} for {n_tokens:,} tokens")
    take: list[tuple[BlockRef, int]] = []
    left = n_cells
    for r in refs:
        if left <= 0:
            break
        take.append((r, min(r.n_cells, left)))
        left -= r.n_cells
    h = Hasher()

    def put(b: bytes | memoryview) -> None:
        h.update(b)
        out.write(b)

    put(struct.pack("<III3i", MAGIC, VERSION, 4 + n_tokens, TOKEN_NULL, PAYLOAD_VERSION, n_tokens))
    put(tokens)
    put(struct.pack("<iII", 0, shape.n_stream, n_cells))
    arrays = [(store.opened(r, shape), r.n_cells, k) for r, k in take]
    # The maps are unmapped as `arrays` and the views of them go.
    cb = shape.cell_bytes
    at0 = 0
    for arr, n, k in arrays:  # the cells' meta: positions 0 … n_cells−1, checked
        meta = arr[:k * cb]
        pos = meta.view(np.int32).reshape(k, cb // 4)[:, 0]
        if not np.array_equal(pos, np.arange(at0, at0 + k, dtype=np.int32)):
            raise BadBlock("a block's positions are not the ones its place in the manifest says")
        at0 += k
        put(meta.data)
    put(struct.pack("<IIII", shape.v_trans, len(shape.layers), shape.n_rot_k, shape.n_rot_v))
    offsets = [n * cb for _, n, _ in arrays]  # where each block's next section starts
    for layer in shape.layers:
        put(struct.pack("<iQ", layer.k_type, layer.k_row))
        for i, (arr, n, k) in enumerate(arrays):
            at = offsets[i]
            put(arr[at:at + k * layer.k_row].data)
            offsets[i] = at + n * layer.k_row
    for layer in shape.layers:
        if shape.v_trans:
            put(struct.pack("<iII", layer.v_type, layer.v_row, layer.n_embd_v))
            parts = []
            for i, (arr, n, k) in enumerate(arrays):
                at = offsets[i]
                size = layer.n_embd_v * n * layer.v_row
                parts.append(arr[at:at + size].reshape(layer.n_embd_v, n, layer.v_row)[:, :k, :])
                offsets[i] = at + size
            put(np.concatenate(parts, axis=1).reshape(-1).data if parts else b"")
        else:
            put(struct.pack("<iQ", layer.v_type, layer.v_row))
            for i, (arr, n, k) in enumerate(arrays):
                at = offsets[i]
                put(arr[at:at + k * layer.v_row].data)
                offsets[i] = at + n * layer.v_row
    del arrays  # the block files' maps go with it
    put(b"\0" * (4 * (shape.n_stream - 1)))
    return h.hexdigest()


def split(store: BlockStore, kv: KVFile, path: Path, model: str,
          keys: Sequence[str] | None = None) -> tuple[list[BlockRef], int]:
    """Cut the file at `path` (parsed as kv) into blocks, storing those not stored yet:
    → (its blocks, bytes written). keys: its chain(), when the caller has it (to pin them).
    The blocks' directories are fsynced before it returns."""
    from .slotfile import encode

    if keys is None:
        keys = chain(model, kv.shape, encode(kv.tokens[:kv.n_cells]), kv.n_cells)
    refs, written = [], 0
    f, st = files.open_regular(path)
    with f:
        mm = np.memmap(f, dtype=np.uint8, mode="r", shape=(st.st_size,))
        for b, key in enumerate(keys):
            start, end = b * BLOCK_TOKENS, min(kv.n_cells, (b + 1) * BLOCK_TOKENS)
            have = store.info(key)
            if have is not None and have[0] == end - start:
                refs.append(BlockRef(key, end - start, have[1]))
                continue
            digest, n = store.put(key, end - start, kv.shape.cell_bytes, cut(kv, mm, start, end))
            refs.append(BlockRef(key, end - start, digest))
            written += n
    store.sync(keys)  # even if this save wrote none: another save's block may not be durable by name yet
    return refs, written


def errno_is_space(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)
