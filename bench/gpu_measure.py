"""One (model, size) of bench/gpu.py: the engine alone, autosessd in front, the engine's RAM cache.

Per size n (tokens of conversation A; B is ~100 tokens, under the daemon's --min-tokens 256, so B
is never saved and a return to A costs A's restore alone):

  engine alone     llama-server --cache-ram 0, -np 1: A read once (warms the GPU up), then per rep
                   B and A again: A is re-read whole (its time to first token, the engine's prompt_ms)
  autosessd        its gate in front of that engine, --idle-save-s 0 (so the switch to B waits for
                   A's save: "the switch-away save"), per rep two returns to A:
                     warm  A's file as the save left it, in the page cache
                     cold  A's file evicted first (fsync, posix_fadvise DONTNEED: no privileges)
                   each: the client's time to first token, autosessd's turn and its restore phase,
                   the engine's own restore_ms, timings.cache_n (the restore was reused)
  engine RAM hit   a second start, --cache-ram big enough for A: A, then per rep B and A again;
                   the engine keeps A in its host-RAM prompt cache and loads it back itself

Each piece writes into the dict it is handed as it goes, so a deadline or a failure leaves what
was measured. Everything started here is stopped at the end of the size.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "scripts"), str(HERE)) if p not in sys.path]
import demo  # noqa: E402  (free_port, wait_http, facts, stop)
from kv8b import disk_read_mb_s, evict, settle, status  # noqa: E402  (eviction, finalize wait, ctl status)

TOKENS_PER_FACT = 16.3  # Llama 3's tokenizer on demo.facts() (bench/kv8b.py)
B_TOKENS = 100
MIN_TOKENS = 256
REPLY_TOKENS = 8


class NoGPU(Exception):
    """The CUDA engine started on the CPU (a driver it cannot use): every number would be the CPU's."""


GPU_FAILED = ("no usable GPU found", "failed to initialize CUDA")


class OutOfTime(Exception):
    """The global deadline: what is measured stays, the rest is skipped."""


@dataclass
class Ctx:
    server: str
    work: Path
    gpu: bool
    deadline: float  # time.monotonic()
    env: dict[str, str] = field(default_factory=dict)  # for the engine (LD_LIBRARY_PATH) and daemon
    procs: list[subprocess.Popen] = field(default_factory=list)
    scratch: list[Path] = field(default_factory=list)  # the daemons' socket folders
    threads: int | None = None  # the engine's -t (None: its default)
    devices: list[str] = field(default_factory=list)  # what the engine's log says of the GPU

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def need(self, seconds: float, what: str) -> None:
        if self.left() < seconds:
            raise OutOfTime(f"{what}: {self.left():.0f} s left, ~{seconds:.0f} s needed")

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            demo.stop(p)
        self.procs.clear()
        for d in self.scratch:
            shutil.rmtree(d, ignore_errors=True)
        self.scratch.clear()


def facts(n_tokens: int, topic: str) -> list[dict[str, str]]:
    n = max(1, int(n_tokens / TOKENS_PER_FACT))
    return [{"role": "user", "content": demo.facts(n, topic) + f"\nHow many marbles are in {topic} 5?"}]


def going_on(messages: list[dict[str, str]], r: dict[str, Any], i: int) -> list[dict[str, str]]:
    return messages + [{"role": "assistant", "content": r["text"]}, {"role": "user", "content": f"And box {i}?"}]


