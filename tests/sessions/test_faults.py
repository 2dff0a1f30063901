"""Faults the real engine cannot show on cue: a full disk, an engine that dies mid-save or
mid-restore, slow and oversized clients. The request's outcome is never worse than
without autosessd, and nothing torn stays under an auto-* name."""

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from autosessd.base.keys import conversation_key
from autosessd.store.directory import AUTO_BIN, TEMP_PREFIX
from fake_engine import answer_for
from harness import Daemon, FakeEngine, chat_body, saves_final, wait_until

A = chat_body("conversation A " * 120)   # ~ 600 tokens → ~1.2 MB at 2,000 bytes/token
B = chat_body("conversation B " * 120)
C = chat_body("conversation C " * 120)


def post(base, body, timeout=60):
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.load(r)


def no_torn_files(directory):
    saves_final(directory)  # a save's finalize runs after its request; a torn temporary stays
    for name in os.listdir(directory):
        assert not name.startswith(TEMP_PREFIX), name
        if m := AUTO_BIN.match(name):
            meta = json.loads((directory / f"auto-{m.group(1)}.json").read_text())
            assert meta["bytes"] == (directory / name).stat().st_size


@pytest.fixture
def small_fs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip(reason="mounting a small tmpfs for the session directory needs root")
    d = tmp_path / "small"
    d.mkdir()
    # mode=0700: a directory of its own, as autosessd requires (a tmpfs is mounted 1777 otherwise)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m,mode=0700", "tmpfs", str(d)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(reason=f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)])


def test_full_disk(small_fs, tmp_path):
    (small_fs / "mine.bin").write_bytes(b"m" * 2_400_000)  # a person's file takes half the disk
    eng = FakeEngine(small_fs, bytes_per_token=2000).start()
    d = Daemon(tmp_path, small_fs, eng.url, min_tokens=10).start()
    try:
        for body in (A, B, C, A):
            status, out = post(d.gate_url, body)
            assert status == 200 and out["choices"][0]["message"]["content"] == answer_for(body)
            no_torn_files(small_fs)
        st = d.status()
        # A and B fit; C's save did not and was refused before it started.
        assert st["counters"]["skipped_disk_full"] >= 1 and st["counters"]["save_failures"] >= 1
        assert "disk full" in d.logtext()
        saves = st["counters"]["saves"]
        # The prune after that turn made room: the next switch saves again.
        wait_until(lambda: d.status()["counters"]["pruned_files"] >= 1, 10, what="a prune that makes room")
        status, _ = post(d.gate_url, B)
        assert status == 200 and d.status()["counters"]["saves"] == saves + 1
        no_torn_files(small_fs)
        assert (small_fs / "mine.bin").read_bytes() == b"m" * 2_400_000
    finally:
        d.stop()
        eng.stop()


def test_enospc_during_the_engines_write_is_cleaned_up(small_fs, tmp_path):
    (small_fs / "mine.bin").write_bytes(b"m" * 4_500_000)  # no history: the first save is tried
    eng = FakeEngine(small_fs, bytes_per_token=2000).start()
    d = Daemon(tmp_path, small_fs, eng.url, min_tokens=10).start()
    try:
        post(d.gate_url, A)
        status, _ = post(d.gate_url, B)
        assert status == 200
        assert d.status()["counters"]["save_failures"] == 1
        no_torn_files(small_fs)
        assert not [n for n in os.listdir(small_fs) if n.startswith("auto-")]
    finally:
        d.stop()
        eng.stop()


@pytest.mark.parametrize("fault", ["die-save", "die-restore"])
def test_engine_dies_mid_action(session_dir, tmp_path, fault):
    from autosessd.store.directory import Store

    eng = FakeEngine(session_dir, faults=[fault]).start()
    d = Daemon(tmp_path, session_dir, eng.url, timeout_s=5).start()
    try:
        post(d.gate_url, A)
        if fault == "die-restore":
            post(d.gate_url, B)  # A is saved; going back to A restores it, and the engine dies
        with pytest.raises(urllib.error.HTTPError) as e:
            post(d.gate_url, A if fault == "die-restore" else B)
        # The engine is gone, so the request fails as it would have without autosessd,
        # with the gate's own error naming the engine.
        assert e.value.code == 502 and json.load(e.value)["error"]["src"] == "autosessd"
        counter = "restore_failures" if fault == "die-restore" else "save_failures"
        assert d.status()["counters"][counter] == 1
        assert d.stop() == 0
        Store(session_dir).cleanup()  # what the next start does
        no_torn_files(session_dir)
        if fault == "die-restore":
            assert (session_dir / f"auto-{conversation_key(A)}.bin").exists()  # the file survives its reader
        else:
            assert not [n for n in os.listdir(session_dir) if n.startswith("auto-")]
    finally:
        d.stop()
        eng.stop()


def test_slow_and_oversized_clients_do_not_stall_the_gate(session_dir, tmp_path):
    eng = FakeEngine(session_dir).start()
    d = Daemon(tmp_path, session_dir, eng.url).start()
    slow = []
    try:
        for _ in range(50):  # slowloris: headers that never end
            s = socket.create_connection(("127.0.0.1", d.gate_port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            slow.append(s)
        s = socket.create_connection(("127.0.0.1", d.gate_port))  # a body that never arrives
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{")
        slow.append(s)
        t0 = time.monotonic()
        status, _ = post(d.gate_url, A, timeout=10)
        assert status == 200 and time.monotonic() - t0 < 5
        # A body over the gate's limit is refused without reading it.
        big = socket.create_connection(("127.0.0.1", d.gate_port))
        big.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 5000000000\r\n\r\n{")
        big.settimeout(10)
        assert big.recv(100).startswith(b"HTTP/1.1 413")
        big.close()
        assert post(d.gate_url, B, timeout=10)[0] == 200
    finally:
        for s in slow:
            s.close()
        d.stop()
        eng.stop()
