"""What autosessd calls things in the session directory, and what an auto file's metadata says.

    auto-<16 hex>.bin / .json   autosessd's own session files and their metadata (Meta)
    .autosessd-*.partial        its temporaries: a save, a download, a removal under way
    .autosessd-quarantine/      files and blocks that failed a check before a restore, with why
    anything else               a person's: never touched (a parked NAME.bin is one)

The store (directory.py) does the I/O; this module only names and parses, and gives the
modes the files get. Everything here is imported from directory.py as well, which is where
the rest of the code reads it from.
"""

from __future__ import annotations

import base64
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from ..base.files import Ident

AUTO_BIN = re.compile(r"^auto-([0-9a-f]{16})\.bin$")
AUTO_META = re.compile(r"^auto-([0-9a-f]{16})\.json$")
TEMP_PREFIX = ".autosessd-"
# Files and blocks that failed a check before a restore are moved here, with a note of why:
# never indexed or restored, listed by status and ls, kept a week for a person to look at (and
# removed with a forgotten conversation they belonged to).
QUARANTINE = ".autosessd-quarantine"
QUARANTINE_KEEP_S = 7 * 86400  # what quarantine holds is there for a person to look at for a week, then pruned
MANUAL_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")


class StoreError(Exception):
    pass


class Unfinished(OSError):
    """A finalize that failed after it read its bytes' digest (Store.finalize): the next try
    copies the bytes from where this one left them and checks them against `digest`."""

    def __init__(self, cause: OSError, digest: str):
        super().__init__(cause.errno, cause.strerror or str(cause), cause.filename)
        self.digest = digest


class InUse(StoreError):
    """install(): someone else holds the name (a save, a restore or another download)."""


class NewerHere(StoreError):
    """install(): a local save at least as new as the one offered is in place; it stays."""


def auto_name(key: str) -> str:
    return f"auto-{key}.bin"


def meta_name(key: str) -> str:
    return f"auto-{key}.json"


def temp_name(key: str) -> str:
    return f"{TEMP_PREFIX}{key}.partial"


def manual_name(name: str) -> str:
    """A person's name for a parked session → the file name, or StoreError saying why not.

    Limited to [A-Za-z0-9._-], no leading dot, never a path; `.bin` is added when missing;
    `auto-<16 hex>` is reserved for automatic files (prune would remove it)."""
    if not isinstance(name, str) or not name:
        raise StoreError("name is empty")
    if "/" in name or "\x00" in name or name in (".", ".."):
        raise StoreError(f"name {name[:64]!r} is a path; give a bare name of letters, digits, '.', '_' or '-'")
    if not MANUAL_NAME.match(name):
        raise StoreError(f"name {name[:64]!r} is not allowed: use 1-128 of A-Z a-z 0-9 . _ - and no leading dot")
    file = name if name.endswith(".bin") else f"{name}.bin"
    if AUTO_BIN.match(file):
        raise StoreError(f"name {name!r} is reserved for automatic sessions")
    return file


@dataclass(frozen=True)
class Mark:
    """A message boundary of a file's tokens (issue 23): its first n_tokens tokens came from the
    request options and first n_messages messages whose keys.chain digest is `chain`. A save
    records the prompt of the request that made its state (those tokens exactly: the engine's
    own count of that prompt), so a request with those very messages has exactly those tokens,
    and one whose messages begin with them starts with them: no need to ask the engine.

    exact False: only the second holds (marks of that kind, from earlier versions' reply checks,
    may still be in an index cache; none are made now)."""

    n_messages: int
    n_tokens: int
    chain: str
    exact: bool = True

    def to_list(self) -> list:
        return [self.n_messages, self.n_tokens, self.chain] + ([] if self.exact else [0])

    def to_text(self) -> str:
        return f"{self.n_messages}:{self.n_tokens}:{self.chain}"

    @classmethod
    def from_list(cls, v: object) -> "Mark | None":
        """A mark as metadata holds it, or None for anything else (never raises)."""
        if isinstance(v, str):
            v = v.split(":")
            if len(v) != 3 or not all(v) or not v[0].isdigit() or not v[1].isdigit():
                return None
            v = [int(v[0]), int(v[1]), v[2]]
        if not isinstance(v, (list, tuple)) or len(v) not in (3, 4) or (len(v) == 4 and v[3] != 0):
            return None
        k, n, h = v[:3]
        if type(k) is not int or type(n) is not int or k < 1 or n < 1 or not isinstance(h, str) \
                or not CHAIN_RE.match(h):
            return None
        return cls(k, n, h, len(v) == 3)


