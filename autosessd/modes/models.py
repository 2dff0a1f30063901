"""llama-server in router mode (--models-dir / --models-preset): several models behind one
URL, at most --models-max of them loaded, each model a child server with its own slots.

A model switch is the conversation switch one level up: when the router unloads a model, it
drops every slot's KV state of it, and nothing is saved. So autosessd takes the switch in
hand. Before it forwards a request for a model that is not loaded while the router is at its
limit, it picks the loaded model to make way (the least recently used one through the gate
that runs no request now), saves that model's conversations worth saving (Sessions.put_away),
unloads it itself (POST /models/unload: a save counts as use in the router's own order, so
leaving the choice to the router would evict another model), loads the one asked for and
waits until it is loaded, and only then runs the request's turn: its conversation is restored
from its file as after a restart. Requests for a model being put away or loaded wait; the
client sees it as time to its first token, never as an error.

The unit is (model, slot): each model has its own Sessions (its slots, state machine,
placement, launch gate, saves and restores), bound to an engine adapter that names the model
in every call and never loads it (autoload=false). They share the directory: one token
index, one prune, one set of counters and events (the house). Files are named per model: a
conversation's key K becomes model_key(model, K) (files of two models never take each
other's name), and a model's fingerprint names its router id too, so a file is only offered
to the model that saved it.

Bad answers from the router (GET /models failing, a model that does not load, an unload that
times out) are logged and the request is forwarded as it would be without autosessd.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..engines.base import EngineError
from ..store.names import StoreError
from ..sessions import held, views
from ..sessions.context import Context
from ..sessions.facade import Sessions
from ..sessions.facts import facts_of
from ..sessions.observe import SLEPT, UNLOADED
from ..sessions.report import Counters, Events
from ..sessions.savings import Savings
from ..sessions.upkeep import Upkeep

if TYPE_CHECKING:
    from ..base.config import Config
    from ..engines.llama_server import LlamaServer
    from ..store.directory import Store

log = logging.getLogger("autosessd")

LOAD_POLL_S = 0.2
UP = ("loaded", "sleeping")  # a sleeping model is loaded to the router: a request wakes it


def model_key(model: str, key: str) -> str:
    """A conversation's key as one model's files name it."""
    return hashlib.sha1(b"autosessd model\0" + model.encode() + b"\0" + key.encode()).hexdigest()[:16]


def save_path_of(args: list[str]) -> str | None:
    """--slot-save-path in a router child's arguments (GET /models status.args)."""
    for i, a in enumerate(args):
        if a == "--slot-save-path" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--slot-save-path="):
            return a.split("=", 1)[1]
    return None


@dataclass
class Model:
    id: str
    status: str = "unloaded"  # as GET /models last said: loaded | loading | sleeping | unloaded | ...
    args: list[str] = field(default_factory=list)  # its child's command line (GET /models)
    managed: bool = True  # its child saves into autosessd's directory
    sessions: Sessions | None = None  # made at its first load; kept while it is unloaded
    last_used: float = 0.0  # the last request for it through the gate
    in_flight: int = 0  # requests for it through the gate now
    loads: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)


