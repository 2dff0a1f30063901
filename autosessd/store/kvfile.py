"""A llama-server slot file read as far as cutting it into token blocks needs (issue 39).

The layout (b11434; DESIGN §9, read in llama.cpp's `llama_kv_cache::state_write` and tried on
the engine): the header and the server's payload (slotfile.py), then one KV cache's state:

    u32 n_stream; per stream u32 cell_count and, when it is not 0, that stream's cells:
      per cell  i32 pos, u32 n_seq_id (1 for a slot's save), [12 bytes of cell extension:
                M-RoPE models], i32 seq id          (cache order, not position order)
      data      u32 v_trans, u32 n_layer, u32 n_rot_k, u32 n_rot_v;
                per layer K: i32 type, u64 row size, cells × row;
                per layer V: v_trans 0: i32 type, u64 row size, cells × row;
                             v_trans 1: i32 type, u32 element size, u32 n_embd_v,
                                        n_embd_v runs of cells × element size

A file is cut into blocks only when all of that holds: the server's payload holds text tokens
only (no media), exactly one stream holds cells, each cell belongs to one sequence, the
positions are 0 … n−1 each once (no context shift), at most one token more than cells (the last
sampled token has no KV yet) and every layer has its V. Anything else stays a whole file, with
the reason.

What follows that first cache's state is the file's **tail** (issue 47), kept as it is, once per
save: a sliding-window model writes its window cache after its full-attention one
(llama_kv_cache_iswa::state_write: the window layers' last n_swa cells), a hybrid model its
recurrent state after its attention cache (llama_memory_hybrid::state_write: per layer the
conv and SSM rows of the sequence's one cell). A tail is valid only at the position it was
taken at, so a file with one is restored whole, never as its first m tokens. It is read far
enough to know it is one of those two and belongs to the same tokens (`tail_kind`); any other
rest keeps the file whole.

The loader checks counts, types, row sizes, n_rot and that the file is long enough; it checks
neither positions nor that the token list matches the KV, and it discards a cell's seq id (it
restores into the slot it is asked to). So a file assembled from blocks is right only if each
block is the KV of exactly its tokens at exactly its positions: blocks.py keys them so.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..base.files import open_regular
from .slotfile import MAGIC, PAYLOAD_VERSION, TOKEN_NULL, VERSION

WINDOW = "window"  # a sliding-window model's window cache (its last n_swa cells)
RECURRENT = "recurrent"  # a hybrid model's recurrent state (one cell: the sequence's last position)
TAILS = ("", WINDOW, RECURRENT)
# Why an earlier autosessd kept a window or hybrid model's file whole: such a file is cut now.
WHOLE_BEFORE_TAILS = "it holds more than one KV cache (a sliding-window or hybrid model)"


def cut_now(why: str | None) -> bool:
    """A whole file's reason (Meta.whole) that no longer holds: worth cutting again."""
    return why is None or why == WHOLE_BEFORE_TAILS


class NotSliceable(ValueError):
    """A slot file that stays whole; says why, in words for `ls` and status. whole: the reading
    got through one whole cache's state (what follows it is what does not fit)."""

    def __init__(self, why: str, whole: bool = False):
        super().__init__(why)
        self.whole = whole


@dataclass(frozen=True)
class Layer:
    k_type: int
    k_row: int
    v_type: int
    v_row: int  # v_trans 0: a cell's V row; v_trans 1: the element size
    n_embd_v: int  # v_trans 1 only (0 otherwise)


