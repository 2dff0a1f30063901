"""What the tail does with log lines, on the stub engine: a start whose end never comes,
ends without counts, the restore after an engine restart, the first start on a long log.
(The follower's file handling is in test_tail.py; the real engine in test_tail_real.py.)"""

import asyncio
import json

import pytest

from autosessd.store import slotfile
from autosessd.base.config import parse
from autosessd.sessions.slot import Phase
from autosessd.store.names import StoreError
from autosessd.follow.tail import IN_FLIGHT_TTL_S, MAX_IN_FLIGHT, Tail
from stub_engine import StubEngine, stub_sessions

A, B = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"


def make(tmp_path, min_tokens=10, n_slots=1, clears_idle=False):
    s, cfg, d = stub_sessions(tmp_path, n_slots=n_slots, min_tokens=min_tokens, clears_idle=clears_idle)
    return s, Tail(cfg, s, str(tmp_path / "requests.jsonl")), d


def line(**d) -> bytes:
    return json.dumps(d).encode()


async def served(s, tail, rid, key, n, **end):
    await tail.handle(line(event="start", id=rid, slot=0, key=key))
    s.engine.ran(list(range(n)) if key == A else list(range(1000, 1000 + n)))
    await tail.handle(line(event="end", id=rid, slot=0, status="ok", **end))


async def settle(tail, s):
    for task in list(tail._save_tasks.values()):
        await task
    await s.drain()


async def test_a_start_without_its_end_expires_and_saves_resume(tmp_path):
    s, tail, d = make(tmp_path)
    await tail.handle(line(event="start", id="lost", slot=0, key=B))  # the serving layer crashed
    await served(s, tail, "r1", A, 50, n_tokens=50)
    await settle(tail, s)
    assert not (d / f"auto-{A}.bin").exists() and len(tail.in_flight) == 1  # "lost" blocks save-behind
    await tail.expire_in_flight(now=10**9)
    assert tail.in_flight == {} and tail.describe()["in_flight_expired"] == 1
    await served(s, tail, "r2", A, 60, n_tokens=60)
    await settle(tail, s)
    assert slotfile.read_header(d / f"auto-{A}.bin").n_tokens == 60


async def test_a_start_is_not_expired_while_the_engine_runs_something(tmp_path):
    s, tail, _ = make(tmp_path)
    await tail.handle(line(event="start", id="long", slot=0, key=A))
    s.engine.processing = True
    await tail.expire_in_flight(now=10**9)
    assert "long" in tail.in_flight
    s.engine.processing = False
    await tail.expire_in_flight(now=10**9 + IN_FLIGHT_TTL_S)
    assert tail.in_flight == {}


async def test_in_flight_is_bounded(tmp_path):
    s, tail, _ = make(tmp_path)
    for i in range(MAX_IN_FLIGHT + 5):
        await tail.handle(line(event="start", id=f"r{i}", slot=0, key=A))
    assert len(tail.in_flight) == MAX_IN_FLIGHT and tail.in_flight_expired == 5


async def test_an_end_without_n_tokens_takes_the_engines_count(tmp_path):
    s, tail, d = make(tmp_path)
    await served(s, tail, "r1", A, 70)  # no n_tokens on the end line
    await settle(tail, s)
    assert slotfile.read_header(d / f"auto-{A}.bin").n_tokens == 70
    assert json.loads((d / f"auto-{A}.json").read_text())["n_tokens"] == 70


async def test_the_restore_after_an_engine_restart_is_checked(tmp_path):
    """A request that starts while the restore is issued may run before it (llama-server
    defers a slot action on a busy slot): the restored state is then not trusted."""
    s, tail, d = make(tmp_path)
    await served(s, tail, "r1", A, 50, n_tokens=50)
    await settle(tail, s)
    s.engine.ran([])  # the engine restarted empty
    await s.engine_restarted("the engine restarted")
    real_restore = s.engine.restore

    async def restore_while_a_request_starts(slot, name):
        res = await real_restore(slot, name)
        with open(tail.path, "a") as f:  # the serving layer logs B meanwhile
            f.write(json.dumps({"event": "start", "id": "r2", "slot": 0, "key": B}) + "\n")
        return res

    s.engine.restore = restore_while_a_request_starts
    tail.follower.skip_existing()
    await tail._engine_restarted()
    v = s.view(0)
    assert v.phase is not Phase.RESTORED and s.counters.restores == 1
    assert v.phase is Phase.UNKNOWN or v.key == B


async def test_the_restore_after_an_engine_restart_is_trusted_when_nothing_came_between(tmp_path):
    s, tail, d = make(tmp_path)
    await served(s, tail, "r1", A, 50, n_tokens=50)
    await settle(tail, s)
    s.engine.ran([])
    await s.engine_restarted("the engine restarted")
    await tail._engine_restarted()
    assert (s.view(0).phase, s.view(0).key) == (Phase.RESTORED, A)


