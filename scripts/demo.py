#!/usr/bin/env python3
"""`make demo`: a real llama-server with and without autosessd, side by side.

Plays one session twice — through autosessd's gate, then straight against the engine —
and prints what the engine reused (timings.cache_n) and how long the user waited for the
first token at each step:

    1. conversation A (long)        2. conversation B (short)
    3. back to A (follow-up)        4. restart engine (and autosessd), A again

The engine runs with --cache-ram 0, so its own RAM prompt cache cannot hide the switch:
what it keeps across a switch or a restart is exactly what autosessd gives back.
Everything started here is stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
A_FACTS = int(os.environ.get("DEMO_FACTS", "150"))  # ~2,600 tokens


def fetch_engine(who: str = "demo") -> dict[str, str]:
    """{"LLAMA_SERVER": path, "MODEL": path} from scripts/fetch-engine, which has just checked that
    the binary answers. Its progress and its reason for failing go straight to stderr; a failure
    ends the program with one line, not a traceback."""
    r = subprocess.run([str(ROOT / "scripts" / "fetch-engine")], stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(f"{who}: scripts/fetch-engine found no working llama-server (exit status {r.returncode}; why: above)")
    return dict(line.split("=", 1) for line in r.stdout.split())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(port: int, path: str, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"demo: {what} exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", path)
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    sys.exit(f"demo: {what} did not come up in {timeout:.0f} s")


def facts(n: int, topic: str) -> str:
    colors = ["red", "blue", "green", "amber", "violet"]
    return " ".join(f"Fact {i}: the {colors[i % 5]} {topic} number {i} holds {i * 7 % 13} marbles." for i in range(n))


def ask(port: int, messages: list[dict]) -> dict:
    """One streamed chat request; returns time to first token, tokens, reuse, the answer."""
    body = {"messages": messages, "temperature": 0, "max_tokens": 24, "seed": 1, "stream": True}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.monotonic()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        sys.exit(f"demo: request answered {r.status}: {r.read()[:300]!r}")
    ttft, text, timings = None, "", {}
    for line in r:
        if not line.startswith(b"data: {"):
            continue
        d = json.loads(line[6:])
        delta = (d.get("choices") or [{}])[0].get("delta", {}).get("content")
        if delta:
            ttft = ttft or time.monotonic() - t0
            text += delta
        timings = d.get("timings") or timings
    c.close()
    return {"ttft": ttft or time.monotonic() - t0, "prompt": timings.get("prompt_n", 0) + timings.get("cache_n", 0),
            "cache_n": timings.get("cache_n", 0), "text": text, "prompt_ms": timings.get("prompt_ms"),
            "prompt_n": timings.get("prompt_n")}


class Stack:
    """The processes of one run; stops them all."""

    def __init__(self, work: Path, server: str, model: str):
        self.work, self.server, self.model = work, server, model
        self.sessions = work / "sessions"
        self.sessions.mkdir()
        self.engine_port = free_port()
        self.gate_port = free_port()
        self.engine: subprocess.Popen | None = None
        self.daemon: subprocess.Popen | None = None
        self.extra_daemon_args: list[str] = []

    def start_engine(self) -> None:
        args = [self.server, "-m", self.model, "--host", "127.0.0.1", "--port", str(self.engine_port), "-np", "1",
                "-c", "8192", "--swa-full", "--cache-ram", "0", "--slot-save-path", str(self.sessions),
                "--no-webui"]
        self.engine = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(self.work / "engine.log", "ab"))
        wait_http(self.engine_port, "/health", self.engine, "llama-server")

    def start_daemon(self) -> None:
        args = [sys.executable, "-m", "autosessd", "run", "--engine-url", f"http://127.0.0.1:{self.engine_port}",
                "--slot-save-path", str(self.sessions), "--gate", f"127.0.0.1:{self.gate_port}",
                "--state-dir", str(self.work / "state"),
                "--socket", str(self.work / "autosessd.sock"), "--log-level", os.environ.get("DEMO_LOG_LEVEL", "info"),
                *self.extra_daemon_args]
        self.daemon = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(self.work / "autosessd.log", "ab"),
                                       env={**os.environ, "AUTOSESSD_CONFIG": str(self.work / "none.toml")})
        (self.work / "none.toml").touch()
        wait_http(self.gate_port, "/autosessd/status", self.daemon, "autosessd")

    def stop_engine(self) -> None:
        stop(self.engine)
        self.engine = None

    def stop_daemon(self) -> None:
        stop(self.daemon)
        self.daemon = None

    def stop_all(self) -> None:
        self.stop_daemon()
        self.stop_engine()


def stop(p: subprocess.Popen | None) -> None:
    if p is None or p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def play(stack: Stack, with_autosessd: bool) -> list[dict]:
    """The four steps. Follow-ups append the engine's own answer, as a chat client does."""
    a = [{"role": "user", "content": facts(A_FACTS, "box") + "\nHow many marbles are in box 5?"}]
    b = [{"role": "user", "content": facts(40, "jar") + "\nWhich jar is red?"}]
    port = stack.gate_port if with_autosessd else stack.engine_port
    rows = []

    def step(label: str, conv: str, messages: list[dict]) -> dict:
        r = ask(port, messages)
        rows.append({"step": label, "conv": conv, **r})
        print(f"  {'with' if with_autosessd else 'without'} autosessd: {label:<28} prompt {r['prompt']:>6,}  "
              f"reused {r['cache_n']:>6,}  first token after {r['ttft']:6.2f} s", flush=True)
        return r

    r1 = step("1. A, first question", "A", a)
    step("2. switch to B", "B", b)
    a = a + [{"role": "assistant", "content": r1["text"]}, {"role": "user", "content": "And in box 7?"}]
    r3 = step("3. back to A", "A", a)
    if with_autosessd:
        stack.stop_daemon()  # SIGTERM: saves the held conversation (the engine is idle)
    stack.stop_engine()
    stack.start_engine()
    if with_autosessd:
        stack.start_daemon()
    a = a + [{"role": "assistant", "content": r3["text"]}, {"role": "user", "content": "And in box 9?"}]
    step("4. after a restart, A again", "A", a)
    return rows


