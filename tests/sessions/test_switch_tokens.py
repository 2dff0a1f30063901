"""A switch on the stub engine that knows files by their tokens (issues 11 and 31): where it looks
at the engine, a switch back that does not wait for the outgoing save's fsync, a retry after a
switch. The stub differs from llama-server as told in test_sessions_tokens.py."""

import asyncio

import pytest

from autosessd.base.keys import conversation_key
from tokens_common import K, LONG_1, LONG_2, X, body, chat, header, make, prompt


@pytest.mark.parametrize("system, looks", [(None, False), ("Be a pirate. " * 12, True)])
async def test_a_switch_that_saves_nothing_looks_at_the_engine_only_where_the_slot_may_share(tmp_path, system,
                                                                                             looks):
    """Issue 23: a return waits for its restore only. When what the slot holds is too small to
    save (or saved already), the turn's GET /slots (a millisecond or more on each return) is
    left out: the look could only show the slot holding something else, which the restore
    replaces. Where the slot may share a long prefix with the request (the same system prompt),
    what it shares decides the restore, so the slot is looked at first."""
    seen = []
    s = await make(tmp_path, min_tokens=400)
    real = s.engine.slots

    async def counted():
        seen.append(1)
        return await real()

    s.engine.slots = counted
    head = [("system", system)] if system else []
    a = body(*head, ("user", LONG_1 * 2))
    small = body(*head, ("user", "Hi."))  # below the minimum: never saved
    await chat(s, a)
    await chat(s, small)  # saves A (a switch that saves looks first)
    seen.clear()
    key = conversation_key(a)
    back = body(*head, ("user", LONG_1 * 2), ("assistant", "Aye."), ("user", "And then?"))
    async with await s.admit() as t:
        turn = await s.turn(t, key, body=back)
        assert turn.restored is not None and turn.saved is None
        assert bool(seen) is looks
        cache_n, n_prompt = s.engine.chat(back, "Aye.")
        await s.ended(t, key, "ok", cache_n=cache_n, n_prompt=n_prompt)
    assert s.counters.restores_reused == 1


# -- a switch back does not wait for the outgoing save's fsync (issue 31) --------------------------
def held_finalize(s):
    """Store.finalize made to wait (a 2 GB file's fsync takes seconds) until the event is set."""
    import threading

    gate, real = threading.Event(), s.store.finalize

    def slow(key, meta, digest=None):
        assert gate.wait(30), "the finalize was never let go"
        return real(key, meta, digest)

    s.store.finalize = slow
    return gate


async def test_a_quick_return_restores_its_save_whose_fsync_still_runs_from_its_temporary(tmp_path):
    """X is saved at the switch to Y; while that save's finalize (its fsync) still runs, the
    client goes back to X. The return does not wait for the fsync: the engine reads X's bytes
    from the temporary, held for it (issue 38: no link, which would move the ctime the digest
    watches), the slot then holds X's tokens token for token, and once the finalize lands X's
    file is whole under its own name and no temporary is left."""
    s = await make(tmp_path)
    await chat(s, X)
    gate = held_finalize(s)
    other = body(("user", LONG_2))
    await chat(s, other, drain=False)  # saves X; X's finalize is held
    assert s.saver.writing() == {f"auto-{K}.bin"}
    x2 = body(*[(m["role"], m["content"]) for m in X["messages"]], ("assistant", "Aye."), ("user", "More?"))
    try:
        turn, cache_n, n_prompt = await asyncio.wait_for(chat(s, x2, drain=False), 10)
    finally:
        gate.set()
    assert turn.restored and turn.restored["file"] == f"auto-{K}.bin"
    assert cache_n >= len(prompt(X))  # the engine reused X's state
    assert s.counters.restores_before_durable == 1
    assert turn.phases.get("wait", 0) < 1000  # not the fsync's: it was held for ever
    last = s.ctx.turn_times.last[0]  # status's turn_phases: where the return's time went
    assert last["key"] == K and last["restore"] >= 0 and "wait" in last and last["ms"] == turn.ms
    await s.drain()
    assert header(s, f"auto-{K}.bin") == prompt(X) + [ord(c) for c in "Aye."]
    assert not [p for p in s.store.path.iterdir() if p.name.startswith(".autosessd-")]
    assert s.counters.save_failures == 0


