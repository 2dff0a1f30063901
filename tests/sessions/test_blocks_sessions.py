"""Sessions on the block store (issue 39), on the stub engine whose files carry a KV section in
llama-server's layout (stub_engine.StubEngine(kv=True)): a conversation's save kept as blocks
with its copy in staging, a return served by the copy or assembled from the blocks, a shared
prompt stored once, a turn writing about its new tokens, a separate staging directory, prune and
forget taking the blocks only their conversations held. Every check reads the files (the
store's blocks, the engine's restored tokens), not autosessd's records."""

import asyncio

import pytest

from autosessd.base.config import parse
from autosessd.sessions.facade import Sessions
from autosessd.store import blocks as B
from autosessd.store import slotfile
from autosessd.store.directory import Store
from stub_engine import StubEngine

A, B2, C = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "cccccccccccccccc"
BASE = {A: 1, B2: 100001, C: 200001}
BLOCK = 16


def conv(key, n, shared=0):
    """Conversation `key`'s first n tokens; with shared, its first `shared` are one common prompt."""
    common = list(range(900001, 900001 + shared))
    return (common + list(range(BASE[key], BASE[key] + n)))[:n]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(B, "BLOCK_TOKENS", BLOCK)


def make(tmp_path, staging=None, hot_budget=1 << 30, min_tokens=10, n_slots=1):
    store_dir = tmp_path / "store"
    store_dir.mkdir(exist_ok=True)
    eng_dir = staging or store_dir
    eng_dir.mkdir(exist_ok=True)
    cfg = parse(f'slot_save_path = "{eng_dir}"\nauto_sessions_min_tokens = {min_tokens}\n'
                f'state_dir = "{tmp_path / "state"}"\n'.encode())
    store = Store(store_dir, staging=eng_dir, hot_budget=hot_budget)
    store.cleanup()
    return Sessions(cfg, StubEngine(eng_dir, kv=True, n_slots=n_slots), store, "stub-model", n_slots=n_slots)


async def request(s, key, tokens, slot=None):
    async with await s.admit(slot) as t:
        turn = await s.turn(t, key)
        s.engine.ran(tokens, t.slot_id)
        await s.ended(t, key, "ok")
    await s.drain()
    return turn


def manifest(s, key):
    return s.store.read_meta(key)


@pytest.mark.parametrize("separate", [False, True])
async def test_a_return_restores_the_copy_or_the_blocks_and_the_slot_holds_its_tokens(tmp_path, separate):
    s = make(tmp_path, staging=tmp_path / "staging" if separate else None)
    await s.prepare()
    await request(s, A, conv(A, 70))
    await request(s, B2, conv(B2, 30))  # A saved at the switch: blocks, a manifest, a copy in staging
    meta = manifest(s, A)
    assert meta is not None and meta.in_blocks and len(meta.blocks) == 5  # 70 tokens: 4 of 16 and one of 6
    assert (s.store.staging / f"auto-{A}.bin").exists()
    r = await request(s, A, conv(A, 70))
    assert r.restored is not None and s.counters.assemblies == 0  # the copy
    assert s.engine.held[0] == conv(A, 70)
    await request(s, B2, conv(B2, 30))
    s.store.hot_budget = 0
    s.store.trim_hot()  # every copy goes (A's is not in use now)
    assert not (s.store.staging / f"auto-{A}.bin").exists()
    r = await request(s, A, conv(A, 70))
    assert r.restored is not None and r.restored.get("assembled_bytes")
    assert s.counters.assemblies == 1 and s.engine.held[0] == conv(A, 70)


async def test_a_conversation_sharing_a_prompt_reads_only_the_shared_blocks(tmp_path):
    """C shares the first 40 tokens with A's file: through the token rule (chat bodies) it would
    restore A's file's first 40 tokens: here by the key rule, restore_now with the store's stage
    of 40 tokens, the bytes read are those of the first blocks only."""
    s = make(tmp_path, hot_budget=0)
    await s.prepare()
    await request(s, A, conv(A, 100))
    await request(s, B2, conv(B2, 30))
    s.store.trim_hot()  # the budget of 0 applied (as it is in a thread once a save is no longer held)
    assert not (s.store.staging / f"auto-{A}.bin").exists()
    staged = s.store.stage(f"auto-{A}.bin", 40)
    try:
        assert staged.temporary and staged.n_tokens == 40
        header = slotfile.read_header(s.store.staging / staged.name)
        assert list(header.tokens) == conv(A, 40)
        shape_cell = B.payload_size(__import__("autosessd.store.kvfile", fromlist=["Shape"]).Shape.from_json(
            manifest(s, A).kv), 1)
        assert staged.bytes_read == 48 * shape_cell  # blocks 0, 1, 2 (of 16 each): 48 cells, not 100
    finally:
        s.store.unstage(staged)
    assert not (s.store.staging / staged.name).exists()


