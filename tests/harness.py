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
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


_paths: dict[str, str] | None = None


def engine_paths() -> dict[str, str]:
    """{"LLAMA_SERVER": path, "MODEL": path}, building them on first use if needed."""
    global _paths
    if _paths is None:
        try:
            out = subprocess.run([str(ROOT / "scripts" / "fetch-engine")], capture_output=True, text=True,
                                 check=True, timeout=3600).stdout
            _paths = dict(line.split("=", 1) for line in out.strip().splitlines())
        except (subprocess.SubprocessError, OSError) as e:
            if os.environ.get("AUTOSESSD_REQUIRE_ENGINE"):
                raise
            pytest.skip(f"no llama-server: scripts/fetch-engine failed ({e})")
    return _paths


class Engine:
    """One llama-server process on a free loopback port."""

    def __init__(self, save_dir: Path | None, swa_full: bool = True, ctx: int = 8192, slots: int = 1,
                 extra: list[str] | None = None, log_path: Path | None = None):
        self.save_dir = save_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        paths = engine_paths()
        self.args = [paths["LLAMA_SERVER"], "-m", paths["MODEL"], "--host", "127.0.0.1", "--port", str(self.port),
                     "-np", str(slots), "-c", str(ctx), "--cache-ram", "0", "-t", "2", "--no-webui"]
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
