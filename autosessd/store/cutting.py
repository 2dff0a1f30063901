"""A slot file cut into token blocks, and one assembled from them (issue 39; blocks.py has the
blocks' keys, format and life).

split() cuts the engine's file into blocks of BLOCK_TOKENS cells in position order (its cells
are in cache order: cut() gathers each block's by position) and stores those not stored yet,
and its tail (a window model's window cache, a hybrid's recurrent state: kvfile.py) as a block
of its own. assemble() writes a slot file of the first m tokens from a manifest's blocks: the
engine's header and payload with those tokens, one stream of min(m, cells) cells at positions
0…m−1, the data per layer from each block in order, and the manifest's stream count; then, for
a file with a tail (m is then all of it), the tail as the engine wrote it. It reads each block
section by section (BlockReader, below): at most OPEN_AT_ONCE descriptors whatever its length.

split() maps the engine's file (cut() gathers rows across it, V transposed too), after every
byte of it was read with read() (its digest: Store.finalize, or `expect` for an import), so a
read error of the disk is found there as OSError, not under the map as SIGBUS: a file in
staging, on tmpfs where that is set up, whose name only the engine writes, under the key's lock
(sessions/saves.py), or a whole file of the store's being imported.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Sequence

import numpy as np

from ..base import files
from ..base.files import Hasher, Ident
from . import blocks
from .blocks import HEADER, MAGIC_BLOCK, BadBlock, BlockRef, BlockStore, NotTheFile, OtherBlock, TailRef, Unreadable, \
    chain, payload_size, tail_key
from .kvfile import KVFile, Shape
from .slotfile import MAGIC, PAYLOAD_VERSION, TOKEN_NULL, VERSION


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


def file_size(shape: Shape, n_tokens: int, n_cells: int, tail: int = 0) -> int:
    """Bytes of the slot file assemble() writes for n_tokens tokens over n_cells cells (and a
    tail of `tail` bytes)."""
    head = 12 + 4 * (4 + n_tokens)
    data = 16 + sum(12 + n_cells * x.k_row for x in shape.layers)
    data += sum(12 + (x.n_embd_v * n_cells * x.v_row if shape.v_trans else n_cells * x.v_row) for x in shape.layers)
    return head + 4 + 4 * shape.n_stream + n_cells * shape.cell_bytes + data + tail  # n_stream, a count per stream


def assemble(store: BlockStore, shape: Shape, tokens: bytes, refs: Sequence[BlockRef], n_cells: int,
             out: BinaryIO, tail: TailRef | None = None) -> str:
    """Write to `out` the slot file of the first len(tokens)/4 tokens over the first n_cells
    cells of `refs`, then `tail` (it must then be all of them). → the file's digest. Every block
    read is checked against its digest before this returns (the caller hands `out` to the engine
    only then). BadBlock: a block is not what its manifest says; Unreadable: a block could not
    be read (nothing is wrong with it)."""
    n_tokens = len(tokens) // 4
    if n_cells > sum(r.n_cells for r in refs) or n_cells > n_tokens or n_tokens - n_cells > 1:
        raise BadBlock(f"{n_cells:,} cells from blocks of {sum(r.n_cells for r in refs):,} for {n_tokens:,} tokens")
    if tail is not None and n_cells != sum(r.n_cells for r in refs):
        raise BadBlock(f"{n_cells:,} of {sum(r.n_cells for r in refs):,} cells asked of a file with a tail: its tail "
                       f"holds the state at its last position only")
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
    readers: list[BlockReader] = []
    try:
        for i, (r, _) in enumerate(take):
            readers.append(BlockReader(store, r, shape, keep_open=i < blocks.OPEN_AT_ONCE))
        cb = shape.cell_bytes
        at0 = 0
        for rd, (r, k) in zip(readers, take):  # the cells' meta: positions 0 … n_cells−1, checked
            meta = memoryview(rd.read(r.n_cells * cb, k * cb))[:k * cb]
            pos = np.frombuffer(meta, dtype=np.int32).reshape(k, cb // 4)[:, 0]
            if not np.array_equal(pos, np.arange(at0, at0 + k, dtype=np.int32)):
                raise BadBlock(f"block {r.key}'s positions are not the ones its place in the manifest says")
            at0 += k
            put(meta)
        put(struct.pack("<IIII", shape.v_trans, len(shape.layers), shape.n_rot_k, shape.n_rot_v))
        for layer in shape.layers:
            put(struct.pack("<iQ", layer.k_type, layer.k_row))
            for rd, (r, k) in zip(readers, take):
                put(memoryview(rd.read(r.n_cells * layer.k_row, k * layer.k_row))[:k * layer.k_row])
        for layer in shape.layers:
            if shape.v_trans:
                put(struct.pack("<iII", layer.v_type, layer.v_row, layer.n_embd_v))
                parts = []
                for rd, (r, k) in zip(readers, take):
                    raw = rd.read(layer.n_embd_v * r.n_cells * layer.v_row)
                    parts.append(np.frombuffer(raw, dtype=np.uint8)
                                 .reshape(layer.n_embd_v, r.n_cells, layer.v_row)[:, :k, :])
                put(np.concatenate(parts, axis=1).reshape(-1).data if parts else b"")
            else:
                put(struct.pack("<iQ", layer.v_type, layer.v_row))
                for rd, (r, k) in zip(readers, take):
                    put(memoryview(rd.read(r.n_cells * layer.v_row, k * layer.v_row))[:k * layer.v_row])
        for rd in readers:
            rd.finish()
    finally:
        for rd in readers:
            rd.close()
    put(b"\0" * (4 * (shape.n_stream - 1)))
    if tail is not None:
        read_tail(store, tail, put)
    return h.hexdigest()


def read_tail(store: BlockStore, tail: TailRef, put: Callable[[bytes], object]) -> None:
    """Hand `put` a tail's bytes in pieces, each checked as it is read; BadBlock at the end when
    they are not the manifest's (the caller drops what it wrote), Unreadable for an error of the
    system's."""
    try:
        f, st = files.open_regular(store.path(tail.key))
    except FileNotFoundError:
        raise BadBlock(f"block {tail.key} (a tail) is missing") from None
    except OSError as e:
        raise Unreadable(f"block {tail.key}: {e.strerror or e}") from None
    with f:
        if st.st_size != HEADER.size + tail.size:
            raise BadBlock(f"block {tail.key} has {st.st_size:,} bytes, {HEADER.size + tail.size:,} were written")
        try:
            magic, n, cb, raw_key, _ = HEADER.unpack(f.read(HEADER.size))
        except struct.error:
            raise BadBlock(f"block {tail.key} ends inside its header") from None
        if magic != MAGIC_BLOCK or raw_key.hex() != tail.key or n != 0 or cb != 0:
            raise BadBlock(f"block {tail.key}'s header is not the one its manifest names")
        h = Hasher()
        left = tail.size
        try:
            while left > 0:
                chunk = f.read(min(files.CHUNK, left))
                if not chunk:
                    raise BadBlock(f"block {tail.key} ends {left:,} bytes early")
                h.update(chunk)
                put(chunk)
                left -= len(chunk)
        except OSError as e:
            raise Unreadable(f"block {tail.key}: {e.strerror or e}") from None
    if h.hexdigest() != tail.digest:
        raise BadBlock(f"block {tail.key}'s bytes changed: its digest is {h.hexdigest()}")


