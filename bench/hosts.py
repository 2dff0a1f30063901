"""Scenario 15 of `make bench`: a return on its own host, on another host, and a re-read (issue 41).

Two hosts on loopback, each a llama-server (-np 1 --cache-ram 0) on the model of Llama 3 8B's
KV shape (128 KiB a token) with autosessd in front (the gate) and the same [shared] bucket on
the real Ceph RADOS Gateway the tests use (scripts/s3-gateway), and a third llama-server alone.
Per repetition:

    host 1          conversation A of ~BENCH_HOSTS_TOKENS tokens, then a small B (A saved,
                    uploaded; B saved while idle): wait until host 2's catalog lists A
    (b) host 2      A's return on another host: autosessd finds A's save in the bucket,
                    downloads it and restores it (idle_save_switched_s = 0: its reply is then
                    saved while idle and uploaded, waited for, so (a) runs on a quiet machine)
    (d) host 3      A's return on a host that holds A's system prompt (its first
                    SYSTEM_TOKENS tokens) from a conversation of its own: it downloads only
                    the blocks of A it lacks (issue 48)
    (a) host 1      A's return on its own host: restored from its local file (staging)
    (c) the engine  the same request to the engine alone: it re-reads all of A

For each: the client's time to first token (streamed), the engine's cache_n against the prompt,
autosessd's turn (its fetch = download, and restore phases), and for (b) the download's
seconds and MB/s (autosessd's status: last_download_ms over the bytes it brought).

    BENCH_HOSTS_TOKENS=6000   A's size (tokens)
    BENCH_HOSTS_REPS=1        repetitions (each a new A: a re-read of it on host 1 and one alone)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOKENS = int(os.environ.get("BENCH_HOSTS_TOKENS", "6000"))
REPS = int(os.environ.get("BENCH_HOSTS_REPS", "1"))
PER_TOKEN = 131072
CASES = ("own host", "another host", "engine alone", "prefix host")
SYSTEM_TOKENS = 4000  # A opens with a system prompt of this many tokens, which host 3 holds already


def _system() -> str:
    import demo
    from kv8b import TOKENS_PER_FACT

    return "You answer questions about boxes of marbles. " + demo.facts(max(1, int(SYSTEM_TOKENS / TOKENS_PER_FACT)),
                                                                         "crate")


# -- the bucket -----------------------------------------------------------------------
def gateway_start() -> tuple[dict[str, str] | None, str]:
    """scripts/s3-gateway start (its memstore sized for every save of the run) → its env, or
    None and why (exit 77: not root and the Ceph packages missing)."""
    mem_mb = max(4096, int(REPS * 2.5 * TOKENS * PER_TOKEN / 1e6) + 2048)
    r = subprocess.run([str(ROOT / "scripts" / "s3-gateway"), "start"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "S3_GATEWAY_MEM_MB": str(mem_mb)})
    if r.returncode == 77:
        return None, (r.stderr.strip().splitlines() or ["scripts/s3-gateway: unavailable"])[-1]
    if r.returncode != 0:
        raise RuntimeError(f"scripts/s3-gateway start failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return dict(line.split("=", 1) for line in r.stdout.split()), ""


def s3_client(env: dict[str, str]):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 10},
                                      request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required"))


# -- the hosts ------------------------------------------------------------------------
def engine(run: Any, sessions: Path) -> tuple[int, Any]:
    import demo

    port = demo.free_port()
    args = [run.paths["LLAMA_SERVER"], "-m", run.paths["MODEL_KV8B"], "--host", "127.0.0.1", "--port", str(port),
            "-np", "1", "-c", str(TOKENS + 4096), "--slot-save-path", str(sessions), "--no-webui", "--cache-ram", "0",
            "-fit", "off"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(run.work / f"engine-{port}.log", "ab"))
    run.procs.append(p)
    demo.wait_http(port, "/health", p, "llama-server", timeout=300)
    return port, p


def host(run: Any, n: int, env: dict[str, str], bucket: str) -> dict[str, Any]:
    """llama-server and autosessd with [shared]; every reply saved while idle (3 s after it) and
    uploaded, so each measured return only restores (and, on another host, downloads)."""
    sessions = run._dir(f"host{n}-sessions")
    port, _ = engine(run, sessions)
    conf = run._dir(f"host{n}-conf") / "autosessd.toml"
    conf.write_text(f'slot_save_path = "{sessions}"\nidle_save_s = 3\nidle_save_switched_s = 0\n'
                    f'[shared]\nendpoint_url = "{env["AWS_ENDPOINT_URL"]}"\nbucket = "{bucket}"\n'
                    f'prefix = "bench/"\nhost = "host{n}"\nlist_every_s = 1\n')
    d = run.daemon({"port": port, "sessions": sessions}, ["--config", str(conf)])
    return {"n": n, "engine_port": port, "sessions": sessions, **d}


def ask(port: int, messages: list[dict[str, str]], max_tokens: int = 8) -> dict[str, Any]:
    """One streamed chat request (slots.ask): time to first token, the answer, the engine's
    timings, and autosessd's response headers."""
    from slots import ask as streamed

    r = streamed(f"http://127.0.0.1:{port}", messages, max_tokens, timeout=1800)
    return {"ttft_s": r["ttft"], "end_s": r["s"], "text": r["text"], "cache_n": r["cache_n"],
            "prompt": r["prompt"], "prompt_ms": r["timings"].get("prompt_ms"), "headers": r["headers"]}