async def test_a_switch_decides_on_a_pending_save_as_it_will_be_without_waiting_for_it(tmp_path):
    """The idle save (or any) of X is finalizing when the client switches to Y: X's file is up
    to date as it will be, so nothing is saved again and the switch does not wait for the fsync."""
    s = await make(tmp_path)
    await chat(s, X)
    gate = held_finalize(s)
    [saved] = await s.idle.save_now()  # X's save while idle, held in its finalize
    assert saved["saved"] and s.saver.writing() == {f"auto-{K}.bin"}
    saves = len(s.engine.saves)
    try:
        turn, _, _ = await asyncio.wait_for(chat(s, body(("user", LONG_2)), drain=False), 10)
    finally:
        gate.set()
    assert len(s.engine.saves) == saves and not turn.saved  # X's file is up to date: not saved twice
    await s.drain()
    assert header(s, f"auto-{K}.bin") == prompt(X) + [ord(c) for c in "Aye."]


# -- a retry after a switch: restored, with a window or without (issues 31, 47) ----------------------
@pytest.mark.parametrize("swa", [0, 20])
async def test_a_retry_after_a_switch_is_restored_with_a_window_or_without(tmp_path, swa):
    """The same request sent again after a switch (a retry, a regenerate): its prompt ends
    before X's file would (the slot holds the reply too). Without a sliding window the file of
    the whole slot serves it. With one the engine's file keeps only the window's last cells, so
    before the save the slot is taken back to one token before its prompt's end (rewind.py):
    the retry goes on from that file, and it is restored too."""
    s = await make(tmp_path, swa=swa)
    await chat(s, X)
    await chat(s, body(("user", LONG_2)))
    turn, cache_n, n_prompt = await chat(s, X)
    assert turn.restored and turn.restored["file"] == f"auto-{K}.bin" and cache_n == n_prompt - 1
    assert s.counters.swa_retries == 0 and s.restore_log.swa_retry is None
    assert turn.restored["n_tokens"] == (n_prompt - 1 if swa else n_prompt + len("Aye."))
    assert s.counters.rewinds == (2 if swa else 0)  # X's and the other's, each at its switch


# -- a model with recurrent layers (issue 47) --------------------------------------------------------
def going_on(b, reply, then="And the ships' names?"):
    return {**b, "messages": b["messages"] + [{"role": "assistant", "content": reply},
                                              {"role": "user", "content": then}]}


async def test_on_a_recurrent_model_a_save_holds_the_state_the_next_turn_goes_on_from(tmp_path):
    """The engine reuses a hybrid model's restore only for a request that goes on from its end
    (DESIGN §9). A file of the slot after its turn (prompt and reply) is passed over for a next
    turn whose reply came back otherwise (the index's rule for such models), and each save holds
    the state one token before its prompt's end, which every next turn and a retry go on from."""
    s = await make(tmp_path)
    await chat(s, X, reply="Aye.")
    await chat(s, body(("user", LONG_2)))  # X's file: its prompt and reply (no rewind on this model)
    assert header(s, f"auto-{K}.bin") == prompt(X) + [ord(c) for c in "Aye."]
    s.ctx.recurrent = True  # as facts.model_memory finds a hybrid's GGUF
    turn, cache_n, _ = await chat(s, going_on(X, "Aye!"))  # departs inside the file's reply
    assert turn.restored is None and cache_n < len(prompt(X)) // 2
    await chat(s, body(("user", LONG_2)))  # the switch takes X's slot back before its save
    grown = going_on(X, "Aye!")
    assert header(s, f"auto-{K}.bin") == prompt(grown)[:-1] and s.counters.rewinds >= 1
    turn, cache_n, _ = await chat(s, going_on(grown, "Yes, captain.", "Which flag?"))  # departs in the reply
    assert turn.restored["file"] == f"auto-{K}.bin" and cache_n == len(prompt(grown)) - 1
    await chat(s, body(("user", LONG_2)))
    turn, cache_n, n_prompt = await chat(s, going_on(grown, "Yes, captain.", "Which flag?"))  # a retry
    assert turn.restored["file"] == f"auto-{K}.bin" and cache_n == n_prompt - 1
    assert s.counters.rewinds_reread == 0 and s.counters.rewinds_not_done == 0
    assert s.status()["engine"]["memory"] == {"swa_window": None, "recurrent": True,
                                              "saved_at": "one token before the prompt's end"}


