"""Whether a session file is still the one saved, before the engine reads it (directory.py's
docstring: "Before a restore"), the quarantine that moves a bad one aside with a note of why,
and what a block found damaged does to the manifests naming it (cut back to before it). Store (directory.py) is this class and the directory; the attributes declared below
are Store's own, and its lock is taken here only as Store takes it: for a look and a rename.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from ..base import files
from ..base.files import Ident
from . import cutting, slotfile
from .kvfile import Shape
from .names import AUTO_BIN, FILE_MODE, QUARANTINE, Meta, StoreError, auto_name, fsync_dir

if TYPE_CHECKING:
    from .blocks import BlockStore
    from .staging import Staging

log = logging.getLogger("autosessd")

NEEDS_READ = "the file must be read to be checked"  # Store.check_whole(stat_only=True): not decided


class Integrity:
    """Store's integrity half (see the module's docstring)."""

    path: Path
    blocks: BlockStore | None
    hot: Staging
    _lock: threading.RLock
    _checked: dict[str, tuple[Ident, str]]

    def meta_path(self, key: str) -> Path: ...  # Store's
    def _meta_at(self, path: Path) -> Meta | None: ...  # Store's

    if TYPE_CHECKING:  # Saving's own: a stub here would come before it in Store's MRO
        def _replace_meta(self, meta: Meta | None, ident0: Ident | None, key: str | None = None,
                          held_ok: bool = False) -> bool: ...

    def check_whole(self, name: str, n_blocks: int | None = None, stat_only: bool = False,
                    ident: Ident | None = None) -> str | None:
        """None when `name` may be handed to the engine: the file it was when saved or
        downloaded. Otherwise why not (the caller quarantines it). Auto files: a regular
        file whose size is its metadata's, and whose digest is checked again when its
        identity changed since the last check (blocking then: seconds for a multi-GB file,
        run it in a thread). People's files, and auto files from before digests: a regular
        file, not shorter than its own KV fields say (slotfile.state_end, with n_blocks KV
        caches: 2 for a sliding-window model; None: not looked at).

        stat_only: decide only what a few lstats and the cached metadata decide (the common
        case: a file unchanged since it was saved or last checked), fast enough for the event
        loop; → NEEDS_READ when the file itself must be read (a digest, a person's file).
        ident: the file's lstat as the caller took it a moment ago (the restore's, whose
        quarantine moves only that file); None: not given, taken here."""
        path = self.path / name
        if ident is None:
            ident = files.regular_ident(path)
        if ident is None:
            return f"{name} is missing or not a regular file (a link, a FIFO?)"
        m = AUTO_BIN.match(name)
        if not m:
            return NEEDS_READ if stat_only and n_blocks is not None else self._short(path, ident, n_blocks)
        meta = self._meta_at(self.meta_path(m.group(1)))
        if meta is None or meta.key != m.group(1):
            return f"{name} has no valid metadata"
        if ident.size != meta.bytes:
            return f"{name} has {ident.size:,} bytes, {meta.bytes:,} were saved"
        if meta.digest is None:
            return NEEDS_READ if stat_only and n_blocks is not None else self._short(path, ident, n_blocks)
        if meta.ident == ident or self._checked.get(name) == (ident, meta.digest):
            return None
        if stat_only:
            return NEEDS_READ
        digest, now = files.digest_file(path)
        if digest != meta.digest:
            return f"{name}'s digest is {digest}, {meta.digest} was saved: its bytes changed"
        with self._lock:
            self._checked[name] = (now, digest)  # the next restore of the same file needs a stat only
        return None

    @staticmethod
    def _short(path: Path, ident: Ident, n_blocks: int | None) -> str | None:
        if n_blocks is None:
            return None
        try:
            end = slotfile.state_end(path, n_blocks)
        except OSError as e:
            return f"{path.name}: {e}"
        if end is not None and end > ident.size:
            return f"{path.name} has {ident.size:,} bytes, its own fields need {end:,}: it is cut short"
        return None

    # -- a block found damaged ---------------------------------------------
    def _bad_block(self, key: str, why: str, only: str | None = None) -> tuple[str, ...]:
        """A block found damaged (evidence about its own bytes): moved into quarantine with why,
        and each manifest naming it cut back to the blocks before it (those tokens are still
        restorable), or removed when it is the first. only: the block is whole, but not the bytes
        manifest `only` recorded (blocks.OtherBlock): that manifest alone is cut back, the block
        stays. → the names changed."""
        assert self.blocks is not None
        if only is not None:
            log.warning("auto sessions: %s cut back before block %s: %s", auto_name(only), key, why)
            with contextlib.suppress(StoreError, OSError):
                if self._cut_back(only, key):
                    return (auto_name(only),)
            return ()
        named_by = self.blocks.manifests_naming(key)
        moved = self.blocks.quarantine(key, why)
        log.warning("auto sessions: block %s moved aside%s: %s", key, f" to {QUARANTINE}/{moved}" if moved else "",
                    why)
        changed = []
        for m in named_by:
            with contextlib.suppress(StoreError, OSError):
                if self._cut_back(m, key):
                    changed.append(auto_name(m))
        return tuple(changed)

    def _cut_back(self, key: str, bad: str) -> bool:
        """Manifest `key` without block `bad` and those after it: rewritten with the blocks
        before it, or removed when there are none or it has a tail (the tail is the state at
        its last position only), unless it changed since it was read (a save landed: the next
        restore judges that one). Its copy in staging goes either way."""
        ident0 = files.regular_ident(self.meta_path(key))
        meta = self._meta_at(self.meta_path(key)) if ident0 is not None else None
        if meta is None or not meta.in_blocks:
            return False
        at = next((i for i, b in enumerate(meta.blocks) if b[0] == bad), None)
        if at is None and not (meta.tail and meta.tail[0] == bad):
            return False
        if self.hot.held(auto_name(key)):
            self.hot.drop_record(auto_name(key))  # a restore reads it now: it stays, unrecorded (no longer its save)
        else:
            self.hot.forget(auto_name(key))
        if at == 0 or meta.tail:  # a file with a tail is restorable at its last position only: nothing is left
            return self._replace_meta(None, ident0, key=key, held_ok=True)
        keep = meta.blocks[:at]
        n = sum(b[1] for b in keep)
        shape = Shape.from_json(meta.kv)
        # saved_at a little older: the save's whole copy in the shared bucket, when there is one,
        # is newer than what is left of it here (a download brings it back).
        cut = dataclasses.replace(meta, n_tokens=n, bytes=cutting.file_size(shape, n, n), blocks=keep,
                                  tokens=(meta.tokens or b"")[:4 * n], digest=None, ident=None,
                                  saved_at=meta.saved_at - 0.001,
                                  n_prompt=min(meta.n_prompt, n) if meta.n_prompt is not None else None,
                                  marks=tuple(m for m in meta.marks if m.n_tokens <= n))
        return self._replace_meta(cut, ident0, held_ok=True)

    # -- quarantine --------------------------------------------------------
    def quarantine(self, name: str, why: str, seen: Ident | None = None) -> str | None:
        """Move `name` (and an auto file's metadata) aside into QUARANTINE/, with a note of
        why. seen: the identity of the file judged bad; a file that changed since (a save
        finalized over it) is left in place. Returns the name it has there, or None when it
        was not moved. Blocking."""
        qdir = self.path / QUARANTINE
        qdir.mkdir(mode=0o700, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        dest = qdir / f"{name}.{stamp}.{uuid.uuid4().hex[:6]}"
        m = AUTO_BIN.match(name)
        with self._lock:
            now = files.regular_ident(self.path / name)
            if seen is not None and now != seen:
                return None
            try:
                os.rename(self.path / name, dest)  # a link moves as a link
            except FileNotFoundError:
                return None
            if m:
                with contextlib.suppress(FileNotFoundError):
                    os.rename(self.meta_path(m.group(1)), dest.with_name(dest.name + ".json"))
        note = json.dumps({"name": name, "why": why, "at": time.time(), "bytes": now.size if now else None})
        fd = os.open(dest.with_name(dest.name + ".why"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        with os.fdopen(fd, "w") as f:
            f.write(note + "\n")
        fsync_dir(self.path)
        log.warning("auto sessions: %s moved aside to %s/%s: %s", name, QUARANTINE, dest.name, why)
        return dest.name

    def forget_quarantined(self, keys: set[str]) -> int:
        """Whatever quarantine holds of the conversations `keys` (forget: nothing of them is
        left anywhere autosessd wrote): their files set aside, and the blocks their manifests
        named when found damaged. → bytes removed."""
        names = {f"auto-{k}.bin" for k in keys}
        freed = 0
        for q in self.quarantined():
            if q.get("name") in names or keys & set(q.get("named_by") or ()):
                freed += self._drop_quarantined(q["file"])
        return freed

    def prune_quarantine(self, max_age_s: float, now: float | None = None) -> int:
        """What quarantine has held longer than max_age_s, removed (it is there for a person to
        look at, not kept for ever). → bytes removed."""
        now = time.time() if now is None else now
        return sum(self._drop_quarantined(q["file"]) for q in self.quarantined()
                   if (q.get("at") or 0) < now - max_age_s)

    def _drop_quarantined(self, file: str) -> int:
        qdir = self.path / QUARANTINE
        if "/" in file or file.startswith("."):
            return 0
        freed = 0
        for p in (qdir / file, qdir / f"{file}.json", qdir / f"{file}.why"):
            try:
                size = p.lstat().st_size
                p.unlink()
                freed += size
            except FileNotFoundError:
                pass
        return freed

    def quarantined(self) -> list[dict]:
        """What quarantine() moved aside (files, and blocks found damaged: BlockStore.quarantine),
        newest first: name, why, at, bytes, and its name there."""
        out = []
        try:
            it = os.scandir(self.path / QUARANTINE)
        except (FileNotFoundError, NotADirectoryError):
            return []
        with it:
            for d in it:
                if d.name.endswith(".why"):
                    try:
                        note = json.loads(files.read_small(d.path, 64 * 1024))
                        out.append({**note, "file": d.name[:-4]})
                    except (OSError, ValueError):
                        continue
        return sorted(out, key=lambda r: r.get("at") or 0, reverse=True)
