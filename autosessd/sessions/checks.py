"""The start checks: the session directory, the engine (reachable, its model loaded, slot
saving on and into our directory: a probe save while idle; whether it empties idle slots),
and what a router refuses. Each failure is a StartupError whose message says what to do.

daemon.py runs them in this order at every start: check_store, (the shared bucket), the
engine's (check_engine, or per model behind a router: daemon._model_sessions).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..base.config import Config
from ..engines.base import Engine, EngineError, SlotSavingOff, SlotsHidden
from ..engines.process import engine_command
from ..store import places
from ..store.names import QUARANTINE
from ..store import slotfile
from ..store.directory import TEMP_PREFIX, Store
from ..store.slotfile import KVLayout
from .report import fmt_bytes

log = logging.getLogger("autosessd")


class StartupError(Exception):
    """The daemon cannot start; the message says what to do."""


class SavesElsewhere(StartupError):
    """The probe save did not land in the session directory (facts.py: for good, until the
    engine restarts again; a short probe file is a passing trouble)."""


async def wait_engine(engine: Engine, deadline_s: float) -> None:
    """Until the engine answers /health with its model loaded, or the deadline."""
    deadline = time.monotonic() + deadline_s
    # Said before the first try: an engine that is down (or a wrong URL) would otherwise
    # leave the log silent for the whole wait.
    log.info("engine check: waiting up to %g s (engine.timeout_s) for the engine at %s to answer /health "
             "with its model loaded", deadline_s, engine.address)
    last: Exception | None = None
    said = ""
    while True:
        try:
            if await engine.health():
                return
            last = EngineError(f"the engine at {engine.address} is still loading its model")
        except EngineError as e:
            last = e
        if time.monotonic() >= deadline:
            raise StartupError(f"{last} (waited {deadline_s:g} s)")
        if str(last) != said:  # each new reason once, not every quarter second
            said = str(last)
            log.info("engine check: not yet: %s; still waiting", said)
        await asyncio.sleep(0.25)


async def wait_idle(engine: Engine, slot: int, deadline_s: float) -> bool:
    """Until the slot is idle. False when the engine does not show its slots (--no-slots)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            states = await engine.slots()
        except SlotsHidden:
            return False
        st = next((s for s in states if s.id == slot), None)
        if st is None:
            raise StartupError(f"the engine at {engine.address} has no slot {slot} "
                               f"(it has {', '.join(str(s.id) for s in states) or 'none'}): fix engine.slot")
        if not st.is_processing:
            return True
        if time.monotonic() >= deadline:
            raise StartupError(f"slot {slot} of the engine at {engine.address} stayed busy for {deadline_s:g} s; "
                               f"autosessd checks the engine with a probe save while it is idle")
        await asyncio.sleep(0.25)


@dataclass(frozen=True)
class Checked:
    model: str  # fingerprint
    model_name: str
    slots_visible: bool  # False: the engine runs with --no-slots
    total_slots: int = 1
    layout: KVLayout | None = None  # of the engine's state files, as far as the probe shows (its streams)
    clears_idle_slots: bool = False
    n_ctx: int | None = None  # tokens one slot holds (/props)
    router: bool = False  # llama-server in router mode: its models are checked as they load (models.py)
    max_loaded: int | None = None  # the router's --models-max
    template: str = ""  # the chat template's identity (EngineInfo.template)


