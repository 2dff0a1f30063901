"""The GGUF metadata reader: a model's sliding window, read from its file (stdlib only)."""

import struct

import pytest

from autosessd.engines import gguf
from autosessd.base.config import ConfigError, parse


def s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def kv_str(key: str, value: str) -> bytes:
    return s(key) + struct.pack("<I", 8) + s(value)


def kv_u32(key: str, value: int) -> bytes:
    return s(key) + struct.pack("<II", 4, value)


def kv_str_array(key: str, values: list[str]) -> bytes:
    return s(key) + struct.pack("<IIQ", 9, 8, len(values)) + b"".join(s(v) for v in values)


def kv_f32_array(key: str, values: list[float]) -> bytes:
    return s(key) + struct.pack("<IIQ", 9, 6, len(values)) + struct.pack(f"<{len(values)}f", *values)


def model(tmp_path, *kvs: bytes, magic=b"GGUF", version=3):
    p = tmp_path / "m.gguf"
    p.write_bytes(magic + struct.pack("<IQQ", version, 0, len(kvs)) + b"".join(kvs) + b"\0" * 64)
    return p


def test_reads_the_sliding_window_past_arrays_it_skips(tmp_path):
    p = model(tmp_path, kv_str("general.architecture", "gemma3"), kv_str_array("tokenizer.ggml.tokens", ["a", "bc"] * 500),
              kv_f32_array("tokenizer.ggml.scores", [0.5] * 1000), kv_u32("gemma3.attention.sliding_window", 512))
    assert gguf.sliding_window(p) == 512
    keys = gguf.read_keys(p)
    assert keys == {"general.architecture": "gemma3", "gemma3.attention.sliding_window": 512}


def test_a_model_without_a_window_has_none(tmp_path):
    p = model(tmp_path, kv_str("general.architecture", "llama"), kv_u32("llama.context_length", 4096))
    assert gguf.sliding_window(p) == 0


@pytest.mark.parametrize("make, match", [
    (lambda t: model(t, kv_u32("x", 1), magic=b"GGML"), "not a GGUF file"),
    (lambda t: model(t, kv_u32("x", 1), version=7), "GGUF version 7"),
    (lambda t: model(t, kv_u32("llama.context_length", 1)), "no general.architecture"),
])
def test_bad_files_say_why(tmp_path, make, match):
    with pytest.raises(gguf.BadGGUF, match=match):
        gguf.sliding_window(make(tmp_path))


def test_a_truncated_file_says_so(tmp_path):
    p = tmp_path / "t.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + kv_str("general.architecture", "gemma3")[:10])
    with pytest.raises(gguf.BadGGUF, match="ends inside its metadata"):
        gguf.sliding_window(p)


def test_the_real_gemma_3_model_has_a_window_of_512(engine_bin):
    assert gguf.sliding_window(engine_bin["MODEL"]) == 512


def test_engine_swa_window_is_checked():
    assert parse(b'slot_save_path = "/x"\n[engine]\nswa_window = 0\n').engine.swa_window == 0
    with pytest.raises(ConfigError, match="engine.swa_window: must be 0"):
        parse(b'slot_save_path = "/x"\n[engine]\nswa_window = -1\n')
