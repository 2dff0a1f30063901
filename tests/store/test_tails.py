"""Two-part saves (issue 47): a sliding-window model's file (its full-attention cache, then the
window's last cells) and a hybrid model's (its attention cache, then its recurrent state), in
the engine's layout (kv_common.py). The first part is cut into blocks like a plain model's; the
rest, the tail, is kept once per save; the file comes back whole, byte for byte, and only whole
(a tail is the state at its last position); a damaged tail is never assembled."""

import io
import os
import struct

import pytest

from autosessd.base.files import digest_file
from autosessd.store import blocks as B
from autosessd.store.blocks import BadBlock, BlockStore, TailRef
from autosessd.store.cutting import assemble, file_size, split
from autosessd.store.directory import Store
from autosessd.store.kvfile import RECURRENT, WINDOW, NotSliceable, Shape, parse
from autosessd.store.names import QUARANTINE, TEMP_PREFIX, Meta
from autosessd.store.slotfile import encode
from autosessd.store.staging import Refused
from kv_common import recurrent_tail, slot_file, two_part_file, window_tail

MODEL = "test-model"
KINDS = [("window", WINDOW), ("recurrent", RECURRENT)]


def write(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data)
    return p


@pytest.mark.parametrize("kind, want", KINDS)
@pytest.mark.parametrize("n_stream, stream", [(1, 0), (4, 2)])
def test_a_two_part_file_is_cut_and_comes_back_byte_for_byte(tmp_path, monkeypatch, kind, want, n_stream, stream):
    monkeypatch.setattr(B, "BLOCK_TOKENS", 8)
    tokens = list(range(300, 345))
    data, tail = two_part_file(tokens, kind, n_stream=n_stream, stream=stream)
    p = write(tmp_path, "a.bin", data)
    kv = parse(p)
    assert kv.shape.tail == want and kv.tail_bytes == len(tail) and kv.n_cells == 45
    store = BlockStore(tmp_path / "home")
    refs, t, written = split(store, kv, p, MODEL)
    store.unpin([t.key])
    assert [r.n_cells for r in refs] == [8] * 5 + [5] and t.size == len(tail)
    assert written == sum(B.HEADER.size + B.payload_size(kv.shape, r.n_cells) for r in refs) + B.HEADER.size + len(tail)
    buf = io.BytesIO()
    digest = assemble(store, kv.shape, encode(tokens), refs, 45, buf, t)
    if n_stream == 1:  # cells in position order, in stream 0: the engine's own bytes
        assert buf.getvalue() == data
    assert buf.getvalue().endswith(tail) and len(buf.getvalue()) == file_size(kv.shape, 45, 45, len(tail))
    out = write(tmp_path, "out.bin", buf.getvalue())
    assert digest_file(out)[0] == digest and parse(out).shape == kv.shape


@pytest.mark.parametrize("kind, _", KINDS)
def test_a_file_with_a_tail_is_never_assembled_short(tmp_path, kind, _):
    """The tail is the state at the file's last position: its first m tokens have none."""
    tokens = list(range(60))
    p = write(tmp_path, "a.bin", two_part_file(tokens, kind)[0])
    kv = parse(p)
    store = BlockStore(tmp_path / "home")
    refs, t, _ = split(store, kv, p, MODEL)
    with pytest.raises(BadBlock, match="its last position only"):
        assemble(store, kv.shape, encode(tokens[:30]), refs, 30, io.BytesIO(), t)


def test_blocks_of_a_window_model_are_never_a_plain_models(tmp_path):
    """The same tokens of a plain file and of a two-part file: the blocks' keys differ (the shape's
    fingerprint says what follows the cache), so neither is ever assembled for the other."""
    tokens = list(range(40))
    plain = parse(write(tmp_path, "p.bin", slot_file(tokens)))
    two = parse(write(tmp_path, "w.bin", two_part_file(tokens, "window")[0]))
    assert B.chain(MODEL, plain.shape, encode(tokens), 40) != B.chain(MODEL, two.shape, encode(tokens), 40)


@pytest.mark.parametrize("rest, why", [
    (b"\0" * 40, "neither a window"),  # not a cache, not a recurrent state
    (None, "neither a window"),  # a recurrent state of another position
    ("window-short", "neither a window"),  # a window cache cut short
])
def test_a_rest_that_is_not_a_tail_keeps_the_file_whole(tmp_path, rest, why):
    tokens = list(range(30))
    if rest is None:
        rest = struct.pack("<IiIII", 1, 12, 0, 0, 3) + b"\0" * 64
    elif rest == "window-short":
        rest = window_tail(tokens, 6)[:-5]
    with pytest.raises(NotSliceable, match=why) as e:
        parse(write(tmp_path, "a.bin", slot_file(tokens) + rest))
    assert e.value.whole


def test_a_window_whose_cells_are_not_the_files_last_is_not_a_tail(tmp_path):
    tokens = list(range(30))
    with pytest.raises(NotSliceable):
        parse(write(tmp_path, "a.bin", slot_file(tokens) + window_tail(tokens[:20], 6)))
    assert parse(write(tmp_path, "b.bin", slot_file(tokens) + recurrent_tail(tokens))).shape.tail == RECURRENT


def test_a_second_cache_of_every_cell_is_not_a_tail(tmp_path):
    """A cache holding every cell of the first (an indexer's mirror, read into the first's very
    cells; a window conversation no longer than its window): cutting would reorder the first's
    cells under it, so the file stays whole."""
    tokens = list(range(30))
    with pytest.raises(NotSliceable, match="neither a window") as e:
        parse(write(tmp_path, "a.bin", slot_file(tokens, order=list(range(10, 30)) + list(range(10)))
                    + window_tail(tokens, 30)))
    assert e.value.whole