def status(h: dict[str, Any]) -> dict[str, Any]:
    from autosessd import ctl

    return ctl.call(h["socket"], "status", timeout=60)


def wait_for(what: str, ok, bound_s: float = 180) -> float:
    t0 = time.monotonic()
    while not ok():
        if time.monotonic() - t0 > bound_s:
            raise RuntimeError(f"bench: {what}: not within {bound_s:.0f} s")
        time.sleep(0.25)
    return time.monotonic() - t0


def quiet(h: dict[str, Any], idle_before: int) -> float:
    """Until the host's idle save after its last reply is final and every upload is done."""
    from kv8b import settle

    t0 = time.monotonic()
    settle(h["socket"], idle_before, bound_s=60)
    wait_for(f"host{h['n']}'s uploads", lambda: status(h)["shared"]["uploads_pending"] == 0)
    return time.monotonic() - t0


def returned(h: dict[str, Any], r: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    st = status(h)
    turn = dict(st["turn_phases"]["last"].get("0") or {})
    restore = st["slots"][0].get("last_restore") or {}
    sh, sh0 = st["shared"], before["shared"]
    out = {"ttft_s": r["ttft_s"], "end_s": r["end_s"], "cache_n": r["cache_n"], "prompt": r["prompt"],
           "text": r["text"], "headers": r["headers"], "turn_ms": turn.get("ms"),
           "phases": {k: v for k, v in turn.items() if k not in ("key", "at", "ms")},
           "engine_restore_ms": restore.get("engine_ms")}
    if sh["downloads"] > sh0["downloads"]:
        got = sh["bytes_down"] - sh0["bytes_down"]
        out["download"] = {"bytes": got, "ms": sh["last_download_ms"],
                           "mb_s": got / 1e6 / (sh["last_download_ms"] / 1000) if sh["last_download_ms"] else None,
                           "moved": sh["downloads_moved"] - sh0["downloads_moved"]}
    return out


SYSTEM = ""  # set by s15_hosts (demo.facts needs bench/ on the path)


def one_rep(i: int, h1: dict[str, Any], h2: dict[str, Any], h3: dict[str, Any], alone_port: int,
            b: list[dict[str, str]]) -> tuple[dict[str, Any], list[dict[str, str]]]:
    from kv8b import facts, going_on, idle_saves

    out: dict[str, Any] = {}
    a = [{"role": "system", "content": SYSTEM}, facts(TOKENS - SYSTEM_TOKENS, f"box{i}" if i else "box")[0]]
    ra = ask(h1["port"], a)  # host 1 reads A
    out["first_read_ttft_s"], out["prompt_tokens"] = ra["ttft_s"], ra["prompt"]
    a = going_on(a, ra, 1)
    idle_b = idle_saves(h1["socket"])
    t0 = time.monotonic()
    rb = ask(h1["port"], b)  # the switch to B saves A
    b = going_on(b, rb, i + 1)
    out["switch_to_b_s"] = time.monotonic() - t0
    quiet(h1, idle_b)  # B saved while idle; A and B uploaded
    # Host 2's catalog has A once a LIST made after the uploads has been read (its headers too).
    up_at = time.time()
    out["catalog_wait_s"] = wait_for("host 2's catalog to list host 1's saves",
                                     lambda: (status(h2)["shared"]["catalog"]["listed_at"] or 0) > up_at
                                     and status(h2)["shared"]["catalog"]["with_tokens"] >= 1, 120)
    out["uploaded_after_s"] = time.monotonic() - t0

    # (b) another host: download from the bucket, then restore
    before, idle2 = status(h2), idle_saves(h2["socket"])
    r = ask(h2["port"], a)
    out["another host"] = returned(h2, r, before)
    quiet(h2, idle2)  # host 2's idle save of A and its upload: not during (a)

    # (a) its own host: restore from its local file
    before = status(h1)
    idle1 = idle_saves(h1["socket"])
    r = ask(h1["port"], a)
    out["own host"] = returned(h1, r, before)
    quiet(h1, idle1)

    # (d) a host holding A's system prompt: only the rest comes down
    wait_for("host 3's catalog to list A", lambda: (status(h3)["shared"]["catalog"]["listed_at"] or 0) > up_at, 120)
    before, idle3 = status(h3), idle_saves(h3["socket"])
    r = ask(h3["port"], a)
    out["prefix host"] = returned(h3, r, before)
    quiet(h3, idle3)

    # (c) the engine alone re-reads A
    r = ask(alone_port, a)
    out["engine alone"] = {"ttft_s": r["ttft_s"], "end_s": r["end_s"], "cache_n": r["cache_n"],
                           "prompt": r["prompt"], "text": r["text"]}
    out["same_answer"] = len({out[c]["text"] for c in CASES}) == 1
    d = out["another host"].get("download") or {}
    print(f"  A {out['prompt_tokens']:,} tokens: first token on its own host "
          f"{out['own host']['ttft_s']:.2f} s (cache_n {out['own host']['cache_n']:,}), on another host "
          f"{out['another host']['ttft_s']:.2f} s (cache_n {out['another host']['cache_n']:,}, download "
          f"{(d.get('ms') or 0) / 1000:.2f} s at {d.get('mb_s') or 0:,.0f} MB/s), re-read "
          f"{out['engine alone']['ttft_s']:.2f} s", flush=True)
    return out, b


def s15_hosts(run: Any) -> dict[str, Any]:
    import shutil

    from kv8b import facts, idle_saves

    if "MODEL_KV8B" not in run.paths:
        return {"skipped": "scripts/fetch-engine gave no MODEL_KV8B"}
    need = (3 * REPS + 2) * TOKENS * PER_TOKEN + 2e9
    free = shutil.disk_usage(run.work).free
    if free < need:
        return {"skipped": f"{free / 1e9:.0f} GB free in {run.work}, the scenario needs {need / 1e9:.0f} GB"}
    t0 = time.monotonic()
    env, why = gateway_start()
    if env is None:
        return {"skipped": f"no S3 gateway: {why}"}
    out: dict[str, Any] = {"tokens": TOKENS, "reps": REPS, "gateway_start_s": time.monotonic() - t0}
    saved_env = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    try:
        c = s3_client(env)
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        c.create_bucket(Bucket=bucket)
        # A fresh cluster creates RGW's pools at its first object and first multipart upload
        # (2-3 s each, bench/shared.py): not a cost of the run's uploads, so they go first.
        import io

        c.upload_fileobj(io.BytesIO(bytes(17 << 20)), bucket, "warm-up")
        c.delete_object(Bucket=bucket, Key="warm-up")
        for k in saved_env:
            os.environ[k] = env[k]  # the daemons' credentials (their environment)
        h1, h2, h3 = host(run, 1, env, bucket), host(run, 2, env, bucket), host(run, 3, env, bucket)
        alone_port, _ = engine(run, run._dir("alone-sessions"))
        global SYSTEM
        SYSTEM = _system()
        b = facts(300, "jar")
        # Host 3 reads a conversation of its own that opens with A's system prompt (saved, uploaded).
        idle3 = idle_saves(h3["socket"])
        ask(h3["port"], [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say ok."}])
        quiet(h3, idle3)
        reps = []
        for i in range(REPS):
            r, b = one_rep(i, h1, h2, h3, alone_port, b)
            reps.append(r)
        out["runs"] = reps
        out["arrivals_host2"] = status(h2)["counters"].get("arrivals")
    finally:
        run.close()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        subprocess.run([str(ROOT / "scripts" / "s3-gateway"), "stop", env["S3_GATEWAY_DIR"]], capture_output=True,
                       timeout=120)
    return out


# -- the table --------------------------------------------------------------------------
def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def t15(r: dict[str, Any]) -> str:
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    runs = r["runs"]
    n = len(runs)
    lines = [f"Two hosts on loopback, each llama-server (-np 1 --cache-ram 0, the model of Llama 3 8B's KV "
             f"shape) with autosessd and [shared] on one bucket (Ceph RGW); A of ~{r['tokens']:,} tokens read on "
             f"host 1, then B there, A saved and uploaded; then A's return (its next request) "
             f"{'once' if n == 1 else f'{n} times, medians'}. *turn*: autosessd's own time before it forwards "
             "the request (*fetch*: the download, *restore*: the engine reading the file).", "",
             "| A's return | from | first token | cache_n / prompt | turn ms (fetch / restore) | download s, MB/s |",
             "|---|---|---:|---:|---:|---:|"]

    def cell(case: str, key: str) -> float:
        return _med([x[case][key] for x in runs if x[case].get(key) is not None])

    for case, label, src in (("own host", "(a) on its own host (host 1)", "its local file"),
                             ("another host", "(b) on another host (host 2)", "the bucket: download + restore"),
                             ("prefix host", f"(d) on a host holding its first {SYSTEM_TOKENS:,} tokens (host 3)",
                              "the bucket: the blocks it lacked + restore"),
                             ("engine alone", "(c) the engine alone", "a re-read of the prompt")):
        if case not in runs[-1]:
            continue
        x = runs[-1][case]
        turn = "-"
        if case != "engine alone":
            fetch = _med([y[case]["phases"].get("fetch", 0.0) for y in runs])
            restore = _med([y[case]["phases"].get("restore", 0.0) for y in runs])
            turn = f"{cell(case, 'turn_ms'):,.0f} ({fetch:,.0f} / {restore:,.0f})"
        dl = "-"
        ds = [y[case]["download"] for y in runs if y[case].get("download")]
        if ds:
            dl = f"{_med([d['ms'] for d in ds]) / 1000:.2f} s, {_med([d['mb_s'] for d in ds]):,.0f} MB/s " \
                 f"({ds[-1]['bytes'] / 1e9:.2f} GB)"
        lines.append(f"| {label} | {src} | **{cell(case, 'ttft_s'):.2f} s** | {x['cache_n']:,} / {x['prompt']:,} | "
                     f"{turn} | {dl} |")
    last = runs[-1]
    came = last["another host"]["headers"].get("x-autosessd-conversation", "-")
    own, other, alone, _ = (_med([x[c]["ttft_s"] for x in runs]) for c in CASES)
    lines += ["", f"A: {last['prompt_tokens']:,} tokens. Another host against its own: "
              f"**{other / own:.1f}×** the first token; the re-read against another host: **{alone / other:.0f}×**. "
              f"Host 2's catalog listed A {_med([x['uploaded_after_s'] for x in runs]):.1f} s after the switch to B. "
              f"Same answer on all three: {'yes' if all(x['same_answer'] for x in runs) else 'no'}. "
              f"X-Autosessd-Conversation on host 2: `{came}`."]
    return "\n".join(lines)
