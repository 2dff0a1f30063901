"""Scenario 13 of `make bench`: what saving writes, per hour of two usage patterns (issue 31).

At 128 KiB a token every save is the conversation's whole state (llama-server writes no
increments): 0.26 / 1 / 2 GB at 2k / 8k / 16k tokens of an 8B model. What matters for an SSD is
how many saves a pattern causes under each setting. The daemon itself is run against the fake
engine (tests/fake_engine.py, tiny files) in time compressed SCALE times, every duration scaled
alike (the gaps between requests, idle_save_s, idle_save_switched_s), and its saves counted;
the table prices them at 8B sizes for 8 hours of use a day.

    two taking turns   conversations A and B alternate, a request every 30 s
    one alone          one conversation, a request every 5 min (no switch ever)

    settings           idle_save_s = 0 (saves only at a switch); 3 s after every reply
                       (idle_save_switched_s = 0, the default before issue 31); 3 s on a slot
                       that switched in the last 30 min (the default now)

The cap (idle_save_mb_per_min, 4,096) is left out of the compressed run (its minute is not
scaled): two 2 GB conversations taking turns every 30 s write 4 GB a minute, the cap's edge.

    BENCH_WRITES_SCALE=30   the compression; BENCH_WRITES_REQUESTS=16 per pattern and setting
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

SCALE = float(os.environ.get("BENCH_WRITES_SCALE", "30"))
REQUESTS = int(os.environ.get("BENCH_WRITES_REQUESTS", "16"))
PATTERNS = {"two taking turns every 30 s": (30.0, "AB"), "one alone, every 5 min": (300.0, "A")}
SETTINGS = {"saves at a switch only (idle_save_s = 0)": (0.0, 0.0),
            "after every reply (idle_save_switched_s = 0)": (3.0, 0.0),
            "after a reply on a switching slot (default)": (3.0, 1800.0)}
SIZES = (2000, 8000, 16000)
BYTES_PER_TOKEN = 131072
HOURS_A_DAY = 8


def _counters(sock: Path) -> dict[str, Any]:
    from autosessd import ctl

    return ctl.call(sock, "status", timeout=60)["counters"]


def one(run: Any, gap_s: float, order: str, idle_s: float, switched_s: float) -> dict[str, Any]:
    from gb import _ask, _conversation, _grown

    fake = run.fake_engine()  # 100 bytes a token: the saves are counted, their size priced below
    sessions = fake["sessions"]
    conf = sessions.parent / f"{sessions.name}.toml"
    conf.write_text(f'slot_save_path = "{sessions}"\nidle_save_s = {idle_s / SCALE}\n'
                    f"idle_save_switched_s = {switched_s / SCALE}\nidle_save_mb_per_min = 1000000\n")
    d = run.daemon(fake, ["--config", str(conf)], min_tokens=256)
    convs = {name: _conversation(2000, name) for name in order}
    t0 = time.monotonic()
    for i in range(REQUESTS):
        name = order[i % len(order)]
        _, data = _ask(d["port"], convs[name])
        convs[name] = _grown(convs[name], data, i)
        time.sleep(max(0.0, t0 + (i + 1) * gap_s / SCALE - time.monotonic()))
    c = _counters(d["socket"])
    run.close()
    hours = REQUESTS * gap_s / 3600
    return {"saves": c["saves"], "idle_saves": c["idle_saves"], "idle_saves_alone": c["idle_saves_alone"],
            "saves_per_hour": c["saves"] / hours}


def s13_writes(run: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"scale": SCALE, "requests": REQUESTS, "patterns": {}}
    for pattern, (gap_s, order) in PATTERNS.items():
        out["patterns"][pattern] = {}
        for setting, (idle_s, switched_s) in SETTINGS.items():
            r = one(run, gap_s, order, idle_s, switched_s)
            out["patterns"][pattern][setting] = r
            print(f"  {pattern}, {setting}: {r['saves']} saves in {REQUESTS} requests "
                  f"({r['saves_per_hour']:.0f} an hour)", flush=True)
    return out


def t13(r: dict[str, Any]) -> str:
    lines = [f"The daemon against the fake engine, time compressed {r['scale']:g}×, {r['requests']} requests per "
             f"pattern and setting; its saves priced at an 8B model's {BYTES_PER_TOKEN:,} bytes a token, "
             f"{HOURS_A_DAY} hours of use a day.", "",
             "| pattern | setting | saves / request | saves / hour | " +
             " | ".join(f"GB a day at {n // 1000}k tokens" for n in SIZES) + " |",
             "|---|---|---:|---:|" + "---:|" * len(SIZES)]
    for pattern, settings in r["patterns"].items():
        for setting, x in settings.items():
            per_day = [x["saves_per_hour"] * HOURS_A_DAY * n * BYTES_PER_TOKEN / 1e9 for n in SIZES]
            lines.append(f"| {pattern} | {setting} | {x['saves'] / r['requests']:.2f} | {x['saves_per_hour']:.0f} | "
                         + " | ".join(f"{g:,.0f}" for g in per_day) + " |")
    return "\n".join(lines)
