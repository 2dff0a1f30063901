"""The store with its blocks (issue 39), against Store alone: what a skeptical review of the first
version found (each test failed on it), kept so it stays fixed. Files in llama-server's layout
with a real KV section (kv_common.slot_file), blocks of 4 tokens."""

import os
import time

import pytest

from autosessd.base import files
from autosessd.store import blocks
from autosessd.store.directory import Meta, Store
from autosessd.store.index import TokenIndex
from autosessd.store.staging import Refused
from autosessd.store.kvfile import parse
from autosessd.store.slotfile import encode
from kv_common import slot_file

TOKS = list(range(100, 120))


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(blocks, "BLOCK_TOKENS", 4)


def save(store, key, data, n):
    store.temp_path(key).write_bytes(data)
    return store.finalize(key, Meta(key, n, len(data), time.time(), "m", 1.0))


def test_turning_blocks_off_keeps_every_conversation_kept_as_blocks(tmp_path):
    """store_blocks = false after conversations were kept as blocks: the start keeps them (their
    blocks are read), and a new save is whole."""
    k = "0123456789abcdef"
    assert save(Store(tmp_path), k, slot_file(TOKS), 20).in_blocks
    off = Store(tmp_path, blocks=False)
    off.cleanup()
    assert off.read_meta(k) is not None and off.read_meta(k).in_blocks
    off.trim_hot()
    staged = off.stage(f"auto-{k}.bin")
    assert (tmp_path / staged.name).exists()
    assert not save(off, "1123456789abcdef", slot_file(TOKS), 20).in_blocks


def test_a_whole_save_after_blocks_of_the_same_conversation_is_the_stores_own_file(tmp_path):
    """A context shift makes a conversation's next save whole: in the store's own directory its
    .bin is then the store's file, never a copy the budget removes; its old blocks go at the
    next prune's sweep."""
    s, k = Store(tmp_path, hot_budget=10**9), "fedcba9876543210"
    first = save(s, k, slot_file(TOKS), 20)
    assert first.in_blocks and s.blocks.scan()
    shifted = slot_file(TOKS + [7, 8], positions=[p + 5 for p in range(22)])
    second = save(s, k, shifted, 22)
    assert not second.in_blocks and "context shift" in second.whole
    assert not s.blocks.naming(k)
    s.prune(keep=12, max_bytes=10**12)
    assert not s.blocks.scan()
    assert [e.key for e in s.scan()] == [k]
    s.hot_budget = 0
    s.trim_hot()
    assert s.bin_path(k).read_bytes() == shifted and s.read_meta(k) is not None


def test_a_missing_block_cuts_the_manifests_back_to_the_blocks_before_it(tmp_path):
    """Block 1 of 5 gone: the conversation keeps its first block (restorable), the next restore
    of all of it is refused once, and the block's loss is noted in quarantine's listing."""
    s, k = Store(tmp_path), "00000000000000dd"
    save(s, k, slot_file(TOKS), 20)
    os.unlink(s.blocks.path(s.blocks.naming(k)[1]))
    s.hot.forget(f"auto-{k}.bin")
    s.bin_path(k).unlink(missing_ok=True)
    with pytest.raises(Refused, match="missing") as e:
        s.stage(f"auto-{k}.bin")
    assert e.value.bad and e.value.cut == (f"auto-{k}.bin",)
    meta = s.read_meta(k)
    assert meta is not None and meta.n_tokens == 4 and len(meta.blocks) == 1 and meta.tokens == encode(TOKS[:4])
    staged = s.stage(f"auto-{k}.bin")
    assert staged.assembled and list(parse(tmp_path / staged.name).tokens) == TOKS[:4]
    assert [q["named_by"] for q in s.quarantined() if q.get("block")] == [[k]]


def test_the_gc_never_takes_a_block_a_save_named_after_it_looked(tmp_path):
    """A sweep lists the blocks, and a save lands before it removes them: the save's blocks stay
    (named or pinned, looked at under the lock at the moment of removal)."""
    s, k = Store(tmp_path), "00000000000000aa"
    listed = s.blocks.scan

    def listing_then_a_save():
        there = listed()
        save(s, k, slot_file(TOKS), 20)  # after the snapshot, before the removals
        return {**there, **listed()}

    s.blocks.scan = listing_then_a_save
    s.blocks.sweep()
    s.blocks.scan = listed
    s.hot.forget(f"auto-{k}.bin")
    s.bin_path(k).unlink(missing_ok=True)
    staged = s.stage(f"auto-{k}.bin")  # assembled from every block: none is missing
    assert staged.assembled and (tmp_path / staged.name).exists()


def test_prune_forgets_the_index_entry_of_a_manifest_with_its_copy_beside_it(tmp_path):
    s, k = Store(tmp_path), "00000000000000bb"
    save(s, k, slot_file(TOKS), 20)
    idx = TokenIndex(tmp_path)
    idx.scan()
    e = [x for x in s.scan(with_meta=False) if x.key == k][0]
    assert idx.get(f"auto-{k}.bin").ident == e.ident  # the manifest's identity, not its copy's
    s.remove(k, e.ident)
    assert idx.remove(f"auto-{k}.bin", ident=e.ident)


def test_an_assembled_copy_says_its_own_digest(tmp_path):
    """Cells in cache order in the engine's file, in position order once assembled: the staged
    copy's digest is its own (what an upload must send), not the engine's file's."""
    s, k = Store(tmp_path), "00000000000000cc"
    m = save(s, k, slot_file(TOKS, order=list(range(10, 20)) + list(range(10))), 20)
    s.hot.forget(f"auto-{k}.bin")
    st = s.stage(f"auto-{k}.bin")
    assert st.digest == files.digest_file(tmp_path / st.name)[0] != m.digest


def test_an_assembly_never_replaces_a_newer_save_of_the_same_conversation(tmp_path):
    """stage() assembles while a newer save of the same name is being finalized (its name held):
    the assembly stays a temporary, the new copy is kept."""
    s, k = Store(tmp_path), "00000000000000ee"
    save(s, k, slot_file(TOKS), 20)
    s.hot.forget(f"auto-{k}.bin")
    name = f"auto-{k}.bin"
    with s.using(name), s.using(name):  # the restore's hold and a finalize's
        st = s.stage(name)
    assert st.temporary and not (tmp_path / name).exists()


def test_a_separate_staging_copy_of_a_whole_file_is_not_read_again_on_return(tmp_path, monkeypatch):
    home, staging = tmp_path / "store", tmp_path / "staging"
    home.mkdir()
    staging.mkdir()
    s, k = Store(home, staging=staging), "00000000000000ff"
    shifted = slot_file(TOKS, positions=[p + 5 for p in range(20)])  # kept whole
    save(s, k, shifted, 20)
    read = []
    real = files.digest_file
    monkeypatch.setattr(files, "digest_file", lambda p: read.append(p) or real(p))
    assert s.stage(f"auto-{k}.bin").name == f"auto-{k}.bin"
    assert read == []  # recorded as checked by the finalize that put it there
