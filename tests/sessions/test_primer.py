"""The primer and the order of starts on an engine that empties idle slots (issue 12), on the stub
engine: a request pinned to an emptied slot gets the primer first, starts that may find their
conversation in the engine's RAM cache go alone, and an end save goes before them.
The placement of requests on slots is in test_slots.py."""

import asyncio
import time

import pytest

from autosessd.store import slotfile
from autosessd.engines.base import EngineRefused
from autosessd.sessions.launch import Hold, LaunchGate
from autosessd.sessions.slot import Phase
from slots_common import A, B, C, D, E, F, conv, file_tokens, make, request


def primed_engine(tmp_path):
    """Sessions on an engine that empties idle slots, as the daemon's start probe finds it."""
    return make(tmp_path, clears_idle=True, probed=True)


async def with_primer(tmp_path):
    """... after a return to an emptied slot has made the primer."""
    s = primed_engine(tmp_path)
    await request(s, E, 5)
    await request(s, F, 5)  # empties E's slot
    await request(s, E, 5)  # E may be in the engine's RAM cache: primed, the primer made
    assert s.launch.primer.name is not None
    return s


async def test_the_primer_is_made_when_first_needed_one_token_after_bos_owner_only_and_removed_at_stop(tmp_path):
    s = primed_engine(tmp_path)
    await request(s, A, 5)
    await request(s, B, 5)  # empties A's slot
    assert s.launch.primer.name is None and s.counters.primed == 0  # new conversations: the RAM cache has nothing of them
    await request(s, A, 5)
    path = tmp_path / s.launch.primer.name
    assert list(slotfile.read_header(path).tokens) == [ord("\n")]  # not BOS: every prompt starts with BOS
    assert path.stat().st_mode & 0o777 == 0o600 and s.counters.primed == 1
    assert not list(tmp_path.glob("auto-*"))
    await s.close()
    assert not path.exists()
    (tmp_path / "one").mkdir()
    single = make(tmp_path / "one", n_slots=1, probed=True)
    for key in (A, B, A):
        await request(single, key, 5)
    assert single.launch.primer.name is None and single.counters.primed == 0  # one slot: nothing else empties it


async def started(s, key):
    """A request of `key` placed, turned and let through the launch gate: (its slot, what the
    engine's slot holds as it starts). Its start is then marked sent."""
    async with await s.place(key) as t:
        await s.turn(t, key)
        await s.before_send(t)
        seen = t.slot_id, list(s.engine.held[t.slot_id])
        await s.sent(t, bound_s=0)
    return seen


async def test_a_request_pinned_to_a_slot_the_engine_emptied_gets_the_primer_first(tmp_path):
    """The engine moved A's slot to its RAM prompt cache when B started; pinned to that empty
    slot, A's next request would not look there (llama.cpp 28139) and would read its prompt
    again. With the primer restored first, the slot holds something, and the engine looks."""
    s = await with_primer(tmp_path)
    slot_a, _ = await request(s, A, 5)  # below min_tokens: never saved, only the RAM cache has it
    slot_b, _ = await request(s, B, 5)  # empties A's slot
    assert s.engine.held[slot_a] == []
    primed = s.counters.primed
    assert await started(s, A) == (slot_a, [ord("\n")]) and s.counters.primed == primed + 1
    # B's slot still holds B: nothing to prime
    assert await started(s, B) == (slot_b, conv(B, 5)) and s.counters.primed == primed + 1


async def test_a_request_without_a_key_pinned_to_an_emptied_slot_gets_the_primer_too(tmp_path):
    """A raw /completion prompt has no conversation key, but the engine's RAM cache may hold it
    as well as any (llama.cpp's test_kv_keep_only_active.py::test_clear_and_restore, through
    the gate): pinned to the slot the engine emptied, without the primer it never looks."""
    s = await with_primer(tmp_path)
    slot_x, _ = await request(s, None, 5)
    slot_y, _ = await request(s, B, 5)  # empties the keyless prompt's slot
    assert slot_x != slot_y and s.engine.held[slot_x] == []
    primed = s.counters.primed
    assert await started(s, None) == (slot_x, [ord("\n")]) and s.counters.primed == primed + 1


