"""Wiring: config → engine + store + sessions → inputs; start checks, signals, sd_notify.

Life of the daemon:

    start    check the session directory, the shared bucket's setup ([shared]: boto3 and
             credentials present, else the start is refused; an unreachable bucket is only
             a warning), the engine (reachable, loaded, one slot, slot saving on, saving
             into our directory: a probe save while idle), clean up after a crash, start
             the bucket's upload worker and catalog, start the inputs, READY=1
    run      inputs feed sessions; SIGHUP reloads the config
    stop     (SIGTERM or SIGINT) STOPPING=1, inputs stop taking
             requests and get a bounded time to finish, the held conversation is saved
             if the engine is idle, what was held is recorded, with --exec the engine is
             stopped, the uploads still queued get their try (they are queued again at
             the next start otherwise), exit 0 -- all within one deadline
             (stop_timeout_s); what it cuts is named in the log. A stop during the start
             ends the start. A second SIGINT exits at once.

With --exec (child.py) the engine is autosessd's child: started after the store check and
a check that the gate's address is free, checked as any engine is (a child that exits during
the checks ends the start), stopped after the stop save (SIGTERM, SIGKILL at the deadline);
a child that exits by itself ends autosessd with exit 1.

Signal handlers only set state (initiate_shutdown); the work happens in run().
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Protocol

from .base import config as config_mod
from .base.config import Config, ConfigError
from .base.logs import stop_logging
from .engines import make_engine
from .engines.base import Engine
from .engines.child import EngineChild, describe_exit
from .engines.upstream import Upstream
from .follow.requestlog import RequestLogError
from .front.control import SocketInUse
from .front.doctor import on_tmpfs
from .front.guard import raise_nofile
from .modes.comeback import StartRestore
from .modes.models import Router
from .sessions.checks import StartupError, check_store, router_refusals
from .sessions.facade import Sessions
from .sessions.remote import Remote
from .starting import Starting
from .store.directory import Store

log = logging.getLogger("autosessd")

STOP_GRACE_S = 30.0  # in-flight requests get at most this long to finish at a stop (within stop_timeout_s)
# With --exec, the part of stop_timeout_s kept from the stop save for the engine's own exit
# after its SIGTERM (at most a quarter of it): llama-server frees its model and exits in well
# under a second here; a large model on a GPU takes longer.
CHILD_STOP_S = 5.0


class Input(Protocol):
    """A source of turns (gate, tail, control socket). Started after the engine check."""

    name: str

    async def start(self) -> None: ...

    async def stop(self, grace_s: float) -> None: ...

    def describe(self) -> Any: ...


# -- sd_notify, without a dependency -------------------------------------------------
def sd_notify(message: str) -> None:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(message.encode())
    except OSError as e:
        log.debug("sd_notify failed: %s", e)


# -- the daemon ---------------------------------------------------------------------
class Daemon(Starting):
    def __init__(self, cfg: Config, config_path: str | None = None, overrides: dict[str, Any] | None = None,
                 child: EngineChild | None = None):
        """child: with --exec, the engine to start (and stop) as autosessd's child."""
        self.cfg = cfg
        self.child = child
        self._engine_gone = False  # the child exited by itself: nothing left to save
        self.config_path = config_path
        self.overrides = overrides or {}
        # One HTTP pool to the engine, for the engine adapter and the gate alike (DESIGN §8).
        self.pool = Upstream(cfg.engine.url, cfg.engine.timeout_s)
        self.engine: Engine = make_engine(cfg, self.pool)
        self.store: Store | None = None
        self.sessions: Sessions | None = None
        self.router: Router | None = None  # llama-server in router mode: one Sessions per model
        self.house: Any = None  # what the inputs, status and the stop act on: the Sessions or the Router
        self.inputs: list[Input] = []
        self._stop = asyncio.Event()
        self._stop_reason = ""
        self._sigints = 0
        self._watcher: asyncio.Task | None = None
        self._comeback: asyncio.Task | None = None  # the restore at start (comeback.py)
        self._stopping = ""  # what the stop is doing now: said if the deadline cuts it
        self.shared: Any = None  # shared.SharedStore when [shared] is set
        self.remote: Remote | None = None
        self._serving = False  # the start is done and no stop has begun: the gate's /health says 200

    # Inputs register here; the gate, tail and control socket each build one from cfg.
    def build_inputs(self) -> list[Input]:
        assert self.house is not None
        from .front.control import ControlServer

        inputs: list[Input] = [ControlServer(self.cfg, self.house)]
        if self.cfg.gate.listen:
            from .front.gate import Gate

            inputs.append(Gate(self.cfg, self.sessions, self.pool, self.router, not_ready=self.not_ready))
        if self.cfg.tail.request_log:
            from .follow.tail import Tail

            inputs.append(Tail(self.cfg, self.sessions, self.cfg.tail.request_log))
        if self.cfg.engine.log:
            from .follow.enginetail import EngineTail

            inputs.append(EngineTail(self.cfg, self.sessions, self.cfg.engine.log))
        return inputs

    async def start(self) -> None:
        if self.child is not None:
            # The engine refuses a --slot-save-path that is not a directory; a new model's
            # directory under llama-swap is made here, for its user only.
            try:
                staging = Path(self.cfg.slot_save_path)
                if self.cfg.store_path is not None and staging.parent.name == f"autosessd-{os.getuid()}":
                    staging.parent.mkdir(mode=0o700, exist_ok=True)  # tmpfs staging (config.tmpfs_staging)
                os.makedirs(self.cfg.slot_save_path, mode=0o700, exist_ok=True)
            except OSError as e:
                raise StartupError(f"slot_save_path {self.cfg.slot_save_path}: cannot create it: "
                                   f"{e.strerror or e}") from None
        self.store = check_store(self.cfg)
        if self.cfg.shared is not None:
            await self._open_shared()
        checked = await self._check_engine()
        model_name = checked.model_name
        if checked.router:
            router_refusals(self.cfg)
        # A directory of thousands of files, or names that are not what they say: off the loop,
        # so a stop during it is still heard.
        for what in await asyncio.get_running_loop().run_in_executor(None, self.store.cleanup):
            log.info("auto sessions: removed %s", what)
        if checked.router:
            await self._start_router(checked)
        else:
            await self._start_sessions(checked)
        try:
            self.inputs = self.build_inputs()
        except RequestLogError as e:
            raise StartupError(str(e)) from None
        started: list[Input] = []
        try:
            for inp in self.inputs:
                await inp.start()
                started.append(inp)
        except BaseException as e:
            for inp in reversed(started):
                await inp.stop(0)
            if isinstance(e, (SocketInUse, OSError)):
                raise StartupError(str(e)) from None
            raise
        self._watcher = asyncio.get_running_loop().create_task(self.house.watch_engine())
        self.house.inputs.update({inp.name: inp.describe for inp in self.inputs})
        if self.cfg.restore_at_start and self.cfg.auto_sessions and not any(inp.name == "gate" for inp in self.inputs):
            # No input restores before a request: each slot's last conversation, back now
            # (behind a router: of each model loaded now).
            if self.router is not None:
                held = [(m.id, m.sessions) for m in self.router.loaded() if m.sessions is not None]
            else:
                held = [(None, self.sessions)] if self.sessions is not None else []
            for _, sessions in held:  # its files into the page cache meanwhile (warm.py)
                sessions.warmer.held_at_stop(name for _, _, name in StartRestore.plan(sessions))
            back = StartRestore(held)
            self.house.inputs[back.name] = back.describe
            self._comeback = asyncio.get_running_loop().create_task(back.run())
        log.info("autosessd ready: engine %s (%s), sessions in %s, inputs: %s", self.engine.address, model_name,
                 self.store.path, ", ".join(self.house.inputs) or "none")
        if self.store.cut and on_tmpfs(str(self.store.staging)) is False:
            log.info("the engine saves into %s, on a disk: each save is written there whole before the store keeps "
                     "its new blocks; with --slot-save-path on tmpfs (/dev/shm/...) and --store-path on the disk, "
                     "only the blocks reach the disk (autosessctl doctor, \"staging\")", self.store.staging)

    def not_ready(self) -> str | None:
        """Why this autosessd does not serve now (the gate's /health answers 503 with it), or None."""
        if self._stop.is_set():
            return f"stopping ({self._stop_reason})"
        return None if self._serving else "starting"

    def initiate_shutdown(self, reason: str) -> None:
        if not self._stop.is_set():
            self._stop_reason = reason
            self._stop.set()

    def _on_sigint(self) -> None:
        self._sigints += 1
        if self._sigints > 1:
            log.warning("second interrupt: exiting now")
            stop_logging()
            os._exit(130)
        self.initiate_shutdown("SIGINT")

    def reload(self) -> None:
        try:
            new = config_mod.load(self.config_path, self.overrides)
        except ConfigError as e:
            log.error("reload refused, keeping the running config: %s", e)
            return
        needs_restart = [k for k in ("slot_save_path", "state_dir", "stop_timeout_s", "engine", "gate", "tail",
                                     "control", "shared")
                         if getattr(new, k) != getattr(self.cfg, k)]
        if needs_restart:
            log.warning("reload: %s changed and take effect at the next start", ", ".join(needs_restart))
        # Policy keys apply now; the rest of the running wiring stays as it started.
        import dataclasses

        self.cfg = dataclasses.replace(self.cfg, auto_sessions=new.auto_sessions,
                                       auto_sessions_min_tokens=new.auto_sessions_min_tokens,
                                       auto_sessions_keep=new.auto_sessions_keep,
                                       auto_sessions_max_gb=new.auto_sessions_max_gb,
                                       idle_save_s=new.idle_save_s, idle_save_min_new_tokens=new.idle_save_min_new_tokens,
                                       idle_save_mb_per_min=new.idle_save_mb_per_min,
                                       idle_save_switched_s=new.idle_save_switched_s)
        if self.sessions:
            self.sessions.cfg = self.cfg
        if self.router:
            self.router.set_cfg(self.cfg)
        log.info("reloaded %s: min_tokens=%s keep=%s max_gb=%s auto_sessions=%s idle_save_s=%s", new.source,
                 self.cfg.auto_sessions_min_tokens, self.cfg.auto_sessions_keep, self.cfg.auto_sessions_max_gb,
                 self.cfg.auto_sessions, self.cfg.idle_save_s)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        # systemd's default soft limit (1,024 descriptors) is what a flood of half-sent
        # requests exhausts first; the gate's connection cap is sized from the raised one.
        log.debug("open-file limit: %d", raise_nofile())
        loop.add_signal_handler(signal.SIGTERM, self.initiate_shutdown, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        # A stop asked for during the start (the engine wait lasts up to engine.timeout_s)
        # ends the start instead of waiting for it.
        starting = loop.create_task(self.start())
        stop_wait = loop.create_task(self._stop.wait())
        await asyncio.wait({starting, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            log.info("stopping (%s) before the start finished", self._stop_reason)
            await self._stop_child(self.cfg.stop_timeout_s)
            await self.engine.close()
            await self.pool.close()
            return 0
        try:
            starting.result()
        except BaseException as e:
            # A start check's refusal, or anything else that ended the start: with --exec the
            # engine started here is stopped either way, never left behind on its port.
            if isinstance(e, StartupError):
                log.error("cannot start: %s", e)
            await self._stop_child(self.cfg.stop_timeout_s)
            await self.engine.close()
            await self.pool.close()
            if isinstance(e, StartupError):
                return 1
            raise
        self._serving = True
        sd_notify("READY=1\nSTATUS=serving")
        watchdog = self._start_watchdog()
        code = await self._serve()
        log.info("stopping (%s)", self._stop_reason)
        sd_notify("STOPPING=1\nSTATUS=stopping: saving the held conversation")
        if watchdog:
            watchdog.cancel()
        await self.stop()
        return code

    async def _serve(self) -> int:
        """Until a stop is asked for (0), or with --exec the engine exits by itself (1)."""
        loop = asyncio.get_running_loop()
        stop_wait = loop.create_task(self._stop.wait())
        waits = {stop_wait}
        if self.child is not None:
            waits.add(loop.create_task(self.child.exited()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if self._stop.is_set() or self.child is None or self.child.alive():
            return 0
        assert self.child.proc is not None
        # The process manager (llama-swap, systemd) must see that its command died: the gate
        # has no engine behind it, and restarting the engine is the manager's to decide.
        why = describe_exit(self.child.proc.returncode or 0)
        log.error("engine: %s (pid %d) exited by itself (%s): autosessd stops and exits 1, its gate has no "
                  "engine behind it", self.child.name, self.child.proc.pid, why)
        self._engine_gone = True
        self.initiate_shutdown(f"the engine exited: {why}")
        return 1

    async def stop(self) -> None:
        """One deadline (stop_timeout_s) for the whole stop: the inputs' requests in flight
        (at most STOP_GRACE_S of it, or half), then the stop save, then with --exec the
        engine (SIGTERM; SIGKILL at the deadline), then the background writes. What is still
        running at the deadline is given up, and the log says what."""
        deadline = time.monotonic() + self.cfg.stop_timeout_s
        # With --exec, the stop save ends this much before the deadline: the engine's exit
        # after its SIGTERM has that long before the SIGKILL.
        reserve = min(CHILD_STOP_S, self.cfg.stop_timeout_s / 4) if self.child is not None else 0.0

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        if self._watcher is not None:
            self._watcher.cancel()
        if self._comeback is not None:
            self._comeback.cancel()  # a restore it waits for ends with the engine call's own bound
        # No save while idle starts now: the stop save comes.
        every = self.router.all_sessions() if self.router is not None else [self.sessions]
        for s in filter(None, every):
            s.idle.close()
        # The inputs stop together: each stops taking requests at once, then gives those in
        # flight the same bounded time (not one grace after another), at most half the
        # deadline: the stop save needs the rest.
        grace = min(STOP_GRACE_S, self.cfg.stop_timeout_s / 2)
        await asyncio.gather(*(self._stop_input(inp, grace, left) for inp in self.inputs))
        if self.house is not None:
            # A multi-GB save can outlast systemd's stop timeout: ask for the rest of ours.
            sd_notify(f"EXTEND_TIMEOUT_USEC={int((left() + 5) * 1e6)}")
            self._stopping = "the stop save"
            try:
                await asyncio.wait_for(self._stop_save(), max(0.0, left() - reserve))
            except asyncio.TimeoutError:
                log.error("stop: gave up on %s after stop_timeout_s = %g s%s; a save the engine was still "
                          "writing is left as a temporary, removed at the next start", self._stopping,
                          self.cfg.stop_timeout_s, f" (less {reserve:g} s for the engine's exit)" if reserve else "")
            except Exception as e:
                log.error("auto sessions: stop save: %s", e)
            for s in filter(None, every):
                await s.last.record_stop(s.slots.values())
        await self._stop_child(left())
        if self.shared is not None:
            await self._stop_shared(left)
        await self.engine.close()
        await self.pool.close()

    async def _stop_child(self, within_s: float) -> None:
        if self.child is not None:
            try:
                await self.child.stop(within_s)
            except Exception as e:  # a stop always ends
                log.error("engine: stopping %s: %s", self.child.name, e)

    async def _stop_shared(self, left: Any) -> None:
        """After the last saves were finalized (and queued): what is still queued gets its try
        within the stop's deadline; then the worker stops. What is not uploaded is found
        again at the next start (the bucket lacks it)."""
        assert self.shared is not None
        if self.remote is not None:
            await self.remote.close()
        loop = asyncio.get_running_loop()
        self._stopping = "the uploads to the shared bucket"
        try:
            n = self.shared.pending()
            if n:
                log.info("auto sessions: shared: stop: %d upload(s) to finish (at most %.0f s)", n, left())
            not_done = await loop.run_in_executor(None, self.shared.drain, left())
            if not_done:
                log.warning("auto sessions: shared: stop: %d upload(s) not done (%s); they are queued again at "
                            "the next start", not_done, self.shared.status()["last_upload_error"] or "out of time")
            await loop.run_in_executor(None, self.shared.stop, min(5.0, left()))
        except Exception as e:  # the tier never fails a stop
            log.error("auto sessions: shared: stop: %s", e)

    async def _stop_input(self, inp: Input, grace: float, left: Any) -> None:
        try:
            await asyncio.wait_for(inp.stop(grace), left())
        except asyncio.TimeoutError:
            log.error("stop: gave up stopping %s after stop_timeout_s = %g s", inp.name, self.cfg.stop_timeout_s)
        except Exception as e:
            log.warning("stopping %s: %s", inp.name, e)

    async def _stop_save(self) -> None:
        if self.router is not None:
            if self._engine_gone:
                log.warning("auto sessions: stop: the engine is gone, nothing of what its slots held can be saved")
            else:
                self._stopping = "the stop saves of the router's loaded models"
                await self.router.save_at_stop()
            self._stopping = "the last session files being written (finalize, prune)"
            await self.router.drain()
            self._stopping = "the index cache"
            await self.router.close()
            return
        assert self.sessions is not None
        if self._engine_gone:
            log.warning("auto sessions: stop: the engine is gone, nothing of what its slots held can be saved")
        for sid in [] if self._engine_gone else list(self.sessions.slots) or [self.cfg.engine.slot]:
            key = self.sessions.view(sid).key
            self._stopping = f"the stop save of slot {sid}" + (f" (conversation {key})" if key else "")
            await self.sessions.save_at_stop(sid, "stop")
        self._stopping = "the last session files being written (finalize, prune)"
        await self.sessions.drain()
        self._stopping = "the index cache"
        await self.sessions.close()

    def _start_watchdog(self) -> asyncio.Task | None:
        usec = os.environ.get("WATCHDOG_USEC")
        if not usec or not usec.isdigit():
            return None
        interval = int(usec) / 1e6 / 2

        async def beat() -> None:
            while True:
                sd_notify("WATCHDOG=1")
                await asyncio.sleep(interval)

        return asyncio.get_running_loop().create_task(beat())


def run(cfg: Config, config_path: str | None = None, overrides: dict[str, Any] | None = None,
        child: EngineChild | None = None) -> int:
    """The daemon's whole life in the foreground; returns the exit code."""
    return asyncio.run(Daemon(cfg, config_path, overrides, child).run())
