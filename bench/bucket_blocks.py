"""The shared bucket by block (issue 48): what goes over the link and what the bucket holds.

Hosts are autosessd's own store and shared tier (Store + SharedStore, as the daemon wires them),
each with its own directory, against the real Ceph RADOS Gateway (scripts/s3-gateway); the saves
are slot files in llama-server's layout of Llama 3 8B's KV shape (32 layers, K and V rows of 2 KiB
a token: 128 KiB a token, 128-token blocks of 16 MiB), with random KV bytes (the bytes do not
change what is sent). No engine: the engine's side of a restore is bench 15's.

    turns   two conversations of ~6,000 tokens taking turns on one host, +~300 tokens a turn:
            the bytes each turn's upload sends, by block, against the whole file today's
            upload sends (and against the new tokens' KV + one block: the acceptance's bound)
    fleet   eight conversations sharing a ~4,000-token system prompt, spread over three hosts,
            each host uploading its own: what the bucket holds against the unique tokens' KV
    move    a ~6,000-token conversation moved to another host: that host holding nothing, and
            holding its first ~4,000 tokens (a shared system prompt): the bytes and time of the
            download, by block, and of the whole file (today's)

    python bench/bucket_blocks.py        (~2 min; needs the gateway: root, or Ceph installed)
    BENCH_ONLY=move python bench/bucket_blocks.py   some of them
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from autosessd.base.config import parse  # noqa: E402
from autosessd.shared import SharedStore  # noqa: E402
from autosessd.store.directory import Meta, Store  # noqa: E402
from autosessd.store.slotfile import MAGIC, VERSION  # noqa: E402

N_LAYER, ROW = 32, 2048  # Llama 3 8B: 8 KV heads x 128 x f16 = 2 KiB per K and per V row a layer
PER_TOKEN = 2 * N_LAYER * ROW
BLOCK = 128 * PER_TOKEN
MODEL = "bench-kv8b"
RNG = np.random.default_rng(48)


def kv_file(tokens: list[int]) -> bytes:
    """A slot file holding `tokens` with KV of the 8B shape (the layout of tests/kv_common.py)."""
    n = len(tokens)
    words = [-1, 1, n, *tokens, 0]
    out = [struct.pack(f"<III{len(words)}i", MAGIC, VERSION, len(words), *words), struct.pack("<II", 1, n)]
    cells = np.zeros((n, 3), dtype="<i4")
    cells[:, 0] = np.arange(n)
    cells[:, 1] = 1
    out += [cells.tobytes(), struct.pack("<IIII", 0, N_LAYER, 0, 0)]
    for _ in range(2 * N_LAYER):  # K of every layer, then V
        out += [struct.pack("<iQ", 1, ROW), RNG.integers(0, 256, n * ROW, dtype=np.uint8).tobytes()]
    return b"".join(out)


def host(env: dict[str, str], bucket: str, name: str, work: Path, **kw) -> tuple[SharedStore, Store]:
    extra = "".join(f"{k} = {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in kw.items())
    cfg = parse((f'slot_save_path = "/srv/x"\n[shared]\nendpoint_url = "{env["AWS_ENDPOINT_URL"]}"\n'
                 f'bucket = "{bucket}"\nprefix = "bench/"\nhost = "{name}"\n{extra}').encode(), "bench.toml").shared
    d = work / name
    d.mkdir()
    sh, store = SharedStore(cfg), Store(d)
    sh.start(store)
    return sh, store


def save(store: Store, key: str, tokens: list[int]) -> Meta:
    data = kv_file(tokens)
    store.temp_path(key).write_bytes(data)
    meta = store.finalize(key, Meta(key, len(tokens), len(data), time.time(), MODEL, 1.0))
    assert meta.in_blocks, meta.whole
    return meta


def up(sh: SharedStore, store: Store, key: str) -> int:
    before = sh.status()["bytes_up"]
    assert sh.upload_now(store.bin_path(key), store.read_meta(key)) == "done"
    return sh.status()["bytes_up"] - before


def toks(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(10, 120_000, n)]


def turns(env, bucket, work) -> list[str]:
    sh, store = host(env, bucket, "turns", work)
    convs = {"a1a1a1a1a1a1a1a1": toks(1, 6000), "b2b2b2b2b2b2b2b2": toks(2, 6000)}
    rows = ["| turn | conversation | tokens | new tokens | sent by block | whole file (today) "
            "| bound: 1.3 x new KV + one block |", "|---:|---|---:|---:|---:|---:|---:|"]
    worst = 0.0
    for turn in range(4):
        for key, t in convs.items():
            new = len(t) if turn == 0 else 300
            if turn:
                t += toks(100 * turn + len(t), 300)
            meta = save(store, key, t)
            sent = up(sh, store, key)
            bound = 1.3 * new * PER_TOKEN + BLOCK
            if turn:
                worst = max(worst, sent / bound)
            rows.append(f"| {turn} | {key[:4]} | {len(t):,} | {new:,} | {sent / 1e6:,.1f} MB "
                        f"| {meta.bytes / 1e6:,.1f} MB | {bound / 1e6:,.1f} MB |")
    sh.stop()
    rows.append(f"\nLater turns sent at most **{worst:.2f}×** the bound (≤ 1 meets it).")
    return rows


def bucket_bytes(c, bucket: str) -> tuple[int, int]:
    total = blocks = 0
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="bench/"):
        for o in page.get("Contents", []):
            total += o["Size"]
            blocks += o["Key"].startswith("bench/blocks/")
    return total, blocks


def fleet(env, bucket, work, c) -> list[str]:
    hosts = [host(env, bucket, f"fleet{i}", work) for i in range(3)]
    prompt = toks(7, 4000)
    unique = len(prompt)
    for i in range(8):
        sh, store = hosts[i % 3]
        own = toks(1000 + i, 300)
        unique += len(own)
        key = f"{i:x}" * 16
        save(store, key, prompt + own)
        up(sh, store, key)
    for sh, _ in hosts:
        sh.stop()
    held, n_blocks = bucket_bytes(c, bucket)
    kv = unique * PER_TOKEN
    return ["| conversations | hosts | unique tokens | their KV | the bucket holds | ratio | blocks |",
            "|---:|---:|---:|---:|---:|---:|---:|",
            f"| 8 (a 4,000-token prompt + 300 each) | 3 | {unique:,} | {kv / 1e9:,.2f} GB | {held / 1e9:,.2f} GB | "
            f"**{held / kv:.2f}×** | {n_blocks:,} |",
            f"\nAs whole files the bucket would hold {8 * 4300 * PER_TOKEN / 1e9:,.2f} GB (8 × 4,300 tokens)."]


def move(env, bucket, work) -> list[str]:
    (sh1, s1), (sh2, s2), (sh3, s3), (sh4, s4) = (host(env, bucket, f"move{i}", work, whole_files=True)
                                                  for i in range(1, 5))
    prompt = toks(11, 4000)
    a = prompt + toks(12, 2000)
    save(s1, "a0a0a0a0a0a0a0a0", a)
    up(sh1, s1, "a0a0a0a0a0a0a0a0")
    save(s3, "c0c0c0c0c0c0c0c0", prompt + toks(13, 50))  # host 3 holds the shared prompt
    rows = ["| A (6,000 tokens) moved to | download | then its file for the engine | what came down | "
            "whole file (today): download, then its file |", "|---|---:|---:|---:|---:|"]
    whole = [s for s in sh4.versions() if not s.manifest and s.name == "auto-a0a0a0a0a0a0a0a0.bin"][0]
    t0 = time.monotonic()
    sh4.download(whole, s4)
    t_whole = time.monotonic() - t0
    t0 = time.monotonic()
    s4.stage("auto-a0a0a0a0a0a0a0a0.bin")
    t_whole_stage = time.monotonic() - t0
    for label, (sh, store) in (("a host holding nothing of it", (sh2, s2)),
                               ("a host holding its first 4,000 tokens", (sh3, s3))):
        [m] = [s for s in sh.find(MODEL) if s.name == "auto-a0a0a0a0a0a0a0a0.bin"]
        assert m.manifest
        before = sh.status()
        t0 = time.monotonic()
        sh.download(m, store)
        dt = time.monotonic() - t0
        t0 = time.monotonic()
        store.stage("auto-a0a0a0a0a0a0a0a0.bin")  # assembled from its blocks, as a restore does
        ds = time.monotonic() - t0
        st = sh.status()
        got = st["bytes_fetched"] - before["bytes_fetched"]
        held = st["bytes_held"] - before["bytes_held"]
        rows.append(f"| {label} | {dt:.2f} s | {ds:.2f} s | {got / 1e9:.2f} GB fetched, {held / 1e9:.2f} GB held | "
                    f"{t_whole:.2f} s, then {t_whole_stage:.2f} s ({whole.bytes / 1e9:.2f} GB) |")
    for sh, _ in ((sh1, s1), (sh2, s2), (sh3, s3), (sh4, s4)):
        sh.stop()
    return rows


def main() -> None:
    from hosts import gateway_start, s3_client

    os.environ.setdefault("BENCH_HOSTS_TOKENS", "14000")  # sizes the gateway's memstore
    env, why = gateway_start()
    if env is None:
        print(f"skipped: no S3 gateway: {why}")
        return
    import subprocess

    try:
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            os.environ[k] = env[k]
        c = s3_client(env)
        with tempfile.TemporaryDirectory(prefix="autosessd-bench-") as d:
            work = Path(d)
            out = {}
            only = os.environ.get("BENCH_ONLY", "turns,fleet,move").split(",")
            for name, fn in (("turns", lambda b: turns(env, b, work)), ("fleet", lambda b: fleet(env, b, work, c)),
                             ("move", lambda b: move(env, b, work))):
                if name not in only:
                    continue
                b = f"bench-{name}-{os.getpid()}"
                c.create_bucket(Bucket=b)
                out[name] = fn(b)
                print(f"\n## {name}\n" + "\n".join(out[name]), flush=True)
    finally:
        subprocess.run([str(ROOT / "scripts" / "s3-gateway"), "stop", env["S3_GATEWAY_DIR"]], capture_output=True,
                       timeout=120)


if __name__ == "__main__":
    main()
