"""The engine-log tail (enginetail.py) on the stub engine, fed llama-server b11434's own lines:
saves named by their tokens, the save that a request overtakes, rotation, truncation and
garbage, and a build whose lines changed (after an engine restart: test_enginetail_restart.py).

The stub differs from llama-server in what these tests make happen on cue: a request that
arrives while a save is written (llama-server defers the save until the request ends, so it
captures that request's state; the stub's save, wrapped, does the same), and an engine that
restarts between two lines. The real engine is in test_enginetail_real.py."""

import json
import logging
import os

import pytest

from autosessd.store import slotfile
from autosessd.base.config import ConfigError, parse
from autosessd.follow.enginetail import LINE, RUN_TTL_S, EngineTail
from autosessd.store.branches import branch_key
from autosessd.store.slotfile import encode
from autosessd.sessions.facade import Sessions
from autosessd.follow.follower import Follower
from enginetail_common import (A, A2, B, OPENER, STARTED, auto_files, jsonl, launch, make, release, restart, served,
                               settle, text, timings)


@pytest.mark.parametrize("fmt", [text, jsonl])
async def test_saves_are_named_by_their_tokens(tmp_path, fmt):
    s, tail, d = make(tmp_path)
    await served(s, tail, A, fmt=fmt)
    await settle(s, tail)
    assert auto_files(d) == {f"auto-{LINE}.bin": A}  # the first conversation takes the line's own name
    meta = json.loads((d / f"auto-{LINE}.json").read_text())
    assert meta["n_tokens"] == len(A) and meta["n_prompt"] == len(A) - 7 and meta["line"] == LINE

    await served(s, tail, B, fmt=fmt)  # another conversation: departs from A inside A's prompt
    await settle(s, tail)
    kb = branch_key(LINE, encode(B[:len(OPENER) + 1]))
    assert auto_files(d) == {f"auto-{LINE}.bin": A, f"auto-{kb}.bin": B}

    await served(s, tail, A2, fmt=fmt, cache_n=0)  # A goes on: its own file grows
    await settle(s, tail)
    assert auto_files(d) == {f"auto-{LINE}.bin": A2, f"auto-{kb}.bin": B}
    assert s.counters.saves == 3 and s.counters.engine_log_bad_lines == 0
    assert tail.describe()["formats"] == {"text" if fmt is text else "jsonl": 3 * 5}


async def test_below_min_tokens_nothing_is_saved(tmp_path):
    s, tail, d = make(tmp_path, min_tokens=1000)
    await served(s, tail, A)
    await settle(s, tail)
    assert auto_files(d) == {} and s.engine.saves == []


async def test_a_request_launched_while_its_save_is_written_leaves_no_file(tmp_path):
    """B arrives as A's save behind is sent: llama-server runs B first and then writes the save,
    which holds B. The log shows B's launch before the save's answer: the temporary is dropped,
    A's earlier file still holds A, and B is saved under its own name when it ends."""
    s, tail, d = make(tmp_path)
    await served(s, tail, A)
    await settle(s, tail)
    real_save = s.engine.save
    overtaken = []

    async def save_after_b(slot, name):
        if not overtaken:
            task = s.engine._tasks + 1
            with open(tail.path, "ab") as f:
                f.write(text(launch(0, task)) + b"\n")
            s.engine.ran(list(B), 0)  # the deferred save sees B's state
            overtaken.append(task)
        return await real_save(slot, name)

    s.engine.save = save_after_b
    tail.follower.skip_existing()
    await tail.handle(text(launch(0, s.engine._tasks + 1)))  # A goes on
    s.engine.ran(list(A2), 0)
    await tail.handle(text(release(0, s.engine._tasks, len(A2))))
    await settle(s, tail)
    assert s.counters.saves_discarded == 1
    assert auto_files(d) == {f"auto-{LINE}.bin": A}  # nothing holds B, nothing under A's name but A
    assert not list(d.glob(".autosessd-*"))
    # B's release comes: B is saved under its own name.
    await tail.handle(text(release(0, overtaken[0], len(B))))
    await settle(s, tail)
    kb = branch_key(LINE, encode(B[:len(OPENER) + 1]))
    assert auto_files(d) == {f"auto-{LINE}.bin": A, f"auto-{kb}.bin": B}


