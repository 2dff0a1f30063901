"""Engine restarts seen by the watch (watch.py): /health going down and up, another process on
the engine's port; each engine process reported once, whether the watch or the engine's own
log (enginetail.py) saw it first. A scripted engine: health answers and port owners on cue."""

import asyncio
from types import SimpleNamespace

from autosessd.base.config import parse
from autosessd.sessions.watch import EngineWatch


class Scripted:
    address = "http://127.0.0.1:8080"

    def __init__(self):
        self.up = True

    async def health(self):
        return self.up


def make(monkeypatch, owner):
    engine = Scripted()
    reports = []

    async def on_restart(why):
        reports.append(why)

    ctx = SimpleNamespace(engine=engine, cfg=parse(b'slot_save_path = "/tmp"\n'))
    w = EngineWatch(ctx, on_restart, True)
    monkeypatch.setattr(w, "identity", lambda: owner[0])
    return w, engine, reports


async def until(pred, timeout=2.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.005)


async def test_down_and_up_is_one_restart_and_the_new_pid_is_not_reported_again(monkeypatch):
    owner = [(100, 1.0)]
    w, engine, reports = make(monkeypatch, owner)
    task = asyncio.ensure_future(w.run(every_s=0.01, identity_every_s=0.03))
    try:
        await asyncio.sleep(0.05)
        engine.up = False
        await asyncio.sleep(0.05)
        owner[0] = (200, 2.0)
        engine.up = True
        await until(lambda: reports)
        await asyncio.sleep(0.15)  # several identity checks meet pid 200: already reported
        assert reports == ["the engine restarted (health went down and up)"]
        owner[0] = (300, 3.0)  # a quick restart between two health checks
        await until(lambda: len(reports) == 2)
        assert reports[1] == "another engine process (pid 300) took its port"
    finally:
        task.cancel()


async def test_a_restart_the_log_reported_first_is_not_reported_by_the_watch(monkeypatch):
    owner = [(100, 1.0)]
    w, engine, reports = make(monkeypatch, owner)
    task = asyncio.ensure_future(w.run(every_s=0.01, identity_every_s=0.03))
    try:
        await asyncio.sleep(0.05)
        engine.up = False
        await asyncio.sleep(0.03)
        owner[0] = (200, 2.0)
        assert await w.seen_in_log("its log") is True  # the new engine's "model loaded"
        engine.up = True
        await asyncio.sleep(0.15)
        assert reports == ["its log"]
    finally:
        task.cancel()


async def test_without_an_identity_a_start_in_the_log_covers_the_down_and_up(monkeypatch):
    owner = [None]  # the engine's process is not visible here
    w, engine, reports = make(monkeypatch, owner)
    task = asyncio.ensure_future(w.run(every_s=0.01, identity_every_s=0.03))
    try:
        await asyncio.sleep(0.05)
        engine.up = False
        await w.seen_in_log("its log")
        await asyncio.sleep(0.03)
        engine.up = True
        await asyncio.sleep(0.1)
        assert reports == ["its log"]
        engine.up = False  # a later restart, not in the log: reported
        await asyncio.sleep(0.03)
        engine.up = True
        await until(lambda: len(reports) == 2)
    finally:
        task.cancel()