class Router:
    def __init__(self, cfg: Config, engine: LlamaServer, store: Store, models: list[dict], max_loaded: int | None,
                 make_sessions: Callable[[LlamaServer, Model], Any]):
        """models: GET /models at the start; max_loaded: --models-max (None: no limit);
        make_sessions(adapter, model) → awaitable Sessions for a model just loaded (the
        daemon's start checks, per model)."""
        self.cfg = cfg
        self.engine = engine
        self.store = store
        self.max_loaded = max_loaded
        self._make_sessions = make_sessions
        # The house: what every model's Sessions shares.
        self.house = facts_of(Context(cfg, engine, store, "router", "router"))
        self.house.counters, self.house.events = Counters(), Events()
        self.house.savings = Savings("", cfg.effective_state_dir() / "savings.json")
        self.upkeep = Upkeep(self.house)
        self.models: dict[str, Model] = {}
        self._transition = asyncio.Lock()  # one model put away or loaded at a time
        self.started_at = time.time()
        self.inputs: dict[str, Callable[[], Any]] = {}
        self.on_engine_restart: list[Callable[[], Any]] = []
        self._seen(models)

    # -- what the router says ------------------------------------------------------------
    def _seen(self, listed: list[dict]) -> None:
        root = Path(self.store.staging).resolve()  # the engine's directory: its children save there
        for m in listed:
            model = self.models.get(m["id"])
            if model is None:
                model = self.models[m["id"]] = Model(m["id"])
                model.idle.set()
                path = save_path_of(m["args"])
                model.managed = path is not None and Path(path).resolve() == root
                if not model.managed:
                    log.warning("router: model %s saves its slots %s, not into %s: its conversations are not kept "
                                "(give the router --slot-save-path %s)", m["id"],
                                f"into {path}" if path else "nowhere (no --slot-save-path)", root, root)
            was, model.status, model.args = model.status, m["status"], m["args"]
            if was == "loaded" and model.status != "loaded" and model.sessions is not None:
                # Unloaded behind our back (a request that bypassed the gate, the router's own
                # choice) or asleep: what its slots held is gone.
                # A slot whose ticket is held is left to its turn: it looks at the slot itself,
                # and GET /models may have been answered before that turn woke the model.
                why = SLEPT if model.status == "sleeping" else UNLOADED
                for s in list(model.sessions.slots.values()):
                    if not s.busy:
                        model.sessions.observer.engine_gone(s, why)

    async def refresh(self) -> None:
        try:
            self._seen(await self.engine.router_models())
        except EngineError as e:
            log.warning("router: GET /models: %s", e)

    def loaded(self) -> list[Model]:
        """The models the router counts against --models-max (a sleeping one too)."""
        return [m for m in self.models.values() if m.status in UP]

    # -- a request's model ----------------------------------------------------------------
    def key(self, model: str, key: str | None) -> str | None:
        return None if key is None else model_key(model, key)

    async def acquire(self, name: str | None, load: bool = True) -> Sessions | None:
        """The Sessions of the model a request asks for, loaded (putting another away first
        when the router is at its limit), its request counted as in flight until release();
        None when the request names no model autosessd keeps (it is forwarded untouched), or
        with load=False when the model is not loaded.

        A request is counted in flight only once its model is loaded, under the transition
        lock: requests for a model being put away wait behind the switch (and load it again
        after), instead of keeping it busy so that the switch waits for them."""
        if not isinstance(name, str):
            return None
        model = self.models.get(name)
        if model is None:
            await self.refresh()
            model = self.models.get(name)
        if model is None or not model.managed:
            return None
        model.last_used = time.monotonic()
        async with self._transition:
            if model.status not in UP or model.sessions is None:
                await self.refresh()
            if (model.status not in UP or model.sessions is None) and load:
                await self._make_room_for(model)
                await self._load(model)
            if model.status not in UP or model.sessions is None:
                return None  # it did not load: forwarded untouched (the router says why)
            model.in_flight += 1
            model.idle.clear()
        return model.sessions

    def sessions_of(self, name: str) -> Sessions | None:
        """A loaded model's Sessions, without loading anything (a client's slot action)."""
        model = self.models.get(name)
        return model.sessions if model is not None and model.status in UP else None

    def release(self, name: str) -> None:
        model = self.models.get(name)
        if model is not None and model.in_flight > 0:
            model.in_flight -= 1
            if model.in_flight == 0:
                model.idle.set()

    async def _make_room_for(self, model: Model) -> None:
        if self.max_loaded is None or model.status in UP:
            return
        loaded = [m for m in self.loaded() if m is not model]
        if len(loaded) < self.max_loaded:
            return
        # The least recently used loaded model; one that runs a request now only when all do,
        # after its requests end (bounded: then the router decides alone).
        victim = min(loaded, key=lambda m: (m.in_flight > 0, m.last_used))
        if victim.in_flight:
            try:
                await asyncio.wait_for(victim.idle.wait(), self.cfg.engine.timeout_s)
            except asyncio.TimeoutError:
                log.warning("router: every loaded model runs a request; %s is left to the router", model.id)
                return
        await self._put_away(victim)

    async def _put_away(self, victim: Model) -> None:
        t0 = time.monotonic()
        c = self.house.counters

        async def unload() -> None:
            try:
                await self.engine.unload_model(victim.id)
                await self._until(victim, lambda st: st not in UP)
                if victim.status in UP:
                    log.warning("router: %s is still %s %g s (engine.timeout_s) after autosessd asked to unload it; "
                                "the router evicts on its own", victim.id, victim.status, self.cfg.engine.timeout_s)
            except EngineError as e:
                log.warning("router: unloading %s: %s", victim.id, e)

        saved = 0
        if victim.sessions is not None and victim.status != "sleeping":  # asleep: nothing held, and a look wakes it
            saved = await victim.sessions.commands.put_away(UNLOADED, unload)
        else:
            await unload()
        c.model_unloads += 1
        c.saves_at_model_switch += saved
        log.info("router: %s unloaded to make way (%d conversation(s) saved first) in %.0f ms", victim.id, saved,
                 (time.monotonic() - t0) * 1000)
        self.house.events.emit("model_unloaded", model=victim.id, saved=saved)

    async def _load(self, model: Model) -> None:
        t0 = time.monotonic()
        try:
            if model.status not in UP:
                await self.engine.load_model(model.id)
                await self._until(model, lambda st: st in UP)
            if model.status not in UP:
                log.warning("router: %s did not load (%s); its request goes on as it would without autosessd",
                            model.id, model.status)
                return
            if model.sessions is None:
                model.sessions = await self._make_sessions(self.engine.for_model(model.id), model)
            model.loads += 1
        except EngineError as e:
            log.warning("router: loading %s: %s; its request goes on as it would without autosessd", model.id, e)
            return
        log.info("router: %s loaded in %.0f ms", model.id, (time.monotonic() - t0) * 1000)
        self.house.events.emit("model_loaded", model=model.id, ms=round((time.monotonic() - t0) * 1000, 1))

    async def _until(self, model: Model, done: Callable[[str], bool]) -> None:
        deadline = time.monotonic() + self.cfg.engine.timeout_s
        while True:
            await self.refresh()
            if done(model.status) or time.monotonic() >= deadline:
                return
            await asyncio.sleep(LOAD_POLL_S)

    # -- the house: what the inputs and the daemon call, as they call a Sessions ---------------
    @property
    def ctx(self) -> Context:
        return self.house

    counters = property(lambda self: self.house.counters)
    events = property(lambda self: self.house.events)
    index = property(lambda self: self.house.index)
    restore_log = property(lambda self: self.house.restore_log)
    model, model_name, remote = "router", "router", None
    slots: dict = {}

    @property
    def engine_healthy(self) -> bool | None:
        return self._healthy

    _healthy: bool | None = True

    def set_cfg(self, cfg: Config) -> None:
        """A reload: the house and every model's Sessions read the new policy keys."""
        self.cfg = self.house.cfg = cfg
        for s in self.all_sessions():
            s.cfg = cfg

    def all_sessions(self) -> list[Sessions]:
        return [m.sessions for m in self.models.values() if m.sessions is not None]

    def status(self) -> dict[str, Any]:
        """Blocking (scans the directory): as Sessions.status, with the models."""
        st = views.status(self)  # type: ignore[arg-type]
        st["engine"]["slots"] = sum(len(s.slots) for s in self.all_sessions())
        st["slots"] = [{**sl, "model": m.id} for m in sorted(self.loaded(), key=lambda x: x.id)
                       if m.sessions is not None for sl in views.slot_entries(m.sessions)]
        nots = [s.restore_log.not_reused for s in self.all_sessions() if s.restore_log.not_reused]
        st["last_not_reused"] = max(nots, key=lambda n: n["at"]) if nots else None
        st["router"] = {"max_loaded": self.max_loaded, "models": self.describe_models()}
        idle = [s.idle.status() for s in self.all_sessions()]
        st["idle_save"] = {**idle[0], "pausing": sum(i["pausing"] for i in idle)} if idle else None
        return st

    async def ls_words(self, model: str | None = None) -> list[dict[str, Any]]:
        """Each model's files (its first words from that model, when it is loaded), people's
        files and what was moved aside once; with `model`, that model's only."""
        rows: dict[str, dict[str, Any]] = {}
        for m in sorted(self.models.values(), key=lambda x: x.id):
            if m.sessions is None or (model is not None and m.id != model):
                continue
            for r in await m.sessions.ls_words():
                if r["kind"] in ("auto", "prefix") and not r["model_ok"]:
                    continue  # another model's
                rows.setdefault(r["name"], {**r, "model": m.id if r["kind"] in ("auto", "prefix") else None})
        return sorted(rows.values(), key=lambda r: r["saved_at"], reverse=True)

    async def prune(self, keep: int | None = None, max_gb: float | None = None, dry_run: bool = False) -> dict:
        return await self.upkeep.prune(keep, max_gb, dry_run)

    async def forget(self, key: str) -> dict[str, Any]:
        """A conversation forgotten under every model (KEY as the client's requests name it, or
        a file's own key as `ls` shows it): each loaded model's Sessions.forget (its slots, its
        saves in flight, its files and held record), then the files of models not loaded."""
        done: dict[str, Any] = {"key": key, "freed": 0, "files": [], "emptied_slots": [], "running_slots": [],
                                "kept": [], "erase_failed": []}
        keys = {key, *(model_key(m, key) for m in self.models)}
        for m in sorted(self.models.values(), key=lambda x: x.id):
            if m.sessions is None:
                continue
            for k in sorted({key, model_key(m.id, key)}):
                one = await m.sessions.forget(k)
                done["freed"] += one["freed"]
                done["files"] += one["files"]
                done["kept"] += one["kept"]
                for what in ("emptied_slots", "running_slots", "erase_failed"):
                    done[what] += [{"model": m.id, "slot": n} for n in one[what]]
        # Models not loaded in this run: their files (the conversation's own and its branches, by
        # their metadata's line) and what their held records name.
        loop = asyncio.get_running_loop()
        entries = await loop.run_in_executor(None, self.store.scan)
        doomed = sorted({e.key for e in entries if e.key in keys or (e.meta is not None and e.meta.line in keys
                                                                      and not e.meta.prefix)})
        for k in doomed:
            try:
                n = self.store.remove(k)
            except StoreError as e:
                done["kept"].append(f"auto-{k}.bin: {e}")
                continue
            done["freed"] += n
            done["files"].append(f"auto-{k}.bin")
            if self.index is not None:
                self.index.remove(f"auto-{k}.bin")
        await loop.run_in_executor(None, held.forget_everywhere, self.cfg.effective_state_dir(), keys,
                                   set(done["files"]))
        return done

    async def fifos_free(self) -> None:
        for s in self.all_sessions():
            await s.fifos_free()

    async def engine_restarted(self, why: str) -> None:
        """The router itself restarted: every model's slots are gone."""
        for s in self.all_sessions():
            await s.engine_restarted(why)
        for m in self.models.values():
            m.status = "unloaded"
        for callback in list(self.on_engine_restart):
            await callback()

    async def save_at_stop(self) -> None:
        """The stop: every loaded model's conversations worth saving."""
        for m in self.loaded():
            if m.sessions is not None:
                for sid in list(m.sessions.slots):
                    await m.sessions.save_at_stop(sid, "stop")

    async def drain(self) -> None:
        for s in self.all_sessions():
            await s.drain()
        if self.upkeep.pruning():
            await asyncio.gather(self.upkeep.pruning(), return_exceptions=True)

    async def close(self) -> None:
        await self.upkeep.save_index()
        for s in self.all_sessions():
            await s.close(index=False)

    async def watch_engine(self, every_s: float = 2.0) -> None:
        """The router's health and its models: a model unloaded behind our back holds nothing
        any more; the router gone and back (health down then up) is a restart of them all."""
        up_before = True
        while True:
            await asyncio.sleep(every_s)
            try:
                up = await self.engine.health()
            except EngineError:
                up = False
            self._healthy = up
            if up and not up_before:
                await self.engine_restarted("the router restarted (health went down and up)")
            up_before = up
            if up:
                await self.refresh()

    def metric_rows(self) -> list[tuple[str, str, str, Any]]:
        models = sorted(self.models.values(), key=lambda x: x.id)
        return [("router_model_loaded", "gauge", "1 while the router has the model loaded (asleep included)",
                 [({"model": m.id}, int(m.status in UP)) for m in models]),
                ("router_model_loads_total", "counter", "Loads of the model that autosessd asked the router for",
                 [({"model": m.id}, m.loads) for m in models])]

    def describe_models(self) -> list[dict[str, Any]]:
        return [{"id": m.id, "status": m.status, "managed": m.managed, "loads": m.loads, "in_flight": m.in_flight,
                 "slots": [s.status() for s in sorted(m.sessions.slots.values(), key=lambda x: x.id)]
                 if m.sessions is not None else [],
                 "fingerprint": m.sessions.model if m.sessions is not None else None,
                 "saving_off": m.sessions.ctx.facts.off if m.sessions is not None else None}
                for m in sorted(self.models.values(), key=lambda x: x.id)]
