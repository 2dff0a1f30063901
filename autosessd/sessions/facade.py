"""Sessions: what the inputs (gate, tail, control socket) and the daemon call. A thin facade
over the rooms below, each owning one invariant; this docstring holds what spans them: each
input's call protocol, and the lock order.

    slot.py       one slot's state machine (phases, the transition table, the only writer)
    placement.py  tickets: one FIFO per slot, where a conversation's request goes
    observe.py    the engine's truth brought into the state machine (GET /slots, cache_n)
    launch.py     when the engine may start a request (an engine that empties idle slots)
    saves.py      the one save path; restores.py the one restore path
    turn.py       the turn: save held → restore best → prefix (prefix.py), never raises
    remote.py     the shared bucket as the turn sees it (Fetcher) and its catalog
    commands.py   autosessctl's park/restore/forget; the stop save; the tail's save/restore behind
    upkeep.py     the token index's life, prune;  report.py  counters, events; views.py status, ls, metrics
    watch.py      engine restarts;  facts.py  what the engine runs since (model, template, ...)
    held.py       what was held at the stop;  context.py  shared facts

Call protocols. Every call that changes a slot takes the slot's ticket (placement.py); each
call says what it blocks on.

  gate (gate.py), for a request that can run on a slot:

    ticket = await s.place(key)        # or s.admit(n) for a client's id_slot. Blocks: the FIFO
    result = await s.turn(ticket, key, body=chat)   # save → restore → prefix. Blocks: the engine;
                                       # never raises. The request is now SWITCHED on the slot
    await s.before_send(ticket)        # blocks: the launch gate (no start may come between a
                                       # restore and its request, or an end and its end save)
    s.sent(ticket)                     # right before forwarding: its start is in flight until the
                                       # engine shows it placed (a task of its own, bounded)
    ... forward the request; the response carries timings.cache_n ...
    await s.ended(ticket, key, status, n_tokens, cache_n, n_prompt)  # settle + verify; on an engine
                                       # that empties idle slots, the end save. Blocks: the gate, the engine
    ticket.release()                   # safe twice; after a client disconnect, only once the
                                       # engine's slot is idle again (s.wait_idle)

    A request the engine places itself (embeddings, rerank): tickets = await s.admit_all(), then
    after it ran await s.ran_unplaced(tickets) and release them. A client's own POST /slots/N
    takes slot N's ticket; after a restore or erase through it: s.lost(ticket, why).

  turn hook (control.py `turn`): place/admit → turn(ticket, key, sees_end=False, body) →
    release; the serving layer then runs the request and never reports its end: the next
    turn on the slot finds it ended (observe.py), and a restore is verified by watching GET
    /slots while it runs. What the hook cannot promise: the launch gate's holds end at the
    ticket's release, before the serving layer sends its request, so on an engine that empties
    idle slots another start may come between a restore and its request (the hook's users run
    one slot, or llama-server with --no-cache-idle-slots).

  tail (tail.py): what it reads has run already, so it holds no ticket for it and takes no
    launch hold. s.observed_start(slot, key) when a request's start line is read (it runs
    already, whatever we do), and s.observed_end(slot, key, status, n_tokens, cache_n) at its
    end: a compare-and-swap that settles the slot only if it still runs that request (checked
    again after the look), and never saves. The tail's own s.save_behind does, and after an
    engine restart s.restore_behind: each takes the slot's ticket for its work.

  engine log (enginetail.py): the tail's protocol, for llama-server's own log. Every request
    is of one line key (enginetail.LINE: the log names no conversation), and its saves are
    named by their tokens (branches.save_key under that key). A launch line is observed_start,
    a release observed_end (with the engine's count, and cache_n and n_prompt from the timing
    lines); the engine's start in its log is s.engine_started(why) (a restart, reported once
    per engine process with the engine watch), after which s.restore_behind(slot, LINE, check,
    file_key) puts back each slot's last saved file.

  daemon: Sessions(...) whole from its start checks, await s.prepare(), then s.remote (the
    shared bucket), s.inputs (what status describes) and s.cfg (at SIGHUP) are set; the engine
    watch runs s.watch_engine(); at the stop s.save_at_stop(slot) per slot, s.drain(),
    s.close(), s.last.record_stop(slots).

  Two more writers change a slot without its ticket, both compare-and-swap on a view they
  read: the engine watch (a restart: every slot lost, the one transition allowed from
  anywhere) and the hook's background read of a request's tokens (turn.py, noted only while
  the slot still runs that request). So a caller that checks a slot's phase and then waits
  checks it again before it changes the slot.

Lock order (what is taken while holding what), never the reverse:

    1. a slot's ticket (placement.py). Only admit_all waits for several, in slot-id order
       (it holds none when it starts); a caller holding one takes a second only by
       try_admit (make-room), which never waits.
    2. the launch gate (launch.py), only while holding a ticket; then the engine facts' read
       lock (facts.py: /props and a probe save into the holder's own slot, nothing under it).
    3. a save's temporary lock, then finalize futures (saves.py), awaited under 1 (and under
       2 where the caller holds it: an end save, a make-room inside a restore).
    4. Store._lock and TokenIndex._lock (threading): taken only inside their own short calls,
       never across an await; Store.install (downloads) holds it for a look and two renames.
    5. a tail's read lock (tail.Following): a save's or restore's check reads the log's new
       lines under 1-3; the read loop holding it never waits for a ticket (the tail's calls
       above take none). The engine log's restore lock is taken before 1.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from ..base.config import Config
from ..engines.base import Engine, EngineError, SlotState
from ..store.directory import Store
from . import held, observe, views
from .commands import Commands
from .context import Context
from .facts import facts_of
from .idle import IdleSaver
from .launch import Launch
from .observe import Observer
from .placement import Placement, Ticket
from .policy import Occasion, Save, SaveOutcome
from .prefix import PrefixReader
from .fetcher import Fetcher
from .report import Counters, Events, TurnResult
from .restores import Restorer
from .rewind import Rewinder
from .saves import Saver
from .savings import Savings
from .slot import Slot, View
from .turn import Turn
from .upkeep import Upkeep
from .warm import Warmer
from .watch import EngineWatch

if TYPE_CHECKING:
    from ..store.index import TokenIndex
    from ..store.slotfile import KVLayout

log = logging.getLogger("autosessd")


class Sleep(Protocol):
    """The engine's sleep, as the facade drives it (sleep.SleepWatch, which drives the facade)."""

    async def before_turn(self, s: Slot) -> None: ...

    def stop(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


class Sessions:
    def __init__(self, cfg: Config, engine: Engine, store: Store, model: str, model_name: str = "",
                 slots_visible: bool = True, n_slots: int = 1, layout: KVLayout | None = None,
                 empties_idle_slots: bool = False, engine_healthy: bool | None = None, n_ctx: int | None = None,
                 house: Context | None = None, upkeep: Upkeep | None = None, template: str = ""):
        """The daemon's start checks give the rest: n_slots, the engine's slots (0..n-1, all
        driven); layout, its state files' KV layout as the probe saw it; empties_idle_slots, the
        probe saw it empty idle slots; engine_healthy, it answered /health; n_ctx, the tokens one
        of its slots holds; template, its chat template's identity. house, upkeep: one model's
        Sessions behind a router (models.py) shares the house's counters, events and token
        index, and its one prune."""
        self.ctx = ctx = facts_of(Context(cfg, engine, store, model, model_name, slots_visible, layout,
                                          n_ctx=n_ctx, template=template))
        if house is not None:
            ctx.counters, ctx.events, ctx.index = house.counters, house.events, house.index
            ctx.warmed = house.warmed  # one warming bound for every model (warm.py)
        self.started_at = time.time()
        ctx.savings = (house.savings.for_model(model) if house is not None
                       else Savings(model, cfg.effective_state_dir() / "savings.json"))
        self.placement = Placement(cfg.engine.slot, lambda: ctx.min_tokens)
        self.placement.add_slots(n_slots)
        self.launch = Launch(ctx, self.placement.slots, empties_idle_slots)
        self.observer = Observer(ctx, self.launch)
        self.launch.look = self.observer.look  # placed yet? the launch gate asks GET /slots
        self.placement.on_release.append(self.launch.released)
        self.saver = Saver(ctx, self.observer)
        self.saver.rewind = Rewinder(ctx, self.launch, self.saver).rewind  # before a save (rewind.py)
        self.restorer = Restorer(ctx, self.placement, self.launch, self.observer, self.saver)
        self.warmer = Warmer(ctx, self.saver, self.placement)  # files into the page cache before a restore
        prefix, fetcher = PrefixReader(ctx, self.launch, self.observer, self.saver), Fetcher(ctx, self.saver)
        self._turn = Turn(ctx, self.observer, self.saver, self.restorer, prefix, fetcher, self.warmer)
        self.commands = Commands(ctx, self.placement, self.observer, self.saver, self.restorer)
        self.idle = IdleSaver(ctx, self.placement, self.observer, self.saver, self.launch)
        self.upkeep = upkeep if upkeep is not None else Upkeep(ctx)
        self.upkeep.savers.append(self.saver)
        self.saver.want_room = self.upkeep.schedule_prune  # a finalize short of space tries again after it
        fetcher.downloaded = self.upkeep.keep_as_blocks  # a download came whole: kept as blocks after
        self.watch = EngineWatch(ctx, self.engine_restarted, engine_healthy)
        # What each slot held last (held.json; behind a router, one file per model), kept as it changes.
        self.last = held.Recorder(cfg.effective_state_dir() / held.file_name(model if house is not None else None),
                                  model, self.placement.slots)
        ctx.facts.n_slots, ctx.facts.check_template = n_slots, self.check_template  # facts.py
        self.listing = views.Listing()
        self.inputs: dict[str, Callable[[], Any]] = {}  # filled by the daemon: name → describe()
        self.sleep: Sleep | None = None  # the engine sleeps when idle (sleep.SleepWatch; the daemon starts it)
        # Called (awaited) after the engine came back from a restart; the tail restores then.
        self.on_engine_restart: list[Callable[[], Awaitable[None]]] = []
        self._flush: asyncio.TimerHandle | None = None

    # -- the facts, for the inputs and reports -------------------------------------------------
    cfg = property(lambda self: self.ctx.cfg, lambda self, cfg: setattr(self.ctx, "cfg", cfg),
                   doc="The running config; a reload (SIGHUP) replaces it")
    remote = property(lambda self: self.ctx.remote, lambda self, r: setattr(self.ctx, "remote", r),
                      doc="The shared bucket ([shared]; the daemon sets it once started)")
    engine: Engine = property(lambda self: self.ctx.engine)  # type: ignore[assignment]
    store: Store = property(lambda self: self.ctx.store)  # type: ignore[assignment]
    model: str = property(lambda self: self.ctx.model)  # type: ignore[assignment]
    model_name: str = property(lambda self: self.ctx.model_name)  # type: ignore[assignment]
    counters: Counters = property(lambda self: self.ctx.counters)  # type: ignore[assignment]
    events: Events = property(lambda self: self.ctx.events)  # type: ignore[assignment]
    index: TokenIndex | None = property(lambda self: self.ctx.index)  # type: ignore[assignment]
    slots_visible: bool = property(lambda self: self.ctx.slots_visible)  # type: ignore[assignment]
    restore_log = property(lambda self: self.ctx.restore_log)
    last_not_reused = property(lambda self: self.ctx.restore_log.not_reused)
    engine_healthy = property(lambda self: self.watch.healthy)
    slots: dict[int, Slot] = property(lambda self: self.placement.slots)  # type: ignore[assignment]

    def slot(self, slot_id: int | None = None) -> Slot:
        return self.placement.slot(slot_id)

    def view(self, slot_id: int | None = None) -> View:
        return self.placement.slot(slot_id).view

    async def look(self, slot_id: int) -> SlotState | None:
        """The engine's own GET /slots for one slot; None when hidden or not answering."""
        return await self.observer.look(self.placement.slot(slot_id))

    # -- tickets (block on the slot's FIFO) ----------------------------------------------------
    async def admit(self, slot_id: int | None = None) -> Ticket:
        return await self.placement.admit(slot_id)

    async def place(self, key: str | None, prompt: str | bytes | None = None) -> Ticket:
        return await self.placement.place(key, prompt)

    async def admit_all(self) -> list[Ticket]:
        return await self.placement.admit_all()

    async def fifos_free(self) -> None:
        await self.placement.fifos_free()

    # -- the gate's and the hook's calls --------------------------------------------------------
    async def turn(self, ticket: Ticket, key: str | None, sees_end: bool = True,
                   body: dict[str, Any] | None = None) -> TurnResult:
        """DESIGN §1 before a request of conversation `key` (None: one without, which skips the
        restore) on the ticket's slot; never raises. sees_end=False: the turn hook (its end is
        never reported). body: the request's OpenAI chat body (tokens choose what to restore)."""
        slot = self.placement.slot_of(ticket)
        if self.sleep is not None:
            await self.sleep.before_turn(slot)
        result = await self._turn.run(slot, key, sees_end, body)
        if self.cfg.auto_sessions:
            self.upkeep.schedule_prune()
        return result

    async def before_send(self, ticket: Ticket) -> None:
        await self.launch.before_send(self.placement.slot_of(ticket))

    def sent(self, ticket: Ticket, bound_s: float = 2.0) -> Awaitable[None]:
        """The request is being forwarded now. Returns what waits for its hold to end (the
        gate does not wait; tests may)."""
        task = self.launch.sent(ticket, self.placement.slot(ticket.slot_id), bound_s)
        if task is None:
            task = asyncio.get_running_loop().create_future()
            task.set_result(None)
        return task

    async def ended(self, ticket: Ticket, key: str | None, status: str, n_tokens: int | None = None,
                    cache_n: int | None = None, n_prompt: int | None = None) -> None:
        """The request of `key` on the ticket's slot ended. status: ok | cancelled | error (it
        failed part-way) | rejected (a 4xx before it ran) | not_run (it never reached the
        engine); the numbers: what the response said (the engine's GET /slots is preferred
        for the count). On an engine that empties idle slots, the next start anywhere empties
        this one: when its end may be saved, no start is sent until the save is done."""
        s = self.placement.slot_of(ticket)
        ours = s.ending(key)
        self.launch.ended(s, key, status, ours)
        if not ours:
            log.debug("auto sessions: slot %d: end of %s ignored: the slot is %s %s now", s.id, key,
                      s.view.phase.value, s.view.key or "")
            return
        self.flush_savings_later()
        hold = self._end_may_save(s, key, status, n_tokens)
        async with self.launch.end_save_hold(hold):  # may wait: observe.end checks the view again
            settled = await self.observer.end(s, key, status, n_tokens, cache_n, n_prompt, look=True)
            if settled and hold:
                step, outcome = await self.saver.save_if_worth(s, Occasion.BEHIND, gate_held=True)
                if isinstance(step, Save) and outcome is SaveOutcome.NOT_TRIED and s.view.conversation() is None:
                    self.counters.saves_missed += 1  # a start sent before this end emptied the slot
        if settled and status == "ok":
            self.idle.ended(s)  # its pause starts: saved behind if the slot stays idle (idle.py)

    def _end_may_save(self, s: Slot, key: str | None, status: str, n_tokens: int | None) -> bool:
        """Whether the end of a request of `key` may be saved right after it (the end save)."""
        if not (self.launch.active and self.cfg.auto_sessions):
            return False
        min_tokens = max(1, self.ctx.min_tokens)
        ran = key is not None and status == "ok" and (n_tokens is None or n_tokens >= min_tokens)
        v = s.view
        after = v.prior.conversation() if status in ("not_run", "rejected") and v.prior is not None else None
        kept = after is not None and (after.n_tokens is None or after.n_tokens >= min_tokens)  # the prior stays
        return ran or kept

    async def wait_idle(self, ticket: Ticket, timeout_s: float) -> None:
        """Until the engine stops working on the ticket's slot (its client went away), bounded.
        GET /slots is asked sparingly meanwhile (observe.QUIET_GAP_S): asked often, it keeps
        llama-server from noticing that a non-streaming request's client is gone."""
        s = self.placement.slot_of(ticket)
        deadline = asyncio.get_running_loop().time() + timeout_s
        with self.observer.quiet():
            while asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(observe.QUIET_GAP_S)
                try:
                    st = await self.observer.engine_slot(s.id)
                except EngineError:
                    return
                if st is None or not st.is_processing:
                    return

    def lost(self, ticket: Ticket, why: str) -> None:
        """Someone else replaced what the ticket's slot holds (a client's own slot action)."""
        self.observer.lost(self.placement.slot_of(ticket), why)

    async def save_before_unplaced(self, tickets: list[Ticket]) -> int:
        return await self.commands.save_before_unplaced(tickets)

    async def ran_unplaced(self, tickets: list[Ticket]) -> None:
        await self.observer.ran_unplaced([self.placement.slot_of(t) for t in tickets])

    def prefill_seen(self, n_tokens: int | None, ms: float | None, cache_n: int | None = None) -> None:
        """A response read n_tokens of prompt after cache_n in ms: the engine's prompt rate (savings.py, remote.py)."""
        self.ctx.savings.saw_read(cache_n, n_tokens, ms)
        if self.remote is not None:
            self.remote.saw_prefill(n_tokens, ms)
        self.flush_savings_later()

    def flush_savings_later(self, delay_s: float = 5.0) -> None:
        """savings.json written off the loop, at most once per delay_s (and at close)."""
        if self._flush is not None or not self.ctx.savings.dirty:
            return
        loop = asyncio.get_running_loop()

        def go() -> None:
            self._flush = None
            fut = loop.run_in_executor(None, self.ctx.savings.flush, self.counters)
            fut.add_done_callback(lambda f: f.exception())  # flush logs its own failures

        self._flush = loop.call_later(delay_s, go)

    # -- the tail's calls (no ticket, no launch hold) ---------------------------------------------
    def observed_start(self, slot_id: int, key: str | None) -> None:
        s = self.placement.slot(slot_id)
        s.start(key)
        self.observer.watch_request(s)

    async def observed_end(self, slot_id: int, key: str | None, status: str, n_tokens: int | None = None,
                           cache_n: int | None = None, look: bool = True, n_prompt: int | None = None,
                           task_id: int | None = None) -> None:
        """Compare-and-swap: settles the slot only while it runs that request of `key`
        (n_prompt, task_id: what the engine's log tells of it)."""
        s = self.placement.slot(slot_id)
        ours = s.ending(key)
        self.launch.ended(s, key, status, False)
        if ours:
            await self.observer.end(s, key, status, n_tokens, cache_n, n_prompt, look, task_id)

    async def save_behind(self, slot_id: int, check: Callable[[SlotState | None], Awaitable[str | None]]) -> bool:
        return await self.commands.save_behind(slot_id, check)

    async def restore_behind(self, slot_id: int, key: str, check: Callable[[], Awaitable[str | None]],
                             file_key: str | None = None) -> bool:
        return await self.commands.restore_behind(slot_id, key, check, file_key)

    async def engine_started(self, why: str) -> bool:
        """The engine's own log shows a new engine process: handled as a restart (every slot
        lost, on_engine_restart called), unless the engine watch already reported this very
        process. → whether it was reported now."""
        return await self.watch.seen_in_log(why)

    # -- commands -------------------------------------------------------------------------------
    async def park(self, slot_id: int | None = None, name: str | None = None) -> dict[str, Any]:
        return await self.commands.park(slot_id, name)

    async def restore_now(self, what: str, slot_id: int | None = None) -> dict[str, Any]:
        return await self.commands.restore_now(what, slot_id)

    async def forget(self, key: str) -> dict[str, Any]:
        done = await self.commands.forget(key)
        self.last.forget(key, done["files"])  # nothing puts it back after a restart
        return done

    async def save_at_stop(self, slot_id: int | None = None, why: str = "stop") -> bool:
        return await self.commands.save_at_stop(slot_id, why)

    async def prune(self, keep: int | None = None, max_gb: float | None = None,
                    dry_run: bool = False) -> dict[str, Any]:
        return await self.upkeep.prune(keep, max_gb, dry_run)

    # -- reports (status and ls block: run them in a thread) ----------------------------------------
    def status(self) -> dict[str, Any]:
        return views.status(self)

    def ls(self) -> list[dict[str, Any]]:
        return self.listing.ls(self)

    async def ls_words(self) -> list[dict[str, Any]]:
        return await self.listing.ls_words(self)

    def metrics(self, extra: list[tuple[str, str, str, int | float]] = ()) -> str:
        return views.metrics(self, extra)

    # -- life ---------------------------------------------------------------------------------------
    async def prepare(self) -> None:
        await self.upkeep.prepare()
        await self.check_template()
        self.upkeep.start_import()  # whole files from before the block store, as blocks (in the background)

    async def check_template(self) -> None:  # may returns be matched by messages that go on (recall.py)?
        await self._turn.recall.check_appends()

    async def drain(self) -> None:
        """Wait for every background finalize and prune (at shutdown, and in tests)."""
        while self.saver.finalizing() or self.upkeep.pruning():
            pending = [*self.saver.finalizing(), *filter(None, [self.upkeep.pruning()])]
            await asyncio.gather(*pending, return_exceptions=True)

    async def close(self, index: bool = True) -> None:
        """At stop, after drain(): keep the index for the next start (index=False: the house
        keeps it, behind a router)."""
        self.idle.close()
        self.upkeep.stop_import()
        if self.sleep is not None:
            self.sleep.stop()
        if index:
            await self.upkeep.save_index()
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        await asyncio.get_running_loop().run_in_executor(None, self.ctx.savings.flush, self.counters)
        self.launch.close()
        self._turn.close()

    async def save_idle_now(self, capped: bool = False) -> list[dict[str, Any]]:
        """Every idle slot's conversation worth a save, saved now (idle.IdleSaver.save_now): for
        a caller that knows the slots' state is about to go (an engine put to sleep)."""
        return await self.idle.save_now(capped)

    async def watch_engine(self, every_s: float = 2.0, identity_every_s: float = 10.0) -> None:
        await self.watch.run(every_s, identity_every_s)

    async def engine_restarted(self, why: str) -> None:
        """What the engine held is gone: every slot lost, the launch gate's memory, its facts (facts.py)."""
        for s in list(self.slots.values()):
            self.observer.engine_gone(s, why)
        self.ctx.suspect = None  # a new engine: whatever a failed restore left is gone
        self.ctx.facts.restarted(why)
        self.launch.engine_restarted()
        for callback in list(self.on_engine_restart):
            try:
                await callback()
            except Exception as e:
                log.warning("engine restart handling: %s", e)
