"""The engine's facts that decide which files fit it, read again after every restart.

A file is handed to the engine only when it was saved for the engine's model (its
fingerprint), fits one of its slots (n_ctx) and its KV layout, and a return is matched by a
file's messages only under the chat template that made them (keys.chain's seed). The start
checks read these once (checks.py). An engine that restarts can come back with any of them
changed: another `-m`, `-c`, `--chat-template`, `--slot-save-path`, `-fa`. Restored under the
old facts, a file is another model's state (a fine-tune of the same shape loads it without a
word and answers from it), or one the engine refuses after writing part of it (llama.cpp
#27068), and a return is matched by marks whose tokens the new template no longer makes.

So a restart marks the facts stale (Sessions.engine_restarted) and starts a new generation.
The first call after it that decides on a file reads them again (fresh): /props always; a
probe save before anything is restored (the caller holds the slot's ticket and may overwrite
it), which shows the engine still saves into our directory and its files' KV streams. A save
may go first without the probe: it checks the directory itself (its file must land here), and
one with state in it teaches the layout and stands for the probe. Until the facts are read,
nothing is saved or restored (a turn lets its request through as without autosessd, after
waiting LOCK_WAIT_S at most for another slot's read); an engine with slot saving off, or
saving elsewhere, gets no save or restore until its next restart, said once; a refused probe
(a full disk, a 5xx) is asked again after REFUSED_S. A restore decided in an earlier
generation is refused (a restart seen while the turn ran), and a read that a restart overtook
is made again. What changed is logged, counted (engine_changes) and said as an
`engine_changed` event.

Not re-read: the number of slots (placement is fixed at start; a change is said, and
autosessd must be restarted to drive the new count) and whether the engine empties idle
slots (learned again from what it does: observe.emptied_by_engine). The probe of an empty
slot shows the KV streams only; the rest of the layout (flash attention, cache types) comes
from the first save after the restart, as at the start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from ..engines import gguf
from ..engines.base import EngineError, EngineInfo, EngineRefused, SlotSavingOff
from .checks import SavesElsewhere, StartupError, probe_save
from .context import Context
from .report import fmt_tokens

log = logging.getLogger("autosessd")

RETRY_S = 1.0  # an engine that does not answer yet (loading its model) is asked again after this
REFUSED_S = 30.0  # one that refused the probe (a full disk, a 5xx) or cut it short: again after this
LOCK_WAIT_S = 1.0  # a turn waits this long at most for another slot's read of the facts


def facts_of(ctx: Context) -> Context:
    """ctx with its EngineFacts (the one place a Context gets them)."""
    ctx.facts = EngineFacts(ctx)
    return ctx


async def model_memory(ctx: Context) -> None:
    """What the model's memory is, from its file: ctx.swa_window (engine.swa_window when set,
    0: none) and ctx.recurrent (part of its state for the last token only)."""
    ctx.swa_window, ctx.recurrent = await _swa_window(ctx), await _recurrent(ctx)


async def _model_path(ctx: Context) -> str:
    path = (await ctx.engine.info()).model_path
    if not path:
        raise ValueError("the engine does not say where its model file is (/props model_path)")
    return path


async def _recurrent(ctx: Context) -> bool:
    if ctx.engine.kind != "llama-server":
        return False
    try:
        path = await _model_path(ctx)
        found = await asyncio.get_running_loop().run_in_executor(None, gguf.recurrent, path)
    except (EngineError, OSError, ValueError) as e:
        log.info("auto sessions: whether the model has recurrent layers is not known (%s)", e)
        return False
    if found:
        log.info("auto sessions: the model has recurrent layers (a hybrid or recurrent model): the engine reuses "
                 "a restore only for a request that goes on from its end, so a conversation is saved one token "
                 "before its last prompt's end")
    return found


async def _swa_window(ctx: Context) -> int | None:
    if ctx.cfg.engine.swa_window is not None:
        return ctx.cfg.engine.swa_window or None
    if ctx.engine.kind != "llama-server":
        return None
    try:
        path = await _model_path(ctx)
        n = await asyncio.get_running_loop().run_in_executor(None, gguf.sliding_window, path)
    except (EngineError, OSError, ValueError) as e:
        log.info("auto sessions: the model's sliding window is not known (%s); set engine.swa_window if it has "
                 "one (Gemma 2/3, ...), or restores of long files may not be reused", e)
        return None
    if n:
        log.info("auto sessions: the model has a sliding window of %s tokens: a file longer than that is "
                 "restored for a request that goes on from its end (a return), not for one that departs "
                 "earlier in it (an edit, a retry of an older turn: those are read again)", fmt_tokens(n))
    return n or None


class ProbeRefused(Exception):
    """The probe save after a restart was refused or cut short: a passing trouble, asked again."""


class EngineFacts:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.n_slots: int | None = None  # the slots autosessd drives (the facade sets it)
        # Asked again after the model or the template changed: may a return that goes on from
        # a file's messages be matched by them (recall.check_appends; the facade sets it)?
        self.check_template: Callable[[], Awaitable[object]] | None = None
        self.generation = 0  # one per engine process seen: a decision is good for its own only
        self.stale = False  # a restart since the facts were read
        self.probed = True  # the directory and KV streams checked since the last restart
        self.off: str | None = None  # why saving and restoring are off until the engine's next restart
        self._layout_before = None  # the engine's KV layout before its last restart (what changed)
        self._lock = asyncio.Lock()
        self._retry_at = 0.0

    @property
    def usable(self) -> bool:
        """Known and usable now: the turn's one check on its path (no await)."""
        return not self.stale and self.probed and self.off is None

    async def ready(self, slot_id: int, probe: bool = True, patient: bool = False) -> bool:
        """fresh(), for a caller about to decide on a file (held: slot_id's ticket)."""
        return self.usable or await self.fresh(slot_id, probe, patient)

    def restarted(self, why: str) -> None:
        log.info("engine: %s: what its slots held is gone; its model and settings are read again before the next "
                 "save or restore", why)
        self.generation += 1
        self.stale, self.probed, self.off = True, False, None
        self._retry_at = 0.0
        # Nothing is restored until the probe or a save teaches the new engine's layout (saves.
        # _learn_layout takes the first it sees); the old one is kept to say what changed.
        if self.ctx.engine_layout is not None:
            self._layout_before = self.ctx.engine_layout
        self.ctx.engine_layout = None

    def saved_here(self, generation: int) -> None:
        """A save of this generation's engine landed in our directory, with state in it: since a
        restart, the probe's question answered (saves._learn_layout took its layout)."""
        if generation == self.generation:
            self.probed = True

    def saves_elsewhere(self, why: str, generation: int) -> None:
        """A save since the restart, before any probe, did not land in our directory."""
        if self.off is None and not self.probed and generation == self.generation:
            self._turn_off(f"since its restart, {why}")

    async def fresh(self, slot_id: int, probe: bool = True, patient: bool = False) -> bool:
        """Whether files may be saved (probe False) or restored (probe True) now, the facts
        read again first when a restart made them stale. probe: the caller holds slot_id's
        ticket and may overwrite it (a probe save costs a save of what it holds); it has looked
        at the slot first (llama-server defers a slot action on a busy slot, and the read's lock
        is waited for LOCK_WAIT_S at most). patient: the caller has just seen the engine up
        (the tails' restore after a restart): asked now, whatever a failure a moment ago said."""
        while True:
            if self.off is not None:
                return False
            if self._known(probe):
                return True
            try:
                await asyncio.wait_for(self._lock.acquire(), LOCK_WAIT_S)
            except asyncio.TimeoutError:
                return False  # another slot's read waits on the engine: this request runs as without us
            try:
                if self.off is not None or self._known(probe):
                    continue
                if time.monotonic() < self._retry_at and not patient:
                    return False
                generation = self.generation
                try:
                    off = await self._read(slot_id if probe and not self.probed else None)
                except (EngineError, ProbeRefused) as e:
                    self._retry_at = time.monotonic() + (REFUSED_S if isinstance(e, ProbeRefused) else RETRY_S)
                    log.info("auto sessions: the engine's facts after its restart: %s; nothing is saved or restored "
                             "until they are read (asked again in %g s)", e, self._retry_at - time.monotonic())
                    return False
                if generation != self.generation:
                    continue  # another restart came meanwhile: read again, for it
                self.stale = False
                if off is not None:
                    self._turn_off(off)
            finally:
                self._lock.release()

    def _known(self, probe: bool) -> bool:
        """Read since the restart, and probed where the caller will restore."""
        return not self.stale and (self.probed or not probe)

    def _turn_off(self, why: str) -> None:
        self.off = why
        log.warning("auto sessions: %s: nothing is saved or restored until the engine restarts again", why)
        self.ctx.events.emit("engine_changed", engine=self.ctx.engine.address, off=why)

    async def _read(self, probe_slot: int | None) -> str | None:
        """/props (when stale) and the probe (probe_slot): the facts applied; → why saving is
        off for good (until the next restart), or None. A passing trouble (the engine not up
        yet, a probe refused or cut short) raises: asked again later."""
        ctx = self.ctx
        info = await ctx.engine.info() if self.stale else None
        changed: dict[str, tuple[object, object]] = {}
        if probe_slot is not None:
            try:
                layout = await probe_save(ctx.engine, ctx.store, probe_slot)
            except SlotSavingOff:
                return f"slot saving is off in the engine at {ctx.engine.address} since its restart"
            except SavesElsewhere as e:
                return f"since its restart, {e}"
            except (EngineRefused, StartupError) as e:  # a full disk, a 5xx, a file cut short
                raise ProbeRefused(f"the probe save: {e}") from None
            self.probed = True
            before = self._layout_before
            if before is not None and layout is not None and layout.n_stream != before.n_stream:
                changed["kv_streams"] = (before.n_stream, layout.n_stream)
            # The probe of an empty slot shows the streams only: the first save teaches the rest
            # (another -fa or cache type looks the same here: a limit, as at the start).
            if ctx.engine_layout is None:
                ctx.engine_layout = layout
        if info is not None:
            self._apply(info, changed)
        if not changed:
            return None
        ctx.counters.engine_changes += 1
        said = ", ".join(f"{k} {a or '-'} → {b or '-'}" for k, (a, b) in changed.items())
        log.warning("engine: it restarted with another %s: files saved for the old one are not restored into it",
                    said)
        ctx.events.emit("engine_changed", engine=ctx.engine.address, **{k: [a, b] for k, (a, b) in changed.items()})
        if "model" in changed:
            await model_memory(ctx)
        if self.check_template is not None and ("model" in changed or "template" in changed):
            await self.check_template()
        return None

    def _apply(self, info: EngineInfo, changed: dict[str, tuple[object, object]]) -> None:
        """/props's facts taken in; what differs from before added to `changed`."""
        ctx = self.ctx
        if info.model != ctx.model:
            changed["model"] = (ctx.model_name or ctx.model, info.model_name or info.model)
        if info.template != ctx.template:
            changed["template"] = (ctx.template, info.template)
        if info.n_ctx != ctx.n_ctx:
            changed["n_ctx"] = (ctx.n_ctx, info.n_ctx)
        if "model" in changed:
            ctx.savings.switch_model(info.model)
            ctx.model, ctx.model_name = info.model, info.model_name
        ctx.template, ctx.n_ctx = info.template, info.n_ctx
        if ctx.index is not None:
            ctx.index.max_tokens = ctx.max_tokens
        if ctx.remote is not None and changed.keys() & {"model", "template", "n_ctx"}:
            ctx.remote.engine_changed(ctx.model, ctx.max_tokens)  # its catalog listed the old model's saves
        if self.n_slots is not None and info.total_slots != self.n_slots:
            log.warning("engine: %s now runs %d slot(s), autosessd drives %d (as at its start): restart autosessd "
                        "to drive the engine's slots as they are now", ctx.engine.address, info.total_slots,
                        self.n_slots)