def ask(ctx: Ctx, port: int, messages: list[dict[str, str]]) -> dict[str, Any]:
    """A streamed chat request: the client's time to first token and to the end, the engine's timings."""
    body = {"messages": messages, "temperature": 0, "max_tokens": REPLY_TOKENS, "seed": 1, "stream": True}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=max(30.0, min(900.0, ctx.left() + 30)))
    t0 = time.monotonic()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"gpu bench: a request answered {r.status}: {r.read()[:300]!r}")
    ttft, text, timings = None, "", {}
    for line in r:
        if not line.startswith(b"data: {"):
            continue
        d = json.loads(line[6:])
        delta = (d.get("choices") or [{}])[0].get("delta", {}).get("content")
        if delta and ttft is None:
            ttft = time.monotonic() - t0
        text += delta or ""
        timings = d.get("timings") or timings
    end = time.monotonic() - t0
    c.close()
    return {"ttft_s": round(ttft if ttft is not None else end, 4), "end_s": round(end, 4), "text": text,
            "prompt": timings.get("prompt_n", 0) + timings.get("cache_n", 0), "cache_n": timings.get("cache_n", 0),
            "prompt_ms": timings.get("prompt_ms")}


def start_engine(ctx: Ctx, model: Path, n_ctx: int, sessions: Path, cache_ram_mib: int, tag: str) -> int:
    port = demo.free_port()
    args = [ctx.server, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", str(n_ctx),
            "--slot-save-path", str(sessions), "--no-webui", "--cache-ram", str(cache_ram_mib), "-fit", "off"]
    # Every layer on the GPU; on a CPU one thread: a loaded 2-core machine's threads wait for each
    # other at ggml's barriers (scripts/engine_build.py), and --cpu checks the code, not the speed.
    args += ["-ngl", "999"] if ctx.gpu else []
    args += ["-t", str(ctx.threads)] if ctx.threads else []
    log = open(ctx.work / f"engine-{tag}.log", "ab")
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, **ctx.env})
    ctx.procs.append(p)
    log_path = ctx.work / f"engine-{tag}.log"
    _wait(port, "/health", p, f"llama-server ({tag})", log_path, max(10.0, min(300.0, ctx.left())))
    if ctx.gpu:
        text = log_path.read_text(errors="replace")
        bad = [ln for ln in text.splitlines() if any(b in ln for b in GPU_FAILED)]
        if bad:
            raise NoGPU(f"llama-server runs without the GPU: {' / '.join(bad)[:500]}")
        ctx.devices = ctx.devices or [ln.strip()[:200] for ln in text.splitlines() if "CUDA0" in ln or "found " in ln
                                      and "CUDA devices" in ln][:4]
    return port


def _wait(port: int, path: str, p: subprocess.Popen, what: str, log: Path, timeout: float) -> None:
    """demo.wait_http, with the end of the process's log in the error when it did not come up."""
    try:
        demo.wait_http(port, path, p, what, timeout=timeout)
    except SystemExit as e:
        tail = log.read_text(errors="replace")[-1500:] if log.is_file() else "(no log)"
        raise RuntimeError(f"{e}; the end of {log}:\n{tail}") from None


def start_daemon(ctx: Ctx, engine_port: int, sessions: Path, state: Path, tag: str) -> tuple[int, Path]:
    gate = demo.free_port()
    d = ctx.work / f"daemon-{tag}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "empty.toml").touch()
    ctx.scratch.append(Path(tempfile.mkdtemp(prefix="gpu-bench-")))
    sock = ctx.scratch[-1] / "autosessd.sock"  # a socket's path: 107 bytes at most
    args = [sys.executable, "-m", "autosessd", "run", "--engine-url", f"http://127.0.0.1:{engine_port}",
            "--slot-save-path", str(sessions), "--gate", f"127.0.0.1:{gate}", "--min-tokens", str(MIN_TOKENS),
            "--idle-save-s", "0", "--state-dir", str(state), "--socket", str(sock)]
    env = {**os.environ, **ctx.env, "AUTOSESSD_CONFIG": str(d / "empty.toml")}
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(d / "autosessd.log", "ab"), env=env, cwd=ROOT)
    ctx.procs.append(p)
    _wait(gate, "/autosessd/status", p, "autosessd", d / "autosessd.log", 120)
    return gate, sock


