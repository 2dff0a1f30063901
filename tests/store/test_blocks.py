"""The block store (issue 39) on slot files written here in the engine's layout (kv_common.py):
what can be cut and why not, cutting by position whatever the cache order, a file assembled from
blocks cell for cell the same as the engine's, the first m tokens of it, blocks of shared tokens
stored once, and a damaged block never assembled."""

import io
import random

import numpy as np
import pytest

from autosessd.store import blocks as B
from autosessd.store.blocks import BadBlock, BlockStore, chain
from autosessd.store.cutting import assemble, file_size, split
from autosessd.store.kvfile import NotSliceable, parse
from autosessd.store.slotfile import encode
from kv_common import slot_file

MODEL = "test-model"


def write(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def cells_by_position(path):
    """Per position: (its meta without the seq id, its K bytes per layer, its V bytes per layer):
    what a file holds, whatever its cell order."""
    kv = parse(path)
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    sh, n = kv.shape, kv.n_cells
    out = []
    for p in range(n):
        i = int(kv.order[p])
        meta = bytes(data[kv.cells_at + i * sh.cell_bytes: kv.cells_at + (i + 1) * sh.cell_bytes - 4])
        ks = [bytes(data[at + i * x.k_row: at + (i + 1) * x.k_row]) for x, at in zip(sh.layers, kv.k_at)]
        if sh.v_trans:
            vs = [b"".join(bytes(data[at + (j * n + i) * x.v_row: at + (j * n + i + 1) * x.v_row])
                           for j in range(x.n_embd_v)) for x, at in zip(sh.layers, kv.v_at)]
        else:
            vs = [bytes(data[at + i * x.v_row: at + (i + 1) * x.v_row]) for x, at in zip(sh.layers, kv.v_at)]
        out.append((meta, ks, vs))
    return kv.tokens, out


def assembled(store, kv, refs, m, tmp_path, name="out.bin"):
    buf = io.BytesIO()
    digest = assemble(store, kv.shape, encode(kv.tokens[:m]), refs, min(m, kv.n_cells), buf)
    p = write(tmp_path, name, buf.getvalue())
    return p, digest


@pytest.mark.parametrize("v_trans", [0, 1])
@pytest.mark.parametrize("cell_ext", [False, True])
@pytest.mark.parametrize("n_stream, stream", [(1, 0), (4, 2)])
def test_a_file_cut_into_blocks_and_assembled_holds_every_cell_it_held(tmp_path, monkeypatch, v_trans, cell_ext,
                                                                         n_stream, stream):
    """Cells in cache order (a unified cache gave 295…1188 then 0…294), another stream's slot,
    V transposed or not, cells with the M-RoPE extension: cut by position, assembled back,
    every position holds the same meta and K/V bytes, the whole file and any first m tokens."""
    monkeypatch.setattr(B, "BLOCK_TOKENS", 8)
    n = 45
    tokens = [1000 + i for i in range(n)]
    order = list(range(30, n)) + list(range(30))
    p = write(tmp_path, "a.bin", slot_file(tokens, v_trans=v_trans, cell_ext=cell_ext, order=order,
                                           n_stream=n_stream, stream=stream))
    kv = parse(p)
    assert kv.n_cells == n and kv.shape.n_stream == n_stream and kv.shape.cell_bytes == (24 if cell_ext else 12)
    store = BlockStore(tmp_path / "home")
    refs, _, written = split(store, kv, p, MODEL)
    assert [r.n_cells for r in refs] == [8] * 5 + [5] and written == sum(
        B.HEADER.size + B.payload_size(kv.shape, r.n_cells) for r in refs)
    want_tokens, want = cells_by_position(p)
    for m in (n, 33, 16, 1):
        out, digest = assembled(store, kv, refs, m, tmp_path, f"m{m}.bin")
        got_tokens, got = cells_by_position(out)
        assert got_tokens == want_tokens[:m] and got == want[:m]
        assert out.stat().st_size == file_size(kv.shape, m, m)
        from autosessd.base.files import digest_file
        assert digest_file(out)[0] == digest


def test_a_file_in_position_order_comes_back_byte_for_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "BLOCK_TOKENS", 16)
    tokens = list(range(5, 105))
    data = slot_file(tokens)
    p = write(tmp_path, "a.bin", data)
    kv = parse(p)
    store = BlockStore(tmp_path / "home")
    refs, _, _ = split(store, kv, p, MODEL)
    out, _ = assembled(store, kv, refs, len(tokens), tmp_path)
    assert out.read_bytes() == data


