"""The engine's file written in place from a manifest's blocks as they arrive (issue 48): a
download of a moved conversation (shared/downloads.py) places each block as it comes, so the
file is ready when the last one is. The layout is cutting.assemble()'s."""

from __future__ import annotations

import mmap
import os
import queue
import struct
import threading
from typing import Sequence

import numpy as np

from .blocks import BadBlock, BlockRef, TailRef, payload_size
from .cutting import file_size
from .kvfile import Shape
from .slotfile import MAGIC, PAYLOAD_VERSION, TOKEN_NULL, VERSION

QUEUED = 64  # pieces waiting for the Placer's writer, and taken in one batch (each 64 MB of megabyte reads)
IOV_MAX = 1024  # buffers one pwritev takes (Linux's UIO_MAXIOV)


def runs(pieces: list[tuple[int, memoryview]]) -> list[tuple[int, list[memoryview]]]:
    """Pieces (where in the file, bytes) as runs to write, each its pieces end to end: the
    pieces of a section that blocks fetched side by side bring arrive together, and one write
    of a megabyte costs the kernel less than four of a quarter. Pieces that overlap (a block
    written again over a damaged copy) keep their order: the later one is written last."""
    pieces = [p for p in pieces if len(p[1])]
    order = sorted(pieces, key=lambda p: p[0])
    if any(b[0] < a[0] + len(a[1]) for a, b in zip(order, order[1:])):
        return [(at, [data]) for at, data in pieces]
    out: list[tuple[int, list[memoryview]]] = []
    end = -1
    for at, data in order:
        if at == end and len(out[-1][1]) < IOV_MAX:
            out[-1][1].append(data)
        else:
            out.append((at, [data]))
        end = at + len(data)
    return out


