"""Several engine slots (issue 12) on the stub engine: where a request is placed, what is saved
and restored, FIFOs per slot, making room, and an engine that empties idle slots.
The real engine with -np 4 and -np auto is in test_slots_real.py."""

import asyncio

from autosessd.store import slotfile
from autosessd.sessions.launch import Hold, LaunchGate
from autosessd.sessions.slot import Phase
from slots_common import A, B, C, D, E, conv, file_tokens, make, request


async def test_each_conversation_keeps_its_slot(tmp_path):
    s = make(tmp_path)
    slot_a, _ = await request(s, A, 50)
    slot_b, _ = await request(s, B, 40)
    assert slot_a != slot_b
    again, turn = await request(s, A, 60)
    assert again == slot_a and turn.saved is None and turn.restored is None
    assert not list(tmp_path.glob("auto-*"))


async def test_a_third_conversation_takes_the_least_recently_used_slot_saving_its_occupant(tmp_path):
    s = make(tmp_path)
    slot_a, _ = await request(s, A, 50)
    slot_b, _ = await request(s, B, 40)
    await request(s, B, 45)
    slot_c, turn = await request(s, C, 30)
    assert slot_c == slot_a and turn.saved["key"] == A  # A was used least recently
    assert file_tokens(tmp_path, A) == conv(A, 50)
    slot_a2, turn = await request(s, A, 55)
    assert slot_a2 == slot_b and turn.saved["key"] == B and turn.restored["key"] == A
    assert file_tokens(tmp_path, B) == conv(B, 45)


async def test_one_conversation_never_runs_on_two_slots(tmp_path):
    s = make(tmp_path)
    await request(s, A, 50)
    first = await s.place(A)
    second = asyncio.ensure_future(s.place(A))
    other = await asyncio.wait_for(s.place(B), 1)  # a free slot is not held back for A
    await asyncio.sleep(0.01)
    assert not second.done()  # A's second request waits for A's slot
    first.release()
    t = await asyncio.wait_for(second, 1)
    assert t.slot_id == first.slot_id and other.slot_id != first.slot_id
    t.release()
    other.release()


async def test_requests_on_different_slots_hold_their_tickets_at_once(tmp_path):
    s = make(tmp_path, n_slots=4)
    tickets = [await asyncio.wait_for(s.place(k), 1) for k in (A, B, C, D)]
    assert sorted(t.slot_id for t in tickets) == [0, 1, 2, 3]
    late = asyncio.ensure_future(s.place(E))
    await asyncio.sleep(0.01)
    assert not late.done()
    tickets[2].release()
    assert (await asyncio.wait_for(late, 1)).slot_id == tickets[2].slot_id


async def test_a_request_without_a_conversation_does_not_displace_a_long_one_while_a_slot_is_free(tmp_path):
    s = make(tmp_path, n_slots=3)
    slot_a, _ = await request(s, A, 500)
    slot_b, _ = await request(s, B, 5)  # below min tokens: nothing worth keeping
    for _ in range(3):
        slot, turn = await request(s, None, 30)
        assert slot != slot_a and turn.saved is None
    assert s.view(slot_a).key == A and s.view(slot_a).phase is Phase.HELD


async def test_a_restore_without_kv_room_empties_the_least_recently_used_idle_slot_and_retries(tmp_path):
    s = make(tmp_path, n_slots=3)
    await request(s, A, 50)
    slot_b, _ = await request(s, B, 40)
    await request(s, C, 30)
    await request(s, D, 20)  # takes A's slot: A saved
    s.engine.no_room = True  # the unified cache is full: the engine never evicts by itself
    slot_a, turn = await request(s, A, 60)
    assert turn.restored is not None and turn.restored["key"] == A and not turn.errors
    assert s.engine.erased and s.engine.erased[0] != slot_a
    emptied = s.engine.erased[0]
    assert s.view(emptied).phase is Phase.EMPTY


async def test_an_engine_that_empties_idle_slots_is_noticed_and_ends_are_saved(tmp_path):
    """llama-server's defaults for -np auto (unified KV, --cache-idle-slots): a request starting
    on one slot empties the idle others. autosessd notices, then saves each conversation when
    its request ends, so a return restores the whole conversation."""
    s = make(tmp_path, clears_idle=True)
    slot_a, _ = await request(s, A, 50)
    await request(s, B, 40)  # empties A's slot: A was never saved
    slot_a2, turn = await request(s, A, 60)
    assert s.launch.empties_idle and turn.restored is None and s.counters.engine_resets >= 1
    await request(s, B, 45)
    assert file_tokens(tmp_path, A) == conv(A, 60) and file_tokens(tmp_path, B) == conv(B, 45)
    _, turn = await request(s, A, 70)
    assert turn.restored is not None and turn.restored["n_tokens"] == 60


async def test_stop_saves_every_slot(tmp_path):
    s = make(tmp_path, n_slots=3)
    for key, n in ((A, 50), (B, 40), (C, 30)):
        await request(s, key, n)
    for sid in s.slots:
        await s.save_at_stop(sid, "stop")
    for key, n in ((A, 50), (B, 40), (C, 30)):
        assert file_tokens(tmp_path, key) == conv(key, n)


