"""Scenario 12 of `make bench`: switches at real sizes on the real engine (issue 31).

The model with Llama 3 8B's KV shape (scripts/kv8b_model.py: 128 KiB a token, no sliding
window, random weights) on llama-server, -np 1, one conversation A of 2k / 8k / 16k tokens
(0.26 / 1 / 2 GB files) and a small B switching with it. Per size, in one run on one engine:

    engine alone        the return to A re-reads it (its time to first token)
    engine's own        POST /slots save, and restore of A's file with the page cache warm and
                        cold (the file evicted: posix_fadvise DONTNEED), the engine's timings
    saved at the switch autosessd with idle_save_s = 0: the switch to B waits for A's save; the
                        return to A restores it
    saved while idle    autosessd's default (idle_save_s = 3), a pause after each reply until the
                        idle save and its finalize are done: the return restores only
                        - warm: A's file in the page cache
                        - cold: A's file evicted, the return sent to an idle engine (nothing to warm)
                        - cold, warmed: A's file evicted, the return sent while B's request runs,
                          so it waits for the slot and autosessd warms the file meanwhile (warm.py)
    the disk            a plain read of A's file, evicted: MB/s

For each return: autosessd's turn (its ms, and the phases: save, restore, ...), and the time to
first token. The targets (issue 31): saved while idle, the turn ≤ 1.1× the engine's own warm
restore of the same file; cold with warming ≤ 1.2× warm.

    BENCH_KV8B_SIZES=2000,6000,8000,16000   the sizes (tokens; 6k: issue 31's case)
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SIZES = [int(x) for x in os.environ.get("BENCH_KV8B_SIZES", "2000,6000,8000,16000").split(",")]
TOKENS_PER_FACT = 16.3  # Llama 3's tokenizer on demo.facts(): 1,450 tokens for 90 facts
PAUSE_S = 3.0  # idle_save_s, autosessd's default


def facts(n_tokens: int, topic: str) -> list[dict[str, str]]:
    import demo

    n = max(1, int(n_tokens / TOKENS_PER_FACT))
    return [{"role": "user", "content": demo.facts(n, topic) + f"\nHow many marbles are in {topic} 5?"}]


def ask(port: int, messages: list[dict[str, str]], max_tokens: int = 8) -> dict[str, Any]:
    """A streamed chat request (slots.ask): time to first token and to the end, the answer, the timings."""
    from slots import ask as streamed

    r = streamed(f"http://127.0.0.1:{port}", messages, max_tokens, timeout=1800)
    t = r["timings"]
    return {"ttft_s": r["ttft"], "end_s": r["s"], "text": r["text"], "cache_n": r["cache_n"], "prompt": r["prompt"],
            "prompt_ms": t.get("prompt_ms"), "predicted_ms": t.get("predicted_ms")}


def going_on(messages: list[dict[str, str]], r: dict[str, Any], i: int) -> list[dict[str, str]]:
    return messages + [{"role": "assistant", "content": r["text"]}, {"role": "user", "content": f"And box {i}?"}]


def post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = json.loads(r.read())
    c.close()
    if r.status != 200:
        raise RuntimeError(f"bench: {path} answered {r.status}: {data}")
    return data


def evict(path: Path) -> None:
    """Out of the page cache (its pages are clean once its finalize has fsynced it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict_blocks(sessions: Path, a_file: Path) -> bool:
    """A conversation kept as blocks (issue 39): its copy in staging removed and its blocks
    evicted from the page cache. False when its metadata names no blocks."""
    meta = json.loads(a_file.with_suffix(".json").read_text())
    if not meta.get("blocks"):
        return False
    a_file.unlink(missing_ok=True)
    for key, _, _ in meta["blocks"]:
        evict(sessions / "blocks" / key[:2] / f"{key}.blk")
    return True


def disk_read_mb_s(path: Path) -> float:
    evict(path)
    t0, n = time.monotonic(), 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(8 << 20):
            n += len(chunk)
    return n / 1e6 / (time.monotonic() - t0)


def status(sock: Path) -> dict[str, Any]:
    from autosessd import ctl

    return ctl.call(sock, "status", timeout=60)


def settle(sock: Path, idle_before: int | None = None, bound_s: float = 120) -> float:
    """The pause after a reply: until every save is final (its fsync, digest, rename) and, with
    idle_before, an idle save beyond that count has landed; → how long it took."""
    from autosessd import ctl

    t0 = time.monotonic()
    while time.monotonic() - t0 < bound_s:
        evs = ctl.call(sock, "events", timeout=60, limit=1000)
        final = sum(e["type"] == "saved" for e in evs) == sum(e["type"] in ("finalized", "save_failed") for e in evs)
        if final and (idle_before is None or status(sock)["counters"]["idle_saves"] > idle_before):
            break
        time.sleep(0.2)
    return time.monotonic() - t0


def idle_saves(sock: Path) -> int:
    return status(sock)["counters"]["idle_saves"]


def last_turn(sock: Path) -> dict[str, Any]:
    return dict(status(sock)["turn_phases"]["last"].get("0") or {})


def one_size(run: Any, n_tokens: int) -> dict[str, Any]:
    import demo

    sessions = run._dir(f"kv8b-{n_tokens}")
    port = demo.free_port()
    model = run.paths["MODEL_KV8B"]
    args = [run.paths["LLAMA_SERVER"], "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", "1",
            "-c", str(n_tokens + 4096), "--slot-save-path", str(sessions), "--no-webui", "--cache-ram", "0",
            "-fit", "off"]
    eng = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(run.work / f"engine-{port}.log", "ab"))
    run.procs.append(eng)
    demo.wait_http(port, "/health", eng, "llama-server", timeout=300)
    out: dict[str, Any] = {"n_tokens": n_tokens}
    a, b = facts(n_tokens, "box"), facts(300, "jar")

    # -- the engine alone, and its own save and restore of A's state
    t0 = time.monotonic()
    ra = ask(port, a)
    out["first_read_s"] = time.monotonic() - t0
    out["prompt_tokens"] = ra["prompt"]
    saved = post(port, "/slots/0?action=save", {"filename": "bench-a.bin"})
    out["engine_save_ms"], out["file_bytes"] = saved["timings"]["save_ms"], saved["n_written"]
    warm, cold = [], []
    for _ in range(3):
        post(port, "/slots/0?action=erase", {})
        warm.append(post(port, "/slots/0?action=restore", {"filename": "bench-a.bin"})["timings"]["restore_ms"])
        post(port, "/slots/0?action=erase", {})
        evict(sessions / "bench-a.bin")
        cold.append(post(port, "/slots/0?action=restore", {"filename": "bench-a.bin"})["timings"]["restore_ms"])
    out["engine_restore_warm_ms"], out["engine_restore_cold_ms"] = statistics.median(warm), statistics.median(cold)
    out["disk_read_mb_s"] = disk_read_mb_s(sessions / "bench-a.bin")
    (sessions / "bench-a.bin").unlink()
    ask(port, b)
    a = going_on(a, ra, 1)
    alone = ask(port, a)  # the return re-reads all of A
    out["alone"] = {"ttft_s": alone["ttft_s"], "cache_n": alone["cache_n"], "prompt": alone["prompt"]}
    print(f"  {n_tokens:,} tokens ({out['file_bytes'] / 1e9:.2f} GB): re-read {alone['ttft_s']:.1f} s, engine "
          f"restore {out['engine_restore_warm_ms']:.0f} ms warm / {out['engine_restore_cold_ms']:.0f} ms cold, "
          f"disk {out['disk_read_mb_s']:,.0f} MB/s", flush=True)
    a = going_on(a, alone, 2)

    def returned(r: dict[str, Any], sock: Path) -> dict[str, Any]:
        st = status(sock)
        t = dict(st["turn_phases"]["last"].get("0") or {})
        restore = st["slots"][0].get("last_restore") or {}
        return {"ttft_s": r["ttft_s"], "end_s": r["end_s"], "cache_n": r["cache_n"], "prompt": r["prompt"],
                "turn_ms": t.get("ms"),
                "engine_restore_ms": restore.get("engine_ms"),
                "phases": {k: v for k, v in t.items() if k not in ("key", "at", "ms")},
                "engine_prompt_ms": r["prompt_ms"], "engine_reply_ms": r["predicted_ms"]}

    # -- autosessd saving at the switch (idle_save_s = 0); the engine's slot holds A already
    d = run.daemon({"port": port, "sessions": sessions}, ["--idle-save-s", "0"])
    r = ask(d["port"], a)  # A goes on: held
    a = going_on(a, r, 3)
    t0 = time.monotonic()
    rb = ask(d["port"], b)  # the switch waits for A's save
    out["switch_saves"] = {"switch_to_b_s": time.monotonic() - t0, "b_ttft_s": rb["ttft_s"],
                           "turn": last_turn(d["socket"])}
    b = going_on(b, rb, 1)
    settle(d["socket"])
    r = ask(d["port"], a)
    out["switch_saves"]["back"] = returned(r, d["socket"])
    a = going_on(a, r, 4)
    run.stop(d["proc"])

    # -- autosessd saving while idle (its default): warm, cold, cold with warming
    d = run.daemon({"port": port, "sessions": sessions}, ["--idle-save-s", str(PAUSE_S)])
    rb = ask(d["port"], b)  # the slot switches from A to B: from now on its pauses save (idle_save_switched_s)
    b = going_on(b, rb, 1)
    settle(d["socket"])
    modes: dict[str, Any] = {}
    for mode in ("warm", "cold", "cold, from blocks", "cold, warmed while waiting"):
        before = idle_saves(d["socket"])
        r = ask(d["port"], a)  # A goes on (or comes back), then the pause saves it
        a = going_on(a, r, 5)
        settle(d["socket"], before)
        a_file = sessions / status(d["socket"])["slots"][0]["file"]
        if mode == "cold, warmed while waiting":
            evict(a_file)
            # B runs long enough for A's file to be read from the disk meanwhile (its size at
            # the disk's speed measured above, and a second; a reply token takes ~20 ms at B's
            # size here); A arrives while B's turn is under way and waits for the slot.
            read_s = a_file.stat().st_size / (out["disk_read_mb_s"] * 1e6)
            n_reply = max(48, int((read_s + 1.0) / 0.02))
            out["warmed_b_reply_tokens"] = n_reply
            box: dict[str, Any] = {}
            tb = threading.Thread(target=lambda: box.update(r=ask(d["port"], b, n_reply)))
            tb.start()
            time.sleep(0.3)
            r = ask(d["port"], a)
            tb.join()
            b = going_on(b, box["r"], 2)
        else:
            before = idle_saves(d["socket"])
            rb = ask(d["port"], b)
            b = going_on(b, rb, 2)
            settle(d["socket"], before)  # B saved while idle too: the return only restores
            if mode == "cold":
                evict(a_file)
            elif mode == "cold, from blocks":
                # No copy in staging: the return assembles A from its blocks, read from the disk.
                if not evict_blocks(sessions, a_file):
                    modes[mode] = {"skipped": "A was kept whole (not as blocks)"}
                    continue
            r = ask(d["port"], a)
        modes[mode] = returned(r, d["socket"])
        a = going_on(a, r, 6)
        print(f"  saved while idle, {mode}: turn {modes[mode]['turn_ms']:.0f} ms "
              f"(restore {modes[mode]['phases'].get('restore', 0):.0f}), first token {r['ttft_s']:.2f} s", flush=True)
    out["saved_while_idle"] = modes
    out["warmed_files"] = status(d["socket"])["counters"]["warmed_files"]
    run.close()
    return out


