"""The session directory kept: the token index's life (built at start, cached at stop) and
prune (after each turn, off the request's path; `autosessctl prune`).

Prune keeps the newest auto_sessions_keep auto files and at most auto_sessions_max_gb of
them, never one in use (Store.in_use), and after a save refused for space also frees what
that save needed (Saver.room_wanted). It runs in a worker thread, one at a time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ..store.directory import auto_name
from ..store.index import TokenIndex
from ..store.kvfile import cut_now
from . import facts
from .report import fmt_bytes

if TYPE_CHECKING:
    from .context import Context
    from .saves import Saver

log = logging.getLogger("autosessd")

# A downloaded file is kept as blocks this long after its restore read it (Upkeep.keep_as_blocks).
KEEP_AS_BLOCKS_AFTER_S = 30.0


class Upkeep:
    def __init__(self, ctx: Context, saver: Saver | None = None):
        """saver: whose refused saves the prune makes room for; behind a router each model's
        Sessions adds its own (savers), and one Upkeep keeps the one directory."""
        self.ctx = ctx
        self.savers: list[Saver] = [saver] if saver is not None else []
        self._prune_task: asyncio.Task | None = None
        self._import_task: asyncio.Task | None = None
        self._wanted: list[str | None] = []  # keys to keep as blocks (None: every whole file)
        self._later: list[asyncio.TimerHandle] = []  # keep_as_blocks of downloads, waiting

    # -- the token index -----------------------------------------------------------------
    async def prepare(self, swa: bool = True) -> None:
        """At start, after store.cleanup(): index the session files (from the cache in the
        state directory when their files did not change) and learn the model's sliding
        window. Without an index every restore follows the key rule."""
        ctx = self.ctx
        index = TokenIndex(ctx.store.path, ctx.cfg.effective_state_dir() / "index.cache", ctx.max_tokens)
        try:
            rep = await asyncio.get_running_loop().run_in_executor(None, index.scan)
        except OSError as e:
            log.warning("auto sessions: cannot index %s (%s): files are restored by their key only", ctx.store.path, e)
            return
        ctx.index = index
        log.info("auto sessions: indexed %d session files in %.0f ms (cache: %s, %d from it, %d headers read)",
                 rep.files, rep.seconds * 1000, rep.cache, rep.from_cache, rep.read)
        for name, why in sorted(rep.skipped.items()):
            log.warning("auto sessions: not indexed: %s: %s", name, why)
        if swa:  # behind a router each model learns its own as it loads
            await facts.model_memory(ctx)

    def start_import(self) -> None:
        """Whole files saved before the block store (or a window or hybrid model's, before its
        files were cut), kept as blocks now (Store.import_whole), one at a time in a worker
        thread, after the start: nothing a user saved is lost, and the upgrade costs no start
        its time."""
        self._want(None)

    def keep_as_blocks(self, key: str, after_s: float | None = None) -> None:
        """A file a turn downloaded whole (a manifest's blocks written into the engine's file,
        or another host's whole file), kept as blocks after_s seconds (KEEP_AS_BLOCKS_AFTER_S)
        after its restore read it: off the turn's path, and after the conversation's next save,
        which usually cuts it first (the import then has nothing to do). One held then (a
        restore reads it) waits as long again."""
        if self.ctx.store.cut:
            loop = asyncio.get_running_loop()
            self._later = [h for h in self._later if h.when() > loop.time()]  # those still to come
            self._later.append(loop.call_later(KEEP_AS_BLOCKS_AFTER_S if after_s is None else after_s,
                                               self._want, key))

    def _want(self, key: str | None) -> None:
        """Import `key` (None: every whole file), in the one import task."""
        if not self.ctx.store.cut:
            return
        self._wanted.append(key)
        if self._import_task is None or self._import_task.done():
            self._import_task = asyncio.get_running_loop().create_task(self._import())

    async def _import(self) -> None:
        store, loop = self.ctx.store, asyncio.get_running_loop()
        try:
            while self._wanted:
                wanted, self._wanted = self._wanted, []
                every = None in wanted
                if every:
                    entries = await loop.run_in_executor(None, store.scan)
                    keys = [e.key for e in entries if e.meta is not None and not e.blocks and cut_now(e.meta.whole)]
                else:
                    keys = list(dict.fromkeys(k for k in wanted if k is not None))
                n = 0
                for key in keys:
                    if not every and store.users(auto_name(key)):
                        self.keep_as_blocks(key)  # not cut under a restore that reads it: later
                        continue
                    done = await loop.run_in_executor(None, store.import_whole, key)
                    if done is None:
                        continue
                    log.info("auto sessions: %s", done)
                    meta = store.read_meta(key)
                    if meta is not None and meta.in_blocks and self.ctx.index is not None:
                        from ..store.runs import decode

                        self.ctx.index.add(auto_name(key), decode(meta.tokens or b""), meta.model, meta.marks)
                    n += meta is not None and meta.in_blocks
                if n and every:
                    log.info("auto sessions: %d whole file(s) from before the block store kept as blocks now", n)
        except Exception as e:  # never the daemon's end: the files stay whole
            log.warning("auto sessions: keeping whole files as blocks: %s", e)

    def stop_import(self) -> None:
        for h in self._later:
            h.cancel()
        self._later.clear()
        if self._import_task is not None:
            self._import_task.cancel()

    async def save_index(self) -> None:
        index = self.ctx.index
        if index is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, index.save_cache)
        except OSError as e:
            log.warning("auto sessions: cannot write the index cache %s: %s", index.cache_path, e)

    # -- prune -----------------------------------------------------------------------------
    def schedule_prune(self) -> None:
        if self._prune_task is None or self._prune_task.done():
            self._prune_task = asyncio.get_running_loop().create_task(self._prune_quietly())

    async def _prune_quietly(self) -> None:
        try:
            await self.prune()
        except Exception as e:
            log.warning("auto sessions: prune: %s", e)

    async def prune(self, keep: int | None = None, max_gb: float | None = None,
                    dry_run: bool = False) -> dict[str, Any]:
        ctx = self.ctx
        keep = ctx.cfg.auto_sessions_keep if keep is None else keep
        max_bytes = int((ctx.cfg.auto_sessions_max_gb if max_gb is None else max_gb) * 1e9)
        free_target = 0 if dry_run else max((s.room_wanted() for s in self.savers), default=0)
        plan = await asyncio.get_running_loop().run_in_executor(None, ctx.store.prune, keep, max_bytes, dry_run,
                                                                free_target)
        removed = [{"key": e.key, "file": e.name, "bytes": e.bytes} for e in plan.remove]
        if removed and not dry_run:
            ctx.counters.pruned_files += len(removed)
            ctx.counters.pruned_bytes += plan.freed
            for e in plan.remove:
                log.info("auto sessions: pruned %s (%s)", e.name, fmt_bytes(e.bytes))
                if ctx.index is not None:
                    # The entry of the file removed, not of one saved again under its name since.
                    ctx.index.remove(e.name, ident=e.ident)
            ctx.events.emit("pruned", files=[r["file"] for r in removed], bytes=plan.freed)
            await self.save_index()
        return {"removed": removed, "freed": plan.freed, "dry_run": dry_run, "kept": len(plan.keep)}

    def pruning(self) -> asyncio.Task | None:
        """The prune running now, if one is."""
        return self._prune_task if self._prune_task is not None and not self._prune_task.done() else None