async def test_a_reload_changes_what_the_tail_decides(tmp_path):
    """SIGHUP replaces sessions.cfg; the tail must not keep the min tokens it started with."""
    s, tail, d = make(tmp_path, min_tokens=10**6)
    await served(s, tail, "r1", A, 50, n_tokens=50)
    await settle(tail, s)
    assert not (d / f"auto-{A}.bin").exists()
    s.cfg = parse(f'slot_save_path = "{d}"\nauto_sessions_min_tokens = 10\n'.encode())
    await served(s, tail, "r2", A, 60, n_tokens=60)
    await settle(tail, s)
    assert slotfile.read_header(d / f"auto-{A}.bin").n_tokens == 60


async def test_a_tail_end_saves_nothing_under_another_tasks_ticket(tmp_path):
    """Issue 18.4: the tail holds no ticket. On an engine that empties idle slots, A's end line
    is read while an unrelated task holds slot 0's ticket (a command, the tail's own save
    behind): the end saves nothing under that ticket — the holder may be about to change the
    slot. A is saved by the save behind once the slot is free, as when nobody held it."""
    for someone_holds_it in (False, True):
        s, tail, d = make(tmp_path / str(someone_holds_it), n_slots=2, clears_idle=True)
        holder = await s.admit(0) if someone_holds_it else None
        await tail.handle(line(event="start", id="r1", slot=0, key=A))
        s.engine.ran(list(range(50)))
        await tail.handle(line(event="end", id="r1", slot=0, status="ok", n_tokens=50))
        assert s.engine.saves == [], someone_holds_it
        if holder is not None:
            holder.release()
        await settle(tail, s)
        assert slotfile.read_header(d / f"auto-{A}.bin").n_tokens == 50 and len(s.engine.saves) == 1


class _SlowSlots(StubEngine):
    """GET /slots that takes a while: something else happens to the slot meanwhile."""

    slow = False

    async def slots(self):
        if self.slow:
            await asyncio.sleep(0.05)
        return await super().slots()


async def test_an_end_whose_slot_changed_during_the_look_changes_nothing_and_the_tail_goes_on(tmp_path):
    """The end line's look at the engine waits; an engine restart (or `autosessctl park`)
    settles the slot meanwhile. The end is then not the slot's any more: it changes nothing,
    and the tail reads on (a refused transition once ended the tail's task for good)."""
    for meanwhile in ("restart", "park"):
        s, tail, d = make(tmp_path / meanwhile)
        s.ctx.engine = eng = _SlowSlots(d)
        await tail.handle(line(event="start", id="r1", slot=0, key=A))
        eng.ran(50)
        eng.slow = True
        end = asyncio.ensure_future(tail.handle(line(event="end", id="r1", slot=0, status="ok", n_tokens=50)))
        await asyncio.sleep(0.01)
        if meanwhile == "restart":
            await s.engine_restarted("the engine restarted")
        else:
            eng.slow = False
            assert (await s.park(0))["file"] == f"auto-{A}.bin"
        await asyncio.wait_for(end, 2)
        expect = Phase.UNKNOWN if meanwhile == "restart" else Phase.HELD
        assert s.view(0).phase is expect, meanwhile
        eng.slow = False
        await served(s, tail, "r2", B, 40, n_tokens=40)  # the next lines are acted on
        assert (s.view(0).phase, s.view(0).key) == (Phase.HELD, B)


async def test_the_first_request_after_an_engine_restart_verifies_its_restore_whatever_its_task_id(tmp_path):
    """llama-server's task ids start over when it restarts (b11434: its last task before was
    16, its first after 5; each GET /slots takes one): the request that follows the restore can
    carry the id the old engine's last request had. Its restore is verified all the same, from
    what GET /slots shows while it runs (an end line without cache_n, as a log writer that does
    not copy the response's timings writes it)."""
    s, tail, d = make(tmp_path)
    await served(s, tail, "r1", A, 50, n_tokens=50)
    await settle(tail, s)
    old = s.engine.task_id
    s.engine.restart()
    await s.engine_restarted("the engine restarted")
    await tail._engine_restarted()
    assert (s.view(0).phase, s.view(0).key) == (Phase.RESTORED, A) and s.counters.restores == 1
    await tail.handle(line(event="start", id="r2", slot=0, key=A))  # the client sends its request again
    s.engine._tasks = old - 1  # the new engine's request gets the id the old one's had
    s.engine.ran(list(range(52)))
    s.engine.processing, s.engine.n_cached = True, 49
    for _ in range(40):  # the watch looks every 25 ms while the request runs
        await asyncio.sleep(0.025)
    s.engine.processing, s.engine.n_cached = False, None
    await tail.handle(line(event="end", id="r2", slot=0, status="ok", n_tokens=52, n_prompt=50))
    await settle(tail, s)
    assert s.engine.task_id == old
    assert s.counters.restores_reused == 1 and s.counters.restores_unverified == 0