async def check_engine(cfg: Config, engine: Engine, store: Store) -> Checked:
    """Refuse to start unless the engine is usable."""
    await wait_engine(engine, cfg.engine.timeout_s)
    try:
        info = await engine.info()
    except EngineError as e:
        raise StartupError(f"cannot read the engine's properties: {e}") from None
    if info.router:
        return Checked("router", "router", True, 0, router=True, max_loaded=info.max_loaded)
    if info.kv_settings is None:
        log.warning("engine: the command line of the engine at %s cannot be read from here (another user's "
                    "process, a container, another host): settings that change its KV (--rope-*, --yarn-*, --lora, "
                    "--control-vector, --override-kv) cannot be told apart; after changing one, give autosessd a "
                    "new store_path (or forget the old saves): saves made under the old ones would be restored",
                    engine.address)
    elif info.kv_settings:
        log.info("engine: its saves are told apart from those of other settings by: %s", ", ".join(info.kv_settings))
    if cfg.engine.slot >= info.total_slots:
        raise StartupError(f"engine.slot is {cfg.engine.slot}, but the engine at {engine.address} runs "
                           f"{info.total_slots} slot(s) (0-{info.total_slots - 1}): fix engine.slot")
    try:
        visible = await wait_idle(engine, cfg.engine.slot, cfg.engine.timeout_s)
        layout = await probe_save(engine, store, cfg.engine.slot)
    except SlotSavingOff:
        raise StartupError(f"slot saving is off in the engine at {engine.address}: start llama-server with "
                           f"--slot-save-path {store.staging}") from None
    except EngineError as e:
        raise StartupError(f"the probe save failed: {e}") from None
    if not visible:
        log.warning("engine: %s does not show its slots (--no-slots): autosessd takes token counts from the "
                    "responses, and cannot see requests that bypass the gate (or a serving layer that does not "
                    "use the turn hook); switch-back and restart work as usual", engine.address)
    clears = False
    if info.total_slots > 1:
        log.info("engine: %d slots%s; each conversation is placed on one and pinned there (id_slot)",
                 info.total_slots, f", {layout.n_stream} KV stream(s)" if layout else "")
        if visible:
            command = await asyncio.to_thread(engine_command, cfg.engine.kind, cfg.engine.url)
            clears, how = empties_idle_slots(info.total_slots, layout, command)
            warn_empties_idle(engine, clears, how)
    return Checked(info.model, info.model_name, visible, info.total_slots, layout, clears, info.n_ctx,
                   template=info.template)


def warn_empties_idle(engine: Engine, clears: bool, how: str) -> None:
    if clears:
        log.warning("engine: %s empties idle slots whenever a request starts on another one (%s): autosessd "
                    "saves each conversation when its request ends, not only when its slot is taken, and a "
                    "conversation whose request ends just as another starts can miss its save. Start llama-server "
                    "with --no-cache-idle-slots to keep idle slots (docs: How it works, Several slots)",
                    engine.address, how)
    else:
        log.info("engine: idle slots keep what they hold (%s)", how)


def empties_idle_slots(total_slots: int, layout: KVLayout | None,
                       command: tuple[list[str], dict[str, str]] | None) -> tuple[bool, str]:
    """Does the engine empty every idle slot whenever a request starts on another one? →
    (it does, how that is known). llama-server does with a unified KV cache, --cache-idle-slots
    and a RAM prompt cache: the defaults of -np auto. The probe save's file tells the first (one
    KV stream for several slots); no endpoint tells the other two, so they are read from the
    engine's command line and environment (command: argv, env) when its process runs here, and
    the engine's defaults assumed otherwise. A slot seen emptied without a task of its own says
    so later too (observe.emptied_by_engine). The engine is not asked with requests of our own:
    their tasks would stay in a fresh engine's GET /slots ("params", llama.cpp's server test
    test_server_slots), and they would run on slots someone may be about to use."""
    if total_slots <= 1 or layout is None or layout.n_stream != 1:
        return False, "not a unified KV cache" if layout is not None else "its state files' KV layout is not known"
    if command is None:
        return True, "a unified KV cache, and --cache-idle-slots with a RAM cache assumed (llama-server's defaults)"
    args, env = command
    idle = _flag(env.get("LLAMA_ARG_CACHE_IDLE_SLOTS"), True)
    ram = _number(env.get("LLAMA_ARG_CACHE_RAM"), 1)
    for i, a in enumerate(args):
        if a.startswith("--"):
            a = a.replace("_", "-")  # llama.cpp reads --cache_ram as --cache-ram
        name, eq, value = a.partition("=")
        nxt = value if eq else (args[i + 1] if i + 1 < len(args) else None)
        if a == "--cache-idle-slots":
            idle = True
        elif a == "--no-cache-idle-slots":
            idle = False
        elif name in ("-cram", "--cache-ram"):
            ram = _number(nxt, ram)
    if not idle:
        return False, "--no-cache-idle-slots on its command line"
    if ram == 0:
        return False, "--cache-ram 0 on its command line"
    return True, "a unified KV cache with --cache-idle-slots and a RAM cache (its command line)"


def _flag(value: str | None, default: bool) -> bool:
    """A boolean the way llama.cpp's argument parser reads one from the environment."""
    if value in ("on", "enabled", "true", "1"):
        return True
    if value in ("off", "disabled", "false", "0"):
        return False
    return default


