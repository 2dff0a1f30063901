"""The session files as the finalizes in flight will make them (saves.py's other half), and
the finalizes themselves.

A save returns to its caller as soon as its temporary checked out; its finalize (digest,
fsync, rename, metadata: Store.finalize) runs in a thread (issue 31). Until it lands, what it
will make is a Pending, and every decision reads a file as it will be (facts): the up-to-date
check (held_info), the naming by tokens (saved_file), the restore choice (pending_best), the
KV layout (loadable). The file as it is stays the store's and the index's own answer.

A decision made on a Pending (the held conversation skipped as up to date, a new save
"covered" by a pending file, a slot emptied to make room) stands only if that finalize lands.
So a finalize is not given up at its first failure (issue 38): its bytes are whole (verified
after the save) and stay where the failed try left them, and it is tried again after
RETRY_S, each try after a failed fsync copying them into a fresh file checked against the
digest the first try read (Store.finalize, Unfinished). Only when every try failed, or the
bytes themselves are gone or changed, is the Pending dropped: its temporary goes (once no
restore reads it), decisions read the directory again, and a slot still holding the
conversation saves it again at its next occasion (its file is missing, so not up to date).
Each failed try counts one save failure. What waits for finalizes waits here too: commands
for a file on disk (wait_file), a save for its temporary name (temp_free), the stop for all
(settled); they wait for the outcome after every try.

Saver (saves.py) is this class and the save path; only it starts a Pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..store import slotfile
from ..store.branches import SavedFile
from ..store.directory import AUTO_BIN, Meta, StoreError, auto_name
from ..store.names import Unfinished
from ..store.runs import common_prefix, decode, swa_usable
from ..store.slotfile import comparable, encode
from .policy import FileInfo

if TYPE_CHECKING:
    from .context import Context
    from .slot import View

log = logging.getLogger("autosessd")

RETRY_S = (0.5, 2.0, 8.0)  # a failed finalize is tried again after each of these (then given up)


@dataclass(frozen=True)
class Pending:
    """A save whose finalize runs in a thread (or waits to be tried again): what it will make."""

    temp: str  # the temporary's key: the bytes are at .autosessd-<temp>.partial until the rename
    final: str  # the name it becomes
    key: str  # auto-<key>.bin's key; for a person's name, the temporary's
    meta: Meta | None  # an auto file's metadata as finalize writes it, less its digest; None: a person's name
    tokens: bytes | None  # its header's tokens (None: an engine whose files do not show them)
    ino: int  # the temporary's inode, as verified: only that file is handed to a restore
    fut: asyncio.Future  # its outcome once every try is done: the metadata written, or the last error
    write: Meta | None = None  # what the finalize writes (a person's name: its model, for the index)
    header: slotfile.SlotHeader | None = None


@dataclass(frozen=True)
class Facts:
    """A session file as it will be once the finalize in flight (if any) has landed."""

    meta: Meta | None  # an auto file's metadata; None: no such file, or a person's
    tokens: bytes | None  # what it holds, when known (a pending one's header, else the index's)
    pending: Pending | None

    def info(self) -> FileInfo | None:
        m = self.meta
        if m is None:
            return None
        return FileInfo(m.n_tokens, m.model, slotfile.KVLayout.from_fingerprint(m.layout) if m.layout else None)


class Finalizing:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._finalizing: dict[str, Pending] = {}  # by the final file's key
        self._temps: dict[str, list] = {}  # temporary's key → [asyncio.Lock, users]
        self._free_target = 0  # bytes a refused save needed free; the next prune makes room
        self._giving_up: set[asyncio.Task] = set()
        # Called on the loop once a conversation's save is final: (its name, its metadata, the
        # tokens its header holds, the slot's view that was saved). recall.py checks its reply.
        self.want_room: Callable[[], None] | None = None  # the facade's: a prune soon

    # -- the files as they will be ---------------------------------------------------------
    def facts(self, name: str) -> Facts:
        """`name` as it will be: a pending finalize's facts, else the directory's and the index's."""
        m = AUTO_BIN.match(name)
        p = self._finalizing.get(m.group(1)) if m else None
        if p is not None and p.final == name and p.meta is not None:
            return Facts(p.meta, p.tokens, p)
        meta = self.ctx.store.read_meta(m.group(1)) if m else None
        e = self.ctx.index.get(name) if self.ctx.index is not None else None
        return Facts(meta, e.tokens if e is not None else None, None)

    def file_info(self, key: str) -> FileInfo | None:
        return self.facts(auto_name(key)).info()

    def loadable(self, name: str, meta: Meta | None = None) -> bool:
        """Whether this engine can load the file, by the KV layout its metadata records (meta:
        the file's, when the caller read it already)."""
        meta = meta or self.facts(name).meta
        layout = slotfile.KVLayout.from_fingerprint(meta.layout) if meta is not None and meta.layout else None
        return layout is None or self.ctx.engine_layout is None or layout.compatible(self.ctx.engine_layout)

    def held_info(self, v: View) -> FileInfo | None:
        """The file holding the slot's conversation as last saved or restored (View.file), for
        plan_save's up-to-date check; None when it has none (yet): it is saved, and the
        file's tokens then decide its name."""
        meta = self.facts(v.file).meta if v.file is not None else None
        return FileInfo(meta.n_tokens, meta.model) if meta else None

    def saved_file(self, key: str) -> SavedFile | None:
        """auto-<key>.bin as branches.save_key needs it: its tokens (a pending one's, the index's,
        else its header) and the prompt count its metadata recorded."""
        f = self.facts(auto_name(key))
        if f.meta is not None and f.tokens is not None and (f.pending is not None or
                                                            len(f.tokens) // 4 == f.meta.n_tokens):
            return SavedFile(f.tokens, f.meta.n_prompt)
        if f.meta is not None and f.meta.in_blocks:  # a manifest holds its tokens
            return SavedFile(encode(comparable(decode(f.meta.tokens or b""))), f.meta.n_prompt)
        try:
            header = slotfile.read_header(self.ctx.store.bin_path(key), self.ctx.max_tokens)
        except FileNotFoundError:
            return None
        except (slotfile.BadSlotFile, OSError):
            return SavedFile(b"")  # not a state this engine wrote: ours to replace
        return SavedFile(header.encoded(), f.meta.n_prompt if f.meta else None)

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

    def writing(self) -> set[str]:
        """Files being finalized (the slot that saved them holds them live)."""
        return {p.final for p in self._finalizing.values()}

    def saving(self, temp: str) -> bool:
        """A save into temporary `temp` is being written or finalized."""
        return temp in self._temps or any(p.temp == temp for p in self._finalizing.values())

    # -- room --------------------------------------------------------------------------------
    def need_room(self, n_bytes: int) -> None:
        """A save (or a finalize) found too little space: the next prune frees n_bytes."""
        self._free_target = max(self._free_target, n_bytes)
        if self.want_room is not None:
            self.want_room()

    def room_wanted(self) -> int:
        """Bytes a refused save needed free (the prune makes room for them), once."""
        target, self._free_target = self._free_target, 0
        return target

    # -- finalizing --------------------------------------------------------------------------
    def finalize_later(self, p: Pending) -> None:
        """Make p's file durable and final off the request's path; p.final is held in
        Store.in_use (the caller's acquire) until its outcome."""
        self._finalizing[p.key] = p
        self._try(p, 0, None)

    def _try(self, p: Pending, tries: int, digest: str | None) -> None:
        if p.fut.done():
            return
        fut = asyncio.get_running_loop().run_in_executor(None, self._finalize, p, digest)
        fut.add_done_callback(lambda f: self._tried(p, tries, f))

    def _finalize(self, p: Pending, digest: str | None) -> Meta | None:
        """In a worker thread: make p's temporary final (an auto file's metadata with the
        file's digest: what is returned), then index it."""
        store, index = self.ctx.store, self.ctx.index
        meta = p.meta
        if p.meta is not None:
            meta = store.finalize(p.temp, p.meta, digest)
        else:
            store.finalize_manual(p.temp, p.final)
        if index is not None and p.header is not None:
            model = (meta or p.write).model if (meta or p.write) is not None else None
            try:
                # The model it was saved for (an engine may restart with another meanwhile).
                index.add(p.final, p.header.tokens, model, meta.marks if meta is not None else ())
            except (OSError, ValueError) as e:  # the file is final either way; a rescan finds it
                log.warning("auto sessions: indexing %s: %s", p.final, e)
        return meta

    def _tried(self, p: Pending, tries: int, fut: asyncio.Future) -> None:
        exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if exc is None:
            self._landed(p, fut.result())
            return
        self.ctx.counters.save_failures += 1
        again = isinstance(exc, OSError) and tries < len(RETRY_S) and \
            (isinstance(exc, Unfinished) or self.ctx.store.temp_path(p.temp).exists())
        if not again:
            task = asyncio.get_running_loop().create_task(self._give_up(p, exc))
            self._giving_up.add(task)
            task.add_done_callback(self._giving_up.discard)
            return
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self.need_room(p.meta.bytes if p.meta is not None else 0)
        delay = RETRY_S[tries]
        self.ctx.counters.finalize_retries += 1
        log.warning("auto sessions: finalize of %s failed (%s): its bytes are kept, trying again in %.1f s",
                    p.final, exc, delay)
        self.ctx.events.emit("finalize_retry", key=p.temp, file=p.final, error=str(exc), in_s=delay)
        digest = exc.digest if isinstance(exc, Unfinished) else None
        asyncio.get_running_loop().call_later(delay, self._try, p, tries + 1, digest)

    def _landed(self, p: Pending, meta: Meta | None) -> None:
        """Durable: fsynced, renamed, its metadata. An auto file (a conversation's, a branch's or
        a prefix's) is uploaded to the shared bucket (with the metadata finalize wrote);
        people's parked names stay local."""
        self._drop(p)
        if meta is not None and meta.tail:
            self.ctx.counters.tails_saved += 1
            self.ctx.counters.tail_bytes_saved += meta.tail[1]
        if meta is not None and self.ctx.remote is not None:
            store = self.ctx.store
            # Whole files go up as they are; a conversation kept as blocks as its copy in
            # staging (assembled again by the upload if it went meanwhile).
            store_file = store.hot_path(meta.key) if meta.in_blocks else store.bin_path(meta.key)
            self.ctx.remote.upload_later(store_file, meta)
        self.ctx.events.emit("finalized", key=p.temp, file=p.final)
        p.fut.set_result(meta)

    async def _give_up(self, p: Pending, exc: BaseException) -> None:
        """Every try failed, or the bytes are gone: the temporary goes (once no restore reads
        it), and an auto file renamed without its metadata (no reader trusts it) goes too."""
        store, index = self.ctx.store, self.ctx.index
        with contextlib.suppress(OSError):
            await asyncio.get_running_loop().run_in_executor(None, store.drop_temp, p.temp)
        self._drop(p)
        if p.meta is not None and store.read_meta(p.key) is None:
            with contextlib.suppress(StoreError, OSError):
                store.remove(p.key)
            if index is not None:
                index.remove(p.final)
        log.error("auto sessions: finalize of %s failed, given up: %s", p.final, exc)
        self.ctx.events.emit("save_failed", key=p.temp, file=p.final, error=str(exc))
        p.fut.set_exception(exc if isinstance(exc, Exception) else StoreError(str(exc)))
        p.fut.exception()  # retrieved: waiters read the directory, nobody needs the error raised

    def _drop(self, p: Pending) -> None:
        if self._finalizing.get(p.key) is p:
            del self._finalizing[p.key]
        self.ctx.store.release(p.final)
        # Copies in staging beyond their budget go now that this one is no longer held.
        asyncio.get_running_loop().run_in_executor(None, self.ctx.store.trim_hot)

    # -- waiting for finalizes ------------------------------------------------------------------
    async def wait_file(self, key: str) -> FileInfo | None:
        """auto-<key>.bin's facts once its finalize in flight (if any) has landed: for commands,
        which hand people a file on disk. A turn reads file_info (pending ones as they will be)."""
        pending = self._finalizing.get(key)
        if pending is not None:
            await self._wait([pending.fut])
        return self.file_info(key)

    async def _wait(self, futs: list[asyncio.Future]) -> None:
        for fut in futs:
            with contextlib.suppress(Exception):
                await asyncio.shield(fut)
        if futs:
            await asyncio.sleep(0)  # their done-callbacks run before the caller goes on

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
                # Finished, and what removes it is queued on the loop: awaiting a done future
                # does not yield, so yield once for it to run instead of spinning here for ever
                # with the loop blocked.
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(Exception):
                await asyncio.shield(fut)

    def finalizing(self) -> list[asyncio.Future]:
        return [p.fut for p in self._finalizing.values()]