def test_the_last_sampled_token_without_kv_is_kept(tmp_path):
    """The engine saves the last token it sampled in the token list before its KV exists: one
    token more than cells. The assembled whole file says the same."""
    tokens = list(range(7, 47))
    p = write(tmp_path, "a.bin", slot_file(tokens, n_cells=39))
    kv = parse(p)
    store = BlockStore(tmp_path / "home")
    refs, _, _ = split(store, kv, p, MODEL)
    out, _ = assembled(store, kv, refs, 40, tmp_path)
    assert out.read_bytes() == p.read_bytes()


@pytest.mark.parametrize("kw, why", [
    (dict(media=True), "media"),
    (dict(extra=b"\1\0\0\0" + b"\0" * 64), "more than one KV cache"),  # a second cache after it: a window's
    (dict(positions=[0, 1, 2, 3, 5, 6, 7, 8, 9, 10]), "context shift"),
    (dict(n_cells=8), "cells for"),  # a sliding window's cells, fewer than tokens
])
def test_what_cannot_be_cut_stays_whole_and_says_why(tmp_path, kw, why):
    p = write(tmp_path, "a.bin", slot_file(list(range(10)), **kw))
    with pytest.raises(NotSliceable, match=why):
        parse(p)


def test_a_cell_of_two_sequences_or_garbage_is_not_cut(tmp_path):
    data = bytearray(slot_file(list(range(10))))
    at = 12 + 4 * 14 + 8  # the first cell's n_seq_id
    data[at:at + 4] = (2).to_bytes(4, "little")
    with pytest.raises(NotSliceable):
        parse(write(tmp_path, "a.bin", bytes(data)))
    rng = random.Random(3)
    for i in range(50):
        junk = bytearray(slot_file(list(range(12))))
        for _ in range(4):
            junk[rng.randrange(12 * 4 + 30, len(junk))] = rng.randrange(256)
        p = write(tmp_path, f"j{i}.bin", bytes(junk[:rng.randrange(40, len(junk) + 1)]))
        try:
            kv = parse(p)
        except NotSliceable:
            continue
        assert kv.n_cells <= 12  # whatever it parsed, it stayed inside the file


def test_blocks_of_shared_tokens_are_stored_once(tmp_path, monkeypatch):
    """Two conversations sharing their first 40 tokens (5 blocks of 8): the second save writes
    only its own blocks. A third with the same first 39 tokens shares 4 whole blocks, not the
    fifth (its tokens differ at the last cell), and a block of the same tokens after other
    tokens is another block (the key is chained)."""
    monkeypatch.setattr(B, "BLOCK_TOKENS", 8)
    shared = list(range(100, 140))
    a = write(tmp_path, "a.bin", slot_file(shared + list(range(500, 520))))
    b = write(tmp_path, "b.bin", slot_file(shared + list(range(700, 712))))
    c = write(tmp_path, "c.bin", slot_file(shared[:39] + [9] + list(range(800, 808))))
    store = BlockStore(tmp_path / "home")
    ra, _, wa = split(store, parse(a), a, MODEL)
    rb, _, wb = split(store, parse(b), b, MODEL)
    rc, _, wc = split(store, parse(c), c, MODEL)
    assert [r.key for r in ra[:5]] == [r.key for r in rb[:5]] and ra[5].key != rb[5].key
    per = B.HEADER.size + B.payload_size(parse(a).shape, 8)
    assert wb == per + B.HEADER.size + B.payload_size(parse(a).shape, 4)  # 12 own cells: one whole, one of 4
    assert [r.key for r in rc[:4]] == [r.key for r in ra[:4]] and rc[4].key != ra[4].key
    assert len(store.scan()) == 8 + 2 + 2  # a: 8 blocks; b and c: 2 of their own each
    shape = parse(a).shape
    assert chain(MODEL, shape, encode(shared[8:16]), 8)[0] != ra[1].key
    assert chain("other-model", shape, encode(shared), 40) != [r.key for r in ra[:5]]