async def test_a_task_that_moved_during_the_save_drops_it_before_the_log_shows_the_launch(tmp_path):
    """The engine's log may lag its answers: the slot's task id is checked as well."""
    s, tail, d = make(tmp_path)
    await served(s, tail, A)
    await settle(s, tail)
    real_save = s.engine.save

    async def save_after_b(slot, name):
        s.engine.ran(list(B), 0)  # B ran; its lines are not in the log yet
        s.engine.save = real_save
        return await real_save(slot, name)

    s.engine.save = save_after_b
    await tail.handle(text(launch(0, s.engine._tasks + 1)))
    s.engine.ran(list(A2), 0)
    await tail.handle(text(release(0, s.engine._tasks, len(A2))))
    await settle(s, tail)
    assert s.counters.saves_discarded == 1 and auto_files(d) == {f"auto-{LINE}.bin": A}


async def test_garbage_rotation_and_truncation_are_counted_and_followed(tmp_path):
    """Through the file: the follower reads what llama-server wrote, around bad lines, a log
    rotated by rename (and a new engine writing the new file), and one truncated in place
    with the engine writing on at its offset (copytruncate: a hole of NULs)."""
    s, tail, d = make(tmp_path)
    log_path = tail.path

    def write(*lines, mode="ab"):
        with open(log_path, mode) as f:
            f.write(b"".join(line + b"\n" for line in lines))

    def request(tokens, cache_n=0):
        task = s.engine._tasks + 1
        s.engine.ran(list(tokens), 0)
        return [text(launch(0, task)), *(text(x) for x in timings(0, task, len(tokens) - 7 - cache_n, 8)),
                text(release(0, task, len(tokens)))]

    write(*(text(x) for x in STARTED))
    await tail.read_new_lines()
    write(b"\xff\xfe garbage", b'{"type": "log", "msg"', b'{"no": "type"}', b"\x01\x02", *request(A))
    await tail.read_new_lines()
    await settle(s, tail)
    assert s.counters.engine_log_bad_lines == 4 and auto_files(d) == {f"auto-{LINE}.bin": A}

    os.rename(log_path, log_path.with_suffix(".1"))  # logrotate, then the engine restarted
    for slot in s.engine.held:
        s.engine.held[slot], s.engine.task_ids[slot] = [], None
    write(*(text(x) for x in STARTED), mode="wb")
    await tail.read_new_lines()
    await settle(s, tail)
    assert s.counters.log_rotations == 1 and s.counters.restores == 1 and s.engine.held[0] == A

    size = log_path.stat().st_size
    os.truncate(log_path, 0)  # copytruncate: the engine writes on at its own offset
    with open(log_path, "r+b") as f:
        f.seek(size)
        f.write(b"".join(x + b"\n" for x in request(A2, cache_n=len(A))))
    await tail.read_new_lines()
    await settle(s, tail)
    assert s.counters.log_truncations == 1 and auto_files(d) == {f"auto-{LINE}.bin": A2}
    assert s.counters.restores_reused == 1 and s.counters.engine_log_bad_lines == 4


async def test_a_log_written_again_from_its_start_past_the_offset_is_read_from_its_start(tmp_path):
    """llama-server truncates its --log-file at every start; autosessd may be down meanwhile and
    find the new log longer than its recorded offset."""
    s, tail, d = make(tmp_path)
    with open(tail.path, "wb") as f:
        f.write(b"".join(text(x) + b"\n" for x in STARTED))
    await tail.read_new_lines()
    await served(s, tail, A)
    await settle(s, tail)
    await tail.stop(1)
    await s.last.record_stop(s.slots.values())  # as the daemon's stop does
    for slot in s.engine.held:
        s.engine.held[slot], s.engine.task_ids[slot] = [], None
    with open(tail.path, "wb") as f:  # a new engine (its times differ), a longer log than before
        f.write(b"".join(text(x, f"0.00.{i:03d}.111") + b"\n"
                         for i, x in enumerate([*STARTED, *[f"srv  load: filler {i}" for i in range(50)]])))
    s2 = Sessions(s.cfg, s.engine, s.store, "stub-model")
    tail2 = EngineTail(s.cfg, s2, str(tail.path))
    s2.on_engine_restart.append(tail2._engine_restarted)
    await tail2.read_new_lines()
    await settle(s2, tail2)
    assert s2.counters.log_truncations == 1 and s2.counters.restores == 1 and s.engine.held[0] == A


