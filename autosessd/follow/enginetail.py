"""The engine-log tail: automatic sessions for an unmodified llama-server with nothing in front
of it, learned from the engine's own log (`--log-file PATH`, text or `--log-jsonl`; the lines
are parsed by enginelog.py). The file is followed as the request-log tail follows its own
(tail.Following: the watch, the poll, rotation, truncation, a log written again from its
start at each engine start, offsets kept across restarts, bad lines counted).

What a line means (the tail's protocol of sessions/facade.py, no ticket for what already ran):

    launch  slot N, task T   observed_start(N, LINE): the engine switched to a request now
    timing  prompt / eval    kept for the release: cache_n and the prompt's length follow
    release slot N, task T   observed_end(N, LINE, n_tokens = the engine's count); then save
                             behind once the slot is idle (below)
    start, model loaded      the engine restarted: sessions.engine_started (reported once per
                             engine process, with the engine watch), then the restore below

LINE: the log names no conversation, so every request is of one line key, and each save is
named by its tokens (branches.save_key under LINE: the first conversation saved takes auto-LINE,
one that departs from it inside its prompt a branch name of the tokens up to where it
departs, and so on): the same conversation lands on the same name as it grows, another one
never on its name, and the gate or a hook with messages, started later, finds the files by
their tokens (docs/how-it-works/inputs.md).

Save behind: after a release, with no launch on that slot since and the engine's slot idle,
the slot is saved if it reached auto_sessions_min_tokens and its file is not up to date. A
save issued as a new request arrives would capture that request's state (llama-server defers
a slot action on a busy slot): the engine writes a temporary, and it is kept only if the log
shows no launch on the slot meanwhile and the engine's task id for the slot did not move
(nor its count, but to 0: an engine that moves idle slots to its RAM cache when a request
starts elsewhere empties it after the save wrote it).

Restore after a restart: each slot's last saved file (held.json, the one record of what each
slot held last: sessions/held.py), the newest first, a file whose tokens another chosen file
extends skipped (Recorder.plan, the start restore's rule too), is restored into its slot
once the engine answers /health, when that slot is empty and idle and the log shows nothing
running there; it is trusted by the same check as a save (counted in restores_not_trusted
otherwise). The next request's cache_n (its timing lines, or GET /slots while it runs)
verifies it: restores_reused / restores_not_reused.

When the lines stop appearing: a request the engine works on (its print_timing lines, any
`slot …: id N | task T |` line, or a task id in GET /slots checked every CHECK_EVERY_S) whose
launch the log never showed is counted (engine_log_unseen), and the second one is said once:
the build may log otherwise than the one the parser was written against.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from ..engines.base import EngineError, SlotState
from ..sessions.facade import Sessions
from . import enginelog
from .enginelog import Activity, BadLine, Launch, Loaded, Release, Slots, Started, Timing
from .tail import Following, cancel

log = logging.getLogger("autosessd")

LINE = hashlib.sha1(b"autosessd: a conversation seen in the engine's own log").hexdigest()[:16]
RUN_TTL_S = 60.0  # a launch whose release never came, its slot idle that long: it ended unseen
CHECK_EVERY_S = 30.0  # GET /slots task ids against the log's
UNSEEN_WARN_AT = 2  # requests the log did not show before saying so
MAX_UNSEEN = 1024  # (slot, task) pairs remembered


@dataclass
class Run:
    """A request the log showed launched and not yet released."""

    task: int
    at: float  # monotonic, when its launch was read
    prompt_n: int | None = None
    eval_n: int | None = None


class EngineTail(Following):
    name = "engine_log"
    what = "engine log"
    bad_counter = "engine_log_bad_lines"
    missing_hint = ": is llama-server run with --log-file at this path (and can autosessd's user read it)?"

    def __init__(self, cfg: Any, sessions: Sessions, path: str):
        super().__init__(cfg, sessions, path, "engine-log")
        self.running: dict[int, Run] = {}
        self.launches: collections.Counter[int] = collections.Counter()  # per slot, read since the start
        self.tasks_seen: dict[int, int] = {}  # per slot, the last task the log showed
        self.formats: collections.Counter[str] = collections.Counter()  # lines read: "text", "jsonl"
        self.unseen: dict[tuple[int, int], None] = {}  # requests the log did not show (counted)
        self.suspects: dict[tuple[int, int], float] = {}  # lines of a request whose launch we did not read
        self.warned_unseen = False
        self.engine_starts = 0
        self.restored = 0
        self._engine_tasks: dict[int, int | None] = {}  # GET /slots task ids at the last check
        self._checked_at = time.monotonic()
        self._restore_wanted = False
        self._restore_task: asyncio.Task | None = None
        self._restore_lock = asyncio.Lock()

    # -- life ------------------------------------------------------------------------------
    async def start(self) -> None:
        log.info("engine log: the parser was written against llama-server %s; it reads the launch, timing and "
                 "release lines of each request and the engine's start, and ignores the rest",
                 enginelog.WRITTEN_AGAINST)
        # The second record of each slot's last file an older autosessd kept: held.json holds it now.
        self.state_path.with_name(self.state_path.stem + "-slots.json").unlink(missing_ok=True)
        self.sessions.on_engine_restart.append(self._engine_restarted)
        self._engine_tasks = await self._task_ids()
        await super().start()

    async def stop(self, grace_s: float) -> None:
        if self._restore_task is not None:
            await cancel(self._restore_task)
        await super().stop(grace_s)

    def describe(self) -> dict[str, Any]:
        return {"engine_log": str(self.path), "written_against": enginelog.WRITTEN_AGAINST, "lines": self.lines,
                "formats": dict(self.formats), "running": {s: r.task for s, r in sorted(self.running.items())},
                "last_files": {s: e["file"] for s, e in sorted(self.sessions.last.entries.items())},
                "engine_starts": self.engine_starts, "restored_after_start": self.restored,
                "unseen_requests": len(self.unseen), "needed_lines_missing": self.warned_unseen}

    # -- the lines ----------------------------------------------------------------------------
    async def handle(self, line: bytes, last: bool = True) -> None:
        self.lines += 1
        if not line.strip(b" \t\r\0"):
            return
        try:
            ev = enginelog.parse(line)
        except BadLine as e:
            self._bad(1, str(e))
            return
        self.formats["jsonl" if line.lstrip(b"\0 \t").startswith(b"{") else "text"] += 1
        if ev is None:
            return
        slots = self.sessions.slots
        if isinstance(ev, (Launch, Release, Timing, Activity)) and ev.slot not in slots:
            self._bad(1, f"slot {ev.slot} is not one of the engine's {len(slots)}")
            return
        if isinstance(ev, (Launch, Release)):
            self.suspects.pop((ev.slot, ev.task), None)
        if isinstance(ev, Launch):
            self._confirm(lambda slot, task: slot == ev.slot)  # earlier tasks there ended unseen
            if ev.slot in self.running:
                log.debug("engine log: slot %d: task %d launched, task %d's release not seen", ev.slot, ev.task,
                          self.running[ev.slot].task)
            self.running[ev.slot] = Run(ev.task, time.monotonic())
            self.launches[ev.slot] += 1
            self.tasks_seen[ev.slot] = ev.task
            self.sessions.observed_start(ev.slot, LINE)  # the engine switched to it, whatever we do
        elif isinstance(ev, Timing):
            run = self.running.get(ev.slot)
            if run is not None and run.task == ev.task:
                if ev.kind == "prompt":
                    run.prompt_n = ev.n
                else:
                    run.eval_n = ev.n
            else:
                self._suspect(ev.slot, ev.task)
        elif isinstance(ev, Release):
            await self._released(ev, last)
        elif isinstance(ev, Activity):
            run = self.running.get(ev.slot)
            if (run is None or run.task != ev.task) and self.tasks_seen.get(ev.slot) != ev.task:
                self._suspect(ev.slot, ev.task)
        elif isinstance(ev, Started):
            self.engine_starts += 1
            self.sessions.counters.engine_log_starts += 1
            self.running.clear()  # the old process's requests end with it
            self._confirm(lambda slot, task: True)  # those whose launch we did not read, unseen
            # The new process numbers its tasks from the start again: the old ids say nothing of it.
            self.tasks_seen.clear()
            self.unseen.clear()
            log.info("engine log: a new engine process is starting (%s)", self.path)
        elif isinstance(ev, Loaded):
            await self.sessions.engine_started("the engine restarted (its log shows it loading its model again)")
        elif isinstance(ev, Slots) and ev.n_slots != len(slots):
            log.warning("engine log: the engine now runs %d slots, autosessd drives %d: restart autosessd to drive "
                        "them all", ev.n_slots, len(slots))

    async def _released(self, ev: Release, last: bool) -> None:
        run = self.running.get(ev.slot)
        if run is None or run.task != ev.task:
            # Its launch was not read (before the first start's end of the log, or a rotation
            # lost it): it ran all the same, and its state is named by its tokens when saved.
            self.launches[ev.slot] += 1
            self.sessions.observed_start(ev.slot, LINE)
            run = Run(ev.task, time.monotonic())
        self.running.pop(ev.slot, None)
        self.tasks_seen[ev.slot] = ev.task
        cache_n, n_prompt = enginelog.prompt_counts(ev.n_tokens, run.prompt_n, run.eval_n)
        await self.sessions.observed_end(ev.slot, LINE, "ok", ev.n_tokens, cache_n, look=last, n_prompt=n_prompt,
                                         task_id=ev.task)
        self._schedule_save_behind(ev.slot)

    def _suspect(self, slot: int, task: int) -> None:
        """Lines of a request whose launch we did not read: its release is awaited (its launch
        may lie before where we began reading); it ended unseen when another task starts on the
        slot, or the slot is idle RUN_TTL_S later, without it."""
        if (slot, task) in self.unseen:
            return
        self._confirm(lambda s, t: s == slot and t != task)  # the engine runs one task a slot at a time
        self.suspects.setdefault((slot, task), time.monotonic())

    def _confirm(self, which: Callable[[int, int], bool]) -> None:
        for slot, task in [k for k in self.suspects if which(*k)]:
            del self.suspects[(slot, task)]
            self._unseen(slot, task)

    def _unseen(self, slot: int, task: int) -> None:
        """A request the engine worked on whose launch and release the log did not show."""
        if (slot, task) in self.unseen:
            return
        self.unseen[(slot, task)] = None
        if len(self.unseen) > MAX_UNSEEN:
            del self.unseen[next(iter(self.unseen))]
        self.sessions.counters.engine_log_unseen += 1
        if len(self.unseen) >= UNSEEN_WARN_AT and not self.warned_unseen:
            self.warned_unseen = True
            log.warning("engine log: the engine ran requests that %s does not show launched (latest: slot %d, task "
                        "%d): autosessd reads the 'launch_slot_ … processing task' and 'release … stop processing: "
                        "n_tokens = …' lines of llama-server %s, and this build logs otherwise, or its log level "
                        "hides them (-lv below 3). Until they appear nothing is saved behind or restored after a "
                        "restart", self.path, slot, task, enginelog.WRITTEN_AGAINST)

    # -- between batches ------------------------------------------------------------------------
    async def after_batch(self) -> None:
        if self._restore_wanted:
            self._start_restore()

    async def tick(self) -> None:
        now = time.monotonic()
        for slot, run in list(self.running.items()):
            if now - run.at < RUN_TTL_S:
                continue
            st = await self.sessions.look(slot)
            if st is not None and st.is_processing:
                continue
            await self.read_new_lines()  # its release may be just in
            if self.running.get(slot) is not run:
                continue
            # Ended without its release in the log (a line lost with a rotation): the engine's
            # slot holds what it left; the save names that by its tokens.
            del self.running[slot]
            log.info("engine log: slot %d: task %d's release never came and the slot is idle: taken as ended", slot,
                     run.task)
            await self.sessions.observed_end(slot, LINE, "ok" if st is not None else "error", look=True)
            if st is not None:
                self._schedule_save_behind(slot)
        old = {k for k, at in self.suspects.items() if now - at >= RUN_TTL_S}
        if old:
            idle = {slot for slot, _ in old if slot not in self.running}
            for slot in sorted(idle):
                st = await self.sessions.look(slot)
                if st is not None and st.is_processing:
                    idle.discard(slot)
            self._confirm(lambda slot, task: (slot, task) in old and slot in idle)
        if now - self._checked_at >= CHECK_EVERY_S:
            self._checked_at = now
            await self._check_tasks()

    async def _states(self) -> list[SlotState]:
        try:
            return await self.sessions.engine.slots()
        except EngineError:
            return []

    async def _task_ids(self) -> dict[int, int | None]:
        return {st.id: st.task_id for st in await self._states()}

    async def _check_tasks(self) -> None:
        """The engine's own task ids against the log's: a request the log never showed."""
        tasks = await self._task_ids()
        moved = {slot: t for slot, t in tasks.items() if t is not None and t != self._engine_tasks.get(slot)
                 and t != self.tasks_seen.get(slot)}
        if moved:
            await self.read_new_lines()  # its lines may be just in
            states = {st.id: st for st in await self._states()}
            for slot, t in moved.items():
                run = self.running.get(slot)
                if t == self.tasks_seen.get(slot) or (run is not None and run.task == t):
                    continue
                st = states.get(slot)
                if st is not None and not st.is_processing:
                    self._unseen(slot, t)  # it ran and ended, and the log showed neither
                else:
                    self._suspect(slot, t)
        self._engine_tasks = tasks

    # -- save behind ----------------------------------------------------------------------------
    async def _save_behind(self, slot: int) -> None:
        try:
            while True:  # until the engine is done with it, unless another request was launched there
                if slot in self.running:
                    return
                st = await self.sessions.look(slot)
                if st is None or not st.is_processing:
                    break
                await asyncio.sleep(0.05)
            await self.sessions.save_behind(slot, self._check(slot))  # held.json follows the slot
        except Exception as e:
            log.warning("engine log: save behind on slot %d: %s", slot, e)

    def _check(self, slot: int, at_restore: SlotState | None = None
               ) -> Callable[[SlotState | None], Awaitable[str | None]]:
        """Whether the state just saved (before: the engine's slot before the save) or
        restored (at_restore: before the restore) is still what we think it is."""
        launches = self.launches[slot]

        async def check(before: SlotState | None = None) -> str | None:
            with contextlib.suppress(OSError):
                await self.read_new_lines()
            if self.launches[slot] != launches or slot in self.running:
                return "a request was launched on the slot meanwhile (the engine's log shows it)"
            st = await self.sessions.look(slot)
            ref = before or at_restore
            if st is None:
                return None
            if st.is_processing:
                return "the engine's slot is running a request"
            if ref is not None and st.task_id != ref.task_id:
                return f"the engine's slot ran another task meanwhile (task {ref.task_id} → {st.task_id})"
            if before is not None and st.n_tokens not in (before.n_tokens, 0):
                return f"the engine's slot holds {st.n_tokens:,} tokens, {before.n_tokens:,} before the save"
            return None

        return check

    # -- after an engine restart ----------------------------------------------------------------
    async def _engine_restarted(self) -> None:
        """on_engine_restart (the watch's or our own report): the old process's requests are
        gone; restore once the lines read so far are acted on."""
        self.running.clear()
        self._engine_tasks = {}
        self._restore_wanted = True
        if not self._read_lock.locked():  # the watch's report: no batch to finish first
            self._start_restore()

    def _start_restore(self) -> None:
        if self._restore_task is None or self._restore_task.done():
            self._restore_wanted = False
            self._restore_task = asyncio.get_running_loop().create_task(self._restore_after_restart())

    async def _restore_after_restart(self) -> None:
        if not self.sessions.cfg.auto_sessions:
            return
        try:
            async with self._restore_lock:
                if not await self._engine_up():
                    log.warning("engine log: the engine did not answer /health within %g s after its restart: "
                                "nothing restored", self.cfg.engine.timeout_s)
                    return
                with contextlib.suppress(OSError):
                    await self.read_new_lines()
                for slot, _, name in self.sessions.last.plan(self.sessions.slots, self.sessions.index):
                    await self._restore_slot(slot, name)
        except Exception as e:
            log.warning("engine log: restore after the engine's restart: %s", e)

    async def _engine_up(self) -> bool:
        deadline = time.monotonic() + self.cfg.engine.timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(EngineError):
                if await self.sessions.engine.health():
                    return True
            await asyncio.sleep(0.1)
        return False

    async def _restore_slot(self, slot: int, name: str) -> None:
        if slot in self.running:
            return
        st = await self.sessions.look(slot)
        if st is not None and (st.is_processing or st.n_tokens > 0):
            log.info("engine log: slot %d holds %s tokens already: %s not restored", slot, f"{st.n_tokens:,}", name)
            return
        if await self.sessions.restore_behind(slot, LINE, self._check(slot, st), file_key=name[5:21]):
            self.restored += 1
            log.info("engine log: slot %d has %s back, from before the engine's restart", slot, name)