async def test_a_start_that_may_find_its_conversation_in_the_engine_goes_alone(tmp_path):
    """A start between another's priming (or its look at a slot holding its conversation) and
    its request would empty that slot again; a new conversation's start need not wait."""
    s = primed_engine(tmp_path)
    await request(s, A, 5)
    await request(s, B, 5)
    first, second = await s.place(A), await s.place(B)
    for t, key in ((first, A), (second, B)):
        await s.turn(t, key)
    await s.before_send(first)
    waiting = asyncio.ensure_future(s.before_send(second))
    await asyncio.sleep(0.02)
    assert not waiting.done()
    s.engine.ran(conv(A, 5), slot=first.slot_id)  # A's request runs: a new task id on its slot
    await s.sent(first, bound_s=1)
    await asyncio.wait_for(waiting, 1)
    second.release()
    first.release()
    new = [await s.place(k) for k in (C, D)]
    for t, key in zip(new, (C, D)):
        await s.turn(t, key)
    await s.before_send(new[0])
    await asyncio.wait_for(s.before_send(new[1]), 1)  # side by side
    for t in new:
        t.release()


async def test_a_primer_that_cannot_be_restored_is_made_again(tmp_path):
    s = await with_primer(tmp_path)
    await request(s, A, 5)
    await request(s, B, 5)
    (tmp_path / s.launch.primer.name).unlink()  # or an engine restarted with another model
    primed = s.counters.primed
    await request(s, A, 5)
    assert s.launch.primer.name is not None and (tmp_path / s.launch.primer.name).exists() and s.counters.primed == primed + 1


@pytest.mark.parametrize("damage", ["cut short", "replaced"])
async def test_a_primer_changed_on_disk_is_never_restored_but_made_again(tmp_path, damage):
    """Like every file handed to the engine (issue 19): llama-server aborts on a short one."""
    s = await with_primer(tmp_path)
    await request(s, A, 5)
    await request(s, B, 5)
    path = tmp_path / s.launch.primer.name
    data = path.read_bytes()
    if damage == "cut short":
        path.write_bytes(data[:-1])
    else:
        path.unlink()
        path.write_bytes(data)  # the same bytes, another file: not the one the engine wrote
    restored = []
    real = s.engine.restore
    s.engine.restore = lambda slot, name: restored.append(name) or real(slot, name)
    primed = s.counters.primed
    await request(s, A, 5)
    assert restored == [] and s.counters.primed == primed + 1  # made again by the engine, not restored
    assert list(slotfile.read_header(path).tokens) == [ord("\n")] and path.stat().st_size == len(data)


async def test_no_primer_for_a_model_without_bos_and_starts_go_side_by_side(tmp_path):
    """Its prompts may start with the newline: the primer would keep the engine from looking."""
    s = primed_engine(tmp_path)
    s.engine.tokenize = lambda text, timeout_s=None: asyncio.sleep(0, [ord(c) for c in text])
    for key in (A, B, A):
        await request(s, key, 5)
    assert s.launch.primer.name is None and s.counters.primed == 0
    first, second = await s.place(B), await s.place(A)
    for t, key in ((first, B), (second, A)):
        await s.turn(t, key)
    await s.before_send(first)
    await asyncio.wait_for(s.before_send(second), 1)  # shared starts, as without a primer
    second.release()
    first.release()


