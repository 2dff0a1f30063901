#!/usr/bin/env python3
"""Which hash keeps a session file's digest (issue 19): throughput per algorithm, on a file in
the page cache (a save is, when its finalize hashes it) and read from disk with the cache
dropped where this process may drop it, against the engine-side restore rate it must not slow.

    python bench/digest.py              1 GiB file, 3 repetitions
    DIGEST_MB=256 DIGEST_REPS=5 ...

Prints a Markdown table: GB/s and ms per GB, in one thread, reading in 1 MiB chunks as
autosessd does (store.digest_file)."""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import tempfile
import time

MB = int(os.environ.get("DIGEST_MB", "1024"))
REPS = int(os.environ.get("DIGEST_REPS", "3"))
CHUNK = 1 << 20


def algorithms() -> dict[str, object]:
    algs: dict[str, object] = {"sha256 (hashlib)": lambda: hashlib.sha256(),
                               "blake2b (hashlib)": lambda: hashlib.blake2b(digest_size=32)}
    try:
        import xxhash

        algs["xxh3_128 (xxhash)"] = xxhash.xxh3_128
        algs["xxh64 (xxhash)"] = xxhash.xxh64
    except ImportError:
        print("xxhash not installed: pip install xxhash", file=sys.stderr)
    try:
        import blake3

        algs["blake3 (blake3, 1 thread)"] = lambda: blake3.blake3()
        algs["blake3 (blake3, all threads)"] = lambda: blake3.blake3(max_threads=blake3.blake3.AUTO)
    except ImportError:
        print("blake3 not installed: pip install blake3", file=sys.stderr)
    return algs


def run(path: str, new) -> float:
    h = new()
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    h.digest()
    return time.perf_counter() - t0


def main() -> None:
    with tempfile.NamedTemporaryFile(dir=os.environ.get("DIGEST_DIR"), delete=False) as f:
        path = f.name
        block = os.urandom(CHUNK)
        for _ in range(MB):
            f.write(block)
    try:
        for _ in range(2):  # into the page cache
            run(path, lambda: hashlib.md5())
        print(f"| hash | GB/s (page cache) | ms per GB | (file {MB:,} MiB, {REPS} runs, 1 MiB reads) |")
        print("|---|---:|---:|---|")
        for name, new in algorithms().items():
            times = [run(path, new) for _ in range(REPS)]
            t = statistics.median(times)
            gb = MB * CHUNK / 1e9
            print(f"| {name} | {gb / t:.2f} | {t / gb * 1000:.0f} | |")
        check_whole(path)
    finally:
        os.unlink(path)


def check_whole(path: str) -> None:
    """What a restore pays before the engine reads the file: Store.check_whole on a file whose
    identity is the one its digest was taken at (a stat or two), and on one copied back (a new
    identity: the digest again), for the same 1 GiB."""
    import shutil
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from autosessd.store.directory import Meta, Store

    with tempfile.TemporaryDirectory(dir=os.environ.get("DIGEST_DIR")) as d:
        store = Store(d)
        key = "0123456789abcdef"
        shutil.copyfile(path, store.temp_path(key))
        size = os.path.getsize(store.temp_path(key))
        store.finalize(key, Meta(key=key, n_tokens=1, bytes=size, saved_at=time.time(), model="m", save_ms=0))
        name = f"auto-{key}.bin"
        t = [time.perf_counter(), 0.0]
        for _ in range(1000):
            assert store.check_whole(name) is None
        t[1] = time.perf_counter()
        same_ms = (t[1] - t[0]) / 1000 * 1000
        data = store.bin_path(key).read_bytes()
        store.bin_path(key).unlink()
        store.bin_path(key).write_bytes(data)  # copied back: another inode
        t0 = time.perf_counter()
        assert store.check_whole(name) is None
        changed_ms = (time.perf_counter() - t0) * 1000
        print(f"\nStore.check_whole before a restore of {size / 2**30:.0f} GiB: {same_ms:.3f} ms when the file is "
              f"the one saved (a stat), {changed_ms:.0f} ms when its identity changed (the digest once)")


if __name__ == "__main__":
    main()
