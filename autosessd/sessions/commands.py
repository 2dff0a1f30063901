"""What autosessctl asks for, and the saves and restores of the inputs that do not run a turn:
the stop save, and the tail's save behind and restore after an engine restart. Each takes
the slot's ticket for its whole work (blocks on the slot's FIFO, then on the engine).

    park          save the held conversation now, whatever its size; with a name, to NAME.bin
    restore_now   restore auto-<KEY>.bin or a person's NAME.bin (the held one saved first)
    forget        KEY gone for good: every slot holding it emptied (the engine's too), its saves in
                  flight landed then removed with every file of its line (branches), the index's and
                  held.json's entries; only a new request of KEY brings it back
    save_at_stop  the stop: save if worth it and the engine is idle
    save_behind   the tail: after a request's end, save if the file is stale and nothing else
                  reached the slot meanwhile (its check)
    restore_behind  the tail, after an engine restart: restore what the slot held (the engine
                  log's tail: the file it last saved), trusted only if nothing reached the
                  slot meanwhile (not trusted: counted in restores_not_trusted)
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from ..base.keys import is_key
from ..engines.base import EngineError, SlotState
from ..shared import SharedError
from ..store.directory import AUTO_BIN, StoreError, auto_name, manual_name
from . import policy
from .policy import Held, Occasion, Save, SaveOutcome, Skip
from .report import TurnResult, fmt_bytes, fmt_tokens, skipped
from .slot import Phase

if TYPE_CHECKING:
    from .context import Context
    from .observe import Observer
    from .placement import Placement, Ticket
    from .restores import Restorer
    from .saves import Saver

log = logging.getLogger("autosessd")

FORGET_WAIT_S = 10.0  # how long forget waits for a reader of a file to let go (an upload, a restore)


class Commands:
    def __init__(self, ctx: Context, placement: Placement, observer: Observer, saver: Saver, restorer: Restorer):
        self.ctx = ctx
        self.placement = placement
        self.observer = observer
        self.saver = saver
        self.restorer = restorer

    async def park(self, slot_id: int | None = None, name: str | None = None) -> dict[str, Any]:
        target = manual_name(name) if name is not None else None
        async with await self.placement.admit(slot_id) as t:
            s = self.placement.slot_of(t)
            if not await self.observer.observe(s):
                raise StoreError(f"a request that did not come through autosessd is running on slot {s.id}")
            v = s.view
            held = v.conversation()
            if held is None and target is not None and v.phase is Phase.UNKNOWN:
                # What the slot holds has no key, but the person asked for it by name.
                held = Held(f"park-{s.id}", v.n_tokens, True)
            if held is None:
                raise StoreError(f"slot {s.id} holds no conversation autosessd can name ({v.phase.value}"
                                 f"{': ' + v.why if v.why else ''})")
            res = TurnResult(key=held.key)
            outcome = await self.saver.save(s, held, res, target)
            # The file it reports is on disk when it answers: a branch's name, a person's name
            # (kept under the conversation's key while it is finalized), or the conversation's.
            m = AUTO_BIN.match((res.saved or {}).get("file") or "")
            await self.saver.wait_file(m.group(1) if m else held.key)
        if outcome is not SaveOutcome.SAVED:
            raise StoreError("; ".join(res.errors + res.skipped) or "save failed")
        return res.saved or {}

    async def restore_now(self, what: str, slot_id: int | None = None) -> dict[str, Any]:
        ctx = self.ctx
        if is_key(what):
            key: str | None = what
            name = auto_name(what)
            if self.saver.facts(name).meta is None:  # a save still being finalized is one
                raise StoreError(f"no session {name} in {ctx.store.path}")
        else:
            key, name = None, manual_name(what)
            if not (ctx.store.path / name).is_file() and not (ctx.store.staging / name).is_file():
                raise StoreError(f"no session {name} in {ctx.store.path}")
        async with await self.placement.admit(slot_id) as t:
            s = self.placement.slot_of(t)
            if not await self.observer.observe(s):
                raise StoreError(f"a request that did not come through autosessd is running on slot {s.id}")
            if not await ctx.facts.ready(s.id):  # the model checked below is the engine's now
                raise StoreError(f"not now: {ctx.facts.off or 'the engine restarted and does not answer yet'}")
            decided = ctx.facts.generation
            meta = self.saver.facts(name).meta if key is not None else None
            if meta is not None and meta.model != ctx.model:
                raise StoreError(f"{name} was saved for another model ({meta.model}, engine has {ctx.model})")
            res = TurnResult(key=key)
            # Like a switch: the held conversation is saved before the restore replaces it.
            await self.saver.save_if_worth(s, Occasion.SWITCH if key else Occasion.KEYLESS, key, res)
            if not await self.restorer.restore(s, key, res, name, decided=decided):
                raise StoreError("; ".join(res.errors))
        return res.restored or {}

    async def forget(self, key: str) -> dict[str, Any]:
        """Conversation `key` gone (issue 38: people forget one to be rid of it, a secret pasted by
        mistake): no file of it appears again unless a new request of it arrives. In order:

          slots      each slot whose view holds it, at rest: its ticket taken (a turn saving it
                     now finishes first), the engine's slot emptied (it holds the conversation's
                     KV too), the view EMPTY; one running a request of it is a new request of
                     it and is left (said in the answer)
          in flight  every finalize landed (settled): a save of it already inside the engine
                     call when forget began is a file now, removed next
          files      auto-<key>.bin and every file of its line (branches: metadata line = key),
                     their index entries; one being read right now (a request of it) is kept
                     and said
          bucket     with [shared]: the saves of those names in the bucket, every host's
                     (Remote.forget); a bucket that does not answer is said, not retried
        The caller drops held.json's entries (the facade's Recorder). → what was done."""
        ctx = self.ctx
        emptied, running, erase_failed = [], [], []
        for s in list(self.placement.slots.values()):
            if s.view.key != key:
                continue
            if s.view.phase is Phase.SWITCHED:
                running.append(s.id)
                continue
            async with await self.placement.admit(s.id):
                v = s.view
                if v.key != key or not s.at_rest():
                    continue  # a turn of another conversation ran first, or a request of it now
                try:
                    await ctx.engine.erase(s.id)
                    s.erased()
                    emptied.append(s.id)
                except EngineError as e:
                    erase_failed.append(s.id)
                    self.observer.lost(s, f"{key} forgotten, but emptying the engine's slot failed: {e}")
        await self.saver.settled()
        loop = asyncio.get_running_loop()
        names = await loop.run_in_executor(None, self._files_of, key)
        freed, removed, kept = 0, [], []
        for name in names:
            try:
                freed += await self._remove_when_free(name)
                removed.append(name)
            except StoreError as e:
                kept.append(f"{name}: {e}")
                continue
            if ctx.index is not None:
                ctx.index.remove(name)
        # What quarantine holds of it (a file or a block found damaged) goes too: nothing of a
        # forgotten conversation stays anywhere autosessd wrote.
        freed += await loop.run_in_executor(None, ctx.store.forget_quarantined, {key} | {n[5:21] for n in names})
        bucket: list[str] = []
        if ctx.remote is not None:
            try:
                bucket = await ctx.remote.forget({auto_name(key), *names})
            except SharedError as e:
                kept.append(f"the bucket: {e}")
                log.warning("auto sessions: forgetting %s in the bucket: %s", key, e)
        if not (removed or emptied or running or kept or erase_failed or bucket):
            return {"key": key, "freed": 0, "files": [], "emptied_slots": [], "running_slots": [], "kept": [],
                    "erase_failed": [], "bucket": []}
        ctx.counters.forgets += 1
        log.info("auto sessions: forgot %s: %d file(s) removed (%s), %d slot(s) emptied%s", key, len(removed),
                 fmt_bytes(freed), len(emptied), f"; slots running a request of it now: {running}" if running else "")
        done = {"key": key, "freed": freed, "files": removed, "emptied_slots": emptied, "running_slots": running,
                "kept": kept, "erase_failed": erase_failed, "bucket": bucket}
        ctx.events.emit("forgot", **done)
        return done

    async def _remove_when_free(self, name: str, wait_s: float = FORGET_WAIT_S) -> int:
        """Remove a file of a forgotten conversation, once whoever reads it lets go (an upload
        assembling it, a restore reading it: both hold it for a moment only); StoreError when it
        is still held after wait_s (said in forget's answer as kept)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            try:
                return await loop.run_in_executor(None, self.ctx.store.remove, name[5:21])
            except StoreError:
                if loop.time() >= deadline or not self.ctx.store.users(name):
                    raise
            await asyncio.sleep(0.05)

    def _files_of(self, key: str) -> list[str]:
        """auto-<key>.bin and the files of its line (branches), as the directory has them."""
        return sorted(e.name for e in self.ctx.store.scan()
                      if e.key == key or (e.meta is not None and e.meta.line == key and not e.meta.prefix))

    async def save_at_stop(self, slot_id: int | None = None, why: str = "stop") -> bool:
        """Save the held conversation if it reached min tokens and the engine is idle (a running
        request's state is partial). The caller bounds it; it waits for its own finalize."""
        async with await self.placement.admit(slot_id) as t:
            s = self.placement.slot_of(t)
            st = await self.observer.look(s)
            if st is not None and st.is_processing:
                log.warning("auto sessions: %s save skipped: a request is running on slot %d and its state "
                            "is partial", why, s.id)
                return False
            await self.observer.observe(s)
            res = TurnResult(key=None)
            # The stop waits for every finalize anyway: decide on the files as they landed (a
            # finalize that failed leaves its conversation to this save, not to a Pending).
            await self.saver.settled()
            step, outcome = await self.saver.save_if_worth(s, Occasion.STOP, result=res)
            held = s.view.conversation()
            if step is None:
                log.info("auto sessions: %s: slot %d: %s", why, s.id, "; ".join(res.skipped) or
                         f"holds no conversation to save ({s.view.phase.value})")
                return False
            if isinstance(step, Skip):
                log.info("auto sessions: %s: slot %d holds %s tokens of %s: not saved (%s)", why, s.id,
                         fmt_tokens(held.n_tokens if held else None), step.key, step.reason)
                return step.reason == policy.UP_TO_DATE
        await self.saver.settled()
        return outcome is SaveOutcome.SAVED

    async def save_behind(self, slot_id: int, check: Callable[[SlotState | None], Awaitable[str | None]]) -> bool:
        """Save the held conversation if its file is stale, keeping the file only if check(the
        engine's slot as seen before the save) finds that nothing else reached the slot meanwhile."""
        async with await self.placement.admit(slot_id) as t:
            s = self.placement.slot_of(t)
            st = await self.observer.look(s)
            if st is not None and st.is_processing:
                return False
            step, outcome = await self.saver.save_if_worth(s, Occasion.BEHIND, check=lambda: check(st))
        return isinstance(step, Save) and outcome is SaveOutcome.SAVED

    async def restore_behind(self, slot_id: int, key: str, check: Callable[[], Awaitable[str | None]],
                             file_key: str | None = None) -> bool:
        """Restore auto-<file_key>.bin (default: auto-<key>.bin) as conversation `key` if the
        turn's rules allow it, and trust it only if check() finds that no request reached the
        slot meanwhile (the engine defers a restore on a busy slot, so it may land after
        someone's request)."""
        ctx = self.ctx
        file_key = file_key or key
        async with await self.placement.admit(slot_id) as t:
            s = self.placement.slot_of(t)
            if s.view.phase is Phase.RESTORED and s.view.file == auto_name(file_key):
                return False  # another caller put it back a moment ago (the start restore, an engine-log start)
            if not s.at_rest():
                return False  # the log shows a request on it
            if not ctx.facts.usable:  # a probe save (facts.py) on a busy slot would wait for it: look first
                st = await self.observer.look(s)
                if st is not None and st.is_processing or not await ctx.facts.fresh(s.id, patient=True):
                    return False
            decided = ctx.facts.generation
            file = await self.saver.wait_file(file_key)
            step = policy.plan_restore(None, file_key, SaveOutcome.NOT_TRIED, file, ctx.model, ctx.min_tokens,
                                       ctx.engine_layout)
            if isinstance(step, Skip):
                skipped(ctx.counters, step, None)
                return False
            if not await self.restorer.restore(s, key, None, auto_name(file_key), decided=decided):
                return False
            why = await check()
            if why:
                ctx.counters.restores_not_trusted += 1
                log.warning("auto sessions: the restore of %s is not trusted: %s", auto_name(file_key), why)
                self.observer.lost(s, why)
                return False
            # A restore runs no task: the slot's task id is still its last request's, in this
            # engine process (one that ran a request before we heard of a restart shows one).
            # Taken as the slot's own, so that neither the watch nor the next look counts it new.
            st = await self.observer.look(s)
            if st is not None and not st.is_processing:
                s.task_id = st.task_id
        return True

    async def put_away(self, why: str, then: Callable[[], Awaitable[None]] | None = None) -> int:
        """The engine is about to drop every slot's state (its model unloads, it goes to sleep):
        with every slot's ticket held (blocks on each FIFO), save each conversation worth it,
        wait for the finalizes, run `then` (the unload), and mark every slot lost with `why`.
        → how many were saved. A slot running a request that bypassed us is left as it is."""
        tickets = await self.placement.admit_all()
        try:
            saved = await self._save_all(tickets)
            if then is not None:
                await then()
            for t in tickets:
                self.observer.lost(self.placement.slot_of(t), why)
        finally:
            for t in tickets:
                t.release()
        return saved

    async def save_all_worth(self) -> int:
        """put_away without the drop: every conversation worth saving saved now, the slots
        keep theirs (the engine is about to sleep, sleep.py). → how many were saved."""
        tickets = await self.placement.admit_all()
        try:
            return await self._save_all(tickets)
        finally:
            for t in tickets:
                t.release()

    async def save_before_unplaced(self, tickets: list[Ticket]) -> int:
        """A request the engine places itself (embeddings, a batch of prompts, n_cmpl > 1) may
        take any idle slot: with every slot's ticket held (the caller's), each conversation worth
        saving is saved first (its file is usually up to date already: saved while idle). The
        finalizes need not land first: the engine wrote the bytes before it answered."""
        return await self._save_all(tickets, Occasion.KEYLESS, settle=False)

    async def _save_all(self, tickets: list[Ticket], occasion: Occasion = Occasion.UNLOAD, settle: bool = True) -> int:
        """Each ticket's slot observed, its conversation saved when worth it; the finalizes
        awaited (settle)."""
        saved = 0
        if settle:  # the files as they landed (above)
            await self.saver.settled()
        for t in tickets:
            s = self.placement.slot_of(t)
            if await self.observer.observe(s):
                step, outcome = await self.saver.save_if_worth(s, occasion)
                saved += isinstance(step, Save) and outcome is SaveOutcome.SAVED
        if settle:
            await self.saver.settled()
        return saved