async def test_a_primed_request_that_never_ran_ends_without_a_hang_or_a_save(tmp_path):
    """The client went away after its slot was primed (or the engine could not be reached).
    The slot held A, whose save at the switch failed, when the turn looked; another start then
    emptied it. The end must not wait for the launch gate this request holds itself, and the
    primer's one token must not be saved as A."""
    s = primed_engine(tmp_path)
    slot_a, _ = await request(s, A, 50)
    (tmp_path / f"auto-{A}.bin").unlink()  # A's file is out of date (gone)
    save = s.engine.save

    async def failing_save(slot, name):
        raise EngineRefused("POST /slots answered 500: stub told to fail")
    t = await s.admit(slot_a)
    s.engine.save = failing_save
    s.launch._ran[C] = None  # C ran before: the engine's RAM cache may hold it
    await s.turn(t, C)  # the save of A fails: A stays held, durable
    s.engine.save = save
    s.engine.held[slot_a] = []  # another request started (on another slot) and emptied it
    s.launch.count_start()
    await s.before_send(t)
    assert s.engine.held[slot_a] == [ord("\n")]
    await asyncio.wait_for(s.ended(t, C, "not_run"), 2)
    t.release()
    await s.drain()
    assert not (tmp_path / f"auto-{A}.bin").exists() and not s.launch.gate.no_starts and not s.launch.gate.alone
    assert s.view(slot_a).conversation() is None


async def test_a_launch_watcher_never_releases_the_next_requests_hold(tmp_path):
    """A request refused at once (4xx) ends before its watcher saw it run; the next request on
    the slot takes the gate exclusively, and the old watcher must leave that hold alone."""
    s = await with_primer(tmp_path)
    s.launch._ran[A] = None  # A ran before: its start goes alone
    t1 = await s.admit(0)
    await s.turn(t1, A)
    await s.before_send(t1)
    watcher = asyncio.ensure_future(s.sent(t1, bound_s=1))
    await asyncio.sleep(0.02)
    await s.ended(t1, A, "rejected")
    t1.release()
    t2 = await s.admit(0)
    await s.turn(t2, A)
    await s.before_send(t2)
    await asyncio.wait_for(watcher, 2)
    assert s.slot(0).launch_hold is Hold.ALONE and s.launch.gate.alone
    t2.release()


async def test_a_request_that_never_ran_saves_the_conversation_still_held_without_waiting_on_itself(tmp_path):
    """The same, but nothing emptied the slot: it still holds A, whose save at the switch
    failed. The end saves A, taking the launch gate this request held until it ended."""
    s = primed_engine(tmp_path)
    slot_a, _ = await request(s, A, 50)
    (tmp_path / f"auto-{A}.bin").unlink()
    save = s.engine.save

    async def failing_save(slot, name):
        raise EngineRefused("POST /slots answered 500: stub told to fail")
    t = await s.admit(slot_a)
    s.engine.save = failing_save
    await s.turn(t, C)
    s.engine.save = save
    await s.before_send(t)  # alone, as every start without a restore; nothing to prime
    await asyncio.wait_for(s.ended(t, C, "not_run"), 2)
    t.release()
    await s.drain()
    assert file_tokens(tmp_path, A) == conv(A, 50) and not s.launch.gate.no_starts and not s.launch.gate.alone


async def test_an_end_save_goes_before_the_starts_that_must_run_alone():
    """Starts to primed slots go one at a time; an end save waiting among them must not wait
    for all of them, or the first of them empties the slot it was to save."""
    g = LaunchGate()
    await g.acquire(Hold.ALONE)
    queued = [asyncio.ensure_future(g.acquire(Hold.ALONE)) for _ in range(3)]
    await asyncio.sleep(0.01)
    save = asyncio.ensure_future(g.acquire(Hold.NO_STARTS))
    await asyncio.sleep(0.01)
    assert not save.done() and not any(q.done() for q in queued)
    g.release(Hold.ALONE)
    await asyncio.wait_for(save, 1)
    assert not any(q.done() for q in queued)
    g.release(Hold.NO_STARTS)
    await asyncio.sleep(0.01)
    assert sum(q.done() for q in queued) == 1  # then one start, alone
    for _ in queued:
        g.release(Hold.ALONE)
        await asyncio.sleep(0.01)
    assert all(q.done() for q in queued)


