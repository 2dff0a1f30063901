"""Sessions knowing files by their tokens (issue 11), on the stub engine: what is restored,
under which name a conversation is saved, the shared prefix read on its own.

The stub tokenizes a toy template one character per token (tests/stub_engine.py) and writes
real slot files, so every check reads a file's header, not autosessd's records. Where it
differs from llama-server: no sliding window unless engine.swa_window is set (the index then
passes over files as it would for Gemma 3), and a request's cache_n is the plain common
prefix with what the slot held."""

import asyncio
import json

from autosessd.store import slotfile
from autosessd.store.branches import branch_key, prefix_key
from autosessd.base.keys import conversation_key
from autosessd.sessions.slot import Phase
from stub_engine import StubEngine, tokenize
from tokens_common import K, LONG_1, LONG_2, MIN, X, Y, body, chat, conversation_files, header, make, prompt


async def test_same_opener_two_conversations_two_files_each_return_restores_its_own(tmp_path):
    assert conversation_key(Y) == K
    s = await make(tmp_path)
    await chat(s, X)
    await chat(s, Y)  # same key, other tokens: X is saved before Y replaces it
    assert conversation_files(s) == [f"auto-{K}.bin"]
    turn, cache_n, n_prompt = await chat(s, X)
    assert turn.restored["file"] == f"auto-{K}.bin" and cache_n >= 0.9 * n_prompt
    turn, cache_n, n_prompt = await chat(s, Y)
    d = next(i for i, (a, c) in enumerate(zip(prompt(X), prompt(Y))) if a != c)  # in the system prompt
    b = f"auto-{branch_key(K, prompt(Y)[:d + 1])}.bin"
    assert turn.restored["file"] == b and cache_n >= 0.9 * n_prompt
    assert sorted(conversation_files(s)) == sorted([f"auto-{K}.bin", b])
    assert header(s, f"auto-{K}.bin")[:len(prompt(X))] == prompt(X)
    assert header(s, b)[:len(prompt(Y))] == prompt(Y)
    assert s.store.read_meta(b[5:21]).line == K
    assert s.counters.restores_reused == 2 and s.counters.saves_branched == 1
    st = s.status()["slots"][0]["last_restore"]
    assert (st["file"], st["chosen_by"], st["cache_n"], st["reused"]) == (b, "tokens", cache_n, True)


async def test_an_edited_message_is_saved_as_a_branch_and_the_parent_stays_whole(tmp_path):
    p = [("system", "Be brief."), ("user", "Facts: " + LONG_1), ("assistant", "Noted."), ("user", "More: " + LONG_2),
         ("assistant", "Noted again."), ("user", "Sum it up.")]
    parent = body(*p)
    edited = body(*p[:2], ("assistant", "Understood, captain."), *p[3:])
    s = await make(tmp_path)
    await chat(s, parent)
    await chat(s, edited)
    parent_file = f"auto-{conversation_key(parent)}.bin"
    before = header(s, parent_file)
    assert before[:len(prompt(parent))] == prompt(parent)
    turn, cache_n, n_prompt = await chat(s, parent)  # the return: the branch is saved elsewhere
    assert turn.saved["named"] == "branch" and turn.saved["file"] != parent_file
    assert turn.restored["file"] == parent_file and cache_n >= 0.9 * n_prompt
    assert header(s, parent_file) == before
    assert header(s, turn.saved["file"])[:len(prompt(edited))] == prompt(edited)


async def test_a_file_under_the_requests_own_key_that_shares_too_little_is_not_restored(tmp_path):
    """No wrong restore: the name says it is this conversation, its tokens say otherwise."""
    s = await make(tmp_path)
    b = body(("user", "Hello there, " + LONG_1))
    key = conversation_key(b)
    fake = tokenize("<user>Hello there, ") + [ord(c) for c in "something else entirely " * 10]
    assert 0 < len(fake) and sum(1 for x, y in zip(fake, prompt(b)) if x == y) < MIN
    data = slotfile.build(fake, b"\0" * 100)
    (s.store.path / f"auto-{key}.bin").write_bytes(data)
    (s.store.path / f"auto-{key}.json").write_text(json.dumps(
        {"key": key, "n_tokens": len(fake), "bytes": len(data), "saved_at": 1.0, "model": "stub-model",
         "save_ms": 1.0}))
    s.index.scan()
    restores = []
    real = s.engine.restore
    s.engine.restore = lambda slot, name: restores.append(name) or real(slot, name)
    turn, cache_n, _ = await chat(s, b)
    assert turn.restored is None and restores == [] and cache_n == 0
    assert any("no file of this model shares" in m for m in turn.skipped)
    # The same file, had its tokens been the conversation's, is restored: the test can fail.
    s2 = await make(tmp_path / "2")
    await chat(s2, b)
    await chat(s2, X)
    turn, cache_n, n_prompt = await chat(s2, b)
    assert turn.restored["file"] == f"auto-{key}.bin" and cache_n >= 0.9 * n_prompt


