"""The daemon's start, after the store check (daemon.py): the engine checked (reachable, its
model loaded, slot saving into our directory: a probe save while idle; behind a router, what
it refuses), the Sessions built from what the checks found (one, or one per model behind a
router: modes/models.py), and the shared bucket opened ([shared]). Daemon is this class and
the daemon's life; the attributes declared below are Daemon's own."""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from .base import config as config_mod
from .base.config import Config
from .engines.base import Engine, EngineError, SlotsHidden
from .engines.child import EngineChild, ExecError, check_free, describe_exit
from .engines.llama_server import LlamaServer
from .engines.process import engine_command
from .modes import sleep
from .modes.models import UP, Model, Router
from .modes.sleep import SleepWatch
from .sessions import facts
from .sessions.checks import Checked, StartupError, check_engine, empties_idle_slots, probe_save, warn_empties_idle
from .sessions.facade import Sessions
from .sessions.remote import Remote
from .store.directory import Store
from .store.slotfile import KVLayout

log = logging.getLogger("autosessd")


class Starting:
    """Daemon's start half (see the module's docstring)."""

    cfg: Config
    child: EngineChild | None
    engine: Engine
    store: Store | None
    sessions: Sessions | None
    router: Router | None
    house: Any
    shared: Any
    remote: Remote | None
    _stop: asyncio.Event
    _stop_reason: str

    async def _start_sessions(self, checked: Checked) -> None:
        assert self.store is not None
        self.house = self.sessions = Sessions(
            self.cfg, self.engine, self.store, checked.model, checked.model_name,
            slots_visible=checked.slots_visible, n_slots=checked.total_slots, layout=checked.layout,
            empties_idle_slots=checked.clears_idle_slots, engine_healthy=True, n_ctx=checked.n_ctx,
            template=checked.template)
        await self.sessions.prepare()  # the token index, after cleanup removed what is not whole
        self.sessions.watch.at_start = await asyncio.get_running_loop().run_in_executor(
            None, self.sessions.watch.identity)  # its log's start lines are not a restart (watch.py)
        if self.shared is not None:
            # After cleanup (only whole saves are queued) and once the model is known: the
            # worker first queues local saves of this model that the bucket lacks.
            self.shared.start(self.store, checked.model)
            self.remote = Remote(self.shared, self.cfg.shared, checked.model, self.sessions.ctx.max_tokens)
            self.remote.start()
            self.sessions.remote = self.remote
        seconds = await asyncio.get_running_loop().run_in_executor(None, sleep.find_seconds, self.cfg)
        if seconds:
            self.sessions.sleep = SleepWatch(self.sessions, seconds)
            self.sessions.sleep.start()

    async def _start_router(self, checked: Checked) -> None:
        """llama-server in router mode: its models as GET /models lists them; each model's
        Sessions is made (and its engine checked) when it is first loaded, by the router."""
        assert self.store is not None and isinstance(self.engine, LlamaServer)
        try:
            listed = await self.engine.router_models()
        except EngineError as e:
            raise StartupError(f"the engine at {self.engine.address} is a router, but GET /models: {e}") from None
        self.house = self.router = Router(self.cfg, self.engine, self.store, listed, checked.max_loaded,
                                          self._model_sessions)
        managed = [m.id for m in self.router.models.values() if m.managed]
        if not listed:
            # A router with no model (yet): nothing to keep; its requests pass untouched.
            log.warning("engine: the router at %s lists no models: its requests are forwarded untouched, and "
                        "autosessd keeps no conversations until it is restarted with models to serve",
                        self.engine.address)
        elif not managed:
            raise StartupError(f"none of the models of the router at {self.engine.address} saves its slots into "
                               f"{self.store.staging}: start llama-server with --slot-save-path {self.store.staging}")
        await self.router.upkeep.prepare(swa=False)  # the one token index; each model's window as it loads
        log.info("engine: a router (--models-max %s) serving %s; autosessd keeps the conversations of %s",
                 checked.max_loaded or "unlimited", ", ".join(sorted(self.router.models)), ", ".join(managed))
        for m in self.router.loaded():
            if m.managed:  # loaded before us: its slots are checked now
                m.sessions = await self._model_sessions(self.engine.for_model(m.id), m)

    async def _model_sessions(self, adapter: LlamaServer, model: Model) -> Sessions:
        """One model behind the router, just loaded: the start checks of a plain engine,
        except that a failure is said and the model served as it is (never a refused start)."""
        assert self.store is not None and self.router is not None
        info = await adapter.info()
        try:
            await adapter.slots()
            visible = True
        except SlotsHidden:
            visible = False
        layout: KVLayout | None = None
        try:
            layout = await probe_save(adapter, self.store, 0)
        except (StartupError, EngineError) as e:
            log.warning("router: model %s: the probe save: %s", model.id, e)
        clears = False
        if info.total_slots > 1 and visible:
            router = await asyncio.to_thread(engine_command, self.cfg.engine.kind, self.cfg.engine.url)
            command = (model.args, router[1] if router else {}) if model.args else router
            clears, how = empties_idle_slots(info.total_slots, layout, command)
            warn_empties_idle(adapter, clears, how)
        s = Sessions(self.cfg, adapter, self.store, info.model, info.model_name, slots_visible=visible,
                     n_slots=info.total_slots, layout=layout, empties_idle_slots=clears, engine_healthy=True,
                     n_ctx=info.n_ctx, house=self.router.house, upkeep=self.router.upkeep, template=info.template)
        await facts.model_memory(s.ctx)
        await s.check_template()
        if self._stop.is_set():
            s.idle.close()  # loaded during the stop's grace: no save while idle after the stop save
        s.inputs = self.router.inputs
        seconds = sleep.find_seconds(self.cfg, model.args)
        if seconds:
            s.sleep = SleepWatch(s, seconds, lambda: model.status in UP)
            s.sleep.start()
        log.info("router: model %s: %d slot(s), %s tokens each", model.id, info.total_slots, info.n_ctx)
        return s

    async def _check_engine(self) -> Checked:
        """The start checks; with --exec, against the child started here, and a child that
        exits during them ends the start."""
        assert self.store is not None
        if self.child is None:
            return await check_engine(self.cfg, self.engine, self.store)
        # A port in use is found now, not after a model of many GB has loaded.
        for hostport in [config_mod.parse_hostport(a) for a in self.cfg.gate.listen or ()]:
            why = check_free(hostport)
            if why is not None:
                host, port = hostport
                raise StartupError(f"gate.listen {f'[{host}]' if ':' in host else host}:{port} (the engine "
                                   f"command's --host/--port): cannot listen there: {why}")
        try:
            await self.child.spawn()
        except ExecError as e:
            raise StartupError(str(e)) from None
        loop = asyncio.get_running_loop()
        checking = loop.create_task(check_engine(self.cfg, self.engine, self.store))
        died = loop.create_task(self.child.exited())
        await asyncio.wait({checking, died}, return_when=asyncio.FIRST_COMPLETED)
        if checking.done():
            died.cancel()
            return checking.result()
        checking.cancel()
        await asyncio.gather(checking, return_exceptions=True)
        where = f"in {self.child.output}" if self.child.output else "above"
        raise StartupError(f"the engine command {self.child.name} exited before it was ready "
                           f"({describe_exit(died.result())}); its output is {where}")

    async def _open_shared(self) -> None:
        """The shared bucket: a setup that cannot work (boto3 or credentials missing) refuses
        the start, as a wrong config does; a bucket that does not answer now is only a warning
        (the local tier works alone, uploads wait and retry)."""
        from .shared import SharedStore, Unavailable

        assert self.cfg.shared is not None
        try:
            self.shared = SharedStore(self.cfg.shared)
        except Unavailable as e:
            raise StartupError(f"[shared] in {self.cfg.source}: {e}") from None
        why = await asyncio.get_running_loop().run_in_executor(None, self.shared.check)
        if why:
            log.warning("auto sessions: shared: %s; autosessd runs with its local directory, and uploads are "
                        "retried until the bucket answers", why)
        else:
            log.info("auto sessions: shared: bucket %s at %s, under %r, as host %s", self.shared.bucket,
                     self.cfg.shared.endpoint_url, self.shared.prefix, self.shared.host)
