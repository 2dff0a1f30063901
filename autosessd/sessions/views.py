"""What autosessd tells people, read from the Sessions facade: the status, the file list,
/metrics. They never change what they read; status and ls scan the session directory and run
in a worker thread (the gate's endpoint and the control socket call them with
run_in_executor): they read views (immutable), counters and dicts only. Above the facade:
what they read is a `Reported`: the Sessions facade, or behind a router the Router (its
house, and its models' Sessions). Below the facade, which answers status() and ls() here."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

from .. import __version__
from ..engines.base import EngineError, EngineRefused
from ..store.runs import decode
from .report import counter_rows, first_words

if TYPE_CHECKING:
    from ..base.config import Config
    from ..engines.base import Engine
    from ..store.directory import Store
    from ..store.index import TokenIndex
    from .context import Context
    from .report import Counters, RestoreLog
    from .slot import Slot

log = logging.getLogger("autosessd")


class Describes(Protocol):
    """A part that says its own state for status (the sleep watch, the idle saver, the bucket)."""

    def describe(self) -> dict[str, Any]: ...


class Reported(Protocol):
    """What status, ls and metrics read: the Sessions facade (sessions/facade.py), or behind a router
    the Router, whose house stands for it (models.py); none of it is changed here."""

    cfg: Config
    ctx: Context
    engine: Engine
    store: Store
    counters: Counters
    restore_log: RestoreLog
    slots: dict[int, Slot]
    index: TokenIndex | None
    inputs: dict[str, Any]
    model: str
    model_name: str
    started_at: float
    remote: Any  # remote.Remote: its status(); None without a bucket

    @property
    def engine_healthy(self) -> bool | None: ...

# -- status, ls, metrics -------------------------------------------------------------------
def slot_entries(s: Reported) -> list[dict[str, Any]]:
    """Each slot of one engine (of one model, behind a router) as status shows it."""
    return [{**sl.status(), "file": sl.view.file, "last_restore": s.restore_log.last.get(sl.id)}
            for sl in sorted(s.slots.values(), key=lambda x: x.id)]


def status(s: Reported) -> dict[str, Any]:
    """GET /autosessd/status and `autosessctl status`. Blocking: scans the directory."""
    entries = s.store.scan(with_meta=False)
    usage = s.store.usage()
    try:
        free = s.store.free_bytes()
    except OSError:
        free = None
    quarantined = s.store.quarantined()
    cfg = s.cfg
    return {
        "version": __version__,
        "spared": spared(s),
        "uptime_s": round(time.time() - s.started_at, 1),
        "auto_sessions": cfg.auto_sessions,
        "engine": {"kind": s.engine.kind, "url": s.engine.address, "healthy": s.engine_healthy,
                   "model": s.model_name, "model_fingerprint": s.model, "slots": len(s.slots) or 1,
                   "slots_visible": s.ctx.slots_visible, "n_ctx": s.ctx.n_ctx, "suspect": s.ctx.suspect,
                   "saving_off": s.ctx.facts.off, "memory": memory(s.ctx),
                   "sleep": s.sleep.describe() if getattr(s, "sleep", None) else None},
        "slots": slot_entries(s),
        "counters": asdict(s.counters),
        "last_not_reused": s.restore_log.not_reused,
        "last_swa_retry": s.restore_log.swa_retry,
        "turn_phases": s.ctx.turn_times.status(),
        "store": {"path": str(s.store.path), "staging": str(s.store.staging), "auto_files": len(entries),
                  "auto_bytes": sum(e.bytes for e in entries if not e.blocks) + usage["block_bytes"],
                  "blocks": blocks_status(s, usage), "hot": usage["hot"],
                  "free_bytes": free, "min_tokens": s.ctx.min_tokens, "min_tokens_auto": not auto_min_is_number(cfg),
                  "min_tokens_why": s.ctx.savings.min_tokens()[1] if not auto_min_is_number(cfg) else "set in the config",
                  "keep": cfg.auto_sessions_keep, "max_gb": cfg.auto_sessions_max_gb,
                  "budget_bytes": int(cfg.auto_sessions_max_gb * 1e9),
                  "quarantined": {"files": len(quarantined), "bytes": sum(q.get("bytes") or 0 for q in quarantined),
                                  "latest": quarantined[:5]}},
        "index": None if s.index is None else {"files": len(s.index), "skipped": len(s.index.skipped),
                                               "swa_window": s.ctx.swa_window},
        "idle_save": s.idle.status() if hasattr(s, "idle") else None,  # a router: its models' (models.py)
        "inputs": {name: describe() for name, describe in s.inputs.items()},
        "shared": None if s.remote is None else s.remote.status(),
    }


def memory(ctx: Any) -> dict[str, Any]:
    """The model's memory as autosessd learned it from the model file (facts.model_memory), and
    so how a conversation is saved (rewind.py)."""
    return {"swa_window": ctx.swa_window, "recurrent": ctx.recurrent,
            "saved_at": "one token before the prompt's end" if ctx.rewinds else "the slot as it is"}


def blocks_status(s: Reported, usage: dict[str, Any]) -> dict[str, Any]:
    """The block store as status shows it (issue 39): what the engine wrote against what the store
    wrote, the blocks (each held once) and how much of them several conversations share."""
    return {"on": s.store.cut, "manifests": usage["manifests"], "blocks": usage["blocks"],
            "bytes": usage["block_bytes"], "shared_bytes": usage["shared_block_bytes"],
            "engine_bytes_written": s.counters.bytes_saved, "store_bytes_written": usage["block_bytes_written"],
            "assembled": s.counters.assemblies, "assembled_bytes": s.counters.bytes_assembled}


def auto_min_is_number(cfg: Any) -> bool:
    return isinstance(cfg.auto_sessions_min_tokens, int)


SPARED_HOW = ("tokens: the engine's own timings.cache_n after each restore it reused, less what the slot "
              "already shared with the request; seconds: those tokens priced at the engine's own measured "
              "prompt rate at that length (fitted from timings.prompt_ms of the prompts it read: "
              "ms = a·n + b·n² from an empty slot)")


def spared(s: Reported) -> dict[str, Any]:
    """The headline: what autosessd did for its users since the start and in total."""
    c, sv = s.counters, s.ctx.savings

    def figures(d: dict[str, float]) -> dict[str, Any]:
        return {"prompt_tokens": int(d["prefill_tokens_avoided"]), "seconds": round(d["ms_avoided"] / 1000, 3),
                "restores_reused": int(d["restores_reused"]), "restores_not_reused": int(d["restores_not_reused"]),
                "restores_unverified": int(d["restores_unverified"])}

    now = {k: getattr(c, k) for k in ("prefill_tokens_avoided", "ms_avoided", "restores_reused",
                                      "restores_not_reused", "restores_unverified")}
    return {"since_start": {**figures(now), "since": round(s.started_at, 3)},
            "total": {**figures(sv.totals(c)), "since": round(sv.since, 3)},
            "unpriced_tokens": sv.unpriced_tokens(), "how": SPARED_HOW, "rates": sv.describe()}


class Listing:
    """`autosessctl ls`: every session file, with its first words once the engine read them."""

    def __init__(self) -> None:
        self._words: dict[str, tuple[Any, str]] = {}  # a file's first words, by (inode, mtime, size)

    def ls(self, s: Reported) -> list[dict[str, Any]]:
        """Every session file: ours (auto: a conversation's, or a shared prefix) and people's
        (manual), newest first. `line`: the first-message key of the conversation an auto
        file holds; `words`: its first words, when ls_words() has read them. Blocking: rescans
        the index (people's files come and go without us)."""
        index = s.index
        if index is not None:
            index.scan()
        held = {sl.view.file for sl in s.slots.values() if sl.view.conversation() and sl.view.file}
        refs = s.store.block_refs()
        sizes = s.store.blocks.scan() if s.store.blocks is not None else {}
        rows = [{"name": e.name, "kind": "prefix" if e.meta and e.meta.prefix else "auto", "key": e.key,
                 "line": e.meta.line if e.meta else None, "bytes": e.bytes, "saved_at": e.saved_at,
                 "n_tokens": e.meta.n_tokens if e.meta else None,
                 "model_ok": bool(e.meta and e.meta.model == s.model), "held": e.name in held,
                 **stored_as(e, refs, sizes)}
                for e in s.store.scan()]
        rows += [{"name": name, "kind": "manual", "key": None, "line": None, "bytes": size, "saved_at": mtime,
                  "n_tokens": None, "model_ok": None, "held": name in held}
                 for name, size, mtime in s.store.manual_files()]
        rows += [{"name": q["name"], "kind": "quarantined", "key": None, "line": None, "bytes": q.get("bytes") or 0,
                  "saved_at": q.get("at") or 0, "n_tokens": None, "model_ok": None, "held": False,
                  "quarantined_as": q["file"], "why": q.get("why")}
                 for q in s.store.quarantined()]
        for r in rows:
            e = index.get(r["name"]) if index is not None and r["kind"] != "quarantined" else None
            if e is not None and r["n_tokens"] is None:
                r["n_tokens"] = e.n_tokens
            if e is not None and r["model_ok"] is None and e.model is not None:
                r["model_ok"] = e.model == s.model
            hit = self._words.get(r["name"])
            r["words"] = hit[1] if hit is not None and e is not None and hit[0] == e.ident else None
        return sorted(rows, key=lambda r: r["saved_at"], reverse=True)

    async def ls_words(self, s: Reported, n_tokens: int = 40, max_chars: int = 72) -> list[dict[str, Any]]:
        """ls() with each file's first words (its first tokens detokenized by the engine,
        the template's markers left out), so a person can tell conversations apart. Read
        once per file (by its inode, mtime and size) and kept; ls runs off the loop."""
        rows = await asyncio.get_running_loop().run_in_executor(None, self.ls, s)
        chat = s.ctx.chat
        if chat is None or s.index is None:
            return rows
        for r in rows:
            e = s.index.get(r["name"])
            if r["words"] is not None or e is None or not e.tokens:
                continue
            try:
                text = await chat.detokenize(decode(e.tokens[:4 * n_tokens]))
            except EngineRefused as err:
                # This file's tokens (one outside the vocabulary: another model's file, a damaged
                # one): its words only are missing, said on its row.
                log.debug("auto sessions: ls: cannot detokenize %s: %s", r["name"], err)
                r["words_error"] = str(err)
                continue
            except EngineError as err:
                log.debug("auto sessions: ls: cannot detokenize %s: %s", r["name"], err)
                break  # the engine is not answering: the rest would not fare better
            words = first_words(text, max_chars)
            self._words[r["name"]] = (e.ident, words)
            r["words"] = words
        live = {r["name"] for r in rows}
        for name in [n for n in self._words if n not in live]:
            del self._words[name]
        return rows


def _shared_rows(sh: dict[str, Any]) -> list[tuple[str, str, str, int | float]]:
    return [
        ("shared_uploads_pending", "gauge", "Saves waiting to be uploaded to the shared bucket", sh["uploads_pending"]),
        ("shared_uploads_retrying", "gauge", "Of those, uploads that failed and wait to be tried again",
         sh["uploads_retrying"]),
        ("shared_uploads_total", "counter", "Saves uploaded to the shared bucket", sh["uploads_done"]),
        ("shared_upload_failures_total", "counter", "Upload attempts that failed (each is retried, unless dropped)",
         sh["upload_failures"]),
        ("shared_uploads_dropped_total", "counter",
         "Saves not uploaded because the local save could not be read (damaged): never retried",
         sh["uploads_dropped"]),
        ("shared_uploaded_bytes_total", "counter", "Bytes sent to the shared bucket", sh["bytes_up"]),
        ("shared_manifests_uploaded_total", "counter",
         "Saves uploaded as a manifest and the blocks the bucket lacked", sh["manifests_up"]),
        ("shared_blocks_uploaded_total", "counter", "Token blocks sent to the shared bucket", sh["blocks_up"]),
        ("shared_blocks_skipped_total", "counter",
         "Token blocks a manifest named that the bucket held already: not sent", sh["blocks_skipped"]),
        ("shared_block_uploaded_bytes_total", "counter",
         "Bytes saves uploaded as manifests sent (blocks and manifests)", sh["bytes_up_blocks"]),
        ("shared_block_whole_file_bytes_total", "counter",
         "Bytes those saves would have sent as whole files", sh["bytes_whole_files"]),
        ("shared_blocks_fetched_total", "counter", "Token blocks downloaded for a manifest", sh["blocks_fetched"]),
        ("shared_block_fetched_bytes_total", "counter", "Bytes of token blocks downloaded", sh["bytes_fetched"]),
        ("shared_blocks_held_total", "counter",
         "Token blocks a downloaded manifest named that this host held already: not downloaded", sh["blocks_held"]),
        ("shared_block_held_bytes_total", "counter", "Bytes of those blocks", sh["bytes_held"]),
        ("shared_downloads_total", "counter", "Saves downloaded from the shared bucket (hits)", sh["downloads"]),
        ("shared_downloads_moved_total", "counter",
         "Downloads of a save another host made: conversations that moved here", sh["downloads_moved"]),
        ("shared_downloaded_moved_bytes_total", "counter", "Bytes of downloads of saves another host made",
         sh["bytes_down_moved"]),
        ("shared_download_failures_total", "counter", "Downloads that failed (the request re-read)",
         sh["download_failures"]),
        ("shared_downloads_skipped_total", "counter", "Downloads skipped: re-reading was estimated faster",
         sh["downloads_skipped_slower"]),
        ("shared_downloads_skipped_unreachable_total", "counter",
         "Downloads not tried: the bucket's last list or a recent download failed", sh["downloads_skipped_unreachable"]),
        ("shared_downloads_refused_layout_total", "counter",
         "Saves not downloaded: another KV layout than this engine's", sh["downloads_refused_layout"]),
        ("shared_downloads_refused_bad_total", "counter",
         "Objects refused as not the save their host made (size, digest, header); never fetched again",
         sh["downloads_refused_bad"]),
        ("shared_downloaded_bytes_total", "counter", "Bytes received from the shared bucket", sh["bytes_down"]),
        ("shared_download_seconds_total", "counter", "Time spent downloading from the shared bucket",
         sh["download_ms_total"] / 1000),
        ("shared_catalog_saves", "gauge", "Saves of this model in the shared bucket, as last read",
         sh["catalog"]["saves"]),
    ]


def stored_as(e: Any, refs: dict[str, int], sizes: dict[str, int]) -> dict[str, Any]:
    """How `ls` says a conversation is kept: as blocks (its own bytes, and those it shares with
    other conversations, each block counted once; with its tail, for a window model's or a
    hybrid's save: what the tail holds and its bytes, among its own), or whole, with why it
    could not be cut."""
    if e.blocks:
        own = sum(sizes.get(k, 0) for k in set(e.blocks) if refs.get(k, 0) <= 1)
        shared = sum(sizes.get(k, 0) for k in set(e.blocks) if refs.get(k, 0) > 1)
        out = {"stored": "blocks", "blocks": len(e.blocks), "own_bytes": own, "shared_bytes": shared}
        tail = e.meta.tail if e.meta is not None else None
        if tail:  # a window model's or a hybrid's save: one of those "blocks" is its tail
            out.update(blocks=len(e.blocks) - 1, tail=(e.meta.kv or {}).get("tail"), tail_bytes=tail[1])
        return out
    return {"stored": "whole", "whole_why": e.meta.whole if e.meta is not None else None}


# A metric row: (name without the prefix, kind, help, value, or [(labels, value), ...] for a labelled one).
Row = tuple[str, str, str, Any]
PREFIX = "autosessd_"


def _gauges(s: Reported) -> list[Row]:
    """What is, not what happened: the directory against its budget, each slot, the threshold.
    Labels are bounded: a slot id (the engine's few slots), a state (slot.py's five), the version
    and the model's file name (one at a time)."""
    from .slot import Phase

    cfg = s.cfg
    entries = s.store.scan(with_meta=False)
    usage = s.store.usage()
    try:
        free: int | None = s.store.free_bytes()
    except OSError:
        free = None
    slots = sorted(s.slots.values(), key=lambda x: x.id)
    totals = s.ctx.savings.totals(s.counters)
    rows: list[Row] = [
        ("build_info", "gauge", "autosessd's version (always 1)", [({"version": __version__}, 1)]),
        ("engine_info", "gauge", "The engine's model (always 1)", [({"model": s.model_name or "unknown"}, 1)]),
        ("start_time_seconds", "gauge", "When autosessd started, in seconds since the epoch", s.started_at),
        ("engine_healthy", "gauge", "1 when the engine answered its last health check", int(bool(s.engine_healthy))),
        ("engine_slots", "gauge", "Engine slots autosessd drives", len(slots)),
        ("session_files", "gauge", "Auto session files in the session directory (conversations kept whole or as "
                                   "blocks)", len(entries)),
        ("session_bytes", "gauge", "Bytes of auto session files (whole files, and blocks each counted once)",
         sum(e.bytes for e in entries if not e.blocks) + usage["block_bytes"]),
        ("store_blocks", "gauge", "Token blocks in the store (each held once, whatever shares it)", usage["blocks"]),
        ("store_shared_block_bytes", "gauge", "Bytes of blocks more than one conversation holds",
         usage["shared_block_bytes"]),
        ("store_block_bytes_written_total", "counter", "Bytes of blocks written to the store (a save writes the "
                                                       "blocks not stored yet)", usage["block_bytes_written"]),
        ("staging_hot_bytes", "gauge", "Bytes of copies kept in staging for a quick return", usage["hot"]["bytes"]),
        ("staging_hot_budget_bytes", "gauge", "staging_max_gb: what those copies are kept under",
         usage["hot"]["budget"]),
        ("store_block_read_errors_total", "counter", "Assemblies that failed twice on an error of the process or the "
                                                     "system reading a block (the store kept as it was)",
         usage["hot"]["read_errors"]),
        ("session_budget_bytes", "gauge", "auto_sessions_max_gb: what prune keeps the auto files under",
         int(cfg.auto_sessions_max_gb * 1e9)),
        ("session_keep_files", "gauge", "auto_sessions_keep: the newest auto files prune keeps", cfg.auto_sessions_keep),
        ("min_tokens", "gauge", "auto_sessions_min_tokens in force (chosen by the measured rates when auto)",
         s.ctx.min_tokens),
        ("lifetime_prefill_tokens_avoided", "gauge", "Prompt tokens not read again, over every run (state_dir)",
         int(totals["prefill_tokens_avoided"])),
        ("lifetime_prefill_avoided_seconds", "gauge", "Prefill time spared, over every run (state_dir)",
         totals["ms_avoided"] / 1000),
        ("slot_tokens", "gauge", "Tokens the slot holds, as far as autosessd knows",
         [({"slot": str(sl.id)}, sl.view.n_tokens or 0) for sl in slots]),
        ("slot_state", "gauge", "1 for the state each slot is in (slot.py: empty, switched, held, restored, unknown)",
         [({"slot": str(sl.id), "state": p.value}, int(sl.view.phase is p)) for sl in slots for p in Phase]),
        ("turn_phase_seconds_total", "counter", "Time requests waited in each phase of their turns (report.PHASES)",
         [({"phase": name}, ms / 1000) for name, ms in s.ctx.turn_times.total_ms.items()]),
    ]
    if free is not None:
        rows.append(("disk_free_bytes", "gauge", "Free bytes on the session directory's file system", free))
    return rows


def _value(v: int | float) -> str:
    if isinstance(v, bool):
        return str(int(v))
    return str(v) if isinstance(v, int) else repr(float(v))


def metrics(s: Reported, extra: list[Row] = ()) -> str:
    """GET /autosessd/metrics (Prometheus text format 0.0.4): every counter, the gauges, the
    save/restore histograms, the caller's own rows (the gate's), and the shared bucket's when it
    is configured (so a scraper sees no zeros for a tier that is not there). Names follow
    Prometheus' conventions (`autosessd_` prefix, base units, `_total` on counters; checked by
    `promtool check metrics` in tests). Blocking: scans the directory (run it in a thread)."""
    rows: list[Row] = [*counter_rows(s.counters), *extra, *_gauges(s)]
    if s.remote is not None:
        rows += _shared_rows(s.remote.status())
    if hasattr(s, "metric_rows"):  # a router's models (models.py)
        rows += s.metric_rows()
    out = []
    for name, kind, help_, value in rows:
        metric = PREFIX + name
        out += [f"# HELP {metric} {help_}", f"# TYPE {metric} {kind}"]
        if isinstance(value, list):
            for labels, v in value:
                text = ",".join(f'{k}="{_escape(str(x))}"' for k, x in labels.items())
                out.append(f"{metric}{{{text}}} {_value(v)}")
        else:
            out.append(f"{metric} {_value(value)}")
    for h in (s.ctx.histograms.save, s.ctx.histograms.restore):
        out += h.lines(PREFIX)
    return "\n".join(out) + "\n"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
