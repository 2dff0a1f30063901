"""The engine's facts read again after a restart (facts.py), on the stub engine: a file saved
for the model the engine ran before is never restored into the one it runs now, and nothing
is saved or restored while the engine's facts are not known. (The real engine restarted with
another model and another template: test_engine_change_real.py.)"""

import asyncio
import logging

import pytest

from autosessd.sessions import facts
from autosessd.store import slotfile
from autosessd.base.config import parse
from autosessd.engines.base import SaveResult
from autosessd.sessions.facade import Sessions
from autosessd.store.slotfile import KVLayout
from autosessd.store.directory import Store
from stub_engine import StubEngine
from autosessd.ctl_text import show_status
from autosessd.engines.base import EngineRefused, EngineUnreachable
from autosessd.store.directory import StoreError
from test_recall import OTHER, grown
from test_sessions import A, B, C, conv, file_tokens, make, request
import test_sessions_tokens as tokens


async def restarted(tmp_path, model: str | None = None, directory=None, why: str = "test: restarted"):
    """A saved for stub-model (B's switch saved it), then the engine restarted, its slot empty:
    with another -m (model), or saving into another directory."""
    s = make(tmp_path)
    await request(s, A, 50)
    await request(s, B, 40)
    s.engine.model = model or s.engine.model
    s.engine.dir = directory or s.engine.dir
    s.engine.held[0] = []
    await s.engine_restarted(why)
    return s


async def test_a_restart_with_another_model_restores_none_of_the_old_models_files(tmp_path, caplog):
    caplog.set_level(logging.INFO, "autosessd")
    s = await restarted(tmp_path, model="other-model")  # the engine came back with another -m
    assert file_tokens(tmp_path, A) == conv(A, 50)
    turn = await request(s, A, 60)
    assert turn.restored is None and s.counters.restores == 0
    assert s.model == "other-model" and s.counters.engine_changes == 1
    assert [e["model"] for e in s.events.recent if e["type"] == "engine_changed"] == [["stub-model", "other-model"]]
    assert "restarted with another model stub-model → other-model" in caplog.text
    # What it saves now is of the new model, and a return to it is restored as always.
    await request(s, B, 40)
    assert s.store.read_meta(A).model == "other-model"
    turn = await request(s, A, 70)
    assert turn.restored is not None and s.counters.restores == 1


async def test_a_restart_with_the_same_facts_changes_nothing(tmp_path):
    s = await restarted(tmp_path)
    turn = await request(s, A, 60)
    assert turn.restored is not None and s.counters.engine_changes == 0
    assert not [e for e in s.events.recent if e["type"] == "engine_changed"]


async def test_nothing_is_saved_or_restored_until_the_restarted_engine_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(facts, "RETRY_S", 0.0)
    s = await restarted(tmp_path)
    info = s.engine.info

    async def loading():
        raise EngineUnreachable("503: loading model")

    s.engine.info = loading
    turn = await request(s, A, 60)
    assert turn.restored is None and any("not known since its restart" in w for w in turn.skipped)
    saves = list(s.engine.saves)
    turn = await request(s, B, 40)  # A held, 60 tokens: not saved under facts not known
    assert s.engine.saves == saves and file_tokens(tmp_path, A) == conv(A, 50)
    s.engine.info = info
    turn = await request(s, A, 70)
    assert turn.restored is not None and file_tokens(tmp_path, A) == conv(A, 50)


