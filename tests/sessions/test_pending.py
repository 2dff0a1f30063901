"""Saves still being made durable (issue 38): a finalize in flight while the slot's conversation
moves on, comes back, is forgotten, or while another model writes the same prefix.

On the stub engine (real slot files, the header's tokens standing for the conversation: A's are
1..n, B's 1001..), so every check reads a file's header, not autosessd's records. A finalize is
held at a chosen point with a threading.Event (Hold): inside its digest after the first chunk,
or before it starts."""

import asyncio
import json
import threading

import pytest

from autosessd.base import files
from autosessd.base.config import parse
from autosessd.sessions.facade import Sessions
from autosessd.sessions.slot import Phase
from autosessd.store import slotfile
from autosessd.store.directory import Store
from autosessd.store.integrity import NEEDS_READ
from stub_engine import StubEngine

A, B, C = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "cccccccccccccccc"
TOKENS = {A: 1, B: 1001, C: 5001}


def conv(key, n):
    return list(range(TOKENS[key], TOKENS[key] + n))


def make(tmp_path, min_tokens=10, n_slots=1, **kw):
    state = tmp_path / "state"
    cfg = parse(f'slot_save_path = "{tmp_path}"\nauto_sessions_min_tokens = {min_tokens}\n'
                f'state_dir = "{state}"\n'.encode())
    return Sessions(cfg, StubEngine(tmp_path, n_slots=n_slots, **kw), Store(tmp_path), "stub-model",
                    n_slots=n_slots)


async def request(s, key, n, slot=None):
    """What the gate does: FIFO, turn, the request runs, ended. Does not wait for finalizes."""
    async with await s.admit(slot) as t:
        turn = await s.turn(t, key)
        s.engine.ran(conv(key, n), t.slot_id)
        await s.ended(t, key, "ok")
    return turn


def header(tmp_path, name):
    return list(slotfile.read_header(tmp_path / name).tokens)


class Hold:
    """Stops the first digest of a finalize after its first chunk until released."""

    def __init__(self, monkeypatch):
        self.inside, self.go = threading.Event(), threading.Event()
        self.held = False
        real = files.Hasher.update
        monkeypatch.setattr(files, "CHUNK", 64)
        hold = self

        def update(h, data):
            real(h, data)
            if not hold.held and threading.current_thread() is not threading.main_thread():
                hold.held = True
                hold.inside.set()
                assert hold.go.wait(10), "the finalize was never let go"

        monkeypatch.setattr(files.Hasher, "update", update)

    async def reached(self):
        for _ in range(500):
            if self.inside.is_set():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the finalize never reached its digest")


async def test_a_quick_return_never_fails_the_save_it_reads(tmp_path, monkeypatch):
    """Item 1: X saved at a switch; while its finalize digests the temporary, the client comes
    back to X and the restore reads the save before it is durable. The finalize must land (no
    save failure, auto-X.bin holding X's tokens) and record the file as it stays, so that the
    next restore of X needs no read of the whole file."""
    s = make(tmp_path)
    hold = Hold(monkeypatch)
    await request(s, A, 60)
    await request(s, B, 30)  # the switch saves A: its finalize is held inside the digest
    await hold.reached()
    assert s.saver.writing() == {f"auto-{A}.bin"}
    r = await request(s, A, 60)  # the quick return restores A's save before it is durable
    assert r.restored is not None and r.restored["n_tokens"] == 60
    hold.go.set()
    await s.drain()
    assert s.counters.save_failures == 0
    assert header(tmp_path, f"auto-{A}.bin") == conv(A, 60)
    assert s.store.check_whole(f"auto-{A}.bin", 1, stat_only=True) is None  # not NEEDS_READ
    digests = []
    real = files.digest_file
    monkeypatch.setattr(files, "digest_file", lambda p: digests.append(p) or real(p))
    await request(s, B, 40)  # A's file is up to date: not saved again
    r = await request(s, A, 60)  # the same file restored again
    await s.drain()
    assert r.restored is not None and r.restored["file"] == f"auto-{A}.bin"
    assert not any(str(p).endswith(f"auto-{A}.bin") for p in digests), digests