def split(store: BlockStore, kv: KVFile, path: Path, model: str, keys: Sequence[str] | None = None,
          expect: str | None = None) -> tuple[list[BlockRef], TailRef | None, int]:
    """Cut the file at `path` (parsed as kv) into blocks, storing those not stored yet, and its
    tail: → (its blocks, its tail, bytes written). keys: its chain(), when the caller has it (to
    pin them). The tail's key is known only once its bytes are hashed: it comes back pinned, and
    the caller unpins it once its manifest names it (or it gives up).
    expect: the digest the file must have (a file kept a while, imported now): its map is
    hashed first and cut only when it matches, so that no damaged byte becomes a block that
    later saves name (NotTheFile otherwise, before any block is written). The blocks'
    directories are fsynced before it returns."""
    from .slotfile import encode

    if keys is None:
        keys = chain(model, kv.shape, encode(kv.tokens[:kv.n_cells]), kv.n_cells)
    refs, written = [], 0
    f, st = files.open_regular(path)
    with f:
        if expect is not None:  # read, not mapped: a read error of the disk is OSError here, not SIGBUS
            h = Hasher()
            for at in range(0, st.st_size, files.CHUNK):
                h.update(os.pread(f.fileno(), min(files.CHUNK, st.st_size - at), at))
            if h.hexdigest() != expect:
                raise NotTheFile(f"{path.name}'s digest is {h.hexdigest()}, {expect} was saved: its bytes changed")
        mm = np.memmap(f, dtype=np.uint8, mode="r", shape=(st.st_size,))
        for b, key in enumerate(keys):
            start, end = b * blocks.BLOCK_TOKENS, min(kv.n_cells, (b + 1) * blocks.BLOCK_TOKENS)
            have = store.info(key)
            if have is not None and have[0] == end - start:
                refs.append(BlockRef(key, end - start, have[1]))
                continue
            digest, n = store.put(key, end - start, kv.shape.cell_bytes, cut(kv, mm, start, end))
            refs.append(BlockRef(key, end - start, digest))
            written += n
        tail = None
        if kv.shape.tail:
            tail, n = _put_tail(store, kv, mm, st.st_size, model)
            written += n
    try:
        store.sync([*keys, *([tail.key] if tail else [])])  # even if this save wrote none: another save's may not be durable by name yet
    except BaseException:
        if tail is not None:
            store.unpin([tail.key])
        raise
    return refs, tail, written