async def test_an_end_to_be_saved_holds_the_starts_from_the_moment_it_is_seen(tmp_path):
    """From A's end to its save no start may be sent: the first would empty A's slot. Held
    only from the save on, a start sent while autosessd still looked at A's slot won."""
    s = primed_engine(tmp_path)
    ta = await s.place(A)
    await s.turn(ta, A)
    await s.before_send(ta)
    s.engine.ran(conv(A, 50), slot=ta.slot_id)
    await s.sent(ta, bound_s=0)
    tb = await s.place(B)
    await s.turn(tb, B)
    slots = s.engine.slots

    async def slow_slots():
        await asyncio.sleep(0.05)
        return await slots()
    s.engine.slots = slow_slots
    end = asyncio.ensure_future(s.ended(ta, A, "ok", n_tokens=50))
    await asyncio.sleep(0.01)  # autosessd is reading A's slot
    await asyncio.wait_for(s.before_send(tb), 2)
    assert end.done()  # B's start waited for A's save
    s.engine.slots = slots
    s.engine.ran(conv(B, 5), slot=tb.slot_id)  # B starts: A's slot is emptied now
    ta.release()
    tb.release()
    await s.drain()
    assert file_tokens(tmp_path, A) == conv(A, 50)


async def test_a_start_that_goes_alone_holds_the_others_only_until_the_engine_has_taken_it_in(tmp_path):
    """The engine answers GET /slots only between its batches: seconds while it reads a long
    prompt. Placed in order from its queue, the next start only has to come after this one is
    queued: the hold ends within the engine's intake time, not when /slots can show it."""
    s = primed_engine(tmp_path)
    await request(s, A, 5)
    t = await s.place(A)  # A's slot holds A: its start goes alone
    await s.turn(t, A)
    await s.before_send(t)
    assert s.launch.gate.alone
    slots = s.engine.slots

    async def in_a_long_batch():
        await asyncio.sleep(1.5)
        return await slots()
    s.engine.slots = in_a_long_batch
    t0 = asyncio.get_running_loop().time()
    await s.sent(t)
    assert asyncio.get_running_loop().time() - t0 < 0.5 and not s.launch.gate.alone
    t.release()


async def test_a_start_refused_before_it_ran_does_not_count_as_emptying_the_other_slots(tmp_path):
    """A request llama-server refuses (4xx) is never placed: the slot next door still holds its
    conversation, and the primer must not replace it."""
    s = await with_primer(tmp_path)
    slot_a, _ = await request(s, A, 5)
    ta = await s.place(A)  # A's slot holds A
    await s.turn(ta, A)
    tb = await s.place(B)
    await s.turn(tb, B)
    await s.before_send(tb)
    await s.sent(tb, bound_s=0)
    await s.ended(tb, B, "rejected")
    tb.release()
    await s.before_send(ta)
    assert s.engine.held[slot_a] == conv(A, 5)  # not primed: nothing emptied it
    ta.release()


async def test_a_start_sent_before_the_look_and_placed_after_it_empties_the_slot(tmp_path):
    """The look saw A's slot holding A, but B's request was already on its way: the engine
    places it first and empties A's slot. A's request must get the primer."""
    s = await with_primer(tmp_path)
    slot_a, _ = await request(s, A, 5)
    await request(s, B, 5)
    tb = await s.place(B)
    await s.turn(tb, B)
    await s.before_send(tb)  # sent; the engine has not shown it yet
    ta = await s.place(A)
    await s.turn(ta, A)  # looks: A's slot still holds A
    await s.sent(tb, bound_s=0)  # B's hold ends on the intake bound, unplaced as far as we know
    s.engine.ran(conv(B, 5), slot=tb.slot_id)  # now the engine places B: A's slot is emptied
    primed = s.counters.primed
    await s.before_send(ta)
    assert s.counters.primed == primed + 1 and s.engine.held[slot_a] == [ord("\n")]
    ta.release()
    tb.release()


