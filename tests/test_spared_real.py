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


def demo_switch(base, facts=demo.A_FACTS):
    """The demo's steps 1-3; returns the return's (answer, headers) and its messages."""
    a = [{"role": "user", "content": demo.facts(facts, "box") + "\nHow many marbles are in box 5?"}]
    b = [{"role": "user", "content": demo.facts(40, "jar") + "\nWhich jar is red?"}]
    first, _ = chat(base, a)
    chat(base, b)
    a = a + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And in box 7?"}]
    back, headers = chat(base, a)
    return back, headers, a


def test_status_shows_the_tokens_and_seconds_spared_as_the_engine_timed_them(engines, session_dir, tmp_path):
    eng = engines(save_dir=session_dir)
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
        # The engine's own timing of that re-read: the same request, its slot erased first.
        eng.post("/slots/0?action=erase", {})
        direct, _ = chat(eng.url, messages)
        truth_s = direct["timings"]["prompt_ms"] / 1000 * spared_tokens / direct["timings"]["prompt_n"]
        assert direct["timings"]["cache_n"] == 0
        assert since["seconds"] == pytest.approx(truth_s, rel=0.2), (since, direct["timings"])
        est = int(headers["X-Autosessd-Est-Saved-Ms"]) / 1000
        assert est == pytest.approx(truth_s, rel=0.2)
        assert headers["X-Autosessd-Restored"].endswith(".bin") and headers["X-Autosessd-Slot"] == "0"
        # For people: the headline, in their units.
        text = ctl(d, "status")
        m = re.search(r"since start: ([\d,]+) prompt tokens not read again, ~([\d.]+) s of prefill spared", text)
        assert m, text
        assert int(m.group(1).replace(",", "")) == spared_tokens
        assert float(m.group(2)) == pytest.approx(truth_s, rel=0.2)
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
        demo_switch(d.gate_url, facts=60)
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
