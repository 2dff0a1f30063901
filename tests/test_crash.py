"""Crash safety: SIGKILL at random points of save → finalize → metadata → prune, then the
next start's cleanup, then the invariants a later restore relies on.

The fast loop forks a child that runs the daemon's own save path (Sessions._save through
Store.finalize and prune) against an engine stub that writes its state file slowly, and
kills it at a random moment; hundreds of iterations take seconds. A slower loop kills the
real daemon (gate + the real llama-server) in the middle of conversation switches.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

from autosessd import slotfile
from autosessd.config import parse
from autosessd.engines.base import RestoreResult, SaveResult, SlotState
from autosessd.policy import Held
from autosessd.sessions import Sessions
from autosessd.store import AUTO_BIN, TEMP_PREFIX, Store
from harness import Daemon, chat_body, long_text

BYTES_PER_TOKEN = 997


def content(n_tokens: int) -> bytes:
    """What the slow engine writes for a state of n_tokens: llama-server's header, then a pattern."""
    return slotfile.build(list(range(n_tokens)), bytes((i * 7) % 251 for i in range(n_tokens * BYTES_PER_TOKEN)))


class SlowEngine:
    kind = "llama-server"
    address = "slow"
    magic = b"qsgg"

    def __init__(self, directory: Path):
        self.dir = directory
        self.tokens = 0

    async def save(self, slot, name):
        data = content(self.tokens)
        with open(self.dir / name, "wb") as f:
            for i in range(0, len(data), 64 * 1024):
                f.write(data[i:i + 64 * 1024])
                f.flush()
                await asyncio.sleep(0.0005)
        return SaveResult(self.tokens, len(data), 1.0)

    async def restore(self, slot, name):
        return RestoreResult(self.tokens, 0, 1.0)

    async def slots(self):
        return [SlotState(0, False, self.tokens)]

    async def health(self):
        return True

    async def info(self):
        raise NotImplementedError

    async def close(self):
        pass


def child(session_dir: Path, state_dir: Path, seed: int) -> None:
    """Runs in the forked child: cleanup (a start), then saves and prunes until killed."""
    rng = random.Random(seed)
    cfg = parse(f'slot_save_path = "{session_dir}"\nauto_sessions_min_tokens = 1\nauto_sessions_keep = 3\n'
                f'state_dir = "{state_dir}"\n'.encode())
    store = Store(session_dir)
    store.cleanup()
    engine = SlowEngine(session_dir)
    s = Sessions(cfg, engine, store, "m", "m")

    async def loop():
        while True:
            key = f"{rng.randrange(6):016x}"
            engine.tokens = rng.randrange(50, 400)
            await s._save(s.slot(0), Held(key, engine.tokens, True), None)
            await s.prune()
            await s.drain()

    asyncio.run(loop())


def check_invariants(session_dir: Path, manual: dict[str, bytes]) -> None:
    names = set(os.listdir(session_dir))
    assert not [n for n in names if n.startswith(TEMP_PREFIX)], names
    for name in names:
        if m := AUTO_BIN.match(name):
            key = m.group(1)
            data = (session_dir / name).read_bytes()
            meta = json.loads((session_dir / f"auto-{key}.json").read_text())
            assert meta["bytes"] == len(data) and meta["key"] == key
            n_tokens = slotfile.parse_header(data).n_tokens
            assert data == content(n_tokens), f"{name} differs from what the engine wrote"
            assert meta["n_tokens"] == n_tokens
        elif name.startswith("auto-") and name.endswith(".json") and len(name) == len("auto-") + 16 + 5:
            assert name[:-5] + ".bin" in names, f"{name} without its session"
    for name, data in manual.items():
        assert (session_dir / name).read_bytes() == data


def test_sigkill_at_random_points_never_leaves_a_torn_session(tmp_path):
    session_dir = tmp_path / "s"
    session_dir.mkdir()
    manual = {"mine.bin": b"a person's session", "notes.txt": b"hi", "auto-XYZ.bin": b"not ours"}
    for name, data in manual.items():
        (session_dir / name).write_bytes(data)
    rng = random.Random(1234)
    iterations, killed_mid_write = 300, 0
    for i in range(iterations):
        pid = os.fork()
        if pid == 0:
            try:
                child(session_dir, tmp_path / "state", i)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.0, 0.06))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        killed_mid_write += any(n.startswith(TEMP_PREFIX) for n in os.listdir(session_dir))
        Store(session_dir).cleanup()  # what the next start does
        check_invariants(session_dir, manual)
    # The kills did land inside saves, not only between them.
    assert killed_mid_write > iterations // 10
    assert any(AUTO_BIN.match(n) for n in os.listdir(session_dir))


@pytest.mark.engine
def test_sigkill_of_the_real_daemon_during_switches(engines, session_dir, tmp_path):
    import threading
    import urllib.request

    (session_dir / "mine.bin").write_bytes(b"keep")
    eng = engines(session_dir)
    bodies = [chat_body(long_text(30 + 10 * i, f"thing{i}") + "\nAnswer.") for i in range(3)]
    rng = random.Random(7)
    def traffic(gate_url: str) -> None:
        for _ in range(6):
            body = rng.choice(bodies)
            try:
                req = urllib.request.Request(gate_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=60).read()
            except OSError:
                return  # the daemon was killed under it: that is the point

    for _ in range(4):
        d = Daemon(tmp_path, session_dir, eng.url, min_tokens=50).start()
        t = threading.Thread(target=traffic, args=(d.gate_url,))
        t.start()
        time.sleep(rng.uniform(0.5, 2.5))
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        t.join(60)
        # The next start cleans up; then every auto file must be whole and agree with its metadata.
        d2 = Daemon(tmp_path, session_dir, eng.url, min_tokens=50).start()
        d2.stop()
        names = set(os.listdir(session_dir))
        assert not [n for n in names if n.startswith(TEMP_PREFIX)]
        for name in names:
            if m := AUTO_BIN.match(name):
                meta = json.loads((session_dir / f"auto-{m.group(1)}.json").read_text())
                data = (session_dir / name).read_bytes()
                assert meta["bytes"] == len(data) and data[:4] == b"qsgg"
        assert (session_dir / "mine.bin").read_bytes() == b"keep"