async def test_an_end_read_before_the_next_lines_leaves_its_conversation_named(tmp_path):
    """An end read in a batch with later lines is settled without a look at the engine (it may
    have moved on since), so autosessd does not see its task id. The next look (park, the
    stop's save) must not take that task for a request that bypassed autosessd."""
    s, tail, d = make(tmp_path, n_slots=2)
    await served(s, tail, "r1", A, 50, n_tokens=50)
    await settle(tail, s)
    # One read of the log: A's next turn on slot 0, ended, then B starting on slot 1.
    await tail.handle(line(event="start", id="r2", slot=0, key=A), last=False)
    s.engine.ran(list(range(60)))
    await tail.handle(line(event="end", id="r2", slot=0, status="ok", n_tokens=60), last=False)
    await tail.handle(line(event="start", id="r3", slot=1, key=B))
    s.engine.ran(list(range(1000, 1040)), 1)
    await tail.handle(line(event="end", id="r3", slot=1, status="ok", n_tokens=40))
    await settle(tail, s)
    saved = await s.park(0)
    assert saved["key"] == A and slotfile.read_header(d / f"auto-{A}.bin").n_tokens == 60
    assert (s.view(0).phase, s.view(0).key) == (Phase.HELD, A) and s.counters.engine_resets == 0


async def test_a_restart_reported_late_still_verifies_the_restore_that_follows(tmp_path):
    """The new engine ran a request on the slot before autosessd heard of the restart (the
    health watch looks every few seconds) and emptied it again (-np auto empties idle slots):
    the restore goes into an empty slot that shows a task id. That id is the slot's own, not a
    request that came later: the next request's restore is verified, and a look does not drop it."""
    s, tail, d = make(tmp_path)
    await served(s, tail, "r1", A, 50, n_tokens=50)
    await settle(tail, s)
    s.engine.restart()
    s.engine.ran([])  # a request of the new process, its slot emptied since
    await s.engine_restarted("the engine restarted")
    await tail._engine_restarted()
    assert (s.view(0).phase, s.view(0).key) == (Phase.RESTORED, A)
    assert await s.observer.observe(s.slot(0)) and s.view(0).phase is Phase.RESTORED
    await tail.handle(line(event="start", id="r2", slot=0, key=A))
    for _ in range(4):
        await asyncio.sleep(0.025)  # the watch looks before the engine has placed the request
    s.engine.ran(list(range(52)))
    s.engine.processing, s.engine.n_cached = True, 49
    for _ in range(40):
        await asyncio.sleep(0.025)
    s.engine.processing, s.engine.n_cached = False, None
    await tail.handle(line(event="end", id="r2", slot=0, status="ok", n_tokens=52, n_prompt=50))
    await settle(tail, s)
    assert s.counters.restores_reused == 1 and s.counters.restores_unverified == 0


async def test_a_cancelled_end_read_before_the_next_lines_still_lets_a_look_see_another_request(tmp_path):
    """A cancelled end has no token count: settled without a look, nothing but the task id can
    tell its state from another request's later. A request that bypassed the log then ran: the
    slot is not A's any more, and A's file is not written over with it."""
    s, tail, d = make(tmp_path, n_slots=2)
    await served(s, tail, "r1", A, 50, n_tokens=50)
    await settle(tail, s)
    await tail.handle(line(event="start", id="r2", slot=0, key=A), last=False)
    s.engine.ran(list(range(55)))
    await tail.handle(line(event="end", id="r2", slot=0, status="cancelled"), last=False)
    await tail.handle(line(event="start", id="r3", slot=1, key=B))
    s.engine.ran(list(range(2000, 2080)))  # on slot 0, and not in the log
    await settle(tail, s)
    with pytest.raises(StoreError, match="holds no conversation"):
        await s.park(0)
    assert slotfile.read_header(d / f"auto-{A}.bin").n_tokens == 50


async def test_the_tail_stops_though_a_cancel_is_lost(tmp_path):
    """On Python < 3.12, asyncio.wait_for can lose a cancel that comes as the event it waits
    for is set (CPython bpo-42130): a log line written as SIGTERM came. Seen once as a stop
    that hung until it was killed. The stop ends all the same."""
    s, tail, d = make(tmp_path)
    reading = asyncio.Event()

    async def read_that_loses_a_cancel():
        reading.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # lost, as in wait_for's race

    tail.read_new_lines = read_that_loses_a_cancel
    tail._task = asyncio.get_running_loop().create_task(tail._run())
    await reading.wait()
    await asyncio.wait_for(tail.stop(1.0), 10)
    assert tail._task.done()
