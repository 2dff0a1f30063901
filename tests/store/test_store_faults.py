"""The store of blocks under faults (issue 46): what a storage reviewer found, each test failing
on the store before it (4061a60) and passing since. Files in llama-server's layout with a real KV
section (kv_common.slot_file), blocks of 4 tokens."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import resource
import threading
import time

import pytest

from autosessd.base import files
from autosessd.store import blocks
from autosessd.store.directory import Meta, Store
from autosessd.store.kvfile import parse
from autosessd.store.staging import Refused
from kv_common import slot_file

A, B = "a" * 16, "b" * 16
TOKS = list(range(100, 120))  # 5 blocks


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(blocks, "BLOCK_TOKENS", 4)


def save(store, key, tokens, **kw):
    data = slot_file(tokens, **kw)
    store.temp_path(key).write_bytes(data)
    return store.finalize(key, Meta(key, len(tokens), len(data), time.time(), "m", 1.0))


def staged_tokens(store, staged) -> list[int]:
    return list(parse(store.staging / staged.name).tokens)


def listing(d) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*")) if p.is_file()}


# -- 2: only evidence about a block's bytes condemns it --------------------------------------------
@pytest.mark.parametrize("err", [errno.EMFILE, errno.ENFILE, errno.EIO, errno.EACCES, errno.EINTR])
def test_an_error_opening_a_block_fails_one_restore_and_leaves_the_store_as_it_was(tmp_path, monkeypatch, err):
    s = Store(tmp_path, hot_budget=0)  # no copies: every restore is assembled from the blocks
    save(s, A, TOKS)
    save(s, B, TOKS[:8] + [7] * 12)  # shares A's first two blocks (a system prompt)
    before = listing(tmp_path)
    real = os.open

    def failing(path, *a, **kw):
        if str(path).endswith(".blk"):
            raise OSError(err, os.strerror(err), str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "open", failing)
    with pytest.raises(Refused) as e:
        s.stage(f"auto-{A}.bin")
    monkeypatch.setattr(os, "open", real)
    assert not e.value.bad, e.value
    assert listing(tmp_path) == before  # nothing moved aside, no manifest removed
    assert staged_tokens(s, s.stage(f"auto-{A}.bin")) == TOKS
    assert staged_tokens(s, s.stage(f"auto-{B}.bin")) == TOKS[:8] + [7] * 12


def test_an_assembly_of_many_blocks_needs_few_descriptors(tmp_path):
    """400 tokens: 100 blocks, assembled with fewer descriptors free than blocks (it keeps its
    first OPEN_AT_ONCE, 64, and reads the others a section at a time)."""
    s = Store(tmp_path, hot_budget=0)
    toks = list(range(1000, 1400))
    save(s, A, toks)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + blocks.OPEN_AT_ONCE + 16, hard))
    try:
        staged = s.stage(f"auto-{A}.bin")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert staged.assembled and staged_tokens(s, staged) == toks


def test_a_block_that_cannot_be_read_midway_is_an_error_never_a_signal(tmp_path):
    """A block whose bytes are gone from under an assembly (a disk's read error; here the block
    cut short by another process after it was opened, which the kernel answers alike for a map:
    SIGBUS) is refused with a reason, and the process lives on. Before, the first 64 blocks were
    mapped: reading them killed the daemon, and a restore at its next start met them again."""
    from autosessd.store.cutting import BlockReader
    from autosessd.store.blocks import BadBlock, BlockRef
    from autosessd.store.kvfile import Shape

    s = Store(tmp_path, hot_budget=0)
    save(s, A, TOKS)
    meta = s.read_meta(A)
    ref, shape = BlockRef(*meta.blocks[0]), Shape.from_json(meta.kv)
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            rd = BlockReader(s.blocks, ref, shape, keep_open=True)
            os.truncate(s.blocks.path(ref.key), blocks.HEADER.size)  # its payload gone after the open
            try:
                rd.read(rd.size)
                code = 2  # read bytes that are not there
            except BadBlock:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert not os.WIFSIGNALED(status), f"the read killed the process with signal {os.WTERMSIG(status)}"
    assert os.WEXITSTATUS(status) == 0


def test_a_read_error_while_the_engines_file_is_parsed_is_an_oserror(tmp_path, monkeypatch):
    """The engine's file is parsed (cut into blocks, imported) by reads, not through a map: a
    read error of the disk reaches the caller as OSError (a finalize tries again), where under
    a map it would have been SIGBUS."""
    p = tmp_path / "f.bin"
    p.write_bytes(slot_file(TOKS))
    assert parse(p).n_cells == len(TOKS)
    real = os.pread

    def eio(fd, n, offset):
        if offset > 0:
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", eio)
    with pytest.raises(OSError, match="injected"):
        parse(p)


def test_real_damage_to_block_i_leaves_blocks_before_it_restorable(tmp_path):
    s = Store(tmp_path, hot_budget=0)
    save(s, A, TOKS)
    p = s.blocks.path(s.read_meta(A).blocks[2][0])
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(Refused, match="bytes changed") as e:
        s.stage(f"auto-{A}.bin")
    assert e.value.bad
    meta = s.read_meta(A)
    assert meta is not None and meta.n_tokens == 8 and len(meta.blocks) == 2
    assert staged_tokens(s, s.stage(f"auto-{A}.bin")) == TOKS[:8]
    [q] = [q for q in s.quarantined() if "block" in q["name"]]  # said, with what named it
    assert "bytes changed" in q["why"] and q.get("named_by") == [A]


# -- 5: import never cuts damaged bytes into blocks --------------------------------------------------
def test_importing_a_whole_file_whose_bytes_changed_under_the_same_identity_cuts_nothing(tmp_path):
    off = Store(tmp_path, blocks=False)
    meta = save(off, A, TOKS)
    assert not meta.in_blocks
    p = off.bin_path(A)
    raw = bytearray(p.read_bytes())
    raw[-7] ^= 0x55
    p.write_bytes(bytes(raw))
    # As a crash or the disk leaves it: the bytes changed, the identity recorded is the file's.
    off.write_meta(dataclasses.replace(off.read_meta(A), ident=files.regular_ident(p)))
    s = Store(tmp_path)
    s.cleanup()
    done = s.import_whole(A)
    assert not s.blocks.scan(), done  # no block holds the damaged bytes
    now = s.read_meta(A)
    assert now is None or not now.in_blocks


# -- 6: copies on the store's disk count in its budget, and go first ------------------------------
def test_copies_on_the_stores_disk_count_in_its_budget_and_go_before_any_conversation(tmp_path):
    s = Store(tmp_path, hot_budget=10**9)  # staging is the store: copies on the same disk
    for i, key in enumerate((A, B)):
        save(s, key, [i * 1000 + t for t in TOKS])
    block_bytes = sum(s.blocks.scan().values())
    copies = sum(p.stat().st_size for p in tmp_path.glob("auto-*.bin"))
    assert copies > 0
    budget = block_bytes + copies // 2  # the blocks fit; the blocks and both copies do not
    s.prune(keep=12, max_bytes=budget)
    assert {e.key for e in s.scan()} == {A, B}  # no conversation removed
    on_disk = sum(s.blocks.scan().values()) + sum(p.stat().st_size for p in tmp_path.glob("auto-*.bin"))
    assert on_disk <= budget


# -- 7: a restore's blocks are pinned when its manifest is read --------------------------------------
def test_a_save_of_the_same_name_between_a_manifest_read_and_its_assembly_takes_no_block(tmp_path, monkeypatch):
    s = Store(tmp_path, hot_budget=0)
    save(s, A, TOKS)
    me = threading.get_ident()
    real = Store._meta_at
    fired = []

    def newer_save_and_prune():  # another slot finalizes A again (a new tail), then a prune runs
        save(s, A, TOKS[:12] + [9] * 8)
        s.prune(keep=12, max_bytes=10**12)

    def meta_at(self, path):
        meta = real(self, path)
        if threading.get_ident() == me and path.name == f"auto-{A}.json" and not fired:
            fired.append(1)
            t = threading.Thread(target=newer_save_and_prune)
            t.start()
            t.join(1.0)  # it runs now, unless the read holds what it needs
        return meta

    monkeypatch.setattr(Store, "_meta_at", meta_at)
    staged = s.stage(f"auto-{A}.bin")  # never "missing": the manifest it pins is the one it assembles
    assert staged_tokens(s, staged) in (TOKS, TOKS[:12] + [9] * 8)
    monkeypatch.setattr(Store, "_meta_at", real)
    for t in threading.enumerate():
        if t is not threading.current_thread() and t.name.startswith("Thread"):
            t.join(10)
    assert s.read_meta(A).tokens is not None


# -- 8: a copy from before a restart is checked by its digest --------------------------------------
def test_a_copy_from_before_a_restart_is_checked_by_digest_before_the_engine_reads_it(tmp_path):
    s = Store(tmp_path, hot_budget=10**9)
    meta = save(s, A, TOKS)
    copy = s.bin_path(A)
    assert copy.exists()
    raw = bytearray(copy.read_bytes())
    raw[-3] ^= 0xFF  # never fsynced: a crash can leave its pages lost under the same size and ctime
    copy.write_bytes(bytes(raw))
    s.write_meta(dataclasses.replace(meta, ident=files.regular_ident(copy)))
    again = Store(tmp_path, hot_budget=10**9)
    again.cleanup()
    staged = again.stage(f"auto-{A}.bin")
    got = (tmp_path / staged.name).read_bytes()
    assert got != bytes(raw)
    assert staged.assembled and staged_tokens(again, staged) == TOKS


# -- 9: names from manifests never leave blocks/; quarantine is listed, reclaimed, forgotten ---------
def test_a_block_key_that_is_not_hex_makes_the_manifest_invalid(tmp_path):
    s = Store(tmp_path)
    meta = save(s, A, TOKS)
    d = json.loads(s.meta_path(A).read_bytes())
    d["blocks"][1][0] = "../../../../../../../tmp/xx"[:32].ljust(32, "a")
    with pytest.raises(ValueError):
        Meta.from_json(json.dumps(d).encode())
    s.meta_path(A).write_text(json.dumps(d))
    assert Store(tmp_path).read_meta(A) is None
    assert meta.in_blocks


def test_quarantined_blocks_are_listed_reclaimed_and_gone_with_a_forgotten_conversation(tmp_path):
    s = Store(tmp_path, hot_budget=0)
    save(s, A, TOKS)
    p = s.blocks.path(s.read_meta(A).blocks[3][0])
    p.write_bytes(p.read_bytes()[:-1])  # torn
    with pytest.raises(Refused):
        s.stage(f"auto-{A}.bin")
    [q] = s.quarantined()
    assert q["block"] == p.stem and q["named_by"] == [A] and q["bytes"] > 0
    assert s.forget_quarantined({A}) > 0 and s.quarantined() == []
    assert not [x for x in (tmp_path / ".autosessd-quarantine").iterdir()]
    p2 = s.blocks.path(s.read_meta(A).blocks[1][0])
    p2.write_bytes(b"x" * p2.stat().st_size)
    with pytest.raises(Refused):
        s.stage(f"auto-{A}.bin")
    assert len(s.quarantined()) == 1
    assert s.prune_quarantine(7 * 86400, now=time.time() + 6 * 86400) == 0
    assert s.prune_quarantine(7 * 86400, now=time.time() + 8 * 86400) > 0 and s.quarantined() == []


# -- 10: a copy never outlives a budget it does not fit -----------------------------------------
def test_a_save_finalized_under_its_own_hold_keeps_no_copy_beyond_the_budget(tmp_path):
    """staging_max_gb = 0: the engine's file does not stay as a copy, though the finalize that
    would keep it holds the name (as the sessions' finalize does); the next restore of a prefix
    is assembled from the blocks, not read whole from a copy."""
    s = Store(tmp_path, hot_budget=0)
    with s.using(f"auto-{A}.bin"):
        save(s, A, TOKS)
    assert not s.bin_path(A).exists()
    with s.using(f"auto-{A}.bin"):
        staged = s.stage(f"auto-{A}.bin", 8)
    assert staged.assembled and staged_tokens(s, staged) == TOKS[:8]


# -- what a skeptical read of the fixes found ---------------------------------------------------
def test_a_restore_of_a_whole_file_larger_than_the_copies_budget_reads_a_temporary(tmp_path):
    """A separate store (tmpfs staging) and a file over staging_max_gb: the engine reads a copy
    made for it, which goes after the restore; none is kept, and none is let go under it."""
    home, staging = tmp_path / "store", tmp_path / "staging"
    home.mkdir()
    staging.mkdir()
    s = Store(home, staging=staging, hot_budget=0, blocks=False)
    save(s, A, TOKS)
    with s.using(f"auto-{A}.bin"):
        staged = s.stage(f"auto-{A}.bin")
        assert staged.temporary and (staging / staged.name).exists()
    s.unstage(staged)
    assert not [p for p in staging.iterdir()]


def test_a_copy_assembled_for_a_restore_stays_while_another_held_copy_is_over_the_budget(tmp_path):
    s = Store(tmp_path, hot_budget=0)
    save(s, A, TOKS)
    save(s, B, [t + 1000 for t in TOKS])
    with s.using(f"auto-{A}.bin"):
        held = s.stage(f"auto-{A}.bin")  # A's copy, held by another slot's restore
        s.hot_budget = 2 * (tmp_path / held.name).stat().st_size - 1  # room for one copy only
        with s.using(f"auto-{B}.bin"):
            mine = s.stage(f"auto-{B}.bin")
            assert (tmp_path / mine.name).exists() and (tmp_path / held.name).exists()


def test_a_block_written_again_with_other_bytes_cuts_back_only_the_manifest_that_recorded_the_old(tmp_path):
    """The same tokens' KV written again under its key (its old file was torn; the bytes of a
    prompt and of a reply differ): the manifest of the old bytes is cut back before it, the
    block is not set aside, and the manifest of the new bytes restores whole."""
    s = Store(tmp_path, hot_budget=0)
    old = save(s, A, TOKS)
    key = old.blocks[2][0]
    p = s.blocks.path(key)
    p.unlink()
    # Another save of the same tokens whose block 2 came out with other bytes (salt).
    new = save(s, B, TOKS[:8] + TOKS[8:12], salt=1)
    assert new.blocks[2][0] == key and new.blocks[2][2] != old.blocks[2][2]
    with pytest.raises(Refused, match="other bytes") as e:
        s.stage(f"auto-{A}.bin")
    assert e.value.cut == (f"auto-{A}.bin",) and s.quarantined() == [] and p.exists()
    assert s.read_meta(A).n_tokens == 8
    assert staged_tokens(s, s.stage(f"auto-{B}.bin")) == TOKS[:12]


def test_forget_leaves_no_block_of_an_earlier_save(tmp_path):
    """18 then 22 tokens (its last block replaced), then removed: none of its blocks is left."""
    s = Store(tmp_path)
    save(s, A, TOKS[:18])
    save(s, A, TOKS + [7, 8])
    s.remove(A)
    assert s.blocks.scan() == {}
