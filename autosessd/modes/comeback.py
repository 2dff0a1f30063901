"""After a reboot: each slot's last conversation back before its first request (issue 33).

The gate restores a conversation in its request's turn, before the request runs. The other
inputs cannot: the engine's log and a request log show a request once the engine has it, and
a turn hook is called only when the serving layer calls it. So after the engine and autosessd
start fresh together (a reboot, `systemctl restart` of the pair), a client going on from its
last answer re-read its whole conversation. At a start with no gate, when the engine's slots
are empty, each slot's last conversation (held.json, kept as the slots change: held.Recorder)
is restored into it while the engine is idle, the most recently used first, through the same
path as the tails' restore after an engine restart (Sessions.restore_behind):

    a request first    a slot that runs or ran a request since the start (its view is not at
                       rest, or its engine slot holds tokens or works) is left alone: the
                       request wins; one arriving during a restore waits at most for it
    trusted            only when the engine's slot ran no task meanwhile (its id_task), else
                       counted in restores_not_trusted and the slot is unknown
    bounded            each restore within engine.timeout_s; a file is restored once, and only
                       one this engine can load (restore_behind's rules: this model, min tokens)
    said               every slot's outcome in the log and in status (inputs.start_restore)

`restore_at_start = false` turns it off. Behind a router (the turn hook its only input then)
each model keeps its own record (held.file_name), and the models loaded at the start are put
back one after another; a model the router loads later is loaded for a request, which runs at
once: there is no idle engine to restore into before it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from ..engines.base import SlotState

if TYPE_CHECKING:
    from ..sessions.facade import Sessions

log = logging.getLogger("autosessd")


class StartRestore:
    name = "start_restore"

    def __init__(self, held: list[tuple[str | None, Sessions]]):
        """held: (model, its Sessions) for each model to put back; model None: a plain engine."""
        self.records = held
        self.outcomes: list[dict[str, Any]] = []
        self.done = False

    def describe(self) -> dict[str, Any]:
        return {"done": self.done, "restored": sum(o["restored"] for o in self.outcomes), "slots": list(self.outcomes)}

    @staticmethod
    def plan(sessions: Sessions) -> list[tuple[int, str, str]]:
        """(slot, key, file) from what each slot held last (held.Recorder.plan): the most
        recently used first, each file once, none another chosen one extends, slots the engine has."""
        return sessions.last.plan(sessions.slots, sessions.index)

    async def run(self) -> None:
        try:
            for model, sessions in self.records:
                await self._model(model, sessions)
        except Exception as e:  # a bug must not stop the daemon's other work
            log.exception("auto sessions: restore at start: %s", e)
        finally:
            self.done = True

    async def _model(self, model: str | None, sessions: Sessions) -> None:
        of = f"model {model}: " if model is not None else ""
        plan = self.plan(sessions)
        if plan:
            log.info("auto sessions: at start: %s%d slot(s) had a conversation before; putting them back while the "
                     "engine is idle", of, len(plan))
        for slot, key, name in plan:
            t0 = time.monotonic()
            why = await self._one(sessions, slot, key, name)
            outcome = {"slot": slot, "file": name, "restored": why is None, "why": why,
                       "ms": round((time.monotonic() - t0) * 1000, 1)}
            self.outcomes.append(outcome if model is None else {"model": model, **outcome})
            if why is None:
                log.info("auto sessions: at start: %sslot %d has %s back (its last conversation)", of, slot, name)
            else:
                log.info("auto sessions: at start: %sslot %d: %s not restored: %s", of, slot, name, why)

    async def _one(self, s: Sessions, slot: int, key: str, name: str) -> str | None:
        if not s.slot(slot).at_rest() or s.view(slot).file is not None:
            return "a request came first"
        st = await s.look(slot)
        if st is None:
            return "the engine's slots cannot be read (GET /slots): whether it uses them is not known"
        if st.is_processing or st.n_tokens > 0:
            return f"the engine's slot is in use ({st.n_tokens:,} tokens)"
        if not await s.restore_behind(slot, key, self._check(s, slot, st), file_key=name[5:21]):
            return "not restored (the log says why)"
        return None

    @staticmethod
    def _check(s: Sessions, slot: int, before: SlotState) -> Callable[[], Awaitable[str | None]]:
        async def check() -> str | None:
            st = await s.look(slot)
            if st is not None and (st.task_id != before.task_id or st.is_processing):
                return "a request reached the slot while it was restored"
            return None

        return check
