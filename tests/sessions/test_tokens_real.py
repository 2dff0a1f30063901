"""Issue 11's acceptance against the real llama-server (Gemma 3 270M, --swa-full, --cache-ram 0),
through the gate as a client drives it: sessions known by their tokens.

Every check of a file reads its header (the engine's own record of the tokens it holds)."""

import json
import urllib.request

import pytest

from autosessd.store import slotfile
from autosessd.base.keys import conversation_key
from harness import Daemon, long_text, saves_final, wait_until

pytestmark = pytest.mark.engine


def post(base, body, path="/v1/chat/completions"):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def chat(*messages, max_tokens=8):
    return {"messages": [{"role": r, "content": c} for r, c in messages], "temperature": 0, "max_tokens": max_tokens,
            "seed": 1}


def reused(out):
    """(cache_n, prompt tokens) of a response."""
    return out["timings"]["cache_n"], out["usage"]["prompt_tokens"]


def going_on(body, out, question):
    """A client's next request: the answer `out` sent back, and a new question. (A return that
    sends the same prompt again ends before the file's reply: on this sliding-window model the
    file is then not restored, runs.swa_usable.)"""
    answer = out["choices"][0]["message"]["content"]
    return {**body, "messages": body["messages"] + [{"role": "assistant", "content": answer},
                                                    {"role": "user", "content": question}]}


def answer(out):
    return out["choices"][0]["message"]["content"]


def header(path):
    return list(slotfile.read_header(path).tokens)


def metas(session_dir):
    return {p.name[:-5] + ".bin": json.loads(p.read_text()) for p in session_dir.glob("auto-*.json")}


def test_same_opener_two_conversations_switch_back_and_forth(engines, session_dir, tmp_path):
    """X (a pirate) and Y (a lawyer) both open with "Hello": one key. X → Y → X → Y: each
    return (going on from its answer) reuses its own state, answers as the engine alone does,
    and two files hold the two conversations."""
    x = chat(("system", "You are a pirate."), ("user", "Hello"), ("assistant", long_text(30, "ship")),
             ("user", "Which ship holds the most marbles?"))
    y = chat(("system", "You are a lawyer."), ("user", "Hello"), ("assistant", long_text(30, "case")),
             ("user", "Which case holds the most marbles?"))
    assert conversation_key(x) == conversation_key(y)
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        x1, y1 = post(d.gate_url, x), post(d.gate_url, y)
        x2_body, y2_body = going_on(x, x1, "And the fewest?"), going_on(y, y1, "And the fewest?")
        x2, y2 = post(d.gate_url, x2_body), post(d.gate_url, y2_body)
        for out in (x2, y2):
            cache_n, prompt = reused(out)
            assert prompt > 500 and cache_n >= 0.9 * prompt, (cache_n, prompt)
        files = sorted(session_dir.glob("auto-*.bin"))
        assert len(files) == 2
        # Each holds its own conversation, token for token, as the engine tokenizes it.
        texts = sorted(eng.post("/detokenize", {"tokens": header(p)})["content"] for p in files)
        assert "You are a lawyer." in texts[0] and "pirate" not in texts[0]
        assert "You are a pirate." in texts[1] and "lawyer" not in texts[1]
        st = d.status()
        assert st["counters"]["restores_reused"] == 2 and st["counters"]["saves_branched"] == 1
        last = st["slots"][0]["last_restore"]
        assert last["chosen_by"] in ("tokens", "messages") and last["cache_n"] == reused(y2)[0] and last["reused"]
    finally:
        d.stop()
    eng.post("/slots/0?action=erase", {})  # the engine alone, reading y2 from its first token
    assert answer(eng.post("/v1/chat/completions", y2_body)) == answer(y2)


SYSTEM = "You are a careful clerk. Follow these rules exactly. " + long_text(80, "rule")  # ~1,450 tokens


