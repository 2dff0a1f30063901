"""A slot file cut into token blocks, and one assembled from them (issue 39; blocks.py has the
blocks' keys, format and life).

split() cuts the engine's file into blocks of BLOCK_TOKENS cells in position order (its cells
are in cache order: cut() gathers each block's by position) and stores those not stored yet.
assemble() writes a slot file of the first m tokens from a manifest's blocks: the engine's
header and payload with those tokens, one stream of min(m, cells) cells at positions 0…m−1,
the data per layer from each block in order, and the manifest's stream count. It reads each
block section by section (BlockReader): at most OPEN_AT_ONCE descriptors whatever its length.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO, Iterator, Sequence

import numpy as np

from ..base import files
from ..base.files import Hasher
from . import blocks
from .blocks import BadBlock, BlockReader, BlockRef, BlockStore, NotTheFile, chain
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


def file_size(shape: Shape, n_tokens: int, n_cells: int) -> int:
    """Bytes of the slot file assemble() writes for n_tokens tokens over n_cells cells."""
    head = 12 + 4 * (4 + n_tokens)
    data = 16 + sum(12 + n_cells * x.k_row for x in shape.layers)
    data += sum(12 + (x.n_embd_v * n_cells * x.v_row if shape.v_trans else n_cells * x.v_row) for x in shape.layers)
    return head + 4 + 4 * shape.n_stream + n_cells * shape.cell_bytes + data  # n_stream, a count per stream


def assemble(store: BlockStore, shape: Shape, tokens: bytes, refs: Sequence[BlockRef], n_cells: int,
             out: BinaryIO) -> str:
    """Write to `out` the slot file of the first len(tokens)/4 tokens over the first n_cells
    cells of `refs`. → the file's digest. Every block read is checked against its digest before
    this returns (the caller hands `out` to the engine only then). BadBlock: a block is not what
    its manifest says; Unreadable: a block could not be read (nothing is wrong with it)."""
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
    readers: list[BlockReader] = []
    try:
        for i, (r, _) in enumerate(take):
            readers.append(store.reader(r, shape, keep_open=i < blocks.OPEN_AT_ONCE))
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
    return h.hexdigest()


def split(store: BlockStore, kv: KVFile, path: Path, model: str,
          keys: Sequence[str] | None = None, expect: str | None = None) -> tuple[list[BlockRef], int]:
    """Cut the file at `path` (parsed as kv) into blocks, storing those not stored yet:
    → (its blocks, bytes written). keys: its chain(), when the caller has it (to pin them).
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
        mm = np.memmap(f, dtype=np.uint8, mode="r", shape=(st.st_size,))
        if expect is not None:
            h = Hasher()
            for at in range(0, st.st_size, files.CHUNK):
                h.update(mm[at:at + files.CHUNK].data)
            if h.hexdigest() != expect:
                raise NotTheFile(f"{path.name}'s digest is {h.hexdigest()}, {expect} was saved: its bytes changed")
        for b, key in enumerate(keys):
            start, end = b * blocks.BLOCK_TOKENS, min(kv.n_cells, (b + 1) * blocks.BLOCK_TOKENS)
            have = store.info(key)
            if have is not None and have[0] == end - start:
                refs.append(BlockRef(key, end - start, have[1]))
                continue
            digest, n = store.put(key, end - start, kv.shape.cell_bytes, cut(kv, mm, start, end))
            refs.append(BlockRef(key, end - start, digest))
            written += n
    store.sync(keys)  # even if this save wrote none: another save's block may not be durable by name yet
    return refs, written


