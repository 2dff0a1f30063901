"""A return to a known conversation matched by its messages, without the engine's tokens
(issue 23, recall.py), on the stub engine (tests/stub_engine.py counts every /tokenize).

The guarantees of the token rule (test_sessions_tokens.py) hold: the file restored is the one
the engine's tokens would have chosen; where the messages cannot say that, the engine is asked."""

import json

import test_sessions_tokens as t
from autosessd.base.keys import chain, chat_signature, conversation_key
from autosessd.store.names import Mark, Meta, marks_from
from stub_engine import StubEngine

X, Y, K, body, chat, make, prompt = t.X, t.Y, t.K, t.body, t.chat, t.make, t.prompt
OTHER = body(("user", "Something else: " + t.LONG_2))


def grown(b, reply="Aye.", then="And the fastest?"):
    """b's next request: its reply sent back, and a new question."""
    return {**b, "messages": b["messages"] + [{"role": "assistant", "content": reply},
                                              {"role": "user", "content": then}]}


def calls(s):
    return s.engine.tokenize_calls


async def test_a_return_with_the_same_messages_asks_for_no_tokens_and_restores_its_own_file(tmp_path):
    s = await make(tmp_path)
    await chat(s, X)
    await chat(s, OTHER)  # X is saved; its file records the messages its tokens came from
    meta = s.store.read_meta(K)
    assert meta.marks == (Mark(len(X["messages"]), len(prompt(X)), chain(chat_signature(X))[-1]),)
    before, tokenized = calls(s), s.status()["counters"]["tokenized"]
    turn, cache_n, n_prompt = await chat(s, X)
    assert calls(s) == before and s.status()["counters"]["tokenized"] == tokenized
    assert turn.restored["file"] == f"auto-{K}.bin" and cache_n == n_prompt - 1
    st = s.status()
    assert st["counters"]["known_by_messages"] == 1 and st["counters"]["restores_reused"] == 1
    last = st["slots"][0]["last_restore"]
    assert (last["chosen_by"], last["tokens_from"], last["shared"]) == ("tokens", "messages", n_prompt)


async def test_a_conversation_that_goes_on_from_its_file_is_restored_without_tokens(tmp_path):
    s = await make(tmp_path)
    await chat(s, X)
    await chat(s, OTHER)
    before = calls(s)
    turn, cache_n, n_prompt = await chat(s, grown(X))
    assert calls(s) == before
    assert turn.restored["file"] == f"auto-{K}.bin" and turn.restored["chosen_by"] == "messages"
    assert cache_n == len(prompt(X)) + len("Aye.")  # the engine reused all of the file
    # Saved again at the next switch, with the grown request's messages: its next return too.
    await chat(s, OTHER)
    assert s.store.read_meta(K).marks[0].n_messages == len(grown(X)["messages"])
    turn, _, _ = await chat(s, grown(grown(X), "Aye.", "And the slowest?"))
    assert calls(s) == before and turn.restored["file"] == f"auto-{K}.bin"
    # Both returns to X, and the one to OTHER (saved too).
    assert s.counters.known_by_messages == 3 and s.counters.restores_reused == 3


async def test_same_opener_conversations_return_to_their_own_files_without_tokens(tmp_path):
    """X and Y open alike (one key): their messages tell them apart as their tokens do."""
    s = await make(tmp_path)
    await chat(s, X)
    await chat(s, Y)
    await chat(s, X)
    await chat(s, Y)  # both files now exist, each with its messages
    before = calls(s)
    for b, base in ((X, X), (Y, Y), (grown(X), X), (grown(Y), Y)):
        turn, cache_n, n_prompt = await chat(s, b)
        assert t.header(s, turn.restored["file"])[:len(prompt(base))] == prompt(base)
        assert cache_n >= len(prompt(base)) - 1, (b, cache_n, n_prompt)
    assert calls(s) == before
    assert len(t.conversation_files(s)) == 2


