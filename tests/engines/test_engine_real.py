"""The llama-server adapter and sessions/facade.py against a real llama-server (Gemma 3 270M)."""

import json
import logging

import aiohttp
import pytest

from autosessd.base.config import parse
from autosessd.sessions.checks import check_engine
from autosessd.engines.base import EngineRefused, SlotSavingOff
from autosessd.engines.llama_server import LlamaServer
from autosessd.base.keys import conversation_key
from autosessd.sessions.facade import Sessions
from autosessd.store.directory import Store
from harness import chat_body, long_text

pytestmark = pytest.mark.engine

A = chat_body(long_text(70) + "\nHow many marbles are in box 5?")  # ~1,250 tokens
B = chat_body(long_text(40, "jar") + "\nWhich jar is red?")
C = chat_body("Say hello in French.")


async def make_sessions(eng, session_dir, min_tokens=100) -> Sessions:
    cfg = parse(f'slot_save_path = "{session_dir}"\nauto_sessions_min_tokens = {min_tokens}\n'
                f'state_dir = "{session_dir}-state"\n[engine]\nurl = "{eng.url}"\ntimeout_s = 30\n'.encode(), "test.toml")
    engine = LlamaServer(eng.url, timeout_s=30)
    store = Store(session_dir)
    checked = await check_engine(cfg, engine, store)
    return Sessions(cfg, engine, store, checked.model, checked.model_name, checked.slots_visible)


async def request(s: Sessions, url: str, body: dict):
    """What an in-path input does: FIFO, turn, request, ended."""
    key = conversation_key(body)
    async with await s.admit() as ticket:
        turn = await s.turn(ticket, key)
        async with aiohttp.ClientSession() as c:
            async with c.post(url + "/v1/chat/completions", json=body) as r:
                d = await r.json()
        t = d["timings"]
        await s.ended(ticket, key, "ok", d["usage"]["total_tokens"], t["cache_n"], t["cache_n"] + t["prompt_n"])
    await s.drain()
    return turn, d


async def test_turn_a_b_a_saves_restores_and_engine_reuses(engines, session_dir, caplog):
    caplog.set_level(logging.INFO, "autosessd")
    eng = engines(session_dir)
    s = await make_sessions(eng, session_dir)
    try:
        ka, kb = conversation_key(A), conversation_key(B)
        _, a1 = await request(s, eng.url, A)
        assert a1["timings"]["cache_n"] == 0
        turn_b, _ = await request(s, eng.url, B)
        assert turn_b.saved["key"] == ka and turn_b.restored is None
        # The save is atomic and carries metadata that agrees with the file: a whole file, or (a
        # model whose file can be cut: Gemma 3's, its window a tail) a manifest of blocks/, the
        # engine's file kept beside it as its copy.
        names = sorted(p.name for p in session_dir.iterdir())
        meta = json.loads((session_dir / f"auto-{ka}.json").read_text())
        assert names == [f"auto-{ka}.bin", f"auto-{ka}.json"] + (["blocks"] if meta.get("blocks") else []), names
        assert meta["bytes"] == (session_dir / f"auto-{ka}.bin").stat().st_size == turn_b.saved["bytes"]
        assert meta["n_tokens"] == turn_b.saved["n_tokens"] >= a1["usage"]["prompt_tokens"]
        assert meta["model"] == s.model
        assert (session_dir / f"auto-{ka}.bin").read_bytes()[:4] == b"qsgg"

        turn_a, a2 = await request(s, eng.url, A)
        assert turn_a.saved["key"] == kb and turn_a.restored["key"] == ka
        prompt = a2["usage"]["prompt_tokens"]
        assert a2["timings"]["cache_n"] >= 0.9 * prompt
        assert a2["choices"][0]["message"]["content"] == a1["choices"][0]["message"]["content"]

        c = s.counters
        assert (c.turns, c.saves, c.restores, c.restores_reused, c.restores_not_reused) == (3, 2, 1, 1, 0)
        assert c.save_failures == c.restore_failures == 0
        # What the restore gave beyond what the slot already shared with A's prompt (issue 22).
        had = s.restore_log.last[0]["slot_shared"] or 0
        assert c.prefill_tokens_avoided == a2["timings"]["cache_n"] - had and had < 100
        lines = [r.getMessage() for r in caplog.records]
        assert any(line.startswith(f"auto sessions: saved {meta['n_tokens']:,} tokens (") and
                   f"to auto-{ka}.bin in " in line for line in lines), lines
        assert any(line.startswith(f"auto sessions: restored {meta['n_tokens']:,} tokens from auto-{ka}.bin in ")
                   for line in lines), lines
    finally:
        await s.engine.close()


async def test_below_min_tokens_is_skipped_and_logged(engines, session_dir, caplog):
    caplog.set_level(logging.DEBUG, "autosessd")
    eng = engines(session_dir)
    s = await make_sessions(eng, session_dir, min_tokens=100_000)
    try:
        await request(s, eng.url, A)
        turn, d = await request(s, eng.url, C)
        assert turn.saved is None and d["choices"]
        assert any("skipped save" in m and "below min tokens" in m for m in turn.skipped)
        assert s.counters.skipped_min_tokens == 1
        assert not list(session_dir.glob("auto-*"))
        # The save of a short chat left is routine: DEBUG (the turn's event has it).
        assert any("auto sessions: skipped save of auto-" in r.getMessage() and r.levelno == logging.DEBUG
                   for r in caplog.records)
    finally:
        await s.engine.close()


async def test_restore_without_swa_full_is_reported_not_reused(engines, session_dir):
    eng = engines(session_dir, swa_full=False)
    s = await make_sessions(eng, session_dir)
    try:
        await request(s, eng.url, A)
        await request(s, eng.url, B)
        turn, a2 = await request(s, eng.url, A)
        assert turn.restored is not None  # the engine accepted the file...
        assert a2["timings"]["cache_n"] < 0.5 * a2["usage"]["prompt_tokens"]  # ...and did not use it
        assert s.counters.restores_not_reused == 1 and s.counters.restores_reused == 0
        st = s.status()
        assert st["counters"]["restores_not_reused"] == 1
        assert "--swa-full" in st["last_not_reused"]["likely_cause"]
    finally:
        await s.engine.close()


async def test_adapter_errors_are_clear(engines, session_dir, tmp_path):
    eng = engines(session_dir)
    e = LlamaServer(eng.url, timeout_s=10)
    try:
        with pytest.raises(EngineRefused, match="400"):
            await e.save(0, "../escape.bin")
        with pytest.raises(EngineRefused):
            await e.restore(0, "auto-0000000000000000.bin")  # no such file
        [slot] = await e.slots()
        assert slot.id == 0 and not slot.is_processing
        assert await e.health()
    finally:
        await e.close()
    off = engines(None)  # no --slot-save-path
    e = LlamaServer(off.url, timeout_s=10)
    try:
        with pytest.raises(SlotSavingOff, match="--slot-save-path"):
            await e.save(0, "x.bin")
    finally:
        await e.close()
