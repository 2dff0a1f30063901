"""The watch that verifies a restore whose request autosessd does not see end (turn hook,
tails): it reads GET /slots while the request runs. llama-server b11434 resets a slot's
counts when it takes a task (cache 0, 0 read) while the slot still holds the restored tokens,
and sets them only as the task's prompt starts (server-context.cpp: reset(), then
n_prompt_cached = n_past): a reading then is not the request's cache_n. A scripted engine
answers those readings in turn."""

import asyncio

from autosessd.engines.base import SlotState
from autosessd.sessions.slot import Phase, View
from stub_engine import stub_sessions


async def test_a_slot_taken_but_not_begun_is_not_read_as_a_restore_not_reused(tmp_path):
    s, _, _ = stub_sessions(tmp_path)
    slot = s.slots[0]
    readings = iter([
        SlotState(0, True, 667, n_cached=0, task_id=9, n_processed=0),  # taken, not begun
        SlotState(0, True, 667, n_cached=666, task_id=9, n_processed=1),  # its prompt read
    ])

    async def engine_slot(slot_id):
        return next(readings)

    s.observer.engine_slot = engine_slot
    slot._view = View(Phase.SWITCHED, "k" * 16, n_tokens=None, restored=666,
                      prior=View(Phase.RESTORED, "k" * 16, n_tokens=666, restored=666))
    slot.task_id = 8
    s.observer.watch_request(slot)
    await asyncio.wait_for(slot.watcher, 5)
    assert slot.seen_cache_n == (9, 666)