def _number(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


_probes = itertools.count()


async def probe_save(engine: Engine, store: Store, slot: int) -> KVLayout | None:
    """Ask the engine to save into a probe name and look for it in our directory: the only
    way to learn that the engine's --slot-save-path is the directory we manage. The file also
    tells how many KV streams the engine's state files carry (what makes them loadable)."""
    # One name per probe: behind a router two models' probes may run at once (facts.py).
    name = f"{TEMP_PREFIX}probe-{os.getpid()}-{next(_probes)}.partial"
    path = store.staging / name
    try:
        res = await engine.save(slot, name)
        if not path.exists():
            raise SavesElsewhere(f"the engine saves its sessions somewhere other than slot_save_path={store.staging}: "
                               f"start the engine with --slot-save-path {store.staging} (the probe file {name} it "
                               f"wrote is in the engine's directory; it can be removed)")
        size = path.stat().st_size
        if size != res.n_bytes:
            raise StartupError(f"probe save: the engine reported {res.n_bytes:,} bytes, {name} has {size:,}")
        log.info("engine check: probe save of %s tokens (%s) landed in %s", f"{res.n_tokens:,}",
                 fmt_bytes(res.n_bytes), store.staging)
        if engine.magic != slotfile.MAGIC_BYTES:
            return None
        try:
            return slotfile.read_layout(path)
        except (slotfile.BadSlotFile, OSError) as e:
            log.warning("engine check: cannot read the KV layout of the probe file: %s", e)
            return None
    finally:
        path.unlink(missing_ok=True)


def router_refusals(cfg: Config) -> None:
    """What autosessd does not do behind a router yet: each refused with the reason."""
    for key, on in (("tail.request_log", cfg.tail.request_log), ("engine.log", cfg.engine.log),
                    ("[shared]", cfg.shared is not None)):
        if on:
            raise StartupError(f"{key} is set, but the engine at {cfg.engine.url} is a router (--models-dir): "
                               f"behind a router autosessd learns about requests through the gate and the turn "
                               f"hook only, and keeps its files locally; unset {key}")


def tmpfs_staging_of(cfg: Config) -> bool:
    """slot_save_path is the tmpfs staging autosessd makes itself (config.tmpfs_staging)."""
    return cfg.store_path is not None and Path(cfg.slot_save_path).parent.name == f"autosessd-{os.getuid()}"


def check_store(cfg: Config) -> Store:
    """The store and its staging, each a directory of autosessd's own (store/places.py), or a
    StartupError that names it and what is wrong. A tmpfs staging is claimed for this process,
    and those of stores that no longer exist are removed."""
    import grp

    path = Path(cfg.slot_save_path)
    group = grp.getgrnam(cfg.control.group).gr_gid if cfg.control.group else None
    made_here = tmpfs_staging_of(cfg)
    if not path.is_dir() and not path.is_symlink():
        raise StartupError(f"slot_save_path {path} is not a directory: create it, and start the engine with "
                           f"--slot-save-path {path}")
    try:
        if made_here:
            places.check_dir(path.parent, "the tmpfs staging directory", made_here=True, group=group)
        places.check_dir(path, "slot_save_path", made_here=made_here, group=group)
    except places.NotOurs as e:
        raise StartupError(str(e)) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise StartupError(f"slot_save_path {path} is not writable by uid {os.getuid()}")
    home = cfg.effective_store()
    if home != path:
        try:
            home.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise StartupError(f"store_path {home}: cannot create it: {e.strerror or e}") from None
        if not os.access(home, os.W_OK | os.X_OK):
            raise StartupError(f"store_path {home} is not writable by uid {os.getuid()}")
    try:
        if home != path:
            places.check_dir(home, "store_path", group=group)
        for sub in (home / "blocks", home / QUARANTINE, home / "quarantine"):  # made by autosessd, 0700
            done = places.tighten(sub, f"{sub.name}/ in the store", group=group)
            if done:
                log.info("auto sessions: %s", done)
    except places.NotOurs as e:
        raise StartupError(str(e)) from None
    # Session files share the socket's audience: the owner, or with control.group its members too.
    store = Store(home, group, staging=path, blocks=cfg.store_blocks, hot_budget=cfg.hot_budget())
    if made_here:
        try:
            store.claim = places.claim(path, home.resolve())
        except places.NotOurs as e:
            raise StartupError(str(e)) from None
        for what in places.reclaim(path.parent):
            log.info("auto sessions: removed %s", what)
    return store
