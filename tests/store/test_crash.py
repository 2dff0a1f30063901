"""Crash safety: SIGKILL at random points of save → finalize → metadata → prune, then the
next start's cleanup, then the invariants a later restore relies on.

The fast loop forks a child that runs the daemon's own save path (Saver.save through
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

from autosessd.store import slotfile
from autosessd.base.config import parse
from autosessd.engines.base import RestoreResult, SaveResult, SlotState
from autosessd.sessions.policy import Held
from autosessd.sessions.facade import Sessions
from autosessd.store.directory import AUTO_BIN, TEMP_PREFIX, Store
from harness import Daemon, chat_body, long_text, wait_until

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
            await s.saver.save(s.slot(0), Held(key, engine.tokens, True), None)
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
    # At least 120 kills; on a loaded machine a child starts slower and more kills land
    # before its first write, so the run goes on (bounded) until 20 landed inside one.
    i, killed_mid_write = 0, 0
    while i < 120 or (killed_mid_write <= 20 and i < 1500):
        i += 1
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
    assert killed_mid_write > 20, f"{killed_mid_write} of {i} kills landed inside a save"
    assert any(AUTO_BIN.match(n) for n in os.listdir(session_dir))


def temporaries(session_dir: Path) -> list[str]:
    """A save's temporary (not the start's probe): it exists from the engine's write until
    autosessd renames it, so one seen means a save was under way."""
    return [n for n in os.listdir(session_dir)
            if n.startswith(TEMP_PREFIX) and n.endswith(".partial") and "probe" not in n]


@pytest.mark.engine
@pytest.mark.timeout(1200)  # four rounds of real conversations on a shared 2-core machine
def test_sigkill_of_the_real_daemon_during_switches(engines, session_dir, tmp_path):
    """Kills the real daemon while it switches conversations. Every kill comes after at
    least one save (counted in its log), half of them the moment a save's temporary shows
    up (the kill lands inside the save), half at a random moment; then the next start's
    cleanup must leave only whole files that agree with their metadata."""
    import threading
    import urllib.request

    (session_dir / "mine.bin").write_bytes(b"keep")
    eng = engines(session_dir)
    convs = [chat_body(long_text(30 + 10 * i, f"thing{i}") + "\nAnswer.")["messages"] for i in range(3)]
    rng = random.Random(7)

    def traffic(gate_url: str, stop: threading.Event) -> None:
        i = 0
        while not stop.is_set():
            c = i % 3 if i < 3 else rng.randrange(3)  # the first three switch for sure
            i += 1
            try:
                req = urllib.request.Request(gate_url + "/v1/chat/completions",
                                             data=json.dumps({**chat_body(""), "messages": convs[c]}).encode(),
                                             headers={"Content-Type": "application/json"})
                answer = json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["message"]["content"]
            except OSError:
                return  # the daemon was killed under it: that is the point
            # Conversations grow, as real ones do: a switch away then always has a new state
            # to save (an unchanged one is "up to date" and not written again).
            convs[c] = convs[c] + [{"role": "assistant", "content": answer},
                                   {"role": "user", "content": f"And box {i}?"}]
            if len(convs[c]) > 15:
                convs[c] = convs[c][:1]

    rounds: list[tuple[int, bool]] = []
    live: list[Daemon] = []
    try:
        run_rounds(session_dir, eng, traffic, rng, rounds, live)
    finally:
        for d in live:  # a failed round must not leave a daemon behind
            d.stop(signal.SIGKILL)
    # Each kill came after saves had happened, and at least one landed inside a save.
    assert all(saves >= 1 for saves, _ in rounds), rounds
    assert any(mid for _, mid in rounds), rounds


def run_rounds(session_dir, eng, traffic, rng, rounds, live) -> None:
    import threading

    tmp_path = session_dir.parent
    for r in range(4):
        d = Daemon(tmp_path, session_dir, eng.url, min_tokens=50)
        live.append(d)
        d.start()
        stop = threading.Event()
        t = threading.Thread(target=traffic, args=(d.gate_url, stop))
        t.start()
        wait_until(lambda: "auto sessions: saved" in d.logtext(), 300, what="a first save")
        if r % 2:
            # Kill inside a save: the moment its temporary appears (polled every millisecond).
            deadline = time.monotonic() + 300
            while not temporaries(session_dir) and time.monotonic() < deadline:
                time.sleep(0.001)
        else:
            time.sleep(rng.uniform(0.0, 1.5))
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        saves_before = d.logtext().count("auto sessions: saved")
        mid_save = bool(temporaries(session_dir))  # the daemon died before renaming it
        rounds.append((saves_before, mid_save))
        stop.set()
        t.join(120)
        # The killed daemon's last request may still be in its prefill (the engine notices the
        # closed connection only then); the next start checks the engine while it is idle.
        wait_until(lambda: not eng.get("/slots")[0]["is_processing"], 300, what="the engine to be idle")
        # The next start cleans up; then every auto file must be whole and agree with its metadata.
        d2 = Daemon(tmp_path, session_dir, eng.url, min_tokens=50)
        live.append(d2)
        d2.start().stop()
        names = set(os.listdir(session_dir))
        assert not [n for n in names if n.startswith(TEMP_PREFIX)]
        for name in names:
            if m := AUTO_BIN.match(name):
                meta = json.loads((session_dir / f"auto-{m.group(1)}.json").read_text())
                data = (session_dir / name).read_bytes()
                assert meta["bytes"] == len(data) and data[:4] == b"qsgg"
        assert (session_dir / "mine.bin").read_bytes() == b"keep"