async def test_launch_gate_lets_starts_run_side_by_side_and_keeps_them_out_of_exclusive_work():
    g = LaunchGate()
    await g.acquire(Hold.SIDE_BY_SIDE)
    await asyncio.wait_for(g.acquire(Hold.SIDE_BY_SIDE), 1)  # two starts in flight at once
    save = asyncio.ensure_future(g.acquire(Hold.NO_STARTS))
    await asyncio.sleep(0.01)
    assert not save.done()  # an end save waits for the starts in flight to be seen running
    late = asyncio.ensure_future(g.acquire(Hold.SIDE_BY_SIDE))
    await asyncio.sleep(0.01)
    g.release(Hold.SIDE_BY_SIDE)
    g.release(Hold.SIDE_BY_SIDE)
    await asyncio.wait_for(save, 1)
    assert not late.done()  # no start is sent while the save runs, nor while it waited
    g.release(Hold.NO_STARTS)
    await asyncio.wait_for(late, 1)


async def test_make_room_on_a_slot_where_a_request_starts_meanwhile_leaves_it_unknown(tmp_path):
    """Making room empties the least recently used free slot; a request log shows a request
    starting on it while the engine erases it. That slot is then not known to be empty."""
    s = make(tmp_path)
    await request(s, A, 50, ticket=await s.admit(0))
    await request(s, B, 40, ticket=await s.admit(0))
    await request(s, C, 40, ticket=await s.admit(1))
    erase = s.engine.erase

    async def erase_while_a_request_starts(slot):
        s.observed_start(slot, D)
        return await erase(slot)

    s.engine.no_room, s.engine.erase = True, erase_while_a_request_starts
    assert (await s.restore_now(A, 1))["key"] == A
    assert s.view(0).phase is Phase.UNKNOWN and (s.view(1).phase, s.view(1).key) == (Phase.RESTORED, A)


# -- whether the engine empties idle slots, known at start without a request of our own --------
def test_the_mode_is_read_from_the_kv_layout_and_the_engines_command_line():
    from autosessd.sessions.checks import empties_idle_slots
    unified, streams = slotfile.KVLayout(1), slotfile.KVLayout(4)
    exe = ["llama-server", "-m", "m.gguf"]
    assert empties_idle_slots(4, unified, (exe, {}))[0] is True  # -np auto's defaults
    assert empties_idle_slots(4, unified, None)[0] is True  # a remote engine: its defaults assumed
    assert empties_idle_slots(4, streams, (exe, {}))[0] is False  # -np 4: a KV stream per slot
    assert empties_idle_slots(1, unified, (exe, {}))[0] is False
    assert empties_idle_slots(4, None, (exe, {}))[0] is False  # no llama-server file: not that engine
    assert empties_idle_slots(4, unified, (exe + ["--no-cache-idle-slots"], {}))[0] is False
    assert empties_idle_slots(4, unified, (exe + ["--cache-ram", "0"], {}))[0] is False
    assert empties_idle_slots(4, unified, (exe + ["-cram", "0"], {}))[0] is False
    assert empties_idle_slots(4, unified, (exe + ["--no_cache_idle_slots"], {}))[0] is False
    assert empties_idle_slots(4, unified, (exe + ["--cache-ram=0"], {}))[0] is False
    assert empties_idle_slots(4, unified, (exe + ["--cache-ram", "1024"], {}))[0] is True
    # The environment as llama.cpp reads it, the command line after it (it wins).
    assert empties_idle_slots(4, unified, (exe, {"LLAMA_ARG_CACHE_IDLE_SLOTS": "off"}))[0] is False
    assert empties_idle_slots(4, unified, (exe, {"LLAMA_ARG_CACHE_RAM": "0"}))[0] is False
    assert empties_idle_slots(4, unified, (exe + ["--cache-idle-slots"],
                                           {"LLAMA_ARG_CACHE_IDLE_SLOTS": "0"}))[0] is True
    assert empties_idle_slots(4, unified, (exe + ["--cache-ram", "512"], {"LLAMA_ARG_CACHE_RAM": "0"}))[0] is True


async def test_a_growing_keyless_prompt_goes_back_to_the_slot_that_holds_its_start(tmp_path):
    """A text-completion client sends its whole chat as one prompt, longer each turn, with no
    conversation key: placed on the least recently used slot, every other turn landed on the
    slot that did not hold it and read it all again. Like llama-server's own choice by prompt
    similarity, it goes to the slot whose last keyless prompt shares more than a tenth of it."""
    from autosessd.sessions.placement import keyless_prompt, shared_length

    s = make(tmp_path, n_slots=3)
    chat = "A long story about a knight. " * 50
    slots = []
    for turn in range(4):
        chat += f"Turn {turn}: and then? "
        async with await s.place(None, keyless_prompt({"prompt": chat})) as t:
            slots.append(t.slot_id)
    assert len(set(slots)) == 1
    async with await s.place(None, keyless_prompt({"prompt": "Something else entirely."})) as t:
        assert t.slot_id != slots[0]  # shares nothing: the least recently used slot
    async with await s.place(None, keyless_prompt({"prompt": [1, 2, 3, 4]})) as t:
        tokens_slot = t.slot_id
    async with await s.place(None, keyless_prompt({"prompt": [1, 2, 3, 4, 5, 6]})) as t:
        assert t.slot_id == tokens_slot
    async with await s.place(A) as t:  # a conversation takes a slot: its keyless prompt is gone
        assert s.slots[t.slot_id].keyless_prompt is None
    assert shared_length("abcdef", "abcxyz") == 3 and shared_length(b"12", "12") == 0
    assert keyless_prompt({"prompt": ["a", "b"]}) is None and keyless_prompt({"messages": []}) is None
