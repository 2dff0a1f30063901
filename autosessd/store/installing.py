"""Store's installs: a save made elsewhere (a download from the shared tier: a whole file, or the
engine's file written from a manifest's blocks) put in place under its name as a local finalize would, after
the store's last look that nobody holds the name and no local save as new landed meanwhile."""

from __future__ import annotations

import os
import threading
import uuid
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from ..base import files
from ..base.files import Ident
from .names import TEMP_PREFIX, InUse, Meta, NewerHere, auto_name, fsync_dir


class Installing:
    """Store's installs (see the module's docstring)."""

    path: Path
    in_use: Counter[str]
    _lock: threading.RLock
    _checked: dict[str, tuple[Ident, str]]

    if TYPE_CHECKING:  # Store's and Saving's own
        def read_meta(self, key: str) -> Meta | None: ...
        def meta_path(self, key: str) -> Path: ...
        def _named(self, key: str, meta: Meta | None) -> tuple[str, ...]: ...
        def _meta_temp(self, meta: Meta, tmp: Path) -> tuple[int, bytes]: ...
        def _remember_meta(self, key: str, written: tuple[int, bytes]) -> None: ...

        @staticmethod
        def _unlink(path: Path) -> bool: ...

    def install(self, temp: Path, name: str, meta: Meta | None, *, claimed: bool) -> None:
        """Put `temp` (in this directory, whole and fsynced: a download from the shared tier)
        in place as `name`, with `meta` as its metadata, as finalize does for a local save.
        name is auto-<meta.key>.bin, or a parked name with meta None. Blocking.

        Refused, with nothing under the name changed (the caller removes temp):
          InUse      someone else holds the name: in_use counts more than the caller's own
                     (claimed: the caller holds one count itself, else none)
          NewerHere  meta given, and auto-<meta.key>.bin has metadata at least as new
                     (saved_at): a local save finalized meanwhile is kept
        Both are judged under _lock, in the same section as the renames: no acquire() and
        no other install comes between the look and the renames. A local save holds
        acquire(final) from before its finalize, so one finalizing now is refused (InUse),
        and one that acquires later finalizes after both renames are done.

        Order: the metadata to a temporary of its own, fsynced (no lock); under _lock: the
        look, rename temp → name, rename the metadata; then fsync the directory (no lock).
        A crash before that fsync leaves the old pair, the new pair, or the new .bin with
        the old metadata (a journaling filesystem keeps two renames in one directory in
        order), as a crash inside finalize does: a .bin whose metadata is missing or
        disagrees (key, bytes) is treated as absent by every reader and removed by
        cleanup() at start, with the temporaries. No torn .bin: temp was whole before."""
        if meta is not None and name != auto_name(meta.key):
            raise ValueError(f"install: {name} is not the file of {meta.key}'s metadata")
        if Path(name).name != name or name.startswith("."):
            raise ValueError(f"install: {name!r} is not a bare file name")
        final = self.path / name
        meta_tmp = None
        if meta is not None:
            meta_tmp = self.path / f"{TEMP_PREFIX}{meta.key}.{uuid.uuid4().hex[:8]}.install.json.partial"
            written = self._meta_temp(meta, meta_tmp)
        try:
            with self._lock:
                if self.in_use.get(name, 0) > (1 if claimed else 0):
                    raise InUse(f"{name} is being written or read")
                local = self.read_meta(meta.key) if meta is not None else None
                if local is not None and local.saved_at >= meta.saved_at:
                    raise NewerHere(f"{name}: the local save (saved_at {local.saved_at:.3f}) is as new")
                os.replace(temp, final)
                if meta_tmp is not None:
                    os.replace(meta_tmp, self.meta_path(meta.key))
                    meta_tmp = None
                    self._remember_meta(meta.key, written)
                    self._named(meta.key, meta)  # its blocks named (none: a whole file, where a manifest was)
                    now = files.regular_ident(final)
                    if meta.digest is not None and now is not None:
                        # The rename moved the ctime the metadata recorded: checked as it arrived.
                        self._checked[name] = (now, meta.digest)
        finally:
            if meta_tmp is not None:
                self._unlink(meta_tmp)
        fsync_dir(self.path)