@pytest.mark.parametrize("model", ["gemma3", "qwen35"], indirect=True)
def test_a_shared_system_prompt_is_reused_after_engine_and_autosessd_restart(engines, session_dir, tmp_path, model):
    """C = S + task 1 (long: its file runs past Gemma 3's 512-token window), saved; engine
    and autosessd restarted; D = S + task 2 reuses S: C's first request read S on its own and
    saved it, and that file is what D restores. On the hybrid too (issue 47): a file ending
    where S ends is a state D goes on from, the only kind of restore such a model reuses."""
    c = chat(("system", SYSTEM), ("user", "Task one. " + long_text(40, "jar") + "\nWhich jar is red?"))
    dd = chat(("system", SYSTEM), ("user", "Task two: which rule holds the most marbles?"))
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        out = post(d.gate_url, c)
        saves_final(session_dir)  # the prefix, saved in C's own turn, is finalized after it
        prefixes = [name for name, m in metas(session_dir).items() if m["prefix"]]
        assert len(prefixes) == 1
        n_prefix = len(header(session_dir / prefixes[0]))
        n_system = len(eng.post("/tokenize", {"content": SYSTEM})["tokens"])
        assert n_system <= n_prefix < n_system + 40  # the template's own tokens around it
        text = eng.post("/detokenize", {"tokens": header(session_dir / prefixes[0])})["content"]
        assert SYSTEM.strip() in text and "Task one" not in text
        # C itself read only its task: the prefix was read just before it, live in the slot.
        assert reused(out)[0] >= n_prefix - 1
    finally:
        assert d.stop() == 0  # saves C
    assert (session_dir / f"auto-{conversation_key(c)}.bin").exists()
    eng.restart()
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        cache_n, prompt = reused(post(d.gate_url, dd))
        assert cache_n >= 0.9 * n_system, (cache_n, n_system, prompt)
        last = d.status()["slots"][0]["last_restore"]
        assert last["file"] == prefixes[0] and last["prefix"] and last["reused"]
    finally:
        d.stop()


def test_an_edited_message_branches_and_the_parent_stays_whole(engines, session_dir, tmp_path):
    """A 6-message conversation, then the same with message 3 edited: the parent's file
    keeps the parent's tokens, and a return to the parent reuses its state."""
    p = [("system", "Be brief."), ("user", long_text(30) + "\nRemember these."), ("assistant", "Noted."),
         ("user", long_text(30, "jar") + "\nRemember these too."), ("assistant", "Noted too."),
         ("user", "How many marbles are in box 3 and jar 4?")]
    parent = chat(*p)
    edited = chat(*p[:2], ("assistant", "Noted, all thirty boxes."), *p[3:])
    eng = engines(session_dir)
    # No save while idle: the parent's, 3 s after its return, would rightly change its file.
    d = Daemon(tmp_path, session_dir, eng.url, extra_toml="idle_save_s = 0").start()
    try:
        first = post(d.gate_url, parent)
        post(d.gate_url, edited)  # the parent is saved before the edit replaces it
        saves_final(session_dir)
        parent_file = session_dir / f"auto-{conversation_key(parent)}.bin"
        before = header(parent_file)
        cache_n, prompt = reused(post(d.gate_url, going_on(parent, first, "And in box 5?")))
        assert cache_n >= 0.9 * prompt, (cache_n, prompt)
        saves_final(session_dir)  # the branch, saved at that switch
        assert header(parent_file) == before
        files = list(session_dir.glob("auto-*.bin"))
        assert len(files) == 2
        [branch] = [f for f in files if f != parent_file]
        text = eng.post("/detokenize", {"tokens": header(branch)})["content"]
        assert "Noted, all thirty boxes." in text
        assert metas(session_dir)[branch.name]["line"] == conversation_key(parent)
    finally:
        d.stop()


