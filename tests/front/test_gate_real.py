"""The gate in front of a real llama-server, driven over HTTP as a client would."""

import json
import signal
import time
import urllib.error
import urllib.request

import pytest

from autosessd.base.keys import conversation_key
from harness import Daemon, answer, chat_body, going_on, long_text, saves_final, stream_chat, wait_until

pytestmark = pytest.mark.engine

A = chat_body(long_text(70) + "\nHow many marbles are in box 5?")  # ~1,250 tokens
B = chat_body(long_text(40, "jar") + "\nWhich jar is red?")


def post(base, body, path="/v1/chat/completions", timeout=300):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def test_switch_back_through_gate_reuses_and_direct_does_not(engines, session_dir, tmp_path, model):
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        a1 = post(d.gate_url, A)
        post(d.gate_url, B)
        a2_body = going_on(A, a1)  # A goes on from its answer, as a client's next request does
        a2 = post(d.gate_url, a2_body)
        prompt = a2["usage"]["prompt_tokens"]
        assert prompt >= 1000
        assert a2["timings"]["cache_n"] >= 0.9 * prompt
        assert (session_dir / f"auto-{conversation_key(A)}.bin").exists()
        st = d.status()
        assert st["counters"]["restores_reused"] == 1 and st["counters"]["saves"] == 2
        assert st["slots"][0]["held"] == conversation_key(A)
        # The same flow straight against the engine (--cache-ram 0): A is read again, and
        # answered as through the gate (the restored state is the engine's own).
        post(eng.url, B)
        a3 = post(eng.url, a2_body)
        assert a3["timings"]["cache_n"] <= 0.05 * a3["usage"]["prompt_tokens"]
        assert a3["timings"]["prompt_n"] >= 0.95 * a3["usage"]["prompt_tokens"]
        assert answer(a3) == answer(a2)
    finally:
        d.stop()


def test_streaming_is_not_buffered(engines, session_dir, tmp_path):
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        body = chat_body("Write a long story about a cat.", max_tokens=120, stream=True)
        req = urllib.request.Request(d.gate_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        arrivals, timings = [], None
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            for line in r:
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic())
                    timings = json.loads(line[6:]).get("timings") or timings
        end = time.monotonic()
        assert timings and timings["predicted_n"] > 10
        # Buffered, every chunk would arrive at the end. Forwarded as generated, the first
        # arrives while the engine still has most of its generation time ahead of it.
        assert end - arrivals[0] >= 0.5 * timings["predicted_ms"] / 1000
        assert len({round(t, 3) for t in arrivals}) > 10
    finally:
        d.stop()


def test_restart_of_engine_and_daemon_restores_the_held_conversation(engines, session_dir, tmp_path, model):
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url).start()
    # Streamed, and stopped the moment the last chunk is read: the bookkeeping after the
    # response must still land before the stop save.
    text1, t1 = stream_chat(d.gate_url, A)
    assert d.stop(signal.SIGTERM) == 0
    held = t1["prompt_n"] + t1["cache_n"] + t1["predicted_n"] - 1
    if model.swa:  # the stop save takes the slot back to one token before its prompt's end (rewind.py)
        held = t1["prompt_n"] + t1["cache_n"] - 1
    assert f"saved {held:,} tokens" in d.logtext()
    eng.restart()
    d2 = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        a2_body = going_on(A, text1)
        a2 = post(d2.gate_url, a2_body)
        assert a2["timings"]["cache_n"] >= 0.9 * a2["usage"]["prompt_tokens"]
    finally:
        d2.stop()
    eng.post("/slots/0?action=erase", {})  # the engine alone, reading it from its first token
    assert answer(eng.post("/v1/chat/completions", a2_body)) == answer(a2)


