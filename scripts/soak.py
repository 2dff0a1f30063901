#!/usr/bin/env python3
"""`make soak`: random conversation switches through the gate for SOAK_MINUTES (default 20),
with engine restarts and request-log rotation, against the real llama-server.

Reports turns, saves, restores and failures, and autosessd's resident memory and open
file descriptors, sampled every minute from the end of a warm-up; checks the session
directory for torn or disagreeing files, and for `.partial` temporaries left once the daemon
has stopped. Exits 1 when a request failed, a file is corrupt or left half-made, or memory or
descriptors grew.

What counts as growth. A leak stays, so the soak compares the last three samples' lowest
value with the first sample: memory may not grow by more than 10%; descriptors other than
TCP connections to the engine or from clients may not grow at all. Those connections come
and go with requests (the gate keeps idle ones to the engine for a few seconds), so one
sample's count says nothing about a leak; they must only stay few (at most MAX_CONNS).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo  # noqa: E402  (the same engine/daemon plumbing as the demo)

MINUTES = float(os.environ.get("SOAK_MINUTES", "20"))
ENGINE_RESTART_S = float(os.environ.get("SOAK_RESTART_S", "180"))
ROTATE_S = float(os.environ.get("SOAK_ROTATE_S", "120"))
WARMUP_S = min(120.0, MINUTES * 60 / 4)


def status(port: int) -> dict:
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/autosessd/status")
    return json.loads(c.getresponse().read())


MAX_CONNS = 16  # the soak sends one request at a time: a few connections, never hundreds
SAMPLE_S = 60.0


def footprint(pid: int, ports: tuple[int, int]) -> tuple[int, int, int]:
    """Resident bytes, descriptors other than TCP connections to the engine or from the
    gate's clients, and those connections."""
    p = psutil.Process(pid)
    listing = getattr(p, "net_connections", None) or p.connections  # psutil < 6
    conns = sum(1 for c in listing(kind="tcp")
                if c.raddr and (c.raddr.port == ports[0] or c.laddr.port == ports[1]))
    return p.memory_info().rss, p.num_fds() - conns, conns


def open_fds(pid: int) -> list[str]:
    """What the daemon's descriptors point at, for the report when they grew."""
    fd_dir = Path(f"/proc/{pid}/fd")
    out = []
    for fd in fd_dir.iterdir() if fd_dir.is_dir() else ():
        try:
            out.append(os.readlink(fd))
        except OSError:
            pass
    return sorted(out)


def check_files(directory: Path) -> list[str]:
    """What is wrong in the session directory once the daemon has stopped. A `.partial`
    temporary is one of them: every save either finishes (renamed) or is cleaned up."""
    bad = []
    partial = sorted(n for n in os.listdir(directory) if n.startswith(".autosessd-") and n.endswith(".partial"))
    if partial:
        bad.append(f"{len(partial)} temporaries left after the daemon stopped ({', '.join(partial[:3])})")
    for name in os.listdir(directory):
        if name.startswith(".autosessd-") and not name.endswith(".partial"):
            bad.append(f"unexpected temporary {name}")
        if name.startswith("auto-") and name.endswith(".bin"):
            meta_path = directory / (name[:-4] + ".json")
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError):
                bad.append(f"{name} without readable metadata")
                continue
            data = (directory / name).read_bytes()[:4]
            if meta["bytes"] != (directory / name).stat().st_size or data != b"qsgg":
                bad.append(f"{name} disagrees with its metadata or has no state header")
    return bad


