#!/usr/bin/env python3
"""The shared tier's costs against a real S3 server (Ceph RADOS Gateway on loopback).

    python bench/shared.py [--sizes 20,80] [--reps 5] [--engine]

Starts scripts/s3-gateway (timed) unless S3_GATEWAY_DIR names a running one, then for each
size moves a slot file (slotfile.build layout, random state) through autosessd/shared/ as
the daemon will: upload_now from host A's session directory, download into host B's (temporary,
verify size and header, fsync, rename, metadata). Prints median (min-max) seconds and MB/s,
and what the estimate makes of them against re-reading the prompt.

--engine adds the cross-host switch with the real engine (scripts/fetch-engine): host A's
llama-server prefills and saves a conversation, host B's (its own directory) either re-reads
it from scratch, or downloads the save, restores it and answers; time to the answer of B's
first request, both ways.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from autosessd.store import slotfile
from autosessd.base.config import parse  # noqa: E402
from autosessd.shared import SharedStore, estimate  # noqa: E402
from autosessd.store.directory import Meta, Store, temp_name  # noqa: E402

MODEL = "benchbenchbench0"


def gateway() -> tuple[dict[str, str], str | None, float | None]:
    if d := os.environ.get("S3_GATEWAY_DIR"):
        out = subprocess.run([str(ROOT / "scripts/s3-gateway"), "env", d], check=True, capture_output=True,
                             text=True).stdout
        return dict(line.split("=", 1) for line in out.split()), None, None
    t0 = time.monotonic()
    out = subprocess.run([str(ROOT / "scripts/s3-gateway"), "start"], check=True, capture_output=True,
                         text=True).stdout
    env = dict(line.split("=", 1) for line in out.split())
    return env, env["S3_GATEWAY_DIR"], time.monotonic() - t0


def store_for(env, bucket: str, host: str) -> SharedStore:
    os.environ["AWS_ACCESS_KEY_ID"] = env["AWS_ACCESS_KEY_ID"]
    os.environ["AWS_SECRET_ACCESS_KEY"] = env["AWS_SECRET_ACCESS_KEY"]
    cfg = parse(f'slot_save_path = "/x"\n[shared]\nendpoint_url = "{env["AWS_ENDPOINT_URL"]}"\n'
                f'bucket = "{bucket}"\nhost = "{host}"\n'.encode(), "bench").shared
    return SharedStore(cfg)


def med(xs):
    return statistics.median(xs), min(xs), max(xs)


def transfer_rows(env, bucket, sizes_mb, reps, tmp: Path):
    a, b = store_for(env, bucket, "host-a"), store_for(env, bucket, "host-b")
    # A fresh cluster creates RGW's pools at the first object and the first multipart upload
    # (~2-3 s each): not a cost of an upload, so one multipart object goes first.
    a._client.upload_fileobj(io.BytesIO(bytes(17 << 20)), bucket, "warm-up", Config=a._transfer)
    a._client.delete_object(Bucket=bucket, Key="warm-up")
    rows = []
    for mb in sizes_mb:
        up, down = [], []
        for i in range(reps):
            sa, sb = Store(tmp / f"a-{mb}-{i}"), Store(tmp / f"b-{mb}-{i}")
            sa.path.mkdir()
            sb.path.mkdir()
            key = f"{i:016x}"
            n_tokens = mb * 185  # Gemma 3 270M: ~5.4 KB of state per token (DESIGN's 18.8 MB at 3.5k)
            data = slotfile.build(list(range(n_tokens)), os.urandom(mb * 1_000_000 - 16 - 4 * n_tokens))
            sa.temp_path(key).write_bytes(data)
            meta = Meta(key=key, n_tokens=n_tokens, bytes=len(data), saved_at=time.time(), model=MODEL, save_ms=0)
            sa.finalize(key, meta)
            t0 = time.perf_counter()
            assert a.upload_now(sa.bin_path(key), meta) == "done"
            up.append(time.perf_counter() - t0)
            [found] = b.find(MODEL, f"auto-{key}.bin")
            t0 = time.perf_counter()
            b.download(found, sb)
            down.append(time.perf_counter() - t0)
            assert sb.bin_path(key).read_bytes() == data
        rows.append((mb, med(up), med(down)))
    return rows, b


def engine_rows(env, bucket, tmp: Path, n_facts_list):
    """Cross-host switch with the real engine: re-read on host B vs download + restore on B."""
    from harness import Engine, chat_body, long_text  # noqa: I001 - tests/ on sys.path above

    from autosessd.engines.llama_server import LlamaServer
    from autosessd.base.keys import conversation_key

    a, b = store_for(env, bucket, "host-a"), store_for(env, bucket, "host-b")
    rows = []
    for n_facts in n_facts_list:
        sa, sb, sc = (Store(tmp / f"{x}-{n_facts}") for x in "abc")
        for s in (sa, sb, sc):
            s.path.mkdir()
        ea, eb, ec = (Engine(s.path, ctx=32768).start() for s in (sa, sb, sc))
        try:
            body = chat_body(long_text(n_facts) + "\nHow many marbles are in box 5?")
            key = conversation_key(body)
            first = ea.post("/v1/chat/completions", body)

            async def fp():
                e = LlamaServer(ea.url)
                try:
                    return (await e.info()).model
                finally:
                    await e.close()

            model = asyncio.run(fp())
            r = ea.post("/slots/0?action=save", {"filename": temp_name(key)})
            meta = Meta(key=key, n_tokens=r["n_saved"], bytes=r["n_written"], saved_at=time.time(), model=model,
                        save_ms=r["timings"]["save_ms"])
            sa.finalize(key, meta)
            t0 = time.perf_counter()
            a.upload_now(sa.bin_path(key), meta)
            up_s = time.perf_counter() - t0
            # Host C: the conversation's next request without the bucket (a full re-read).
            t0 = time.perf_counter()
            reread = ec.post("/v1/chat/completions", body)
            reread_s = time.perf_counter() - t0
            # Host B: find, download, restore, then the request.
            t0 = time.perf_counter()
            [found] = b.find(model, f"auto-{key}.bin")
            b.download(found, sb)
            t_dl = time.perf_counter() - t0
            eb.post("/slots/0?action=restore", {"filename": found.name})
            t_rs = time.perf_counter() - t0 - t_dl
            moved = eb.post("/v1/chat/completions", body)
            moved_s = time.perf_counter() - t0
            answer = first["choices"][0]["message"]["content"]
            # Host B's answer after the move against host A's, and a plain re-read's against A's
            # (llama.cpp's results can differ with how a prompt was batched).
            same = ("B=A " + ("yes" if moved["choices"][0]["message"]["content"] == answer else "NO") +
                    ", C=A " + ("yes" if reread["choices"][0]["message"]["content"] == answer else "NO"))
            est = estimate(found.bytes, found.n_tokens, b.download_bytes_per_s,
                           first["timings"]["prompt_per_second"])
            rows.append((meta.n_tokens, meta.bytes, up_s, reread_s, t_dl, t_rs, moved_s,
                         moved["timings"]["cache_n"], moved["usage"]["prompt_tokens"], same, est))
        finally:
            for e in (ea, eb, ec):
                e.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="20,80", help="MB, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engine", action="store_true", help="also the cross-host switch with llama-server")
    ap.add_argument("--facts", default="200,800", help="--engine: conversation sizes (facts, ~17 tokens each)")
    args = ap.parse_args()
    env, started, start_s = gateway()
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    try:
        store_for(env, bucket, "setup")._client.create_bucket(Bucket=bucket)
        with tempfile.TemporaryDirectory() as tmp:
            rows, b = transfer_rows(env, bucket, [int(x) for x in args.sizes.split(",")], args.reps, Path(tmp))
            if start_s is not None:
                print(f"\ngateway start (scripts/s3-gateway start, to serving S3): {start_s:.1f} s")
            print(f"\nshared tier, {args.reps} runs each, median (min-max); download = temporary, verify size and "
                  f"header, fsync, rename, metadata\n")
            print("| file | upload s | upload MB/s | download s | download MB/s |")
            print("|---:|---:|---:|---:|---:|")
            for mb, (u, ulo, uhi), (d, dlo, dhi) in rows:
                print(f"| {mb} MB | {u:.2f} ({ulo:.2f}-{uhi:.2f}) | {mb / u:,.0f} | {d:.2f} ({dlo:.2f}-{dhi:.2f}) | "
                      f"{mb / d:,.0f} |")
            rate = b.download_bytes_per_s
            print(f"\nthe estimate's download rate after these runs: {rate / 1e6:,.0f} MB/s; at the 2-core "
                  f"prefill rate in DESIGN (3,520 tokens in 8.6 s = 409 tokens/s):")
            for mb, _, _ in rows:
                n = mb * 185
                e = estimate(mb * 1_000_000, n, rate, 409)
                print(f"  {e.line(f'{mb} MB file', mb * 1_000_000, n)}")
            if args.engine:
                erows = engine_rows(env, bucket, Path(tmp), [int(x) for x in args.facts.split(",")])
                print("\ncross-host switch, real llama-server (Gemma 3 270M, 2 threads): the conversation's next "
                      "request on host B\n")
                print("| tokens | file | upload s | B re-reads: s | B downloads: dl s + restore s, answer s "
                      "| cache_n / prompt | same answer as A | estimate said |")
                print("|---:|---:|---:|---:|---|---:|---|---|")
                for n, by, up_s, rr, dl, rs, mv, cn, pn, same, est in erows:
                    print(f"| {n:,} | {by / 1e6:.1f} MB | {up_s:.2f} | {rr:.2f} | {dl:.2f} + {rs:.2f}, {mv:.2f} | "
                          f"{cn:,} / {pn:,} | {same} | "
                          f"{'download' if est.worth else 're-read'} ({est.download_s or 0:.2f} vs "
                          f"{est.reread_s or 0:.2f} s) |")
    finally:
        if started:
            subprocess.run([str(ROOT / "scripts/s3-gateway"), "stop", started], check=False)


if __name__ == "__main__":
    main()
