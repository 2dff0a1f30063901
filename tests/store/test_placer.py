"""The engine's file written in place as a download brings its blocks (placing.Placer, issue 48):
blocks placed in any order, from several threads at once, give byte for byte the file
assemble() writes from the same blocks — V transposed or not, cells with the M-RoPE
extension, another stream's slot, a last block shorter than the others, a window model's or a
hybrid's tail, a file with one token more than cells. A block of the wrong size is refused."""

import contextlib
import io
import os
import random
import sys
import threading

import pytest

from autosessd.store import blocks as B
from autosessd.store import placing
from autosessd.store.blocks import BadBlock, BlockStore
from autosessd.store.cutting import assemble, split
from autosessd.store.placing import Placer
from autosessd.store.kvfile import parse
from autosessd.store.slotfile import encode
from kv_common import slot_file, two_part_file

MODEL = "test-model"


def payload(store, key):
    return store.path(key).read_bytes()[B.HEADER.size:]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(B, "BLOCK_TOKENS", 8)


def cut(tmp_path, data):
    """Slot file `data` cut into a block store: → (its KV, the store, its blocks, its tail)."""
    src = tmp_path / "a.bin"
    src.write_bytes(data)
    kv = parse(src)
    store = BlockStore(tmp_path / "home")
    refs, tail, _ = split(store, kv, src, MODEL)
    return kv, store, refs, tail


@contextlib.contextmanager
def placer(out, kv, refs, tail=None):
    """A Placer writing the new file `out`, closed (and its descriptor) after."""
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    p = None
    try:
        p = Placer(fd, kv.shape, encode(kv.tokens), refs, tail)
        yield p
    finally:
        try:
            if p is not None:
                p.close()
        finally:
            os.close(fd)


