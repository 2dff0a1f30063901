"""One restore path: a session file read back into a slot by the engine.

    keep starts out   on an engine that empties idle slots, no other request starts between
                      the restore and the slot's own request (launch.no_starts)
    in use            the name is held in Store.in_use while the engine reads it (no prune)
    not waited for    a file whose finalize still runs (finalizing.Pending) is read as its temporary,
                      held for the engine (Store.read_temp): a switch back does not wait for the
                      fsync, and the finalize renames it only once the engine has read it
    still decided     after each wait (the launch gate, a finalize, a digest), the file was chosen
                      under the engine that runs now (facts.py): one restarted meanwhile, maybe with
                      another model, is never handed the old one's file
    checked           the file must be the one saved (Store.check_whole: a regular file of its
                      metadata's size; its digest again when its identity changed) and fit
                      the slot (no more tokens than the engine's context): llama-server aborts
                      on a file one byte short, and a refused restore can leave spoiled K/V
                      behind (llama.cpp #27068). A file that is not whole is moved aside
                      (Store.quarantine); the engine never sees it, and the slot is unchanged
    restore           the engine's answer; "No available space in KV cache" on a cache all
                      slots share → make room once (the least recently used free slot, its
                      conversation saved first when worth it), then try again
    the view          RESTORED (awaiting verification by the next cache_n), UNKNOWN for a
                      person's file, EMPTY when llama-server refused it (it clears the slot)

Callers: the turn (turn.py), `autosessctl restore`, the tail's restore after an engine
restart (commands.py). Each holds the slot's ticket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from ..base import files, logs
from ..engines.base import EngineError, EngineRefused
from ..store import slotfile
from ..store.directory import AUTO_BIN, auto_name
from ..store.integrity import NEEDS_READ
from ..store.runs import decode
from ..store.staging import Refused, Staged
from .observe import SLEPT, UNLOADED
from .phases import timed
from .policy import Occasion
from .report import TurnResult, fmt_bytes, fmt_tokens
from .slot import Phase, Slot

if TYPE_CHECKING:
    from .context import Context
    from .launch import Launch
    from .observe import Observer
    from .placement import Placement
    from .saves import Saver

log = logging.getLogger("autosessd")

NO_KV_ROOM = "No available space in KV cache"  # llama-server's answer to a restore that does not fit


class Restorer:
    def __init__(self, ctx: Context, placement: Placement, launch: Launch, observer: Observer, saver: Saver):
        self.ctx = ctx
        self.placement = placement
        self.launch = launch
        self.observer = observer
        self.saver = saver

    async def restore(self, s: Slot, key: str | None, result: TurnResult | None, name: str | None = None,
                      expect: int | None = None, tokens: bytes | None = None, *, decided: int) -> bool:
        """Restore auto-<key>.bin (or `name`; key None: a person's file) into slot s. expect:
        the tokens the engine should reuse of it (all by default); tokens: what it holds, when
        the index knows; decided: the engine's generation (facts.py) the caller chose the file
        under, after facts.ready. Blocks on the launch gate and the engine."""
        ctx = self.ctx
        name = name or auto_name(key or "")
        with timed(result, "launch"):
            await self.launch.no_starts(s)  # another request starting in between would empty the restored slot
        after = s.view.why  # a model switch or a sleep emptied the slot: counted once reused
        t0 = time.monotonic()
        reading = None  # the name the engine reads: `name`, or its pending temporary, held
        staged: Staged | None = None  # or what staging holds of it (a copy, an assembly of its blocks)
        try:
            with ctx.store.using(name):
                if self._overtaken(name, decided, result):
                    return False
                reading = await self._pending_temp(name, result)
                if reading is None:
                    with timed(result, "assemble"):
                        staged = await self._stage(s, key, name, expect, result)
                    if staged is None:
                        return False
                with timed(result, "check"):
                    refused = await self._refused(s, key, name, result,
                                                  pending=reading is not None or self._checked_in_staging(name))
                if refused or self._overtaken(name, decided, result):
                    return False
                engine_name = reading or (staged.name if staged is not None else name)
                with timed(result, "restore"):
                    try:
                        res = await ctx.engine.restore(s.id, engine_name)
                    except EngineRefused as e:
                        # A unified KV cache shared by every slot can be too full for the file; the
                        # engine never evicts another slot itself. Make room once, then try again.
                        if NO_KV_ROOM not in str(e) or not await self._make_room(s, name):
                            raise
                        res = await ctx.engine.restore(s.id, engine_name)
        except EngineError as e:
            ctx.counters.restore_failures += 1
            log.warning("auto sessions: restore of %s: %s", name, e)
            if isinstance(e, EngineRefused):
                # The engine read some of the file before it refused it: what it wrote may stay
                # in its KV cache and spoil later completions until it restarts (llama.cpp #27068).
                ctx.suspect = {"at": time.time(), "file": name, "error": str(e)[:300]}
                log.warning("engine: it refused the restore of %s after reading it: it may hold spoiled K/V "
                            "state until it restarts (llama.cpp #27068); restart llama-server if answers go wrong",
                            name)
            ctx.events.emit("restore_failed", slot=s.id, key=key, file=name, error=str(e))
            if result is not None:
                result.errors.append(f"restore of {name}: {e}")
            if ctx.engine.kind == "llama-server" and s.at_rest():  # it clears the slot when a restore fails
                s.restore_failed()
            else:
                self.observer.lost(s, f"the restore of {name} failed")
            return False
        finally:
            if reading is not None:
                ctx.store.done_reading(reading)
            if staged is not None and staged.temporary:
                asyncio.get_running_loop().run_in_executor(None, ctx.store.unstage, staged)
            elif staged is not None:
                asyncio.get_running_loop().run_in_executor(None, ctx.store.trim_hot)  # no longer held
        ms = (time.monotonic() - t0) * 1000
        ctx.counters.restores += 1
        if reading is not None:
            ctx.counters.restores_before_durable += 1
        ctx.counters.bytes_restored += res.n_bytes
        ctx.counters.ms_restored += res.ms
        ctx.savings.saw_restore(res.n_tokens, res.n_bytes, res.ms)
        ctx.histograms.restore.observe(res.ms / 1000)
        how = "" if staged is None or not staged.assembled else \
            f" (assembled from its blocks: {fmt_bytes(staged.bytes_read)} read in {staged.ms:.0f} ms)"
        logs.soon(log, logging.INFO, "auto sessions: restored %s tokens from %s in %.0f ms%s", fmt_tokens(res.n_tokens),
                  name, ms, how)
        info = {"key": key, "file": name, "n_tokens": res.n_tokens, "bytes": res.n_bytes,
                "engine_ms": round(res.ms, 2), "ms": round(ms, 2)}
        if staged is not None and staged.assembled:
            # Assembled from its blocks: what was read of them (only the blocks of the tokens used).
            info.update(assembled_bytes=staged.bytes_read, assemble_ms=round(staged.ms, 2))
            ctx.counters.assemblies += 1
            ctx.counters.bytes_assembled += staged.bytes_read
            if staged.n_tokens is not None and tokens is not None:
                tokens = tokens[:4 * staged.n_tokens]  # the slot holds only the first n_tokens of the file
        if staged is not None and staged.tail:
            ctx.counters.tail_restores += 1
        ctx.events.emit_soon("restored", slot=s.id, **info)
        if not s.at_rest():
            # A request the log showed starting meanwhile (the tail): the engine ran the
            # restore before or after it, so what the slot holds is not known.
            self.observer.lost(s, f"a request started while {name} was restored")
            return False
        s.restored(key, res.n_tokens, name, expect, tokens)
        if after == UNLOADED:
            ctx.counters.restores_after_model_switch += 1
        elif after == SLEPT:
            ctx.counters.restores_after_sleep += 1
        if result is not None:
            result.restored = info
        return True

    async def _stage(self, s: Slot, key: str | None, name: str, expect: int | None,
                     result: TurnResult | None) -> Staged | None:
        """What the engine reads for `name` (Store.stage: its copy in staging, or its first
        `expect` tokens assembled from its blocks). None: none can be read (said, counted)."""
        ctx = self.ctx
        try:
            return await asyncio.get_running_loop().run_in_executor(None, ctx.store.stage, name, expect)
        except (Refused, OSError) as e:
            ctx.counters.restores_refused += 1
            log.warning("auto sessions: restore of %s refused: %s", name, e)
            ctx.events.emit("restore_refused", slot=s.id, key=key, file=name, why=str(e))
            if result is not None:
                result.errors.append(f"restore of {name} refused: {e}")
            if ctx.index is not None and isinstance(e, Refused) and e.bad:
                ctx.index.forget_if_gone(name)
                for cut in e.cut:  # a damaged block cut these back: the index learns what they hold now
                    meta = ctx.store.read_meta(cut[5:21])
                    if meta is None or not meta.in_blocks:
                        ctx.index.forget_if_gone(cut)
                        continue
                    with contextlib.suppress(OSError, ValueError):
                        ctx.index.add(cut, decode(meta.tokens or b""), meta.model, meta.marks)
            return None

    def _checked_in_staging(self, name: str) -> bool:
        """The file is kept as blocks: stage() checked what the engine reads (its copy, or the
        blocks it was assembled from), so only the context is checked here."""
        meta = self.saver.facts(name).meta
        return meta is not None and meta.in_blocks

    def _overtaken(self, name: str, decided: int, result: TurnResult | None) -> bool:
        """The file was chosen under the facts of an engine that has restarted since (facts.py):
        it is chosen again at the next request, under the new engine's."""
        facts = self.ctx.facts
        if facts.usable and decided == facts.generation:
            return False
        why = facts.off or "the engine restarted while it was chosen"
        log.info("auto sessions: no restore of %s: %s", name, why)
        if result is not None:
            result.skipped.append(f"restore of {name}: {why}")
        return True

    async def refuse_if_damaged(self, s: Slot, key: str | None, name: str, result: TurnResult | None) -> None:
        """A file under the conversation's name that its metadata does not vouch for (its
        size differs, or it is a link): the key rule passes over it as no file; it is said,
        counted and moved aside here, so that nothing restores it later."""
        with self.ctx.store.using(name):
            await self._refused(s, key, name, result)

    async def _pending_temp(self, name: str, result: TurnResult | None) -> str | None:
        """A file whose finalize still runs (its fsync: seconds at 2 GB) is read by the engine
        as its temporary, not waited for (saves.py, Store.read_temp): the bytes are the ones
        verified after the save. None: the file is final, or its temporary is not that file any
        more (renamed meanwhile, or copied again by a retry): then its finalize is waited for."""
        p = self.saver.facts(name).pending
        if p is None or p.meta is None:
            return None
        reading = self.ctx.store.read_temp(p.temp, p.ino, p.meta.bytes)
        if reading is None:
            with timed(result, "wait"):
                await self.saver.wait_file(p.meta.key)
        return reading

    async def _refused(self, s: Slot, key: str | None, name: str, result: TurnResult | None,
                       pending: bool = False) -> bool:
        """Whether the file may not be handed to the engine (said, counted, and a file that is
        not whole moved aside). The check is a stat or two, in a thread (a digest when the
        file changed since it was last checked). pending: the engine reads a link to the file's
        temporary, whose inode and size read_temp checked: only the context is checked here."""
        ctx = self.ctx
        loop = asyncio.get_running_loop()
        seen = files.regular_ident(ctx.store.path / name)
        n_blocks = (2 if ctx.swa_window else 1) if ctx.engine.magic == slotfile.MAGIC_BYTES else None
        if pending:
            why = None
        else:
            # A file unchanged since it was saved or last checked: a few lstats, here on the loop
            # (a thread's round trip costs more than they do); one to read: in a thread.
            why = ctx.store.check_whole(name, n_blocks, stat_only=True, ident=seen)
            if why is NEEDS_READ:
                why = await loop.run_in_executor(None, ctx.store.check_whole, name, n_blocks)
        bad = why is not None
        if not bad and ctx.n_ctx is not None:
            entry = ctx.index.get(name) if ctx.index is not None and not pending else None
            meta = self.saver.facts(name).meta if entry is None else None
            n = entry.n_tokens if entry is not None else meta.n_tokens if meta is not None else None
            if n is not None and n > ctx.n_ctx:
                why = f"{name} holds {n:,} tokens, more than the engine's context of {ctx.n_ctx:,} per slot"
        if why is None:
            return False
        ctx.counters.restores_refused += 1
        log.warning("auto sessions: restore of %s refused: %s", name, why)
        ctx.events.emit("restore_refused", slot=s.id, key=key, file=name, why=why)
        if result is not None:
            result.errors.append(f"restore of {name} refused: {why}")
        if bad and AUTO_BIN.match(name):
            if ctx.index is not None:
                ctx.index.remove(name)
            moved = await loop.run_in_executor(None, ctx.store.quarantine, name, why, seen)
            if moved is not None:
                ctx.counters.quarantined += 1
                ctx.events.emit("quarantined", file=name, moved_to=moved, why=why)
        return True

    async def _make_room(self, s: Slot, name: str) -> bool:
        """Empty the least recently used other slot that is free now and runs nothing we know
        of, saving its conversation first when worth it. False when there is none."""
        others = sorted((o for o in self.placement.slots.values()
                         if o is not s and not o.busy and o.view.phase is not Phase.SWITCHED),
                        key=lambda o: o.last_used)
        for o in others:
            ticket = self.placement.try_admit(o)
            if ticket is None:
                continue
            try:
                # Inside this restore's no-starts hold (no second one: it would wait for itself).
                await self.saver.save_if_worth(o, Occasion.KEYLESS, gate_held=True)
                n = await self.ctx.engine.erase(o.id)
                log.info("auto sessions: emptied slot %d (%s tokens) to make room in the KV cache for %s", o.id,
                         fmt_tokens(n), name)
                self.ctx.events.emit("slot_emptied", slot=o.id, why=f"room for {name}")
                if o.at_rest():
                    o.erased()
                else:  # the tail saw a request start there meanwhile: what it holds is not known
                    self.observer.lost(o, f"emptied for {name} while a request started on it")
                return True
            except EngineError as e:
                log.warning("auto sessions: making room on slot %d for %s: %s", o.id, name, e)
                return False
            finally:
                ticket.release()
        return False
