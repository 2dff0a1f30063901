"""autosessd against the real engine, driven only through autosessctl and the socket."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from autosessd.base.keys import conversation_key
from harness import Daemon, answer, chat_body, going_on, hook_turn, long_text, wait_until

pytestmark = pytest.mark.engine

A = chat_body(long_text(70) + "\nHow many marbles are in box 5?")
B = chat_body(long_text(40, "jar") + "\nWhich jar is red?")
KA, KB = conversation_key(A), conversation_key(B)


def ctl(d, *args, check=True):
    r = subprocess.run([sys.executable, "-c", "from autosessd.cli import autosessctl_main; autosessctl_main()",
                        "--socket", str(d.socket), *args], capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def ctl_json(d, *args):
    return json.loads(ctl(d, *args, "--json").stdout)


@pytest.fixture
def daemon(engines, session_dir, tmp_path):
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url, gate=False).start()
    yield eng, d
    d.stop()


def test_autosessctl_against_the_real_engine(daemon, session_dir):
    eng, d = daemon
    st = ctl_json(d, "status")
    for field in ("version", "engine", "slots", "counters", "store", "inputs"):
        assert field in st
    assert {"kind", "url", "healthy", "model", "slots"} <= set(st["engine"])
    assert {"turns", "saves", "restores", "save_failures", "restore_failures", "skipped_min_tokens",
            "restores_not_reused", "bad_log_lines"} <= set(st["counters"])
    assert {"path", "auto_files", "auto_bytes", "free_bytes"} <= set(st["store"])
    assert "socket" in st["inputs"]
    assert "autosessd" in ctl(d, "status").stdout

    assert json.loads(ctl(d, "--json", "status").stdout)["version"]  # --json also before the command
    (session_dir / "notes.txt").write_text("mine")

    follower = subprocess.Popen([sys.executable, "-c", "from autosessd.cli import autosessctl_main; "
                                 "autosessctl_main()", "--socket", str(d.socket), "events", "-f"],
                                stdout=subprocess.PIPE, text=True)
    seen: list[str] = []
    threading.Thread(target=lambda: seen.extend(follower.stdout), daemon=True).start()
    try:
        hook_turn(d, A)  # the turn hook, as a serving layer uses it, then the request straight to the engine
        a1 = eng.post("/v1/chat/completions", A)
        r = ctl(d, "park")
        assert f"to auto-{KA}.bin" in r.stdout
        wait_until(lambda: any("saved" in line and KA in line for line in seen), 10, what="events -f to show the save")
    finally:
        follower.terminate()
    assert ctl(d, "park", "--name", "mine").returncode == 0
    assert (session_dir / "mine.bin").exists()

    eng.post("/v1/chat/completions", B)  # the engine now holds B
    r = ctl(d, "restore", KA)
    assert "restored" in r.stdout
    hook_turn(d, A)  # a serving layer asks before every request (the restored A is held: nothing to do)
    a2 = eng.post("/v1/chat/completions", A)
    assert a2["timings"]["cache_n"] >= 0.9 * a2["usage"]["prompt_tokens"]
    assert a2["choices"][0]["message"]["content"] == a1["choices"][0]["message"]["content"]

    ls = ctl(d, "ls").stdout
    assert f"auto-{KA}.bin" in ls and "mine.bin" in ls and "manual" in ls

    r = ctl(d, "prune", "--dry-run", "--keep", "0")
    assert f"would remove auto-{KA}.bin" in r.stdout and (session_dir / f"auto-{KA}.bin").exists()
    r = ctl(d, "prune", "--keep", "0")
    assert f"removed auto-{KA}.bin" in r.stdout and not (session_dir / f"auto-{KA}.bin").exists()
    assert (session_dir / "mine.bin").exists() and (session_dir / "notes.txt").read_text() == "mine"

    ctl(d, "park")
    assert (session_dir / f"auto-{KA}.bin").exists()
    out = ctl(d, "forget", KA).stdout
    assert f"forgot {KA}: 1 file(s) removed" in out and "emptied" in out  # the slot held it: emptied too
    assert not (session_dir / f"auto-{KA}.bin").exists() and not (session_dir / f"auto-{KA}.json").exists()
    r = ctl(d, "forget", KA, check=False)
    assert r.returncode == 1 and f"no conversation {KA}" in r.stderr
    r = ctl(d, "restore", "../../etc/passwd", check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr


def test_turn_hook_switch_away_and_back(daemon, session_dir, model):
    eng, d = daemon
    hook_turn(d, A)
    a1 = eng.post("/v1/chat/completions", A)
    t = hook_turn(d, B)
    assert t["saved"]["key"] == KA
    eng.post("/v1/chat/completions", B)
    a2_body = going_on(A, a1)  # A goes on from its answer, as a client's next request does
    t = hook_turn(d, a2_body)
    assert t["saved"]["key"] == KB and t["restored"]["key"] == KA
    a2 = eng.post("/v1/chat/completions", a2_body)
    assert a2["timings"]["cache_n"] >= 0.9 * a2["usage"]["prompt_tokens"]
    eng.post("/slots/0?action=erase", {})  # the engine alone, reading it from its first token
    assert answer(eng.post("/v1/chat/completions", a2_body)) == answer(a2)


def test_sigterm_with_a_request_in_flight_saves_nothing_partial(daemon, session_dir):
    eng, d = daemon
    hook_turn(d, A)
    long = chat_body(A["messages"][0]["content"], max_tokens=3000)
    def request():
        try:
            eng.post("/v1/chat/completions", long)
        except OSError:
            pass  # the engine is stopped under it at the end of the test

    t = threading.Thread(target=request, daemon=True)
    t.start()
    wait_until(lambda: eng.get("/slots")[0]["is_processing"], 30, what="the request to be running")
    assert d.stop(signal.SIGTERM) == 0
    assert "a request is running" in d.logtext()
    assert not list(session_dir.glob("auto-*"))
    eng.stop(signal.SIGKILL)  # llama-server's SIGTERM waits out the 3,000-token answer (20 s)


def test_not_running_and_permission_exit_codes(tmp_path, daemon):
    _, d = daemon
    r = ctl(d, "--socket", str(tmp_path / "none.sock"), "status", check=False)
    assert r.returncode == 3 and str(tmp_path / "none.sock") in r.stderr and "not running" in r.stderr
    assert ctl(d, "bogus", check=False).returncode == 2
    assert os.stat(d.socket).st_mode & 0o777 == 0o600
    assert os.stat(d.socket.parent).st_mode & 0o777 == 0o700


def test_another_uid_is_refused(engines, session_dir, tmp_path):
    if os.geteuid() != 0:
        pytest.skip(reason="dropping to another uid needs root")
    import tempfile

    top = tempfile.mkdtemp(prefix="autosessd-peer-")  # world-traversable, unlike pytest's tmp
    os.chmod(top, 0o755)
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url, gate=False, socket=Path(top) / "ctl" / "a.sock").start()
    try:
        os.chmod(d.socket.parent, 0o755)  # the directory no longer protects it: the socket's mode does
        assert as_other_uid(d.socket) == "4: permission denied: " + str(d.socket) + \
            " (run as the daemon's user, root, or a member of control.group)"
        os.chmod(d.socket, 0o666)  # nor does the mode: the peer check still refuses
        assert as_other_uid(d.socket) == "4: permission denied: uid 65534 may not use this socket"
        assert ctl(d, "status").returncode == 0  # and the owner is still served
    finally:
        d.stop()
        import shutil

        shutil.rmtree(top, ignore_errors=True)  # outside pytest's tmp: nothing left in /tmp


def as_other_uid(path) -> str:
    """autosessctl's call() from a forked child running as uid 65534: "exit code: message"."""
    from autosessd import ctl as ctl_mod

    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rd)
        try:
            os.setgid(65534)
            os.setuid(65534)
            ctl_mod.call(path, "status", timeout=10)
            out = "0: ok"
        except ctl_mod.CtlError as e:
            out = f"{e.exit_code}: {e}"
        except BaseException as e:  # noqa: BLE001 - report anything to the parent
            out = f"?: {e!r}"
        os.write(wr, out.encode())
        os._exit(0)
    os.close(wr)
    with os.fdopen(rd) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out
