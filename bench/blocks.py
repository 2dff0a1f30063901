"""Scenario 14 of `make bench`: the store of token blocks on the real engine (issue 39).

The model with Llama 3 8B's KV shape (128 KiB a token, no window), -np 1, through the gate, in
two settings side by side: whole files (store_blocks = false, the engine's directory the store,
as before issue 39) and token blocks with the engine's directory on tmpfs (store_path on disk,
slot_save_path under /dev/shm: what `autosessd --exec` sets up).

    write volume     A and B of ~BENCH_BLOCKS_TOKENS tokens taking turns, each turn adding ~300
                     tokens, saves at the switch only (idle_save_s = 0): per turn, the bytes the
                     engine wrote (a whole save) against the bytes written to the store (whole:
                     the same; blocks: the new blocks), and the disk's own count of bytes written
                     (/proc/diskstats of the store's device, all writers: an upper bound)
    shared prompt    8 conversations sharing a ~BENCH_BLOCKS_SYSTEM-token system prompt, each with
                     its own ~300-token question: the store's bytes against the unique tokens' KV
    block size       a save of A cut with blocks of 64, 128, 256 and 1024 tokens: the time to cut it,
                     the files, and what A grown by ~300 tokens then writes (the last partial
                     block is written again); the assembly of the whole file, warm

The figures a day price the README's pattern (two conversations taking turns every 30 s, 8 hours
a day, a save at every switch) at 16k tokens.

    BENCH_BLOCKS_TOKENS=6000  BENCH_BLOCKS_TURNS=4  BENCH_BLOCKS_SYSTEM=4000
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

TOKENS = int(os.environ.get("BENCH_BLOCKS_TOKENS", "6000"))
TURNS = int(os.environ.get("BENCH_BLOCKS_TURNS", "4"))
SYSTEM = int(os.environ.get("BENCH_BLOCKS_SYSTEM", "4000"))
PER_TOKEN = 131072
SAVES_A_DAY = 8 * 3600 / 30  # a switch every 30 s, 8 hours a day


def disk_written(path: Path) -> int:
    """Bytes the device under `path` has written since boot (/proc/diskstats, sectors of 512)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if int(p[0]) == major and int(p[1]) == minor:
                return int(p[9]) * 512
    # a partition's device may be listed by its disk: the first disk of that major
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if int(p[0]) == major:
                return int(p[9]) * 512
    return 0


def _engine(run: Any, staging: Path, n_ctx: int, model: str = "MODEL_KV8B", swa_full: bool = False) -> int:
    import demo

    port = demo.free_port()
    args = [run.paths["LLAMA_SERVER"], "-m", run.paths[model], "--host", "127.0.0.1", "--port", str(port),
            "-np", "1", "-c", str(n_ctx), "--slot-save-path", str(staging), "--no-webui", "--cache-ram", "0",
            "-fit", "off"] + (["--swa-full"] if swa_full else [])
    eng = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(run.work / f"engine-{port}.log", "ab"))
    run.procs.append(eng)
    demo.wait_http(port, "/health", eng, "llama-server", timeout=300)
    return port


def _setting(run: Any, blocks: bool, name: str, model: str = "MODEL_KV8B", swa_full: bool = False) -> dict[str, Any]:
    """An engine and autosessd of one setting: (staging, store) directories, ports, socket."""
    store = run._dir(f"blocks-{name}-store")
    if blocks and Path("/dev/shm").is_dir():
        staging = Path(f"/dev/shm/autosessd-bench-{os.getpid()}-{name}")
        staging.mkdir(mode=0o700, exist_ok=True)
    else:
        staging = store
    port = _engine(run, staging, TOKENS + TURNS * 700 + 2048 if "shared" not in name else SYSTEM + 4096, model,
                   swa_full)
    conf = run._dir(f"blocks-{name}-conf") / "autosessd.toml"
    conf.write_text(f'slot_save_path = "{staging}"\n' + (f'store_path = "{store}"\n' if staging != store else "")
                    + f"store_blocks = {'true' if blocks else 'false'}\nidle_save_s = 0\n")
    d = run.daemon({"port": port, "sessions": staging}, ["--config", str(conf)])
    return {"port": port, "staging": staging, "store": store, "daemon": d}


def _status(sock: Path) -> dict[str, Any]:
    from autosessd import ctl

    return ctl.call(sock, "status", timeout=60)


def _store_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file() and not p.name.startswith("."))


def kept(store: Path) -> dict[str, int]:
    """What the store's manifests say of a save: a token's bytes in its blocks (every layer with
    a cache for every token: a window or hybrid model's full-attention layers), and the largest
    tail (0: none)."""
    from autosessd.store.kvfile import Shape

    per, tail = 0, 0
    for p in store.glob("auto-*.json"):
        d = json.loads(p.read_text())
        if d.get("kv"):
            per = Shape.from_json(d["kv"]).cell_size()
            tail = max(tail, (d.get("tail") or [0, 0])[1])
    return {"token_bytes": per, "tail_bytes": tail}


