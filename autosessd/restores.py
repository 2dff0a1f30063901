"""One restore path: a session file read back into a slot by the engine.

    keep starts out   on an engine that empties idle slots, no other request starts between
                      the restore and the slot's own request (launch.no_starts)
    in use            the name is held in Store.in_use while the engine reads it (no prune)
    restore           the engine's answer; "No available space in KV cache" on a cache all
                      slots share → make room once (the least recently used free slot, its
                      conversation saved first when worth it), then try again
    the view          RESTORED (awaiting verification by the next cache_n), UNKNOWN for a
                      person's file, EMPTY when llama-server refused it (it clears the slot)

Callers: the turn (turn.py), `autosessctl restore`, the tail's restore after an engine
restart (commands.py). Each holds the slot's ticket.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .engines.base import EngineError, EngineRefused
from .policy import Occasion
from .report import TurnResult, fmt_tokens
from .slot import Phase, Slot
from .store import auto_name

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
                      expect: int | None = None, tokens: bytes | None = None) -> bool:
        """Restore auto-<key>.bin (or `name`; key None: a person's file) into slot s. expect:
        the tokens the engine should reuse of it (all by default); tokens: what it holds, when
        the index knows. Blocks on the launch gate and the engine."""
        ctx = self.ctx
        name = name or auto_name(key or "")
        await self.launch.no_starts(s)  # another request starting in between would empty the restored slot
        t0 = time.monotonic()
        try:
            with ctx.store.using(name):
                try:
                    res = await ctx.engine.restore(s.id, name)
                except EngineRefused as e:
                    # A unified KV cache shared by every slot can be too full for the file; the
                    # engine never evicts another slot itself. Make room once, then try again.
                    if NO_KV_ROOM not in str(e) or not await self._make_room(s, name):
                        raise
                    res = await ctx.engine.restore(s.id, name)
        except EngineError as e:
            ctx.counters.restore_failures += 1
            log.warning("auto sessions: restore of %s: %s", name, e)
            ctx.events.emit("restore_failed", slot=s.id, key=key, file=name, error=str(e))
            if result is not None:
                result.errors.append(f"restore of {name}: {e}")
            if ctx.engine.kind == "llama-server" and s.at_rest():  # it clears the slot when a restore fails
                s.restore_failed()
            else:
                self.observer.lost(s, f"the restore of {name} failed")
            return False
        ms = (time.monotonic() - t0) * 1000
        ctx.counters.restores += 1
        ctx.counters.bytes_restored += res.n_bytes
        ctx.counters.ms_restored += res.ms
        ctx.savings.saw_restore(res.n_tokens, res.n_bytes, res.ms)
        ctx.histograms.restore.observe(res.ms / 1000)
        log.info("auto sessions: restored %s tokens from %s in %.0f ms", fmt_tokens(res.n_tokens), name, ms)
        info = {"key": key, "file": name, "n_tokens": res.n_tokens, "bytes": res.n_bytes,
                "engine_ms": round(res.ms, 2), "ms": round(ms, 2)}
        ctx.events.emit("restored", slot=s.id, **info)
        if not s.at_rest():
            # A request the log showed starting meanwhile (the tail): the engine ran the
            # restore before or after it, so what the slot holds is not known.
            self.observer.lost(s, f"a request started while {name} was restored")
            return False
        s.restored(key, res.n_tokens, name, expect, tokens)
        if result is not None:
            result.restored = info
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
                await self.saver.save_if_worth(o, Occasion.KEYLESS)
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
