"""The slot's state machine (sessions/facade.py) on the stub engine: what a slot holds after each
kind of request end, and that no auto file ever gets another conversation's state.

The stub writes real slot files whose header tokens stand for the conversation (A's are
1..n, B's 1001.., ...), so every check reads the file's header, not autosessd's records."""

import asyncio
import json

import pytest

from autosessd.store import slotfile
from autosessd.base.config import parse
from autosessd.sessions.facade import Sessions
from autosessd.sessions.finalizing import Pending
from autosessd.sessions.slot import Phase
from autosessd.store.directory import Store
from stub_engine import StubEngine

A, B, C = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "cccccccccccccccc"
TOKENS = {A: 1, B: 1001, C: 5001}


def conv(key, n):
    """The tokens conversation `key` has after n tokens."""
    return list(range(TOKENS[key], TOKENS[key] + n))


def make(tmp_path, min_tokens=10, **kw):
    cfg = parse(f'slot_save_path = "{tmp_path}"\nauto_sessions_min_tokens = {min_tokens}\n'
                f'state_dir = "{tmp_path}-state"\n'.encode())
    return Sessions(cfg, StubEngine(tmp_path, **kw), Store(tmp_path), "stub-model")


async def request(s, key, n, status="ok", cache_n=None):
    """What the gate does: FIFO, turn, the request runs (or not), ended."""
    async with await s.admit() as t:
        turn = await s.turn(t, key)
        if status in ("ok", "cancelled"):
            s.engine.ran(conv(key, n) if key else list(range(90000, 90000 + n)))
        elif status == "rejected":
            s.engine.task_id = (s.engine.task_id or 0) + 1  # the engine took the task, then refused it
        await s.ended(t, key, status, cache_n=cache_n)
    await s.drain()
    return turn


def file_tokens(tmp_path, key):
    return list(slotfile.read_header(tmp_path / f"auto-{key}.bin").tokens)


async def test_a_rejected_request_after_a_switch_holds_nothing_new(tmp_path):
    """Issue 10.1: the previous conversation's state must not be saved under the rejected one's key."""
    s = make(tmp_path)
    await request(s, A, 50)
    await request(s, B, 0, status="rejected")  # e.g. a prompt over the context: 400 before it runs
    assert s.view().phase is Phase.HELD and s.view().key == A and s.view().n_tokens == 50
    await request(s, C, 30)
    assert not (tmp_path / f"auto-{B}.bin").exists()
    assert file_tokens(tmp_path, A) == conv(A, 50)


async def test_a_rejected_request_keeps_a_restored_state_awaiting_verification(tmp_path):
    s = make(tmp_path)
    await request(s, A, 50)
    await request(s, B, 40)
    await request(s, A, 0, status="rejected")
    v = s.view()
    assert (v.phase, v.key, v.restored) == (Phase.RESTORED, A, 50)
    await request(s, A, 60, cache_n=50)
    assert s.counters.restores_reused == 1 and s.view().phase is Phase.HELD


async def test_a_request_that_failed_part_way_leaves_the_slot_unknown(tmp_path):
    s = make(tmp_path)
    await request(s, A, 50)
    async with await s.admit() as t:
        await s.turn(t, B)
        s.engine.ran(conv(B, 7))  # the engine got some way into B, then failed
        await s.ended(t, B, "error")
    assert s.view().phase is Phase.UNKNOWN
    await request(s, C, 30)
    assert not (tmp_path / f"auto-{B}.bin").exists()


async def test_a_request_that_never_reached_the_engine_changes_nothing(tmp_path):
    s = make(tmp_path)
    await request(s, A, 50)
    await request(s, B, 0, status="not_run")
    assert (s.view().phase, s.view().key) == (Phase.HELD, A)


async def test_a_cancelled_request_is_provisional_unless_the_engine_never_started_it(tmp_path):
    s = make(tmp_path)
    await request(s, A, 50)
    await request(s, B, 20, status="cancelled")
    assert (s.view().phase, s.view().key, s.view().durable) == (Phase.HELD, B, False)
    async with await s.admit() as t:
        await s.turn(t, C)
        await s.ended(t, C, "cancelled")  # the engine's slot did not change
    assert (s.view().key, s.view().durable) == (B, False)


