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
loader in llama.cpp checks n_words against the file size before it reads on; so do we, and
against the most tokens the engine could hold (max_tokens: its context), so a small sparse
file whose header claims 50 million tokens costs nothing. Files are opened as
files.open_regular opens them: never through a link, never blocking on a FIFO.
"""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..base.files import open_regular

MAGIC = 0x67677371
MAGIC_BYTES = struct.pack("<I", MAGIC)  # b"qsgg"
VERSION = 4
TOKEN_NULL = -1
_NULL_WORD = struct.pack("<i", TOKEN_NULL)
PAYLOAD_VERSION = 1
MEDIA_WORDS = 1 << 16  # words of media chunks allowed beyond the tokens (images are rare and small here)


class BadSlotFile(ValueError):
    """A file that is not a llama-server slot file this code understands; says why."""


class UnknownFormat(BadSlotFile):
    """A slot file of another state or payload version than this code reads (a newer engine):
    kept whole under its conversation's key, never cut or matched by its tokens."""


@dataclass(frozen=True)
class SlotHeader:
    tokens: tuple[int, ...]  # the prompt the state belongs to: what the engine would reuse
    # The same tokens as the file stores them (little-endian int32), when read from one.
    raw: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def encoded(self) -> bytes:
        """index.encode(index.comparable(tokens)): the tokens a text prompt can share, up to
        the first media placeholder, as the index keeps them. From the file's own bytes when
        it was read (the same little-endian int32): decoding and encoding 21k tokens again
        cost ~1.2 ms on a switch's path."""
        raw = self.raw
        if raw is None or sys.byteorder != "little":
            return encode(comparable(self.tokens))
        at = raw.find(_NULL_WORD)
        while at >= 0 and at % 4:  # inside two tokens' bytes, not a token of its own
            at = raw.find(_NULL_WORD, at + 1)
        return raw if at < 0 else raw[:at]


def max_words(max_tokens: int | None) -> int | None:
    """The most header words a file of at most max_tokens tokens can have."""
    return None if max_tokens is None else 4 + max_tokens + MEDIA_WORDS


def parse_header(data: bytes, file_size: int | None = None, max_tokens: int | None = None) -> SlotHeader:
    """The header at the start of `data` (which must hold at least the whole header)."""
    if len(data) < 12:
        raise BadSlotFile(f"{len(data)} bytes: too short for a slot file header")
    magic, version, n_words = struct.unpack_from("<III", data, 0)
    if magic != MAGIC:
        raise BadSlotFile(f"magic {magic:#010x} is not llama-server's {MAGIC:#010x}")
    if version != VERSION:
        raise UnknownFormat(f"state file version {version}, this code reads {VERSION}")
    end = 12 + 4 * n_words
    if file_size is not None and end > file_size:
        raise BadSlotFile(f"header claims {n_words:,} words, more than the file's {file_size:,} bytes hold")
    bound = max_words(max_tokens)
    if bound is not None and n_words > bound:
        raise BadSlotFile(f"header claims {n_words:,} words, more than {max_tokens:,} tokens take (the engine's "
                          f"context): not read")
    if len(data) < end:
        raise BadSlotFile(f"header of {end:,} bytes, only {len(data):,} read")
    words = struct.unpack_from(f"<{n_words}i", data, 12)
    if n_words >= 3 and words[0] == TOKEN_NULL:
        if words[1] != PAYLOAD_VERSION:
            raise UnknownFormat(f"server payload version {words[1]}, this code reads {PAYLOAD_VERSION}")
        n = words[2]
        if n < 0 or 3 + n > n_words:
            raise BadSlotFile(f"payload claims {n:,} tokens in {n_words:,} words")
        if max_tokens is not None and n > max_tokens:
            raise BadSlotFile(f"holds {n:,} tokens, more than the engine's context of {max_tokens:,}")
        return SlotHeader(tuple(words[3:3 + n]), bytes(data[24:24 + 4 * n]))
    return SlotHeader(tuple(words), bytes(data[12:end]))  # an older server's plain token list


def read_header(path: str | Path, max_tokens: int | None = None) -> SlotHeader:
    """Read only the header of a slot file (a regular file: NotRegular, an OSError, for a
    link or a FIFO). BadSlotFile or OSError when it cannot."""
    f, st = open_regular(path)
    with f:
        size = st.st_size
        head = f.read(12)
        if len(head) < 12:
            raise BadSlotFile(f"{path}: {len(head)} bytes, too short for a slot file")
        _, _, n_words = struct.unpack("<III", head)
        if 12 + 4 * n_words > size:
            raise BadSlotFile(f"{path}: header claims {n_words:,} words, more than the file's {size:,} bytes hold")
        bound = max_words(max_tokens)
        if bound is not None and n_words > bound:
            raise BadSlotFile(f"{path}: header claims {n_words:,} words, more than {max_tokens:,} tokens take (the "
                              f"engine's context): not read")
        return parse_header(head + f.read(4 * n_words), size, max_tokens)


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
        """fingerprint() read back; None for anything else (metadata written by hand, or older).
        Cached: every turn that restores asks it of the file's metadata."""
        return _layout_of(cls, text) if isinstance(text, str) else None

    @classmethod
    def _parse(cls, text: str) -> "KVLayout | None":
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
    f, st = open_regular(path)
    with f:
        size = st.st_size
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


