"""`autosessd run --exec -- ENGINE ARGS…`: the engine as autosessd's child, as a process
manager (llama-swap) runs it. The command's reading is a pure table; the child's life is
driven with tests/fake_engine.py as the engine, as a user's process manager would drive it."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from autosessd.engines.child import ExecError, parse_command
from autosessd.base.keys import conversation_key
from fake_engine import answer_for
from harness import ROOT, chat_body, free_port, log_text, wait_until

FAKE = [sys.executable, str(ROOT / "tests" / "fake_engine.py")]
A = chat_body("conversation A " * 120)
B = chat_body("conversation B " * 120)


# -- reading the command (pure) ------------------------------------------------------------
@pytest.mark.parametrize("words, listen, rest, ssp, key", [
    (["llama-server", "-m", "m.gguf", "--port", "8080"], ("127.0.0.1:8080",), ("-m", "m.gguf"), None, None),
    # llama-server reads `_` in an option's name as `-`; the last of a repeated option wins
    (["ls", "--port", "1", "--host", "0.0.0.0", "--port", "9000", "-np", "2"], ("0.0.0.0:9000",), ("-np", "2"),
     None, None),
    (["ls", "--host", "127.0.0.1,::1", "--port", "8081"], ("127.0.0.1:8081", "[::1]:8081"), (), None, None),
    (["ls", "--slot_save_path", "rel/dir", "--port", "5"], ("127.0.0.1:5",), (), "/work/rel/dir", None),
    (["ls", "--port", "5", "--slot-save-path", "/abs/s/"], ("127.0.0.1:5",), (), "/abs/s", None),
    # the engine keeps its keys; autosessd's own calls use the first
    (["ls", "--api-key", "k1,k2", "--port", "5"], ("127.0.0.1:5",), ("--api-key", "k1,k2"), None, "k1"),
])
def test_the_command_is_read_as_llama_server_reads_it(words, listen, rest, ssp, key):
    cmd = parse_command(words, "/work")
    assert (cmd.listen, cmd.rest, cmd.slot_save_path, cmd.api_key) == (listen, rest, ssp, key)
    argv = cmd.argv("/bin/llama-server", 4321, "/sessions")
    # The engine listens on the private loopback port only, and saves where autosessd manages.
    assert argv[0] == "/bin/llama-server" and argv[-6:] == ["--host", "127.0.0.1", "--port", "4321",
                                                           "--slot-save-path", "/sessions"]
    assert argv.count("--port") == 1 and argv.count("--host") == 1


def test_the_api_key_file_gives_its_first_key(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# a comment\n\nsecret-1\nsecret-2\n")
    assert parse_command(["ls", "--api-key-file", str(f), "--port", "5"], "/").api_key == "secret-1"
    with pytest.raises(ExecError, match="cannot read it"):
        parse_command(["ls", "--api-key-file", str(tmp_path / "nope"), "--port", "5"], "/")


@pytest.mark.parametrize("words, why", [
    ([], "needs the engine's command after --"),
    (["llama-server", "-m", "m.gguf"], "has no --port"),
    (["llama-server", "--port", "http"], "must be a number from 1 to 65535, got 'http'"),
    (["llama-server", "--port", "70000"], "must be a number from 1 to 65535"),
    (["llama-server", "--port", "5", "--host", "/run/llm.sock"], "is a UNIX socket"),
    (["llama-server", "--port"], "ends with --port and no value"),
])
def test_commands_that_cannot_be_run_behind_the_gate(words, why):
    with pytest.raises(ExecError, match=why.replace("(", r"\(").replace(")", r"\)")):
        parse_command(words, "/")


# -- the command line ---------------------------------------------------------------------------
def autosessd(tmp_path, *args, timeout=60, **kw):
    return subprocess.run([sys.executable, "-m", "autosessd", "run", "--socket", str(tmp_path / "ctl.sock"),
                           "--state-dir", str(tmp_path / "state"), *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


@pytest.mark.parametrize("args, message", [
    (["--exec"], "--exec needs the engine's command after --"),
    (["--", "llama-server", "--port", "5"], "an engine command (llama-server) is given only with --exec"),
    (["--exec", "--", "no-such-llama-server", "--port", "5"], "no-such-llama-server: not found in PATH"),
    (["--exec", "--", "{tmp}/model.gguf", "--port", "5"], "{tmp}/model.gguf: not an executable file"),
    (["--exec", "--", "{tmp}", "--port", "5"], "{tmp}: not an executable file"),
    (["--exec", "--", "llama-server", "-m", "m.gguf"], "the engine command has no --port"),
    (["--gate", "127.0.0.1:5", "--exec", "--", "llama-server", "--port", "6"], "--gate and --exec"),
    (["--slot-save-path", "/a", "--exec", "--", "llama-server", "--port", "6", "--slot-save-path", "/b"],
     "--slot-save-path /a and the engine command's --slot-save-path /b differ"),
])
def test_bad_exec_input_is_a_usage_error(tmp_path, args, message):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    message = message.replace("{tmp}", str(tmp_path))
    if "--slot-save-path" not in args:
        args = ["--slot-save-path", str(tmp_path / "s"), *args]
    r = autosessd(tmp_path, *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_port_in_use_is_refused_before_the_engine_starts(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    marker = tmp_path / "engine-ran"
    try:
        r = autosessd(tmp_path, "--slot-save-path", str(tmp_path / "s"), "--exec", "--", "sh", "-c",
                      f"touch {marker}", "sh", "--port", str(port))
    finally:
        taken.close()
    assert r.returncode == 1, r.stderr
    assert f"cannot start: gate.listen 127.0.0.1:{port} (the engine command's --host/--port): cannot listen " \
           f"there: Address already in use" in r.stderr, r.stderr
    assert not marker.exists() and "engine: started" not in r.stderr


def test_an_engine_that_exits_during_the_start_ends_it(tmp_path):
    r = autosessd(tmp_path, "--slot-save-path", str(tmp_path / "s"), "--exec", "--", "sh", "-c", "exit 3", "sh",
                  "--port", str(free_port()))
    assert r.returncode == 1, r.stderr
    assert "cannot start: the engine command sh exited before it was ready (exit status 3); its output is above" \
        in r.stderr, r.stderr


# -- the child's life ------------------------------------------------------------------------
class Exec:
    """autosessd --exec with the fake engine as its child, in its own process group as
    llama-swap starts its commands."""

    def __init__(self, tmp_path: Path, *engine_args: str, args: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sessions = tmp_path / "sessions"  # made by autosessd: a new model's directory
        self.log = tmp_path / f"autosessd-{self.port}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "autosessd", "run", "--socket", str(tmp_path / "ctl.sock"), "--state-dir",
             str(tmp_path / "state"), "--min-tokens", "10", "--log-level", "debug", *args, "--exec", "--",
             *FAKE, "--port", str(self.port), "--slot-save-path", str(self.sessions), *engine_args],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"), start_new_session=True)
        wait_until(self.ready, 60, what="autosessd --exec to be ready")
        self.child = int(self.logtext().split("engine: started python (pid ")[1].split(")")[0])

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"autosessd exited with {self.proc.returncode}:\n{self.logtext()}")
        return "autosessd ready" in self.logtext()

    def logtext(self) -> str:
        return log_text(self.log)

    def chat(self, body: dict) -> dict:
        req = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)

    def close(self) -> None:
        for pid in (self.proc.pid, self.child):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie has exited; only its parent's wait is missing.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_sigterm_to_the_process_group_saves_before_the_engine_stops(tmp_path):
    """What llama-swap does at a swap: SIGTERM to its cmd's whole process group. The engine,
    in a session of its own, is still up for the stop save; then it is stopped, and the next
    start on the same port restores on the first request."""
    ex = Exec(tmp_path)
    try:
        assert ex.chat(A)["choices"][0]["message"]["content"] == answer_for(A)
        os.killpg(ex.proc.pid, signal.SIGTERM)
        assert ex.proc.wait(30) == 0
        log = ex.logtext()
        saved = log.index(f"to auto-{conversation_key(A)}.bin")
        assert saved < log.index("engine: stopping python") < log.index("stopped (killed by signal 15 (SIGTERM))")
        assert (ex.sessions / f"auto-{conversation_key(A)}.bin").exists()
        assert gone(ex.child)
    finally:
        ex.close()
    again = Exec(tmp_path)
    try:
        again.chat(B)
        assert again.chat(A)["timings"]["cache_n"] > 0
        assert f"restored" in again.logtext() and f"from auto-{conversation_key(A)}.bin" in again.logtext()
    finally:
        again.close()


def test_an_engine_that_exits_by_itself_ends_autosessd_with_exit_1(tmp_path):
    ex = Exec(tmp_path)
    try:
        os.kill(ex.child, signal.SIGKILL)  # the OOM killer, a crash
        assert ex.proc.wait(30) == 1
        assert "engine: python (pid %d) exited by itself (killed by signal 9 (SIGKILL)): autosessd stops and " \
               "exits 1" % ex.child in ex.logtext()
        assert "Traceback" not in ex.logtext()
    finally:
        ex.close()


def test_an_engine_deaf_to_sigterm_is_killed_at_the_stop_deadline(tmp_path):
    ex = Exec(tmp_path, "--fault", "ignore-sigterm", args=("--stop-timeout-s", "4"))
    try:
        ex.chat(A)
        t0 = time.monotonic()
        ex.proc.send_signal(signal.SIGTERM)
        assert ex.proc.wait(30) == 0
        assert time.monotonic() - t0 < 4 + 3
        log = ex.logtext()
        assert log.index(f"to auto-{conversation_key(A)}.bin") < log.index("engine: stopping python")
        assert "still running at the stop's deadline (stop_timeout_s): SIGKILL" in log
        wait_until(lambda: gone(ex.child), 5, what="the engine to be gone")
    finally:
        ex.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_autosessd_killed_outright_takes_the_engine_with_it(tmp_path):
    ex = Exec(tmp_path)
    try:
        os.kill(ex.proc.pid, signal.SIGKILL)
        ex.proc.wait()
        wait_until(lambda: gone(ex.child), 10, what="the engine to follow autosessd")
    finally:
        ex.close()


def test_the_engine_output_goes_to_the_exec_log(tmp_path):
    out = tmp_path / "engine.log"
    ex = Exec(tmp_path, args=("--exec-log", str(out)))
    try:
        assert out.read_text().splitlines()[0] == "ready"  # the fake's first line
        assert "ready\n" not in ex.logtext()
    finally:
        ex.close()
