"""The few facts autosessd reads from a model's GGUF file: its architecture, its sliding window,
and whether part of its state is recurrent.

llama-server does not say in /props whether its model has sliding-window attention layers,
but its model file does (`<arch>.attention.sliding_window`, e.g. 1,024 for Gemma 3 27B, 512 for 270M), and that
window decides which saved files the engine can reuse after a restore (index.py, best()).
A model with recurrent layers (Mamba, RWKV, and the hybrids: Qwen3.5, Qwen3-Next, Granite 4.0-H)
keeps a state for its last token only; the engine reuses a restore of it only for a request
that strictly extends the restored tokens (sessions/rewind.py).

GGUF (ggml's docs/gguf.md), little-endian:

    u32 magic "GGUF"   u32 version (1-3)   tensor count, key/value count (u64; u32 in v1)
    per key/value: string key, u32 value type, the value
    string: length (u64; u32 in v1) + UTF-8 bytes;  array: u32 element type, count, elements

Only the key/value section at the start is read, stopping at the keys wanted: a model of
many GB costs a few reads (a tokenizer's string arrays are skipped, not parsed).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"GGUF"
# Architectures whose state has recurrent layers (llama.cpp's RS memory, alone or in a hybrid);
# the keys below say it for architectures not listed here.
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "jamba", "falcon-h1",
                             "granitehybrid", "nemotron_h", "nemotron_h_moe", "plamo2", "lfm2", "lfm2moe",
                             "qwen3next", "qwen35", "qwen35moe", "bamba", "kimi-linear"})
RECURRENT_KEYS = ("ssm.conv_kernel", "ssm.state_size", "wkv.head_size", "shortconv.l_cache")
# value type → struct format of one scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_KV = 1 << 20
_MAX_STRING = 1 << 26


class BadGGUF(ValueError):
    """Not a GGUF file this reader understands; says why."""


class _Reader:
    def __init__(self, f: BinaryIO, path: str):
        self.f = f
        self.path = path
        self.version = 0

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise BadGGUF(f"{self.path}: ends inside its metadata")
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self) -> int:
        return self.scalar("I" if self.version == 1 else "Q")

    def string(self) -> str:
        n = self.count()
        if n > _MAX_STRING:
            raise BadGGUF(f"{self.path}: a string of {n:,} bytes is not plausible")
        return self.take(n).decode("utf-8", "replace")

    def skip_string(self) -> None:
        n = self.count()
        if n > _MAX_STRING:
            raise BadGGUF(f"{self.path}: a string of {n:,} bytes is not plausible")
        self.f.seek(n, 1)

    def value(self, vtype: int, keep: bool) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            if keep:
                return self.string()
            self.skip_string()
            return None
        if vtype == _ARRAY:
            etype, n = self.scalar("I"), self.count()
            if etype in _SCALARS:
                self.f.seek(n * struct.calcsize(_SCALARS[etype]), 1)  # arrays are never wanted here
            elif etype == _STRING:
                for _ in range(n):
                    self.skip_string()
            else:
                for _ in range(n):
                    self.value(etype, False)
            return None
        raise BadGGUF(f"{self.path}: unknown value type {vtype}")


def read_keys(path: str | Path, wanted: set[str] | None = None, stop_after: int | None = None) -> dict[str, Any]:
    """The scalar and string metadata of a GGUF file (arrays are skipped): every key, or only
    those in `wanted`. Stops once stop_after of them are found. BadGGUF or OSError."""
    path = str(path)
    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        r = _Reader(f, path)
        if r.take(4) != MAGIC:
            raise BadGGUF(f"{path}: not a GGUF file (no GGUF magic)")
        r.version = r.scalar("I")
        if r.version not in (1, 2, 3):
            raise BadGGUF(f"{path}: GGUF version {r.version} (big-endian or newer than this reader knows)")
        r.count()  # tensors
        n_kv = r.count()
        if n_kv > _MAX_KV:
            raise BadGGUF(f"{path}: {n_kv:,} metadata keys is not plausible")
        for _ in range(n_kv):
            key = r.string()
            keep = wanted is None or key in wanted
            v = r.value(r.scalar("I"), keep)
            if keep and v is not None:
                out[key] = v
                if stop_after is not None and len(out) >= stop_after:
                    break
    return out


def sliding_window(path: str | Path) -> int:
    """The model's sliding attention window in tokens (n_swa), 0 when it has none."""
    key = f"{architecture(path)}.attention.sliding_window"
    v = read_keys(path, {key}, stop_after=1).get(key)
    return int(v) if isinstance(v, (int, float)) and v > 0 else 0


def architecture(path: str | Path) -> str:
    arch = read_keys(path, {"general.architecture"}, stop_after=1).get("general.architecture")
    if not isinstance(arch, str):
        raise BadGGUF(f"{path}: no general.architecture")
    return arch


def recurrent(path: str | Path) -> bool:
    """Part of the model's state is recurrent (a state for the last token only)."""
    arch = architecture(path)
    return arch in RECURRENT_ARCHS or bool(read_keys(path, {f"{arch}.{k}" for k in RECURRENT_KEYS}, stop_after=1))
