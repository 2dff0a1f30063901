"""bench/index.py's parts without an engine: the prefix lookup three ways (the index, a scan of
every file, a hash chain per block), and building the index at start from headers or its cache."""

from __future__ import annotations

import gc
import hashlib
import json
import random
import time
import tracemalloc
from pathlib import Path
from typing import Any

# First: it puts this checkout and tests/ on sys.path, so the autosessd measured is this one.
from index_common import FILES, MODEL, TOKENS, VOCAB, timed

from autosessd.store.index import TokenIndex

from autosessd.store.runs import common_prefix

from autosessd.store.slotfile import build, encode


# -- the two alternatives the index was measured against ----------------------------------
class Linear:
    """Every file's token list, compared one by one."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def add(self, name: str, data: bytes) -> None:
        self.files[name] = data

    def best(self, q: bytes) -> tuple[str, int] | None:
        top = max(((common_prefix(d, q), n) for n, d in self.files.items()), default=(0, ""))
        return (top[1], top[0]) if top[0] else None


class Chain:
    """A hash chain per 64-token block (h_i = H(h_{i-1} ‖ block i)); only the hashes are
    kept. The deepest block the query shares with some file is found by bisection over the
    query's own chain; the exact prefix inside the next block is read from each such file's
    header (one small read each)."""

    B = 64

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.by_hash: dict[bytes, set[str]] = {}
        self.names: set[str] = set()

    @classmethod
    def chain(cls, data: bytes) -> list[bytes]:
        out, h, step = [], b"", 4 * cls.B
        for i in range(0, len(data) - len(data) % step, step):
            h = hashlib.blake2b(h + data[i:i + step], digest_size=8).digest()
            out.append(h)
        return out

    def add(self, name: str, data: bytes) -> None:
        self.names.add(name)
        for h in self.chain(data):
            self.by_hash.setdefault(h, set()).add(name)

    def best(self, q: bytes) -> tuple[str, int] | None:
        qh = self.chain(q)
        lo, hi = -1, len(qh)  # qh[lo] present (or lo = -1), qh[hi] absent
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if qh[mid] in self.by_hash:
                lo = mid
            else:
                hi = mid
        cands = self.by_hash[qh[lo]] if lo >= 0 else self.names
        start = (lo + 1) * self.B  # tokens known to be shared
        best = None
        for name in cands:
            with open(self.dir / name, "rb") as f:
                f.seek(12 + 12 + 4 * start)  # magic, version, n_words; -1, 1, n_tokens
                block = f.read(4 * self.B)
            n = start + common_prefix(block, q[4 * start:4 * start + 4 * self.B])
            if best is None or n > best[1]:
                best = (name, n)
        return best if best and best[1] else None


def workload(n_tokens: int, n_files: int, rng: random.Random) -> tuple[list[list[int]], list[int]]:
    """Files that all start with one system prompt (a quarter of them, at most 3,000 tokens:
    the agent case), then differ."""
    system = [rng.randrange(VOCAB) for _ in range(min(n_tokens // 4, 3000))]
    files = [system + [rng.randrange(VOCAB) for _ in range(n_tokens - len(system))] for _ in range(n_files)]
    return files, system


def part_lookup(work: Path) -> dict[str, Any]:
    rows = []
    rng = random.Random(11)
    for n_tokens in TOKENS:
        for n_files in FILES:
            files, system = workload(n_tokens, n_files, rng)
            d = work / f"lookup-{n_tokens}-{n_files}"
            d.mkdir()
            for i, t in enumerate(files):
                (d / f"f{i}.bin").write_bytes(build(t))
            # Query 1, a return: continues file j for 3/4 of its tokens, then departs.
            j = n_files // 2
            ret = files[j][:3 * n_tokens // 4] + [rng.randrange(VOCAB) for _ in range(n_tokens // 4)]
            # Query 2, a new conversation under the same system prompt: every file ties.
            new = system + [rng.randrange(VOCAB) for _ in range(n_tokens - len(system))]
            row: dict[str, Any] = {"tokens": n_tokens, "files": n_files}
            for kind in ("index", "linear", "chain"):
                def make():
                    if kind == "index":
                        s = TokenIndex(d)
                        for i, t in enumerate(files):
                            s.add(f"f{i}.bin", t, MODEL)
                        return s, lambda q: s.best(q, MODEL)
                    s = Linear() if kind == "linear" else Chain(d)
                    for i, t in enumerate(files):
                        s.add(f"f{i}.bin", encode(t))
                    return s, lambda q: s.best(encode(q))

                gc.collect()
                tracemalloc.start()  # slows allocation down: the build is timed apart
                base = tracemalloc.get_traced_memory()[0]
                s, lookup = make()
                mem = tracemalloc.get_traced_memory()[0] - base
                tracemalloc.stop()
                del s, lookup
                gc.collect()
                t0 = time.perf_counter()
                s, lookup = make()
                build_s = time.perf_counter() - t0
                got = lookup(ret)
                assert got == (f"f{j}.bin", 3 * n_tokens // 4), (kind, got)
                assert lookup(new)[1] == len(system), kind
                reps = 20 if kind == "linear" and n_files * n_tokens > 4e6 else 50
                row[kind] = {"build_s": build_s, "memory_bytes": mem,
                             "return_ms": 1e3 * timed(lambda: lookup(ret), reps),
                             "new_ms": 1e3 * timed(lambda: lookup(new), reps)}
                if kind == "index":  # the caller encodes a prompt once per turn
                    rb, nb = encode(ret), encode(new)
                    row[kind]["return_encoded_ms"] = 1e3 * timed(lambda: s.best(rb, MODEL), reps)
                    row[kind]["new_encoded_ms"] = 1e3 * timed(lambda: s.best(nb, MODEL), reps)
                del s, lookup
            row["encode_ms"] = 1e3 * timed(lambda: encode(ret), 50)
            rows.append(row)
            print(f"  lookup {n_tokens:,} tokens × {n_files:,} files: index {row['index']['return_ms']:.3f} ms, "
                  f"linear {row['linear']['return_ms']:.2f} ms, chain {row['chain']['return_ms']:.2f} ms", flush=True)
            for p in d.iterdir():
                p.unlink()
            d.rmdir()
    return {"rows": rows}


def t_lookup(r: dict[str, Any]) -> str:
    lines = ["| tokens/file | files | index: return / new (ms) | the same, query encoded (ms) | "
             "linear: return / new (ms) | chain: return / new (ms) | memory index / chain | build index (ms) | "
             "encode query (ms) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        i, li, c = row["index"], row["linear"], row["chain"]
        lines.append(f"| {row['tokens']:,} | {row['files']:,} | {i['return_ms']:.3f} / {i['new_ms']:.3f} | "
                     f"{i['return_encoded_ms']:.3f} / {i['new_encoded_ms']:.3f} | "
                     f"{li['return_ms']:.2f} / {li['new_ms']:.2f} | {c['return_ms']:.2f} / {c['new_ms']:.2f} | "
                     f"{i['memory_bytes'] / 1e6:.2f} MB / {c['memory_bytes'] / 1e6:.2f} MB | "
                     f"{1e3 * i['build_s']:.0f} | {row['encode_ms']:.2f} |")
    return "\n".join(lines)


def part_start(work: Path) -> dict[str, Any]:
    rows = []
    rng = random.Random(12)
    for n_tokens in TOKENS:
        for n_files in FILES:
            files, _ = workload(n_tokens, n_files, rng)
            d = work / f"start-{n_tokens}-{n_files}"
            d.mkdir()
            cache = work / f"start-{n_tokens}-{n_files}.cache"
            for i, t in enumerate(files):
                key = f"{i:016x}"
                p = d / f"auto-{key}.bin"
                p.write_bytes(build(t))
                (d / f"auto-{key}.json").write_text(json.dumps({"key": key, "bytes": p.stat().st_size,
                                                                "model": MODEL}))
            del files
            gc.collect()
            idx = TokenIndex(d, cache)
            r1 = idx.scan()
            t0 = time.perf_counter()
            idx.save_cache()
            save_s = time.perf_counter() - t0
            del idx
            gc.collect()
            idx2 = TokenIndex(d, cache)
            r2 = idx2.scan()
            assert r2.cache == "loaded" and r2.read == 0 and r2.files == n_files, r2
            t0 = time.perf_counter()
            idx2.scan()  # a rescan while running: a stat per file
            rescan_s = time.perf_counter() - t0
            rows.append({"tokens": n_tokens, "files": n_files, "headers_s": r1.seconds, "cache_s": r2.seconds,
                         "rescan_s": rescan_s, "save_s": save_s, "cache_bytes": cache.stat().st_size})
            print(f"  start {n_tokens:,} × {n_files:,}: headers {r1.seconds * 1e3:.0f} ms, "
                  f"cache {r2.seconds * 1e3:.0f} ms", flush=True)
            del idx2
            for p in d.iterdir():
                p.unlink()
            d.rmdir()
            cache.unlink()
    return {"rows": rows}


def t_start(r: dict[str, Any]) -> str:
    lines = ["| tokens/file | files | scan reading every header (ms) | scan from the cache (ms) | "
             "rescan, nothing changed (ms) | write the cache (ms) | cache size |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["rows"]:
        lines.append(f"| {x['tokens']:,} | {x['files']:,} | {1e3 * x['headers_s']:.0f} | {1e3 * x['cache_s']:.0f} | "
                     f"{1e3 * x['rescan_s']:.1f} | {1e3 * x['save_s']:.0f} | {x['cache_bytes'] / 1e6:.2f} MB |")
    return "\n".join(lines)