def test_a_file_under_the_requests_own_key_sharing_too_little_is_not_restored(engines, session_dir, tmp_path):
    """No wrong restore: a file named after the request's key whose tokens share fewer than
    min tokens with it (faked here: an opener's few template tokens, then other text)."""
    body = chat(("user", long_text(15) + "\nWhich box is red?"))
    key = conversation_key(body)
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url).start()
    model = d.status()["engine"]["model_fingerprint"]
    d.stop()
    prompt = eng.post("/apply-template", body)["prompt"]
    opener = prompt[:prompt.index("Fact 0: the") + len("Fact 0: the")]
    fake = (eng.post("/tokenize", {"content": opener, "add_special": True, "parse_special": True})["tokens"]
            + eng.post("/tokenize", {"content": long_text(15, "jar")})["tokens"])
    data = slotfile.build(fake, b"\0" * 4096)
    (session_dir / f"auto-{key}.bin").write_bytes(data)
    (session_dir / f"auto-{key}.json").write_text(json.dumps({
        "key": key, "n_tokens": len(fake), "bytes": len(data), "saved_at": 1.0, "model": model, "save_ms": 1.0,
        "line": key}))
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        assert d.status()["index"]["files"] == 1  # the index sees it: it is passed over for its tokens
        cache_n, prompt = reused(post(d.gate_url, body))
        st = d.status()
        assert st["counters"]["restores"] == 0 and st["counters"]["restore_failures"] == 0
        assert cache_n == 0 and prompt >= 200
    finally:
        d.stop()


@pytest.mark.parametrize("model", ["kv8b"], indirect=True)
def test_a_return_asks_the_engine_for_no_tokens_and_a_switch_after_a_pause_only_restores(engines, session_dir,
                                                                                         tmp_path, model):
    """Issue 23: A answered, then a pause: A is saved while the engine is idle. B's request then
    saves nothing (its switch only restores); B's pause saves B. A going on from its answer is
    restored without asking the engine for its tokens (status: tokenized unchanged), reused, and
    answered as the engine alone answers it. On the model without a window: on one with a window
    (or recurrent layers) a file holds the state one token before its prompt's end, not a
    prompt, and a return to it is tokenized (rewind.py; test_retry_real.py)."""
    a = chat(("user", long_text(40, "box") + "\nWhich box holds the most marbles?"))
    b = chat(("user", long_text(40, "jar") + "\nWhich jar holds the most marbles?"))
    eng = engines(session_dir)
    # Every reply's pause saves (idle_save_switched_s = 0): the mechanism under test; the
    # default's wait for a switch first is tested in test_idle.py. The pause is 2 s, longer than
    # a status read after a reply takes on a busy machine: an idle save counts in `saves` too.
    d = Daemon(tmp_path, session_dir, eng.url, extra_toml="idle_save_s = 2\nidle_save_switched_s = 0").start()
    counters = lambda: d.status()["counters"]  # noqa: E731
    try:
        a1 = post(d.gate_url, a)
        wait_until(lambda: counters()["idle_saves"] == 1, 30, what="A saved while idle")
        post(d.gate_url, b)
        assert counters()["saves"] == 1  # B's switch saved nothing: A's file was up to date
        wait_until(lambda: counters()["idle_saves"] == 2, 30, what="B saved while idle")
        before = counters()
        a2_body = going_on(a, a1, "And which holds the fewest?")
        a2 = post(d.gate_url, a2_body)
        cache_n, prompt = reused(a2)
        assert cache_n >= 0.9 * prompt, (cache_n, prompt)
        st = d.status()
        assert st["counters"]["tokenized"] == before["tokenized"]
        assert st["counters"]["known_by_messages"] == before["known_by_messages"] + 1
        assert st["counters"]["saves"] == before["saves"]  # B's file was up to date too
        last = st["slots"][0]["last_restore"]
        assert (last["file"], last["chosen_by"], last["reused"]) == (f"auto-{conversation_key(a)}.bin", "messages", True)
    finally:
        d.stop()
    eng.post("/slots/0?action=erase", {})
    assert answer(eng.post("/v1/chat/completions", a2_body)) == answer(a2)