class FailOnce:
    """Store.<step> held until released, then failing once with `error` (the finalize's later
    tries go through)."""

    def __init__(self, monkeypatch, store, step, error):
        self.inside, self.go, self.calls = threading.Event(), threading.Event(), 0
        real = getattr(Store, step)
        me = self

        def step_fn(self_, *a, **kw):
            me.calls += 1
            if me.calls == 1:
                me.inside.set()
                assert me.go.wait(10), "never let go"
                raise error
            return real(self_, *a, **kw)

        monkeypatch.setattr(Store, step, step_fn)

    async def reached(self):
        for _ in range(500):
            if self.inside.is_set():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the finalize never reached the step")


@pytest.mark.parametrize("step, error", [
    ("_seal", OSError(5, "Input/output error")),  # the fsync of the temporary: a fresh copy is made
    ("_write_meta", OSError(28, "No space left on device")),  # renamed already; the prune makes room
])
@pytest.mark.parametrize("saved_at", ["switch", "idle"])
async def test_a_failed_finalize_never_loses_the_conversation_a_slot_held(tmp_path, monkeypatch, step, error,
                                                                         saved_at):
    """Item 2: A's save is finalizing while the client switches away (the switch saved it, or
    skipped it as up to date because an idle save of it is pending); B's request then replaces
    the slot's contents; then A's finalize fails. The decisions made on the pending save must
    still hold: the finalize is tried again from the bytes the engine wrote, and A's tokens are
    in auto-A.bin afterwards. One save failure is counted: the injected one."""
    from autosessd.sessions import finalizing

    monkeypatch.setattr(finalizing, "RETRY_S", (0.05, 0.05, 0.05))
    s = make(tmp_path)
    fail = FailOnce(monkeypatch, s.store, step, error)
    await request(s, A, 60)
    if saved_at == "idle":
        [saved] = await s.idle.save_now()
        assert saved["saved"]
        await fail.reached()
    saves = len(s.engine.saves)
    r = await request(s, B, 30)  # the switch away; A's file "as it will be" decided it
    await fail.reached()
    assert (r.saved is None) == (saved_at == "idle") and len(s.engine.saves) == saves + (saved_at == "switch")
    assert s.engine.held[0] == conv(B, 30)  # A is in no slot now
    fail.go.set()
    await s.drain()
    assert header(tmp_path, f"auto-{A}.bin") == conv(A, 60)
    assert s.counters.save_failures == 1
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".autosessd-")]
    r = await request(s, A, 60)
    assert r.restored is not None and r.restored["n_tokens"] == 60


async def test_a_finalize_whose_bytes_are_gone_is_given_up_and_the_slot_saves_again(tmp_path, monkeypatch):
    """The temporary removed behind autosessd's back (a person's rm) before its finalize: nothing
    to try again from. The Pending is dropped, and the slot, which still holds A, saves it again
    at the next switch (its file is missing, so not up to date)."""
    s = make(tmp_path)
    fail = FailOnce(monkeypatch, s.store, "finalize", FileNotFoundError(2, "No such file or directory"))
    await request(s, A, 60)
    [saved] = await s.idle.save_now()
    await fail.reached()
    (tmp_path / f".autosessd-{A}.partial").unlink()
    fail.go.set()
    await s.drain()
    assert not (tmp_path / f"auto-{A}.bin").exists() and s.counters.save_failures == 1
    r = await request(s, B, 30)
    assert r.saved is not None and r.saved["file"] == f"auto-{A}.bin"
    await s.drain()
    assert header(tmp_path, f"auto-{A}.bin") == conv(A, 60)


def files_holding(tmp_path, key):
    """Every auto file whose header holds conversation `key`'s tokens (whatever its name)."""
    out = []
    for p in tmp_path.glob("auto-*.bin"):
        tokens = header(tmp_path, p.name)
        if tokens and tokens[0] == TOKENS[key]:
            out.append(p.name)
    return out