def test_engine_killed_gives_502_then_recovers(engines, session_dir, tmp_path):
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url, timeout_s=5).start()
    try:
        a1 = post(d.gate_url, A)
        post(d.gate_url, B)  # A is saved
        eng.stop(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as e:
            post(d.gate_url, going_on(A, a1))
        assert time.monotonic() - t0 < 5 + 2
        assert e.value.code == 502
        err = json.load(e.value)["error"]
        assert err["src"] == "autosessd" and eng.url in err["message"]
        eng.start()
        # The gate's held A (from the failed request) is not trusted: the engine restarted empty.
        a = post(d.gate_url, going_on(A, a1))
        assert a["timings"]["cache_n"] >= 0.9 * a["usage"]["prompt_tokens"]
        assert "Traceback" not in d.logtext()
    finally:
        d.stop()


def test_status_and_metrics_endpoints(engines, session_dir, tmp_path):
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        post(d.gate_url, A)
        post(d.gate_url, B)
        saves_final(session_dir)  # A's save is counted as a file once its finalize renamed it
        st = d.status()
        assert st["engine"]["kind"] == "llama-server" and st["engine"]["healthy"] is True
        assert st["store"]["auto_files"] == 1 and st["inputs"]["gate"]["upstream"] == eng.url
        with urllib.request.urlopen(d.gate_url + "/autosessd/metrics") as r:
            text = r.read().decode()
        assert "autosessd_saves_total 1" in text and "autosessd_turns_total 2" in text
        # Untouched pass-through of the engine's own endpoints
        with urllib.request.urlopen(d.gate_url + "/props") as r:
            assert json.load(r)["total_slots"] == 1
        with pytest.raises(urllib.error.HTTPError) as e:
            post(d.gate_url, {"messages": "nope"})  # the engine's own error, passed on
        assert e.value.code in (400, 500) and "src" not in json.load(e.value).get("error", {})
    finally:
        d.stop()


def test_client_disconnect_stops_the_engine_and_leaves_state_provisional(engines, session_dir, tmp_path):
    import http.client

    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        # ignore_eos: the model cannot end the story on its own before the disconnect, so
        # "stopped early" below can only be the disconnect's doing.
        body = {**chat_body("Write a very long story about a cat.", max_tokens=4000, stream=True), "ignore_eos": True}
        c = http.client.HTTPConnection("127.0.0.1", d.gate_port, timeout=60)
        c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        r.fp.readline()  # the first chunk arrived: generation is under way
        c.sock.close()
        c.close()
        wait_until(lambda: not eng.get("/slots")[0]["is_processing"], 20, what="the engine to stop generating")
        decoded = eng.get("/slots")[0]["next_token"][0]["n_decoded"]
        assert decoded < 4000
        st = wait_until(lambda: (s := d.status())["slots"] and s["slots"][0]["durable"] is False and s, 10,
                        what="the held state to be marked provisional")
        assert st["slots"][0]["held"] == conversation_key(body)
        # The gate is free again: the FIFO was released.
        assert post(d.gate_url, chat_body("Say hi."))["choices"]
    finally:
        d.stop()


def test_engine_restart_between_requests_fails_nothing(engines, session_dir, tmp_path):
    """An engine restarted between two requests: the next one restores and nothing fails."""
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        a1 = post(d.gate_url, A)
        post(d.gate_url, B)  # A saved
        eng.restart()
        a = post(d.gate_url, going_on(A, a1))  # straight away: the watcher may not have noticed yet
        assert a["timings"]["cache_n"] >= 0.9 * a["usage"]["prompt_tokens"]
        assert "cannot reach" not in d.logtext()
    finally:
        d.stop()


def test_sigterm_with_a_request_in_flight_through_the_gate(engines, session_dir, tmp_path):
    """SIGTERM while the gate streams a long generation: the request gets the stop's grace
    (half of stop_timeout_s here: 5 s), then its connection is closed cleanly, the engine
    stops generating, and the daemon exits 0. Nothing partial is saved: no temporary is
    left, and a file of the conversation, if the stop save wrote one, was taken once the
    engine was idle (DESIGN §7) -- its header holds what the idle slot held."""
    import http.client
    import threading

    from autosessd.store.slotfile import read_header

    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url, extra_toml="stop_timeout_s = 10").start()
    body = {**chat_body(A["messages"][0]["content"], max_tokens=3000, stream=True), "ignore_eos": True}
    outcome = {}
    first_chunk = threading.Event()

    def client():
        c = http.client.HTTPConnection("127.0.0.1", d.gate_port, timeout=120)
        try:
            c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            outcome["status"] = r.status
            done = False
            for line in r:
                first_chunk.set()
                done = done or line.startswith(b"data: [DONE]")
            outcome["end"] = "complete" if done else "closed"
        except (http.client.IncompleteRead, ConnectionError) as e:
            outcome["end"] = f"closed ({type(e).__name__})"
        finally:
            first_chunk.set()
            c.close()

    t = threading.Thread(target=client)
    t.start()
    assert first_chunk.wait(300), "no chunk arrived"
    assert d.stop(signal.SIGTERM) == 0
    t.join(60)
    # 3,000 tokens cannot be generated on this machine in 5 s: the stop cut the request,
    # with a clean close (the status line had been sent), never an error the gate made up.
    assert outcome["status"] == 200 and outcome["end"].startswith("closed"), outcome
    wait_until(lambda: not eng.get("/slots")[0]["is_processing"], 20, what="the engine to stop generating")
    [slot] = eng.get("/slots")
    assert slot["next_token"][0]["n_decoded"] < 3000
    log = d.logtext()
    assert "gate: stop: 1 request(s) still in flight after 5 s" in log, log
    assert "Traceback" not in log and "gave up" not in log, log
    assert not list(session_dir.glob(".autosessd-*"))
    for f in session_dir.glob("auto-*.bin"):
        meta = json.loads(f.with_suffix(".json").read_text())
        assert read_header(f).n_tokens == meta["n_tokens"] == slot["n_prompt_tokens"], (meta, slot)