def from_blocks(sessions: Path) -> bool:
    """Issue 39: every conversation kept as blocks loses its copy (the .bin) and has its blocks
    evicted: the next return is assembled from the blocks, read from the disk. False: none is
    kept as blocks."""
    any_blocks = False
    for meta in sessions.glob("auto-*.json"):
        d = json.loads(meta.read_text())
        if not d.get("blocks"):
            continue
        any_blocks = True
        meta.with_suffix(".bin").unlink(missing_ok=True)
        for key, _, _ in d["blocks"]:
            evict(sessions / "blocks" / key[:2] / f"{key}.blk")
    return any_blocks


def _stop(ctx: Ctx, p: subprocess.Popen) -> None:
    demo.stop(p)
    if p in ctx.procs:
        ctx.procs.remove(p)


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


def _last_turn(sock: Path) -> dict[str, Any]:
    return dict(status(sock)["turn_phases"]["last"].get("0") or {})


def _returned(r: dict[str, Any], sock: Path) -> dict[str, Any]:
    st = status(sock)
    t = dict(st["turn_phases"]["last"].get("0") or {})
    restore = st["slots"][0].get("last_restore") or {}
    return {"ttft_s": r["ttft_s"], "cache_n": r["cache_n"], "prompt": r["prompt"], "turn_ms": t.get("ms"),
            "restore_ms": t.get("restore"), "engine_restore_ms": restore.get("engine_ms"),
            "phases": {k: v for k, v in t.items() if k not in ("key", "at", "ms")}}


def alone(ctx: Ctx, port: int, n: int, reps: int, out: dict[str, Any]) -> list[dict[str, str]]:
    a, b = facts(n, "box"), facts(B_TOKENS, "jar")
    t0 = time.monotonic()
    r = ask(ctx, port, a)
    out["first_read"] = {"ttft_s": r["ttft_s"], "prompt_ms": r["prompt_ms"], "prompt": r["prompt"]}
    out["prompt_tokens"] = r["prompt"]
    one = time.monotonic() - t0
    rows = out.setdefault("reread", {"samples": []})["samples"]
    for i in range(reps):
        ctx.need(2 * one + 5, f"re-read {i + 1} of {n:,} tokens")
        ask(ctx, port, b)
        a = going_on(a, r, i)
        r = ask(ctx, port, a)
        rows.append({"ttft_s": r["ttft_s"], "prompt_ms": r["prompt_ms"], "cache_n": r["cache_n"], "prompt": r["prompt"]})
        out["reread"].update(ttft_s=med([x["ttft_s"] for x in rows]), prompt_ms=med([x["prompt_ms"] for x in rows]))
    return going_on(a, r, 99)


def with_autosessd(ctx: Ctx, gate: int, sock: Path, sessions: Path, a: list[dict[str, str]], reps: int,
                   out: dict[str, Any]) -> None:
    b = facts(B_TOKENS, "jar")
    r = ask(ctx, gate, a)  # the slot holds A already: A goes on, now held
    saves = out.setdefault("switch_save", {"samples": []})["samples"]
    modes: dict[str, list] = {m: out.setdefault(m, {"samples": []})["samples"] for m in ("warm", "cold", "blocks")}
    cycle = 0.0
    for i in range(reps):
        for mode in ("warm", "cold", "blocks"):
            ctx.need(max(10.0, 1.5 * cycle), f"autosessd {mode} return {i + 1}")
            t0 = time.monotonic()
            a = going_on(a, r, 10 + i)
            rb = ask(ctx, gate, b)  # the switch: A saved before B runs
            t = _last_turn(sock)
            saves.append({"save_ms": t.get("save"), "turn_ms": t.get("ms"), "b_ttft_s": rb["ttft_s"]})
            settle(sock, bound_s=max(30.0, min(600.0, ctx.left())))  # the file final (fsync, digest, rename)
            files = sorted(sessions.glob("*.bin"), key=lambda p: p.stat().st_size)
            if files:
                out["file_bytes"] = files[-1].stat().st_size
            if mode == "cold":
                for f in files:
                    evict(f)
            elif mode == "blocks" and not from_blocks(sessions):
                continue  # kept whole (a sliding-window model): no return from blocks to time
            r = ask(ctx, gate, a)  # the return: A restored
            modes[mode].append(_returned(r, sock))
            cycle = time.monotonic() - t0
    for m in ("warm", "cold", "blocks"):
        rows = modes[m]
        if not rows:
            continue
        out[m].update({k: med([x[k] for x in rows]) for k in ("ttft_s", "turn_ms", "restore_ms", "engine_restore_ms")})
        out[m]["reused"] = all(x["cache_n"] * 2 >= x["prompt"] - 64 for x in rows)
    out["switch_save"].update(save_ms=med([x["save_ms"] for x in saves]), b_ttft_s=med([x["b_ttft_s"] for x in saves]))
    files = sorted(sessions.glob("*.bin"), key=lambda p: p.stat().st_size)
    if files and ctx.left() > 30:
        out["disk_read_mb_s"] = round(disk_read_mb_s(files[-1]), 1)  # A's file read plainly, evicted first


