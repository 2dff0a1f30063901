"""The gate in-process, with a stub engine behind Sessions: what needs no engine process."""

import threading

import aiohttp
import pytest

from autosessd.config import parse
from autosessd.gate import Gate
from autosessd.sessions import Sessions
from autosessd.store import Store
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