CHAIN_RE = re.compile(r"^[0-9a-f]{16}$")
# A block's key (blocks.chain): it names a file under blocks/, so nothing else ever passes for one
# (a "/" or ".." from a manifest someone edited would leave the directory).
BLOCK_KEY_RE = re.compile(r"\A[0-9a-f]{32}\Z")


def marks_from(v: object) -> tuple[Mark, ...]:
    """Metadata's marks (a JSON list, or the bucket's "k:n:chain;…" text); () for anything else."""
    if isinstance(v, str):
        v = v.split(";") if v else []
    if not isinstance(v, list) or len(v) > 64:
        return ()
    marks = tuple(m for m in (Mark.from_list(x) for x in v) if m is not None)
    return marks if len(marks) == len(v) else ()


@dataclass(frozen=True)
class Meta:
    key: str  # the file's: auto-<key>.bin
    n_tokens: int
    bytes: int
    saved_at: float
    model: str
    save_ms: float
    layout: str | None = None  # slotfile.KVLayout.fingerprint(): the KV streams, cache types, layers
    # The conversation's line: the key of its first user message. It names the file too,
    # unless the conversation departs from another one of the same line (branches.save_key:
    # the file is then a branch, auto-<branch key>.bin). None: a prefix, or older metadata.
    line: str | None = None
    # Of n_tokens, how many were the prompt the last reply was generated from (None: not known).
    n_prompt: int | None = None
    # A shared prefix (a system prompt and tools, read on its own before a new conversation):
    # no conversation of its own, restored for any request that starts with it.
    prefix: bool = False
    # The host whose save it is, for a file downloaded from the shared bucket (shared/);
    # None: saved here. A restart uploads only this host's own saves (and never re-uploads
    # what the bucket prune removed from another host's).
    host: str | None = None
    # files.DIGEST of the whole .bin ("xxh3-128:<hex>"), taken at finalize or while a download
    # arrived; None in metadata written before it existed (then only the size is checked).
    digest: str | None = None
    # The .bin's identity when the digest was last checked: the same one needs no new check.
    ident: Ident | None = None
    # Where its tokens came from, by messages (Mark): a return to the conversation is matched
    # by them without asking the engine for its tokens. (): not known (older metadata, a
    # prefix, a state no request of ours made).
    marks: tuple[Mark, ...] = ()
    # Kept as token blocks (store/blocks.py, issue 39): its blocks ((key, cells, digest) each, in
    # position order), its KV's shape (kvfile.Shape.to_json) and its tokens (little-endian int32):
    # the metadata is then the manifest the file is assembled from, and auto-<key>.bin, when
    # there is one, only a copy kept for a quick return (its bytes are `bytes`, its digest
    # `digest`). (): a whole file; `whole` may say why it could not be cut.
    blocks: tuple[tuple[str, int, str], ...] = ()
    kv: dict | None = None
    tokens: bytes | None = None
    whole: str | None = None
    # The file's tail (kvfile.py: a window model's window cells, a hybrid's recurrent state),
    # kept as a block of its own: (key, bytes, digest). With one, the file is restored whole only.
    tail: tuple[str, int, str] | None = None

    @classmethod
    def from_json(cls, data: bytes) -> "Meta":
        d = json.loads(data)
        layout, line, n_prompt, digest = d.get("layout"), d.get("line"), d.get("n_prompt"), d.get("digest")
        return cls(key=str(d["key"]), n_tokens=int(d["n_tokens"]), bytes=int(d["bytes"]),
                   saved_at=float(d["saved_at"]), model=str(d["model"]), save_ms=float(d.get("save_ms", 0.0)),
                   layout=layout if isinstance(layout, str) else None,
                   line=str(line) if line is not None else None,
                   n_prompt=int(n_prompt) if n_prompt is not None else None, prefix=bool(d.get("prefix", False)),
                   host=str(d["host"]) if d.get("host") is not None else None,
                   digest=digest if isinstance(digest, str) else None, ident=Ident.from_list(d.get("ident")),
                   marks=marks_from(d.get("marks")), blocks=_blocks_from(d.get("blocks")),
                   kv=d["kv"] if isinstance(d.get("kv"), dict) else None,
                   tokens=base64.b64decode(d["tokens"], validate=True) if isinstance(d.get("tokens"), str) else None,
                   whole=str(d["whole"]) if d.get("whole") is not None else None, tail=_tail_from(d.get("tail")))

    def to_json(self) -> bytes:
        d = asdict(self)
        for k in ("host", "digest", "ident"):
            if d[k] is None:
                del d[k]  # absent, as in metadata written before these existed
        if self.ident is not None:
            d["ident"] = self.ident.to_list()
        if self.marks:
            d["marks"] = [m.to_list() for m in self.marks]
        else:
            del d["marks"]
        for k in ("blocks", "kv", "tokens", "whole", "tail"):
            if not d[k]:
                del d[k]  # a whole file's metadata, as before the block store
        if self.blocks:
            d["blocks"] = [list(b) for b in self.blocks]
        if self.tail:
            d["tail"] = list(self.tail)
        if self.tokens is not None:
            d["tokens"] = base64.b64encode(self.tokens).decode()
        return json.dumps(d, sort_keys=True).encode() + b"\n"

    @property
    def in_blocks(self) -> bool:
        """Kept as token blocks: its .bin, if any, is a copy that may go at any time."""
        return bool(self.blocks) and self.kv is not None and self.tokens is not None

    @property
    def n_cells(self) -> int:
        return sum(b[1] for b in self.blocks)

    @property
    def block_keys(self) -> tuple[str, ...]:
        """Every block a manifest names: its blocks', and its tail's (none for a whole file)."""
        if not self.in_blocks:
            return ()
        return tuple(b[0] for b in self.blocks) + ((self.tail[0],) if self.tail else ())