async def test_a_restore_of_a_files_first_tokens_says_the_slot_holds_those_only(tmp_path):
    """A request sharing A's first 40 tokens (the token rule's pick) restores an assembly of those:
    the slot is recorded with exactly those 40 tokens, not the file's 100 (a later turn judges
    what it shares with the slot by them)."""
    s = make(tmp_path, hot_budget=0)
    await s.prepare()
    await request(s, A, conv(A, 100))
    await request(s, B2, conv(B2, 30))
    s.store.trim_hot()
    sl = s.slot(0)
    ok = await s.restorer.restore(sl, A, None, expect=40, tokens=slotfile.encode(conv(A, 100)),
                                  decided=s.ctx.facts.generation)
    assert ok and s.engine.held[0] == conv(A, 40)
    assert sl.view.tokens == slotfile.encode(conv(A, 40)) and sl.view.n_tokens == 40


async def test_conversations_sharing_a_system_prompt_store_it_once(tmp_path):
    """Eight conversations whose first 64 tokens are one system prompt, then their own 36: the
    store holds the prompt's blocks once (≤ 1.2 × the unique tokens' bytes)."""
    s = make(tmp_path, n_slots=1)
    await s.prepare()
    keys = [f"{i:x}" * 16 for i in range(1, 9)]
    for k in keys:
        BASE[k] = 300001 + 1000 * keys.index(k)
    for k in keys:
        await request(s, k, conv(k, 100, shared=64))
    await request(s, A, conv(A, 20))  # the last one saved too
    usage = s.store.usage()
    cell = B.payload_size(__import__("autosessd.store.kvfile", fromlist=["Shape"]).Shape.from_json(
        manifest(s, keys[0]).kv), 1)
    unique_tokens = 64 + 8 * 36
    assert usage["manifests"] == 8
    assert usage["block_bytes"] <= 1.2 * unique_tokens * cell + 8 * B.HEADER.size * 4, usage
    assert usage["shared_block_bytes"] >= 64 * cell


async def test_a_turn_writes_about_its_new_tokens(tmp_path):
    """Two conversations taking turns on one slot, each turn adding 20 tokens: each save writes
    the new tokens' blocks and one partial block at most, not the whole conversation."""
    s = make(tmp_path)
    await s.prepare()
    n = {A: 200, B2: 200}
    await request(s, A, conv(A, n[A]))
    await request(s, B2, conv(B2, n[B2]))  # A saved whole: all its blocks are new
    await request(s, A, conv(A, n[A]))  # B's too
    cell = B.payload_size(__import__("autosessd.store.kvfile", fromlist=["Shape"]).Shape.from_json(
        manifest(s, A).kv), 1)
    for _ in range(3):
        for k in (A, B2):
            before = s.store.blocks.bytes_written
            n[k] += 20
            await request(s, k, conv(k, n[k]))
            written = s.store.blocks.bytes_written - before
            # The switch saved the other one (20 new tokens): ≤ 1.3 × its new tokens + one block.
            assert written <= 1.3 * 20 * cell + (BLOCK * cell + 2 * B.HEADER.size), (written, cell)


async def test_prune_and_forget_take_only_the_blocks_their_conversations_held(tmp_path):
    s = make(tmp_path)
    await s.prepare()
    await request(s, A, conv(A, 64, shared=32))
    await request(s, B2, conv(B2, 64, shared=32))
    await request(s, C, conv(C, 20))  # B saved
    a, b = manifest(s, A), manifest(s, B2)
    shared = {x[0] for x in a.blocks} & {x[0] for x in b.blocks}
    assert len(shared) == 2
    done = await s.forget(A)
    assert done["files"] == [f"auto-{A}.bin"]
    there = set(s.store.blocks.scan())
    assert shared <= there and not ({x[0] for x in a.blocks} - shared) & there
    assert not (s.store.staging / f"auto-{A}.bin").exists()
    await request(s, A, conv(A, 64, shared=32))  # A anew
    await request(s, C, conv(C, 20))
    await s.prune(keep=1)  # A newest: B goes, the blocks it shared with A stay
    there = set(s.store.blocks.scan())
    assert manifest(s, B2) is None and shared <= there
    assert not ({x[0] for x in b.blocks} - shared) & there