def _put_tail(store: BlockStore, kv: KVFile, mm: np.ndarray, size: int, model: str) -> tuple[TailRef, int]:
    """The file's tail stored as a block of its own (unless it is there): → (its reference,
    pinned; bytes written)."""
    def pieces() -> Iterator[memoryview]:
        return (mm[at:min(at + files.CHUNK, size)].data for at in range(kv.tail_at, size, files.CHUNK))

    h = Hasher()
    for piece in pieces():
        h.update(piece)
    key = tail_key(model, kv.shape, h.hexdigest())
    held = store.pin([key])
    try:
        digest, written = store.put(key, 0, 0, pieces())
    except BaseException:
        store.unpin(held)
        raise
    return TailRef(key, size - kv.tail_at, digest), written


class BlockReader:
    """One block read for an assembly, section by section in the order of its payload (its
    cells' meta, K per layer, V per layer), each section with a pread. keep_open (the first
    OPEN_AT_ONCE blocks of an assembly): the file stays open; the others are opened again for
    each section. So an assembly of any length holds at most OPEN_AT_ONCE descriptors. Every
    opening must find the file of the first (its identity); the payload is hashed as it is read,
    unless this very file was read whole and found right before, and finish() compares the digest.

    Read, never mapped: a read error of the disk (EIO, a checksumming filesystem's) under a map
    is SIGBUS, which kills the daemon, and a restore at its next start would meet it again;
    a pread reports it (Unreadable), and the turn re-reads the prompt.

    BadBlock: evidence about the block itself (missing, its size, its header, its digest).
    Unreadable: anything else (EMFILE, EIO, EACCES, the file replaced while read)."""

    def __init__(self, store: BlockStore, ref: BlockRef, shape: Shape, keep_open: bool):
        self.store, self.ref, self.shape = store, ref, shape
        self.size = payload_size(shape, ref.n_cells)
        self.keep_open = keep_open
        self.fd: int | None = None
        self.at = 0
        fd = self._open()
        try:
            st = os.fstat(fd)
            if st.st_size != HEADER.size + self.size:
                raise BadBlock(f"block {ref.key} has {st.st_size:,} bytes, {HEADER.size + self.size:,} were written")
            head = self._pread(fd, HEADER.size, 0)
            magic, n, cb, raw_key, raw_digest = HEADER.unpack(head)
            if magic != MAGIC_BLOCK or raw_key.hex() != ref.key or n != ref.n_cells or cb != shape.cell_bytes:
                raise BadBlock(f"block {ref.key}'s header is not the one its manifest names")
            self.own_digest = blocks._digest_of(raw_digest)  # what its header says: finish() tells damage from another block
            self.ident = Ident.of(st)
            self.hasher = None if store._checked_as(ref.key) == (self.ident, ref.digest) else Hasher()
        except BaseException:
            os.close(fd)
            raise
        if keep_open:
            self.fd = fd
        else:
            os.close(fd)

    def _open(self) -> int:
        p = self.store.path(self.ref.key)
        try:
            return os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise BadBlock(f"block {self.ref.key} is missing") from None
        except OSError as e:
            raise Unreadable(f"block {self.ref.key}: {e.strerror or e}") from None

    def _pread(self, fd: int, n: int, offset: int) -> bytes:
        try:
            got = os.pread(fd, n, offset)
        except OSError as e:
            raise Unreadable(f"block {self.ref.key}: {e.strerror or e}") from None
        if len(got) != n:
            raise BadBlock(f"block {self.ref.key} ends {n - len(got):,} bytes early")
        return got

    def read(self, section: int, take: int | None = None) -> bytes | memoryview:
        """The next `section` bytes of the payload (only their first `take` when the rest is not
        wanted and nothing needs hashing)."""
        want = section if take is None or self.hasher is not None else take
        if self.fd is not None:
            got: bytes | memoryview = self._pread(self.fd, want, HEADER.size + self.at)
        else:
            fd = self._open()
            try:
                if Ident.of(os.fstat(fd)) != self.ident:
                    raise Unreadable(f"block {self.ref.key} was replaced while it was read")
                got = self._pread(fd, want, HEADER.size + self.at)
            finally:
                os.close(fd)
        self.at += section
        if self.hasher is not None:
            self.hasher.update(got)
        return got

    def finish(self) -> None:
        """Every section read: the payload is the one its manifest names."""
        self.close()
        if self.hasher is None:
            return
        if self.at != self.size:
            raise BadBlock(f"block {self.ref.key}: {self.at:,} of its {self.size:,} bytes read")
        digest = self.hasher.hexdigest()
        if digest != self.ref.digest:
            if digest == self.own_digest:  # whole: the key's block was written again since the manifest
                raise OtherBlock(self.ref.key, f"block {self.ref.key} holds other bytes than its manifest recorded "
                                               f"(written again since): {digest}")
            raise BadBlock(f"block {self.ref.key}'s bytes changed: its digest is {digest}")
        self.store._read_whole(self.ref.key, self.ident, digest)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
