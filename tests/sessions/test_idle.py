"""Saving while the engine is idle (issue 23, idle.py), on the stub engine: after a reply and a
pause the conversation is saved, so the switch that comes later only restores; never while a
request holds or waits for the slot; at most one save per pause; the cap on bytes per minute."""

import asyncio
import time

import pytest

import test_sessions_tokens as t
from autosessd.base.config import ConfigError, parse
from autosessd.base.keys import conversation_key
from autosessd.sessions.facade import Sessions
from autosessd.store.directory import Store
from stub_engine import StubEngine

A = t.body(("user", "Tell me of the sea. " + t.LONG_1))
B = t.body(("user", "Tell me of the law. " + t.LONG_2))
GROWN_A = {**A, "messages": A["messages"] + [{"role": "assistant", "content": "Aye."},
                                             {"role": "user", "content": "More of it."}]}
PAUSE = 0.05


async def make(tmp_path, idle_s=PAUSE, mb_per_min=4096.0, min_new=1, n_slots=1, switched_s=0):
    """switched_s: idle_save_switched_s; 0 (every reply's pause saves) for the tests of the other
    bounds, the default's own test below."""
    d = tmp_path / "sessions"
    d.mkdir(parents=True, exist_ok=True)
    cfg = parse(f'slot_save_path = "{d}"\nauto_sessions_min_tokens = {t.MIN}\nstate_dir = "{tmp_path / "state"}"\n'
                f'idle_save_s = {idle_s}\nidle_save_mb_per_min = {mb_per_min}\n'
                f'idle_save_min_new_tokens = {min_new}\nidle_save_switched_s = {switched_s}\n'.encode())
    s = Sessions(cfg, StubEngine(d, n_slots=n_slots), Store(d), "stub-model", n_slots=n_slots)
    await s.prepare()
    return s