def s12_kv8b(run: Any) -> dict[str, Any]:
    import shutil

    if "MODEL_KV8B" not in run.paths:
        return {"skipped": "scripts/fetch-engine gave no MODEL_KV8B"}
    need = 3 * max(SIZES) * 131072 + 2e9
    free = shutil.disk_usage(run.work).free
    if free < need:
        return {"skipped": f"{free / 1e9:.0f} GB free in {run.work}, the scenario needs {need / 1e9:.0f} GB"}
    return {"sizes": {str(n): one_size(run, n) for n in SIZES}}


def blocks_cell(cb: dict[str, Any], s: dict[str, Any]) -> str:
    if not cb or cb.get("skipped"):
        return (cb or {}).get("skipped", "-")
    return (f"{cb['turn_ms']:,.0f} / {cb['phases'].get('assemble', 0):,.0f} "
            f"(**{cb['turn_ms'] / s['engine_restore_cold_ms']:.2f}×**)")


def t12(r: dict[str, Any]) -> str:
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    lines = ["The model of Llama 3 8B's KV shape, -np 1; A of each size, B of ~300 tokens. *turn*: autosessd's "
             "own time before the return is forwarded, *restore* its restore phase, *engine*: the engine's own "
             "restore_ms of that same restore; *first token*: the client's, which adds the engine's reading of "
             "the ~20 new tokens at that context. Cold: A's file evicted from the page cache before the return; "
             "warmed: the return sent while B's request ran, so autosessd read the file in meanwhile.", "",
             "| A | file | re-read (engine alone), first token | engine save ms | engine restore ms warm / cold | "
             "disk MB/s | saved at the switch: switch to B, return turn ms, return's answer / (engine's restore "
             "+ its own prompt and reply) | saved while idle, warm: turn / "
             "restore / engine ms (**turn / engine**) | cold: turn / restore ms | cold, from blocks: turn / "
             "assemble ms (**turn / engine's cold restore**) | cold, warmed: turn / restore ms "
             "(**restore / warm's**) | first token: re-read / idle warm |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def own(x: dict[str, Any]) -> float:
        """The return's answer against the engine's own restore and work on it (issue 31: ≤ 1.2×)."""
        work = (x.get("engine_restore_ms") or 0) + (x.get("engine_prompt_ms") or 0) + (x.get("engine_reply_ms") or 0)
        return x["end_s"] * 1000 / work if work else float("nan")

    for n, s in r["sizes"].items():
        idle = s["saved_while_idle"]
        w, c, cw = idle["warm"], idle["cold"], idle["cold, warmed while waiting"]
        cb = idle.get("cold, from blocks") or {}

        def rs(x: dict[str, Any]) -> float:
            return x["phases"].get("restore", 0.0)

        lines.append(
            f"| {s['prompt_tokens']:,} | {s['file_bytes'] / 1e9:.2f} GB | {s['alone']['ttft_s']:.2f} s | "
            f"{s['engine_save_ms']:,.0f} | {s['engine_restore_warm_ms']:,.0f} / {s['engine_restore_cold_ms']:,.0f} | "
            f"{s['disk_read_mb_s']:,.0f} | {s['switch_saves']['switch_to_b_s']:.2f} s, "
            f"{s['switch_saves']['back']['turn_ms']:,.0f} ms, **{own(s['switch_saves']['back']):.2f}×** | "
            f"{w['turn_ms']:,.0f} / {rs(w):,.0f} / "
            f"{w['engine_restore_ms']:,.0f} (**{w['turn_ms'] / w['engine_restore_ms']:.2f}×**) | "
            f"{c['turn_ms']:,.0f} / {rs(c):,.0f} | {blocks_cell(cb, s)} | "
            f"{cw['turn_ms']:,.0f} / {rs(cw):,.0f} (**{rs(cw) / rs(w):.2f}×**) | "
            f"{s['alone']['ttft_s']:.2f} / {w['ttft_s']:.2f} s |")
    lines += ["", "Targets (issue 31): saved while idle, warm, the turn ≤ 1.1× the engine's own restore of the "
              "file; cold with warming, the restore ≤ 1.2× warm (the warmed return also saves B, which had no "
              "pause: its turn holds that save too). Issue 39: a cold return from blocks (no copy in staging, "
              "the blocks evicted), the turn ≤ 1.3× the engine's own cold restore of the whole file."]
    return "\n".join(lines)
