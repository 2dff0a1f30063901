"""The request-log follower and line parser: rotation, truncation, partial and bad lines, restarts."""

import json
import os

import pytest

from autosessd.follow.follower import MAX_LINE, Follower
from autosessd.follow.requestlog import BadLine, LogEvent, parse_line


def line(**d) -> bytes:
    return json.dumps(d).encode() + b"\n"


@pytest.fixture
def log(tmp_path):
    return tmp_path / "logs" / "requests.jsonl"


@pytest.fixture
def state(tmp_path):
    return tmp_path / "state" / "tail.json"


def append(path, data: bytes):
    path.parent.mkdir(exist_ok=True)
    with open(path, "ab") as f:
        f.write(data)


def test_log_that_does_not_exist_yet(log, state):
    f = Follower(log, state)
    assert f.read() == []
    append(log, b"a\nb\n")
    assert f.read() == [b"a", b"b"]


def test_partial_last_line_waits_for_its_newline(log, state):
    f = Follower(log, state)
    append(log, b'first\n{"half')
    assert f.read() == [b"first"]
    assert f.read() == []
    append(log, b' done"}\n')
    assert f.read() == [b'{"half done"}']


def test_rotation_by_rename_finishes_the_old_file_first(log, state):
    f = Follower(log, state)
    append(log, b"1\n")
    assert f.read() == [b"1"]
    append(log, b"2\n")
    os.rename(log, log.with_suffix(".1"))
    append(log.with_suffix(".1"), b"3\n")  # a writer still holding the old file
    append(log, b"4\n")
    assert f.read() == [b"2", b"3", b"4"]
    append(log, b"5\n")
    assert f.read() == [b"5"]


def test_copytruncate_starts_again_at_zero(log, state):
    f = Follower(log, state)
    append(log, b"one\ntwo\n")
    assert f.read() == [b"one", b"two"]
    with open(log, "r+b") as fh:
        fh.truncate(0)
    append(log, b"x\n")
    assert f.read() == [b"x"]


def test_restart_neither_replays_nor_misses(log, state):
    f = Follower(log, state)
    append(log, b"a\nb\n")
    assert f.read() == [b"a", b"b"]
    f.save_state()
    append(log, b"c\n")  # written while the daemon is down
    f2 = Follower(log, state)
    append(log, b"d\n")
    assert f2.read() == [b"c", b"d"]


def test_restart_after_rotation_while_down_reads_the_new_file_from_zero(log, state):
    f = Follower(log, state)
    append(log, b"a\n")
    f.read()
    f.save_state()
    os.rename(log, log.with_suffix(".1"))
    append(log, b"new\n")
    assert Follower(log, state).read() == [b"new"]


def test_over_long_line_is_skipped_to_its_newline(log, state):
    f = Follower(log, state)
    append(log, b"ok1\n" + b"x" * (MAX_LINE + 100))
    assert f.read() == [b"ok1"]
    append(log, b"y" * 1000 + b"\nok2\n")
    assert f.read() == [b"ok2"]
    assert f.too_long == 1


@pytest.mark.parametrize("raw, ev", [
    (line(event="start", id="r1", slot=0, key="0123456789abcdef"), LogEvent("start", "r1", 0, key="0123456789abcdef")),
    (line(ts=1.0, event="start", id=7, messages=[{"role": "user", "content": "Hello"}], extra="ignored"),
     LogEvent("start", "7", 0, key="f7ff9e8b7bb2e09b")),
    (line(event="start", id="r2"), LogEvent("start", "r2", 0, key=None)),
    (line(event="end", id="r1", slot=0, n_tokens=27174, status="ok"),
     LogEvent("end", "r1", 0, n_tokens=27174, status="ok")),
    (line(event="end", id="r1", status="cancelled"), LogEvent("end", "r1", 0, n_tokens=None, status="cancelled")),
    (line(event="end", id="r1", n_tokens=900, n_prompt=880, cache_n=12),
     LogEvent("end", "r1", 0, n_tokens=900, status="ok", cache_n=12, n_prompt=880)),
    # A prompt longer than the state: the engine cut its context; the end counts, its n_prompt not.
    (line(event="end", id="r1", n_tokens=10, n_prompt=11), LogEvent("end", "r1", 0, n_tokens=10, status="ok")),
])
def test_parse_line(raw, ev):
    assert parse_line(raw.strip()) == ev


@pytest.mark.parametrize("raw", [
    b"\xff\xfe", b"not json", b"[1]", b"{}", b'{"event": "begin", "id": 1}', b'{"event": "start"}',
    b'{"event": "start", "id": true}', b'{"event": "start", "id": 1, "key": "../../etc/passwd"}',
    b'{"event": "start", "id": 1, "key": "0123456789ABCDEF"}', b'{"event": "start", "id": 1, "slot": -1}',
    b'{"event": "end", "id": 1, "n_tokens": -5}', b'{"event": "end", "id": 1, "status": "maybe"}',
    b'{"event": "end", "id": 1, "n_prompt": 1.5}',
    b"[" * 10000,
])
def test_bad_lines_are_refused_with_a_reason(raw):
    with pytest.raises(BadLine):
        parse_line(raw)
