#!/usr/bin/env python3
"""Which S3 client library for the shared tier: throughput against a real RADOS Gateway.

    python bench/s3_clients.py [--mb 100] [--reps 3]

Starts scripts/s3-gateway (or uses the one named by S3_GATEWAY_DIR), writes one file of
--mb random megabytes, and for each library that imports here moves it up and down --reps
times, printing the median MB/s. Run it from a scratch venv that has all three
(`pip install 'aiobotocore[boto3]' obstore`); autosessd's own venv has only the one chosen.

What each row does (all nothing hand-written: the libraries' own transfer code):
  boto3 put_object         one PUT from the open file
  boto3 upload_file        s3transfer: multipart, 8 MiB parts, 10 threads
  boto3 get_object         one GET, streamed to a file in 1 MiB reads
  boto3 download_file      s3transfer: ranged GETs in parallel, written to a file
  obstore put (multipart)  obstore.put(Path): 5 MiB parts, 12 concurrent
  obstore put (single)     use_multipart=False
  obstore get              obstore.get → streamed to a file
  aiobotocore put_object   one PUT (aiobotocore has no managed multipart)
  aiobotocore get_object   one GET, streamed to a file
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "bench-clients"


def gateway_env() -> tuple[dict[str, str], str | None]:
    """The gateway's env lines; starts one (returned dir to stop) unless S3_GATEWAY_DIR names one."""
    if d := os.environ.get("S3_GATEWAY_DIR"):
        out = subprocess.run([str(ROOT / "scripts/s3-gateway"), "env", d], check=True, capture_output=True,
                             text=True).stdout
        return dict(line.split("=", 1) for line in out.split()), None
    t0 = time.monotonic()
    out = subprocess.run([str(ROOT / "scripts/s3-gateway"), "start"], check=True, capture_output=True,
                         text=True).stdout
    env = dict(line.split("=", 1) for line in out.split())
    print(f"gateway started in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return env, env["S3_GATEWAY_DIR"]


def sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 20):
            h.update(b)
    return h.hexdigest()


def boto3_client(env):
    import boto3
    from botocore.config import Config

    # RGW 16.2 predates the flexible checksums that botocore ≥ 1.36 sends by default.
    cfg = Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                 response_checksum_validation="when_required", retries={"max_attempts": 1})
    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1", config=cfg)


def cases(env, src: Path, dst: Path):
    """(name, direction, function) for every library that imports."""
    out = []
    try:
        c = boto3_client(env)
        try:
            c.create_bucket(Bucket=BUCKET)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass

        def b_put():
            with open(src, "rb") as f:
                c.put_object(Bucket=BUCKET, Key="o", Body=f)

        def b_upload():
            c.upload_file(str(src), BUCKET, "o")

        def b_get():
            body = c.get_object(Bucket=BUCKET, Key="o")["Body"]
            with open(dst, "wb") as f:
                while chunk := body.read(1 << 20):
                    f.write(chunk)

        def b_download():
            c.download_file(BUCKET, "o", str(dst))

        out += [("boto3 put_object", "up", b_put), ("boto3 upload_file", "up", b_upload),
                ("boto3 get_object", "down", b_get), ("boto3 download_file", "down", b_download)]
    except ImportError:
        print("boto3 not installed: skipped", file=sys.stderr)
    try:
        import obstore
        from obstore.store import S3Store

        s = S3Store(BUCKET, endpoint=env["AWS_ENDPOINT_URL"], access_key_id=env["AWS_ACCESS_KEY_ID"],
                    secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region="us-east-1",
                    virtual_hosted_style_request=False, client_options={"allow_http": True})

        def o_put():
            obstore.put(s, "o", src)

        def o_put_single():
            obstore.put(s, "o", src, use_multipart=False)

        def o_get():
            r = obstore.get(s, "o")
            with open(dst, "wb") as f:
                for chunk in r.stream(min_chunk_size=1 << 20):
                    f.write(chunk)

        out += [("obstore put (multipart)", "up", o_put), ("obstore put (single)", "up", o_put_single),
                ("obstore get", "down", o_get)]
    except ImportError:
        print("obstore not installed: skipped", file=sys.stderr)
    try:
        from aiobotocore.session import get_session
        from botocore.config import Config

        cfg = Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                     response_checksum_validation="when_required")
        kw = dict(endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                  aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1", config=cfg)

        async def a_put():
            async with get_session().create_client("s3", **kw) as c:
                with open(src, "rb") as f:
                    await c.put_object(Bucket=BUCKET, Key="o", Body=f)

        async def a_get():
            async with get_session().create_client("s3", **kw) as c:
                r = await c.get_object(Bucket=BUCKET, Key="o")
                with open(dst, "wb") as f:
                    async with r["Body"] as body:
                        while chunk := await body.read(1 << 20):
                            f.write(chunk)

        out += [("aiobotocore put_object", "up", lambda: asyncio.run(a_put())),
                ("aiobotocore get_object", "down", lambda: asyncio.run(a_get()))]
    except ImportError:
        print("aiobotocore not installed: skipped", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    env, started = gateway_env()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            src, dst = Path(tmp) / "src.bin", Path(tmp) / "dst.bin"
            with open(src, "wb") as f:
                for _ in range(args.mb):
                    f.write(os.urandom(1 << 20))
            want = sha(src)
            size = src.stat().st_size
            rows = []
            all_cases = cases(env, src, dst)
            by_name = {name: [] for name, _, _ in all_cases}
            # Interleaved repetitions: a neighbour's load spike hits every library alike.
            ups = [c for c in all_cases if c[1] == "up"]
            downs = [c for c in all_cases if c[1] == "down"]
            for _ in range(args.reps):
                for up_name, _, up in ups:
                    t0 = time.perf_counter()
                    up()
                    by_name[up_name].append(time.perf_counter() - t0)
                    for down_name, _, down in downs:
                        dst.unlink(missing_ok=True)
                        t0 = time.perf_counter()
                        down()
                        by_name[down_name].append(time.perf_counter() - t0)
                        if sha(dst) != want:
                            raise SystemExit(f"{down_name} after {up_name}: the downloaded bytes differ")
            for name, d, _ in all_cases:
                med = statistics.median(by_name[name])
                rows.append((name, d, med, size / med / 1e6, min(by_name[name]), max(by_name[name])))
            print(f"\n{args.mb} MB object, {args.reps}+ runs each, median (min–max) seconds\n")
            print("| client | direction | median s | MB/s | min s | max s |")
            print("|---|---|---:|---:|---:|---:|")
            for name, d, med, mbs, lo, hi in rows:
                print(f"| {name} | {d} | {med:.2f} | {mbs:,.0f} | {lo:.2f} | {hi:.2f} |")
    finally:
        if started:
            subprocess.run([str(ROOT / "scripts/s3-gateway"), "stop", started], check=False)


if __name__ == "__main__":
    main()
