"""After a reboot (issue 33): the engine and autosessd both stopped and started fresh on the
same session and state directories, with an input that cannot restore before a request (the
engine's own log, a request log, the turn hook alone). The client's next request goes on from
its last answer and must find its conversation back in the slot (cache_n >= 90%), where it
used to re-read all of it; a request of another conversation arriving during the start's
restore is not held up past it, and no slot or file ends up with another's state."""

import json
import subprocess
import sys
import threading
import time

import pytest

from autosessd.store import slotfile
from autosessd.base.keys import conversation_key
from harness import Daemon, chat_body, going_on, hook_turn, long_text, wait_until

pytestmark = pytest.mark.engine

C = chat_body(long_text(60) + "\nHow many marbles are in box 5?")  # ~1,050 tokens
D = chat_body(long_text(45, "jar") + "\nWhich jar is red?")


def status(d):
    r = subprocess.run([sys.executable, "-c", "from autosessd.cli import autosessctl_main; autosessctl_main()",
                        "--socket", str(d.socket), "--json", "status"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


class Pair:
    """An engine and autosessd on one input, stopped and started as a reboot does."""

    def __init__(self, engines, session_dir, tmp_path, input_, slots, extra_toml=""):
        self.session_dir, self.tmp_path, self.input_, self.extra_toml = session_dir, tmp_path, input_, extra_toml
        logs = tmp_path / "logs"
        logs.mkdir(exist_ok=True)
        self.engine_log, self.request_log = logs / "server.log", logs / "requests.jsonl"
        extra = ["--log-file", str(self.engine_log), "--log-jsonl"] if input_ == "engine-log" else []
        self.eng = engines(session_dir, slots=slots, extra=extra)
        self.args = {"engine-log": ["--engine-log", str(self.engine_log)],
                     "request-log": ["--request-log", str(self.request_log)], "hook": []}[input_]
        self.d = self.daemon()

    def daemon(self, start=True):
        d = Daemon(self.tmp_path, self.session_dir, self.eng.url, gate=False, args=self.args,
                   extra_toml=self.extra_toml)
        return d.start() if start else d

    def serve(self, rid, body):
        """The client's request as each input sees it (straight to the engine in every case)."""
        if self.input_ == "request-log":
            self._log(event="start", id=rid, slot=0, key=conversation_key(body))
        elif self.input_ == "hook":
            # A serving layer pins the request to the slot the turn names (several slots).
            body = {**body, "id_slot": hook_turn(self.d, body)["slot"]}
        r = self.eng.post("/v1/chat/completions", body)
        if self.input_ == "request-log":
            self._log(event="end", id=rid, slot=0, n_tokens=r["usage"]["total_tokens"],
                      n_prompt=r["usage"]["prompt_tokens"], status="ok")
        return r

    def _log(self, **line):
        with open(self.request_log, "a") as f:
            f.write(json.dumps(line) + "\n")

    def reboot(self):
        """autosessd stops first (its stop save), then the engine; the engine starts (a new
        process, its log written again), then autosessd: a service restart of the pair."""
        assert self.d.stop() == 0
        self.eng.stop()
        self.eng.start()
        self.d = self.daemon()


@pytest.mark.parametrize("input_, slots", [("engine-log", 1), ("engine-log", "auto"), ("request-log", 1),
                                            ("hook", 1), ("hook", "auto")])
def test_after_a_reboot_the_next_request_finds_its_conversation_back(engines, session_dir, tmp_path, input_, slots):
    p = Pair(engines, session_dir, tmp_path, input_, slots)
    try:
        r1 = p.serve("r1", C)
        if input_ != "hook":  # the tails save behind its end; the hook's is saved by the stop
            wait_until(lambda: status(p.d)["counters"]["saves"] >= 1, 20, 0.1, "C saved behind")
        p.reboot()
        wait_until(lambda: status(p.d)["inputs"]["start_restore"]["done"], 60, 0.1, "the restore at start")
        back = status(p.d)["inputs"]["start_restore"]
        assert back["restored"] == 1, back
        assert "has auto-" in p.d.logtext() and "back (its last conversation)" in p.d.logtext()
        # The client goes on from its last answer, without a hook call first.
        nxt = going_on(C, r1)
        r2 = p.eng.post("/v1/chat/completions", nxt)
        assert r2["timings"]["cache_n"] >= 0.9 * r2["usage"]["prompt_tokens"], r2["timings"]
    finally:
        p.d.stop()


def test_with_it_off_the_reboot_re_reads(engines, session_dir, tmp_path):
    """What the test above guards against: restore_at_start = false, the same reboot, a re-read
    (the request-log tail: the engine-log tail also puts back what it saved when the engine's
    log shows it start again)."""
    p = Pair(engines, session_dir, tmp_path, "request-log", 1, extra_toml="restore_at_start = false")
    try:
        r1 = p.serve("r1", C)
        wait_until(lambda: status(p.d)["counters"]["saves"] >= 1, 20, 0.1, "C saved behind")
        p.reboot()
        time.sleep(1)
        assert "start_restore" not in status(p.d)["inputs"]
        assert status(p.d)["counters"]["warmed_files"] == 0  # nothing put back: nothing warmed (issue 38)
        r2 = p.eng.post("/v1/chat/completions", going_on(C, r1))
        assert r2["timings"]["cache_n"] < 0.1 * r2["usage"]["prompt_tokens"]
    finally:
        p.d.stop()


def test_a_request_of_another_conversation_during_the_start_restore_wins_and_nothing_is_mixed(
        engines, session_dir, tmp_path):
    """-np 1, the engine log: D arrives as autosessd starts and puts C back. Whichever the
    engine runs first, D is answered as it would be without autosessd (its own prompt read,
    held up at most by one restore), and every file holds one conversation's tokens."""
    p = Pair(engines, session_dir, tmp_path, "engine-log", 1)
    try:
        r1 = p.serve("r1", C)
        wait_until(lambda: status(p.d)["counters"]["saves"] >= 1, 20, 0.1, "C saved behind")
        alone = p.eng.post("/v1/chat/completions", D)  # D's own time, on this engine
        wait_until(lambda: status(p.d)["counters"]["saves"] >= 2, 20, 0.1, "D saved behind")
        assert p.d.stop() == 0
        p.eng.stop()
        p.eng.start()
        box = {}
        p.d = p.daemon(start=False)
        starting = threading.Thread(target=p.d.start)
        starting.start()
        # D arrives the moment autosessd is ready: as it starts putting C back.
        wait_until(lambda: p.d.log.exists() and "autosessd ready" in p.d.log.read_text(), 60, 0.01,
                   "autosessd ready")
        t0 = time.monotonic()
        box["r"] = p.eng.post("/v1/chat/completions", D)
        box["s"] = time.monotonic() - t0
        starting.join()
        wait_until(lambda: status(p.d)["inputs"]["start_restore"]["done"], 60, 0.1, "the restore at start")
        r = box["r"]
        assert r["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
        restore_s = max((o["ms"] for o in status(p.d)["inputs"]["start_restore"]["slots"]), default=0) / 1000
        own_s = (r["timings"]["prompt_ms"] + r["timings"]["predicted_ms"]) / 1000
        assert box["s"] <= own_s + restore_s + 1.0, (box["s"], own_s, restore_s)
        st = status(p.d)
        assert st["counters"]["restores_not_trusted"] + st["inputs"]["start_restore"]["restored"] <= 1
        # Every file holds one conversation, by its header's tokens.
        for f in session_dir.glob("auto-*.bin"):
            text = p.eng.post("/detokenize", {"tokens": list(slotfile.read_header(f).tokens)})["content"]
            assert ("box number 0" in text) != ("jar number 0" in text), f.name
        # C's next request: restored at start, or (D ran on the slot) read again; never D's state.
        r2 = p.eng.post("/v1/chat/completions", going_on(C, r1))
        assert r2["timings"]["cache_n"] in range(0, 20) or r2["timings"]["cache_n"] >= 0.9 * r2["usage"]["prompt_tokens"]
    finally:
        p.d.stop()


def test_behind_a_router_each_loaded_models_last_conversation_is_back(engines, session_dir, tmp_path):
    """A router (two aliases of the test model, --models-max 1) and the turn hook alone: each
    model keeps its own record of what its slots held, so ga's conversation is back after a
    reboot of the pair even though gb ran after it, for the model loaded before autosessd
    starts; gb, not loaded, is left for its own load."""
    eng = engines(session_dir, ctx=8192, slots=1, router=(tmp_path / "models", ["ga", "gb"], 1))
    d = Daemon(tmp_path, session_dir, eng.url, gate=False).start()

    def serve(model, body):
        slot = hook_turn(d, body, model)["slot"]
        return eng.post("/v1/chat/completions", {**body, "model": model, "id_slot": slot})

    try:
        r1 = serve("ga", C)
        serve("gb", D)  # autosessd saves ga's conversation, then has the router put ga away
        assert d.stop() == 0
        eng.stop()
        eng.start()
        eng.post("/models/load", {"model": "ga"})
        wait_until(lambda: any(m["id"] == "ga" and m["status"]["value"] == "loaded"
                               for m in eng.get("/models")["data"]), 120, 0.2, "ga loaded")
        d = Daemon(tmp_path, session_dir, eng.url, gate=False).start()
        wait_until(lambda: status(d)["inputs"]["start_restore"]["done"], 60, 0.1, "the restore at start")
        back = status(d)["inputs"]["start_restore"]
        assert back["restored"] == 1 and [o["model"] for o in back["slots"]] == ["ga"], back
        assert "model ga: slot 0 has auto-" in d.logtext()
        r2 = eng.post("/v1/chat/completions", {**going_on(C, r1), "model": "ga"})
        assert r2["timings"]["cache_n"] >= 0.9 * r2["usage"]["prompt_tokens"], r2["timings"]
    finally:
        d.stop()