async def test_a_second_file_holding_the_same_tokens_makes_it_ask_the_engine(tmp_path):
    """A person's copy of X's state (parked by name) holds what X's file holds: which of the two
    shares more with the request only its tokens can say, so the engine is asked, and the token
    rule picks (the request's own line)."""
    s = await make(tmp_path)
    await chat(s, X)
    await s.park(name="copy")
    await chat(s, OTHER)
    before = s.counters.tokenized
    turn, cache_n, n_prompt = await chat(s, grown(X))
    assert s.counters.tokenized == before + 1
    assert turn.restored["file"] == f"auto-{K}.bin" and turn.restored["tokens_from"] == "engine"


async def test_on_a_sliding_window_model_a_file_holds_the_state_before_its_prompts_end(tmp_path):
    """runs.swa_usable: a file past the window is restored only when the prompt goes on from
    (nearly) its end. So on such a model the slot is taken back to one token before its
    prompt's end before it is saved (rewind.py): the same messages again (a retry) and the
    next turn both go on from that, and both are restored (by the engine's tokens: such a
    file has no marks, its tokens are not a prompt's)."""
    s = await make(tmp_path, swa=50)
    await chat(s, X, reply="Aye, captain.")
    await chat(s, OTHER)
    assert s.engine.prefills[-1] == prompt(X)[:-1]  # taken back before the save at the switch
    assert t.header(s, f"auto-{K}.bin") == prompt(X)[:-1] and s.store.read_meta(K).marks == ()
    turn, cache_n, n_prompt = await chat(s, X, reply="Aye, captain.")  # a retry
    assert turn.restored["file"] == f"auto-{K}.bin" and cache_n == n_prompt - 1
    await chat(s, OTHER)  # its file holds that state already: not taken back nor saved again
    assert s.engine.prefills[-1] != prompt(X)[:-1] or s.status()["counters"]["rewinds"] == 2
    turn, cache_n, n_prompt = await chat(s, grown(X, "Aye, captain."))
    assert turn.restored["file"] == f"auto-{K}.bin" and cache_n == len(prompt(X)) - 1
    assert s.status()["counters"]["rewinds_reread"] == 0


async def test_a_known_conversation_with_a_shared_prefix_file_restores_its_own(tmp_path):
    """C = S + task 1 (its system prompt read and saved on its own), D = S + task 2: back to C,
    its own file is restored, not the prefix; no tokens asked for, and no second prefix read."""
    s = await make(tmp_path)
    c = body(("system", t.SYSTEM), ("user", t.TASK_1))
    d = body(("system", t.SYSTEM), ("user", t.TASK_2))
    await chat(s, c)
    await chat(s, d)
    assert len(s.engine.prefills) == 1
    before = calls(s)
    turn, cache_n, n_prompt = await chat(s, grown(c))
    assert calls(s) == before and len(s.engine.prefills) == 1
    assert turn.restored["file"] == f"auto-{conversation_key(c)}.bin" and cache_n >= 0.9 * n_prompt


async def test_marks_are_kept_across_a_restart_and_through_older_metadata(tmp_path):
    s = await make(tmp_path)
    await chat(s, X)
    await s.save_at_stop()
    await s.close()
    s2 = await make(tmp_path, engine=StubEngine(tmp_path / "sessions"))  # the index from its cache
    assert s2.index.get(f"auto-{K}.bin").marks == s2.store.read_meta(K).marks != ()
    turn, _, _ = await chat(s2, X)
    assert calls(s2) == 0 and turn.restored["file"] == f"auto-{K}.bin"
    # Metadata written before marks existed: none, and a return asks the engine.
    path = s2.store.path / f"auto-{K}.json"
    d = json.loads(path.read_text())
    assert Meta.from_json(path.read_bytes()).marks and "marks" in d
    del d["marks"]
    assert Meta.from_json(json.dumps(d).encode()).marks == ()