async def test_a_request_without_a_conversation_saves_the_held_one_first(tmp_path):
    """A raw completion replaces what the slot holds: the held conversation is saved before
    it, and the slot then holds nothing autosessd can name."""
    s = make(tmp_path)
    await request(s, A, 50)
    turn = await request(s, None, 30)
    assert turn.saved["key"] == A and file_tokens(tmp_path, A) == conv(A, 50)
    assert s.view().phase is Phase.UNKNOWN
    turn = await request(s, A, 60)
    assert turn.restored["key"] == A and turn.saved is None


async def test_a_request_that_bypassed_the_fifo_makes_the_slot_unknown(tmp_path):
    s = make(tmp_path)
    await request(s, A, 50)
    s.engine.ran(conv(B, 50))  # someone sent B straight to the engine: same length as A
    turn = await request(s, C, 30)
    assert turn.saved is None and not (tmp_path / f"auto-{A}.bin").exists()
    assert s.counters.engine_resets == 1


async def test_hook_growth_is_saved_and_the_restore_verified_at_the_next_turn(tmp_path):
    """Issue 10.2: through the turn hook (the end is never reported), a restored conversation
    that grows is saved with its new length."""
    s = make(tmp_path)

    async def hook(key, n=None):
        async with await s.admit() as t:
            r = await s.turn(t, key, sees_end=False)
        if n is not None:
            s.engine.ran(conv(key, n))  # the serving layer runs the request
        await s.drain()
        return r

    await hook(A, 50)
    await hook(B, 40)
    r = await hook(A, 80)
    assert r.restored["n_tokens"] == 50
    r = await hook(B)
    assert r.saved["key"] == A and r.saved["n_tokens"] == 80
    assert file_tokens(tmp_path, A) == conv(A, 80)
    assert json.loads((tmp_path / f"auto-{A}.json").read_text())["n_tokens"] == 80


async def test_hook_turn_for_a_request_that_never_ran_keeps_what_was_held(tmp_path):
    s = make(tmp_path)
    async with await s.admit() as t:
        await s.turn(t, A, sees_end=False)
    s.engine.ran(conv(A, 50))
    async with await s.admit() as t:
        await s.turn(t, B, sees_end=False)  # the serving layer then dropped B without running it
    async with await s.admit() as t:
        r = await s.turn(t, C, sees_end=False)
    await s.drain()
    assert r.saved is None or r.saved["key"] == A
    assert not (tmp_path / f"auto-{B}.bin").exists()


async def test_a_manual_restore_never_leads_to_a_file_outside_the_owned_names(tmp_path):
    """Issue 10.4: `autosessctl restore mine` then a switch."""
    s = make(tmp_path)
    (tmp_path / "mine.bin").write_bytes(slotfile.build(conv(B, 70), b"\0" * 700))  # the stub engine's layout
    await request(s, A, 50)
    await s.restore_now("mine")
    assert s.view().phase is Phase.UNKNOWN
    await request(s, C, 30)
    await request(s, A, 55)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(["mine.bin", f"auto-{A}.bin", f"auto-{A}.json", f"auto-{C}.bin", f"auto-{C}.json"])
    assert file_tokens(tmp_path, A) == conv(A, 50) and file_tokens(tmp_path, C) == conv(C, 30)


async def test_every_save_is_checked_against_the_files_header(tmp_path):
    s = make(tmp_path)
    real_save = s.engine.save

    async def lying_save(slot, name):
        res = await real_save(slot, name)
        return type(res)(res.n_tokens + 5, res.n_bytes, res.ms)  # says more tokens than it wrote

    await request(s, A, 50)
    s.engine.save = lying_save
    turn = await request(s, B, 40)
    assert turn.saved is None and "holds 50 tokens by its header, the engine reported 55" in turn.errors[0]
    assert not list(tmp_path.glob("auto-*")) and not list(tmp_path.glob(".autosessd-*"))


