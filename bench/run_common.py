"""What every scenario of bench/run.py shares: the processes a scenario starts (Run), the
control socket, the statistics, and the conversations the scenarios send."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import demo  # noqa: E402  (free_port, wait_http, facts, ask: the demo's client and helpers)

SIZES = [int(x) for x in os.environ.get("BENCH_SIZES", "1000,4000,16000").split(",")]
REPS = int(os.environ.get("BENCH_REPS", "3"))
CTX = 32768
TOKENS_PER_FACT = 18  # measured with Gemma 3's tokenizer on demo.facts()


# -- processes ------------------------------------------------------------------------
class Run:
    """Every process a scenario starts, stopped at its end."""

    def __init__(self, work: Path, paths: dict[str, str]):
        self.work, self.paths = work, paths
        self.procs: list[subprocess.Popen] = []
        self.n = 0

    def _dir(self, name: str) -> Path:
        self.n += 1
        d = self.work / f"{self.n}-{name}"
        d.mkdir()
        return d

    def engine(self, cache_ram: int | None = 0, port: int | None = None, sessions: Path | None = None,
               ctx: int = CTX, model: str | None = None, swa_full: bool = True) -> dict[str, Any]:
        sessions = sessions or self._dir("sessions")
        port = port or demo.free_port()
        args = [self.paths["LLAMA_SERVER"], "-m", model or self.paths["MODEL"], "--host", "127.0.0.1",
                "--port", str(port), "-np", "1", "-c", str(ctx), "--slot-save-path", str(sessions), "--no-webui"]
        if swa_full:
            args.append("--swa-full")
        if cache_ram is not None:
            args += ["--cache-ram", str(cache_ram)]
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(self.work / f"engine-{port}.log", "ab"))
        self.procs.append(p)
        demo.wait_http(port, "/health", p, "llama-server", timeout=300)
        return {"proc": p, "port": port, "sessions": sessions, "cache_ram": cache_ram, "ctx": ctx}

    def fake_engine(self) -> dict[str, Any]:
        sessions = self._dir("fake-sessions")
        port = demo.free_port()
        p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fake_engine.py"), "--port", str(port),
                              "--dir", str(sessions), "--bytes-per-token", "100"], stdout=subprocess.PIPE, text=True)
        self.procs.append(p)
        assert p.stdout.readline().strip() == "ready"
        return {"proc": p, "port": port, "sessions": sessions}

    def daemon(self, engine: dict[str, Any], extra: list[str] = (), min_tokens: int = 256) -> dict[str, Any]:
        gate_port = demo.free_port()
        d = self._dir("daemon")
        sock = d / "autosessd.sock"
        (d / "empty.toml").touch()
        args = [sys.executable, "-m", "autosessd", "run", "--engine-url", f"http://127.0.0.1:{engine['port']}",
                "--slot-save-path", str(engine["sessions"]), "--gate", f"127.0.0.1:{gate_port}",
                "--min-tokens", str(min_tokens), "--state-dir", str(d / "state"), "--socket", str(sock), *extra]
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(d / "autosessd.log", "ab"),
                             env={**os.environ, "AUTOSESSD_CONFIG": str(d / "empty.toml")})
        self.procs.append(p)
        demo.wait_http(gate_port, "/autosessd/status", p, "autosessd")
        return {"proc": p, "port": gate_port, "socket": sock, "dir": d}

    def stop(self, p: subprocess.Popen) -> None:
        demo.stop(p)
        if p in self.procs:
            self.procs.remove(p)

    def close(self) -> None:
        for p in reversed(self.procs):
            demo.stop(p)
        self.procs.clear()


def ctl(sock: Path, cmd: str, **args: Any) -> Any:
    from autosessd import ctl as c

    return c.call(sock, cmd, timeout=60, **args)


# -- statistics -----------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}–{max(xs):.2f}" if xs else "-"


def conv(n_tokens: int, topic: str) -> list[dict[str, str]]:
    n = max(1, n_tokens // TOKENS_PER_FACT)
    return [{"role": "user", "content": demo.facts(n, topic) + f"\nHow many marbles are in {topic} 5?"}]


SMALL_B = [{"role": "user", "content": demo.facts(8, "jar") + "\nWhich jar is red?"}]


def going_on(messages: list[dict[str, str]], answer: str, question: str) -> list[dict[str, str]]:
    """A client's next request of a conversation: the answer sent back, then a new question.
    (Sending the same prompt again would end before the file's reply: on a sliding-window model
    such as Gemma 3 that file is rightly not restored, runs.swa_usable.)"""
    return messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
