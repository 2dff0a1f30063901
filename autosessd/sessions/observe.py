"""Believe the engine, not the bookkeeping (STYLE §14): what the engine says of a slot,
brought into the slot's state machine (slot.py).

How the engine's truth is read: the token count from its save/restore answers and from GET
/slots (`n_prompt_tokens`), a request that bypassed the FIFO from the slot's task id
(`id_task`), a restore's reuse from `timings.cache_n` (the gate's response), a request-log
line's `cache_n`, or GET /slots while the request runs (turn hook, tail: llama-server resets
the slot's counters when a request ends). An engine that hides its slots (--no-slots) leaves
counts to the responses and cannot show requests that bypass the gate.

    observe(s)   before acting on a slot (its ticket held): a SWITCHED whose end was not seen
                 (the turn hook) is settled as ended; a task we did not let through, or
                 another token count → lost; the look is kept for the launch gate
    end(s, ...)  a request's end: settle, and verify a restore by cache_n
    lost(s, why) the slot's contents changed behind our back (counted, said)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from ..engines.base import EngineError, SlotsHidden, SlotState
from ..store.directory import auto_name
from . import policy
from .report import TurnResult, fmt_tokens
from .slot import TASK_UNSEEN, Phase, Slot

if TYPE_CHECKING:
    from .context import Context
    from .launch import Launch

log = logging.getLogger("autosessd")

# Causes reported when a restore was not reused, most likely first.
NOT_REUSED_CAUSE = ("the engine did not reuse the restored state: a sliding-window model (Gemma 2/3, ...) "
                    "run without --swa-full, or a prompt that no longer starts with the saved conversation")
WATCH_EVERY_S = 0.025  # GET /slots while a request whose restore awaits verification runs (hook, tail)
# llama-server notices that a client of a non-streaming request went away only when its
# handler's wait for results times out (HTTP_POLLING_SECONDS, 1 s), and every GET /slots
# answer wakes that wait and starts its second again (server_response::recv_with_timeout).
# So while such a request may still run after its client left, GET /slots is asked at most
# once per QUIET_GAP_S: polling faster would keep the engine generating for nobody.
QUIET_GAP_S = 1.3
EMPTIED = "the engine emptied the idle slot (moved to its RAM cache)"
UNLOADED = "the router unloaded its model"  # models.py: a model switch behind llama-server's router
SLEPT = "the engine went to sleep (--sleep-idle-seconds): it freed its model"  # sleep.py


class Observer:
    def __init__(self, ctx: Context, launch: Launch):
        self.ctx = ctx
        self.launch = launch
        self._quiet = 0  # requests whose clients left and whose engine task may still run
        self._last_look = 0.0  # time.monotonic() of the last GET /slots

    @contextlib.contextmanager
    def quiet(self):
        """While a request whose client went away may still run on the engine: GET /slots at
        most once per QUIET_GAP_S (see there), so the engine can notice and stop it."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    # -- reading the engine ----------------------------------------------------------------
    async def engine_slot(self, slot_id: int) -> SlotState | None:
        """What the engine itself says of one slot (EngineError when it cannot say). Waits for
        its turn while quiet()."""
        while self._quiet and (left := self._last_look + QUIET_GAP_S - time.monotonic()) > 0:
            await asyncio.sleep(left)
        self._last_look = time.monotonic()
        return next((x for x in await self.ctx.engine.slots() if x.id == slot_id), None)

    async def look(self, s: Slot) -> SlotState | None:
        """GET /slots for one slot; None when the engine hides its slots or cannot answer."""
        if not self.ctx.slots_visible:
            return None
        try:
            return await self.engine_slot(s.id)
        except SlotsHidden:
            self.ctx.slots_visible = False
            log.warning("engine: GET /slots is off now (--no-slots): token counts come from responses")
        except EngineError as e:
            log.debug("auto sessions: slot %d: cannot read the engine's slot: %s", s.id, e)
        return None

    async def observe(self, s: Slot, result: TurnResult | None = None) -> bool:
        """Bring the slot's view up to date with the engine before acting on it (the caller
        holds the slot's ticket). False when a request we did not let through is running:
        a save now would wait for it and capture its state."""
        before = self.launch.before_look(s)
        st = await self.look(s)
        self.launch.looked(s, before, st)
        v = s.view
        if st is not None and st.is_processing:
            msg = "slot busy with a request that did not come through autosessd"
            log.warning("auto sessions: skipped turn: %s", msg)
            if result is not None:
                result.skipped.append(msg)
            self.ctx.counters.skipped_engine_busy += 1
            self.lost(s, msg)
            return False
        if v.phase is Phase.SWITCHED:
            # Its end was not seen (turn hook): the serving layer runs one request at a time,
            # so it has ended; whether it ran at all, the engine's task id says.
            ran = st is None or st.task_id != s.task_id
            self.settle(s, "ok" if ran else "not_run", st, None, None, None)
        elif st is not None and v.phase in (Phase.HELD, Phase.RESTORED):
            # A slot that never ran a task does not report its count (right after a restore).
            counted = v.phase is Phase.HELD or st.task_id is not None
            if st.task_id != s.task_id and (s.task_id != TASK_UNSEEN or v.n_tokens is None):
                # (TASK_UNSEEN: the id moved under a request of ours; the token count below
                # still tells another request's state from it, when the end gave one.)
                self.lost(s, "a request that did not come through autosessd ran on the slot")
            elif counted and st.n_tokens == 0 and v.n_tokens:
                self.emptied_by_engine(s)
            elif counted and v.n_tokens is not None and st.n_tokens != v.n_tokens:
                self.lost(s, f"its slot shows {st.n_tokens:,} tokens, {v.n_tokens:,} were held")
        if st is not None:
            s.task_id = st.task_id
        return True

    # -- changes behind our back -----------------------------------------------------------
    def engine_gone(self, s: Slot, why: str) -> None:
        """The engine process that ran the slot is gone (a restart, a model unloaded): what the
        slot held, and its task id, which the next process numbers from the start again (b11434:
        the last task before a restart was 16, the first after it 5). A stale id would hide the
        new process's request of that number from the watch and the turn's look."""
        s.task_id = None
        self.lost(s, why)

    def lost(self, s: Slot, why: str) -> None:
        """Hold nothing named, so the next request of the conversation restores it instead of
        trusting a state that is gone."""
        named = s.lost(why)
        if named is not None:
            log.info("auto sessions: slot %d no longer holds %s (%s); the next request restores it", s.id, named, why)
            self.ctx.events.emit("engine_reset", slot=s.id, key=named, why=why)
            self.ctx.counters.engine_resets += 1

    def emptied_by_engine(self, s: Slot) -> None:
        """The slot lost its tokens without a task of its own: with a unified KV cache and
        --cache-idle-slots (llama-server's defaults for -np auto), every request that starts on
        any slot moves the idle slots to the engine's RAM cache and empties them."""
        if self.launch.saw_empties_idle():
            log.warning("engine: %s empties idle slots whenever a request starts on another one (a unified KV "
                        "cache with --cache-idle-slots, the defaults of -np auto): autosessd now saves each "
                        "conversation when its request ends, not only when its slot is taken, and a conversation "
                        "whose request ends just as another starts can miss its save. Start llama-server with "
                        "--no-cache-idle-slots to keep idle slots (docs: How it works, Several slots)",
                        self.ctx.engine.address)
        self.lost(s, EMPTIED)

    # -- a request's end -------------------------------------------------------------------
    async def end(self, s: Slot, key: str | None, status: str, n_tokens: int | None, cache_n: int | None,
                  n_prompt: int | None, look: bool, task_id: int | None = None) -> bool:
        """The slot's request of `key` ended: settle it with the engine's look when `look`, if
        the slot still runs that request once the look is back (an engine restart, a command or
        another input may have settled or lost it meanwhile: then this end changes nothing). →
        False when it changed nothing, or the engine had emptied the slot before we looked (the
        end missed its save: counted when it was worth one). task_id: the engine's id of the
        request, when the input knows it (the engine's log): the slot's task id without a look."""
        st = await self.look(s) if look and status != "not_run" else None
        if not s.ending(key):
            return False
        if st is not None and st.is_processing:
            st = None  # the next request runs already (a log read late): this one's end is not visible
        self.settle(s, status, st, n_tokens, cache_n, n_prompt)
        if st is None and task_id is not None:
            s.task_id = task_id
        elif not look and status not in ("not_run", "rejected"):
            s.task_id = TASK_UNSEEN  # it ran: the engine's id moved, and the next look must not count it foreign
        if self.launch.empties_idle and s.view.phase is Phase.HELD and st is not None and st.n_tokens == 0:
            # Another request started between this one's end and our look, and the engine moved
            # this slot to its RAM cache: its latest state never reaches the disk.
            if n_tokens is not None and n_tokens >= max(1, self.ctx.min_tokens):
                self.ctx.counters.saves_missed += 1
                log.warning("auto sessions: %s: another request started as it ended and the engine emptied its "
                            "slot before it could be saved (--no-cache-idle-slots keeps idle slots)",
                            auto_name(s.view.key or ""))
            self.lost(s, EMPTIED)
            return False
        return True

    def settle(self, s: Slot, status: str, st: SlotState | None, n_tokens: int | None, cache_n: int | None,
               n_prompt: int | None) -> None:
        """SWITCHED → what the slot holds after its request (slot.settle), then verify the
        restore it started from."""
        verify = s.settle(status, st, n_tokens, n_prompt, self.ctx.slots_visible)
        if st is not None:
            s.task_id = st.task_id
        if verify is not None:
            self.verify(s, verify.key, verify.restored, cache_n if cache_n is not None else verify.cache_n,
                        n_prompt, status)

    def verify(self, s: Slot, key: str, n_restored: int, cache_n: int | None, n_prompt: int | None,
               status: str) -> None:
        """A restore is verified by the engine's timings.cache_n, not assumed."""
        c, restores = self.ctx.counters, self.ctx.restore_log
        if cache_n is None:
            if status == "ok":
                c.restores_unverified += 1
                log.info("auto sessions: could not see whether the engine reused %s (no cache_n)", auto_name(key))
            return
        reused = policy.restore_reused(n_restored, cache_n, n_prompt)
        last = restores.last.get(s.id)
        body = restores.bodies.pop(s.id, None)
        file = last["file"] if last is not None else auto_name(key)
        window = self.ctx.swa_window
        if reused and window and n_prompt is not None and n_prompt < n_restored:
            # Seen on b11434 with --swa-full (the server then takes the model for one without a
            # window): the prompt ends inside the file, and the engine reuses it although the
            # window of its first new token reaches cells the file does not hold. Its answer can
            # differ from a fresh read's (2 of 3 tries here). Nothing can undo it now: said loud.
            log.warning("auto sessions: the engine reused %s for a prompt of %s tokens that ends before the file's %s "
                        "(a retry?): with a %s-token sliding window the file lacks the window's oldest %s cells, so "
                        "this answer may differ from a fresh read (llama-server does not check it)", file,
                        fmt_tokens(n_prompt), fmt_tokens(n_restored), f"{window:,}", fmt_tokens(n_restored - n_prompt))
            self._swa_retry(key, file, n_prompt, n_restored, reused=True)
        if last is not None:
            last.update(cache_n=cache_n, reused=reused)
        if reused:
            c.restores_reused += 1
            # What the restore gave beyond what the slot already shared with the request (the
            # engine would have kept that part anyway), priced at the engine's own prompt rate.
            had = (last.get("slot_shared") or 0) if last is not None else 0
            had = min(had, cache_n)
            ms = self.ctx.savings.spared(c, had, cache_n)
            if last is not None:
                last.update(spared_tokens=cache_n - had, spared_ms=None if ms is None else round(ms, 1))
            self.ctx.events.emit("restore_reused", slot=s.id, key=key, file=file, cache_n=cache_n,
                                 n_restored=n_restored, spared_tokens=cache_n - had,
                                 spared_ms=None if ms is None else round(ms, 1))
            return
        c.restores_not_reused += 1
        cause = NOT_REUSED_CAUSE
        if window and n_prompt is not None and n_prompt < n_restored:
            # A restore the index could not weigh (the tails and the key rule restore without the
            # request's tokens): what Turn._window_kept_out says of a retry the turn passes over.
            cause = (f"the prompt ({fmt_tokens(n_prompt)} tokens) ends before the restored conversation "
                     f"({fmt_tokens(n_restored)}) does (a retry, a regenerate?): the model has a {window:,}-token "
                     "sliding window and llama-server's file keeps only the window's last cells, so the engine "
                     "read the prompt again")
            self._swa_retry(key, file, n_prompt, n_restored, reused=False)
        elif n_prompt is not None and n_prompt * 2 < n_restored:
            # A regenerated answer's prompt is a little shorter than the restored state (which
            # holds the answer too); one under half of it was cut back by the client.
            cause = (f"the prompt ({fmt_tokens(n_prompt)} tokens) is shorter than the restored conversation: "
                     f"the client cut it, and the engine read the prompt again instead of cutting its state back")
        restores.not_reused = {"key": key, "file": file, "n_restored": n_restored, "cache_n": cache_n,
                               "at": time.time(), "likely_cause": cause}
        restores.departed.append({**restores.not_reused, "body": body})
        log.warning("auto sessions: restored %s tokens of %s but the engine reused %s (timings.cache_n): %s",
                    fmt_tokens(n_restored), file, fmt_tokens(cache_n), cause)
        self.ctx.events.emit("restore_not_reused", slot=s.id, key=key, file=file, cache_n=cache_n,
                             n_restored=n_restored)

    def _swa_retry(self, key: str, file: str, n_prompt: int, n_restored: int, reused: bool) -> None:
        self.ctx.counters.swa_retries += 1
        self.ctx.restore_log.swa_retry = {"at": round(time.time(), 3), "key": key, "file": file, "shared": None,
                                          "n_prompt": n_prompt, "n_file": n_restored, "reused": reused,
                                          "swa_window": self.ctx.swa_window}

    # -- requests we do not see end with their timings ---------------------------------------
    def watch_request(self, s: Slot) -> None:
        """A request whose end we will not see with its timings (turn hook, tail) starts on a
        restored slot: read GET /slots while it runs, for the cache_n that verifies the restore
        (llama-server clears it when the request ends)."""
        if s.view.restored is None or not self.ctx.slots_visible or (s.watcher and not s.watcher.done()):
            return
        s.watcher = asyncio.get_running_loop().create_task(self._watch(s, s.view.key, s.task_id))

    async def _watch(self, s: Slot, key: str | None, task_before: int | None) -> None:
        deadline = time.monotonic() + self.ctx.cfg.engine.timeout_s
        while time.monotonic() < deadline and s.view.phase is Phase.SWITCHED and s.view.key == key:
            try:
                st = await self.engine_slot(s.id)
            except EngineError:
                return
            if st is not None and st.task_id is not None and st.task_id != task_before:
                if not st.is_processing:
                    return  # ended between two looks: the restore stays unverified
                # Between taking the task and starting its prompt, llama-server shows cache 0
                # and 0 read, with the restored tokens still in the slot: not known yet.
                begun = st.n_processed > 0 if st.n_processed is not None else bool(st.n_tokens)
                if st.n_cached is not None and (st.n_cached or begun):
                    s.seen_cache_n = (st.task_id, st.n_cached)
                    return
            await asyncio.sleep(WATCH_EVERY_S)

    async def ran_unplaced(self, slots: list[Slot]) -> None:
        """A request the engine placed itself has run, every slot's ticket held meanwhile: the
        slot it ran on (its task id moved) holds nothing autosessd can name."""
        self.launch.count_start()
        for s in sorted(slots, key=lambda x: x.id):
            st = await self.look(s)
            if st is None:
                self.lost(s, "a request the engine placed itself may have run on it (slots not visible)")
            elif st.task_id != s.task_id:
                s.task_id = st.task_id
                self.lost(s, "a request the engine placed itself (an embedding, a rerank) ran on it")
