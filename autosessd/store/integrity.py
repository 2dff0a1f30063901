"""Whether a session file is still the one saved, before the engine reads it (directory.py's
docstring: "Before a restore"), and the quarantine that moves a bad one aside with a note of
why. Store (directory.py) is this class and the directory; the attributes declared below
are Store's own, and its lock is taken here only as Store takes it: for a look and a rename.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path

from ..base import files
from ..base.files import Ident
from . import slotfile
from .names import AUTO_BIN, FILE_MODE, QUARANTINE, Meta, fsync_dir

log = logging.getLogger("autosessd")

NEEDS_READ = "the file must be read to be checked"  # Store.check_whole(stat_only=True): not decided


class Integrity:
    """Store's integrity half (see the module's docstring)."""

    path: Path
    _lock: threading.RLock
    _checked: dict[str, tuple[Ident, str]]

    def meta_path(self, key: str) -> Path: ...  # Store's
    def _meta_at(self, path: Path) -> Meta | None: ...  # Store's

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