async def stop_and_start(s, tmp_path):
    """The daemon's stop (save at stop, drain, close, held.json), then a new start on the same
    directories: → the new Sessions and the restore at start's plan."""
    from autosessd.modes.comeback import StartRestore

    await s.save_at_stop(0, "stop")
    await s.drain()
    await s.close()
    await s.last.record_stop(s.slots.values())
    s2 = make(tmp_path)
    await s2.prepare()
    return s2, StartRestore.plan(s2)


async def test_a_forgotten_conversation_stays_forgotten_across_a_switch_a_stop_and_a_start(tmp_path):
    """Item 3: X held on slot 0 and saved; `forget X`; a switch to Y, the stop, a new start: no
    file holds X's tokens anywhere, the slot and held.json dropped it, nothing is restored at
    the start, and the answer says what was done."""
    s = make(tmp_path)
    await request(s, A, 60)
    [saved] = await s.idle.save_now()
    await s.drain()
    assert files_holding(tmp_path, A) == [f"auto-{A}.bin"]
    done = await s.forget(A)
    assert done["files"] == [f"auto-{A}.bin"] and done["emptied_slots"] == [0]
    assert s.view(0).phase is Phase.EMPTY and s.engine.held[0] == []  # the engine's KV of it too
    assert s.counters.forgets == 1
    await request(s, B, 30)
    s2, plan = await stop_and_start(s, tmp_path)
    assert files_holding(tmp_path, A) == []
    assert all(key != A for _, key, _ in plan)
    held = json.loads((tmp_path / "state" / "held.json").read_text())
    assert all(e["key"] != A for e in held["slots"].values()), held


async def test_a_save_inside_the_engine_call_when_forget_runs_does_not_bring_it_back(tmp_path):
    """Item 3: the switch to Y is saving X (inside the engine call) when `forget X` comes: the
    save lands, and forget removes it after (it waits for the slot's turn and the finalizes)."""
    s = make(tmp_path)
    await request(s, A, 60)
    go, inside = asyncio.Event(), asyncio.Event()
    real = s.engine.save

    async def slow(slot, name):
        inside.set()
        await go.wait()
        return await real(slot, name)

    s.engine.save = slow
    switch = asyncio.ensure_future(request(s, B, 30))
    await asyncio.wait_for(inside.wait(), 5)
    forget = asyncio.ensure_future(s.forget(A))
    await asyncio.sleep(0.05)
    go.set()
    await asyncio.wait_for(switch, 5)
    done = await asyncio.wait_for(forget, 5)
    await s.drain()
    assert done["files"] == [f"auto-{A}.bin"]
    assert files_holding(tmp_path, A) == []
    r = await request(s, A, 10)  # a new request of X: a conversation like any other, nothing restored
    assert r.restored is None


class MarkedStub(StubEngine):
    """The stub whose state files carry its model's mark in their KV bytes: whose bytes a file
    holds, whatever its name and metadata say."""

    def __init__(self, directory, model, mark, **kw):
        super().__init__(directory, model=model, **kw)
        self.mark = mark

    async def save(self, slot, name):
        from autosessd.engines.base import SaveResult

        tokens = self.held[slot]
        data = slotfile.build(tokens, self.mark * (len(tokens) * 10))
        (self.dir / name).write_bytes(data)  # in place, as fopen("wb") does: the same inode
        self.saves.append(name)
        return SaveResult(len(tokens), len(data), 1.0)


