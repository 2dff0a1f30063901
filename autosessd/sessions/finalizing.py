"""The session files as the finalizes in flight will make them (saves.py's other half).

A save returns to its caller as soon as its temporary checked out; its finalize (fsync,
rename, metadata) runs in a thread (issue 31). Until it lands, what it will make is a Pending,
and every decision reads a file's facts here, pending or final: the up-to-date check
(held_info), the naming by tokens (saved_file), the restore choice (pending_best), the KV
layout (loadable). What waits for finalizes waits here too: commands for a file on disk
(wait_file), a save for its temporary name (temp_free), the stop for all (settled). Saver
(saves.py) is this class and the save path; only it adds and removes a Pending.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..store import slotfile
from ..store.branches import SavedFile
from ..store.directory import AUTO_BIN, Meta, auto_name
from ..store.runs import common_prefix, swa_usable
from .policy import FileInfo

if TYPE_CHECKING:
    from .context import Context
    from .slot import View


@dataclass(frozen=True)
class Pending:
    """A save whose finalize (fsync, rename, metadata) runs in a thread: what it will make."""

    temp: str  # the temporary's key: the bytes are at .autosessd-<temp>.partial until the rename
    final: str  # the name it becomes
    meta: Meta | None  # an auto file's metadata as finalize writes it, less its digest; None: a person's name
    tokens: bytes | None  # its header's tokens (None: an engine whose files do not show them)
    ino: int  # the temporary's inode, as verified: a link is made only to that file
    fut: asyncio.Future


class Finalizing:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._finalizing: dict[str, Pending] = {}  # by the final file's key
        self._temps: dict[str, list] = {}  # temporary's key → [asyncio.Lock, users]

    # -- the files' facts --------------------------------------------------------------------
    def meta_of(self, name: str) -> Meta | None:
        """An auto file's metadata: a pending finalize's as it will be written, else the disk's."""
        m = AUTO_BIN.match(name)
        return self.read_meta(m.group(1)) if m else None

    def read_meta(self, key: str) -> Meta | None:
        """store.read_meta, or the metadata a finalize in flight will write for auto-<key>.bin."""
        p = self._finalizing.get(key)
        if p is not None and p.meta is not None and p.final == auto_name(key):
            return p.meta
        return self.ctx.store.read_meta(key)

    def pending(self, name: str) -> Pending | None:
        """The finalize in flight that will make `name`, if any."""
        m = AUTO_BIN.match(name)
        p = self._finalizing.get(m.group(1)) if m else None
        return p if p is not None and p.final == name else None

    def tokens_of(self, name: str) -> bytes | None:
        """The tokens a file holds (a pending one's as it will be), when known."""
        p = self.pending(name)
        if p is not None:
            return p.tokens
        e = self.ctx.index.get(name) if self.ctx.index is not None else None
        return e.tokens if e is not None else None

    def pending_best(self, tokens: bytes, model: str | None, found: tuple[str, int] | None, min_lcp: int,
                     window: int | None, prefer: str | None = None) -> tuple[str, int] | None:
        """index.best over the files being finalized too (the index learns a file once it is
        final): `found` (the index's choice among final files), or a pending file of `model`
        sharing more with `tokens` (min_lcp at least; on a tie, `prefer`), by the same rules."""
        for p in list(self._finalizing.values()):
            if p.meta is None or p.tokens is None or p.meta.model != model:
                continue
            n = common_prefix(p.tokens, tokens)
            if n < max(1, min_lcp) or not swa_usable(p.meta.n_tokens, n, window):
                continue
            if found is None or n > found[1] or (n == found[1] and p.final == prefer):
                found = (p.final, n)
        return found

    def file_info(self, key: str) -> FileInfo | None:
        meta = self.read_meta(key)
        if meta is None:
            return None
        return FileInfo(meta.n_tokens, meta.model, slotfile.KVLayout.from_fingerprint(meta.layout) if meta.layout
                        else None)

    def loadable(self, name: str, meta: Meta | None = None) -> bool:
        """Whether this engine can load the file, by the KV layout its metadata records (meta:
        the file's, when the caller read it already)."""
        meta = meta or self.meta_of(name)
        layout = slotfile.KVLayout.from_fingerprint(meta.layout) if meta is not None and meta.layout else None
        return layout is None or self.ctx.engine_layout is None or layout.compatible(self.ctx.engine_layout)

    def held_info(self, v: View) -> FileInfo | None:
        """The file holding the slot's conversation as last saved or restored (View.file), for
        plan_save's up-to-date check; None when it has none (yet): it is saved, and the
        file's tokens then decide its name."""
        meta = self.meta_of(v.file) if v.file is not None else None
        return FileInfo(meta.n_tokens, meta.model) if meta else None

    def saved_file(self, key: str) -> SavedFile | None:
        """auto-<key>.bin as branches.save_key needs it: its tokens (the index's, else its header)
        and the prompt count its metadata recorded."""
        store, index = self.ctx.store, self.ctx.index
        p = self.pending(auto_name(key))
        if p is not None and p.meta is not None and p.tokens is not None:
            return SavedFile(p.tokens, p.meta.n_prompt)  # as it will be once final
        meta = store.read_meta(key)
        e = index.get(auto_name(key)) if index is not None else None
        if e is not None and meta is not None and e.n_tokens == meta.n_tokens:
            return SavedFile(e.tokens, meta.n_prompt)
        try:
            header = slotfile.read_header(store.bin_path(key), self.ctx.max_tokens)
        except FileNotFoundError:
            return None
        except (slotfile.BadSlotFile, OSError):
            return SavedFile(b"")  # not a state this engine wrote: ours to replace
        return SavedFile(header.encoded(), meta.n_prompt if meta else None)

    def writing(self) -> set[str]:
        """Files being finalized (the slot that saved them holds them live)."""
        return {p.final for p in self._finalizing.values()}

    def in_flight(self, key: str) -> bool:
        """A save of temporary `key` is in flight, or its file is being finalized."""
        return key in self._temps or key in self._finalizing

    # -- waiting for finalizes ------------------------------------------------------------------
    async def wait_file(self, key: str) -> FileInfo | None:
        """auto-<key>.bin's facts once its finalize in flight (if any) has landed: for commands,
        which hand people a file on disk. A turn reads file_info (pending ones as they will be)."""
        pending = self._finalizing.get(key)
        if pending is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(pending.fut)
        return self.file_info(key)

    async def _wait(self, futs: list[asyncio.Future]) -> None:
        for fut in futs:
            with contextlib.suppress(Exception):
                await asyncio.shield(fut)
        if futs:
            await asyncio.sleep(0)  # their done-callbacks (_finalized) run before the caller goes on

    async def temp_free(self, temp: str) -> None:
        """Until no finalize in flight holds .autosessd-<temp>.partial: the engine writes a
        save into that name, over the bytes being fsynced."""
        while futs := [p.fut for p in self._finalizing.values() if p.temp == temp]:
            await self._wait(futs)

    async def settled(self) -> None:
        """Every finalize in flight: a save's temporary is named by its line's key while its
        final name is chosen by comparing with the files of that line."""
        while self._finalizing:
            fut = next(iter(self._finalizing.values())).fut
            if fut.done():
                # Finished, and its done-callback (_finalized, which removes it) is queued on
                # the loop: awaiting a done future does not yield, so yield once for it to run
                # instead of spinning here for ever with the loop blocked.
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(Exception):
                await asyncio.shield(fut)

    def finalizing(self) -> list[asyncio.Future]:
        return [p.fut for p in self._finalizing.values()]