def placed(tmp_path, store, kv, refs, tail=None, seed=0, threads=1):
    """The file a Placer writes from `refs` (and `tail`) placed in a shuffled order (whole or
    in pieces of PIECE bytes)."""
    out = tmp_path / f"placed-{seed}-{threads}.bin"
    with placer(out, kv, refs, tail) as p:
        jobs = list(range(len(refs))) + ([-1] if tail else [])
        random.Random(seed).shuffle(jobs)

        def one(i):
            if i < 0:
                p.place_tail(payload(store, tail.key))
            elif PIECE is None:
                p.place(i, payload(store, refs[i].key))
            else:
                data = payload(store, refs[i].key)
                for at in range(0, len(data), PIECE):
                    p.write(i, at, data[at:at + PIECE])
                p.done(i)

        if threads == 1:
            for i in jobs:
                one(i)
        else:
            ts = [threading.Thread(target=lambda part=jobs[k::threads]: [one(i) for i in part])
                  for k in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        p.finish()
    return out.read_bytes()


def assembled(store, kv, refs, tail=None):
    buf = io.BytesIO()
    assemble(store, kv.shape, encode(kv.tokens), refs, sum(r.n_cells for r in refs), buf, tail)
    return buf.getvalue()


PIECE: int | None = None  # placed() writes each block whole (None) or in pieces of this many bytes


@pytest.fixture(params=[None, 7, 4096], ids=["whole", "small-pieces", "pieces"])
def pieces(request, monkeypatch):
    """Blocks placed whole, or written as a download streams them: pieces of a few bytes that
    cross sections and rows anywhere, or of a few KB."""
    monkeypatch.setattr(sys.modules[__name__], "PIECE", request.param)


@pytest.mark.parametrize("v_trans", [0, 1])
@pytest.mark.parametrize("cell_ext", [False, True])
@pytest.mark.parametrize("n_stream, stream", [(1, 0), (4, 2)])
def test_blocks_placed_in_any_order_give_the_file_assemble_writes(tmp_path, pieces, v_trans, cell_ext, n_stream,
                                                                    stream):
    n = 45
    tokens = [1000 + i for i in range(n)]
    order = list(range(30, n)) + list(range(30))  # cells in cache order: split gathers them by position
    kv, store, refs, _ = cut(tmp_path, slot_file(tokens, v_trans=v_trans, cell_ext=cell_ext, order=order,
                                                 n_stream=n_stream, stream=stream))
    assert [r.n_cells for r in refs] == [8] * 5 + [5]
    want = assembled(store, kv, refs)
    for seed, threads in ((1, 1), (2, 1), (3, 4)):
        assert placed(tmp_path, store, kv, refs, seed=seed, threads=threads) == want


@pytest.mark.parametrize("v_trans", [0, 1])
def test_layers_of_other_row_sizes_are_placed_each_at_its_own_offsets(tmp_path, pieces, v_trans):
    """Runs of layers whose rows are of one size go in one copy each: rows that change from
    layer to layer (and back) start a new run."""
    data = slot_file(list(range(700, 737)), n_layer=6, k_row=[16, 16, 32, 8, 8, 16], v_row=[16, 8, 8, 24, 24, 24],
                     n_embd_v=[8, 8, 4, 4, 6, 8], v_trans=v_trans)
    kv, store, refs, _ = cut(tmp_path, data)
    assert placed(tmp_path, store, kv, refs, seed=11, threads=2) == assembled(store, kv, refs) == data


@pytest.mark.parametrize("kind", ["window", "recurrent"])
def test_a_file_with_a_tail_is_placed_byte_for_byte_as_the_engine_wrote_it(tmp_path, pieces, kind):
    data, _ = two_part_file(list(range(300, 345)), kind)
    kv, store, refs, tail = cut(tmp_path, data)
    assert placed(tmp_path, store, kv, refs, tail, seed=5, threads=3) == data == assembled(store, kv, refs, tail)


def test_a_file_with_one_token_more_than_cells(tmp_path):
    """The engine's file after a request whose last token it did not decode: n tokens, n−1 cells."""
    data = slot_file(list(range(500, 521)), n_cells=20)
    kv, store, refs, _ = cut(tmp_path, data)
    assert kv.n_cells == 20 and len(kv.tokens) == 21
    assert placed(tmp_path, store, kv, refs, seed=7) == assembled(store, kv, refs) == data


def test_a_block_of_the_wrong_size_is_refused(tmp_path):
    kv, store, refs, _ = cut(tmp_path, slot_file(list(range(20))))
    with placer(tmp_path / "out.bin", kv, refs) as p:
        with pytest.raises(BadBlock, match="bytes, its payload has"):
            p.place(0, payload(store, refs[0].key)[:-1])
        with pytest.raises(BadBlock, match="a tail of"):
            p.place_tail(b"x")
        p.place(0, payload(store, refs[0].key))
        with pytest.raises(BadBlock, match="placed twice"):
            p.place(0, payload(store, refs[0].key))
        with pytest.raises(BadBlock, match="placed twice"):
            p.write(0, 0, b"x")
        size = len(payload(store, refs[1].key))
        with pytest.raises(BadBlock, match=f"bytes {size - 1:,} to {size + 1:,} of a payload of {size:,}"):
            p.write(1, size - 1, b"xx")
        with pytest.raises(BadBlock, match="never placed"):
            p.finish()


def test_a_tail_placed_twice_or_never_is_refused(tmp_path):
    data, _ = two_part_file(list(range(20)), "window")
    kv, store, refs, tail = cut(tmp_path, data)
    with placer(tmp_path / "out.bin", kv, refs, tail) as p:
        for i, r in enumerate(refs):
            p.place(i, payload(store, r.key))
        with pytest.raises(BadBlock, match="tail was never placed"):
            p.finish()
        p.place_tail(payload(store, tail.key))
        with pytest.raises(BadBlock, match="tail placed twice"):
            p.place_tail(payload(store, tail.key))
        p.finish()


@pytest.mark.parametrize("v_trans", [0, 1])
def test_a_block_written_again_from_elsewhere_replaces_what_was_there(tmp_path, v_trans):
    """A download reads a block this host holds, finds it damaged halfway, and fetches it from
    the bucket instead: the second writing of every piece is what the file holds."""
    data = slot_file(list(range(40, 64)), v_trans=v_trans)
    kv, store, refs, _ = cut(tmp_path, data)
    with placer(tmp_path / "out.bin", kv, refs) as p:
        for i, r in enumerate(refs):
            pay = payload(store, r.key)
            p.write(i, 0, bytes(len(pay) * 2 // 3))  # a damaged held copy, given up on
            for at in range(0, len(pay), 5):
                p.write(i, at, pay[at:at + 5])
            p.done(i)
        p.finish()
    assert (tmp_path / "out.bin").read_bytes() == assembled(store, kv, refs) == data


def test_a_transposed_v_never_written_is_refused(tmp_path):
    kv, store, refs, _ = cut(tmp_path, slot_file(list(range(16)), v_trans=1))
    with placer(tmp_path / "out.bin", kv, refs) as p:
        p.write(0, 0, payload(store, refs[0].key)[:kv.shape.cell_bytes * 8])  # the cells only
        with pytest.raises(BadBlock, match="its V was never written"):
            p.done(0)


def test_a_write_that_fails_in_the_writer_is_raised_to_the_download(tmp_path, monkeypatch):
    """A full disk under the Placer's writer thread: the download hears of it (and stops)."""
    import errno

    kv, store, refs, _ = cut(tmp_path, slot_file(list(range(32))))

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    with placer(tmp_path / "out.bin", kv, refs) as p:
        monkeypatch.setattr(placing.os, "pwrite", full)
        monkeypatch.setattr(placing.os, "pwritev", full)
        with pytest.raises(OSError, match="No space left"):  # by a later place(), or at the latest by finish()
            for i, r in enumerate(refs):
                p.place(i, payload(store, r.key))
            p.finish()


def test_pieces_end_to_end_go_in_one_write_and_overlapping_ones_in_their_order():
    """What the writer found waiting goes as runs: pieces that lie end to end in the file in one
    pwritev (a section's pieces from blocks fetched side by side), any overlap (a block written
    again over a damaged copy) in the order the pieces came, the later one last."""
    v = lambda b: memoryview(b)  # noqa: E731
    got = placing.runs([(10, v(b"cc")), (0, v(b"aaaaa")), (20, v(b"x")), (5, v(b"bbbbb"))])
    assert [(at, [bytes(d) for d in views]) for at, views in got] == [(0, [b"aaaaa", b"bbbbb", b"cc"]), (20, [b"x"])]
    again = [(2, v(b"XY")), (0, v(b"abcd"))]  # in file order, "abXY" would be written: it is "abcd"
    assert [(at, [bytes(d) for d in views]) for at, views in placing.runs(again)] == [(2, [b"XY"]), (0, [b"abcd"])]
    assert placing.runs([(0, v(b"")), (4, v(b""))]) == []  # nothing to write (pwritev would write 0 bytes)


def test_the_writer_takes_at_most_queued_pieces_at_once(tmp_path, monkeypatch):
    """What waits for the writer is taken in batches of at most QUEUED pieces, however fast the
    fetching threads refill its queue: the memory a download holds stays bounded."""
    kv, store, refs, _ = cut(tmp_path, slot_file(list(range(16))))
    seen = []
    real_runs = placing.runs
    monkeypatch.setattr(placing, "runs", lambda pieces: seen.append(len(pieces)) or real_runs(pieces))

    class Endless:  # a queue the fetching threads keep full: 10 × QUEUED pieces, then the end
        def __init__(self):
            self.n = 0

        def get(self, *a, **k):
            self.n += 1
            return None if self.n > 10 * placing.QUEUED else [(0, memoryview(b"x"))]

        get_nowait = get

        def put(self, item, *a, **k):
            pass

    with placer(tmp_path / "out.bin", kv, refs) as p:
        p._stop()  # the real writer ended; one reading the endless queue in its place
        p._queue = Endless()
        p._drain()
    assert sum(seen) == 10 * placing.QUEUED and max(seen) <= placing.QUEUED


@pytest.mark.parametrize("v_trans", [0, 1])
@pytest.mark.parametrize("damaged", [False, True], ids=["plain", "written-again"])
def test_pieces_waiting_together_are_written_as_runs_and_the_file_is_the_same(tmp_path, monkeypatch, v_trans,
                                                                              damaged):
    """The writer held while the pieces are queued (a slow disk): it then finds them waiting and
    writes those end to end in single calls, partial writes and all (each pwritev here writes at
    most 5 bytes). A block written again over a damaged copy (in pieces that straddle the good
    ones) still ends as its second writing."""
    data = slot_file(list(range(40, 64)), v_trans=v_trans)
    kv, store, refs, _ = cut(tmp_path, data)
    monkeypatch.setattr(placing, "QUEUED", 1 << 20)
    go, calls, real = threading.Event(), [], os.pwritev

    def short(fd, views, at):
        if threading.current_thread().name == "autosessd-placer":  # the writer, not the header's writes
            go.wait()
            calls.append(len(views))
        return real(fd, [bytes(views[0][:5])], at)

    monkeypatch.setattr(placing.os, "pwritev", short)
    with placer(tmp_path / "out.bin", kv, refs) as p:
        for i, r in enumerate(refs):
            pay = payload(store, r.key)
            if damaged and i == 1:  # a damaged held copy, given up on
                for at in (0, *range(50, len(pay), 100)):
                    p.write(i, at, bytes(len(pay[at:at + (50 if at == 0 else 100)])))
            for at in range(0, len(pay), 64):
                p.write(i, at, pay[at:at + 64])
            p.done(i)
        go.set()
        p.finish()
    assert (tmp_path / "out.bin").read_bytes() == data
    if not damaged:
        assert max(calls) > 1  # pieces end to end went in one call