async def test_a_restart_finds_the_manifests_and_their_copies(tmp_path):
    """A stop and a start with a separate staging directory emptied meanwhile (tmpfs after a
    reboot): the start keeps the manifests, and the return assembles A from its blocks."""
    staging = tmp_path / "staging"
    s = make(tmp_path, staging=staging)
    await s.prepare()
    await request(s, A, conv(A, 50))
    await request(s, B2, conv(B2, 30))
    await s.close()
    for p in staging.iterdir():
        p.unlink()
    s2 = make(tmp_path, staging=staging)
    await s2.prepare()
    assert s2.index.get(f"auto-{A}.bin") is not None and manifest(s2, A).in_blocks
    r = await request(s2, A, conv(A, 50))
    assert r.restored is not None and s2.counters.assemblies == 1 and s2.engine.held[0] == conv(A, 50)


async def test_whole_files_from_before_the_block_store_are_kept_as_blocks_after_a_start(tmp_path):
    """Files saved with store_blocks off (as every save before issue 39): the next start keeps
    them as blocks, in the background; the conversation restores as before."""
    s = make(tmp_path)
    s.store.cut = False  # the store of an older autosessd: whole files
    await s.prepare()
    await request(s, A, conv(A, 40))
    await request(s, B2, conv(B2, 30))
    assert not manifest(s, A).in_blocks and manifest(s, A).whole is None
    await s.close()
    s2 = make(tmp_path)
    await s2.prepare()
    for _ in range(200):
        if manifest(s2, A).in_blocks:
            break
        await asyncio.sleep(0.02)
    assert manifest(s2, A).in_blocks and len(manifest(s2, A).blocks) == 3
    r = await request(s2, A, conv(A, 40))
    assert r.restored is not None and s2.engine.held[0] == conv(A, 40)


def test_exec_puts_the_engines_files_on_tmpfs_and_the_store_on_disk(tmp_path, monkeypatch):
    from autosessd.base import config

    cfg = parse(f'slot_save_path = "{tmp_path}"\n'.encode())
    monkeypatch.setattr(config, "_is_tmpfs", lambda p: True)
    staged = config.tmpfs_staging(cfg, "/dev/shm")
    assert staged.store_path == str(tmp_path) and staged.slot_save_path.startswith("/dev/shm/autosessd-")
    chosen = parse(f'slot_save_path = "{tmp_path}"\nstore_path = "/srv/store"\n'.encode())
    assert config.tmpfs_staging(chosen, "/dev/shm") is chosen  # the user chose: left alone
    monkeypatch.setattr(config, "_is_tmpfs", lambda p: False)
    assert config.tmpfs_staging(cfg, "/dev/shm") is cfg


async def test_a_request_naming_its_own_lora_adapters_is_no_conversation(tmp_path):
    """A per-request "lora" changes the KV the engine computes for that request alone (issue 46,
    3): the gate gives it no key, so the slot's conversation is saved before it, nothing of it is
    saved or restored, and the conversation's return restores its own file."""
    from autosessd.base.keys import conversation_key

    body = {"messages": [{"role": "user", "content": "hi"}], "lora": [{"id": 0, "scale": 1.0}]}
    assert conversation_key(body) is None
    assert conversation_key({**body, "lora": []}) is not None
    s = make(tmp_path)
    await s.prepare()
    await request(s, A, conv(A, 70))
    await request(s, None, conv(C, 50))  # the LoRA request: A saved before it
    assert manifest(s, A) is not None and manifest(s, C) is None
    r = await request(s, A, conv(A, 70))
    assert r.restored is not None and s.engine.held[0] == conv(A, 70)


async def test_forget_waits_for_a_reader_of_the_file_to_let_go(tmp_path):
    """An upload assembling the file (it holds the name for a moment) when forget comes: the file
    is removed once it lets go, not kept (a stress seed found the conversation back)."""
    import threading

    s = make(tmp_path)
    await s.prepare()
    await request(s, A, conv(A, 70))
    await request(s, B2, conv(B2, 30))  # A saved
    name = f"auto-{A}.bin"
    s.store.acquire(name)  # the upload's hold
    threading.Timer(0.3, s.store.release, (name,)).start()
    done = await s.forget(A)
    assert done["files"] == [name] and done["kept"] == [] and manifest(s, A) is None