@dataclass(frozen=True)
class Shape:
    """What makes blocks of one engine's files loadable together, and how big a cell is: in
    every block key (blocks.chain) and in the manifest, from which a file is assembled."""

    n_stream: int
    cell_bytes: int  # 12, or 24 with the cell extension (M-RoPE)
    v_trans: int
    n_rot_k: int
    n_rot_v: int
    layers: tuple[Layer, ...]
    # What follows this cache in the model's files: "" nothing (a plain model), WINDOW or
    # RECURRENT. Part of the fingerprint: the blocks of a model's full-attention layers are
    # never taken for those of a model whose attention is all of it.
    tail: str = ""

    def fingerprint(self) -> str:
        """Everything the loader checks of a cell's data, and the cell's size: blocks of shapes
        whose fingerprints differ never share a key (n_stream is the file's framing, not a
        block's: the assembled file takes the manifest's)."""
        per = ";".join(f"{x.k_type},{x.k_row},{x.v_type},{x.v_row},{x.n_embd_v}" for x in self.layers)
        tail = f"-t{self.tail}" if self.tail else ""
        return f"c{self.cell_bytes}-v{self.v_trans}-r{self.n_rot_k},{self.n_rot_v}-L{len(self.layers)}:{per}{tail}"

    def cell_size(self) -> int:
        """Bytes one cell takes in a block: its meta, its K rows and its V (rows or elements)."""
        v = sum(x.v_row * (x.n_embd_v if self.v_trans else 1) for x in self.layers)
        return self.cell_bytes + sum(x.k_row for x in self.layers) + v

    def to_json(self) -> dict:
        d = {"n_stream": self.n_stream, "cell_bytes": self.cell_bytes, "v_trans": self.v_trans,
             "n_rot": [self.n_rot_k, self.n_rot_v],
             "layers": [[x.k_type, x.k_row, x.v_type, x.v_row, x.n_embd_v] for x in self.layers]}
        if self.tail:
            d["tail"] = self.tail
        return d

    @classmethod
    def from_json(cls, d: object) -> "Shape":
        if not isinstance(d, dict):
            raise ValueError("kv: not an object")
        layers = tuple(Layer(*(int(v) for v in x)) for x in d["layers"])
        if not layers:
            raise ValueError("kv: no layers")
        shape = cls(int(d["n_stream"]), int(d["cell_bytes"]), int(d["v_trans"]), int(d["n_rot"][0]),
                    int(d["n_rot"][1]), layers, str(d.get("tail", "")))
        if shape.cell_bytes not in (12, 24) or shape.v_trans not in (0, 1) or not 0 < shape.n_stream <= 4096 \
                or shape.tail not in TAILS:
            raise ValueError("kv: implausible shape")
        return shape


@dataclass(frozen=True)
class KVFile:
    """Where everything is in one sliceable slot file (offsets into it)."""

    size: int
    tokens: tuple[int, ...]
    shape: Shape
    n_cells: int
    cells_at: int  # the first cell's meta
    k_at: tuple[int, ...]  # per layer: its K data
    v_at: tuple[int, ...]  # per layer: its V data
    order: np.ndarray  # cell index in the file of position 0, 1, … (cells are in cache order)
    tail_at: int = 0  # where the tail starts (== size: none); shape.tail says what it is

    @property
    def tail_bytes(self) -> int:
        return self.size - self.tail_at if self.shape.tail else 0


class _Reads:
    """A file's bytes by pread, sliced as a buffer is (r[a:b] → bytes): parse() reads its
    headers and cells' meta so, a few hundred small reads, never through a map (a read error
    of the disk under a map is SIGBUS, which kills the daemon; here it is OSError)."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size

    def __getitem__(self, s: slice) -> bytes:
        start, stop = s.start, min(s.stop, self.size)
        if stop <= start:
            return b""
        got = os.pread(self.fd, stop - start, start)
        if len(got) != stop - start:
            raise NotSliceable("it ended while it was read (written again meanwhile?)")
        return got


def _unpack(fmt: str, mm: _Reads, at: int) -> tuple:
    return struct.unpack(fmt, mm[at:at + struct.calcsize(fmt)])


def _u32(mm: _Reads, at: int) -> int:
    return _unpack("<I", mm, at)[0]


def parse(path: str | Path, max_tokens: int | None = None) -> KVFile:
    """The file's layout, or NotSliceable saying why it stays whole (OSError: unreadable)."""
    f, st = open_regular(path)
    with f:
        size = st.st_size
        if size < 16:
            raise NotSliceable("too short for a slot file")
        return _parse(_Reads(f.fileno(), size), size, max_tokens)