async def test_without_get_slots_counts_come_from_responses(tmp_path):
    """An engine run with --no-slots: switch-back still works, counts from the engine's answers."""
    s = make(tmp_path, slots_visible=False)
    s.ctx.slots_visible = False
    await request(s, A, 50)
    async with await s.admit() as t:
        await s.turn(t, B)
        s.engine.ran(conv(B, 40))
        await s.ended(t, B, "ok", n_tokens=40)
    await s.drain()
    assert file_tokens(tmp_path, A) == conv(A, 50)
    turn = await request(s, A, 60)
    assert turn.saved["key"] == B and turn.restored["key"] == A


async def test_ticket_release_is_safe_twice(tmp_path):
    s = make(tmp_path)
    t = await s.admit()
    t.release()
    t.release()
    t2 = await asyncio.wait_for(s.admit(), 1)
    t2.release()


@pytest.mark.parametrize("cache_n, n_prompt, counter", [
    (2999, 3040, "restores_reused"), (0, 3040, "restores_not_reused"), (None, None, "restores_unverified")])
async def test_a_restore_is_verified_by_cache_n(tmp_path, cache_n, n_prompt, counter):
    s = make(tmp_path)
    await request(s, A, 3000)
    await request(s, B, 40)
    async with await s.admit() as t:
        await s.turn(t, A)
        s.engine.ran(conv(A, 3050))
        await s.ended(t, A, "ok", cache_n=cache_n, n_prompt=n_prompt)
    assert getattr(s.counters, counter) == 1
    assert s.counters.prefill_tokens_avoided == (cache_n if counter == "restores_reused" else 0)


async def test_not_reused_names_a_cut_conversation_when_the_prompt_is_shorter(tmp_path):
    s = make(tmp_path)
    await request(s, A, 3000)
    await request(s, B, 40)
    async with await s.admit() as t:
        await s.turn(t, A)
        s.engine.ran(conv(A, 1100))
        await s.ended(t, A, "ok", cache_n=0, n_prompt=1000)
    assert "shorter than the restored conversation" in s.last_not_reused["likely_cause"]
    assert "--swa-full" not in s.last_not_reused["likely_cause"]


async def test_not_reused_after_a_regenerate_names_swa_full(tmp_path):
    """The same prompt again (a regenerated answer) is a little shorter than the restored
    state, which holds the first answer too: the likely cause is still --swa-full."""
    s = make(tmp_path)
    await request(s, A, 3000)
    await request(s, B, 40)
    async with await s.admit() as t:
        await s.turn(t, A)
        s.engine.ran(conv(A, 3000))
        await s.ended(t, A, "ok", cache_n=0, n_prompt=2990)
    assert "--swa-full" in s.last_not_reused["likely_cause"]


class _Spinning(dict):
    """_finalizing that notices a caller spinning on it (the loop blocked for ever)."""

    looks = 0

    def __bool__(self):
        self.looks += 1
        if self.looks > 1000:
            raise RuntimeError("waited on _finalizing 1,000 times without the loop running")
        return len(self) > 0


async def test_waiting_for_a_finalize_that_just_finished_lets_its_callback_run(tmp_path):
    """A turn that waits for in-flight finalizes at the moment one has finished but its
    done-callback (which removes it) is still queued must yield to the loop, not spin: seen
    in CI as a daemon at 100% CPU with its gate hung, under llama-server's defaults (an end
    save finishing as the next turn starts)."""
    s = make(tmp_path)
    s.saver._finalizing = _Spinning()
    fut = asyncio.get_running_loop().create_future()
    s.saver._finalizing["k"] = Pending("k", "auto-k.bin", "k", None, None, 0, fut)
    fut.add_done_callback(lambda f: s.saver._finalizing.pop("k"))
    fut.set_result(None)  # done; the callback is queued, not run
    await s.saver.settled()
    assert not s.saver._finalizing