def test_a_damaged_or_missing_block_is_never_assembled(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "BLOCK_TOKENS", 8)
    p = write(tmp_path, "a.bin", slot_file(list(range(30))))
    kv = parse(p)
    store = BlockStore(tmp_path / "home")
    refs, _, _ = split(store, kv, p, MODEL)
    victim = store.path(refs[1].key)
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0xFF
    victim.write_bytes(bytes(raw))  # another inode: read again
    with pytest.raises(BadBlock, match="bytes changed"):
        assembled(store, kv, refs, 30, tmp_path)
    out, _ = assembled(store, kv, refs, 8, tmp_path)  # the first block alone is whole
    assert parse(out).n_cells == 8
    victim.write_bytes(bytes(raw[:-5]))
    with pytest.raises(BadBlock, match="bytes"):
        assembled(store, kv, refs, 30, tmp_path)
    victim.unlink()
    with pytest.raises(BadBlock, match="missing"):
        assembled(store, kv, refs, 30, tmp_path)


def test_a_block_is_swept_only_when_nobody_names_or_holds_it(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "BLOCK_TOKENS", 8)
    store = BlockStore(tmp_path / "home")
    p = write(tmp_path, "a.bin", slot_file(list(range(24))))
    refs, _, _ = split(store, parse(p), p, MODEL)
    keys = [r.key for r in refs]
    store.name("m" * 16, keys[2:])  # a manifest names the last
    with store.pinned(keys[:1]):  # a save or an assembly holds the first
        n, freed = store.sweep()
    assert n == 1 and freed == B.HEADER.size + B.payload_size(parse(p).shape, 8)
    assert set(store.scan()) == {keys[0], keys[2]}
    store.name("m" * 16, None)
    assert store.sweep(keys[2:]) == (1, freed) and set(store.scan()) == {keys[0]}
    dead = store.path(keys[0]).parent / f".{keys[0]}.0123abcd.dead.partial"
    dead.write_bytes(b"x")  # what a crash between a sweep's rename and its unlink leaves
    assert len(store.cleanup()) == 1 and not dead.exists()


def test_the_stores_gc_takes_only_blocks_no_manifest_names(tmp_path, monkeypatch):
    """A manifest's blocks stay; a block no manifest names goes, unless pinned (a save that is
    about to name it)."""
    import dataclasses

    from autosessd.store.directory import Store
    from autosessd.store.names import Meta

    monkeypatch.setattr(B, "BLOCK_TOKENS", 8)
    s = Store(tmp_path / "home")
    p = write(tmp_path, "a.bin", slot_file(list(range(24))))
    kv = parse(p)
    refs, _, _ = split(s.blocks, kv, p, MODEL)
    meta = Meta(key="a" * 16, n_tokens=24, bytes=kv.size, saved_at=1.0, model=MODEL, save_ms=1.0,
                blocks=tuple((r.key, r.n_cells, r.digest) for r in refs[:2]), kv=kv.shape.to_json(),
                tokens=encode(kv.tokens[:16]))
    s.write_meta(dataclasses.replace(meta, n_tokens=16))
    extra = refs[2].key
    with s.blocks.pinned([extra]):
        assert s.blocks.sweep()[1] == 0 and extra in s.blocks.scan()
    n, freed = s.blocks.sweep()
    assert n == 1 and freed > 0 and set(s.blocks.scan()) == {refs[0].key, refs[1].key}