def state_end(path: str | Path, n_blocks: int) -> int | None:
    """Where the file's KV state ends by its own fields (b11434: llama_kv_cache::state_write,
    one block per KV cache: 1, or 2 for a sliding-window model's base and SWA caches), or None
    when its fields are not what this reader understands (another architecture: cells with
    extensions, layers without V). A value past the file's size means the file is short:
    llama-server would abort on it (GGML_ASSERT(nread <= state_size)); shorter means padding
    after the state, which the engine ignores. Reads the small fields only, seeking over data.

    Per block: u32 n_stream; per stream u32 cell_count, and for a stream with cells: per cell
    i32 pos, u32 n_seq_id, n_seq_id × i32; then u32 v_trans, u32 n_layer, u32 n_rot_k, u32
    n_rot_v; K per layer: i32 type, u64 row, cells × row bytes; V per layer: not transposed
    i32 type, u64 row, cells × row; transposed i32 type, u32 element size, u32 n_embd, n_embd ×
    cells × element size."""
    f, st = open_regular(path)
    size = st.st_size
    with f:

        def u32() -> int:
            b = f.read(4)
            if len(b) != 4:
                raise EOFError
            return struct.unpack("<I", b)[0]

        def skip(n: int) -> None:
            f.seek(f.tell() + n)

        try:
            magic, version, n_words = struct.unpack("<III", f.read(12))
        except struct.error:
            return None
        if magic != MAGIC or version != VERSION:
            return None
        skip(4 * n_words)
        for _ in range(n_blocks):
            try:
                n_stream = u32()
                if not 0 < n_stream <= 4096:
                    return None
                for _ in range(n_stream):
                    cells = u32()
                    if not cells:
                        continue
                    if cells > 1 << 26:
                        return None
                    for _ in range(cells):
                        _pos, n_seq = struct.unpack("<iI", f.read(8))
                        if n_seq != 1:
                            return None  # a single sequence's save has one per cell; anything else: not understood
                        skip(4)
                    v_trans, n_layer, _rk, _rv = (u32() for _ in range(4))
                    if v_trans > 1 or not 0 < n_layer <= 4096:
                        return None
                    for _ in range(n_layer):
                        k_type, row = struct.unpack("<iQ", f.read(12))
                        if not 0 <= k_type < 64 or row == 0:
                            return None
                        skip(cells * row)
                    for _ in range(n_layer):
                        v_type = struct.unpack("<i", f.read(4))[0]
                        if not 0 <= v_type < 64:
                            return None
                        if v_trans:
                            el, n_embd = u32(), u32()
                            skip(n_embd * cells * el)
                        else:
                            skip(cells * struct.unpack("<Q", f.read(8))[0])
                    if f.tell() > size:
                        return f.tell()  # its data runs past the end: short
            except (EOFError, struct.error):
                return size + 1  # a field the state needs is past the end: short
        return f.tell()


@functools.lru_cache(maxsize=256)
def _layout_of(cls: type, text: str) -> KVLayout | None:
    return cls._parse(text)


# -- a header's tokens as the token index keeps them (index.py) ---------------------------
def encode(tokens: Sequence[int]) -> bytes:
    """A token list as the header stores it: little-endian int32. ValueError naming what was wrong."""
    if isinstance(tokens, (bytes, bytearray, str)):
        raise ValueError(f"tokens must be a list of integers, got {type(tokens).__name__}")
    try:
        a = array("i", tokens)
    except (TypeError, OverflowError) as e:
        bad = next((t for t in tokens if not isinstance(t, int) or isinstance(t, bool)
                    or not -2**31 <= t < 2**31), None)
        raise ValueError(f"tokens must be 32-bit integers, got {bad!r}: {e}") from None
    if a.itemsize != 4:  # pragma: no cover - every platform CPython runs on has a 4-byte int
        a = array("l", tokens)
    if sys.byteorder == "big":  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def comparable(tokens: Sequence[int]) -> Sequence[int]:
    """The part of a file's token list a text prompt can share: up to the first media
    placeholder (the engine marks an image's positions with -1 and compares media by
    their own ids, which a header does not tell us)."""
    return tokens[:tokens.index(TOKEN_NULL)] if TOKEN_NULL in tokens else tokens
