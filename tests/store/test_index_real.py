"""A chat request's tokens from the engine (/apply-template + /tokenize) against what the
engine then saves: the index compares exactly these two lists."""

import aiohttp
import pytest

from autosessd.engines.base import EngineRefused
from autosessd.engines.llama_server import LlamaServer
from autosessd.store.index import TokenIndex
from autosessd.store.slotfile import read_header
from harness import long_text

pytestmark = pytest.mark.engine


async def test_prompt_tokens_are_the_saved_files_first_tokens(engines, session_dir):
    eng = engines(session_dir)
    e = LlamaServer(eng.url, timeout_s=30)
    body = {"messages": [{"role": "system", "content": "You are a pirate."},
                         {"role": "user", "content": long_text(20)},
                         {"role": "assistant", "content": "Arr, twenty facts."},
                         {"role": "user", "content": "Which box is red? Say <start_of_turn> too."}],
            "temperature": 0, "max_tokens": 8, "seed": 1}
    try:
        tokens = await e.prompt_tokens(body)
        async with aiohttp.ClientSession() as c:
            async with c.post(eng.url + "/v1/chat/completions", json=body) as r:
                out = await r.json()
        assert out["usage"]["prompt_tokens"] == len(tokens)
        saved = await e.save(0, "pirate.bin")
        head = read_header(session_dir / "pirate.bin").tokens
        assert len(head) == saved.n_tokens
        # The file holds the prompt, token for token (BOS included), then what was generated.
        assert list(head[:len(tokens)]) == tokens
        assert len(tokens) < len(head) <= len(tokens) + out["usage"]["completion_tokens"]

        idx = TokenIndex(session_dir)
        idx.scan()
        idx.learn("pirate.bin", "gemma")
        follow_up = await e.prompt_tokens({**body, "messages": body["messages"] + [
            {"role": "assistant", "content": out["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And the blue one?"}]})
        name, shared = idx.best(follow_up, "gemma")
        assert name == "pirate.bin" and len(tokens) <= shared < len(follow_up)

        with pytest.raises(EngineRefused, match="apply-template"):
            await e.prompt_tokens({"messages": "not a list"})
    finally:
        await e.close()