def write_volume(run: Any, blocks: bool, model: str = "MODEL_KV8B", swa_full: bool = False) -> dict[str, Any]:
    from kv8b import ask, facts, going_on

    name = ("blocks" if blocks else "whole") + ("" if model == "MODEL_KV8B" else f"-{model}")
    s = _setting(run, blocks, name, model, swa_full)
    sock, port = s["daemon"]["socket"], s["daemon"]["port"]
    convs = {"A": facts(TOKENS, "box"), "B": facts(TOKENS, "jar")}
    for k in ("A", "B", "A"):  # each read once and saved once (the first switches save them whole)
        r = ask(port, convs[k])
        convs[k] = going_on(convs[k], r, 1)
    turns = []
    for i in range(TURNS):
        for k in ("B", "A"):
            import demo

            convs[k] = convs[k][:-1] + [{"role": "user", "content": demo.facts(18, f"crate{i}{k}") + "\nAnd?"}]
            st0, disk0 = _status(sock), disk_written(s["store"])
            t0 = time.monotonic()
            r = ask(port, convs[k])  # the switch saves the other one, grown by its last turn
            wall = time.monotonic() - t0
            st1, disk1 = _status(sock), disk_written(s["store"])
            c0, c1 = st0["counters"], st1["counters"]
            written = (st1["store"]["blocks"]["store_bytes_written"] - st0["store"]["blocks"]["store_bytes_written"]
                       if blocks else c1["bytes_saved"] - c0["bytes_saved"])
            turns.append({"engine_bytes": c1["bytes_saved"] - c0["bytes_saved"], "store_bytes": written,
                          "disk_bytes": disk1 - disk0, "turn_s": wall, "prompt": r["prompt"]})
            convs[k] = going_on(convs[k], r, i + 2)
    # New tokens per turn: what the other conversation gained since its last save (~300 of a
    # question and its short answer): the prompt's growth between its turns.
    by = {"B": [], "A": []}
    for t, k in zip(turns, ["B", "A"] * TURNS):
        by[k].append(t)
    for k, ts in by.items():
        for prev, cur in zip(ts, ts[1:]):
            cur["grown"] = cur["prompt"] - prev["prompt"]
    st = _status(sock)
    out = {"turns": turns, "store_bytes_total": _store_bytes(s["store"]), "store": st["store"], **kept(s["store"])}
    run.close()
    if s["staging"] != s["store"]:
        subprocess.run(["rm", "-rf", str(s["staging"])], check=False)
    return out


def shared_prompt(run: Any, blocks: bool, model: str = "MODEL_KV8B", swa_full: bool = False) -> dict[str, Any]:
    from kv8b import ask, facts

    name = ("shared" if blocks else "shared-whole") + ("" if model == "MODEL_KV8B" else f"-{model}")
    s = _setting(run, blocks, name, model, swa_full)
    sock, port = s["daemon"]["socket"], s["daemon"]["port"]
    system = facts(SYSTEM, "box")[0]["content"]
    reused = []
    for i in range(8):
        q = facts(300, f"jar{i}")[0]["content"]
        r = ask(port, [{"role": "system", "content": system}, {"role": "user", "content": q}])
        reused.append(r["cache_n"])
    ask(port, [{"role": "user", "content": "Hello."}])  # the last one saved too
    time.sleep(2)
    st = _status(sock)
    prompt = r["prompt"]
    unique = (prompt - 300) + 8 * 300  # the system prompt once, each question once (about)
    k = kept(s["store"])
    per = k["token_bytes"] or PER_TOKEN
    saves = len(list(s["store"].glob("auto-*.json")))
    out = {"store_bytes": _store_bytes(s["store"]), "unique_tokens": unique, "cache_n": reused,
           "store": st["store"], "saves": saves, **k}
    out["ratio"] = out["store_bytes"] / (unique * per)
    # the target for a model with a tail: ≤ 1.2 × the unique tokens' full-attention KV + a tail a save
    out["ratio_less_tails"] = (out["store_bytes"] - saves * k["tail_bytes"]) / (unique * per)
    run.close()
    if s["staging"] != s["store"]:
        subprocess.run(["rm", "-rf", str(s["staging"])], check=False)
    return out


