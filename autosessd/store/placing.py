"""The engine's file written in place from a manifest's blocks as they arrive (issue 48): a
download of a moved conversation (shared/downloads.py) places each block as it comes, so the
file is ready when the last one is. The layout is cutting.assemble()'s."""

from __future__ import annotations

import mmap
import os
import struct
import threading
from typing import Sequence

import numpy as np

from .blocks import BadBlock, BlockRef, TailRef, payload_size
from .cutting import file_size
from .kvfile import Shape
from .slotfile import MAGIC, PAYLOAD_VERSION, TOKEN_NULL, VERSION

GROUP_BYTES = 128 << 20  # Placer writes consecutive blocks together once they hold this much


class Placer:
    """The file assemble() writes of all of a manifest's blocks and its tail, written in place
    instead, in any order, as the blocks come (a download: shared/downloads.py brings a moved
    conversation's blocks, 4 at a time, and the engine's file is ready when the last one is,
    instead of assembled after it). `fd` is a file opened for reading and writing, of the size
    the header, the tokens and every section's own header are written at first.

    Each layer's K (and V) rows of consecutive blocks are consecutive in the file: blocks that
    arrived are kept until a run of them holds GROUP_BYTES (or cannot grow: its neighbours are
    written), then each section of the run goes in one pwritev. So a download makes about 70
    calls per 128 MB, not 70 per block: each call lets go of the GIL and waits for it again
    behind the daemon's other threads, which made a write per section 8× slower there. A
    transposed V (a row per element across all cells) goes in through a map instead, a block's
    columns of a run of layers in one numpy copy, its bytes reserved first (posix_fallocate: a
    full disk says ENOSPC there, not SIGBUS under the map). place() of every block and the
    tail, then finish() writes what is left; the caller fsyncs the file. The offsets here and
    assemble()'s are the same layout (tests/store/test_placer.py checks them byte for byte)."""

    def __init__(self, fd: int, shape: Shape, tokens: bytes, refs: Sequence[BlockRef], tail: TailRef | None = None):
        n_tokens = len(tokens) // 4
        n_cells = sum(r.n_cells for r in refs)
        if n_cells > n_tokens or n_tokens - n_cells > 1:
            raise BadBlock(f"{n_cells:,} cells in blocks for {n_tokens:,} tokens")
        self.fd, self.shape, self.refs, self.tail, self.n_cells = fd, shape, list(refs), tail, n_cells
        self.size = file_size(shape, n_tokens, n_cells, tail.size if tail else 0)
        self.first: list[int] = []  # each block's first cell
        self.before_v = shape.cell_bytes + sum(x.k_row for x in shape.layers)  # a cell's bytes before its V
        at0 = 0
        for r in self.refs:
            self.first.append(at0)
            at0 += r.n_cells
        if shape.v_trans and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, self.size)
        else:  # (macOS has none: there a full disk under the map is SIGBUS)
            os.ftruncate(fd, self.size)
        at = self._put(0, struct.pack("<III3i", MAGIC, VERSION, 4 + n_tokens, TOKEN_NULL, PAYLOAD_VERSION, n_tokens)
                       + tokens + struct.pack("<iII", 0, shape.n_stream, n_cells))
        # (where in the file, bytes a cell) of each section a block's payload holds, in its order
        self.sections: list[tuple[int, int]] = [(at, shape.cell_bytes)]
        at = self._put(at + n_cells * shape.cell_bytes,
                       struct.pack("<IIII", shape.v_trans, len(shape.layers), shape.n_rot_k, shape.n_rot_v))
        for layer in shape.layers:
            at = self._put(at, struct.pack("<iQ", layer.k_type, layer.k_row))
            self.sections.append((at, layer.k_row))
            at += n_cells * layer.k_row
        self.v_runs: list[list] = []  # transposed V: runs of layers of one size (layers, (row, n_embd_v), at, stride)
        for layer in shape.layers:
            if shape.v_trans:
                at = self._put(at, struct.pack("<iII", layer.v_type, layer.v_row, layer.n_embd_v))
                stride = 12 + layer.n_embd_v * n_cells * layer.v_row
                last = self.v_runs[-1] if self.v_runs else None
                if last is not None and last[1] == (layer.v_row, layer.n_embd_v) and last[2] + last[0] * last[3] == at:
                    last[0] += 1
                else:
                    self.v_runs.append([1, (layer.v_row, layer.n_embd_v), at, stride])
                at += layer.n_embd_v * n_cells * layer.v_row
            else:
                at = self._put(at, struct.pack("<iQ", layer.v_type, layer.v_row))
                self.sections.append((at, layer.v_row))
                at += n_cells * layer.v_row
        self.tail_at = self._put(at, b"\0" * (4 * (shape.n_stream - 1)))
        if self.tail_at + (tail.size if tail else 0) != self.size:
            raise AssertionError(f"placer: {self.tail_at:,} bytes before the tail, file_size says {self.size:,}")
        self._map: mmap.mmap | None = mmap.mmap(fd, self.size) if shape.v_trans else None
        self._arr: np.ndarray | None = np.frombuffer(self._map, dtype=np.uint8) if self._map is not None else None
        self._lock = threading.Lock()
        self._tail_placed = False
        self._taken: set[int] = set()  # placed, or being placed
        self._waiting: dict[int, memoryview] = {}  # arrived, not written yet
        self._written = [False] * len(self.refs)

    def _put(self, at: int, data: bytes | memoryview) -> int:
        """pwrite all of `data` at `at` → the offset after it."""
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(self.fd, view, at)
            if n <= 0:
                raise OSError(f"pwrite wrote nothing at {at:,}")
            view, at = view[n:], at + n
        return at

    def _putv(self, at: int, parts: list[memoryview]) -> None:
        """pwritev the parts, one after the other from `at` (what a short write left, part by part)."""
        for i in range(0, len(parts), 512):  # IOV_MAX is 1024
            chunk = parts[i:i + 512]
            n = os.pwritev(self.fd, chunk, at)
            end = at + sum(len(p) for p in chunk)
            at += n
            if at < end:  # short: the rest one by one
                skip = n
                for p in chunk:
                    if skip >= len(p):
                        skip -= len(p)
                        continue
                    at = self._put(at, p[skip:])
                    skip = 0

    def place(self, i: int, payload: bytes | memoryview) -> None:
        """Block i's payload (checked against its digest by the caller)."""
        r, sh = self.refs[i], self.shape
        data = memoryview(payload).cast("B")
        if len(data) != payload_size(sh, r.n_cells):
            raise BadBlock(f"block {r.key}: {len(data):,} bytes, its payload has {payload_size(sh, r.n_cells):,}")
        with self._lock:
            if i in self._taken:
                raise BadBlock(f"block {r.key} placed twice")
            self._taken.add(i)
        if self._arr is not None:
            self._place_v(i, data)
            data = data[:r.n_cells * self.before_v]
        with self._lock:
            self._waiting[i] = data  # what is left to write: all but a transposed V
            run = self._run_of(i, final=False)
            if run is not None:
                self._write(*run)
                # Its neighbours' runs can grow no more now: written too.
                for j in (run[0] - 1, run[1]):
                    if j in self._waiting:
                        near = self._run_of(j, final=False)
                        if near is not None:
                            self._write(*near)

    def finish(self) -> None:
        """Every block placed: those still waiting written."""
        with self._lock:
            while self._waiting:
                self._write(*self._run_of(min(self._waiting), final=True))
            if not all(self._written):
                raise BadBlock(f"{self._written.count(False)} of {len(self.refs)} blocks never placed")
            if self.tail is not None and not self._tail_placed:
                raise BadBlock("the tail was never placed")

    def _run_of(self, i: int, final: bool) -> tuple[int, int] | None:
        """The run of waiting blocks around i, [a, b), if it is to be written now. Under _lock."""
        a, b = i, i + 1
        while a > 0 and a - 1 in self._waiting:
            a -= 1
        while b < len(self.refs) and b in self._waiting:
            b += 1
        whole = (a == 0 or self._written[a - 1]) and (b == len(self.refs) or self._written[b])
        big = sum(len(self._waiting[j]) for j in range(a, b)) >= GROUP_BYTES
        return (a, b) if final or whole or big else None

    def _write(self, a: int, b: int) -> None:
        """Blocks [a, b), waiting: each section of theirs in one pwritev. Under _lock."""
        run = [(self.refs[j].n_cells, self._waiting.pop(j)) for j in range(a, b)]
        offs = [0] * len(run)
        c0 = self.first[a]
        for at, per_cell in self.sections:
            parts = []
            for j, (n, data) in enumerate(run):
                parts.append(data[offs[j]:offs[j] + n * per_cell])
                offs[j] += n * per_cell
            self._putv(at + c0 * per_cell, parts)
        for j in range(a, b):
            self._written[j] = True

    def _place_v(self, i: int, data: memoryview) -> None:
        """A block's transposed V through the map: its columns of each run of layers in one copy."""
        r, c0 = self.refs[i], self.first[i]
        n = r.n_cells
        off = n * self.before_v
        src = np.frombuffer(data, dtype=np.uint8)
        arr = self._arr
        assert arr is not None
        for count, (v_row, n_embd_v), at, stride in self.v_runs:
            w = n * v_row
            shape, strides = (count, n_embd_v, w), (stride, self.n_cells * v_row, 1)
            start = at + c0 * v_row
            end = start + (count - 1) * stride + (n_embd_v - 1) * self.n_cells * v_row + w
            if end > self.size:  # as_strided checks no bounds
                raise AssertionError(f"placer: a transposed V section ends at {end:,} of {self.size:,}")
            np.lib.stride_tricks.as_strided(arr[start:], shape=shape, strides=strides)[...] = \
                src[off:off + count * n_embd_v * w].reshape(shape)
            off += count * n_embd_v * w

    def place_tail(self, data: bytes | memoryview) -> None:
        """The tail's bytes (checked against its digest by the caller) at the file's end."""
        if self.tail is None or len(data) != self.tail.size:
            raise BadBlock(f"a tail of {len(data):,} bytes for a file whose tail has "
                           f"{self.tail.size if self.tail else 0:,}")
        with self._lock:
            if self._tail_placed:
                raise BadBlock("the tail placed twice")
            self._tail_placed = True
        self._put(self.tail_at, data)

    def close(self) -> None:
        """The map let go (its pages are the file's: the caller fsyncs fd, then closes it)."""
        self._arr = None
        if self._map is not None:
            self._map.close()
            self._map = None
