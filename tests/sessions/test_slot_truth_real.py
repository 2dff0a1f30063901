"""What a slot holds is known, not guessed (issue 10), against the real llama-server, driven as
users drive autosessd: through the gate, the turn hook, autosessctl and a request log.

Every check of a session file reads the engine's own record of it — the token list in the
file's header — and detokenizes it with the engine: auto-<key>.bin must hold conversation
`key`, never another one."""

import json
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from autosessd.store import slotfile
from autosessd.base.keys import conversation_key
from harness import Daemon, chat_body, going_on, long_text, saves_final, wait_until

pytestmark = pytest.mark.engine

A = chat_body(long_text(70) + "\nHow many marbles are in box 5?")  # ~1,250 tokens
B = chat_body(long_text(40, "jar") + "\nWhich jar is red?")  # ~700
C = chat_body(long_text(30, "cup") + "\nWhich cup holds most?")  # ~530
KA, KB, KC = conversation_key(A), conversation_key(B), conversation_key(C)
MARK = {KA: "Fact 69: the violet box", KB: "Which jar is red?", KC: "Which cup holds most?"}


def post(base, body, path="/v1/chat/completions"):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def file_text(eng, session_dir, key) -> tuple[int, str]:
    """(token count, text) of auto-<key>.bin by its header, detokenized by the engine."""
    tokens = list(slotfile.read_header(session_dir / f"auto-{key}.bin").tokens)
    return len(tokens), eng.post("/detokenize", {"tokens": tokens})["content"]


def assert_every_file_holds_its_own_conversation(eng, session_dir):
    for p in session_dir.glob("auto-*.bin"):
        key = p.name[5:21]
        _, text = file_text(eng, session_dir, key)
        assert MARK[key] in text, f"{p.name} does not hold conversation {key}"
        assert not [m for k, m in MARK.items() if k != key and m in text], f"{p.name} holds another conversation"