async def until(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_after_a_pause_the_conversation_is_saved_and_the_switch_only_restores(tmp_path):
    s = await make(tmp_path)
    await t.chat(s, A)
    await t.chat(s, B)  # A saved at the switch (no pause between): the usual way
    await until(lambda: s.counters.idle_saves == 1)  # B, in the pause after its reply
    await s.drain()
    saves = s.counters.saves
    turn, cache_n, n_prompt = await t.chat(s, GROWN_A)
    assert turn.saved is None and turn.restored["file"] == f"auto-{conversation_key(A)}.bin"
    assert s.counters.saves == saves and cache_n == len(t.prompt(A)) + len("Aye.")
    assert s.counters.bytes_saved_idle == s.store.read_meta(conversation_key(B)).bytes
    # A grew: the next pause saves it, once.
    await until(lambda: s.counters.idle_saves == 2)
    await asyncio.sleep(PAUSE * 4)
    assert s.counters.idle_saves == 2
    turn, _, _ = await t.chat(s, B)
    assert turn.saved is None and turn.restored is not None
    assert s.status()["idle_save"]["on"]


async def test_no_save_while_a_request_holds_or_waits_for_the_slot(tmp_path):
    s = await make(tmp_path)
    await t.chat(s, A)
    async with await s.admit():  # a request runs past the pause
        await asyncio.sleep(PAUSE * 4)
        assert s.counters.idle_saves == 0 and s.engine.saves == []
    await asyncio.sleep(PAUSE * 4)
    assert s.counters.idle_saves == 0  # that pause gave way; the next reply brings the next one


async def test_the_cap_on_bytes_per_minute_defers_a_save(tmp_path):
    s = await make(tmp_path, mb_per_min=0.002, n_slots=2)  # 2 kB a minute: one stub file of ~4 kB
    for b in (A, B):
        key = conversation_key(b)
        async with await s.place(key) as tk:
            await s.turn(tk, key, body=b)
            cache_n, n_prompt = s.engine.chat(b, "Aye.") if tk.slot_id == 0 else (0, 0)
            if tk.slot_id == 1:
                s.engine.ran(t.prompt(b) + [ord(c) for c in "Aye."], 1)
            await s.ended(tk, key, "ok", cache_n=cache_n, n_prompt=n_prompt)
    await until(lambda: s.counters.idle_saves == 1 and s.counters.idle_saves_deferred >= 1)
    await asyncio.sleep(PAUSE * 4)
    assert s.counters.idle_saves == 1  # the other waits for the minute to pass
    # Saved now (an engine about to sleep): without the cap.
    out = await s.save_idle_now()
    assert [bool(r["saved"]) for r in out].count(True) == 1 and s.counters.idle_saves == 2
    await s.close()


async def test_save_now_saves_every_idle_slot_without_waiting_for_a_pause(tmp_path):
    s = await make(tmp_path, idle_s=3600, n_slots=2)
    await t.chat(s, A)
    out = await s.save_idle_now()
    assert out[0]["saved"]["file"] == f"auto-{conversation_key(A)}.bin" and out[1]["saved"] is None
    assert (await s.save_idle_now())[0]["saved"] is None  # up to date now
    await s.close()


async def test_a_small_growth_is_left_to_the_switch(tmp_path):
    s = await make(tmp_path, min_new=1000)
    await t.chat(s, A)
    await until(lambda: s.counters.idle_saves == 1)  # no file yet: saved whatever it gained
    await t.chat(s, GROWN_A)
    await asyncio.sleep(PAUSE * 4)
    assert s.counters.idle_saves == 1
    turn, _, _ = await t.chat(s, B)
    assert turn.saved is not None  # the switch saves what the pause left


def test_idle_save_keys_are_checked():
    for text, key in (("idle_save_s = -1", "idle_save_s"), ("idle_save_mb_per_min = 0", "idle_save_mb_per_min"),
                      ("idle_save_min_new_tokens = 0", "idle_save_min_new_tokens"),
                      ('idle_save_s = "soon"', "idle_save_s"), ("idle_save_switched_s = -5", "idle_save_switched_s")):
        with pytest.raises(ConfigError) as e:
            parse(f'slot_save_path = "/tmp/x"\n{text}\n'.encode())
        assert e.value.key == key
    assert parse(b'slot_save_path = "/tmp/x"\nidle_save_s = 0\n').idle_save_s == 0


async def test_no_save_while_another_slot_runs_a_request(tmp_path):
    """llama-server writes a save on its main loop: every slot's generation stops meanwhile. So
    a pause that ends while another slot runs a request waits for that slot to be free."""
    s = await make(tmp_path, n_slots=2)
    await t.chat(s, A)  # on slot 0
    other = await s.admit(1)  # a request runs on slot 1 past slot 0's pause
    await asyncio.sleep(PAUSE * 6)
    assert s.counters.idle_saves == 0 and s.engine.saves == []
    other.release()
    await until(lambda: s.counters.idle_saves == 1)


async def test_one_conversation_alone_is_not_saved_while_idle_until_its_slot_switches(tmp_path):
    """idle_save_switched_s (the default, 30 min): a conversation going on alone on its slot is
    never switched away, so its pauses write nothing (at 8B sizes a whole state a turn); once the
    slot has switched conversations, every pause saves as before."""
    s = await make(tmp_path, switched_s=1800)
    await t.chat(s, A)
    await until(lambda: s.counters.idle_saves_alone == 1)
    await t.chat(s, GROWN_A)
    await until(lambda: s.counters.idle_saves_alone == 2)
    assert s.counters.idle_saves == 0 and s.engine.saves == [] and s.status()["idle_save"]["switching_slots"] == []
    turn, _, _ = await t.chat(s, B)  # the first switch saves A at the switch
    assert turn.saved is not None and turn.saved["key"] == conversation_key(A)
    await until(lambda: s.counters.idle_saves == 1)  # B's pause: the slot switched
    assert s.status()["idle_save"]["switching_slots"] == [0]
    await s.drain()
    turn, _, _ = await t.chat(s, {**GROWN_A, "messages": GROWN_A["messages"] + [
        {"role": "assistant", "content": "Aye."}, {"role": "user", "content": "And then?"}]})
    assert turn.saved is None and turn.restored is not None  # B's file was up to date
