"""What changes the KV bytes is in the model's fingerprint, and so in every block key (issue 46, 3):
the engine's RoPE/YaRN, LoRA, control-vector and metadata-override settings, read from its
command line (or behind a router, from its model's args) and its loaded adapters. Two engines
differing only in such a setting never share a block; an engine without any keeps the
fingerprint it always had."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from autosessd.engines.llama_server import LlamaServer
from autosessd.engines.process import kv_flags
from autosessd.store.cutting import cut
from autosessd.store.directory import Meta, Store
from autosessd.store.kvfile import parse


@pytest.mark.parametrize("argv, env, want", [
    (["llama-server", "-m", "m.gguf", "-c", "8192", "--swa-full"], {}, ()),
    (["llama-server", "--rope-freq-base", "20000", "-c", "8192"], {}, ("--rope-freq-base=20000",)),
    (["llama-server", "--rope_freq_base=20000"], {}, ("--rope-freq-base=20000",)),
    (["llama-server", "--yarn-ext-factor", "-1.0", "--rope-scaling", "yarn"], {},
     ("--rope-scaling=yarn", "--yarn-ext-factor=-1.0")),
    (["llama-server", "--control-vector-layer-range", "2", "9"], {}, ("--control-vector-layer-range=2 9",)),
    (["llama-server", "--lora", "/no/such/adapter.gguf"], {}, ("--lora=adapter.gguf[?]",)),
    (["llama-server", "--lora-scaled", "/x/a.gguf:0.5,/y/b.gguf:1"], {}, ("--lora-scaled=a.gguf[?]:0.5,b.gguf[?]:1",)),
    (["llama-server"], {"LLAMA_ARG_ROPE_FREQ_BASE": "500000", "LLAMA_ARG_CTX_SIZE": "4096"},
     ("LLAMA_ARG_ROPE_FREQ_BASE=500000",)),
    (["--rope-freq-base", "20000", "--port", "8080"], {}, ("--rope-freq-base=20000",)),  # a router's model args
    (["s", "--control-vector-scaled", "/v/cv.gguf", "0.8"], {}, ("--control-vector-scaled=cv.gguf[?] 0.8",)),
])
def test_the_settings_that_change_the_kv_are_read_from_a_command_line(argv, env, want):
    assert kv_flags(argv, env) == want


def test_an_adapter_file_is_named_by_its_base_name_and_size(tmp_path):
    a, b = tmp_path / "one" / "lora.gguf", tmp_path / "two" / "lora.gguf"
    for p, n in ((a, 100), (b, 200)):
        p.parent.mkdir()
        p.write_bytes(b"x" * n)
    assert kv_flags(["s", "--lora", str(a)]) == ("--lora=lora.gguf[100]",)
    assert kv_flags(["s", "--lora", str(a)]) != kv_flags(["s", "--lora", str(b)])


def saved_blocks(eng, store: Store, fingerprint: str, key: str, prompt: list[int]) -> list[str]:
    """The engine reads `prompt` into slot 0 and saves it; the store keeps it as blocks under the
    engine's fingerprint: → the block keys."""
    eng.post("/completion", {"prompt": prompt, "n_predict": 1, "id_slot": 0, "cache_prompt": True, "temperature": 0})
    res = eng.post("/slots/0?action=save", {"filename": store.temp_path(key).name})
    meta = store.finalize(key, Meta(key, res["n_saved"], res["n_written"], time.time(), fingerprint, 1.0))
    assert meta.in_blocks, meta.whole
    return [b[0] for b in meta.blocks]


@pytest.mark.engine
@pytest.mark.parametrize("model", ["kv8b"], indirect=True)
def test_two_engines_differing_only_in_rope_never_share_a_block(engines, tmp_path, model):
    d1, d2 = tmp_path / "one", tmp_path / "two"
    d1.mkdir()
    d2.mkdir()
    plain = engines(d1)
    rope = engines(d2, extra=["--rope-freq-base", "20000"])

    async def fingerprints():
        out = []
        for e in (plain, rope):
            s = LlamaServer(e.url)
            try:
                out.append((await s.info()))
            finally:
                await s.close()
        return out

    a, b = asyncio.run(fingerprints())
    assert a.kv_settings == () and b.kv_settings == ("--rope-freq-base=20000",)
    assert a.model != b.model
    s1, s2 = Store(d1), Store(d2)
    prompt = list(range(1000, 1000 + 300))  # two whole blocks and part of a third
    keys_a = saved_blocks(plain, s1, a.model, "a" * 16, prompt)
    keys_b = saved_blocks(rope, s2, b.model, "b" * 16, prompt)
    assert not set(keys_a) & set(keys_b)
    # And it matters: the same tokens at the same positions have other K/V under the other RoPE base.
    first = []
    for st, key in ((s1, "a" * 16), (s2, "b" * 16)):
        path = st.hot_path(key)
        kv = parse(path)
        arr = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        first.append(b"".join(bytes(p) for p in cut(kv, arr, 0, 128)))
    assert first[0] != first[1]
