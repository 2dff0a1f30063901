"""What the token index knows of each file (Entry: its tokens, its model, its identity, its
marks), and the index's cache file, which lets a start stat thousands of files instead of
reading every header again. The cache is written atomically (a temporary, fsync, rename) and
owner-only (it holds every conversation's tokens); one that is damaged, of another version or
for another directory is not used, and says why."""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..base.files import read_small
from .names import Mark, Meta, auto_name, marks_from
from .runs import decode
from .slotfile import comparable, encode

# Cache file layout: MAGIC, u32 version, u32 length of a JSON description, the JSON, every
# entry's token bytes one after another, u32 crc32 of all that precedes it.
CACHE_MAGIC = b"autosessd-index\n"
CACHE_VERSION = 2  # 2: each entry carries its file's marks (issue 23)
CACHE_MAX = 1 << 30  # the cache holds every file's comparable tokens: 1 GiB is ~250 M tokens

Ident = tuple[int, int, int]  # (inode, mtime_ns, size)


@dataclass(frozen=True)
class Entry:
    name: str
    model: str | None  # fingerprint of the model it was written for; None: not known
    n_tokens: int  # as the header says (media placeholders included)
    tokens: bytes  # encoded; the comparable part only
    ident: Ident | None  # of the .bin, when indexed from the disk
    meta_ident: Ident | None = None  # of auto-<key>.json, when it had one
    marks: tuple[Mark, ...] = ()  # its metadata's: where its tokens came from, by messages

    def token_list(self) -> list[int]:
        return decode(self.tokens)


def check_name(name: str) -> str:
    """A bare, final session file name, or ValueError: the index never reads temporaries
    (dot names) and never a path."""
    if not isinstance(name, str) or not name.endswith(".bin") or "/" in name or "\x00" in name \
            or name.startswith("."):
        raise ValueError(f"{name!r} is not a session file name (a bare *.bin name, no leading dot)")
    return name


def fitting(marks: tuple[Mark, ...], tokens: bytes) -> tuple[Mark, ...]:
    """The marks a file's tokens can back: none past its comparable tokens (a media placeholder
    ends them), none that claims more."""
    n = len(tokens) // 4
    return tuple(m for m in marks if m.n_tokens <= n)


def manifest_entry(directory: Path, name: str, meta_ident: Ident) -> Entry | None:
    """The entry of a manifest (issue 39: a conversation kept as token blocks, its tokens in its
    metadata), known by the manifest's identity (ident == meta_ident); None for a whole file's
    metadata."""
    meta = Meta.from_json(read_small(directory / (name[:-4] + ".json")))
    if not meta.in_blocks or auto_name(meta.key) != name:
        return None
    tokens = encode(comparable(decode(meta.tokens or b"")))
    return Entry(name=name, model=meta.model, n_tokens=meta.n_tokens, tokens=tokens, ident=meta_ident,
                 meta_ident=meta_ident, marks=fitting(meta.marks, tokens))


def is_manifest(directory: Path, name: str) -> bool:
    """auto-<key>.json of `name` is a manifest (its .bin, if any, only a copy)."""
    try:
        return Meta.from_json(read_small(directory / (name[:-4] + ".json"))).in_blocks
    except (OSError, ValueError, KeyError, TypeError):
        return False


def write_cache(path: Path, directory: Path, entries: list[Entry]) -> None:
    """The cache at `path` for the index of `directory`, replaced atomically. Raises OSError."""
    dst = os.stat(directory)
    desc = {"dir": str(directory.resolve()), "dev": dst.st_dev, "ino": dst.st_ino,
            "entries": [[e.name, e.model, e.n_tokens, len(e.tokens) // 4, list(e.ident or (0, 0, 0)),
                         list(e.meta_ident) if e.meta_ident else None, [m.to_list() for m in e.marks]]
                        for e in entries]}
    head = json.dumps(desc, separators=(",", ":")).encode()
    body = CACHE_MAGIC + struct.pack("<II", CACHE_VERSION, len(head)) + head
    crc = zlib.crc32(body)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.unlink()  # O_CREAT keeps an existing file's mode: start from none
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(body)
            for e in entries:
                f.write(e.tokens)
                crc = zlib.crc32(e.tokens, crc)
            f.write(struct.pack("<I", crc))
            f.flush()
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_cache(path: Path, directory: Path) -> tuple[dict[str, Entry], str]:
    """(entries, "loaded") or ({}, why the cache was not used)."""
    try:
        data = read_small(path, CACHE_MAX)
    except FileNotFoundError:
        return {}, "none"
    except OSError as e:
        return {}, f"unreadable: {e.strerror or e}"
    try:
        if not data.startswith(CACHE_MAGIC) or len(data) < len(CACHE_MAGIC) + 12:
            return {}, "not an index cache"
        version, n_head = struct.unpack_from("<II", data, len(CACHE_MAGIC))
        if version != CACHE_VERSION:
            return {}, f"version {version}, this code reads {CACHE_VERSION}"
        (crc,) = struct.unpack_from("<I", data, len(data) - 4)
        if zlib.crc32(memoryview(data)[:-4]) != crc:
            return {}, "damaged (checksum)"
        at = len(CACHE_MAGIC) + 8
        desc = json.loads(data[at:at + n_head])
        dst = os.stat(directory)
        if (desc["dir"], desc["dev"], desc["ino"]) != (str(directory.resolve()), dst.st_dev, dst.st_ino):
            return {}, f"for another directory ({desc['dir']})"
        at += n_head
        entries = {}
        for name, model, n_tokens, n_cmp, ident, meta_ident, marks in desc["entries"]:
            tokens = data[at:at + 4 * n_cmp]
            at += 4 * n_cmp
            entries[check_name(name)] = Entry(name, model, int(n_tokens), tokens, tuple(ident),
                                              tuple(meta_ident) if meta_ident else None,
                                              fitting(marks_from(marks), tokens))
        if at != len(data) - 4:
            return {}, "damaged (length)"
        return entries, "loaded"
    except (ValueError, KeyError, TypeError, struct.error, OSError) as e:
        return {}, f"damaged ({e})"
