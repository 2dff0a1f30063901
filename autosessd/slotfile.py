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


@dataclass(frozen=True)
class KVLayout:
    """What makes a slot file loadable by an engine (llama_kv_cache::state_read checks these):
    the number of KV streams (1 for -np 1 or a unified cache, N for -np N without one), whether
    V is stored transposed (flash attention off), the layer count and the K/V cache types.
    Nothing in the file names the model: the model's fingerprint is kept beside it."""

    n_stream: int
    v_trans: int | None = None  # None: the file holds no cells (an empty slot), only n_stream is known
    n_layer: int | None = None
    k_type: int | None = None  # ggml_type of the first layer's K (1 = F16, 8 = Q8_0, ...)

    def fingerprint(self) -> str:
        return f"s{self.n_stream}" + ("" if self.v_trans is None else
                                      f"-v{self.v_trans}-l{self.n_layer}-k{self.k_type}")

    @classmethod
    def from_fingerprint(cls, text: str) -> "KVLayout | None":
        """fingerprint() read back; None for anything else (metadata written by hand, or older)."""
        try:
            parts = dict((p[0], int(p[1:])) for p in text.split("-"))
            if set(parts) == {"s"}:
                return cls(parts["s"])
            return cls(parts["s"], parts["v"], parts["l"], parts["k"])
        except (ValueError, KeyError, IndexError, AttributeError, TypeError):
            return None

    def compatible(self, other: "KVLayout") -> bool:
        """Could a file of this layout load into an engine that writes `other`? Unknown parts
        (an empty slot's file) do not count against it."""
        if self.n_stream != other.n_stream:
            return False
        if self.v_trans is None or other.v_trans is None:
            return True
        return (self.v_trans, self.n_layer, self.k_type) == (other.v_trans, other.n_layer, other.k_type)


def read_layout(path: str | Path) -> KVLayout:
    """The first KV cache block after the token header (llama-kv-cache.cpp state_write):
    u32 n_stream; per stream u32 cell_count; for the stream with cells, 12 bytes per cell
    (24 for models with per-cell extensions), then u32 v_trans, u32 n_layer, u32 n_rot_k,
    u32 n_rot_v, then per layer i32 k_type, u64 row size, the data. Reads a few small pieces."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        head = f.read(12)
        if len(head) < 12:
            raise BadSlotFile(f"{path}: too short for a slot file")
        magic, version, n_words = struct.unpack("<III", head)
        if magic != MAGIC or version != VERSION:
            raise BadSlotFile(f"{path}: not a llama-server slot file of version {VERSION}")
        pos = 12 + 4 * n_words
        f.seek(pos)
        raw = f.read(4)
        if len(raw) < 4:
            raise BadSlotFile(f"{path}: ends before its KV state")
        (n_stream,) = struct.unpack("<I", raw)
        if not 0 < n_stream <= 4096:
            raise BadSlotFile(f"{path}: {n_stream} KV streams is not a plausible count")
        # Per stream: u32 cell_count, and only for the stream holding the slot's cells, what
        # follows it. The streams before it are bare zero counts.
        cells = 0
        for _ in range(n_stream):
            raw = f.read(4)
            if len(raw) < 4:
                raise BadSlotFile(f"{path}: ends inside its KV stream counts")
            (cells,) = struct.unpack("<I", raw)
            if cells:
                break
        if cells == 0:
            return KVLayout(n_stream)
        cells_at = f.tell()
        for cell_bytes in (12, 24):
            start = cells_at + cells * cell_bytes
            if start + 20 > size:
                continue
            f.seek(start)
            v_trans, n_layer, _, _, k_type = struct.unpack("<IIIIi", f.read(20))
            if v_trans in (0, 1) and 0 < n_layer <= 4096 and 0 <= k_type < 256:
                return KVLayout(n_stream, v_trans, n_layer, k_type)
        raise BadSlotFile(f"{path}: cannot find the KV layout after {cells:,} cells")