async def test_a_request_whose_priming_was_cancelled_saves_nothing_under_the_slots_former_conversation(tmp_path):
    """The client left while the primer was being restored; the engine restored it anyway. The
    slot had held A (its save at the switch failed): its one token must not become A's file."""
    s = await with_primer(tmp_path)
    slot_a, _ = await request(s, A, 50)
    (tmp_path / f"auto-{A}.bin").unlink()
    save, restore, started = s.engine.save, s.engine.restore, asyncio.Event()

    async def failing_save(slot, name):
        raise EngineRefused("POST /slots answered 500: stub told to fail")

    async def slow_restore(slot, name):
        result = await restore(slot, name)  # the engine does it...
        started.set()
        await asyncio.sleep(10)  # ... and the answer never reaches the client that left
        return result
    t = await s.admit(slot_a)
    s.launch._ran[C] = None
    s.engine.save = failing_save
    await s.turn(t, C)
    s.engine.save, s.engine.restore = save, slow_restore
    s.engine.held[slot_a] = []
    s.launch.count_start()  # another request was placed: A's slot was emptied
    launching = asyncio.ensure_future(s.before_send(t))
    await asyncio.wait_for(started.wait(), 1)
    launching.cancel()
    await asyncio.gather(launching, return_exceptions=True)
    assert s.engine.held[slot_a] == [ord("\n")]
    await asyncio.wait_for(s.ended(t, C, "not_run"), 2)
    t.release()
    await s.drain()
    assert not (tmp_path / f"auto-{A}.bin").exists() and s.view(slot_a).conversation() is None


async def test_a_start_waiting_to_go_alone_is_not_starved_by_starts_side_by_side():
    g = LaunchGate()
    await g.acquire(Hold.SIDE_BY_SIDE)
    alone = asyncio.ensure_future(g.acquire(Hold.ALONE))
    await asyncio.sleep(0.01)
    later = asyncio.ensure_future(g.acquire(Hold.SIDE_BY_SIDE))
    await asyncio.sleep(0.01)
    assert not later.done()  # no new start side by side while one waits to go alone
    g.release(Hold.SIDE_BY_SIDE)
    await asyncio.wait_for(alone, 1)
    assert not later.done()
    g.release(Hold.ALONE)
    await asyncio.wait_for(later, 1)


async def test_the_stop_after_an_end_save_asks_the_engine_for_no_second_save(tmp_path):
    """Issue 18.1: on an engine that empties idle slots each end is saved at once. The stop
    right after it must decide on A's file as it will be once that save's finalize (fsync,
    rename, metadata: slow for a multi-GB file) has landed: up to date, not saved again."""
    s = primed_engine(tmp_path)
    finalize = s.store.finalize

    def slow_finalize(key, meta, digest=None):
        time.sleep(0.1)  # a big file's fsync
        return finalize(key, meta)

    s.store.finalize = slow_finalize
    t = await s.place(A)
    async with t:
        await s.turn(t, A)
        await s.before_send(t)
        s.engine.ran(conv(A, 50), slot=t.slot_id)
        await s.sent(t, bound_s=0)
        await s.ended(t, A, "ok")  # the end save; its finalize is still running
    assert len(s.engine.saves) == 1
    assert await s.save_at_stop(t.slot_id, "stop")  # up to date: done, nothing to write
    assert len(s.engine.saves) == 1
    await s.saver.settled()  # the stop waits for it before the exit (Sessions.close)
    assert file_tokens(tmp_path, A) == conv(A, 50)


async def test_a_start_that_waited_to_go_alone_while_the_engine_restarted_is_sent_unprimed(tmp_path):
    """before_send waits for its turn to go alone; the engine restarts meanwhile (every slot
    lost). The request is sent as it is, nothing primed, no error to the client."""
    s = await with_primer(tmp_path)
    t = await s.place(A)
    await s.turn(t, A)
    await s.launch.gate.acquire(Hold.SIDE_BY_SIDE)  # another slot's start is in flight
    sending = asyncio.ensure_future(s.before_send(t))
    await asyncio.sleep(0.01)
    await s.engine_restarted("the engine restarted")
    s.launch.count_start()
    s.launch.gate.release(Hold.SIDE_BY_SIDE)
    await asyncio.wait_for(sending, 1)
    assert s.view(t.slot_id).phase is Phase.UNKNOWN and s.counters.primed == 1  # only with_primer's own
    t.release()