def block_sizes(run: Any) -> dict[str, Any]:
    """A's save cut with blocks of 64, 256 and 1024 tokens, offline (the same file each time)."""
    from autosessd.store import blocks as B
    from autosessd.store.blocks import BlockStore
    from autosessd.store.cutting import assemble, split
    from autosessd.store.kvfile import parse
    from autosessd.store.slotfile import encode
    from kv8b import ask, facts, going_on, post

    staging = run._dir("blocks-sizes")
    port = _engine(run, staging, TOKENS + 2048)
    a = facts(TOKENS, "box")
    r = ask(port, a)
    post(port, "/slots/0?action=save", {"filename": "a.bin"})
    grown = going_on(a, r, 1)
    import demo

    grown = grown[:-1] + [{"role": "user", "content": demo.facts(18, "crate") + "\nAnd?"}]
    ask(port, grown)
    post(port, "/slots/0?action=save", {"filename": "a2.bin"})
    run.close()
    out: dict[str, Any] = {}
    old = B.BLOCK_TOKENS
    try:
        for size in (64, 128, 256, 1024):
            B.BLOCK_TOKENS = size
            home = run._dir(f"blocks-size-{size}")
            store = BlockStore(home)
            kv = parse(staging / "a.bin")
            t0 = time.monotonic()
            refs, _, written = split(store, kv, staging / "a.bin", "m")
            cut_s = time.monotonic() - t0
            kv2 = parse(staging / "a2.bin")
            refs2, _, written2 = split(store, kv2, staging / "a2.bin", "m")
            t0 = time.monotonic()
            assemble(store, kv2.shape, encode(kv2.tokens), refs2, kv2.n_cells, io.BytesIO())
            asm_s = time.monotonic() - t0
            out[str(size)] = {"cut_s": cut_s, "files": len(refs), "first_bytes": written,
                              "grown_tokens": kv2.n_cells - kv.n_cells, "grown_bytes": written2,
                              "assemble_s": asm_s, "file_bytes": kv2.size}
            subprocess.run(["rm", "-rf", str(home)], check=False)
    finally:
        B.BLOCK_TOKENS = old
    return out


def s14_blocks(run: Any) -> dict[str, Any]:
    if "MODEL_KV8B" not in run.paths:
        return {"skipped": "scripts/fetch-engine gave no MODEL_KV8B"}
    out = {"tokens": TOKENS, "turns": TURNS, "system": SYSTEM}
    out["write_volume"] = {"whole files": write_volume(run, False), "blocks, staging on tmpfs": write_volume(run, True)}
    out["shared_prompt"] = {"whole files": shared_prompt(run, False), "blocks": shared_prompt(run, True)}
    out["block_sizes"] = block_sizes(run)
    print(json.dumps({k: v for k, v in out.items() if k == "block_sizes"}, indent=1), flush=True)
    return out


def t14(r: dict[str, Any]) -> str:
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    lines = [f"The model of Llama 3 8B's KV shape, -np 1, through the gate. **Write volume**: A and B of "
             f"~{r['tokens']:,} tokens taking turns, each turn adding ~300 tokens; per switch, what the engine "
             "wrote (the outgoing conversation, whole), what was written to the store, and what the disk wrote "
             "(its own count, every writer on it).", "",
             "| setting | engine MB / turn | store MB / turn | store / new tokens' KV | disk MB / turn | "
             "GB a day at 16k (the README's pattern) |", "|---|---:|---:|---:|---:|---:|"]
    for name, w in r["write_volume"].items():
        ts = [t for t in w["turns"] if "grown" in t]
        if not ts:
            continue
        eng = sum(t["engine_bytes"] for t in ts) / len(ts)
        store = sum(t["store_bytes"] for t in ts) / len(ts)
        disk = sum(t["disk_bytes"] for t in ts) / len(ts)
        new = sum(t["grown"] for t in ts) / len(ts) * PER_TOKEN
        day = (16000 * PER_TOKEN if "whole" in name else store) * SAVES_A_DAY / 1e9
        lines.append(f"| {name} | {eng / 1e6:,.0f} | {store / 1e6:,.0f} | {store / new:.2f}× | {disk / 1e6:,.0f} | "
                     f"{day:,.0f} |")
    lines += ["", f"**Shared system prompt**: 8 conversations sharing a ~{r['system']:,}-token system prompt, each "
                  "with its own ~300-token question.", "",
              "| setting | store GB | unique tokens' KV GB | store / unique | cache_n of the 2nd … 8th |",
              "|---|---:|---:|---:|---|"]
    for name, x in r["shared_prompt"].items():
        lines.append(f"| {name} | {x['store_bytes'] / 1e9:.2f} | {x['unique_tokens'] * PER_TOKEN / 1e9:.2f} | "
                     f"{x['ratio']:.2f}× | {', '.join(f'{c:,}' for c in x['cache_n'][1:])} |")
    lines += ["", "**Block size**: A's save cut offline with blocks of each size; then A grown by a turn.", "",
              "| tokens a block | cut s | files | grown by | written then MB | whole file assembled, warm s |",
              "|---:|---:|---:|---:|---:|---:|"]
    for size, x in r["block_sizes"].items():
        lines.append(f"| {size} | {x['cut_s']:.2f} | {x['files']} | {x['grown_tokens']} | "
                     f"{x['grown_bytes'] / 1e6:,.0f} | {x['assemble_s']:.2f} |")
    lines += ["", "Targets (issue 39): store bytes per turn ≤ 1.3 × the new tokens' KV plus one block; the shared "
                  "prompt's store ≤ 1.2 × the unique tokens' KV."]
    return "\n".join(lines)
