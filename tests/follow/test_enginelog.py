"""llama-server's own log lines (enginelog.py), on lines b11434 wrote (tests/fixtures/engine-log/)
and on what it never writes: the format told per line, the needed lines found, the rest ignored,
unknown formats refused with a reason."""

from pathlib import Path

import pytest

from autosessd.follow.enginelog import (Activity, BadLine, Launch, Loaded, Release, Slots, Started, Timing, parse,
                                 prompt_counts)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "engine-log"


def events(name):
    out = []
    for line in (FIXTURES / name).read_bytes().split(b"\n"):
        ev = parse(line)  # no real line is a BadLine
        if ev is not None and not isinstance(ev, Activity):
            out.append(ev)
    return out


def test_text_log_one_slot():
    assert events("b11434-np1.log") == [
        Started(), Slots(1, False), Loaded(),
        Launch(0, 0), Timing(0, 0, "prompt", 31), Timing(0, 0, "eval", 8), Release(0, 0, 38, False),
        Launch(0, 10), Timing(0, 10, "prompt", 31), Timing(0, 10, "eval", 8), Release(0, 10, 76, False)]
    # The engine's own timings for the second request: cache_n 38, a prompt of 38 + 31.
    assert prompt_counts(38, 31, 8) == (0, 31)
    assert prompt_counts(76, 31, 8) == (38, 69)


def test_jsonl_log_four_slots():
    evs = events("b11434-npauto.jsonl")
    assert evs[:3] == [Started(), Slots(4, True), Loaded()]
    assert [e for e in evs if isinstance(e, (Launch, Release))] == [
        Launch(3, 0), Release(3, 0, 38, False), Launch(3, 9), Release(3, 9, 30, False)]
    assert prompt_counts(30, 18, 4) == (9, 27)  # the second conversation shared 9 tokens of the template


def test_slot_actions_are_not_in_the_log_and_a_request_saved_while_busy_is():
    evs = events("b11434-save-while-busy.log")
    assert [e for e in evs if isinstance(e, (Launch, Release))] == [
        Launch(0, 1), Release(0, 1, 38, False), Launch(0, 17), Release(0, 17, 73, False)]


def test_multi_line_messages_at_verbosity_4_are_ignored_not_refused():
    evs = events("b11434-lv4.log")
    assert Loaded() in evs and Launch(0, 0) in evs and Release(0, 0, 28, False) in evs
    assert parse(b"Hello<|im_end|>") is None and parse(b"'") is None
    assert parse(b"\trepeat_last_n = 64, repeat_penalty = 1.000") is None


def test_every_line_of_the_fixtures_is_a_known_format():
    for p in FIXTURES.glob("b11434-*"):
        for line in p.read_bytes().split(b"\n"):
            parse(line)


@pytest.mark.parametrize("line", [
    b"slot launch_slot_: id  2 | task 7 | processing task, is_child = 0",  # --no-log-prefix
    b"I slot launch_slot_: id  2 | task 7 | processing task, is_child = 0",  # no timestamps
    b"0.03.276.238 I slot launch_slot_: id  2 | task 7 | processing task, is_child = 0",
    b'{"type":"log","time":5405935,"level":"info","msg":"slot launch_slot_: id  2 | task 7 | processing task\\n"}',
    b"\0\0\0\0" + b"0.03.276.238 I slot launch_slot_: id  2 | task 7 | processing task",  # after a copytruncate hole
    b"0.03.276.238 I slot launch_slot_: id  2 | task 7 | processing task, is_child = 0\r",
])
def test_a_launch_in_every_prefix_and_format(line):
    assert parse(line) == Launch(2, 7)


@pytest.mark.parametrize("line", [
    b"0.00.010.334 I srv    load_model: loading model 'x.gguf'",
    b"0.03.276.028 I slot get_availabl: id  0 | task -1 | selected slot by LRU, t_last = -1",
    b'{"type":"fit_memory_breakdown","data":{"unit":"MiB"}}',
    b"garbage that is plain text",  # taken as a continuation line: llama-server writes those
    b"",
])
def test_lines_not_needed_are_ignored(line):
    assert parse(line) is None


@pytest.mark.parametrize("line, why", [
    (b"\xff\xfe\x00garbage", "not UTF-8"),
    (b"abc\x01\x02def", "control characters"),
    (b'{"type": "log", "msg": "slot', "not JSON"),
    (b"{not json at all", "not JSON"),
    (b'{"foo": 1}', "without a string \"type\""),
    (b'{"type": "log", "msg": 5}', "without a string \"msg\""),
    (b'  {"type": 3}', "without a string \"type\""),
])
def test_unknown_formats_are_refused_with_a_reason(line, why):
    with pytest.raises(BadLine, match=why):
        parse(line)