async def test_a_build_whose_lines_changed_is_said_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "autosessd")
    s, tail, d = make(tmp_path)
    for task in (5, 6, 7):  # a build that calls its launch and release lines otherwise
        await tail.handle(text(f"slot start_task__: id  0 | task {task} | starting"))
        s.engine.ran(list(A), 0)
        for line in timings(0, task, 50, 8):
            await tail.handle(text(line))
        await tail.handle(text(f"slot      finish: id  0 | task {task} | n_tokens = 70"))
    await tail.tick()
    assert s.counters.engine_log_unseen == 2  # the third is confirmed once its slot has been idle a while
    tail.suspects = {k: v - RUN_TTL_S for k, v in tail.suspects.items()}
    await tail.tick()
    assert s.counters.engine_log_unseen == 3 and tail.describe()["needed_lines_missing"] is True
    assert len([r for r in caplog.records if "does not show launched" in r.getMessage()]) == 1
    assert auto_files(d) == {}


async def test_requests_the_log_never_shows_are_found_by_the_engines_task_ids(tmp_path):
    s, tail, d = make(tmp_path)
    tail._engine_tasks = await tail._task_ids()
    s.engine.ran(list(A), 0)  # a request, and no line at all (-lv 0, --log-disable)
    await tail._check_tasks()
    s.engine.ran(list(B), 0)
    await tail._check_tasks()
    assert s.counters.engine_log_unseen == 2 and tail.warned_unseen
    await served(s, tail, A2)  # a request the log shows is not counted
    await tail._check_tasks()
    assert s.counters.engine_log_unseen == 2


async def test_first_start_mid_request_saves_what_the_release_left(tmp_path):
    """A release whose launch came before where the first start began reading: the request
    ran, and its state is saved by its tokens."""
    s, tail, d = make(tmp_path)
    s.engine.ran(list(A), 0)
    task = s.engine._tasks
    for line in timings(0, task, 60, 8):
        await tail.handle(text(line))
    await tail.handle(text(release(0, task, len(A))))
    await settle(s, tail)
    assert auto_files(d) == {f"auto-{LINE}.bin": A} and s.counters.engine_log_unseen == 0


async def test_the_restore_plan_skips_a_file_another_chosen_one_extends(tmp_path):
    s, tail, d = make(tmp_path, n_slots=3)
    await s.prepare()
    for name, tokens in (("auto-aaaaaaaaaaaaaaaa.bin", A[:40]), ("auto-bbbbbbbbbbbbbbbb.bin", A2),
                         ("auto-cccccccccccccccc.bin", B)):
        (d / name).write_bytes(slotfile.build(tokens, b""))
        s.index.add(name, tokens, "stub-model")
    s.last.entries = {0: {"key": LINE, "file": "auto-aaaaaaaaaaaaaaaa.bin", "at": 1.0},
                      1: {"key": LINE, "file": "auto-bbbbbbbbbbbbbbbb.bin", "at": 2.0},
                      2: {"key": LINE, "file": "auto-cccccccccccccccc.bin", "at": 0.5}}
    assert s.last.plan(s.slots, s.index) == [(1, LINE, "auto-bbbbbbbbbbbbbbbb.bin"),
                                             (2, LINE, "auto-cccccccccccccccc.bin")]