def ctl(d, *args):
    r = subprocess.run([sys.executable, "-c", "from autosessd.cli import autosessctl_main; autosessctl_main()",
                        "--socket", str(d.socket), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def hook_turn(d, body):
    """The turn hook as a serving layer sends it: one JSON line on the control socket."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(120)
        s.connect(str(d.socket))
        s.sendall(json.dumps({"v": 1, "cmd": "turn", "args": {"messages": body["messages"]}}).encode() + b"\n")
        reply = json.loads(s.makefile().readline())
    assert reply["ok"], reply
    return reply["result"]


def grow(body, answer, question):
    return {**body, "messages": body["messages"] + [{"role": "assistant", "content": answer},
                                                    {"role": "user", "content": question}]}


def test_a_switch_after_a_rejected_request_saves_nothing_under_its_key(engines, session_dir, tmp_path):
    """Item 1: R is refused by the engine (its prompt is over the context) right after the
    switch; the slot still holds A, which must not become auto-<R>.bin at the next switch."""
    eng = engines(session_dir)  # -c 8192
    # No save while idle: C's, 3 s after its answer, would rightly add a file.
    d = Daemon(tmp_path, session_dir, eng.url, extra_toml="idle_save_s = 0").start()
    try:
        a1 = post(d.gate_url, A)
        r = chat_body(long_text(520, "crate") + "\nCount the crates.")  # ~9k tokens: over the context
        with pytest.raises(urllib.error.HTTPError) as e:
            post(d.gate_url, r)
        assert e.value.code == 400
        post(d.gate_url, C)
        saves_final(session_dir)  # A's save at that switch is finalized after C's request
        assert not (session_dir / f"auto-{conversation_key(r)}.bin").exists()
        assert {p.name for p in session_dir.glob("auto-*.bin")} == {f"auto-{KA}.bin"}
        assert_every_file_holds_its_own_conversation(eng, session_dir)
        a = post(d.gate_url, going_on(A, a1))
        assert a["timings"]["cache_n"] >= 0.9 * a["usage"]["prompt_tokens"]
    finally:
        d.stop()


def test_hook_grown_conversation_is_saved_grown_and_its_restore_verified(engines, session_dir, tmp_path):
    """Item 2: through the turn hook (autosessd never sees a request end), A is restored,
    grows, and the next switch saves the grown A; the restore is verified by the engine."""
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url, gate=False).start()
    try:
        hook_turn(d, A)
        a1 = eng.post("/v1/chat/completions", A)
        hook_turn(d, B)
        eng.post("/v1/chat/completions", B)
        a_more = grow(A, a1["choices"][0]["message"]["content"], "And how many are in box 7?")
        assert hook_turn(d, a_more)["restored"]["key"] == KA
        a2 = eng.post("/v1/chat/completions", a_more)
        assert a2["timings"]["cache_n"] >= 0.9 * a1["usage"]["prompt_tokens"]
        # On this sliding-window model (Gemma 3) the switch saves the grown A taken back to one
        # token before its prompt's end (rewind.py): a state its next turn and a retry go on from.
        grown = a2["usage"]["prompt_tokens"] - 1
        assert eng.get("/slots")[0]["n_prompt_tokens"] > grown  # the slot held its reply too
        t = hook_turn(d, B)
        assert t["saved"]["key"] == KA and t["saved"]["n_tokens"] == grown
        # The turn answers once the temporary checked out; the rename follows off its path.
        wait_until(lambda: json.loads((session_dir / f"auto-{KA}.json").read_text())["n_tokens"] == grown, 15,
                   what="the grown save to be finalized")
        n, text = file_text(eng, session_dir, KA)
        assert n == grown and "And how many are in box 7?" in text
        assert_every_file_holds_its_own_conversation(eng, session_dir)
        st = json.loads(ctl(d, "--json", "status"))
        assert st["counters"]["restores_reused"] == 1 and st["counters"]["prefill_tokens_avoided"] > 1000
    finally:
        d.stop()


def test_hook_growth_after_a_regenerated_answer_is_saved_under_the_conversations_own_name(engines, session_dir,
                                                                                         tmp_path):
    """Issue 18.3: through the turn hook, A, B, A again (restored, its answer regenerated: a
    shorter one), then A grown by ~900 tokens from that answer, then B: the switch saves the
    grown A to A's own file, not to a branch. A sent again as it was is restored: on this
    sliding-window model the file holds A one token before its prompt's end (rewind.py)."""
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url, gate=False).start()
    try:
        hook_turn(d, A)
        eng.post("/v1/chat/completions", A)
        hook_turn(d, B)
        eng.post("/v1/chat/completions", B)
        assert hook_turn(d, A)["restored"]["key"] == KA
        before = slotfile.read_header(session_dir / f"auto-{KA}.bin").n_tokens
        a2 = eng.post("/v1/chat/completions", {**A, "max_tokens": 3})  # regenerated: the client's choice
        a_more = grow(A, a2["choices"][0]["message"]["content"], "And how many are in box 7? " + long_text(50, "bag"))
        hook_turn(d, a_more)
        eng.post("/v1/chat/completions", a_more)
        t = hook_turn(d, B)
        assert t["saved"]["key"] == KA and t["saved"]["file"] == f"auto-{KA}.bin", t
        wait_until(lambda: json.loads((session_dir / f"auto-{KA}.json").read_text())["n_tokens"] ==
                   t["saved"]["n_tokens"], 15, what="the grown save to be finalized")
        n, text = file_text(eng, session_dir, KA)
        assert n > before + 800 and "And how many are in box 7?" in text
        assert_every_file_holds_its_own_conversation(eng, session_dir)
    finally:
        d.stop()


def test_a_request_without_a_conversation_waits_and_the_held_one_is_saved_first(engines, session_dir, tmp_path):
    """Item 3: a raw /completion through the gate passes the slot's FIFO; it replaces what the
    slot holds, so the held conversation is saved first, and A's return restores it."""
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        a1 = post(d.gate_url, A)
        raw = post(d.gate_url, {"prompt": long_text(20, "pen") + " The next pen", "n_predict": 4,
                                "temperature": 0}, "/completion")
        assert raw["content"] is not None
        saves_final(session_dir)
        assert (session_dir / f"auto-{KA}.bin").exists()
        a2 = post(d.gate_url, going_on(A, a1))
        assert a2["timings"]["cache_n"] >= 0.9 * a2["usage"]["prompt_tokens"]
        assert_every_file_holds_its_own_conversation(eng, session_dir)
    finally:
        d.stop()


def test_a_manual_restore_then_a_switch_writes_only_owned_names(engines, session_dir, tmp_path):
    """Item 4: `autosessctl restore mine`, then a switch: no auto-mine.bin.bin."""
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        post(d.gate_url, B)
        ctl(d, "park", "--name", "mine")
        post(d.gate_url, A)
        ctl(d, "restore", "mine")
        post(d.gate_url, C)
        names = sorted(p.name for p in session_dir.iterdir())
        owned = [n for n in names if n not in ("mine.bin", "blocks")]  # blocks/: the store's own
        assert "blocks" not in names or (session_dir / "blocks").is_dir()
        assert all(re.fullmatch(r"auto-[0-9a-f]{16}\.(bin|json)", n) for n in owned), names
        assert f"auto-{KA}.bin" in names  # A was saved before the restore replaced it
        assert_every_file_holds_its_own_conversation(eng, session_dir)
    finally:
        d.stop()


def serve(eng, log, rid, body, **end):
    """What a serving layer does: log start, run the request, log end."""
    with open(log, "a") as f:
        f.write(json.dumps({"event": "start", "id": rid, "slot": 0, "key": conversation_key(body)}) + "\n")
    r = eng.post("/v1/chat/completions", body)
    with open(log, "a") as f:
        f.write(json.dumps({"event": "end", "id": rid, "slot": 0, "status": "ok", **end}) + "\n")
    return r


def test_tail_first_start_end_lines_without_counts_and_reload(engines, session_dir, tmp_path):
    """Item 5: a first start does not replay the log's history; an end line without n_tokens
    is still saved behind. Item 6: after SIGHUP the tail uses the new min tokens."""
    eng = engines(session_dir)
    log = tmp_path / "serving" / "requests.jsonl"
    log.parent.mkdir()
    # History from before autosessd ever ran: not to be acted on now.
    serve(eng, log, "old1", B, n_tokens=700)
    d = Daemon(tmp_path, session_dir, eng.url, gate=False, min_tokens=10**6,
               args=["--request-log", str(log)]).start()
    try:
        st = json.loads(ctl(d, "--json", "status"))
        assert st["inputs"]["tail"]["lines"] == 0
        a1 = serve(eng, log, "r1", A)  # no n_tokens in the end line; min tokens not reached
        wait_until(lambda: json.loads(ctl(d, "--json", "status"))["inputs"]["tail"]["lines"] == 2, 15,
                   what="the tail to read A's lines")
        assert not list(session_dir.glob("auto-*"))
        d.config.write_text(d.config.read_text().replace("auto_sessions_min_tokens = 1000000",
                                                         "auto_sessions_min_tokens = 100"))
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "reloaded" in d.logtext(), 15, what="the reload")
        serve(eng, log, "r2", grow(A, a1["choices"][0]["message"]["content"], "And box 7?"))
        wait_until(lambda: (session_dir / f"auto-{KA}.json").exists(), 30, what="A saved behind")
        n, text = file_text(eng, session_dir, KA)
        assert n == eng.get("/slots")[0]["n_prompt_tokens"] and "And box 7?" in text
    finally:
        d.stop()


def test_engine_without_get_slots_still_switches_back(engines, session_dir, tmp_path):
    """llama-server --no-slots (llama.cpp's own test presets, and setups that keep prompts
    private): autosessd starts, says what it cannot see, and switch-back works."""
    eng = engines(session_dir, extra=["--no-slots"])
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        assert "does not show its slots" in d.logtext()
        a1 = post(d.gate_url, A)
        post(d.gate_url, B)
        a2 = post(d.gate_url, going_on(A, a1))
        assert a2["timings"]["cache_n"] >= 0.9 * a2["usage"]["prompt_tokens"]
        assert_every_file_holds_its_own_conversation(eng, session_dir)
        st = d.status()
        assert st["engine"]["slots_visible"] is False and st["counters"]["restores_reused"] == 1
    finally:
        d.stop()
