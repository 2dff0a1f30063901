"""The daemon's log (daemon.setup_logging): written by a thread of its own, so the event loop
never waits for stderr (a file under a big save's writeback, a full pipe), and nothing queued
is lost when the daemon stops."""

import json
import logging
import sys
import threading

import pytest

from autosessd import daemon


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
        daemon.stop_logging()
        for lg, (handlers, level, propagate) in zip(loggers, kept):
            lg.handlers[:], lg.propagate = handlers, propagate
            lg.setLevel(level)


def setup(stuck, fmt, monkeypatch):
    monkeypatch.setattr(sys, "stderr", stuck)  # in the test itself: pytest's capture sets its own before
    daemon.setup_logging("info", fmt)


def test_a_log_line_never_waits_for_stderr_and_none_is_lost_at_the_stop(stuck, monkeypatch):
    setup(stuck, "text", monkeypatch)
    log = logging.getLogger("autosessd")
    for i in range(3):
        log.info("auto sessions: line %d", i)
    assert stuck.text == []  # handed over: the writer waits for stderr, the caller did not
    stuck.go.set()
    daemon.stop_logging()
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
    daemon.stop_logging()
    line = json.loads("".join(stuck.text).strip())
    assert line["level"] == "error" and line["msg"] == "auto sessions: ['first']"
    assert "ValueError: boom" in line["exc"]


def test_the_stop_does_not_wait_for_ever_on_a_stderr_that_blocks(stuck, monkeypatch):
    setup(stuck, "text", monkeypatch)
    logging.getLogger("autosessd").warning("auto sessions: stuck")
    done = threading.Event()
    t = threading.Thread(target=lambda: (daemon.stop_logging(), done.set()), daemon=True)
    t.start()
    assert done.wait(8), "stop_logging waited on a blocked stderr"  # its bound is 2 s; the write waits 10