def main() -> None:
    paths = fetch_engine()
    results = {}
    with tempfile.TemporaryDirectory(prefix="autosessd-demo-") as tmp:
        for with_autosessd in (True, False):
            work = Path(tmp) / ("with" if with_autosessd else "without")
            work.mkdir()
            stack = Stack(work, paths["LLAMA_SERVER"], paths["MODEL"])
            try:
                stack.start_engine()
                if with_autosessd:
                    stack.start_daemon()
                results[with_autosessd] = play(stack, with_autosessd)
            except KeyboardInterrupt:
                sys.exit(130)
            finally:
                stack.stop_all()
            if with_autosessd:
                log = (work / "autosessd.log").read_text()
                print("\n  autosessd said:")
                for line in log.splitlines():
                    if ("auto sessions: saved" in line or "auto sessions: restored" in line
                            or "(auto)" in line):
                        print("   ", line.split(" ", 2)[2])
                print()
    print()
    print("| step | conv | prompt tokens | reused by the engine (cache_n) | first token after | "
          "without autosessd: reused | without: first token after | user waited |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for w, wo in zip(results[True], results[False]):
        speed = wo["ttft"] / w["ttft"] if w["ttft"] > 0 else float("inf")
        print(f"| {w['step']} | {w['conv']} | {w['prompt']:,} | {w['cache_n']:,} | {w['ttft']:.2f} s | "
              f"{wo['cache_n']:,} | {wo['ttft']:.2f} s | {speed:.1f}× less |"
              if speed >= 1.5 else
              f"| {w['step']} | {w['conv']} | {w['prompt']:,} | {w['cache_n']:,} | {w['ttft']:.2f} s | "
              f"{wo['cache_n']:,} | {wo['ttft']:.2f} s | same |")
    same = all(w["text"] == wo["text"] for w, wo in zip(results[True], results[False]))
    print(f"\nanswers with and without autosessd identical: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