async def test_a_bug_anywhere_in_the_turn_never_fails_the_request(tmp_path, monkeypatch):
    """The turn never fails a request: a bug before its first decision (the body's signature,
    here) is logged and named in the turn's result; the request goes on, and the slot is taken
    to hold the request's conversation, not what it held."""
    from autosessd.sessions import turn as turn_mod

    s = make(tmp_path)
    await request(s, A, 50)

    def broken(body):
        raise RuntimeError("signature bug")

    monkeypatch.setattr(turn_mod, "chat_signature", broken)
    body = {"messages": [{"role": "user", "content": "conversation B"}]}
    async with await s.admit() as t:
        r = await s.turn(t, B, body=body)
        assert any("signature bug" in e for e in r.errors)
        assert s.view().key == B  # started: the request runs
        s.engine.ran(conv(B, 30))
        await s.ended(t, B, "ok")
    await s.drain()
    assert s.view().phase is Phase.HELD and s.view().key == B


def test_a_turns_event_is_a_copy_of_what_the_turn_did():
    """TurnResult.to_dict (every turn's event) as dataclasses.asdict has it, and a copy: what
    the gate's headers read later does not change an event already emitted."""
    from dataclasses import asdict

    from autosessd.sessions.report import TurnResult

    r = TurnResult(key=A, slot=1, saved={"file": "auto-a.bin", "n_tokens": 5}, restored={"file": "auto-b.bin"},
                   prefix={"file": "auto-p.bin"}, tokens_from="messages", skipped=["s"], errors=["e"], ms=1.5)
    d = r.to_dict()
    assert d == asdict(r)
    r.restored["slot_shared"] = 3
    r.skipped.append("t")
    assert "slot_shared" not in d["restored"] and d["skipped"] == ["s"]


async def test_what_a_turn_says_comes_after_it_in_order_and_no_reader_misses_it(tmp_path):
    """The `restored` and `turn` events are published LATER_S after the turn (its request is
    on its way then), not before the request is forwarded. A reader of the events, or an
    event emitted at once, publishes what waits first: nothing out of order, nothing missed,
    each with the time it happened."""
    from autosessd.sessions import report

    s = make(tmp_path)
    await request(s, A, 50)
    await request(s, B, 40)
    async with await s.admit() as t:
        before = len(s.events._recent)
        turn = await s.turn(t, A)
        assert turn.restored is not None
        # Not said yet when the turn hands the request over (its save's events were)...
        assert not {"restored", "turn"} & {e["type"] for e in list(s.events._recent)[before:]}
        # ...but a reader sees it all, in order.
        types = [e["type"] for e in list(s.events.recent)[before:]]
        assert types[-2:] == ["restored", "turn"], types
        seqs = [e["seq"] for e in s.events.recent]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        s.engine.ran(conv(A, 60))
        await s.ended(t, A, "ok", cache_n=50)
    await s.drain()

    async def switch(key, n, cache_n, between):
        """A request of `key` through the gate, `between` run after its turn: the new events' types."""
        async with await s.admit() as t:
            first = len(s.events._recent)
            await s.turn(t, key)
            await between()
            types = [e["type"] for e in list(s.events._recent)[first:]]
            s.engine.ran(conv(key, n))
            await s.ended(t, key, "ok", cache_n=cache_n)
        await s.drain()
        return types

    async def emit_at_once():
        s.events.emit("mark")

    # An event emitted at once comes after what waits; unread, it is said once LATER_S has passed.
    types = await switch(B, 50, 40, emit_at_once)
    assert "turn" in types and types.index("turn") < types.index("mark") == len(types) - 1, types
    assert "turn" in await switch(A, 70, 50, lambda: asyncio.sleep(report.LATER_S * 20))


async def test_what_the_last_turn_left_to_say_is_said_at_the_stop(tmp_path, monkeypatch):
    """A stop within LATER_S of a turn: its events are published by close()."""
    from autosessd.sessions import report

    monkeypatch.setattr(report, "LATER_S", 3600.0)  # only the stop can publish them
    s = make(tmp_path)
    await request(s, A, 50)
    await request(s, B, 40)
    async with await s.admit() as t:
        assert (await s.turn(t, A)).restored is not None  # the stop comes before the request's end
    await s.close()
    assert [e["type"] for e in s.events._recent].count("restored") == 1


