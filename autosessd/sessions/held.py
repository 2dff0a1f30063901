"""What each slot held last (held.json in the state directory), for the restore after a
restart (the tail's by key, the engine log's by file) and at a start (issue 33: after a
reboot of the engine and autosessd, each slot's last conversation is back before its first
request).

One record, the Recorder's entries: per slot, the conversation it held last in a file of its
own (its key, that file, and when the entry was made). An entry changes only when a slot's
conversation or its file does (a request's end that changes neither writes nothing), and at
the stop, which records the slots as they are then over what each held last. Every write is
the same: the whole record to a temporary, fsynced, renamed, the directory fsynced, so a
crash leaves the old record or the new one (a temporary a crash left is removed at the next
open). A record of another model, or one that cannot be read, is as good as none. Nothing is
written after the stop's record. `autosessctl forget` drops what names the conversation.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ..base.files import read_small
from ..store.names import AUTO_BIN
from .slot import Phase, Slot

if TYPE_CHECKING:
    from ..store.index import TokenIndex

log = logging.getLogger("autosessd")


def file_name(model: str | None = None) -> str:
    """held.json; behind a router, held-<digest of the model>.json: one per model, so that a
    model's record never overwrites another's."""
    return "held.json" if model is None else f"held-{hashlib.sha256(model.encode()).hexdigest()[:16]}.json"


def _write(path: Path, data: dict[str, Any]) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)  # 0600, its own
        tmp = Path(name)
        try:
            try:
                os.write(fd, json.dumps(data).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return True
    except OSError as e:
        log.warning("auto sessions: could not record the held conversations in %s: %s", path, e)
        return False


def forget_everywhere(state_dir: Path, keys: set[str], names: set[str]) -> None:
    """Every held record in state_dir (each model's, behind a router: also those of models not
    loaded now) rid of the entries naming one of `keys` or `names` (autosessctl forget)."""
    for path in sorted(state_dir.glob("held*.json")):
        try:
            data = json.loads(read_small(path))
            slots = data.get("slots", {})
            kept = {k: v for k, v in slots.items()
                    if not (isinstance(v, dict) and (v.get("key") in keys or v.get("file") in names))}
        except (OSError, ValueError, AttributeError):
            continue
        if kept != slots:
            _write(path, {**data, "slots": kept})


class Recorder:
    """held.json kept as the slots change: slot.py's one writer calls changed() on every
    transition, and a slot that holds a conversation in a file (held or restored, its file
    known) replaces its entry; a slot that runs a request, lost its state or is empty keeps
    its last one (what it held last is what a restart restores). Written off the loop, at most
    once per FLUSH_S, only when an entry changed."""

    FLUSH_S = 0.05

    def __init__(self, path: Path, model: str, slots: dict[int, Slot] | None = None):
        """slots: told to call changed() on every transition."""
        self.path = path
        self.model = model
        self.entries: dict[int, dict[str, Any]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._writing: asyncio.Future | None = None
        self._dirty = False
        self._stopped = False  # the stop's record is written: nothing after it replaces it
        for left in path.parent.glob(f"{path.name}.*.tmp"):  # a write a crash cut short (_write's mkstemp)
            left.unlink(missing_ok=True)
        try:
            data = json.loads(read_small(path))
            if data.get("model") == model:
                self.entries = {int(k): {"key": str(v["key"]), "file": v.get("file"), "at": float(v.get("at") or 0)}
                                for k, v in data.get("slots", {}).items() if isinstance(v, dict) and v.get("key")}
        except (OSError, ValueError, TypeError, AttributeError, KeyError):
            pass
        for sl in (slots or {}).values():
            sl.on_change = self.changed

    # -- what the inputs ask ------------------------------------------------------------------
    async def record_stop(self, slots: Iterable[Slot]) -> None:
        """At a stop: the slots as they are now, over what each held last; after the write in
        flight, if any, and instead of the one waiting (an older record never lands after it).
        The last write: nothing after it replaces it."""
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._dirty = False
        if self._writing is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._writing)
        now = round(time.time(), 3)
        self.entries.update({s.id: {"key": s.view.key, "file": s.view.file, "at": now}
                             for s in slots if s.view.key and s.view.phase is not Phase.UNKNOWN})
        _write(self.path, self._data())

    def keys(self) -> dict[int, str]:
        """slot → the conversation it held last (the tail's restore, by key)."""
        return {slot: e["key"] for slot, e in self.entries.items()}

    def plan(self, slots: Iterable[int], index: TokenIndex | None = None) -> list[tuple[int, str, str]]:
        """(slot, key, file) to put back after a restart or at a start: each of `slots` whose
        last conversation is in an auto file, the most recently used first, each file once, and
        none whose tokens another chosen one extends (the engine places a request on the slot
        that shares most with it; index: what the files hold, where known)."""
        chosen: list[tuple[int, str, str, bytes | None]] = []
        have = set(slots)
        for slot, e in self.last():
            name = e.get("file")
            if slot not in have or not isinstance(name, str) or not AUTO_BIN.match(name):
                continue
            entry = index.get(name) if index is not None else None
            tokens = entry.tokens if entry is not None else None
            if any(n == name or (tokens is not None and t is not None and t.startswith(tokens))
                   for _, _, n, t in chosen):
                continue
            chosen.append((slot, e["key"], name, tokens))
        return [(slot, key, name) for slot, key, name, _ in chosen]

    def forget(self, key: str, names: Iterable[str] = ()) -> None:
        """Conversation `key` forgotten: no entry names it, or a file of it, any more."""
        gone = set(names)
        drop = [slot for slot, e in self.entries.items() if e.get("key") == key or e.get("file") in gone]
        for slot in drop:
            del self.entries[slot]
        if drop:
            self._schedule()

    def last(self) -> list[tuple[int, dict[str, Any]]]:
        """(slot, entry) of every slot's last conversation, the most recently used first."""
        return sorted(self.entries.items(), key=lambda kv: -float(kv[1].get("at") or 0))

    # -- keeping it ----------------------------------------------------------------------------
    def changed(self, s: Slot) -> None:
        v = s.view
        if v.phase not in (Phase.HELD, Phase.RESTORED) or not v.key:
            return
        old = self.entries.get(s.id)
        if not v.file:
            # A conversation in no file of its own (a new one; one that went on from another's
            # file or a prefix, which its view does not call its own): nothing to put back.
            if old is not None:
                del self.entries[s.id]
                self._schedule()
            return
        if old is not None and (old.get("key"), old.get("file")) == (v.key, v.file):
            return  # the same conversation in the same file: nothing a restart needs changed
        self.entries[s.id] = {"key": v.key, "file": v.file, "at": round(time.time(), 3)}
        self._schedule()

    def _data(self) -> dict[str, Any]:
        return {"model": self.model, "slots": {str(k): dict(v) for k, v in sorted(self.entries.items())}}

    def _schedule(self) -> None:
        if self._stopped:
            return  # a change after the stop's record (a slot closed down) never replaces it
        self._dirty = True
        if self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(self.FLUSH_S, self._flush)
            except RuntimeError:  # no loop (a test calling it directly): now
                self._dirty = False
                _write(self.path, self._data())

    def _flush(self) -> None:
        self._timer = None
        if not self._dirty or (self._writing is not None and not self._writing.done()):
            if self._dirty:  # a write is under way: once more after it
                self._timer = asyncio.get_running_loop().call_later(self.FLUSH_S, self._flush)
            return
        self._dirty = False
        self._writing = asyncio.get_running_loop().run_in_executor(None, _write, self.path, self._data())
