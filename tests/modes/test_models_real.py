"""Model switches on the real llama-server: router mode (--models-dir, --models-max 1) and
--sleep-idle-seconds, through the gate as a client drives them.

Two aliases of the one test model are two models to the router (each its own child process,
slots and KV state), which is all a model switch needs; the engine's own numbers
(timings.cache_n) and the files' headers are what the checks read.
"""

import json
import time
import urllib.request

import pytest

from autosessd.store import slotfile
from autosessd.base.keys import conversation_key
from autosessd.modes.models import model_key
from harness import Daemon, long_text

pytestmark = pytest.mark.engine


def post(base, body, path="/v1/chat/completions", timeout=600):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


class Chat:
    """One conversation with one model: each request sends everything so far, then keeps the
    answer and asks one more question (what a chat client does)."""

    def __init__(self, model, text):
        self.model = model
        self.messages = [{"role": "user", "content": text}]
        self.n = 0

    def body(self):
        b = {"messages": self.messages, "temperature": 0, "max_tokens": 8, "seed": 1}
        return {"model": self.model, **b} if self.model else b

    def send(self, base):
        first = self.body()
        r = post(base, first)
        self.messages = [*self.messages, {"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"And question {self.n}?"}]
        self.n += 1
        return r, first

    @staticmethod
    def reused(r):
        return r["timings"]["cache_n"] / r["usage"]["prompt_tokens"]


def router(engines, session_dir, tmp_path, slots=1):
    return engines(session_dir, ctx=8192, slots=slots, router=(tmp_path / "models", ["ga", "gb"], 1))


@pytest.mark.parametrize("model", ["kv8b"], indirect=True)  # Gemma 3 behind the router: the next tests
def test_a_model_switch_and_back_reuses_the_conversation_and_the_router_alone_does_not(engines, session_dir,
                                                                                      tmp_path, model):
    eng = router(engines, session_dir, tmp_path)
    d = Daemon(tmp_path, session_dir, eng.url, timeout_s=120).start()
    try:
        a, b = Chat("ga", long_text(125) + "\nHow many marbles are in box 5?"), Chat("gb", long_text(20, "jar"))
        a.send(d.gate_url)
        b.send(d.gate_url)  # gb loads: ga is unloaded, after its conversation was saved
        back, _ = a.send(d.gate_url)
        assert back["usage"]["prompt_tokens"] >= 2000
        assert Chat.reused(back) >= 0.9
        st = d.status()
        assert st["counters"]["model_unloads"] >= 2 and st["counters"]["restores_after_model_switch"] == 1
        assert {m["id"]: m["status"] for m in st["router"]["models"]} == {"ga": "loaded", "gb": "unloaded"}
        metrics = urllib.request.urlopen(d.gate_url + "/autosessd/metrics", timeout=10).read().decode()
        assert 'autosessd_router_model_loaded{model="ga"} 1' in metrics
    finally:
        d.stop()
    # The same switch straight to the router: ga comes back empty.
    b.send(eng.url)
    alone, _ = a.send(eng.url)
    assert alone["timings"]["cache_n"] == 0


def test_two_conversations_on_one_model_and_one_on_another_over_five_model_switches(engines, session_dir, tmp_path):
    """The engine's default slots (-np auto: 4, one unified KV cache) in each model's child."""
    eng = router(engines, session_dir, tmp_path, slots="auto")
    d = Daemon(tmp_path, session_dir, eng.url, timeout_s=120).start()
    try:
        a1, a2 = Chat("ga", long_text(40) + "\nWhich box is red?"), Chat("ga", long_text(40, "jar") + "\nAnd jars?")
        b1 = Chat("gb", long_text(40, "crate") + "\nWhich crate is blue?")
        returns = []
        for c in (a1, a2, b1):
            c.send(d.gate_url)
        for _ in range(2):  # with the first round, five model switches: each request below is a return
            for c in (a1, a2, b1):
                r, _ = c.send(d.gate_url)
                returns.append((c.model, r["usage"]["prompt_tokens"], Chat.reused(r)))
        assert all(reused >= 0.9 for _, _, reused in returns), returns
        # Each file holds its own model's conversation, named for both (the engine's tokens,
        # read back to text by the engine itself), and says which model wrote it.
        loaded = next(m["id"] for m in d.status()["router"]["models"] if m["status"] == "loaded")
        fingerprints = {}
        for c, topic in ((a1, "box"), (a2, "jar"), (b1, "crate")):
            name = f"auto-{model_key(c.model, conversation_key({'messages': c.messages}))}"
            tokens = list(slotfile.read_header(session_dir / f"{name}.bin").tokens)
            text = post(eng.url, {"model": loaded, "tokens": tokens}, "/detokenize?autoload=false")["content"]
            assert f"the red {topic} number 0" in text
            assert not any(f" {other} " in text for other in {"box", "jar", "crate"} - {topic}), text[:200]
            fingerprints.setdefault(c.model, set()).add(json.loads((session_dir / f"{name}.json").read_text())["model"])
        assert len(fingerprints["ga"]) == 1 and fingerprints["ga"] != fingerprints["gb"]
        assert not any(m["in_flight"] for m in d.status()["router"]["models"])
    finally:
        d.stop()


def asleep_within(base, seconds):
    """Waits until the engine's /props says it sleeps (asking neither wakes it nor moves its timer)."""
    deadline = time.monotonic() + seconds
    while True:
        with urllib.request.urlopen(base + "/props", timeout=10) as r:
            if json.load(r).get("is_sleeping"):
                return
        assert time.monotonic() < deadline, f"the engine did not sleep within {seconds} s"
        time.sleep(0.25)


def test_a_sleeping_engine_wakes_to_its_conversation(engines, session_dir, tmp_path):
    """--sleep-idle-seconds 5 on one slot: no switch saves the conversation; the sleep would
    drop it. autosessd reads the timer from the engine's command line."""
    eng = engines(session_dir, slots=1, extra=["--sleep-idle-seconds", "5"])
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        c = Chat(None, long_text(60) + "\nWhich box is green?")
        c.send(d.gate_url)
        # autosessd's save is a task to the engine and starts its timer again: the engine
        # sleeps 5 s after the save, not after the request (server-queue.cpp).
        asleep_within(eng.url, 30)
        r, _ = c.send(d.gate_url)
        assert Chat.reused(r) >= 0.9, r["timings"]
        counters = d.status()["counters"]
        assert counters["saves_before_sleep"] == 1 and counters["restores_after_sleep"] == 1
        assert "sleeps after 5 s idle" in d.logtext()
    finally:
        d.stop()
    # The engine alone: the same sleep, and the conversation is read again.
    c2 = Chat(None, long_text(60, "jar") + "\nWhich jar is green?")
    c2.send(eng.url)
    asleep_within(eng.url, 30)
    r, _ = c2.send(eng.url)
    assert r["timings"]["cache_n"] == 0
