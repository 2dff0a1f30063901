"""bench/gpu.py's reading of its results: the Markdown table, where a return stops paying, what `auto` picks.

    python bench/gpu_table.py RESULT.json      print an earlier run's table again

All pure functions of the result dict that bench/gpu.py writes (tests/project/test_gpu_bench.py).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(HERE.parent), str(HERE)) if p not in sys.path]


def _g(d: Any, *path: str) -> Any:
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def crossing(points: list[tuple[int, float, float]]) -> dict[str, Any]:
    """Where a return (y) stops beating a re-read (x), from (tokens, re-read s, return s) by size.
    → {"verdict": "always" | "never" | "from", "tokens": n (from)}: "from" interpolates linearly
    between the last size where the return won and the first where it lost."""
    pts = sorted(p for p in points if p[1] is not None and p[2] is not None)
    if not pts:
        return {"verdict": "unmeasured"}
    wins = [reread > ret for _, reread, ret in pts]
    if all(wins):
        return {"verdict": "always", "tokens": None}
    if not any(wins):
        return {"verdict": "never", "tokens": None}
    for (n0, r0, t0), (n1, r1, t1), w0, w1 in zip(pts, pts[1:], wins, wins[1:]):
        if w0 != w1:
            d0, d1 = r0 - t0, r1 - t1
            n = n0 + (n1 - n0) * d0 / (d0 - d1) if d0 != d1 else n1
            return {"verdict": "from" if w0 else "up to", "tokens": int(round(n))}
    return {"verdict": "mixed", "tokens": None}


def auto_choice(reads: list[tuple[int, int, float]], rates: dict[str, Any] | None,
                scale_reads: float = 1.0) -> dict[str, Any] | None:
    """What autosessd's `auto_sessions_min_tokens = "auto"` would choose here: its own
    policy.auto_min_tokens on the bench's re-reads (cache_n, prompt_n, prompt_ms; scaled by
    scale_reads for an estimate of a bigger model) and the daemon's measured saves and
    restores (state_dir/savings.json's rows)."""
    if not reads or not rates:
        return None
    from autosessd.sessions import policy
    from autosessd.sessions.savings import Rates

    r = Rates({"reads": [[c, p, ms * scale_reads] for c, p, ms in reads], "saves": rates.get("saves"),
               "restores": rates.get("restores")})
    n, why = policy.auto_min_tokens(r.prefill(), r.save(), r.restore(), r.bytes_per_token())
    return {"min_tokens": n, "why": why}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Per model: the crossings (warm, cold) and auto's choice; the 70B estimate from the 8B's reads."""
    out: dict[str, Any] = {}
    models = res.get("models") or {}
    for name, m in models.items():
        sizes = m.get("sizes") or {}
        pts = {mode: [(int(n), _g(s, "alone", "reread", "ttft_s"), _g(s, "autosessd", mode, "ttft_s"))
                      for n, s in sizes.items()] for mode in ("warm", "cold")}
        out[name] = {"warm": crossing(pts["warm"]), "cold": crossing(pts["cold"]),
                     "auto": auto_choice(_reads(m), m.get("daemon_rates"))}
    est = res.get("estimate_70b") or {}
    kv, base = models.get(est.get("kv", "")), models.get(est.get("from", ""))
    if kv and base:
        big = est["flops_ratio"]
        pts_w, pts_c = [], []
        for n, s in (kv.get("sizes") or {}).items():
            reread = _reread_estimate(base, int(n), big)
            pts_w.append((int(n), reread, _g(s, "autosessd", "warm", "ttft_s")))
            pts_c.append((int(n), reread, _g(s, "autosessd", "cold", "ttft_s")))
        out["70b (estimated)"] = {"warm": crossing(pts_w), "cold": crossing(pts_c),
                                  "auto": auto_choice(_reads(base), kv.get("daemon_rates"), big),
                                  "how": f"re-reads: {est['from']}'s measured x {big:.2f} (Llama 3 70B's FLOPs per "
                                         f"token over the {est['from']} model's); returns and rates: {est['kv']}'s"}
    return out


def _reads(m: dict[str, Any]) -> list[tuple[int, int, float]]:
    """The engine-alone re-reads of a model as savings.Rates rows: (cache_n, prompt_n, prompt_ms)."""
    return [(x.get("cache_n") or 0, x["prompt"] - (x.get("cache_n") or 0), x["prompt_ms"])
            for s in (m.get("sizes") or {}).values()
            for x in (_g(s, "alone", "reread", "samples") or []) if x.get("prompt_ms")]


def _reread_estimate(base: dict[str, Any] | None, n: int, ratio: float) -> float | None:
    """A re-read of n tokens on the bigger model: the base model's re-read time at the nearest size,
    scaled by n and the FLOPs ratio (the base's time at that size over its tokens: quadratic parts
    are carried along only approximately)."""
    if not base:
        return None
    best = None
    for m, s in (base.get("sizes") or {}).items():
        t = _g(s, "alone", "reread", "ttft_s")
        if t is not None and (best is None or abs(int(m) - n) < abs(best[0] - n)):
            best = (int(m), t)
    return None if best is None else round(best[1] * n / best[0] * ratio, 3)


def _s(x: Any, unit: str = "s") -> str:
    """A time for people: "1.23 s", or "87 ms" under a second."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    s = x / 1000 if unit == "ms" else x
    return f"{s:.2f} s" if s >= 1 else f"{s * 1000:.0f} ms"


def _bytes(b: Any) -> str:
    return "-" if not b else f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}×" if a and b else "-"


