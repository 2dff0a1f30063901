"""The engine-log tail after the engine restarts (stub engine, llama-server b11434's lines): each
slot gets its last file back and the next request verifies it, a request that came during the
restore makes it untrusted, a restart seen twice is handled once, and the new process's task ids,
which start over, are not taken for the old one's."""

import asyncio

import pytest

from autosessd.follow.enginetail import LINE
from autosessd.store.branches import branch_key
from autosessd.store.slotfile import encode
from autosessd.sessions.slot import Phase
from enginetail_common import A, A2, B, OPENER, jsonl, launch, make, restart, served, settle, text


@pytest.mark.parametrize("fmt", [text, jsonl])
async def test_after_a_restart_the_slot_gets_its_last_file_back_and_the_next_request_verifies_it(tmp_path, fmt):
    s, tail, d = make(tmp_path)
    await served(s, tail, A, fmt=fmt)
    await settle(s, tail)
    await restart(s, tail, fmt)
    assert s.counters.engine_log_starts == 1 and s.counters.restores == 1
    assert s.engine.held[0] == A and (s.view(0).phase, s.view(0).key) == (Phase.RESTORED, LINE)
    # The next request of A reuses it: its timings say the engine read only the new tokens.
    await served(s, tail, A2, fmt=fmt, cache_n=len(A))
    assert s.counters.restores_reused == 1 and s.counters.restores_not_reused == 0
    assert s.counters.prefill_tokens_avoided == len(A)


async def test_after_a_restart_a_request_that_started_during_the_restore_makes_it_untrusted(tmp_path):
    s, tail, d = make(tmp_path)
    await served(s, tail, A)
    await settle(s, tail)
    real_restore = s.engine.restore

    async def restore_then_b(slot, name):
        res = await real_restore(slot, name)
        with open(tail.path, "ab") as f:  # B arrives as the restore is read: it may run first
            f.write(text(launch(0, 99)) + b"\n")
        return res

    s.engine.restore = restore_then_b
    tail.follower.skip_existing()
    await restart(s, tail)
    assert s.counters.restores == 1 and s.counters.restores_not_trusted == 1
    assert s.view(0).phase is not Phase.RESTORED


async def test_the_restart_seen_in_the_log_and_by_the_watch_is_handled_once(tmp_path, monkeypatch):
    s, tail, d = make(tmp_path)
    await served(s, tail, A)
    await settle(s, tail)
    monkeypatch.setattr(s.watch, "identity", lambda: (4242, 1.5))  # the new engine process
    seen = []
    s.on_engine_restart.append(lambda: asyncio.sleep(0, seen.append(1)))
    await restart(s, tail)
    assert s.counters.restores == 1 and seen == [1]
    await s.watch._report("the engine restarted (health went down and up)", (4242, 1.5))  # the watch, later
    await settle(s, tail)
    assert seen == [1] and (s.view(0).phase, s.view(0).key) == (Phase.RESTORED, LINE)
    # Another process later: reported.
    await s.watch._report("another engine process (pid 4343) took its port", (4343, 9.0))
    assert seen == [1, 1]


async def test_the_watch_reports_first_and_the_logs_start_is_not_reported_again(tmp_path, monkeypatch):
    s, tail, d = make(tmp_path)
    monkeypatch.setattr(s.watch, "identity", lambda: (4242, 1.5))
    await s.watch._report("the engine restarted (health went down and up)", (4242, 1.5))
    assert await s.engine_started("its log") is False


async def test_several_slots_each_get_their_last_file_and_a_file_another_extends_is_skipped(tmp_path):
    s, tail, d = make(tmp_path, n_slots=3)
    await served(s, tail, A, slot=0)  # A on slot 0, then A goes on on slot 1: slot 0's file is a prefix
    await settle(s, tail)
    first = s.view(0).file
    await served(s, tail, B, slot=2)
    await settle(s, tail)
    await served(s, tail, A2, slot=1)
    await settle(s, tail)
    assert first == f"auto-{LINE}.bin" and s.view(1).file == first  # A's own file, grown
    await restart(s, tail)
    assert s.engine.held == {0: [], 1: A2, 2: B} and s.counters.restores == 2
    # Recorded across a restart of autosessd (its stop writes the record last): the next start has the same plan.
    await s.last.record_stop(s.slots.values())
    s2, tail2, _ = make(tmp_path, n_slots=3)
    assert s2.last.entries.keys() == {0, 1, 2}  # held.json: the one record of what each slot held last
    assert s2.last.plan(s2.slots, s2.index) == [(1, LINE, first), (2, LINE, s.view(2).file)]


async def test_the_file_the_stop_save_wrote_is_the_one_restored_after_the_next_start(tmp_path):
    s, tail, d = make(tmp_path)
    await served(s, tail, A)
    await settle(s, tail)
    await tail.handle(text(launch(0, s.engine._tasks + 1)))  # a request whose release comes after our stop
    s.engine.ran(list(B), 0)
    await s.observed_end(0, LINE, "ok", len(B))  # as the stop save's look would settle it
    await s.save_at_stop(0)
    await s.drain()
    await s.last.record_stop(s.slots.values())
    kb = branch_key(LINE, encode(B[:len(OPENER) + 1]))
    s2, _, _ = make(tmp_path)
    assert s2.last.entries[0]["file"] == f"auto-{kb}.bin"


async def test_after_a_restart_a_request_the_log_never_shows_is_found_though_it_has_an_old_task_id(tmp_path):
    """A new engine process numbers its tasks from the start again: the log's last task of the
    old process says nothing of the new one's."""
    s, tail, d = make(tmp_path)
    old = await served(s, tail, A)
    await settle(s, tail)
    await restart(s, tail)
    tail._engine_tasks = await tail._task_ids()
    s.engine._tasks = old - 1
    s.engine.ran(list(B), 0)  # the new process's request of the same number, and no line of it
    await tail._check_tasks()
    assert s.engine.task_id == old and s.counters.engine_log_unseen == 1


async def test_after_a_restart_an_unseen_request_with_an_old_unseen_ones_number_is_counted(tmp_path):
    s, tail, d = make(tmp_path)
    tail._engine_tasks = await tail._task_ids()
    s.engine.ran(list(A), 0)  # a request, and no line of it
    await tail._check_tasks()
    old = s.engine.task_id
    await restart(s, tail)
    tail._engine_tasks = await tail._task_ids()
    s.engine._tasks = old - 1
    s.engine.ran(list(B), 0)  # the new process's, of the same number, and no line of it either
    await tail._check_tasks()
    assert s.engine.task_id == old and s.counters.engine_log_unseen == 2