@pytest.mark.parametrize("toml, why", [
    ('[engine]\nlog = "engine.log"\n', "engine.log: must be an absolute path"),
    ('[engine]\nlog = "/var/log/e.log"\n[gate]\nlisten = "127.0.0.1:8081"\n', "engine.log: cannot be followed with "
                                                                                 "the gate on"),
    ('[engine]\nlog = "/var/log/e.log"\n[tail]\nrequest_log = "/var/log/r.jsonl"\n', "engine.log: cannot be "
                                                                                      "followed with a request log"),
    ('[engine]\nlog = "/var/log/e.log"\nkind = "control-stream"\ncontrol = "unix:/run/e.sock"\n',
     "engine.log: is llama-server's own log"),
    ('[engine]\nlog = 5\n', "engine.log: must be a string"),
])
def test_engine_log_config_errors_name_the_key(toml, why):
    with pytest.raises(ConfigError) as e:
        parse(f'slot_save_path = "/tmp"\n{toml}'.encode(), "c.toml")
    assert why in str(e.value)


def test_engine_log_flag_overrides_the_file():
    from autosessd.cli import RUN_FLAGS

    cfg = parse(b'slot_save_path = "/tmp"\n', "c.toml", {RUN_FLAGS["engine_log"]: "/var/log/llama.log"})
    assert cfg.engine.log == "/var/log/llama.log"


def test_follower_hole_and_rewrite(tmp_path):
    """The follower on its own: a hole of NULs after copytruncate under a writer at its offset
    is skipped, not read as a line; a file rewritten past the offset is read from its start."""
    p, state = tmp_path / "e.log", tmp_path / "state.json"
    p.write_bytes(b"one\ntwo\n")
    f = Follower(p, state)
    assert f.read() == [b"one", b"two"]
    os.truncate(p, 0)
    with open(p, "r+b") as fh:
        fh.seek(8)
        fh.write(b"three\n")
    assert f.read() == [b"three"] and f.truncations == 1
    f.save_state()
    p.write_bytes(b"new engine line 1\nnew engine line 2\n")  # longer than the offset (14)
    g = Follower(p, state)
    assert g.read() == [b"new engine line 1", b"new engine line 2"] and g.truncations == 1


async def test_a_missing_then_unreadable_log_is_said_once_each_and_counted(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, "autosessd")
    s, tail, d = make(tmp_path)
    await tail.read_new_lines()
    await tail.read_new_lines()
    assert s.counters.log_missing == 1
    assert [r.getMessage() for r in caplog.records if "does not exist (yet)" in r.getMessage()] == [
        f"engine log: {tail.path} does not exist (yet); it is read as soon as it appears: is llama-server run with "
        f"--log-file at this path (and can autosessd's user read it)?"]
    tail.path.write_bytes(b"".join(text(x) + b"\n" for x in STARTED))
    await tail.read_new_lines()
    assert s.counters.engine_log_starts == 1
    tail.follower._close()

    def no_permission(*a, **k):  # a log autosessd's user may not read (the tests run as root)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("autosessd.follow.follower.open_regular", no_permission)
    await tail.read_new_lines()
    await tail.read_new_lines()
    assert s.counters.log_missing == 2
    assert len([r for r in caplog.records if "cannot read" in r.getMessage()]) == 1
    monkeypatch.undo()
    tail.path.unlink()
    await tail.read_new_lines()
    assert any("does not exist any more" in r.getMessage() for r in caplog.records)


async def test_auto_sessions_off_saves_and_restores_nothing(tmp_path):
    """auto_sessions = false (at the start, or by a reload): both tails only follow."""
    import dataclasses

    from autosessd.follow.tail import Tail

    s, tail, d = make(tmp_path)
    await served(s, tail, A)
    await settle(s, tail)
    assert len(s.engine.saves) == 1
    s.cfg = dataclasses.replace(s.cfg, auto_sessions=False)  # a reload turns them off
    await served(s, tail, A2)
    await restart(s, tail)
    request_tail = Tail(s.cfg, s, str(tmp_path / "requests.jsonl"))
    await request_tail.handle(json.dumps({"event": "start", "id": "r1", "slot": 0, "key": "a" * 16}).encode())
    s.engine.ran(list(B), 0)
    await request_tail.handle(json.dumps({"event": "end", "id": "r1", "slot": 0, "n_tokens": len(B)}).encode())
    await settle(s, tail)
    assert len(s.engine.saves) == 1 and s.counters.restores == 0 and request_tail._save_tasks == {}