async def test_two_models_behind_a_router_never_write_one_prefix_name(tmp_path, monkeypatch):
    """Item 4: two models of one tokenizer (two Sessions on one Store, each with its own Saver)
    read the same system prompt on its own. The first's finalize is held while the second saves:
    each model's prefix file holds that model's bytes under that model's metadata."""
    from autosessd.base.keys import conversation_key
    from tokens_common import body

    d = tmp_path / "sessions"
    d.mkdir()
    cfg = parse(f'slot_save_path = "{d}"\nauto_sessions_min_tokens = 60\nstate_dir = "{tmp_path / "state"}"\n'.encode())
    store = Store(d)
    s1 = Sessions(cfg, MarkedStub(d, "m1", b"1"), store, "m1")
    await s1.prepare()
    s2 = Sessions(cfg, MarkedStub(d, "m2", b"2"), store, "m2", house=s1.ctx, upkeep=s1.upkeep)
    go, calls, real = threading.Event(), [], Store.finalize

    def held_first(self_, key, meta, digest=None):
        calls.append(key)
        if len(calls) == 1:
            assert go.wait(10), "never let go"
        return real(self_, key, meta, digest)

    monkeypatch.setattr(Store, "finalize", held_first)
    system = "You are a careful assistant. Follow these rules. " * 8

    async def chat(s, task):
        b = body(("system", system), ("user", task))
        key = conversation_key(b)
        async with await s.admit() as t:
            turn = await s.turn(t, key, body=b)
            cache_n, n_prompt = s.engine.chat(b, "Aye.")
            await s.ended(t, key, "ok", cache_n=cache_n, n_prompt=n_prompt)
        return turn

    t1 = await chat(s1, "Task one.")
    assert t1.prefix is not None
    t2 = await chat(s2, "Task two.")
    go.set()
    await s1.drain()
    await s2.drain()
    prefixes = {}
    for p in d.glob("auto-*.bin"):
        meta = store.read_meta(p.name[5:21])
        if meta is not None and meta.prefix:
            prefixes[meta.model] = p.read_bytes()[-1:]
    assert prefixes == {"m1": b"1", "m2": b"2"}, prefixes
    assert t2.prefix is not None and t2.prefix["file"] != t1.prefix["file"]


async def test_an_engine_restarted_while_a_restore_waits_is_not_handed_the_file(tmp_path, monkeypatch):
    """Item 5: the file was chosen, then the restore waited (here: its check, which may read
    the whole file); meanwhile the engine restarted, maybe with another model. The file is not
    handed to the new engine: chosen again at the next request, under its facts."""
    s = make(tmp_path)
    await request(s, A, 60)
    await request(s, B, 30)
    await s.drain()
    real = s.restorer._refused

    async def refused(*a, **kw):
        why = await real(*a, **kw)
        await s.engine_restarted("the engine restarted (another model?)")
        return why

    monkeypatch.setattr(s.restorer, "_refused", refused)
    asked = []
    restore = s.engine.restore
    monkeypatch.setattr(s.engine, "restore", lambda slot, name: asked.append(name) or restore(slot, name))
    r = await request(s, A, 60)
    assert asked == [] and r.restored is None
    assert any("restarted" in x for x in r.skipped), r.skipped


def save_again_by_hand(s, tmp_path, key, n):
    """A save of `key` landing now, as a finalize makes it (in the calling thread)."""
    import dataclasses

    from autosessd.store.names import Meta

    data = slotfile.build(conv(key, n), b"\0" * (n * 10))
    (tmp_path / f".autosessd-{key}.partial").write_bytes(data)
    meta = Meta(key=key, n_tokens=n, bytes=len(data), saved_at=__import__("time").time(), model="stub-model",
                save_ms=1.0, line=key)
    meta = s.store.finalize(key, meta)
    s.index.add(f"auto-{key}.bin", conv(key, n), meta.model)
    return dataclasses.replace(meta)


