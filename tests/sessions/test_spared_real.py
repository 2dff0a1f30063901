"""What autosessd spared, against the real engine (issue 22's acceptance): after the demo's switch
(A, B, back to A) with no --min-tokens, `autosessctl status` shows the prompt tokens the engine
did not read again and the seconds that spared, and the return's X-Autosessd-Est-Saved-Ms says
the same: the figure the engine's own timings of the reads before it give (no test here depends
on the machine's speed staying the same from one request to the next; how close the estimate
comes to a fresh re-read is bench scenario 1's). Then `autosessctl doctor` on an engine without
--swa-full names the flag and where the unreused restore's prompt stood."""

import json
import re
import subprocess
import sys
import urllib.request

import pytest

from autosessd.ctl_text import seconds
from harness import ROOT, Daemon, wait_until

sys.path.insert(0, str(ROOT / "scripts"))
import demo  # noqa: E402

pytestmark = pytest.mark.engine


def chat(base, messages, headers=False):
    body = {"messages": messages, "temperature": 0, "max_tokens": 8, "seed": 1}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r), dict(r.headers)


def ctl(d, *args):
    r = subprocess.run([sys.executable, "-c", "from autosessd.cli import autosessctl_main; autosessctl_main()",
                        "--socket", str(d.socket), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


A = [{"role": "user", "content": demo.facts(demo.A_FACTS, "box") + "\nHow many marbles are in box 5?"}]
B = [{"role": "user", "content": demo.facts(40, "jar") + "\nWhich jar is red?"}]


def demo_switch(base, a=A):
    """The demo's steps 1-3; returns the return's (answer, headers) and its messages."""
    first, _ = chat(base, a)
    chat(base, B)
    a = a + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And in box 7?"}]
    back, headers = chat(base, a)
    return back, headers, a


def nnls2(rows):
    """u, v >= 0 minimising sum (y - u*x1 - v*x2)^2 over rows (x1, x2, y): the two-variable
    non-negative least squares, written here from its definition (the exact solve when both come
    out non-negative, else the better of the one-variable fits)."""
    s11 = sum(a * a for a, _, _ in rows)
    s22 = sum(b * b for _, b, _ in rows)
    s12 = sum(a * b for a, b, _ in rows)
    s1y = sum(a * y for a, _, y in rows)
    s2y = sum(b * y for _, b, y in rows)
    det = s11 * s22 - s12 * s12
    if det > 0:
        u, v = (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det
        if u >= 0 and v >= 0:
            return u, v
    cands = [(max(0.0, s1y / s11), 0.0), (0.0, max(0.0, s2y / s22))]
    return min(cands, key=lambda uv: sum((y - uv[0] * a - uv[1] * b) ** 2 for a, b, y in rows))


def test_status_shows_the_tokens_and_seconds_spared_as_the_engine_timed_them(engines, session_dir, tmp_path):
    """The figures are made of the engine's own timings, not of autosessd's clock: the tokens are
    the return's cache_n less what the slot shared, and the seconds those tokens priced at the
    prompt rate fitted from the reads the engine timed before the return was verified (A's first
    read and B's, as their responses through the gate said: ms = a*p + b*((c+p)^2 - c^2)). The
    test fits the same observations itself and asks for that figure within rounding. (How close
    the figure comes to a fresh re-read of the same tokens, timed minutes apart on a machine shared
    with other work, is a benchmark's question: bench scenario 1 prints it, issue 38.)"""
    eng = engines(save_dir=session_dir)
    d = Daemon(tmp_path, session_dir, eng.url, min_tokens=None).start()  # the default: auto
    try:
        first, _ = chat(d.gate_url, A)
        other, _ = chat(d.gate_url, B)
        a = A + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And in box 7?"}]
        back, headers = chat(d.gate_url, a)
        t = back["timings"]  # the engine's timings pass through untouched
        assert t["cache_n"] > 2000, t
        st = json.loads(ctl(d, "--json", "status"))
        last = st["slots"][0]["last_restore"]
        had = last["slot_shared"] or 0
        spared_tokens = last["cache_n"] - had
        assert last["cache_n"] == t["cache_n"]
        since = st["spared"]["since_start"]
        assert since["prompt_tokens"] == spared_tokens and since["restores_reused"] == 1
        reads = [(x["timings"]["cache_n"], x["timings"]["prompt_n"], x["timings"]["prompt_ms"]) for x in (first, other)]
        ca, cb = nnls2([(p, (c + p) ** 2 - c * c, ms) for c, p, ms in reads])
        expect_ms = ca * spared_tokens + cb * (t["cache_n"] ** 2 - had ** 2)
        assert since["seconds"] == pytest.approx(expect_ms / 1000, abs=0.0011), (since, reads)
        assert int(headers["X-Autosessd-Est-Saved-Ms"]) == pytest.approx(expect_ms, abs=1.01)
        assert headers["X-Autosessd-Restored"].endswith(".bin") and headers["X-Autosessd-Slot"] == "0"
        # For people: the headline, in their units.
        text = ctl(d, "status")
        m = re.search(r"since start: ([\d,]+) prompt tokens not read again, ~(.+?) of prefill spared", text)
        assert m, text
        assert int(m.group(1).replace(",", "")) == spared_tokens
        assert m.group(2) == seconds(since["seconds"])  # the figure above, for people (850 ms, 12.3 s, 1 min 5 s)
        # auto chose its threshold from what it measured, and says so.
        assert st["store"]["min_tokens_auto"] and st["store"]["min_tokens"] <= spared_tokens
        assert "(auto)" in d.logtext() and "saves from:" in text
    finally:
        d.stop()
    # In total, over runs: the next start begins with this run's figures.
    d2 = Daemon(tmp_path, session_dir, eng.url, min_tokens=None).start()
    try:
        total = json.loads(ctl(d2, "--json", "status"))["spared"]["total"]
        assert total["prompt_tokens"] == spared_tokens and total["seconds"] == pytest.approx(since["seconds"])
    finally:
        d2.stop()


def test_doctor_names_swa_full_on_an_engine_without_it(engines, session_dir, tmp_path):
    eng = engines(save_dir=session_dir, swa_full=False)
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        demo_switch(d.gate_url, [{"role": "user", "content": demo.facts(60, "box") + "\nHow many in box 5?"}])
        wait_until(lambda: d.status()["counters"]["restores_not_reused"] == 1, 30, 0.1, "the unreused restore")
        text = ctl(d, "doctor")
        swa = next(ln for ln in text.splitlines() if "--swa-full" in ln)
        assert swa.startswith("PROBLEM") and "fix: start llama-server with --swa-full" in swa
        assert "the prompt continues the whole file" in text  # the client did nothing wrong
        assert "(its command line is not readable" not in text  # read from the engine's own process
        r = json.loads(ctl(d, "--json", "doctor"))
        assert {f["setting"] for f in r["findings"]} >= {"--swa-full", "--slot-save-path", "--no-slots", "-c",
                                                         "model"}
    finally:
        d.stop()