# -- a slot file format this code does not read (issue 47) -------------------------------------------
async def test_a_slot_file_of_an_unknown_version_is_kept_whole_and_said(tmp_path, caplog):
    """A newer engine writes state version 5: the save is kept whole under its key (not failed,
    not cut, not matched by tokens it cannot read: a turn's token rule passes it over), and the
    log says why once."""
    from stub_engine import StubEngine

    class Newer(StubEngine):
        async def save(self, slot, name):
            res = await super().save(slot, name)
            p = self.dir / name
            data = bytearray(p.read_bytes())
            data[4:8] = (5).to_bytes(4, "little")
            p.write_bytes(bytes(data))
            return res

    d = tmp_path / "sessions"
    d.mkdir()
    s = await make(tmp_path, engine=Newer(d))
    await chat(s, X)
    await chat(s, body(("user", LONG_2)))
    await chat(s, X)
    assert s.counters.save_failures == 0 and s.counters.saves >= 2
    assert (d / f"auto-{K}.bin").read_bytes()[4:8] == (5).to_bytes(4, "little")
    assert sum("state file version 5" in r.getMessage() for r in caplog.records) == 1
    assert not any(r.levelname == "ERROR" for r in caplog.records)


OPENER = body(("system", LONG_1), ("user", "Hello"))  # another conversation of the same key as LONGER
LONGER = body(("system", LONG_1), ("user", "Hello"), ("assistant", "Aye."), ("user", "And the ships?"))


async def test_a_rewound_save_does_not_replace_another_conversations_longer_file(tmp_path):
    """Two conversations with the same first user message share a key. The shorter one's
    rewound state is a strict prefix of the longer one's file: it goes to a branch of its own,
    and the longer one's file stays whole."""
    s = await make(tmp_path)
    s.ctx.recurrent = True
    key = conversation_key(LONGER)
    assert conversation_key(OPENER) == key
    await chat(s, LONGER)
    await chat(s, body(("user", LONG_2)))
    assert header(s, f"auto-{key}.bin") == prompt(LONGER)[:-1]
    await chat(s, OPENER)
    await chat(s, body(("user", LONG_2)))  # the opener's save
    assert header(s, f"auto-{key}.bin") == prompt(LONGER)[:-1]
    mine = [r["name"] for r in s.ls() if r["kind"] == "auto" and header(s, r["name"]) == prompt(OPENER)[:-1]]
    assert len(mine) == 1 and mine[0] != f"auto-{key}.bin"


async def test_a_slot_taken_back_while_idle_goes_on_live(tmp_path):
    """A save while idle takes the slot back (its prefill is a task the engine ran): the
    conversation's next turn goes on from the slot as it is, no restore, nothing taken for a
    request that bypassed autosessd."""
    s = await make(tmp_path)
    s.ctx.recurrent = True
    await chat(s, LONGER)
    [saved] = await s.idle.save_now()
    assert saved["saved"] and s.counters.rewinds == 1
    nxt = {**LONGER, "messages": LONGER["messages"] + [{"role": "assistant", "content": "Aye."},
                                                      {"role": "user", "content": "Which flag?"}]}
    turn, cache_n, _ = await chat(s, nxt)
    assert turn.restored is None and s.counters.restores == 0
    assert cache_n == len(prompt(LONGER)) - 1


async def test_on_an_engine_that_empties_idle_slots_the_end_save_is_taken_back_too(tmp_path):
    """With llama-server's defaults (-np auto: a unified cache that empties idle slots) every
    request's end is saved at once under the launch gate's no-starts hold: the rewind runs
    inside that hold (a second one would wait for itself for ever)."""
    from stub_engine import StubEngine

    d = tmp_path / "sessions"
    d.mkdir()
    s = await make(tmp_path, engine=StubEngine(d, n_slots=2, clears_idle=True))
    s.ctx.recurrent = True
    assert s.launch.active
    await asyncio.wait_for(chat(s, LONGER), 10)
    assert header(s, f"auto-{conversation_key(LONGER)}.bin") == prompt(LONGER)[:-1]
    assert s.counters.rewinds == 1