@pytest.mark.parametrize("when", ["after the removal", "between the plan and the removal"])
async def test_prune_never_drops_a_save_made_while_it_ran(tmp_path, monkeypatch, when):
    """Item 6: a prune runs in a thread; A, planned for removal as the oldest, is saved again
    meanwhile. Saved again after its removal: its new file keeps its index entry (the prune
    removes the entry of the file it removed, by its inode). Saved again between the plan and
    the removal: the new file is not removed."""
    from autosessd.store import directory

    s = make(tmp_path)
    await s.prepare()
    await request(s, A, 60)
    await request(s, B, 30)
    await request(s, C, 40)  # B saved; the slot holds C
    await s.drain()
    name = f"auto-{A}.bin"
    if when == "after the removal":
        real = s.store.prune

        def prune(*a, **kw):
            plan = real(*a, **kw)
            assert name in [e.name for e in plan.remove]
            save_again_by_hand(s, tmp_path, A, 70)
            return plan

        monkeypatch.setattr(s.store, "prune", prune)
    else:
        real_plan = directory.plan_prune

        def plan_prune(*a, **kw):
            plan = real_plan(*a, **kw)
            assert name in [e.name for e in plan.remove]
            save_again_by_hand(s, tmp_path, A, 70)
            return plan

        monkeypatch.setattr(directory, "plan_prune", plan_prune)
    await s.prune(keep=1)
    assert header(tmp_path, name) == conv(A, 70)
    assert s.index.get(name) is not None and s.index.get(name).n_tokens == 70


# -- item 7: the minor ones ------------------------------------------------------------------------
async def test_park_answers_once_the_file_it_names_is_on_disk_even_a_branch(tmp_path, monkeypatch):
    """park names the file the save went to (here a branch: another conversation of the same
    first message holds auto-K.bin) and answers only once that file is final."""
    from tokens_common import X, Y, chat, make as make_tokens

    s = await make_tokens(tmp_path)
    await chat(s, X)
    await chat(s, Y)  # X saved as auto-K.bin; the slot holds Y, of the same first message
    go, real = threading.Event(), Store.finalize

    def held_finalize(self_, key, meta, digest=None):
        assert go.wait(10)
        return real(self_, key, meta, digest)

    monkeypatch.setattr(Store, "finalize", held_finalize)
    threading.Timer(0.3, go.set).start()
    saved = await s.park()
    assert saved["file"] != f"auto-{s.view().key}.bin"  # a branch's name
    assert (s.store.path / saved["file"]).exists() and s.store.read_meta(saved["file"][5:21]) is not None


async def test_restore_by_key_of_a_save_still_being_finalized(tmp_path):
    """`autosessctl restore KEY` of a conversation whose save is finalizing restores it (its
    temporary, as a turn does), instead of answering that there is no such session."""
    s = make(tmp_path)
    await request(s, A, 60)
    go, real = threading.Event(), s.store.finalize

    def held_finalize(key, meta, digest=None):
        assert go.wait(10)
        return real(key, meta, digest)

    s.store.finalize = held_finalize
    [saved] = await s.idle.save_now()
    try:
        await request(s, B, 30)
        done = await s.restore_now(A)
    finally:
        go.set()
    assert done["file"] == f"auto-{A}.bin" and s.engine.held[0] == conv(A, 60)
    await s.drain()


async def test_behind_a_router_the_warming_bound_is_the_houses(tmp_path, monkeypatch):
    """Two models' Sessions share one record of what was warmed lately: a file one model warmed
    counts against the memory bound when the other warms another."""
    import psutil

    from autosessd.sessions import warm

    d = tmp_path
    store = Store(d)
    cfg = parse(f'slot_save_path = "{d}"\nstate_dir = "{tmp_path / "state"}"\n'.encode())
    s1 = Sessions(cfg, StubEngine(d, model="m1"), store, "m1")
    s2 = Sessions(cfg, StubEngine(d, model="m2"), store, "m2", house=s1.ctx, upkeep=s1.upkeep)
    (d / "auto-1111111111111111.bin").write_bytes(b"x" * 1000)
    (d / "auto-2222222222222222.bin").write_bytes(b"x" * 1000)
    avail = type("VM", (), {"available": int(1500 / warm.MEMORY_SHARE)})()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: avail)
    assert s1.warmer.warm("auto-1111111111111111.bin")
    assert not s2.warmer.warm("auto-2222222222222222.bin")  # 2,000 bytes would not fit in 1,500
    assert s1.counters.warm_skipped_memory == 1
