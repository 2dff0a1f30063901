"""The engine-log tail (enginetail.py) on the stub engine, fed llama-server b11434's own lines:
saves named by their tokens, the save that a request overtakes, the restore after the engine
restarts, rotation, truncation and garbage, and a build whose lines changed.

The stub differs from llama-server in what these tests make happen on cue: a request that
arrives while a save is written (llama-server defers the save until the request ends, so it
captures that request's state; the stub's save, wrapped, does the same), and an engine that
restarts between two lines. The real engine is in test_enginetail_real.py."""

import asyncio
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
from autosessd.sessions.slot import Phase
from autosessd.store.directory import Store
from autosessd.follow.follower import Follower
from stub_engine import StubEngine

# Two conversations, as token ids: a shared template opener, then their own text.
OPENER = list(range(2, 12))
A = OPENER + list(range(100, 160))
A2 = A + list(range(160, 200))  # A goes on
B = OPENER + list(range(500, 570))


def make(tmp_path, n_slots=1, min_tokens=10, clears_idle=False):
    d = tmp_path / "s"
    d.mkdir(parents=True, exist_ok=True)
    cfg = parse(f'slot_save_path = "{d}"\nauto_sessions_min_tokens = {min_tokens}\n'
                f'state_dir = "{tmp_path / "state"}"\n[engine]\nlog = "{tmp_path / "engine.log"}"\n'.encode())
    s = Sessions(cfg, StubEngine(d, n_slots=n_slots, clears_idle=clears_idle), Store(d), "stub-model",
                 n_slots=n_slots, empties_idle_slots=clears_idle)
    tail = EngineTail(cfg, s, cfg.engine.log)
    s.on_engine_restart.append(tail._engine_restarted)
    return s, tail, d


def text(msg: str, ts: str = "0.03.276.238") -> bytes:
    return f"{ts} I {msg}".encode()


def jsonl(msg: str) -> bytes:
    return json.dumps({"type": "log", "time": 3276238, "level": "info", "msg": msg + "\n"}).encode()


def launch(slot, task):
    return f"slot launch_slot_: id  {slot} | task {task} | processing task, is_child = 0"


def timings(slot, task, prompt_n, eval_n):
    return [f"slot print_timing: id  {slot} | task {task} | prompt eval time =     294.19 ms /    {prompt_n} tokens "
            f"(    9.49 ms per token,   105.37 tokens per second)",
            f"slot print_timing: id  {slot} | task {task} |        eval time =     248.07 ms /     {eval_n} tokens "
            f"(   35.44 ms per token,    28.22 tokens per second)",
            f"slot print_timing: id  {slot} | task {task} |       total time =     542.27 ms /    {prompt_n + eval_n} "
            f"tokens"]


def release(slot, task, n):
    return f"slot      release: id  {slot} | task {task} | stop processing: n_tokens = {n}, truncated = 0"


STARTED = ["srv  llama_server: initializing ...",
           "srv    load_model: initializing, n_slots = 1, n_ctx_slot = 8192, kv_unified = 'false'",
           "srv  llama_server: model loaded", "srv  llama_server: listening on http://127.0.0.1:8080"]


async def served(s, tail, tokens, slot=0, fmt=text, cache_n=0, generated=8):
    """One request as llama-server runs and logs it: launch, the slot's new tokens, timings, release."""
    task = s.engine._tasks + 1
    await tail.handle(fmt(launch(slot, task)))
    s.engine.ran(list(tokens), slot)
    for line in timings(slot, task, len(tokens) - generated + 1 - cache_n, generated):
        await tail.handle(fmt(line))
    await tail.handle(fmt(release(slot, task, len(tokens))))
    return task


async def settle(s, tail):
    for _ in range(3):
        for task in list(tail._save_tasks.values()):
            await task
        if tail._restore_task is not None:
            await tail._restore_task
        await s.drain()


def auto_files(d):
    """name → the tokens its header holds."""
    return {p.name: list(slotfile.read_header(p).tokens) for p in sorted(d.glob("auto-*.bin"))}


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


async def restart(s, tail, fmt=text):
    """The engine restarts: its slots are empty, its task ids start over, its log starts again."""
    s.engine.restart()
    for line in STARTED:
        await tail.handle(fmt(line))
    await tail.after_batch()
    await settle(s, tail)


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