async def test_an_engine_that_no_longer_saves_here_gets_no_file_until_its_next_restart(tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    caplog.set_level(logging.WARNING, "autosessd")
    s = await restarted(tmp_path, directory=elsewhere)  # restarted with another --slot-save-path
    real = tmp_path
    turn = await request(s, A, 60)
    assert turn.restored is None and s.counters.restores == 0
    assert "saves its sessions somewhere other than" in caplog.text
    assert "nothing is saved or restored until the engine restarts again" in caplog.text
    assert not list(elsewhere.glob("auto-*"))
    st = s.status()
    assert "somewhere other than" in st["engine"]["saving_off"]
    assert "warning   no saves or restores: since its restart, the engine saves" in show_status(st)
    s.engine.dir = real
    s.engine.held[0] = []
    await s.engine_restarted("test: restarted again")
    turn = await request(s, A, 70)
    assert turn.restored is not None and s.status()["engine"]["saving_off"] is None


async def test_the_tails_restore_and_autosessctl_restore_after_a_restart_decide_under_the_new_model(tmp_path):
    s = await restarted(tmp_path, model="other-model")

    async def no_request_meanwhile():
        return None

    with pytest.raises(StoreError, match="saved for another model"):
        await s.restore_now(A)
    s.engine.model = "third-model"
    await s.engine_restarted("test: restarted again")  # the tail's restore is the first call after it
    assert not await s.restore_behind(0, A, no_request_meanwhile)
    assert s.counters.restores == 0 and s.engine.held[0] == [] and s.model == "third-model"


@pytest.mark.parametrize("read_meanwhile", [False, True])
async def test_a_restart_seen_while_a_turn_runs_restores_nothing_it_chose_before(tmp_path, read_meanwhile):
    """The turn chose X's file by its messages under stub-model; the watch reports a restart
    (another -m) while the turn saves, and maybe another slot's turn reads the new engine's
    facts meanwhile. What it chose is not restored into the new engine."""
    s = await tokens.make(tmp_path)
    await tokens.chat(s, tokens.X)
    await tokens.chat(s, OTHER)  # X saved with its marks, for stub-model
    real, fired = s.saver.save_if_worth, []

    async def save_if_worth(slot, *a, **kw):
        if not fired:
            fired.append(1)
            s.engine.model = "other-model"
            s.engine.held[0] = []
            await s.engine_restarted("test: restarted mid-turn")
            if read_meanwhile:
                assert await s.ctx.facts.fresh(slot.id) and s.ctx.facts.usable
        return await real(slot, *a, **kw)

    s.saver.save_if_worth = save_if_worth
    turn, _, _ = await tokens.chat(s, grown(tokens.X))
    assert fired and turn.restored is None
    assert any("restarted while it was chosen" in w for w in turn.skipped)


async def test_a_restart_while_the_facts_are_read_has_them_read_again(tmp_path):
    s = await restarted(tmp_path, why="test: first")
    real = s.engine.save

    async def save(slot, name):
        if "probe" in name and s.engine.model != "m2":  # the engine restarts again, with another -m
            s.engine.model = "m2"
            s.engine.held[0] = []
            await s.engine_restarted("test: second")
        return await real(slot, name)

    s.engine.save = save
    turn = await request(s, A, 60)
    assert s.model == "m2" and turn.restored is None and s.counters.engine_changes == 1


async def test_a_save_that_comes_first_after_a_restart_checks_the_directory(tmp_path):
    """The tail's save behind (or a save while idle) can be the first call after a restart:
    a file that does not land here turns saving and restoring off, as the probe would."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    s = await restarted(tmp_path, directory=elsewhere)
    s.observed_start(0, C)  # the tail: C runs and ends on the restarted engine
    s.engine.ran(conv(C, 30))
    await s.observed_end(0, C, "ok", 30)

    async def nothing_ran_meanwhile(_st):
        return None

    assert not await s.save_behind(0, nothing_ran_meanwhile)
    assert "somewhere other than" in (s.ctx.facts.off or "")
    turn = await request(s, A, 60)
    assert turn.restored is None and s.ctx.suspect is None and s.counters.restore_failures == 0


async def test_two_models_read_their_facts_at_once_each_with_its_own_probe(tmp_path):
    """Behind a router each model's Sessions probes after a restart, maybe at the same moment."""

    class Slow(StubEngine):
        async def save(self, slot, name):
            data = slotfile.build(self.held[slot], b"\0" * (len(self.held[slot]) * 10))
            (self.dir / name).write_bytes(data)
            await asyncio.sleep(0.01)
            return SaveResult(len(self.held[slot]), len(data), 1.0)

    cfg = parse(f'slot_save_path = "{tmp_path}"\nauto_sessions_min_tokens = 10\nstate_dir = "{tmp_path}-state"\n'.encode())
    both = [Sessions(cfg, Slow(tmp_path, model=m), Store(tmp_path), m) for m in ("m1", "m2")]
    for s in both:
        await s.engine_restarted("test: the router restarted")
    assert await asyncio.gather(*(s.ctx.facts.fresh(0) for s in both)) == [True, True]
    assert [s.ctx.facts.off for s in both] == [None, None]


async def test_the_layout_after_a_restart_is_the_new_engines(tmp_path, monkeypatch):
    """Restarted with -fa toggled: V is stored otherwise, which an empty slot's probe cannot
    show. The first save teaches it; from then on files of the old layout are not restored,
    and the engine's own new ones are (they used to be refused as another layout for good)."""
    layout = [KVLayout(1, 1, 24, 1)]  # flash attention off: V transposed
    read = slotfile.read_layout
    monkeypatch.setattr(slotfile, "read_layout",
                        lambda path: read(path) if slotfile.read_header(path).n_tokens == 0 else layout[0])
    s = make(tmp_path)
    await request(s, A, 50)
    await request(s, C, 45)
    await request(s, B, 40)  # A and C saved, V transposed
    layout[0] = KVLayout(1, 0, 24, 1)  # restarted with -fa on
    s.engine.held[0] = []
    await s.engine_restarted("test: restarted")
    await request(s, A, 60)
    await request(s, B, 41)  # A saved by the new engine
    assert s.ctx.engine_layout == KVLayout(1, 0, 24, 1) and s.store.read_meta(A).layout == "s1-v0-l24-k1"
    assert (await request(s, A, 70)).restored is not None
    assert (await request(s, C, 50)).restored is None  # the old layout: never handed to the new engine


def layouts(monkeypatch, now: list[KVLayout]) -> None:
    """The stub's files read as the KV layout now[0] (its streams alone for an empty slot)."""
    monkeypatch.setattr(slotfile, "read_layout", lambda path: now[0] if slotfile.read_header(path).n_tokens
                        else KVLayout(now[0].n_stream))


async def test_after_a_restart_with_other_kv_streams_an_empty_save_first_is_no_probe(tmp_path, monkeypatch):
    """-np 1 → -np 4 (one KV stream → four). A save that finds the slot empty (park on the
    restarted engine) lands here but shows no layout: the next restore still probes first, and
    the old engine's one-stream file is not handed to the four-stream one (it would refuse it
    after reading part of it)."""
    now = [KVLayout(1, 1, 24, 1)]
    layouts(monkeypatch, now)
    s = make(tmp_path)
    await request(s, A, 50)
    await request(s, B, 40)
    now[0] = KVLayout(4, 1, 24, 1)
    s.engine.held[0] = []
    await s.engine_restarted("test: restarted")
    with pytest.raises(StoreError, match="empty"):
        await s.park(0, "mine")
    turn = await request(s, A, 60)
    assert any("probe" in name for name in s.engine.saves[-3:])
    assert turn.restored is None and s.ctx.engine_layout.n_stream == 4 and s.counters.engine_changes == 1


async def test_a_refused_probe_is_asked_again_later_not_taken_for_good(tmp_path, monkeypatch):
    """A probe refused by a full disk or a 5xx is a passing trouble: nothing is restored then,
    and once the engine takes the probe again, all is as before."""
    monkeypatch.setattr(facts, "REFUSED_S", 0.0)
    s = await restarted(tmp_path)
    real = s.engine.save

    async def full(slot, name):
        if "probe" in name:
            raise EngineRefused("POST /slots answered 500: failed to save: No space left on device")
        return await real(slot, name)

    s.engine.save = full
    turn = await request(s, A, 60)
    assert turn.restored is None and s.ctx.facts.off is None
    s.engine.save = real
    s.engine.held[0] = []
    turn = await request(s, A, 60)
    assert turn.restored is not None


async def test_a_save_made_across_a_restart_keeps_the_model_it_was_made_for(tmp_path):
    """The facts of the new engine read while an old engine's save was under way (another
    slot's turn): the file and its index entry are the old model's."""
    s = make(tmp_path)
    await s.prepare()  # the token index
    await request(s, A, 50)
    real = s.engine.save

    async def save(slot, name):
        res = await real(slot, name)
        if "probe" not in name and s.engine.model == "stub-model":
            s.engine.model = "other-model"
            await s.engine_restarted("test: restarted during a save")
            assert await s.ctx.facts.fresh(slot, probe=False)
        return res

    s.engine.save = save
    await request(s, B, 40)  # A saved: its bytes are stub-model's
    assert s.store.read_meta(A).model == "stub-model" and s.index.get(f"auto-{A}.bin").model == "stub-model"


async def test_a_new_model_empties_the_buckets_catalog(tmp_path):
    s = await restarted(tmp_path, model="other-model")
    told = []

    class Bucket:
        def engine_changed(self, model, max_tokens):
            told.append((model, max_tokens))

    s.ctx.remote = Bucket()
    assert await s.ctx.facts.fresh(0)
    assert told == [("other-model", s.ctx.max_tokens)]


async def test_autosessctl_restore_looks_before_it_probes(tmp_path):
    """A request that bypassed autosessd runs on the slot: llama-server would defer a probe save
    until it ends, holding up every other slot's turn on the facts' read."""
    s = await restarted(tmp_path)
    s.engine.processing = True
    saves = list(s.engine.saves)
    with pytest.raises(StoreError, match="did not come through autosessd"):
        await s.restore_now(A)
    assert s.engine.saves == saves


async def test_the_tails_restore_right_after_a_failed_read_asks_again(tmp_path):
    """A turn while the engine loaded its model failed to read its facts (retried after
    RETRY_S); the tail's restore once /health is up asks at once."""
    s = await restarted(tmp_path)
    info = s.engine.info

    async def loading():
        raise EngineRefused("GET /props answered 503: Loading model")

    s.engine.info = loading
    assert (await request(s, C, 20)).restored is None
    s.engine.info = info
    s.engine.held[0] = []
    s.observer.lost(s.slot(0), "test: the tail's look")

    async def no_request_meanwhile():
        return None

    assert await s.restore_behind(0, A, no_request_meanwhile)


async def test_a_turn_waits_a_bounded_time_for_another_slots_read(tmp_path, monkeypatch):
    """The probe runs on the reader's own slot; the engine may take its time. Another slot's
    turn does not wait for it past LOCK_WAIT_S: its request runs as without autosessd."""
    monkeypatch.setattr(facts, "LOCK_WAIT_S", 0.05)
    s = make(tmp_path, n_slots=2)
    await s.engine_restarted("test: restarted")
    release = asyncio.Event()
    real = s.engine.save

    async def slow(slot, name):
        if "probe" in name:
            await release.wait()
        return await real(slot, name)

    s.engine.save = slow
    first = asyncio.ensure_future(s.ctx.facts.fresh(0))
    await asyncio.sleep(0.01)
    assert await asyncio.wait_for(s.ctx.facts.fresh(1), 1) is False
    release.set()
    assert await first is True


async def test_what_an_old_engines_probe_said_is_not_taken_for_the_new_ones(tmp_path):
    """The probe went to the engine that saved elsewhere; before its answer that engine was
    replaced by one saving here. Saving is not turned off for the new one."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    s = await restarted(tmp_path, directory=elsewhere)
    real, fired = s.engine.save, []

    async def save(slot, name):
        res = await real(slot, name)
        if "probe" in name and not fired:
            fired.append(1)
            s.engine.dir = tmp_path
            await s.engine_restarted("test: restarted again, with the right directory")
        return res

    s.engine.save = save
    turn = await request(s, A, 60)
    assert fired and s.ctx.facts.off is None and turn.restored is not None


async def test_the_tails_restore_looks_before_it_probes(tmp_path):
    """As autosessctl restore: a request that bypassed autosessd runs on the slot, and a probe
    save there would wait for it, holding the facts' read for every other slot."""
    s = await restarted(tmp_path)
    s.engine.processing = True
    saves = list(s.engine.saves)

    async def no_request_meanwhile():
        return None

    assert not await s.restore_behind(0, A, no_request_meanwhile)
    assert s.engine.saves == saves