def ram_hit(ctx: Ctx, port: int, n: int, reps: int, out: dict[str, Any]) -> None:
    a, b = facts(n, "crate"), facts(B_TOKENS, "jar")
    r = ask(ctx, port, a)
    one = r["end_s"]
    rows = out.setdefault("samples", [])
    for i in range(reps):
        ctx.need(one + 10, f"RAM-cache return {i + 1}")
        rb = ask(ctx, port, b)  # the engine moves A into its RAM cache
        a = going_on(a, r, 20 + i)
        r = ask(ctx, port, a)
        rows.append({"ttft_s": r["ttft_s"], "cache_n": r["cache_n"], "prompt": r["prompt"], "b_ttft_s": rb["ttft_s"]})
    out.update(ttft_s=med([x["ttft_s"] for x in rows]), b_ttft_s=med([x["b_ttft_s"] for x in rows]),
               reused=all(x["cache_n"] * 2 >= x["prompt"] for x in rows) if rows else None)


def one_size(ctx: Ctx, model: Path, kv_bytes_per_token: int, n: int, reps: int, state: Path, tag: str,
             out: dict[str, Any]) -> None:
    """Measure size n on model into out (filled as it goes); stops every process it started."""
    sessions = ctx.work / f"sessions-{tag}"
    sessions.mkdir(parents=True, exist_ok=True)
    n_ctx = n + 4096
    took = out.setdefault("phase_s", {})
    t = time.monotonic()

    def done(what: str) -> None:
        nonlocal t
        took[what] = round(time.monotonic() - t, 2)
        t = time.monotonic()

    try:
        port = start_engine(ctx, model, n_ctx, sessions, 0, tag)
        done("engine start")
        a = alone(ctx, port, n, reps, out.setdefault("alone", {}))
        done("engine alone")
        ctx.need(20, "autosessd")
        gate, sock = start_daemon(ctx, port, sessions, state, tag)
        done("daemon start")
        with_autosessd(ctx, gate, sock, sessions, a, reps, out.setdefault("autosessd", {}))
        done("autosessd")
        ctx.stop_all()
        done("stop")
        ctx.need(20, "the engine's RAM cache")
        ram = int(2.5 * n_ctx * kv_bytes_per_token / 2**20) + 256
        out["ram_hit"] = {"cache_ram_mib": ram}
        port = start_engine(ctx, model, n_ctx, sessions, ram, tag + "-ram")
        done("engine start (RAM cache)")
        ram_hit(ctx, port, n, reps, out["ram_hit"])
        done("RAM cache")
    finally:
        ctx.stop_all()
        shutil.rmtree(sessions, ignore_errors=True)  # the files, and the store's blocks/
        sessions.mkdir(parents=True, exist_ok=True)
