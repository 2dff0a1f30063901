"""What autosessd spared, against the real engine (issue 22's acceptance): after the demo's switch
(A, B, back to A) with no --min-tokens, `autosessctl status` shows the prompt tokens the engine
did not read again and the seconds that spared, and the return's X-Autosessd-Est-Saved-Ms says
the same; both within 20% of the engine's own timing of that very re-read (the same request sent
to the same engine with its slot erased). Then `autosessctl doctor` on an engine without
--swa-full names the flag and where the unreused restore's prompt stood."""

import json
import re
import subprocess
import sys
import urllib.request

import pytest

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


def ms_per_token(answer):
    t = answer["timings"]
    assert t["cache_n"] == 0  # a read from an empty slot: the whole prompt
    return t["prompt_ms"] / t["prompt_n"]


def test_status_shows_the_tokens_and_seconds_spared_as_the_engine_timed_them(engines, session_dir, tmp_path):
    """The engine's own timing of the re-read is taken twice, on the same engine: A read cold before
    the daemon starts, and the return's prompt read cold after it (its slot erased). A machine shared
    with other work changes speed between the two; the figures must lie within 20% of those
    timings (of the one, or of the other, or between them)."""
    eng = engines(save_dir=session_dir)
    alone, _ = chat(eng.url, A)  # the engine alone, as the demo's second leg
    eng.post("/slots/0?action=erase", {})
    d = Daemon(tmp_path, session_dir, eng.url, min_tokens=None).start()  # the default: auto
    try:
        back, headers, messages = demo_switch(d.gate_url)
        t = back["timings"]  # the engine's timings pass through untouched
        assert t["cache_n"] > 2000, t
        st = json.loads(ctl(d, "--json", "status"))
        last = st["slots"][0]["last_restore"]
        spared_tokens = last["cache_n"] - (last["slot_shared"] or 0)
        since = st["spared"]["since_start"]
        assert since["prompt_tokens"] == spared_tokens and since["restores_reused"] == 1
        eng.post("/slots/0?action=erase", {})
        direct, _ = chat(eng.url, messages)  # the re-read autosessd spared, timed by the engine
        truths = sorted(ms_per_token(x) * spared_tokens / 1000 for x in (alone, direct))

        def within(s):
            return 0.8 * truths[0] <= s <= 1.2 * truths[1]

        assert within(since["seconds"]), (since, truths)
        est = int(headers["X-Autosessd-Est-Saved-Ms"]) / 1000
        assert within(est), (est, truths)
        assert headers["X-Autosessd-Restored"].endswith(".bin") and headers["X-Autosessd-Slot"] == "0"
        # For people: the headline, in their units.
        text = ctl(d, "status")
        m = re.search(r"since start: ([\d,]+) prompt tokens not read again, ~([\d.]+) s of prefill spared", text)
        assert m, text
        assert int(m.group(1).replace(",", "")) == spared_tokens and within(float(m.group(2)))
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
