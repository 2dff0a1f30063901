"""`autosessd run --exec` as llama-swap's cmd, with the real llama-server: model swaps keep
every conversation (issue 20's acceptance for --exec)."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from harness import chat_body, engine_paths, free_port, log_text, long_text, wait_until

pytestmark = pytest.mark.engine

OPENERS = {"A1": long_text(30) + "\nHow many marbles are in box 5?",
           "A2": long_text(30, "jar") + "\nWhich jar is red?",
           "B1": long_text(30, "crate") + "\nHow many marbles are in crate 7?"}
LLAMA_SWAP_GRACE_S = 10  # llama-swap: SIGTERM to the cmd's process group, SIGKILL 10 s later


class SwapStandIn:
    """What llama-swap does with its model entries: one port for whichever model runs; a swap
    sends SIGTERM to the running cmd's process group, waits for it to exit (SIGKILL after
    LLAMA_SWAP_GRACE_S), starts the other model's cmd on the same port and waits for /health."""

    def __init__(self, tmp_path, models: dict[str, list[str]]):
        self.tmp = tmp_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.models = models
        self.running: str | None = None
        self.proc: subprocess.Popen | None = None
        self.stops: list[tuple[int, float]] = []  # (exit status, seconds) of each swap's stop

    def cmd(self, name: str) -> list[str]:
        # One session directory and control socket per model entry (README: llama-swap).
        return [sys.executable, "-m", "autosessd", "run", "--slot-save-path", str(self.tmp / "sessions" / name),
                "--socket", str(self.tmp / f"{name}.sock"), "--state-dir", str(self.tmp / f"state-{name}"),
                "--min-tokens", "100", "--stop-timeout-s", "8", "--log-level", "debug", "--exec", "--",
                *self.models[name], "--port", str(self.port)]

    def swap_to(self, name: str) -> None:
        if self.running == name:
            return
        self.stop()
        log = open(self.tmp / f"{name}.log", "ab")
        self.proc = subprocess.Popen(self.cmd(name), stdout=log, stderr=log, start_new_session=True)
        self.running = name
        wait_until(self.healthy, 180, 0.25, f"{name} to answer /health on {self.url}")

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.running} exited with {self.proc.returncode}:\n{self.logtext()}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self.proc is None:
            return
        t0 = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            rc = self.proc.wait(LLAMA_SWAP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.stops.append((rc, time.monotonic() - t0))
        self.proc, self.running = None, None

    def logtext(self, name: str | None = None) -> str:
        return log_text(self.tmp / f"{name or self.running}.log")

    def turn(self, conv: list[dict]) -> dict:
        """One turn of a conversation (its messages so far): the answer, and the messages
        grow by it and by the next question, as a chat client's do."""
        answer = self.chat({**chat_body(""), "messages": conv})
        conv += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And the next one?"}]
        return answer

    def chat(self, body: dict) -> dict:
        req = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.load(r)


def reuse(answer: dict) -> float:
    return answer["timings"]["cache_n"] / answer["usage"]["prompt_tokens"]


@pytest.mark.timeout(1200)
def test_model_swaps_through_exec_keep_every_conversation(tmp_path):
    """Two models (two aliases of the Gemma GGUF with two context sizes: two models to a
    router or to llama-swap): two conversations on A, one on B, swapped A → B → A → B. The
    first turn after each return reuses at least 90% of its prompt (timings.cache_n)."""
    paths = engine_paths()
    base = [paths["LLAMA_SERVER"], "-m", paths["MODEL"], "-np", "1", "--swa-full", "--cache-ram", "0", "-t", "2",
            "--no-webui", "-fit", "off"]  # -fit off: as harness.Engine, 1.2 s less per start
    swap = SwapStandIn(tmp_path, {"A": [*base, "--alias", "model-a", "-c", "8192"],
                                  "B": [*base, "--alias", "model-b", "-c", "4096"]})
    convs = {name: [{"role": "user", "content": text}] for name, text in OPENERS.items()}
    try:
        swap.swap_to("A")
        first = {"A1": swap.turn(convs["A1"]), "A2": swap.turn(convs["A2"])}
        swap.swap_to("B")
        first["B1"] = swap.turn(convs["B1"])
        with urllib.request.urlopen(swap.url + "/props", timeout=10) as r:
            assert json.load(r)["default_generation_settings"]["n_ctx"] == 4096  # B really runs
        swap.swap_to("A")
        back = {"A1": swap.turn(convs["A1"]), "A2": swap.turn(convs["A2"])}
        swap.swap_to("B")
        back["B1"] = swap.turn(convs["B1"])
        for conv, answer in back.items():
            assert first[conv]["timings"]["cache_n"] < 20, conv  # the first turn read its prompt
            assert answer["usage"]["prompt_tokens"] >= 500, conv
            assert reuse(answer) >= 0.9, (conv, answer["timings"], answer["usage"])
            print(f"{conv}: back after the swaps, cache_n {answer['timings']['cache_n']} of "
                  f"{answer['usage']['prompt_tokens']} prompt tokens")
        swap.stop()
        # Each swap's stop: exit 0, well inside llama-swap's grace, the saves before the engine's stop.
        assert [rc for rc, _ in swap.stops] == [0, 0, 0, 0], swap.stops
        assert all(s < LLAMA_SWAP_GRACE_S for _, s in swap.stops), swap.stops
        for name in ("A", "B"):
            log = swap.logtext(name)
            assert log.count("engine: stopping llama-server") == 2
            assert log.rindex("auto sessions: saved") < log.rindex("engine: stopping llama-server")
            assert "Traceback" not in log
    finally:
        swap.stop()


def test_a_router_with_no_models_starts_and_its_requests_pass(tmp_path):
    """llama.cpp's own server tests start llama-server with no model at all (a router that
    loads on demand: ServerPreset.router()). autosessd refused that start ("none of the
    models … saves its slots"); there is nothing to keep, so it starts, says so, and the
    router's answers pass untouched (here its CORS preflight)."""
    port = free_port()
    log = tmp_path / "autosessd.log"
    cmd = [sys.executable, "-m", "autosessd", "run", "--slot-save-path", str(tmp_path / "sessions"), "--socket",
           str(tmp_path / "ctl.sock"), "--state-dir", str(tmp_path / "state"), "--exec", "--",
           engine_paths()["LLAMA_SERVER"], "--port", str(port), "--cors-origins", "localhost", "--no-webui"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "wb"), start_new_session=True)
    try:
        wait_until(lambda: p.poll() is not None or "autosessd ready" in log.read_text(), 60, what="the start")
        assert p.poll() is None, log.read_text()
        assert "lists no models" in log.read_text()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completions", method="OPTIONS",
                                     headers={"Origin": "http://localhost", "Access-Control-Request-Method": "POST"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "http://localhost"
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        assert p.wait(30) == 0
