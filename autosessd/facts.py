"""The engine's facts that decide which files fit it, read again after every restart.

A file is handed to the engine only when it was saved for the engine's model (its
fingerprint), fits one of its slots (n_ctx) and its KV layout, and a return is matched by a
file's messages only under the chat template that made them (keys.chain's seed). The start
checks read these once (checks.py). An engine that restarts can come back with any of them
changed: another `-m`, `-c`, `--chat-template`, `--slot-save-path`. Restored under the old
facts, a file is another model's state (a fine-tune of the same shape loads it without a
word and answers from it), or one the engine refuses after writing part of it (llama.cpp
#27068), and a return is matched by marks whose tokens the new template no longer makes.

So a restart marks the facts stale (Sessions.engine_restarted), and the first call after it
that would save or restore reads them again (fresh): /props, and where the caller may
overwrite the slot (a turn, a restore) a probe save into it, which shows the engine still
saves into our directory and its files' KV streams. Until they are read, nothing is saved or
restored (a turn lets its request through as without autosessd); an engine that no longer
saves here, or not at all, turns saving and restoring off until its next restart, said once.
What changed is logged, counted (engine_changes) and said as an `engine_changed` event.

Not re-read: the number of slots (placement is fixed at start; a change is said, and
autosessd must be restarted to drive the new count) and whether the engine empties idle
slots (learned again from what it does: observe.emptied_by_engine).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable

from .checks import StartupError, probe_save
from .engines.base import EngineError, SlotSavingOff

if TYPE_CHECKING:
    from .context import Context

log = logging.getLogger("autosessd")

RETRY_S = 1.0  # an engine that does not answer yet (loading its model) is asked again after this


class EngineFacts:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.n_slots: int | None = None  # the slots autosessd drives (the facade sets it)
        # Asked again after the model or the template changed: may a return that goes on from
        # a file's messages be matched by them (recall.check_appends; the facade sets it)?
        self.check_template: Callable[[], Awaitable[object]] | None = None
        self.stale = False
        self.off: str | None = None  # why saving and restoring are off until the engine's next restart
        self._lock = asyncio.Lock()
        self._retry_at = 0.0

    @property
    def usable(self) -> bool:
        """Known and usable now: the turn's one check on its path (no await)."""
        return not self.stale and self.off is None

    async def ready(self, slot_id: int | None, probe: bool = True) -> bool:
        """fresh(), for a caller about to decide on a file (held: slot_id's ticket)."""
        return self.usable or await self.fresh(slot_id, probe)

    def restarted(self, why: str) -> None:
        log.info("engine: %s: what its slots held is gone; its model and settings are read again before the next "
                 "save or restore", why)
        self.stale = True
        self.off = None
        self._retry_at = 0.0

    async def fresh(self, slot_id: int | None, probe: bool = True) -> bool:
        """Whether files may be saved and restored now, the facts read again first when a
        restart made them stale. probe: the caller holds slot_id's ticket and may overwrite
        it (a probe save costs a save of what it holds); False: the layout is left for the
        caller's own save to teach (saves._learn_layout)."""
        if not self.stale:
            return self.off is None
        async with self._lock:
            if not self.stale:
                return self.off is None
            if time.monotonic() < self._retry_at:
                return False
            try:
                await self._read(slot_id if probe else None)
            except EngineError as e:
                self._retry_at = time.monotonic() + RETRY_S
                log.info("auto sessions: the engine's facts after its restart: %s; nothing is saved or restored "
                         "until they are read", e)
                return False
            self.stale = False
            return self.off is None

    async def _read(self, probe_slot: int | None) -> None:
        ctx = self.ctx
        info = await ctx.engine.info()
        layout = None
        off = None
        if probe_slot is not None:
            try:
                layout = await probe_save(ctx.engine, ctx.store, probe_slot)
            except SlotSavingOff:
                off = f"slot saving is off in the engine at {ctx.engine.address} since its restart"
            except StartupError as e:
                off = f"since its restart, {e}"
        changed: dict[str, tuple[object, object]] = {}
        if info.model != ctx.model:
            changed["model"] = (ctx.model_name or ctx.model, info.model_name or info.model)
        if info.template != ctx.template:
            changed["template"] = (ctx.template, info.template)
        if info.n_ctx != ctx.n_ctx:
            changed["n_ctx"] = (ctx.n_ctx, info.n_ctx)
        if layout is not None and ctx.engine_layout is not None and layout.n_stream != ctx.engine_layout.n_stream:
            changed["kv_streams"] = (ctx.engine_layout.n_stream, layout.n_stream)
        if "model" in changed:
            ctx.savings.switch_model(info.model)
            if ctx.remote is not None:
                ctx.remote.model = info.model
            ctx.model, ctx.model_name = info.model, info.model_name
        ctx.template, ctx.n_ctx = info.template, info.n_ctx
        if changed:
            # The probe's layout has only the streams (None without a probe): the next save
            # teaches the rest. Nothing of the old engine's layout stands.
            ctx.engine_layout = layout
        if self.n_slots is not None and info.total_slots != self.n_slots:
            log.warning("engine: %s now runs %d slot(s), autosessd drives %d (as at its start): restart autosessd "
                        "to drive the engine's slots as they are now", ctx.engine.address, info.total_slots,
                        self.n_slots)
        if off is not None:
            log.warning("auto sessions: %s: nothing is saved or restored until the engine restarts again", off)
            ctx.events.emit("engine_changed", off=off)
        self.off = off
        if not changed:
            return
        ctx.counters.engine_changes += 1
        said = ", ".join(f"{k} {a or '-'} → {b or '-'}" for k, (a, b) in changed.items())
        log.warning("engine: it restarted with another %s: files saved for the old one are not restored into it",
                    said)
        ctx.events.emit("engine_changed", **{k: [a, b] for k, (a, b) in changed.items()})
        if "model" in changed:
            from .upkeep import Upkeep

            ctx.swa_window = await Upkeep.swa_window(ctx)
        if self.check_template is not None and ("model" in changed or "template" in changed):
            await self.check_template()
