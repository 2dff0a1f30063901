"""`autosessd run`: the start checks, seen from the command line as a user sees them."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness import free_port, wait_until

pytestmark = pytest.mark.engine


def run_daemon(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "autosessd", "run", *args], capture_output=True, text=True,
                          timeout=timeout)


def config(tmp_path, session_dir, url, **extra):
    f = tmp_path / "autosessd.toml"
    # Its own control socket: the default path is shared by every daemon on the machine.
    lines = [f'slot_save_path = "{session_dir}"', f'state_dir = "{tmp_path / "state"}"', "[engine]",
             f'url = "{url}"', "timeout_s = 3", "[control]", f'socket = "{tmp_path / "ctl" / "a.sock"}"']
    f.write_text("\n".join(lines) + "\n")
    return str(f)


def test_engine_without_slot_save_path(engines, tmp_path, session_dir):
    eng = engines(None)
    r = run_daemon("--config", config(tmp_path, session_dir, eng.url))
    assert r.returncode != 0
    assert "--slot-save-path" in r.stderr and str(session_dir) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_unreachable_engine_names_the_url(tmp_path, session_dir):
    url = f"http://127.0.0.1:{free_port()}"
    r = run_daemon("--config", config(tmp_path, session_dir, url))
    assert r.returncode != 0
    assert f"cannot reach the engine at {url}" in r.stderr and "Traceback" not in r.stderr


def test_engine_saving_elsewhere_is_refused(engines, tmp_path, session_dir):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    eng = engines(elsewhere)
    r = run_daemon("--config", config(tmp_path, session_dir, eng.url))
    assert r.returncode != 0
    assert f"--slot-save-path {session_dir}" in r.stderr and "somewhere other" in r.stderr
    # The engine wrote its probe where it saves; the message names it, ours stays clean.
    [probe] = elsewhere.iterdir()
    assert probe.name in r.stderr and list(session_dir.iterdir()) == []


def test_missing_session_dir(tmp_path):
    r = run_daemon("--config", config(tmp_path, tmp_path / "nope", "http://127.0.0.1:1"))
    assert r.returncode != 0 and "is not a directory" in r.stderr


def test_a_slot_the_engine_does_not_have_is_refused(engines, tmp_path, session_dir):
    eng = engines(session_dir, slots=2)
    cfg = config(tmp_path, session_dir, eng.url)
    Path(cfg).write_text(Path(cfg).read_text().replace("[engine]\n", "[engine]\nslot = 5\n", 1))
    r = run_daemon("--config", cfg)
    assert r.returncode != 0 and "engine.slot is 5" in r.stderr and "2 slot(s)" in r.stderr


def test_starts_cleans_up_and_stops_on_sigterm(engines, tmp_path, session_dir):
    eng = engines(session_dir)
    (session_dir / ".autosessd-0123456789abcdef.partial").write_bytes(b"torn")
    (session_dir / "mine.bin").write_bytes(b"keep me")
    err_file = tmp_path / "stderr"
    p = subprocess.Popen([sys.executable, "-m", "autosessd", "run", "--config",
                          config(tmp_path, session_dir, eng.url)], stderr=open(err_file, "wb"))
    try:
        # The leftover goes early in the start, before "ready": a SIGTERM between the two is a
        # stop before the start finished (its own case), so wait for the whole start.
        wait_until(lambda: "autosessd ready" in err_file.read_text(), 30, what="the start to finish")
        assert not (session_dir / ".autosessd-0123456789abcdef.partial").exists()
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        err = err_file.read_text()
        assert "stopping (SIGTERM)" in err and "before the start finished" not in err
        # One line at start says the engine's whole saves go to a disk (here /tmp, where it is one).
        from autosessd.front.doctor import on_tmpfs

        assert ("on a disk: each save is written there whole" in err) == (on_tmpfs(str(session_dir)) is False)
        assert (session_dir / "mine.bin").read_bytes() == b"keep me"
        assert sorted(os.listdir(session_dir)) == ["mine.bin"]
    finally:
        p.kill()


def test_unwritable_gate_request_log_is_refused_clearly(tmp_path, session_dir):
    from harness import FakeEngine

    eng = FakeEngine(session_dir).start()
    try:
        log_dir = tmp_path / "a-directory"  # where the log file should be: cannot be opened for writing
        log_dir.mkdir()
        r = run_daemon("--config", config(tmp_path, session_dir, eng.url), "--gate", f"127.0.0.1:{free_port()}",
                       "--gate-request-log", str(log_dir))
        assert r.returncode == 1, r.stderr
        assert f"cannot start: gate.request_log {log_dir}: cannot open it for writing" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    finally:
        eng.stop()


def test_waiting_for_an_unreachable_engine_says_so_at_once_and_stops_on_sigterm(tmp_path, session_dir):
    url = f"http://127.0.0.1:{free_port()}"
    cfg_path = Path(config(tmp_path, session_dir, url))
    cfg_path.write_text(cfg_path.read_text().replace("timeout_s = 3", "timeout_s = 600"))
    err = tmp_path / "stderr"
    p = subprocess.Popen([sys.executable, "-m", "autosessd", "run", "--config", str(cfg_path)],
                         stderr=open(err, "wb"))
    try:
        # Long before the 600 s wait is over, the log names what it waits for, and why not yet.
        wait_until(lambda: f"waiting up to 600 s (engine.timeout_s) for the engine at {url}" in err.read_text(),
                   60, what="the wait to be announced")
        wait_until(lambda: f"not yet: cannot reach the engine at {url}" in err.read_text(), 60,
                   what="the reason it is still waiting")
        assert p.poll() is None  # and it keeps waiting
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0  # a stop does not wait for the engine wait to run out
        assert "stopping (SIGTERM) before the start finished" in err.read_text()
        assert "Traceback" not in err.read_text()
    finally:
        p.kill()
        p.wait()


def test_a_gate_address_in_use_is_refused_clearly(tmp_path, session_dir):
    import socket

    from harness import FakeEngine

    eng = FakeEngine(session_dir).start()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        r = run_daemon("--config", config(tmp_path, session_dir, eng.url), "--gate", f"127.0.0.1:{port}")
        assert r.returncode == 1, r.stderr
        assert f"cannot start: gate.listen 127.0.0.1:{port}: cannot listen there: " in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    finally:
        taken.close()
        eng.stop()