class Placer:
    """The file assemble() writes of all of a manifest's blocks and its tail, written in place
    instead, in any order, as the blocks come (a download: shared/downloads.py streams a moved
    conversation's blocks, 4 at a time, and the engine's file is ready when the last one is,
    instead of assembled after it). `fd` is a file opened for reading and writing, of the size
    the header, the tokens and every section's own header are written at first.

    A block's payload is its cells' meta, then each layer's K, then each layer's V; each of
    these goes to its own section of the file, where consecutive blocks' rows are consecutive.
    write() takes any piece of a block's payload as it arrives from the network (a megabyte at
    a time) and queues it, cut by section, for the Placer's one writer thread: the bytes go from
    a piece to the page cache, as a whole file's download writes them, not through a block-sized
    buffer of fresh memory held until a run formed (that cost the download twice its CPU time),
    and the threads that fetch wait for the disk only when QUEUED pieces are waiting, never for
    one another on the file's inode lock (four writers of one file spent a core spinning on it).
    A transposed V (a row per element across all cells) is kept until the block is done(),
    then goes in through a map, a block's columns of a run of layers in one numpy copy, its
    bytes reserved first (posix_fallocate: a full disk says ENOSPC there, not SIGBUS under the
    map). write() and done() of every block, write_tail() and tail_done() (or place() and
    place_tail(), each whole), then finish(); the caller fsyncs the file. The offsets here and
    assemble()'s are the same layout (tests/store/test_placer.py checks them byte for byte)."""

    def __init__(self, fd: int, shape: Shape, tokens: bytes, refs: Sequence[BlockRef], tail: TailRef | None = None):
        n_tokens = len(tokens) // 4
        n_cells = sum(r.n_cells for r in refs)
        if n_cells > n_tokens or n_tokens - n_cells > 1:
            raise BadBlock(f"{n_cells:,} cells in blocks for {n_tokens:,} tokens")
        self.fd, self.shape, self.refs, self.tail, self.n_cells = fd, shape, list(refs), tail, n_cells
        self.size = file_size(shape, n_tokens, n_cells, tail.size if tail else 0)
        self.first: list[int] = []  # each block's first cell
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
        self._done = [False] * len(self.refs)
        self._v: dict[int, bytearray] = {}  # transposed V of blocks being written, until done()
        self._direct = sum(per_cell for _, per_cell in self.sections)  # a cell's bytes written by write()
        # One thread writes: several writing one file wait for its inode's lock, spinning on it.
        self._queue: queue.Queue[list[tuple[int, memoryview]] | None] = queue.Queue(QUEUED)
        self._error: OSError | None = None
        self._cancelled = False  # close() before finish(): what is queued is not written
        self._writer: threading.Thread | None = threading.Thread(target=self._drain, name="autosessd-placer",
                                                                 daemon=True)
        self._writer.start()

    def _put(self, at: int, data: bytes | memoryview) -> int:
        """pwrite all of `data` at `at` → the offset after it."""
        return self._putv(at, [memoryview(data).cast("B")])

    def _drain(self) -> None:
        """The writer: queued pieces written (after an error or close(), dropped: write() and
        finish() raise the error) until the None close() or finish() queues. All that waits is
        taken at once, and what lies end to end in the file goes in one write (runs())."""
        while True:
            batch = [self._queue.get()]
            while batch[-1] is not None and len(batch) < QUEUED:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if self._error is None:
                try:
                    for at, views in runs([p for item in batch if item is not None for p in item]):
                        if self._cancelled:
                            break
                        self._putv(at, views)
                except OSError as e:
                    self._error = e
                except BaseException as e:  # never a dead writer that write() and close() wait for
                    self._error = OSError(f"placing a block's bytes: {e!r}")
            if batch[-1] is None:
                return

    def _putv(self, at: int, views: list[memoryview]) -> int:
        """Write all of `views`, end to end from `at` (pwritev; one pwrite a view where there is
        none), partial writes continued → the offset after them."""
        views = [v for v in views if len(v)]
        while views:
            n = os.pwritev(self.fd, views, at) if hasattr(os, "pwritev") else os.pwrite(self.fd, views[0], at)
            if n <= 0:
                raise OSError(f"pwrite wrote nothing at {at:,}")
            at += n
            while views and n >= len(views[0]):
                n -= len(views[0])
                views = views[1:]
            if n:
                views = [views[0][n:], *views[1:]]
        return at

    def _stop(self) -> None:
        """The writer ended, everything queued written (or dropped after an error)."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None

    def _writable(self, what: str) -> None:
        """Before a write: the writer's error raised (OSError), a write after finish() refused."""
        if self._error is not None:
            raise self._error
        if self._writer is None:
            raise BadBlock(f"{what} written after finish()")

    def write(self, i: int, at: int, data: bytes | memoryview) -> None:
        """Bytes [at, at + len(data)) of block i's payload, queued for the writer (OSError: an
        earlier piece's write failed), which reads `data` later: the caller does not change it.
        A piece written again (a block read again from elsewhere) replaces what was there; the
        caller checks the block's digest, then says done(i)."""
        r = self.refs[i]
        data = memoryview(data).cast("B")
        end, size = at + len(data), payload_size(self.shape, r.n_cells)
        if at < 0 or end > size:
            raise BadBlock(f"block {r.key}: bytes {at:,} to {end:,} of a payload of {size:,}")
        if self._done[i]:
            raise BadBlock(f"block {r.key} placed twice")
        self._writable(f"block {r.key}")
        n, c0 = r.n_cells, self.first[i]
        pos = 0  # where the section starts in the payload
        piece = []
        for file_at, per_cell in self.sections:
            length = n * per_cell
            lo, hi = max(at, pos), min(end, pos + length)
            if lo < hi:
                piece.append((file_at + c0 * per_cell + lo - pos, data[lo - at:hi - at]))
            pos += length
            if pos >= end:
                break
        if piece:
            self._queue.put(piece)
        if pos >= end:
            return
        # What is left is a transposed V (the sections hold all of a payload otherwise).
        with self._lock:
            v = self._v.get(i)
            if v is None:
                v = self._v[i] = bytearray(size - pos)
        lo = max(at, pos)
        v[lo - pos:end - pos] = data[lo - at:]

    def done(self, i: int) -> None:
        """Block i all written (and its digest checked by the caller): its transposed V placed."""
        r = self.refs[i]
        with self._lock:
            if self._done[i]:
                raise BadBlock(f"block {r.key} placed twice")
            self._done[i] = True
            v = self._v.pop(i, None)
        if self._arr is not None and payload_size(self.shape, r.n_cells) > r.n_cells * self._direct:
            if v is None:
                raise BadBlock(f"block {r.key}: its V was never written")
            self._place_v(i, memoryview(v))

    def place(self, i: int, payload: bytes | memoryview) -> None:
        """Block i's whole payload (checked against its digest by the caller): write() and done()."""
        r = self.refs[i]
        if len(payload) != payload_size(self.shape, r.n_cells):
            raise BadBlock(f"block {r.key}: {len(payload):,} bytes, its payload has "
                           f"{payload_size(self.shape, r.n_cells):,}")
        self.write(i, 0, payload)
        self.done(i)

    def finish(self) -> None:
        """Every block and the tail placed (BadBlock otherwise), then written (the writer
        ended; OSError when a write failed)."""
        with self._lock:
            if not all(self._done):
                raise BadBlock(f"{self._done.count(False)} of {len(self.refs)} blocks never placed")
            if self.tail is not None and not self._tail_placed:
                raise BadBlock("the tail was never placed")
        self._stop()
        if self._error is not None:
            raise self._error

    def _place_v(self, i: int, v: memoryview) -> None:
        """A block's transposed V through the map: its columns of each run of layers in one copy."""
        r, c0 = self.refs[i], self.first[i]
        n = r.n_cells
        off = 0
        src = np.frombuffer(v, dtype=np.uint8)
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

    def write_tail(self, at: int, data: bytes | memoryview) -> None:
        """Bytes [at, at + len(data)) of the tail, in place (as write() for a block)."""
        end, size = at + len(data), self.tail.size if self.tail else 0
        if at < 0 or end > size:
            raise BadBlock(f"bytes {at:,} to {end:,} of a tail of {size:,}")
        if self._tail_placed:
            raise BadBlock("the tail placed twice")
        self._writable("the tail")
        self._queue.put([(self.tail_at + at, memoryview(data).cast("B"))])

    def tail_done(self) -> None:
        """The tail all written (and its digest checked by the caller)."""
        with self._lock:
            if self.tail is None or self._tail_placed:
                raise BadBlock("the tail placed twice" if self.tail else "a tail for a file that has none")
            self._tail_placed = True

    def place_tail(self, data: bytes | memoryview) -> None:
        """The tail's bytes (checked against its digest by the caller): write_tail() and tail_done()."""
        if self.tail is None or len(data) != self.tail.size:
            raise BadBlock(f"a tail of {len(data):,} bytes for a file whose tail has "
                           f"{self.tail.size if self.tail else 0:,}")
        self.write_tail(0, data)
        self.tail_done()

    def close(self) -> None:
        """The writer ended and the map let go (its pages are the file's: the caller fsyncs
        fd, then closes it). Before finish() (a download that failed), what is still queued is
        not written."""
        self._cancelled = self._writer is not None
        self._stop()
        self._arr = None
        if self._map is not None:
            self._map.close()
            self._map = None
