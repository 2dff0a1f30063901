"""Applies the turn (policy.py) through an engine and the store; owns what each slot holds.

Ordering, per engine slot:

    async with sessions.lock(slot):        # the slot's FIFO: one turn + request at a time
        result = await sessions.turn(key, slot)   # save held → restore key; never raises
        ... the request runs on the engine ...
        sessions.finish(slot, key, n_tokens, cache_n, status)

The save must finish before the restore: both target the same slot, and the restore
replaces the state the save reads. asyncio.Lock wakes waiters in FIFO order, so
requests run in the order they arrived. A save returns to the turn as soon as the
engine has written the temporary and its size checked out; the fsync/rename/metadata
(store.finalize) runs in a worker thread off the request's path, and a later restore or
save of the same key waits for it.

Every failure is caught here, logged as `auto sessions: <what>: <why>`, counted, and
turned into "do nothing": the request then runs exactly as it would without autosessd.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import psutil
from typing import Any, AsyncIterator, Awaitable, Callable

from . import __version__, policy
from .config import Config
from .engines.base import Engine, EngineError, SlotState
from .policy import FileInfo, Held, Restore, Save, SaveOutcome, Skip
from .store import Meta, Store, StoreError, auto_name, manual_name, temp_name

log = logging.getLogger("autosessd")

# Causes reported when a restore was not reused, most likely first.
NOT_REUSED_CAUSE = ("the engine did not reuse the restored state: a sliding-window model (Gemma 2/3, ...) "
                    "run without --swa-full, or a prompt that no longer starts with the saved conversation")


def fmt_tokens(n: int) -> str:
    return f"{n:,}"


def fmt_bytes(n: int) -> str:
    if n >= 100e6:
        return f"{n / 1e9:.2f} GB"
    if n >= 100e3:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e3:.1f} kB"


@dataclass
class Counters:
    turns: int = 0
    saves: int = 0
    restores: int = 0
    save_failures: int = 0
    restore_failures: int = 0
    skipped_min_tokens: int = 0
    skipped_no_file: int = 0
    skipped_model_mismatch: int = 0
    skipped_disk_full: int = 0
    skipped_engine_busy: int = 0
    saves_discarded: int = 0
    restores_reused: int = 0
    restores_not_reused: int = 0
    engine_resets: int = 0
    bytes_saved: int = 0
    bytes_restored: int = 0
    ms_saved: float = 0.0
    ms_restored: float = 0.0
    prefill_tokens_avoided: int = 0
    bad_log_lines: int = 0
    pruned_files: int = 0
    pruned_bytes: int = 0


@dataclass
class Slot:
    id: int
    held: Held | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    restored: int | None = None  # tokens restored by the last turn, until a response verifies them
    busy: bool = False  # a request of ours is running on it


@dataclass
class TurnResult:
    key: str | None
    saved: dict[str, Any] | None = None
    restored: dict[str, Any] | None = None
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Events:
    """Recent events for `events`, and live followers. A follower that falls behind by
    more than its queue is dropped rather than slowing the daemon down."""

    def __init__(self, keep: int = 1000):
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self._followers: set[asyncio.Queue] = set()
        self._seq = 0

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        ev = {"seq": self._seq, "ts": round(time.time(), 3), "type": type_, **fields}
        self.recent.append(ev)
        for q in list(self._followers):
            try:
                q.put_nowait(ev)
            except asyncio.QueueFull:
                self._followers.discard(q)
                with contextlib.suppress(asyncio.QueueFull):
                    q.get_nowait()
                    q.put_nowait(None)  # None tells the follower it was dropped
        return ev

    @contextlib.contextmanager
    def follow(self, maxsize: int = 1000):
        q: asyncio.Queue = asyncio.Queue(maxsize)
        self._followers.add(q)
        try:
            yield q
        finally:
            self._followers.discard(q)


class Sessions:
    def __init__(self, cfg: Config, engine: Engine, store: Store, model: str, model_name: str = ""):
        self.cfg = cfg
        self.engine = engine
        self.store = store
        self.model = model
        self.model_name = model_name
        self.counters = Counters()
        self.events = Events()
        self.slots: dict[int, Slot] = {}
        self.last_not_reused: dict[str, Any] | None = None
        self.started_at = time.time()
        self.inputs: dict[str, Callable[[], Any]] = {}  # filled by the daemon: name → describe()
        self.engine_healthy: bool | None = None
        self._finalizing: dict[str, asyncio.Future] = {}
        self._prune_task: asyncio.Task | None = None
        self._free_target = 0  # bytes a refused save needed free; the next prune makes room
        # Called (awaited) after the engine came back from a restart; the tail restores then.
        self.on_engine_restart: list[Callable[[], Awaitable[None]]] = []

    # -- slots -----------------------------------------------------------------
    def slot(self, slot_id: int | None = None) -> Slot:
        sid = self.cfg.engine.slot if slot_id is None else slot_id
        if sid not in self.slots:
            self.slots[sid] = Slot(sid)
        return self.slots[sid]

    async def engine_slot(self, slot_id: int) -> SlotState | None:
        """What the engine itself says of one slot (EngineError when it cannot say)."""
        return next((x for x in await self.engine.slots() if x.id == slot_id), None)

    @contextlib.asynccontextmanager
    async def lock(self, slot_id: int | None = None) -> AsyncIterator[Slot]:
        s = self.slot(slot_id)
        async with s.lock:
            yield s

    def reset_held(self, slot_id: int | None, why: str) -> None:
        """The engine lost what it held (a restart): forget it, so the next request of the
        held conversation restores it instead of trusting a state that is gone."""
        s = self.slot(slot_id)
        if s.held is not None:
            log.info("auto sessions: engine no longer holds %s (%s); the next request restores it",
                     s.held.key, why)
            self.events.emit("engine_reset", slot=s.id, key=s.held.key, why=why)
            self.counters.engine_resets += 1
        s.held = None
        s.restored = None

    # -- the turn --------------------------------------------------------------
    async def turn(self, key: str | None, slot_id: int | None = None, check_engine: bool = True) -> TurnResult:
        """Runs DESIGN §1 for a request of conversation `key`. The caller holds the slot's
        lock. Never raises (cancellation aside): on any failure the request goes on."""
        s = self.slot(slot_id)
        result = TurnResult(key=key)
        if key is None or not self.cfg.auto_sessions:
            return result
        t0 = time.monotonic()
        self.counters.turns += 1
        try:
            if check_engine and s.held is not None:
                if not await self._engine_still_holds(s, result):
                    return result
            await self._turn(s, key, result)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug must not fail the request either
            log.exception("auto sessions: turn for %s: %s", key, e)
            result.errors.append(f"internal error: {e}")
        finally:
            result.ms = round((time.monotonic() - t0) * 1000, 2)
            if key is not None and self.cfg.auto_sessions:
                self.events.emit("turn", slot=s.id, **result.to_dict())
        self.schedule_prune()
        return result

    async def _engine_still_holds(self, s: Slot, result: TurnResult) -> bool:
        """Compares what the engine's slot shows with what we think it holds. False when
        the turn must not touch the slot at all (someone else's request is running)."""
        try:
            st = await self.engine_slot(s.id)
        except EngineError as e:
            log.debug("auto sessions: slot check skipped: %s", e)
            return True
        if st is None:
            return True
        if st.is_processing:
            # Not ours (we hold the FIFO): a save now would wait for it and capture its state.
            msg = "slot busy with a request that did not come through autosessd"
            log.warning("auto sessions: skipped turn: %s", msg)
            result.skipped.append(msg)
            self.counters.skipped_engine_busy += 1
            s.held, s.restored = None, None
            return False
        assert s.held is not None
        if not self._adopt_unseen_end(s, st) and (st.n_tokens == 0 or st.n_tokens < s.held.n_tokens * 0.9):
            self.reset_held(s.id, f"its slot shows {st.n_tokens:,} tokens, {s.held.n_tokens:,} were held")
        return True

    def _adopt_unseen_end(self, s: Slot, st: SlotState) -> bool:
        """The held conversation's request ran without us seeing its end (turn hook, tail):
        what the idle slot holds now is its state, and its cache_n verifies a restore."""
        if s.held is None or s.held.n_tokens != 0 or st.n_tokens == 0:
            return False
        self.finish(s.id, s.held.key, st.n_tokens, st.n_cached, "ok")
        return True

    async def _turn(self, s: Slot, key: str, result: TurnResult) -> None:
        held = s.held
        if held is not None and held.key == key:
            return
        outcome = SaveOutcome.NOT_TRIED
        if held is not None:
            step = policy.plan_save(held, key, self.cfg.auto_sessions_min_tokens,
                                    self._file_info(held.key), self.model)
            if isinstance(step, Save):
                outcome = await self._save(s, held, result)
            elif isinstance(step, Skip):
                self._skipped(step, result)
        file = await self._wait_file(key)
        step = policy.plan_restore(held, key, outcome, file, self.model, self.cfg.auto_sessions_min_tokens)
        if isinstance(step, Restore):
            await self._restore(s, key, result)
        else:
            if isinstance(step, Skip):
                self._skipped(step, result)
            # Whether or not anything was restored, the engine holds `key` once this
            # request has run (by prefill, when nothing was restored).
            s.held, s.restored = Held(key, 0, durable=False), None

    def _skipped(self, step: Skip, result: TurnResult) -> None:
        name = auto_name(step.key)
        msg = f"skipped {step.what} of {name}: {step.reason}"
        result.skipped.append(msg)
        counter = {policy.BELOW_MIN: "skipped_min_tokens", policy.NO_FILE: "skipped_no_file",
                   policy.MODEL_MISMATCH: "skipped_model_mismatch"}.get(step.reason)
        if counter:
            setattr(self.counters, counter, getattr(self.counters, counter) + 1)
        # "no file" is the normal first sight of a conversation: not worth an INFO line.
        (log.debug if step.reason in (policy.NO_FILE, policy.UP_TO_DATE) else log.info)("auto sessions: %s", msg)

    def _file_info(self, key: str) -> FileInfo | None:
        meta = self.store.read_meta(key)
        return FileInfo(meta.n_tokens, meta.model) if meta else None

    async def _wait_file(self, key: str) -> FileInfo | None:
        pending = self._finalizing.get(key)
        if pending is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(pending)
        return self._file_info(key)

    # -- save --------------------------------------------------------------------
    async def _save(self, s: Slot, held: Held, result: TurnResult | None, target: str | None = None,
                    check: Callable[[], Awaitable[str | None]] | None = None) -> SaveOutcome:
        """Save what slot s holds to auto-<held.key>.bin (or to the manual file `target`).

        `check`, when given, runs after the engine wrote the temporary: a reason it returns
        means the state may not be the held conversation's, and the temporary is dropped."""
        key = held.key
        final = target or auto_name(key)
        what = f"save to {final}"
        await self._wait_file(key)
        short = self.store.check_space(held.n_tokens)
        if short:
            # The prune after this turn evicts the oldest auto files until the next save fits.
            self._free_target = max(self._free_target, self.store.space_needed(held.n_tokens))
            self.counters.skipped_disk_full += 1
            self.counters.save_failures += 1
            return self._save_failed(what, short, key, result)
        t0 = time.monotonic()
        tmp = temp_name(key)
        self.events.emit("saving", slot=s.id, key=key, file=final, n_tokens=held.n_tokens)
        self.store.acquire(final)
        handed_off = False
        try:
            try:
                res = await self.engine.save(s.id, tmp)
            except EngineError as e:
                self.store.discard_temp(key)
                self.counters.save_failures += 1
                return self._save_failed(what, str(e), key, result)
            try:
                self.store.verify_temp(key, res.n_bytes, self.engine.magic)
            except StoreError as e:
                self.store.discard_temp(key)
                self.counters.save_failures += 1
                return self._save_failed(what, str(e), key, result)
            if res.n_tokens == 0:
                self.store.discard_temp(key)
                self.counters.save_failures += 1
                return self._save_failed(what, "the engine's slot was empty (0 tokens saved)", key, result)
            why = await check() if check is not None else None
            if why:
                self.store.discard_temp(key)
                self.counters.saves_discarded += 1
                log.warning("auto sessions: %s discarded: %s", what, why)
                self.events.emit("save_discarded", slot=s.id, key=key, why=why)
                return SaveOutcome.FAILED
            ms = (time.monotonic() - t0) * 1000
            meta = Meta(key=key, n_tokens=res.n_tokens, bytes=res.n_bytes, saved_at=time.time(),
                        model=self.model, save_ms=round(res.ms, 2))
            fut = asyncio.get_running_loop().run_in_executor(None, self._finalize, key, meta, target)
            self._finalizing[key] = fut
            fut.add_done_callback(lambda f: self._finalized(key, final, f))
            handed_off = True
        finally:
            if not handed_off:
                self.store.release(final)
        if s.held is not None and s.held.key == key and target is None:
            # The engine's count is the truth (a client's usage may differ by one).
            s.held = Held(key, res.n_tokens, s.held.durable)
        self.counters.saves += 1
        self.counters.bytes_saved += res.n_bytes
        self.counters.ms_saved += res.ms
        log.info("auto sessions: saved %s tokens (%s) to %s in %.0f ms", fmt_tokens(res.n_tokens),
                 fmt_bytes(res.n_bytes), final, ms)
        info = {"key": key, "file": final, "n_tokens": res.n_tokens, "bytes": res.n_bytes,
                "engine_ms": round(res.ms, 2), "ms": round(ms, 2)}
        self.events.emit("saved", slot=s.id, **info)
        if result is not None:
            result.saved = info
        return SaveOutcome.SAVED

    def _finalize(self, key: str, meta: Meta, target: str | None) -> None:
        if target is None:
            self.store.finalize(key, meta)
        else:
            self.store.finalize_manual(key, target)

    def _finalized(self, key: str, final: str, fut: asyncio.Future) -> None:
        if self._finalizing.get(key) is fut:
            del self._finalizing[key]
        self.store.release(final)
        exc = fut.exception() if not fut.cancelled() else None
        if exc is not None:
            self.counters.save_failures += 1
            self.store.discard_temp(key)
            if final == auto_name(key) and self.store.read_meta(key) is None:
                with contextlib.suppress(StoreError, OSError):
                    self.store.remove(key)
            log.error("auto sessions: finalize of %s: %s", final, exc)
            self.events.emit("save_failed", key=key, file=final, error=str(exc))

    def _save_failed(self, what: str, why: str, key: str, result: TurnResult | None) -> SaveOutcome:
        log.warning("auto sessions: %s: %s", what, why)
        self.events.emit("save_failed", key=key, error=why)
        if result is not None:
            result.errors.append(f"{what}: {why}")
        return SaveOutcome.FAILED

    # -- restore -----------------------------------------------------------------
    async def _restore(self, s: Slot, key: str, result: TurnResult | None, name: str | None = None) -> bool:
        name = name or auto_name(key)
        t0 = time.monotonic()
        try:
            with self.store.using(name):
                res = await self.engine.restore(s.id, name)
        except EngineError as e:
            self.counters.restore_failures += 1
            log.warning("auto sessions: restore of %s: %s", name, e)
            self.events.emit("restore_failed", slot=s.id, key=key, file=name, error=str(e))
            if result is not None:
                result.errors.append(f"restore of {name}: {e}")
            # llama-server clears the slot after a failed restore: it holds nothing now.
            s.held, s.restored = Held(key, 0, durable=False), None
            return False
        ms = (time.monotonic() - t0) * 1000
        self.counters.restores += 1
        self.counters.bytes_restored += res.n_bytes
        self.counters.ms_restored += res.ms
        s.held, s.restored = Held(key, res.n_tokens, durable=True), res.n_tokens
        log.info("auto sessions: restored %s tokens from %s in %.0f ms", fmt_tokens(res.n_tokens), name, ms)
        info = {"key": key, "file": name, "n_tokens": res.n_tokens, "bytes": res.n_bytes,
                "engine_ms": round(res.ms, 2), "ms": round(ms, 2)}
        self.events.emit("restored", slot=s.id, **info)
        if result is not None:
            result.restored = info
        return True

    # -- after the request -------------------------------------------------------
    def finish(self, slot_id: int | None, key: str | None, n_tokens: int | None = None,
               cache_n: int | None = None, status: str = "ok", n_prompt: int | None = None) -> None:
        """The request of `key` ended: update the held token count and durability, and
        verify a restore from the engine's timings.cache_n."""
        if key is None or not self.cfg.auto_sessions:
            return
        s = self.slot(slot_id)
        if s.held is None or s.held.key != key:
            s.held = Held(key, 0, durable=False)
        tokens = n_tokens if n_tokens is not None else s.held.n_tokens
        s.held = Held(key, tokens, durable=(status == "ok"))
        if s.restored is not None and cache_n is not None:
            n_restored, s.restored = s.restored, None
            if policy.restore_reused(n_restored, cache_n, n_prompt):
                self.counters.restores_reused += 1
                self.counters.prefill_tokens_avoided += cache_n
                self.events.emit("restore_reused", slot=s.id, key=key, cache_n=cache_n, n_restored=n_restored)
            else:
                self.counters.restores_not_reused += 1
                cause = NOT_REUSED_CAUSE
                if n_prompt is not None and n_prompt < n_restored:
                    cause = (f"the prompt ({fmt_tokens(n_prompt)} tokens) is shorter than the restored conversation: "
                             f"the client cut it, and the engine read the prompt again instead of cutting its "
                             f"state back")
                self.last_not_reused = {"key": key, "n_restored": n_restored, "cache_n": cache_n,
                                        "at": time.time(), "likely_cause": cause}
                log.warning("auto sessions: restored %s tokens of %s but the engine reused %s "
                            "(timings.cache_n): %s", fmt_tokens(n_restored), auto_name(key),
                            fmt_tokens(cache_n), cause)
                self.events.emit("restore_not_reused", slot=s.id, key=key, cache_n=cache_n,
                                 n_restored=n_restored)
        elif status != "ok":
            s.restored = None

    # -- commands ----------------------------------------------------------------
    async def park(self, slot_id: int | None = None, name: str | None = None) -> dict[str, Any]:
        """Save the held conversation now, whatever its size; with a name, to NAME.bin."""
        s = self.slot(slot_id)
        target = manual_name(name) if name is not None else None
        async with s.lock:
            if s.held is None:
                raise StoreError("nothing is held: no conversation has run through autosessd on this slot")
            res = TurnResult(key=s.held.key)
            outcome = await self._save(s, s.held, res, target)
            await self._wait_file(s.held.key)
        if outcome is not SaveOutcome.SAVED:
            raise StoreError("; ".join(res.errors) or "save failed")
        return res.saved or {}

    async def restore_now(self, what: str, slot_id: int | None = None) -> dict[str, Any]:
        """Restore auto-<KEY>.bin or a manual NAME.bin into the slot."""
        from .keys import is_key

        s = self.slot(slot_id)
        if is_key(what):
            key, name = what, auto_name(what)
            meta = self.store.read_meta(key)
            if meta is None:
                raise StoreError(f"no session {name} in {self.store.path}")
            if meta.model != self.model:
                raise StoreError(f"{name} was saved for another model ({meta.model}, engine has {self.model})")
        else:
            name = manual_name(what)
            if not (self.store.path / name).is_file():
                raise StoreError(f"no session {name} in {self.store.path}")
            key = name
        async with s.lock:
            res = TurnResult(key=key)
            if not await self._restore(s, key, res, name):
                raise StoreError("; ".join(res.errors))
        return res.restored or {}

    def forget(self, key: str) -> int:
        freed = self.store.remove(key)
        for s in self.slots.values():
            if s.held is not None and s.held.key == key:
                s.held = Held(key, s.held.n_tokens, durable=False)
        self.events.emit("forgot", key=key, bytes=freed)
        return freed

    async def save_held(self, slot_id: int | None = None, why: str = "stop") -> bool:
        """Save the held conversation if it reached min tokens and the engine is idle
        (a running request's state is partial). Used on a normal stop."""
        s = self.slot(slot_id)
        if s.held is None:
            log.info("auto sessions: %s: nothing held on slot %d, nothing to save", why, s.id)
            return False
        try:
            st = await self.engine_slot(s.id)
        except EngineError as e:
            log.warning("auto sessions: %s save skipped: %s", why, e)
            return False
        if st is None or st.is_processing:
            log.warning("auto sessions: %s save skipped: a request is running on slot %d and its state "
                        "is partial", why, s.id)
            return False
        self._adopt_unseen_end(s, st)
        if s.held.n_tokens < max(1, self.cfg.auto_sessions_min_tokens):
            log.info("auto sessions: %s: %s holds %s tokens, below min tokens: not saved", why,
                     auto_name(s.held.key), fmt_tokens(s.held.n_tokens))
            return False
        info = self._file_info(s.held.key)
        if info and info.n_tokens == s.held.n_tokens and info.model == self.model:
            log.info("auto sessions: %s: %s is up to date", why, auto_name(s.held.key))
            return True
        outcome = await self._save(s, s.held, None)
        await self.drain()
        return outcome is SaveOutcome.SAVED

    async def save_checked(self, slot_id: int, key: str, n_tokens: int,
                           check: Callable[[int], Awaitable[str | None]]) -> bool:
        """Save behind (tail): save `key`, which the idle slot holds with n_tokens, keeping
        the file only if check(n_tokens) finds nothing else reached the slot meanwhile."""
        s = self.slot(slot_id)
        outcome = await self._save(s, Held(key, n_tokens, True), None, check=lambda: check(n_tokens))
        return outcome is SaveOutcome.SAVED

    async def restore_quietly(self, slot_id: int, key: str) -> bool:
        """Restore auto-<key>.bin if the turn's rules allow it (after an engine restart)."""
        s = self.slot(slot_id)
        file = await self._wait_file(key)
        step = policy.plan_restore(None, key, SaveOutcome.NOT_TRIED, file, self.model,
                                   self.cfg.auto_sessions_min_tokens)
        if isinstance(step, Skip):
            self._skipped(step, TurnResult(key=key))
            return False
        return await self._restore(s, key, None)

    # -- prune -------------------------------------------------------------------
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
        keep = self.cfg.auto_sessions_keep if keep is None else keep
        max_bytes = int((self.cfg.auto_sessions_max_gb if max_gb is None else max_gb) * 1e9)
        free_target, self._free_target = (0, self._free_target) if dry_run else (self._free_target, 0)
        plan = await asyncio.get_running_loop().run_in_executor(None, self.store.prune, keep, max_bytes, dry_run,
                                                                free_target)
        removed = [{"key": e.key, "file": e.name, "bytes": e.bytes} for e in plan.remove]
        if removed and not dry_run:
            self.counters.pruned_files += len(removed)
            self.counters.pruned_bytes += plan.freed
            for r in removed:
                log.info("auto sessions: pruned %s (%s)", r["file"], fmt_bytes(r["bytes"]))
            self.events.emit("pruned", files=[r["file"] for r in removed], bytes=plan.freed)
        return {"removed": removed, "freed": plan.freed, "dry_run": dry_run, "kept": len(plan.keep)}

    async def drain(self) -> None:
        """Wait for every background finalize and prune (at shutdown, and in tests)."""
        while self._finalizing or (self._prune_task and not self._prune_task.done()):
            pending = list(self._finalizing.values())
            if self._prune_task and not self._prune_task.done():
                pending.append(self._prune_task)
            await asyncio.gather(*pending, return_exceptions=True)

    # -- engine restarts -----------------------------------------------------------
    def engine_identity(self) -> tuple[int, float] | None:
        """(pid, start time) of the process listening on the engine's port, when it runs on
        this host and is visible to us; None otherwise. Blocking (psutil)."""
        u = urlsplit(self.cfg.engine.url)
        if self.cfg.engine.kind != "llama-server" or u.hostname not in ("127.0.0.1", "localhost", "::1"):
            return None
        port = u.port or (443 if u.scheme == "https" else 80)
        try:
            for c in psutil.net_connections("tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                    return c.pid, psutil.Process(c.pid).create_time()
        except (psutil.Error, OSError):
            return None
        return None

    async def watch_engine(self, every_s: float = 2.0, identity_every_s: float = 10.0) -> None:
        """Notice the engine restarting: /health going down and up, or another process on
        its port. Either way what it held is gone: reset, and tell on_engine_restart."""
        loop = asyncio.get_running_loop()
        identity = await loop.run_in_executor(None, self.engine_identity)
        last_identity_check = time.monotonic()
        up_before = True
        while True:
            await asyncio.sleep(every_s)
            try:
                up = await self.engine.health()
            except EngineError:
                up = False
            self.engine_healthy = up
            restarted = None
            if not up and up_before:
                log.warning("engine: %s is down", self.engine.address)
            elif up and not up_before:
                log.info("engine: %s is back", self.engine.address)
                restarted = "the engine restarted (health went down and up)"
            up_before = up
            if up and restarted is None and time.monotonic() - last_identity_check >= identity_every_s:
                last_identity_check = time.monotonic()
                ident = await loop.run_in_executor(None, self.engine_identity)
                if ident and identity and ident != identity:
                    restarted = f"another engine process (pid {ident[0]}) took its port"
                identity = ident or identity
            if restarted:
                for sid in list(self.slots):
                    self.reset_held(sid, restarted)
                for callback in list(self.on_engine_restart):
                    try:
                        await callback()
                    except Exception as e:
                        log.warning("engine restart handling: %s", e)

    # -- status ------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        entries = self.store.scan(with_meta=False)
        try:
            free = self.store.free_bytes()
        except OSError:
            free = None
        return {
            "version": __version__,
            "uptime_s": round(time.time() - self.started_at, 1),
            "auto_sessions": self.cfg.auto_sessions,
            "engine": {"kind": self.engine.kind, "url": self.engine.address, "healthy": self.engine_healthy,
                       "model": self.model_name, "model_fingerprint": self.model, "slots": len(self.slots) or 1},
            "slots": [{"id": s.id, "held": s.held.key if s.held else None,
                       "n_tokens": s.held.n_tokens if s.held else 0,
                       "durable": s.held.durable if s.held else None, "busy": s.busy}
                      for s in sorted(self.slots.values(), key=lambda x: x.id)],
            "counters": asdict(self.counters),
            "last_not_reused": self.last_not_reused,
            "store": {"path": str(self.store.path), "auto_files": len(entries),
                      "auto_bytes": sum(e.bytes for e in entries), "free_bytes": free,
                      "min_tokens": self.cfg.auto_sessions_min_tokens, "keep": self.cfg.auto_sessions_keep,
                      "max_gb": self.cfg.auto_sessions_max_gb},
            "inputs": {name: describe() for name, describe in self.inputs.items()},
        }

    def ls(self) -> list[dict[str, Any]]:
        """Every session file: ours (auto) and people's (manual), newest first."""
        held = {s.held.key for s in self.slots.values() if s.held}
        rows = [{"name": e.name, "kind": "auto", "key": e.key, "bytes": e.bytes, "saved_at": e.saved_at,
                 "n_tokens": e.meta.n_tokens if e.meta else None, "model_ok": bool(e.meta and
                                                                                    e.meta.model == self.model),
                 "held": e.key in held} for e in self.store.scan()]
        rows += [{"name": name, "kind": "manual", "key": None, "bytes": size, "saved_at": mtime, "n_tokens": None,
                  "model_ok": None, "held": False} for name, size, mtime in self.store.manual_files()]
        return sorted(rows, key=lambda r: r["saved_at"], reverse=True)

    # -- what was held at the last stop --------------------------------------------
    def state_file(self) -> Path:
        return self.cfg.effective_state_dir() / "held.json"

    def record_held(self) -> None:
        """Remember the held conversations (for a restore after a restart)."""
        data = {"model": self.model, "slots": {str(s.id): {"key": s.held.key, "n_tokens": s.held.n_tokens}
                                               for s in self.slots.values() if s.held}}
        path = self.state_file()
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("auto sessions: could not record the held conversation in %s: %s", path, e)

    def recorded_held(self) -> dict[int, str]:
        try:
            data = json.loads(self.state_file().read_text())
            if data.get("model") != self.model:
                return {}
            return {int(k): str(v["key"]) for k, v in data.get("slots", {}).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}
