"""Issue 38's acceptance, as a stress run on the stub engine: 4 slots, 8 conversations, a few
hundred requests, several at a time, with quick returns, forgets, prunes and saves while idle
interleaved at random, every finalize slowed and some failed once at random. Afterwards, after
a clean stop:

    every conversation neither forgotten nor pruned since its last request is in a file whose
    header holds its newest tokens (the stop saved what the slots held);
    no file holds a forgotten conversation's tokens;
    no temporary (.partial, held.json's .tmp) is left;
    save_failures counts exactly the failures injected (each retried from its bytes).

The stub writes real slot files whose header tokens stand for the conversation (conversation i
is i*10000+1, i*10000+2, ...), so every check reads the files, not autosessd's records."""

import asyncio
import random
import threading

import pytest

from autosessd.base.config import parse
from autosessd.sessions import finalizing
from autosessd.sessions.facade import Sessions
from autosessd.store import slotfile
from autosessd.store.directory import Store
from stub_engine import StubEngine

N_CONV, N_SLOTS, STEPS = 8, 4, 300
KEYS = [f"{i:x}" * 16 for i in range(1, N_CONV + 1)]


def conv(key, n):
    base = KEYS.index(key) * 10000 + 1
    return list(range(base, base + n))


def owner(tokens):
    return KEYS[(tokens[0] - 1) // 10000] if tokens else None


@pytest.mark.parametrize("seed", [1, 2])
async def test_many_quick_returns_forgets_and_prunes_lose_nothing_and_bring_nothing_back(tmp_path, monkeypatch,
                                                                                        seed):
    rng = random.Random(seed)
    monkeypatch.setattr(finalizing, "RETRY_S", (0.01, 0.02, 0.05))
    state = tmp_path / "state"
    cfg = parse(f'slot_save_path = "{tmp_path}"\nauto_sessions_min_tokens = 10\nstate_dir = "{state}"\n'
                f'idle_save_s = 0.05\n'.encode())
    s = Sessions(cfg, StubEngine(tmp_path, n_slots=N_SLOTS), Store(tmp_path), "stub-model", n_slots=N_SLOTS)
    await s.prepare()

    injected, seen, lock = [0], set(), threading.Lock()
    real = Store.finalize

    def flaky(self_, key, meta, digest=None):
        __import__("time").sleep(rng.random() * 0.01)  # a fsync of some size
        with lock:
            first_try = (key, meta.saved_at) not in seen
            seen.add((key, meta.saved_at))
            fail = first_try and rng.random() < 0.15
            if fail:
                injected[0] += 1
        if fail:
            raise OSError(5, "Input/output error (injected)")
        return real(self_, key, meta, digest)

    monkeypatch.setattr(Store, "finalize", flaky)

    length = {k: 20 for k in KEYS}  # each conversation's newest length, as its client sends it
    forgotten: set[str] = set()  # forgotten, and no request of it ran meanwhile or since
    pruned: set[str] = set()  # pruned since its last request: may be gone, legitimately
    recent: list[str] = []
    started = {k: 0 for k in KEYS}  # requests of each conversation begun
    running = {k: 0 for k in KEYS}  # and not ended

    async def request(key):
        length[key] += rng.randint(3, 30)
        n = length[key]
        forgotten.discard(key)
        pruned.discard(key)
        started[key] += 1
        running[key] += 1
        try:
            t = await s.place(key)
            async with t:
                await s.turn(t, key)
                s.engine.ran(conv(key, n), t.slot_id)
                await s.ended(t, key, "ok")
        finally:
            running[key] -= 1
        recent.append(key)

    async def step():
        r = rng.random()
        if r < 0.08 and recent:
            key = rng.choice(KEYS)
            before, was_running = started[key], running[key]
            await s.forget(key)
            if started[key] == before and not was_running:
                # No request of it in flight when forget began, none since: it must stay gone.
                # (One in flight, or arriving meanwhile, is a new request of it.)
                forgotten.add(key)
        elif r < 0.13:
            done = await s.prune(keep=rng.randint(3, 10))
            pruned.update(x["key"] for x in done["removed"])
        elif r < 0.16:
            await s.save_idle_now()
        else:
            # A quick return (to one of the last few), or any conversation.
            key = rng.choice(recent[-3:]) if recent and rng.random() < 0.5 else rng.choice(KEYS)
            await request(key)

    i = 0
    while i < STEPS:
        batch = rng.randint(1, 3)
        await asyncio.gather(*(step() for _ in range(batch)))
        i += batch

    # A clean stop, as the daemon's.
    for slot in s.slots:
        await s.save_at_stop(slot, "stop")
    await s.drain()
    await s.close()
    await s.last.record_stop(s.slots.values())

    files = {p.name: list(slotfile.read_header(p).tokens) for p in tmp_path.glob("auto-*.bin")}
    by_owner: dict[str, list[list[int]]] = {}
    for tokens in files.values():
        by_owner.setdefault(owner(tokens), []).append(tokens)
    for key in KEYS:
        if key in forgotten:
            assert key not in by_owner, f"forgotten {key} is back in a file"
        elif key not in pruned and length[key] > 20:  # it ran at least once
            assert conv(key, length[key]) in by_owner.get(key, []), \
                (key, length[key], [len(t) for t in by_owner.get(key, [])])
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".autosessd-")]
    left += [p.name for p in state.iterdir() if p.name.endswith(".tmp")]
    assert left == []
    assert s.counters.save_failures == injected[0] and injected[0] > 0
