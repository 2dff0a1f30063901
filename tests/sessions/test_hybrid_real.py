"""Returns the engine reuses on the models people run now (issue 47), on the real engine: the
Qwen3.5-shaped hybrid (full attention and Gated DeltaNet layers) and gpt-oss-20b's attention (a
128-token window every other layer). The window model runs with --swa-full, as doctor asks: without
it llama-server b11434 reuses no restore of it at all (the restored window's oldest cell is at the
position its check wants one below; measured here: 0 of 436 for a request going on from the file).

llama-server alone, with its own save and restore of the slot after a turn, gives nothing on the
hybrid when the next turn departs from the saved reply (its template drops earlier reasoning, a
reply comes back as other tokens) nor for a retry: the engine needs a context checkpoint there,
and none is in the file (DESIGN §9; llama.cpp issues 25913, 28194; pinned on these models by
tests/engines/test_shape_models.py). Here autosessd's save, taken one token before the prompt's
end (rewind.py), is reused by each of those requests; without the rewind the first of them reads
its prompt again. Each save is kept as the token blocks of its full-attention layers and a tail
(the recurrent state, the window's cells), and every restore here is assembled from them."""

import pytest

from autosessd import ctl

from harness import Daemon, chat_body, long_text, wait_until

pytestmark = pytest.mark.engine

A = chat_body(long_text(25, "box") + "\nWhich box holds the most marbles?", max_tokens=4)  # ~500 tokens
B = chat_body(long_text(4, "jar") + "\nWhich jar is red?", max_tokens=2)


def departing(body, reply="Something else entirely.", then="Why that one?"):
    """The next turn, its reply sent back as other text than the engine generated."""
    return {**body, "messages": body["messages"] + [{"role": "assistant", "content": reply},
                                                    {"role": "user", "content": then}]}


def shared(r):
    return r["timings"]["cache_n"], r["usage"]["prompt_tokens"]


@pytest.mark.parametrize("model", ["qwen35", "gptoss"], indirect=True)
def test_a_return_a_retry_and_a_restart_are_reused(engines, session_dir, tmp_path, model):
    eng = engines(session_dir, swa_full=model.swa)
    nxt = departing(A)
    # The store apart from the engine's directory and no copies kept there: every restore is
    # assembled from the blocks of the full-attention layers and the save's tail.
    d = Daemon(tmp_path, session_dir, eng.url,
               extra_toml=f'store_path = "{tmp_path / "store"}"\nstaging_max_gb = 0').start()
    try:
        a = eng.post("/v1/chat/completions", A, base=d.gate_url)
        eng.post("/v1/chat/completions", B, base=d.gate_url)  # a switch: A taken back and saved
        cache_n, prompt = shared(eng.post("/v1/chat/completions", nxt, base=d.gate_url))
        assert cache_n >= a["usage"]["prompt_tokens"] - 1, (cache_n, prompt)  # A's prompt, less its last token
        eng.post("/v1/chat/completions", B, base=d.gate_url)
        retry = eng.post("/v1/chat/completions", nxt, base=d.gate_url)  # the same request again
        cache_n, prompt = shared(retry)
        assert cache_n == prompt - 1, (cache_n, prompt)
        eng.restart()
        wait_until(lambda: d.status()["engine"]["healthy"], 60, 0.1, "the engine back")
        cache_n, prompt = shared(eng.post("/v1/chat/completions", nxt, base=d.gate_url))  # after the restart
        assert cache_n == prompt - 1, (cache_n, prompt)
        st = d.status()
        mem = st["engine"]["memory"]  # what the model file said, and so how saves are taken
        assert mem["recurrent"] is model.hybrid and (mem["swa_window"] == 128) is model.swa, mem
        assert mem["saved_at"] == "one token before the prompt's end"
        c = st["counters"]
        assert c["restores_reused"] == 3 and c["restores_not_reused"] == 0, c  # A three times (B is short)
        assert c["rewinds"] >= 2 and c["rewinds_reread"] == 0 and c["rewinds_not_done"] == 0, c
        assert c["tails_saved"] >= 2 and c["tail_restores"] == 3 and c["assemblies"] >= 3, c
        kept = [f for f in ctl.call(d.socket, "ls", timeout=30) if f["kind"] == "auto"]
        assert kept and all(f["stored"] == "blocks" and f["tail"] == ("recurrent" if model.hybrid else "window")
                            for f in kept), kept
    finally:
        d.stop()
    # The answer after the restores is the engine's own for that prompt read fresh (its first
    # tokens: with random weights, later ones drift apart with the cells' batching, as they do
    # for the engine's own prefix reuse).
    eng.post("/slots/0?action=erase", {})
    fresh = eng.post("/v1/chat/completions", nxt)
    assert fresh["choices"][0]["message"]["content"] == retry["choices"][0]["message"]["content"]