def _parse(mm: _Reads, size: int, max_tokens: int | None) -> KVFile:
    magic, version, n_words = _unpack("<III", mm, 0)
    if magic != MAGIC or version != VERSION:
        raise NotSliceable(f"not a llama-server slot file of version {VERSION}")
    if 12 + 4 * n_words + 4 > size or (max_tokens is not None and n_words > max_tokens + 4):
        raise NotSliceable(f"its header claims {n_words:,} words")
    head = _unpack("<3i", mm, 12) if n_words >= 3 else ()
    if len(head) < 3 or head[0] != TOKEN_NULL or head[1] != PAYLOAD_VERSION:
        raise NotSliceable("an older server's header (a plain token list)")
    n_tok = head[2]
    if n_tok < 0 or n_words != 4 + n_tok:
        raise NotSliceable("its payload holds media (images) or more than tokens")
    tokens = _unpack(f"<{n_tok}i", mm, 24)
    if _u32(mm, 24 + 4 * n_tok) != 0:
        raise NotSliceable("its payload holds media (images)")
    at = 12 + 4 * n_words
    n_stream = _u32(mm, at)
    if not 0 < n_stream <= 4096:
        raise NotSliceable(f"{n_stream} KV streams is not a plausible count")
    at += 4
    for s in range(n_stream):
        if at + 4 > size:
            raise NotSliceable("it ends inside its KV stream counts")
        n_cells = _u32(mm, at)
        at += 4
        if n_cells:
            break
    else:
        raise NotSliceable("it holds no cells (an empty slot)")
    if n_cells > n_tok or n_tok - n_cells > 1:
        raise NotSliceable(f"{n_cells:,} cells for {n_tok:,} tokens (a sliding window, or a context shift)")
    why: list[NotSliceable] = []
    found: list[KVFile] = []
    for cell_bytes in (12, 24):
        try:
            shape, k_at, v_at, end = _data(mm, size, at, n_cells, cell_bytes, s, n_stream)
        except NotSliceable as e:
            why.append(e)
            continue
        cells = np.frombuffer(mm[at:at + n_cells * cell_bytes], dtype=np.int32)
        cells = cells.reshape(n_cells, cell_bytes // 4)
        if not np.all(cells[:, 1] == 1):
            why.append(NotSliceable("a cell belongs to more than one sequence"))
            continue
        pos = cells[:, 0]
        order = np.argsort(pos, kind="stable")
        if not np.array_equal(pos[order], np.arange(n_cells, dtype=np.int32)):
            why.append(NotSliceable("its positions are not 0 … n−1 each once (a context shift)"))
            continue
        tail = ""
        if end != size:
            try:
                tail = tail_kind(mm, size, end, n_cells, n_stream)
            except NotSliceable as e:
                why.append(e)
                continue
        found.append(KVFile(size, tuple(tokens), dataclasses.replace(shape, tail=tail), n_cells, at, k_at, v_at,
                            order, end))
    if found:  # a reading that ends with the file's end before one that leaves a tail
        return min(found, key=lambda kv: kv.tail_bytes)
    # The reason of the reading that got through a whole cache, if one did; else the first's.
    raise next((e for e in why if e.whole), why[0])


def tail_kind(mm: _Reads, size: int, at: int, n_cells: int, n_stream: int) -> str:
    """What the rest of a file from `at` is, after a first cache of n_cells cells at positions
    0 … n_cells−1: WINDOW (a second KV cache's state to the file's end, fewer cells than the
    first, every one of one sequence at one of those positions, the last among them: read on
    its own, whatever order the first's cells come back in) or RECURRENT (the state of one
    recurrent cell at the last of them, as llama_memory_recurrent::state_write writes a
    sequence's: u32 1, i32 pos, u32 0 seq ids, u32 s_trans, u32 n_layer, then its rows, read no
    further: their layout differs by architecture). NotSliceable for anything else."""
    other = NotSliceable("it holds more than one KV cache, and what follows the first is neither a window's cells "
                         "nor a recurrent state this code reads", whole=True)
    if at + 20 <= size:
        count, pos, n_seq, s_trans, n_layer = _unpack("<IiIII", mm, at)
        if count == 1 and pos == n_cells - 1 and n_seq == 0 and s_trans <= 1 and 0 < n_layer <= 4096:
            return RECURRENT
    if at + 4 > size or _u32(mm, at) != n_stream:
        raise other
    p = at + 4
    for s in range(n_stream):
        if p + 4 > size:
            raise other
        n = _u32(mm, p)
        p += 4
        if n:
            break
    else:
        raise other
    if n >= n_cells:
        # Not a window: a second cache of every cell (a cache mirroring the first cell for cell, as
        # some models' indexers do, is read into the first's cells: cutting would reorder them
        # under it). A window model's conversation no longer than its window stays whole too.
        raise other
    for cell_bytes in (12, 24):
        try:
            _, _, _, end = _data(mm, size, p, n, cell_bytes, s, n_stream)
        except NotSliceable:
            continue
        if end != size:
            continue
        cells = np.frombuffer(mm[p:p + n * cell_bytes], dtype=np.int32).reshape(n, cell_bytes // 4)
        pos = cells[:, 0]
        if np.all(cells[:, 1] == 1) and pos.min() >= 0 and pos.max() == n_cells - 1 \
                and len(np.unique(pos)) == n:
            return WINDOW
    raise other


def _data(mm: _Reads, size: int, cells_at: int, n: int, cell_bytes: int, s: int,
          n_stream: int) -> tuple[Shape, tuple[int, ...], tuple[int, ...], int]:
    """One cache's data after its n cells' meta: its shape, where each layer's K and V are, and
    where its state ends (after the zero counts of the streams after s)."""
    at = cells_at + n * cell_bytes
    if at + 16 > size:
        raise NotSliceable("it ends inside its cells")
    v_trans, n_layer, n_rot_k, n_rot_v = _unpack("<IIII", mm, at)
    if v_trans > 1 or not 0 < n_layer <= 4096:
        raise NotSliceable("its KV state is not a plain cache this code can cut")
    at += 16
    ks, k_at = [], []
    for _ in range(n_layer):
        if at + 12 > size:
            raise NotSliceable("it ends inside its K data")
        k_type, k_row = _unpack("<iQ", mm, at)
        if not 0 <= k_type < 256 or not 0 < k_row < 1 << 30:
            raise NotSliceable("its K data is not a plain cache's")
        at += 12
        k_at.append(at)
        ks.append((k_type, k_row))
        at += n * k_row
    layers, v_at = [], []
    for k_type, k_row in ks:
        if at + 12 > size:
            raise NotSliceable("it ends inside its V data (a layer without V?)")
        v_type = _unpack("<i", mm, at)[0]
        if not 0 <= v_type < 256:
            raise NotSliceable("its V data is not a plain cache's")
        if v_trans:
            el, n_embd = _unpack("<II", mm, at + 4)
            if not 0 < el <= 64 or not 0 < n_embd < 1 << 20:
                raise NotSliceable("its V data is not a plain cache's")
            at += 12
            v_at.append(at)
            at += n_embd * n * el
            layers.append(Layer(k_type, k_row, v_type, el, n_embd))
        else:
            v_row = _unpack("<Q", mm, at + 4)[0]
            if not 0 < v_row < 1 << 30:
                raise NotSliceable("its V data is not a plain cache's")
            at += 12
            v_at.append(at)
            at += n * v_row
            layers.append(Layer(k_type, k_row, v_type, v_row, 0))
    rest = n_stream - s - 1
    if at + 4 * rest > size:
        raise NotSliceable("it ends inside its KV state")
    if any(_u32(mm, at + 4 * i) for i in range(rest)):
        raise NotSliceable("more than one stream holds cells", whole=True)
    at += 4 * rest
    return Shape(n_stream, cell_bytes, v_trans, n_rot_k, n_rot_v, tuple(layers)), tuple(k_at), tuple(v_at), at
