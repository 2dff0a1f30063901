"""The block store against the real engine (issue 39): a save of the model without a window is
cut into blocks, and the first m tokens assembled from them are restored by llama-server and
reused (cache_n = m), with exactly the answer a fresh read gives (the top log-probability of the
first token): with flash attention on (the default: V stored as rows), off (V stored transposed)
and with quantized K/V (rows rotated, n_rot). The whole save assembled is reused as the engine's
own file is, with its answer (not a fresh read's: the KV of tokens the engine generated differs
a little from the same tokens read as a prompt). The sliding-window model's save is cut into the
blocks of its full-attention layers and its window's tail (issue 47): assembled whole, it is the
engine's own file, and reused as that one is."""

import io

import pytest

from autosessd.store import blocks as B
from autosessd.store.blocks import BlockStore
from autosessd.store.cutting import assemble, split
from autosessd.store.kvfile import WINDOW, parse
from autosessd.store.slotfile import encode
from harness import chat_body, going_on, long_text

pytestmark = pytest.mark.engine


def top(r):
    return r["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0]["logprob"]


def ask(eng, body):
    return eng.post("/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 2, "max_tokens": 1,
                                             "temperature": 0})


@pytest.mark.parametrize("model, extra, v_trans", [
    ("kv8b", [], 0), ("kv8b", ["-fa", "off"], 1), ("kv8b", ["-ctk", "q8_0", "-ctv", "q8_0"], 0), ("gemma3", [], None),
], indirect=["model"], ids=["kv8b", "kv8b-fa-off", "kv8b-q8_0", "gemma3"])
def test_the_first_blocks_of_a_save_restore_as_a_fresh_read_does(engines, session_dir, tmp_path, model, extra,
                                                                   v_trans, monkeypatch):
    monkeypatch.setattr(B, "BLOCK_TOKENS", 128)  # blocks of 128: a short prompt is several
    eng = engines(session_dir, extra=extra)
    # ~340 tokens; on the window model ~680, past its window of 512 (a shorter conversation's window
    # holds every cell, and such a file stays whole)
    a = chat_body(long_text(40 if model.swa else 20) + "\nWhich box holds the most marbles?")
    first = eng.post("/v1/chat/completions", a)
    eng.post("/slots/0?action=save", {"filename": "a.bin"})
    kv = parse(session_dir / "a.bin")
    if model.swa:
        whole_save_with_its_tail(eng, kv, session_dir, tmp_path, a, first)
        return
    assert kv.n_cells >= 300 and kv.shape.v_trans == v_trans
    store = BlockStore(tmp_path / "home")
    refs, _, written = split(store, kv, session_dir / "a.bin", "kv8b")
    assert len(refs) == (kv.n_cells + 127) // 128
    m = 256  # two whole blocks: reads only those
    buf = io.BytesIO()
    assemble(store, kv.shape, encode(kv.tokens[:m]), refs, m, buf)
    (session_dir / "asm.bin").write_bytes(buf.getvalue())
    eng.post("/slots/0?action=erase", {})
    restored = eng.post("/slots/0?action=restore", {"filename": "asm.bin"})
    assert restored["n_restored"] == m
    nxt = going_on(a, first)
    via = ask(eng, nxt)
    assert via["timings"]["cache_n"] == m, via["timings"]
    eng.post("/slots/0?action=erase", {})
    fresh = ask(eng, nxt)
    assert fresh["timings"]["cache_n"] == 0
    assert top(via) == top(fresh), (top(via), top(fresh))
    # The whole save, assembled: reused as the engine's own file is (its cache order aside).
    buf = io.BytesIO()
    assemble(store, kv.shape, encode(kv.tokens), refs, kv.n_cells, buf)
    (session_dir / "all.bin").write_bytes(buf.getvalue())
    reused = {}
    for name in ("a.bin", "all.bin"):
        eng.post("/slots/0?action=erase", {})
        assert eng.post("/slots/0?action=restore", {"filename": name})["n_restored"] == len(kv.tokens)
        r = ask(eng, nxt)
        reused[name] = (r["timings"]["cache_n"], top(r))
    assert reused["all.bin"] == reused["a.bin"] and reused["a.bin"][0] > m, reused


def whole_save_with_its_tail(eng, kv, session_dir, tmp_path, body, first):
    assert kv.shape.tail == WINDOW and kv.tail_bytes > 0
    store = BlockStore(tmp_path / "home")
    refs, tail, _ = split(store, kv, session_dir / "a.bin", "gemma3")
    buf = io.BytesIO()
    assemble(store, kv.shape, encode(kv.tokens), refs, kv.n_cells, buf, tail)
    assert buf.getvalue() == (session_dir / "a.bin").read_bytes()  # one slot, one prompt: cells in position order
    (session_dir / "all.bin").write_bytes(buf.getvalue())
    eng.post("/slots/0?action=erase", {})
    assert eng.post("/slots/0?action=restore", {"filename": "all.bin"})["n_restored"] == len(kv.tokens)
    r = eng.post("/v1/chat/completions", {**going_on(body, first), "max_tokens": 1, "temperature": 0})
    assert r["timings"]["cache_n"] >= kv.n_cells - 1, r["timings"]
