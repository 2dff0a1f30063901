"""The daemon's log (logs.setup_logging): written by a thread of its own, so the event loop
never waits for stderr (a file under a big save's writeback, a full pipe), and nothing queued
is lost when the daemon stops."""

import asyncio
import json
import logging
import sys
import threading
import time

import pytest

from autosessd.base import logs


class Stuck:
    """A stderr whose writes wait until let go."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.text: list[str] = []

    def write(self, s: str) -> None:
        self.go.wait(10)
        self.text.append(s)

    def flush(self) -> None:
        pass


@pytest.fixture
def stuck():
    s = Stuck()
    loggers = [logging.getLogger(n) for n in ("autosessd", "aiohttp")]
    kept = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    try:
        yield s
    finally:
        s.go.set()
        logs.stop_logging()
        for lg, (handlers, level, propagate) in zip(loggers, kept):
            lg.handlers[:], lg.propagate = handlers, propagate
            lg.setLevel(level)


def setup(stuck, fmt, monkeypatch):
    monkeypatch.setattr(sys, "stderr", stuck)  # in the test itself: pytest's capture sets its own before
    logs.setup_logging("info", fmt)


def test_a_log_line_never_waits_for_stderr_and_none_is_lost_at_the_stop(stuck, monkeypatch):
    setup(stuck, "text", monkeypatch)
    log = logging.getLogger("autosessd")
    for i in range(3):
        log.info("auto sessions: line %d", i)
    assert stuck.text == []  # handed over: the writer waits for stderr, the caller did not
    stuck.go.set()
    logs.stop_logging()
    out = "".join(stuck.text)
    assert [f" INFO auto sessions: line {i}" in out for i in range(3)] == [True] * 3, out


def test_a_json_line_keeps_its_message_and_traceback_apart(stuck, monkeypatch):
    setup(stuck, "json", monkeypatch)
    stuck.go.set()
    args = ["first"]
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("autosessd").exception("auto sessions: %s", args)
    args[0] = "changed"  # after the call: the line says what was logged
    logs.stop_logging()
    line = json.loads("".join(stuck.text).strip())
    assert line["level"] == "error" and line["msg"] == "auto sessions: ['first']"
    assert "ValueError: boom" in line["exc"]


def test_the_stop_does_not_wait_for_ever_on_a_stderr_that_blocks(stuck, monkeypatch):
    setup(stuck, "text", monkeypatch)
    logging.getLogger("autosessd").warning("auto sessions: stuck")
    done = threading.Event()
    t = threading.Thread(target=lambda: (logs.stop_logging(), done.set()), daemon=True)
    t.start()
    assert done.wait(8), "stop_logging waited on a blocked stderr"  # its bound is 2 s; the write waits 10


def lines(stuck):
    return [json.loads(x) for x in "".join(stuck.text).splitlines()]


def test_a_turns_line_is_built_after_the_turn_in_its_place_with_its_own_time(stuck, monkeypatch):
    """logs.soon: the record is built once the turn has handed its request on (issue 23: one
    line cost ~0.2 ms of the switch back, cold), yet the log reads as if it were logged then:
    before any line logged after it, with the time it was said."""
    setup(stuck, "json", monkeypatch)
    stuck.go.set()
    built = []
    make = logging.Logger.makeRecord
    monkeypatch.setattr(logging.Logger, "makeRecord", lambda self, *a, **k: built.append(a[4]) or make(self, *a, **k))
    log = logging.getLogger("autosessd.sessions.restores")
    monkeypatch.setattr(logs, "LATER_S", 0.15)  # wide enough to tell on a loaded machine

    async def turn():
        logs.soon(log, logging.INFO, "auto sessions: restored %s tokens", "21k")
        assert built == []  # nothing built on the request's path
        time.sleep(0.2)  # the loop busy: the line waits
        logging.getLogger("autosessd.front.gate").warning("auto sessions: later")
        logs.soon(log, logging.INFO, "auto sessions: restored %s tokens", "5k")
        await asyncio.sleep(0.05)
        assert len(built) == 2  # a line said after a flush waits its own LATER_S, not the first's
        await asyncio.sleep(0.2)  # the loop free: the line is written LATER_S after
        assert len(built) == 3
        logs.soon(log, logging.INFO, "auto sessions: said at the stop")
        logs.stop_logging()  # the loop's last moment: its timer never fires

    asyncio.run(turn())
    got = lines(stuck)
    assert [x["msg"] for x in got] == ["auto sessions: restored 21k tokens", "auto sessions: later",
                                       "auto sessions: restored 5k tokens", "auto sessions: said at the stop"]
    assert got[1]["ts"] - got[0]["ts"] >= 0.15  # the time it was said, not when it was built


def test_without_the_daemons_log_a_line_said_soon_is_logged_at_once(caplog):
    caplog.set_level(logging.INFO, "autosessd")
    logs.soon(logging.getLogger("autosessd.sessions.saves"), logging.INFO, "auto sessions: saved %s", "it")
    assert "auto sessions: saved it" in caplog.text


def test_a_line_said_soon_stays_first_while_another_thread_writes_it(stuck, monkeypatch):
    """A worker thread (a save's finalize) that logs flushes what waits; the loop's next line,
    logged while that thread is still building the waiting one, comes after it."""
    setup(stuck, "json", monkeypatch)
    stuck.go.set()
    log = logging.getLogger("autosessd.sessions.saves")
    inside, go_on = threading.Event(), threading.Event()
    make = logging.Logger.makeRecord

    def slow(self, *a, **k):
        if a[4].startswith("said first") and threading.current_thread() is not threading.main_thread():
            inside.set()
            go_on.wait(5)
        return make(self, *a, **k)

    monkeypatch.setattr(logging.Logger, "makeRecord", slow)

    async def turn():
        logs.soon(log, logging.INFO, "said first")
        worker = threading.Thread(target=lambda: log.info("the worker's line"))
        worker.start()
        assert inside.wait(5)
        threading.Timer(0.1, go_on.set).start()
        log.info("said second")  # waits for the worker's flush
        worker.join()

    asyncio.run(turn())
    logs.stop_logging()
    msgs = [x["msg"] for x in lines(stuck)]
    assert msgs[0] == "said first" and set(msgs[1:]) == {"said second", "the worker's line"}, msgs


def flooded(stuck, monkeypatch, bound: int, n: int) -> logging.Logger:
    """The daemon's log with at most `bound` lines waiting, and n lines logged to a stderr that blocks."""
    monkeypatch.setattr(logs, "QUEUE_MAX", bound)
    setup(stuck, "text", monkeypatch)
    log = logging.getLogger("autosessd")
    for i in range(n):
        log.info("auto sessions: line %d", i)
    return log


def lost_and_written(out: list[str]) -> tuple[list[str], int]:
    """The lines that say how many were dropped, and how many of the flood's lines were written."""
    return ([x for x in out if "dropped here while stderr was blocked" in x],
            sum("auto sessions: line" in x for x in out))


def test_a_stderr_blocked_for_long_holds_at_most_queue_max_lines_and_the_loss_is_said(stuck, monkeypatch):
    """A pipe nobody reads: the daemon logs on, its memory must not grow with every line."""
    log = flooded(stuck, monkeypatch, 50, 500)
    assert logs._writer.queue.qsize() <= 50  # the writer holds one more, waiting on stderr
    stuck.go.set()
    deadline = time.monotonic() + 5
    while logs._writer.queue.qsize() and time.monotonic() < deadline:
        time.sleep(0.01)
    log.info("auto sessions: after")  # the first line with room: the loss is said before it
    logs.stop_logging()
    out = "".join(stuck.text).splitlines()
    lost, written = lost_and_written(out)
    assert written <= 51 and len(lost) == 1 and " WARNING log: " in lost[0]
    assert int(lost[0].split("log: ")[1].split()[0].replace(",", "")) + written == 500
    assert out[-2] == lost[0] and out[-1].endswith("auto sessions: after")  # said where the gap is


def test_lines_dropped_just_before_the_stop_are_said_at_the_stop(stuck, monkeypatch):
    flooded(stuck, monkeypatch, 5, 20)
    stuck.go.set()
    logs.stop_logging()
    out = "".join(stuck.text).splitlines()
    lost, written = lost_and_written(out)
    assert lost == [out[-1]] and int(out[-1].split("log: ")[1].split()[0]) + written == 20


def test_the_first_line_after_drops_and_its_notice_never_pass_queue_max(monkeypatch):
    """The writer took one line of a full queue: the next line and the notice of what was dropped
    would be two in a room of one (CI saw 51 of 50). The line is dropped too, and counted."""
    import queue as q_mod
    monkeypatch.setattr(logs, "QUEUE_MAX", 3)
    monkeypatch.setattr(logs, "_dropped", 0)
    q = q_mod.SimpleQueue()
    h = logs._Handoff(q)
    rec = lambda i: logging.makeLogRecord({"name": "autosessd", "msg": f"line {i}", "levelno": 20})
    for i in range(5):
        h.enqueue(rec(i))  # 3 queued, 2 dropped
    q.get_nowait()  # the writer takes one: room for one
    h.enqueue(rec(5))
    assert q.qsize() <= 3 and logs._dropped == 3
    q.get_nowait()  # room for two: the notice, then the line
    h.enqueue(rec(6))
    got = [q.get_nowait().getMessage() for _ in range(q.qsize())]
    assert got[-2:] == ["log: 3 line(s) dropped here while stderr was blocked", "line 6"] and logs._dropped == 0