async def test_without_tokens_the_key_decides(tmp_path):
    """The engine cannot tokenize, or the body is not OpenAI chat (Anthropic, images): the
    file under the request's key is restored, as before issue 11. (X's file records its
    messages, which would tell its tokens: not under another template.)"""
    s = await make(tmp_path)
    await chat(s, X)
    await chat(s, body(("user", "Something else: " + LONG_2)))
    s.ctx.template = "another template"
    s.engine.tokenize_fails = True
    turn, _, _ = await chat(s, X)
    assert turn.restored["file"] == f"auto-{K}.bin" and turn.restored["chosen_by"] == "key"
    assert s.counters.tokenize_failures == 1
    s.engine.tokenize_fails = False
    image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Something else: " + LONG_2},
                                                       {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    calls = s.engine.tokenize_calls
    async with await s.admit() as t:
        turn = await s.turn(t, conversation_key(image), body=image)
        await s.ended(t, conversation_key(image), "not_run")
    assert s.engine.tokenize_calls == calls and turn.restored["chosen_by"] == "key"


async def test_a_request_that_goes_on_from_the_held_one_asks_for_no_tokens(tmp_path):
    s = await make(tmp_path)
    await chat(s, X)
    calls = s.engine.tokenize_calls
    grown = {**X, "messages": X["messages"] + [{"role": "assistant", "content": "Aye."},
                                               {"role": "user", "content": "Which is fastest?"}]}
    turn, _, _ = await chat(s, grown)
    assert s.engine.tokenize_calls == calls and turn.saved is None and turn.restored is None
    # Other tools: the prompt changes though the messages go on.
    turn, _, _ = await chat(s, {**grown, "tools": [{"type": "function", "function": {"name": "sail"}}]})
    assert s.engine.tokenize_calls > calls


SYSTEM = "You are a careful assistant. Follow these rules. " * 8  # ~400 tokens
TASK_1 = "Task one: summarise these facts. " + LONG_1
TASK_2 = "Task two: list the ships. " + LONG_2


async def test_a_shared_system_prompt_is_saved_on_its_own_and_restored_after_a_restart(tmp_path):
    s = await make(tmp_path, swa=50)
    c = body(("system", SYSTEM), ("user", TASK_1))
    turn, cache_n, n_prompt = await chat(s, c)
    head = tokenize(f"<system>{SYSTEM}<end><user>")
    assert s.engine.prefills == [head]
    pname = f"auto-{prefix_key(head, s.model)}.bin"
    assert turn.prefix["file"] == pname and header(s, pname) == head
    meta = s.store.read_meta(pname[5:21])
    assert meta.prefix and meta.line is None and meta.n_prompt == len(head)
    assert cache_n == len(head)  # the request read only its task: the prefix was read live
    assert s.view().phase is Phase.HELD and s.view().file is None
    await s.save_at_stop()
    await s.close()
    # Engine and autosessd restarted: the slot is empty; C's file is past the window.
    s2 = await make(tmp_path, swa=50, engine=StubEngine(tmp_path / "sessions"))
    assert s2.index.get(f"auto-{conversation_key(c)}.bin") is not None
    d = body(("system", SYSTEM), ("user", TASK_2))
    turn, cache_n, n_prompt = await chat(s2, d)
    assert turn.restored["file"] == pname and turn.restored["prefix"] and turn.prefix is None
    assert cache_n == len(head) and s2.engine.prefills == []
    # C's own file shares more ("Task " too): only the window rule passes over it.
    assert s2.index.lcp(f"auto-{conversation_key(c)}.bin", prompt(d)) > len(head)


async def test_no_prefix_read_when_the_slot_shares_more_or_the_part_is_short(tmp_path):
    s = await make(tmp_path)
    await chat(s, body(("system", "Short."), ("user", TASK_1)))
    assert s.engine.prefills == []  # the system prompt is under min tokens
    first = body(("system", SYSTEM), ("user", TASK_1), ("assistant", "Done."), ("user", "Again."))
    await chat(s, first)
    assert len(s.engine.prefills) == 1
    pname = next(r["name"] for r in s.ls() if r["kind"] == "prefix")
    await s.forget(pname[5:21])
    # An edited reply: same opener, tokens depart after the first user message, so the slot
    # shares more than the prefix; reading the prefix alone would throw that away.
    edited = body(("system", SYSTEM), ("user", TASK_1), ("assistant", "Done, boss."), ("user", "Again."))
    turn, cache_n, _ = await chat(s, edited)
    assert len(s.engine.prefills) == 1 and turn.prefix is None
    assert cache_n > len(tokenize(f"<system>{SYSTEM}<end><user>{TASK_1}"))


async def test_ls_shows_first_words_and_the_line(tmp_path):
    s = await make(tmp_path)
    await chat(s, X)
    await chat(s, Y)
    await chat(s, X)
    rows = {r["name"]: r for r in await s.ls_words()}
    assert rows[f"auto-{K}.bin"]["words"].startswith("You are a pirate. Hel")  # 40 tokens: one a character
    branch = next(n for n in rows if n != f"auto-{K}.bin")
    assert rows[branch]["words"].startswith("You are a lawyer.") and rows[branch]["line"] == K
    assert rows[f"auto-{K}.bin"]["held"] and not rows[branch]["held"]


async def test_the_index_follows_forget_and_prune_and_is_cached_for_the_next_start(tmp_path):
    s = await make(tmp_path)
    await chat(s, X)
    await chat(s, body(("user", "Other: " + LONG_2)))
    await chat(s, X)
    names = conversation_files(s)
    assert len(names) == 2 and sorted(s.index.names()) == names
    await s.forget(K)
    assert f"auto-{K}.bin" not in s.index
    await s.prune(keep=1, max_gb=1)  # nothing to remove: one file left
    await s.close()
    s2 = await make(tmp_path)
    assert s2.index.names() == [n for n in names if n != f"auto-{K}.bin"]


async def test_rewritten_messages_with_the_same_tokens_go_on_without_a_save(tmp_path):
    """A client that resends an earlier message in another form (here a field the template
    ignores): the signature differs, so the tokens are asked for, and they go on from the
    held ones: no save, no restore."""
    s = await make(tmp_path)
    await chat(s, X)
    grown = {**X, "messages": [{**X["messages"][0], "name": "captain"}] + X["messages"][1:]
             + [{"role": "assistant", "content": "Aye."}, {"role": "user", "content": "Which is fastest?"}]}
    calls = s.engine.tokenize_calls
    turn, cache_n, n_prompt = await chat(s, grown)
    assert s.engine.tokenize_calls == calls + 1
    assert turn.saved is None and turn.restored is None and cache_n == len(prompt(X)) + len("Aye.")


async def test_with_an_engine_that_empties_idle_slots_a_prefix_is_read_while_no_other_request_starts(tmp_path):
    """Reading the prefix is a request start: on such an engine it would empty a slot restored
    (or primed) for a request about to start, and another start would empty this slot before
    its request reuses the prefix. It holds the starts until its own request runs."""
    eng = StubEngine(tmp_path / "sessions", n_slots=2, clears_idle=True)
    s = await make(tmp_path, engine=eng)
    seen = []
    prefill = eng.prefill

    async def watching(slot, tokens):
        seen.append(s.launch.gate.no_starts)
        return await prefill(slot, tokens)
    eng.prefill = watching
    c = body(("system", SYSTEM), ("user", TASK_1))
    key = conversation_key(c)
    async with await s.place(key) as t:
        turn = await s.turn(t, key, body=c)
        assert turn.prefix is not None and seen == [True]
        await asyncio.wait_for(s.before_send(t), 1)  # its hold goes on until the request runs
        assert s.launch.gate.no_starts
    assert not s.launch.gate.no_starts  # released with the ticket


class SlowStub(StubEngine):
    """Saves and prefills that take a while, as the real engine's do: two slots' turns overlap.
    (llama-server runs them side by side too: they are on two slots.)"""

    async def save(self, slot, name):
        await asyncio.sleep(0.02)
        return await super().save(slot, name)

    async def prefill(self, slot, tokens):
        await asyncio.sleep(0.02)
        return await super().prefill(slot, tokens)


async def test_two_slots_starting_with_one_system_prompt_save_one_whole_prefix_file(tmp_path):
    """Issue 18.2: two new conversations with one long system prompt, placed on two slots at
    once (four agents starting with one system prompt). One prefix file, whole; no failed save."""
    eng = SlowStub(tmp_path / "sessions", n_slots=2)
    s = await make(tmp_path, engine=eng)
    bodies = [body(("system", SYSTEM), ("user", TASK_1)), body(("system", SYSTEM), ("user", TASK_2))]

    async def turn(b):
        key = conversation_key(b)
        t = await s.place(key)
        async with t:
            r = await s.turn(t, key, body=b)
            await s.ended(t, key, "not_run")
        return t.slot_id, r

    (slot_1, r1), (slot_2, r2) = await asyncio.gather(*(turn(b) for b in bodies))
    await s.drain()
    assert slot_1 != slot_2
    head = tokenize(f"<system>{SYSTEM}<end><user>")
    pname = f"auto-{prefix_key(head, s.model)}.bin"
    assert s.counters.save_failures == 0 and s.counters.prefixes_saved == 1, (r1.errors, r2.errors)
    assert header(s, pname) == head and s.store.read_meta(pname[5:21]).prefix
    assert [p for p in eng.prefills if p == head] == [head]  # read once; the other request reads it live


async def test_hook_growth_after_a_regenerated_reply_goes_to_the_conversations_own_file(tmp_path):
    """Issue 18.3: through the turn hook (no end is ever reported, so no response says how much
    of a state was prompt): A, B, A again (restored, its answer regenerated), A grown from that
    answer, then B. The grown A replaces A's own file: it departs from the file inside the file's
    reply, not inside its prompt (that would make it another conversation: a branch)."""
    s = await make(tmp_path)

    async def hook(b, reply=None):
        key = conversation_key(b)
        async with await s.admit() as t:
            r = await s.turn(t, key, sees_end=False, body=b)
        if reply is not None:
            s.engine.chat(b, reply)  # the serving layer runs the request
        await s.drain()
        return r

    a = body(("user", LONG_1))
    b = body(("user", LONG_2))
    await hook(a, "Aye, the sea.")
    await hook(b, "Void.")
    assert (await hook(a, "Nay, the ships.")).restored["file"] == f"auto-{conversation_key(a)}.bin"
    grown = body(("user", LONG_1), ("assistant", "Nay, the ships."), ("user", "How many ships? " + LONG_2))
    await hook(grown, "Many.")
    r = await hook(b)
    ka = conversation_key(a)
    assert r.saved["file"] == f"auto-{ka}.bin" and r.saved["named"] == "replaces", r.saved
    assert header(s, f"auto-{ka}.bin") == prompt(grown) + [ord(c) for c in "Many."]
    # Once more, from a state whose last request went on from the held one (no tokens asked
    # for at its turn): the answer regenerated again, the conversation grown from it.
    assert (await hook(grown, "Few.")).restored["file"] == f"auto-{ka}.bin"
    await asyncio.sleep(0)
    again = body(*[(m["role"], m["content"]) for m in grown["messages"]], ("assistant", "Few."), ("user", "And?"))
    await hook(again, "Done.")
    await asyncio.sleep(0)  # the serving layer takes longer than /tokenize
    r = await hook(b)
    assert r.saved["file"] == f"auto-{ka}.bin" and r.saved["named"] == "replaces", r.saved
    assert header(s, f"auto-{ka}.bin") == prompt(again) + [ord(c) for c in "Done."]
    assert s.counters.saves_branched == 0


async def test_a_file_removed_by_hand_is_forgotten_and_the_next_best_restored(tmp_path):
    """A file removed from the directory behind autosessd's back (rm, another tool) while the
    index still lists it: the turn finds it gone, the index forgets it and the next best file
    (here the shared system prompt's) is restored, instead of a refused restore and a re-read."""
    s = await make(tmp_path)
    c = body(("system", SYSTEM), ("user", TASK_1))
    await chat(s, c)
    await s.save_at_stop()
    await s.close()
    head = tokenize(f"<system>{SYSTEM}<end><user>")
    pname, cname = f"auto-{prefix_key(head, s.model)}.bin", f"auto-{conversation_key(c)}.bin"
    s2 = await make(tmp_path, engine=StubEngine(tmp_path / "sessions"))
    d = body(("system", SYSTEM), ("user", TASK_2))
    assert s2.index.lcp(cname, prompt(d)) > len(head)  # C's file would be the best
    (s2.store.path / cname).unlink()
    (s2.store.path / f"{cname[:-4]}.json").unlink()
    turn, cache_n, n_prompt = await chat(s2, d)
    assert turn.restored["file"] == pname and cache_n == len(head)
    assert s2.counters.restores_refused == 0 and s2.index.get(cname) is None


async def test_an_engine_without_a_template_endpoint_is_not_asked_for_tokens_on_every_turn(tmp_path):
    """An engine that answers 404 to /apply-template (another server, an older build, the
    fakes) cannot tell a request's tokens: the key rule decides, and it is asked again only
    after a while, not in a round trip on every turn (the bench's switch at 1 GB spent its
    milliseconds there)."""
    from autosessd.engines.base import EngineLacks

    asked = []

    class NoTemplate(StubEngine):
        async def apply_template(self, body, timeout_s=None):
            asked.append(1)
            raise EngineLacks("POST /apply-template answered 404: File Not Found")

    s = await make(tmp_path, engine=NoTemplate(tmp_path / "sessions"))
    asked.clear()  # the start's check of the template asked once
    a = body(("user", LONG_1))
    b = body(("user", LONG_2))
    await chat(s, a)
    await chat(s, b)  # saves A by its key
    back, _, _ = await chat(s, body(("user", LONG_1), ("assistant", "Aye."), ("user", "And then?")))
    assert len(asked) == 1 and back.restored is not None and back.restored["chosen_by"] == "key"
    assert s.counters.tokenize_failures == 1
