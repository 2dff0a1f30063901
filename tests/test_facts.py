"""The engine's facts read again after a restart (facts.py), on the stub engine: a file saved
for the model the engine ran before is never restored into the one it runs now, and nothing
is saved or restored while the engine's facts are not known. (The real engine restarted with
another model and another template: test_engine_change_real.py.)"""

import logging

import pytest

from autosessd import facts
from autosessd.ctl import show_status
from autosessd.engines.base import EngineUnreachable
from autosessd.store import StoreError
from test_sessions import A, B, conv, file_tokens, make, request


async def test_a_restart_with_another_model_restores_none_of_the_old_models_files(tmp_path, caplog):
    s = make(tmp_path)
    await request(s, A, 50)
    await request(s, B, 40)  # A saved, for stub-model
    assert file_tokens(tmp_path, A) == conv(A, 50)
    s.engine.model = "other-model"  # the engine came back with another -m
    s.engine.held[0] = []
    caplog.set_level(logging.INFO, "autosessd")
    await s.engine_restarted("test: restarted")
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
    s = make(tmp_path)
    await request(s, A, 50)
    await request(s, B, 40)
    s.engine.held[0] = []
    await s.engine_restarted("test: restarted")
    turn = await request(s, A, 60)
    assert turn.restored is not None and s.counters.engine_changes == 0
    assert not [e for e in s.events.recent if e["type"] == "engine_changed"]


async def test_nothing_is_saved_or_restored_until_the_restarted_engine_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(facts, "RETRY_S", 0.0)
    s = make(tmp_path)
    await request(s, A, 50)
    await request(s, B, 40)
    s.engine.held[0] = []
    await s.engine_restarted("test: restarted")
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
    s = make(tmp_path)
    await request(s, A, 50)
    await request(s, B, 40)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    real = s.engine.dir
    s.engine.dir = elsewhere  # restarted with another --slot-save-path
    s.engine.held[0] = []
    caplog.set_level(logging.WARNING, "autosessd")
    await s.engine_restarted("test: restarted")
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
    s = make(tmp_path)
    await request(s, A, 50)
    await request(s, B, 40)
    s.engine.model = "other-model"
    s.engine.held[0] = []
    await s.engine_restarted("test: restarted")

    async def no_request_meanwhile():
        return None

    with pytest.raises(StoreError, match="saved for another model"):
        await s.restore_now(A)
    await s.engine_restarted("test: restarted again")
    assert not await s.restore_behind(0, A, no_request_meanwhile)  # the tail's restore after a restart
    assert s.counters.restores == 0 and s.engine.held[0] == []
