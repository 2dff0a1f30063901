"""The gate in-process, with a stub engine behind Sessions: what needs no engine process."""

import threading

import aiohttp
import pytest

from autosessd.base.config import parse
from autosessd.front.gate import Gate
from autosessd.sessions.facade import Sessions
from autosessd.store.directory import Store
from harness import free_port
from stub_engine import StubEngine


@pytest.fixture
async def gate(tmp_path, session_dir):
    port = free_port()
    cfg = parse(f'slot_save_path = "{session_dir}"\nstate_dir = "{tmp_path}"\n'
                f'[engine]\nurl = "http://127.0.0.1:{free_port()}"\n[gate]\nlisten = "127.0.0.1:{port}"\n'.encode())
    g = Gate(cfg, Sessions(cfg, StubEngine(session_dir), Store(session_dir), "m"))
    await g.start()
    yield g, f"http://127.0.0.1:{port}"
    await g.stop(1)


async def test_status_endpoint_runs_off_the_event_loop(gate):
    """status() scans the session directory (thousands of files on a busy machine): the loop
    that forwards every other request must not wait for it."""
    g, url = gate
    threads = []
    real = g.sessions.status
    g.sessions.status = lambda: threads.append(threading.current_thread()) or real()
    async with aiohttp.ClientSession() as c:
        async with c.get(url + "/autosessd/status") as r:
            assert r.status == 200 and (await r.json())["engine"]["model_fingerprint"] == "m"
    assert threads and threads[0] is not threading.main_thread()


async def test_every_counter_reaches_status_and_metrics(gate, tmp_path):
    """Issue 18: each counter autosessd keeps is in `status --json` (the control socket and
    GET /autosessd/status give the same object) and in GET /autosessd/metrics, with its value
    (saves_missed among them: the one README's Limits tells people to watch)."""
    import dataclasses

    from autosessd.sessions.report import Counters

    g, url = gate
    fields = dataclasses.fields(Counters)
    for i, f in enumerate(fields):  # a value of its own for each, so a mix-up shows
        setattr(g.sessions.counters, f.name, (i + 1) * 10 if f.type == "int" else (i + 1) * 10 + 0.5)
    async with aiohttp.ClientSession() as c:
        async with c.get(url + "/autosessd/status") as r:
            status = await r.json()
        async with c.get(url + "/autosessd/metrics") as r:
            metrics = await r.text()
    lines = set(metrics.splitlines())
    for i, f in enumerate(fields):
        want = getattr(g.sessions.counters, f.name)
        assert status["counters"][f.name] == want, f.name
        metric = f"autosessd_{f.metadata['metric']}"
        assert f"# TYPE {metric} counter" in lines, f.name
        # In the metric's base unit (seconds for the fields kept in ms), exactly.
        scaled = want * f.metadata["scale"]
        assert f"{metric} {scaled!r}" in lines or f"{metric} {scaled}" in lines, f.name
        assert metric.endswith("_total") and "millisecond" not in metric, f.name
    assert "autosessd_saves_missed_total 120" in lines
    names = [ln.split()[2] for ln in metrics.splitlines() if ln.startswith("# TYPE")]
    assert len(names) == len(set(names))  # one name per counter