async def test_a_request_waiting_behind_another_warms_its_conversations_file(tmp_path, monkeypatch):
    """Issue 31: a request that has to wait for its slot behind another conversation's has its
    own file asked into the page cache (POSIX_FADV_WILLNEED) while it waits, once; a file
    larger than half the memory available is not, and is counted as such."""
    import os

    from autosessd.sessions import warm

    advised = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: advised.append((os.fstat(fd).st_ino, advice,
                                                                                         off, n)))
    monkeypatch.setattr(warm, "CHUNK", 100)  # Linux reads one readahead window per call: every chunk asked
    s = make(tmp_path)
    await request(s, A, 50)
    await request(s, B, 40)  # A saved at the switch
    t = await s.place(B)  # B's request runs; A's waits behind it
    waiting = asyncio.ensure_future(s.place(A))
    st = (tmp_path / f"auto-{A}.bin").stat()
    for _ in range(200):  # the advice is given in a worker thread
        await asyncio.sleep(0.01)
        if len(advised) >= len(range(0, st.st_size, 100)):
            break
    assert advised == [(st.st_ino, os.POSIX_FADV_WILLNEED, off, 100) for off in range(0, st.st_size, 100)]
    assert s.counters.warmed_files == 1 and s.counters.warmed_bytes == (tmp_path / f"auto-{A}.bin").stat().st_size
    t.release()
    (await waiting).release()
    t = await s.place(B)  # again, within REPEAT_S: not asked twice
    waiting = asyncio.ensure_future(s.place(A))
    await asyncio.sleep(0)
    assert len(advised) == len(range(0, st.st_size, 100))
    t.release()
    (await waiting).release()

    import psutil
    monkeypatch.setattr(warm, "REPEAT_S", 0.0)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 100})())
    t = await s.place(B)
    waiting = asyncio.ensure_future(s.place(A))
    await asyncio.sleep(0)
    assert len(advised) == len(range(0, st.st_size, 100)) and s.counters.warm_skipped_memory == 1
    t.release()
    (await waiting).release()


async def test_a_bug_in_a_waiting_hook_never_leaves_a_request_stuck_in_the_fifo(tmp_path):
    """Placement.on_wait hooks (warm.py) run as a request starts to wait: one that raises is
    logged, and the request still gets the slot when it frees."""
    s = make(tmp_path)

    def broken(key):
        raise RuntimeError("hook bug")

    s.placement.on_wait.insert(0, broken)
    t = await s.place(B)
    waiting = asyncio.ensure_future(s.place(A))
    await asyncio.sleep(0.01)
    t.release()
    (await asyncio.wait_for(waiting, 2)).release()


async def test_the_stop_decides_on_the_files_as_they_landed_not_on_a_finalize_that_failed(tmp_path, monkeypatch):
    """A save while idle whose finalize then fails for good (EIO at every try, issue 38): the
    stop, which waits for every finalize anyway, sees the file missing and saves again, instead
    of taking the failed one's Pending for an up-to-date file."""
    import threading

    from autosessd.sessions import finalizing

    monkeypatch.setattr(finalizing, "RETRY_S", (0.01, 0.01, 0.01))
    s = make(tmp_path, min_tokens=10)
    await request(s, A, 50)
    gate, real, calls = threading.Event(), s.store.finalize, []

    def failing(key, meta, digest=None):
        calls.append(key)
        if len(calls) > 4:  # the first save's four tries
            return real(key, meta, digest)
        gate.wait(10)
        raise OSError(5, "Input/output error")

    s.store.finalize = failing
    [saved] = await s.idle.save_now()
    assert saved["saved"] and s.saver.writing() == {f"auto-{A}.bin"}
    saves = len(s.engine.saves)
    stop = asyncio.ensure_future(s.save_at_stop(0, "stop"))
    await asyncio.sleep(0.05)
    gate.set()
    assert await asyncio.wait_for(stop, 10)
    assert len(s.engine.saves) == saves + 1 and s.counters.save_failures == 4
    await s.drain()
    assert file_tokens(tmp_path, A) == conv(A, 50)
