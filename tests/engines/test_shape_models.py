"""The real-shape test models beyond the default two (issue 47), on the real engine: a hybrid
(`qwen35`: full attention and Gated DeltaNet, scripts/qwen35_model.py) and a sliding-window MoE
(`gptoss`, scripts/gptoss_model.py). Not in the `model` fixture's default list: named here.

What they pin down: the file a save writes is the engine's format with the prompt's tokens in its
header and the size the model's shape gives; and on the hybrid, where llama-server b11434 reuses a
restored state and where it reads everything again, the behaviour the product must work around
(DESIGN §9): a restore is reused only by a request that strictly goes on from the file's tokens.
"""

import pytest

from autosessd.store import slotfile
from harness import chat_body, long_text

pytestmark = pytest.mark.engine

A = [{"role": "user", "content": long_text(12) + " Which box holds the most?"}]  # ~250 tokens
B = chat_body(long_text(4, "jar") + " Which jar is red?", max_tokens=2)  # another conversation


def tokens_of(e, messages) -> list[int]:
    """The tokens of a chat request's prompt, as autosessd learns them."""
    text = e.post("/apply-template", {"messages": messages})["prompt"]
    return e.post("/tokenize", {"content": text, "add_special": True})["tokens"]


def chat(e, messages, max_tokens=2) -> dict:
    body = {**chat_body("", max_tokens), "messages": messages, "id_slot": 0, "cache_prompt": True}
    return e.post("/v1/chat/completions", body)


def switch_and_restore(e, name: str) -> None:
    """Another conversation on the slot, then the file back: what a switch does."""
    e.post("/v1/chat/completions", {**B, "id_slot": 0})
    assert e.post("/slots/0?action=restore", {"filename": name})["n_restored"] > 0


@pytest.mark.parametrize("model", ["qwen35", "gptoss"], indirect=True)
def test_a_save_holds_the_prompts_tokens_and_the_shapes_bytes(model, engines, tmp_path):
    d = tmp_path / "slots"
    d.mkdir()
    e = engines(save_dir=d)
    prompt = tokens_of(e, A)
    chat(e, A)
    saved = e.post("/slots/0?action=save", {"filename": "a.bin"})
    header = slotfile.read_header(d / "a.bin")
    # The prompt, then the reply's first token (the second is sampled, never evaluated).
    assert header.tokens[:len(prompt)] == tuple(prompt)
    assert header.n_tokens == saved["n_saved"] and len(prompt) < header.n_tokens <= len(prompt) + 1
    # The shape's size to the byte: per token (the full-attention layers' K and V and the cell's
    # metadata) and what every file holds whatever its length (a hybrid's recurrent state, an SWA
    # model's 128 window cells), as scripts/<model>_model.py measured and its layout gives.
    assert (d / "a.bin").stat().st_size == model.bytes_per_token * header.n_tokens + model.fixed_bytes


@pytest.mark.parametrize("model", ["qwen35"], indirect=True)
def test_a_hybrid_restore_is_reused_only_by_a_prompt_that_goes_on_from_the_file(model, engines, tmp_path):
    """llama-server b11434 (tools/server/server-context.cpp, ~3520-3610): a memory that cannot
    roll back (the DeltaNet layers hold the state after the last token only) is reused only when
    the request goes on from the slot's last token; otherwise it needs one of the slot's context
    checkpoints, which live in RAM and are cleared by a restore, and without one it reads the whole
    prompt again. So the state one token before the prompt's end serves a retry (and a next turn),
    while the state after the turn (prompt + reply) serves no request whose reply differs from the
    file's: a template that drops or rewrites earlier replies (reasoning, tool calls) gets nothing
    from it. The product saves the state it can use, not the one the engine happens to hold."""
    assert model.hybrid
    d = tmp_path / "slots"
    d.mkdir()
    e = engines(save_dir=d)
    prompt = tokens_of(e, A)
    # The state one token before the prompt's end, then the turn from it.
    e.post("/completion", {"prompt": prompt[:-1], "n_predict": 0, "id_slot": 0, "cache_prompt": True})
    assert e.post("/slots/0?action=save", {"filename": "before-end.bin"})["n_saved"] == len(prompt) - 1
    turn = chat(e, A)
    assert turn["timings"]["cache_n"] == len(prompt) - 1  # the turn went on from that state
    e.post("/slots/0?action=save", {"filename": "after-turn.bin"})

    switch_and_restore(e, "before-end.bin")
    retry = chat(e, A)["timings"]
    assert retry["cache_n"] >= len(prompt) - 1, retry

    switch_and_restore(e, "after-turn.bin")
    changed = A + [{"role": "assistant", "content": "The red box number 5 holds the most."},
                   {"role": "user", "content": "And which box holds the fewest?"}]
    departing = chat(e, changed)["timings"]
    # The engine's behaviour, not a wish: the whole prompt read again.
    assert departing["cache_n"] == 0, departing
    assert departing["prompt_n"] == len(tokens_of(e, changed))