def table(res: dict[str, Any]) -> str:
    lines = [f"Machine: {res.get('machine', '?')}. Engine: llama-server {res.get('engine', '?')}. "
             "Times to first token (the client's), medians; *turn*: autosessd's own time before it forwards "
             "the return; *restore*: the engine's restore_ms inside it. B is ~100 tokens (never saved), "
             "so a return costs A's restore alone; the switch to B waits for A's save.", "",
             "| model | A tokens | file | re-read (engine alone) | engine RAM-cache hit | autosessd warm: first token "
             "(turn / restore) | cold: first token (turn / restore) | cold, from blocks: first token (turn) | "
             "switch-away save | warm / re-read |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in (res.get("models") or {}).items():
        for n, s in sorted((m.get("sizes") or {}).items(), key=lambda kv: int(kv[0])):
            w, c = _g(s, "autosessd", "warm") or {}, _g(s, "autosessd", "cold") or {}
            bl = _g(s, "autosessd", "blocks") or {}
            reread = _g(s, "alone", "reread", "ttft_s")
            fb = _g(s, "autosessd", "file_bytes")
            lines.append(
                f"| {name} | {_g(s, 'alone', 'prompt_tokens') or int(n):,} | "
                f"{_bytes(fb)} | {_s(reread)} | {_s(_g(s, 'ram_hit', 'ttft_s'))} | "
                f"{_s(w.get('ttft_s'))} ({_s(w.get('turn_ms'), 'ms')} / {_s(w.get('engine_restore_ms'), 'ms')}) | "
                f"{_s(c.get('ttft_s'))} ({_s(c.get('turn_ms'), 'ms')} / {_s(c.get('engine_restore_ms'), 'ms')}) | "
                f"{_s(bl.get('ttft_s'))} ({_s(bl.get('turn_ms'), 'ms')}) | "
                f"{_s(_g(s, 'autosessd', 'switch_save', 'save_ms'), 'ms')} | "
                f"**{_ratio(w.get('ttft_s'), reread)}** |"
                + (f" *cut: {s['cut']}*" if s.get("cut") else "") + (" *failed: see the JSON*" if s.get("error") else ""))
    summary = res.get("summary") or {}
    if summary:
        lines += ["", "Where autosessd's return stops beating a re-read, and what `auto_sessions_min_tokens = "
                  "\"auto\"` picks from these rates (autosessd's own policy.auto_min_tokens):", ""]
        for name, v in summary.items():
            def say(x: dict[str, Any]) -> str:
                return {"always": "beats it at every size measured", "never": "loses at every size measured",
                        "from": f"loses from ~{x.get('tokens') or 0:,} tokens",
                        "up to": f"wins from ~{x.get('tokens') or 0:,} tokens"}.get(x.get("verdict"), "unmeasured")
            auto = v.get("auto")
            lines.append(f"- {name}: warm {say(v['warm'])}; cold {say(v['cold'])}; auto: "
                         + (f"min tokens {auto['min_tokens']:,} ({auto['why']})" if auto else "not enough rates")
                         + (f". {v['how']}" if v.get("how") else ""))
    if res.get("skipped"):
        lines += ["", "Not measured: " + "; ".join(res["skipped"])]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.loads(Path(sys.argv[1]).read_text())))