def _tail_from(v: object) -> tuple[str, int, str] | None:
    if v is None:
        return None
    if not (isinstance(v, list) and len(v) == 3 and isinstance(v[0], str) and BLOCK_KEY_RE.match(v[0])
            and type(v[1]) is int and v[1] > 0 and isinstance(v[2], str)):
        raise ValueError(f"tail: not a tail reference: {v!r}")
    return (v[0], v[1], v[2])


def _blocks_from(v: object) -> tuple[tuple[str, int, str], ...]:
    """A manifest's blocks as metadata holds them; ValueError for anything else."""
    if v is None:
        return ()
    if not isinstance(v, list):
        raise ValueError("blocks: not a list")
    out = []
    for b in v:
        if not (isinstance(b, list) and len(b) == 3 and isinstance(b[0], str) and BLOCK_KEY_RE.match(b[0])
                and type(b[1]) is int and b[1] > 0 and isinstance(b[2], str)):
            raise ValueError(f"blocks: not a block reference: {b!r}")
        out.append((b[0], b[1], b[2]))
    return tuple(out)


# Every file autosessd makes visible holds a conversation: its owner's only (0640 with control.group).
FILE_MODE = 0o600
GROUP_FILE_MODE = 0o640


def fsync_dir(path: Path) -> None:
    """A rename or an unlink in `path` made durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