def main() -> int:
    paths = demo.fetch_engine("soak")
    rng = random.Random(int(os.environ.get("SOAK_SEED", "1")))
    import tempfile

    with tempfile.TemporaryDirectory(prefix="autosessd-soak-") as tmp:
        work = Path(tmp)
        stack = demo.Stack(work, paths["LLAMA_SERVER"], paths["MODEL"])
        log = work / "requests.jsonl"
        stack.extra_daemon_args = ["--gate-request-log", str(log)]
        convs = [[{"role": "user", "content": demo.facts(40 + 15 * i, f"crate{i}") + f"\nQuestion {i}?"}]
                 for i in range(6)]
        requests = failed = restarts = rotations = 0
        try:
            stack.start_engine()
            stack.start_daemon()
            pid = stack.daemon.pid
            t0 = time.monotonic()
            next_restart, next_rotate = t0 + ENGINE_RESTART_S, t0 + ROTATE_S
            samples: list[tuple[int, int, int]] = []
            ports = (stack.engine_port, stack.gate_port)
            next_sample = t0 + WARMUP_S
            first_fds: list[str] = []
            while time.monotonic() - t0 < MINUTES * 60:
                i = rng.randrange(len(convs))
                try:
                    r = demo.ask(stack.gate_port, convs[i])
                    convs[i] = convs[i] + [{"role": "assistant", "content": r["text"]},
                                           {"role": "user", "content": f"And box {rng.randrange(100)}?"}]
                    if len(convs[i]) > 40:
                        convs[i] = convs[i][:1]
                except SystemExit as e:  # demo.ask exits on a non-200 answer
                    failed += 1
                    print(f"soak: request failed: {e}", flush=True)
                requests += 1
                now = time.monotonic()
                if now >= next_sample:
                    samples.append(footprint(pid, ports))
                    first_fds = first_fds or open_fds(pid)
                    rss, fds, conns = samples[-1]
                    print(f"soak: {(now - t0) / 60:4.1f} min: rss {rss / 1e6:.1f} MB, {fds} fds + {conns} "
                          "connections", flush=True)
                    next_sample = now + SAMPLE_S
                if now >= next_rotate:
                    log.rename(log.with_name(f"requests.jsonl.{rotations}"))
                    rotations += 1
                    next_rotate = now + ROTATE_S
                if now >= next_restart:
                    stack.stop_engine()
                    stack.start_engine()
                    restarts += 1
                    next_restart = time.monotonic() + ENGINE_RESTART_S
            samples.append(footprint(pid, ports))
            last_fds = open_fds(pid)
            st = status(stack.gate_port)
        finally:
            stack.stop_all()
        bad = check_files(stack.sessions)
        notes = [line.split(" ", 2)[2] for line in (work / "autosessd.log").read_text().splitlines()
                 if "WARNING" in line or "ERROR" in line]
        c = st["counters"]
        warm, last = samples[0], samples[-3:]
        end = tuple(min(s[k] for s in last) for k in range(3))
        print()
        print(f"| | after warm-up | end (lowest of the last {len(last)} samples) | most |")
        print("|---|---:|---:|---:|")
        print(f"| resident memory | {warm[0] / 1e6:.1f} MB | {end[0] / 1e6:.1f} MB | "
              f"{max(s[0] for s in samples) / 1e6:.1f} MB |")
        print(f"| file descriptors, without connections | {warm[1]} | {end[1]} | {max(s[1] for s in samples)} |")
        print(f"| connections to the engine and from clients | {warm[2]} | {end[2]} | "
              f"{max(s[2] for s in samples)} |")
        print()
        print(f"{MINUTES:g} min: {requests} requests ({failed} failed), turns {c['turns']}, saves {c['saves']}, "
              f"restores {c['restores']} (reused {c['restores_reused']}, not reused {c['restores_not_reused']}), "
              f"save failures {c['save_failures']}, restore failures {c['restore_failures']}, engine restarts "
              f"{restarts}, log rotations {rotations}, engine resets seen {c['engine_resets']}")
        print(f"session files: {'all whole and agreeing' if not bad else '; '.join(bad)}")
        if notes:
            print(f"autosessd warnings ({len(notes)}), the first ones:")
            for line in notes[:8]:
                print("   ", line[:300])
        grew = end[0] > warm[0] * 1.10 or end[1] > warm[1] or max(s[2] for s in samples) > MAX_CONNS
        if end[1] > warm[1]:
            gone, new = sorted(set(first_fds) - set(last_fds)), sorted(set(last_fds) - set(first_fds))
            print(f"descriptors after the warm-up: {first_fds}\nat the end, new: {new}; gone: {gone}")
        ok = not failed and not bad and not grew
        print("soak:", "PASS" if ok else "FAIL" + (" (memory grew over 10%, descriptors grew, or connections piled up)" if grew else ""))
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