def test_marks_in_metadata_are_checked():
    good = Mark(3, 120, "0123456789abcdef")
    assert marks_from([good.to_list()]) == (good,) == marks_from(good.to_text())
    assert marks_from(f"{good.to_text()};2:50:fedcba9876543210") == (good, Mark(2, 50, "fedcba9876543210"))
    for bad in ([[0, 1, "0123456789abcdef"]], [[1, -1, "0123456789abcdef"]], [[1, 2, "xyz"]], [[True, 2, "0" * 16]],
                "1:2", "a:b:0123456789abcdef", [[1, 2, "0" * 16]] * 65, {"k": 1}, 7, [[1, 2, "0" * 16], "junk"]):
        assert marks_from(bad) == (), bad


class RewritingEngine(StubEngine):
    """A template that moves the system prompt into the last user message (Mistral v0.3's
    does so): a conversation a turn later does not start with its earlier prompt."""

    async def apply_template(self, body, timeout_s=None):
        msgs = body["messages"]
        system = [m for m in msgs if m["role"] == "system"]
        rest = [m for m in msgs if m["role"] != "system"]
        if system and rest:
            last = max(i for i, m in enumerate(rest) if m["role"] == "user")
            rest = [dict(m, content=system[0]["content"] + " " + m["content"]) if i == last else m
                    for i, m in enumerate(rest)]
        return await super().apply_template({**body, "messages": rest}, timeout_s)


async def test_a_template_that_rewrites_earlier_turns_is_found_and_returns_are_tokenized(tmp_path):
    """The "goes on" match assumes a template that appends: checked at start. Where it does not
    hold, a return going on from a file's messages is tokenized (the token rule decides) instead
    of restoring the file for a prompt that does not start with it."""
    d = tmp_path / "sessions"
    d.mkdir()
    s = await make(tmp_path, engine=RewritingEngine(d))
    assert s._turn.recall.appends is False
    await chat(s, X)
    await chat(s, OTHER)
    before = calls(s)
    await chat(s, grown(X))
    assert calls(s) > before and s.counters.known_by_messages == 0
    s2 = await make(tmp_path / "plain")
    assert s2._turn.recall.appends is True


async def test_a_known_file_removed_by_hand_is_forgotten_and_the_return_tokenized(tmp_path):
    s = await make(tmp_path)
    await chat(s, X)
    await chat(s, OTHER)
    (s.store.path / f"auto-{K}.bin").unlink()
    before = calls(s)
    turn, _, _ = await chat(s, grown(X))
    assert s.counters.restores_refused == 0 and s.index.get(f"auto-{K}.bin") is None
    assert calls(s) > before and turn.restored is None


async def test_the_file_a_return_goes_on_from_is_looked_up_again_only_when_the_switch_changed_something(tmp_path):
    """A return that goes on from a file's mark is matched against the index once when the
    switch saves nothing (a short conversation left); a switch that saved the one it left
    changed the index, and the match is asked again. The file restored is the same."""
    s = await make(tmp_path)
    sole = s._turn.recall.sole
    asked = []
    s._turn.recall.sole = lambda *a: asked.append(1) or sole(*a)
    short = body(("user", "Hi."))
    await chat(s, X)
    await chat(s, short)  # X is saved; the short one is not worth a file
    turn, _, _ = await chat(s, grown(X))
    assert turn.restored["file"] == f"auto-{K}.bin" and turn.restored["chosen_by"] == "messages"
    assert len(asked) == 1
    await chat(s, OTHER)  # X saved again
    await chat(s, body(("user", "Hi, " + t.LONG_1)))  # OTHER is saved by this switch: the index changed
    asked.clear()
    turn, _, _ = await chat(s, grown(grown(X), "Aye.", "And the slowest?"))
    assert turn.restored["file"] == f"auto-{K}.bin" and len(asked) == 2