@pytest.mark.parametrize("stray", [1, 2, 3, 5])
def test_a_few_stray_bytes_after_the_cache_keep_the_file_whole(tmp_path, stray):
    with pytest.raises(NotSliceable):
        parse(write(tmp_path, "a.bin", slot_file(list(range(30))) + b"\1" * stray))


# -- in the store --------------------------------------------------------------------------------
def save(store, key, data, n_tokens):
    temp = store.temp_path(key)
    temp.write_bytes(data)
    store.verify_temp(key, len(data))
    return store.finalize(key, Meta(key=key, n_tokens=n_tokens, bytes=len(data), saved_at=1.0, model=MODEL,
                                    save_ms=1.0))


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "BLOCK_TOKENS", 16)
    (tmp_path / "staging").mkdir()
    return Store(tmp_path / "home", staging=tmp_path / "staging", hot_budget=0)


@pytest.mark.parametrize("kind, _", KINDS)
def test_a_save_is_kept_as_blocks_and_a_tail_and_restored_whole(store, kind, _):
    tokens = list(range(1000, 1100))
    data, tail = two_part_file(tokens, kind)
    meta = save(store, "00000000000000a1", data, 100)
    assert meta.in_blocks and meta.tail is not None and meta.tail[1] == len(tail) and meta.n_cells == 100
    assert store.blocks.naming("00000000000000a1") == meta.block_keys
    staged = store.stage("auto-00000000000000a1.bin", 40)  # a request sharing 40: the whole file all the same
    got = (store.hot.dir / staged.name).read_bytes()
    assert got == data and staged.n_tokens in (None, 100)
    store.unstage(staged)


def test_a_longer_save_writes_its_new_blocks_and_one_tail_and_the_old_tail_goes(store):
    """A conversation saved again 20 tokens longer: its new blocks (and its last partial one
    again) and a tail; the old tail, named by no manifest now, is swept."""
    tokens = list(range(2000, 2100))
    first = save(store, "00000000000000b2", two_part_file(tokens, "recurrent")[0], 100)
    before = store.blocks.bytes_written
    data, tail = two_part_file(tokens + list(range(5000, 5020)), "recurrent")
    second = save(store, "00000000000000b2", data, 120)
    written = store.blocks.bytes_written - before
    shape_cell = Shape.from_json(second.kv).cell_size()
    # blocks 96…119 (the old last block of 4 cells again, and 16 + 4 new) and the tail
    assert written == 2 * B.HEADER.size + 24 * shape_cell + B.HEADER.size + len(tail)
    store.blocks.sweep_dropped()
    assert not store.blocks.path(first.tail[0]).exists() and store.blocks.path(second.tail[0]).exists()


def test_a_damaged_tail_is_never_assembled_and_its_manifest_goes(store):
    tokens = list(range(3000, 3070))
    meta = save(store, "00000000000000c3", two_part_file(tokens, "window")[0], 70)
    store.hot.forget("auto-00000000000000c3.bin")
    p = store.blocks.path(meta.tail[0])
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(Refused, match="bytes changed"):
        store.stage("auto-00000000000000c3.bin")
    assert store.read_meta("00000000000000c3") is None  # nothing of it is restorable without its tail
    assert not p.exists() and list((store.path / QUARANTINE).glob(f"block-{meta.tail[0]}*"))
    assert not [n for n in os.listdir(store.hot.dir) if n.startswith(TEMP_PREFIX)]


def test_a_manifests_tail_survives_every_sweep_while_named(store):
    tokens = list(range(4000, 4050))
    meta = save(store, "00000000000000d4", two_part_file(tokens, "window")[0], 50)
    store.blocks.sweep()
    assert store.blocks.path(meta.tail[0]).exists()
    TailRef(*meta.tail)  # the manifest's tail reads back as one


def test_a_window_models_file_an_earlier_version_kept_whole_is_cut_now(store):
    """An upgrade: a file an earlier autosessd kept whole for its second cache is kept as blocks
    and a tail by the start's pass (import_whole); one whole for another reason stays whole."""
    from autosessd.store.kvfile import WHOLE_BEFORE_TAILS

    tokens = list(range(6000, 6090))
    data = two_part_file(tokens, "window")[0]
    store.path.mkdir(mode=0o700, exist_ok=True)
    for key, why in (("00000000000000e5", WHOLE_BEFORE_TAILS), ("00000000000000e6", "its payload holds media")):
        store.bin_path(key).write_bytes(data)
        store._write_meta(Meta(key=key, n_tokens=90, bytes=len(data), saved_at=1.0, model=MODEL, save_ms=1.0,
                               digest=digest_file(store.bin_path(key))[0], whole=why))
    assert "kept as" in store.import_whole("00000000000000e5")
    meta = store.read_meta("00000000000000e5")
    assert meta.in_blocks and meta.tail is not None and not store.bin_path("00000000000000e5").exists()
    assert store.import_whole("00000000000000e6") is None and not store.read_meta("00000000000000e6").in_blocks
    staged = store.stage("auto-00000000000000e5.bin")
    assert (store.hot.dir / staged.name).read_bytes() == data


def test_a_manifest_whose_tail_is_missing_goes_at_the_start(store, tmp_path):
    """A tail lost while autosessd was down (a person, a disk): the next start removes the
    manifest (nothing of it is restorable without its tail), not only the first restore."""
    tokens = list(range(7000, 7060))
    meta = save(store, "00000000000000f7", two_part_file(tokens, "recurrent")[0], 60)
    store.blocks.path(meta.tail[0]).unlink()
    again = Store(store.path, staging=store.staging, hot_budget=0)
    removed = again.cleanup()
    assert again.read_meta("00000000000000f7") is None and removed
