"""What a llama-server slot file says about itself: its token list, read from the header.

The engine is the ground truth for what a file holds (STYLE §14). llama-server b11434
writes (llama_state_seq_save_file + server_tokens::serialize):

    u32 magic     0x67677371 ("qsgg" on disk, little-endian)
    u32 version   4 (LLAMA_STATE_SEQ_VERSION)
    u32 n_words   number of 32-bit words that follow, before the KV state
    n_words × i32 the server's payload:
                    -1 (LLAMA_TOKEN_NULL, a format marker), 1 (payload version),
                    n_tokens, n_tokens token ids, n_media, media chunks…
                  older servers: the plain token list (n_words tokens)
    …             the KV state (read only by the engine)

Only the header is read: a 20 GB file costs one small read per token block. The
loader in llama.cpp checks n_words against the file size before it reads on; so do we.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = 0x67677371
MAGIC_BYTES = struct.pack("<I", MAGIC)  # b"qsgg"
VERSION = 4
TOKEN_NULL = -1
PAYLOAD_VERSION = 1


class BadSlotFile(ValueError):
    """A file that is not a llama-server slot file this code understands; says why."""


@dataclass(frozen=True)
class SlotHeader:
    tokens: tuple[int, ...]  # the prompt the state belongs to: what the engine would reuse

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def parse_header(data: bytes, file_size: int | None = None) -> SlotHeader:
    """The header at the start of `data` (which must hold at least the whole header)."""
    if len(data) < 12:
        raise BadSlotFile(f"{len(data)} bytes: too short for a slot file header")
    magic, version, n_words = struct.unpack_from("<III", data, 0)
    if magic != MAGIC:
        raise BadSlotFile(f"magic {magic:#010x} is not llama-server's {MAGIC:#010x}")
    if version != VERSION:
        raise BadSlotFile(f"state file version {version}, this code reads {VERSION}")
    end = 12 + 4 * n_words
    if file_size is not None and end > file_size:
        raise BadSlotFile(f"header claims {n_words:,} words, more than the file's {file_size:,} bytes hold")
    if len(data) < end:
        raise BadSlotFile(f"header of {end:,} bytes, only {len(data):,} read")
    words = struct.unpack_from(f"<{n_words}i", data, 12)
    if n_words >= 3 and words[0] == TOKEN_NULL:
        if words[1] != PAYLOAD_VERSION:
            raise BadSlotFile(f"server payload version {words[1]}, this code reads {PAYLOAD_VERSION}")
        n = words[2]
        if n < 0 or 3 + n > n_words:
            raise BadSlotFile(f"payload claims {n:,} tokens in {n_words:,} words")
        return SlotHeader(tuple(words[3:3 + n]))
    return SlotHeader(tuple(words))  # an older server's plain token list


def read_header(path: str | Path) -> SlotHeader:
    """Read only the header of a slot file. BadSlotFile or OSError when it cannot."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        head = f.read(12)
        if len(head) < 12:
            raise BadSlotFile(f"{path}: {len(head)} bytes, too short for a slot file")
        _, _, n_words = struct.unpack("<III", head)
        if 12 + 4 * n_words > size:
            raise BadSlotFile(f"{path}: header claims {n_words:,} words, more than the file's {size:,} bytes hold")
        return parse_header(head + f.read(4 * n_words), size)


def build(tokens: list[int] | tuple[int, ...], state: bytes = b"") -> bytes:
    """A file in the engine's layout (tests and fakes write these)."""
    payload = [TOKEN_NULL, PAYLOAD_VERSION, len(tokens), *tokens, 0]
    return struct.pack(f"<III{len(payload)}i", MAGIC, VERSION, len(payload), *payload) + state
