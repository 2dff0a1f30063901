"""What autosessd tells people: its counters, events, the status, the file list, /metrics.

Every counter is a field of `Counters` that carries its metric name and help text, so the
status (`autosessctl status --json`, GET /autosessd/status) and GET /autosessd/metrics are
generated from the one list and no counter can be left out of either (a test checks it).
`status()`, `ls()` and `metrics()` read the Sessions facade and never change it; status and
ls scan the session directory and run in a worker thread (the gate's endpoint and the control
socket call them with run_in_executor): they read views (immutable), counters and dicts only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import re
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from . import __version__, phases, policy
from .engines.base import EngineError, EngineRefused
from .index import decode
from .policy import Skip
from .store import auto_name

if TYPE_CHECKING:
    from .sessions import Sessions

log = logging.getLogger("autosessd")


# -- numbers for people ------------------------------------------------------------------
def fmt_tokens(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def fmt_bytes(n: int) -> str:
    if n >= 100e6:
        return f"{n / 1e9:.2f} GB"
    if n >= 100e3:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e3:.1f} kB"


_MARKERS = re.compile(r"<\|?[A-Za-z_][A-Za-z0-9_]*\|?>|\[/?INST\]|<<SYS>>|<</SYS>>")


def first_words(text: str, max_chars: int = 72) -> str:
    """A file's first tokens as a person reads them: the template's markers (`<bos>`,
    `<start_of_turn>`, `<|im_start|>`) left out, whitespace folded, cut at a word."""
    text = " ".join(_MARKERS.sub(" ", text).split())
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars].rsplit(" ", 1)[0] if " " in text[:max_chars] else text[:max_chars]
    return cut + " …"


# -- counters ------------------------------------------------------------------------------
def _counter(metric: str, help_: str, zero: int | float = 0, scale: float = 1) -> Any:
    """A field of Counters: its metric's name (Prometheus conventions: base units, `_total`), its
    help, and the factor from the field's unit (ms, kept for people) to the metric's (seconds)."""
    return field(default=zero, metadata={"metric": metric, "help": help_, "scale": scale})


@dataclass
class Counters:
    """Every counter autosessd keeps; each field is a Prometheus counter named by its metadata."""

    turns: int = _counter("turns_total", "Turns run (requests with a conversation key)")
    saves: int = _counter("saves_total", "Conversations saved to auto-*.bin")
    restores: int = _counter("restores_total", "Session files restored into a slot")
    save_failures: int = _counter("save_failures_total", "Saves that failed")
    restore_failures: int = _counter("restore_failures_total", "Restores that failed")
    skipped_min_tokens: int = _counter("skipped_min_tokens_total", "Saves or restores skipped below min tokens")
    skipped_no_file: int = _counter("skipped_no_file_total",
                                    "Restores skipped: no file of the conversation, or none sharing enough tokens")
    skipped_model_mismatch: int = _counter("skipped_model_mismatch_total", "Restores skipped: file of another model")
    skipped_disk_full: int = _counter("skipped_disk_full_total", "Saves skipped: not enough free space")
    skipped_engine_busy: int = _counter("skipped_engine_busy_total",
                                        "Turns skipped: a request that did not come through autosessd ran on the slot")
    saves_discarded: int = _counter("saves_discarded_total",
                                    "Saves dropped: a request reached the slot while it was written (tail)")
    # An engine that empties idle slots emptied one before its end could be saved.
    saves_missed: int = _counter("saves_missed_total",
                                 "Conversations not saved: the engine emptied their idle slot before their end save")
    restores_reused: int = _counter("restores_reused_total", "Restores the engine reused (timings.cache_n)")
    restores_not_reused: int = _counter("restores_not_reused_total", "Restores the engine did not reuse")
    restores_unverified: int = _counter("restores_unverified_total",
                                        "Restores whose reuse could not be seen (no cache_n in the response)")
    engine_resets: int = _counter("engine_resets_total", "Held states dropped because the engine lost them")
    bytes_saved: int = _counter("saved_bytes_total", "Bytes saved")
    bytes_restored: int = _counter("restored_bytes_total", "Bytes restored")
    ms_saved: float = _counter("save_seconds_total", "Engine time spent saving", 0.0, 0.001)
    ms_restored: float = _counter("restore_seconds_total", "Engine time spent restoring", 0.0, 0.001)
    prefill_tokens_avoided: int = _counter("prefill_tokens_avoided_total",
                                           "Prompt tokens the engine did not read again thanks to a restore "
                                           "(its timings.cache_n, less what the slot already held)")
    ms_avoided: float = _counter("prefill_avoided_seconds_total",
                                 "Prefill time those tokens would have taken, at the engine's own measured "
                                 "prompt rate", 0.0, 0.001)
    bad_log_lines: int = _counter("request_log_bad_lines_total", "Request-log lines skipped as malformed")
    pruned_files: int = _counter("pruned_files_total", "Auto files removed by prune")
    pruned_bytes: int = _counter("pruned_bytes_total", "Bytes freed by prune")
    tokenized: int = _counter("tokenized_turns_total", "Turns that asked the engine for the request's tokens")
    known_by_messages: int = _counter("known_by_messages_total",
                                      "Turns whose request's tokens, or the file to restore, a file's recorded "
                                      "messages told: no tokens asked of the engine")
    replies_checked: int = _counter("replies_checked_total",
                                    "Saved replies whose tokens were checked against their file, off the request's "
                                    "path (sliding-window models: may a request going on from it restore it?)")
    replies_marked: int = _counter("replies_marked_total",
                                   "Of those, replies that came back as the file's own tokens: marked")
    idle_saves: int = _counter("idle_saves_total",
                               "Conversations saved while their slot stayed idle after a reply (idle_save_s)")
    idle_saves_deferred: int = _counter("idle_saves_deferred_total",
                                        "Saves while idle put off by idle_save_mb_per_min")
    idle_saves_alone: int = _counter("idle_saves_alone_total",
                                     "Pauses that saved nothing: their slot had not switched conversations within "
                                     "idle_save_switched_s (one conversation going on alone)")
    bytes_saved_idle: int = _counter("idle_saved_bytes_total", "Bytes saved while idle (also in saved_bytes_total)")
    tokenize_failures: int = _counter("tokenize_failures_total",
                                      "Turns that got no tokens from the engine (the key rule decided)")
    restores_before_durable: int = _counter("restores_before_durable_total",
                                            "Restores of a save whose finalize (fsync) still ran, read through a "
                                            "link to its temporary instead of waiting for it")
    warmed_files: int = _counter("warmed_files_total",
                                 "Session files asked into the page cache before a restore (warm.py)")
    warmed_bytes: int = _counter("warmed_bytes_total", "Bytes of those files")
    warm_skipped_memory: int = _counter("warm_skipped_memory_total",
                                        "Files not warmed: larger than half the memory available")
    restores_by_tokens: int = _counter("restores_by_tokens_total",
                                       "Restores chosen by the tokens a file shares with the request")
    saves_covered: int = _counter("saves_covered_total",
                                  "Saves not kept: a file already held the conversation and more")
    saves_branched: int = _counter("saves_branched_total",
                                   "Conversations saved under a branch name (their opener's file is another's)")
    prefixes_saved: int = _counter("prefixes_saved_total",
                                   "Shared prefixes (system prompt, tools) read on their own and saved")
    fetched: int = _counter("fetched_total", "Saves downloaded from the shared bucket for a turn's restore")
    fetch_failures: int = _counter("fetch_failures_total",
                                   "Downloads for a turn that failed or ran out of time (the request re-read)")
    primed: int = _counter("primed_total",
                           "Requests to a slot the engine emptied, primed so that its RAM cache serves them")
    model_unloads: int = _counter("model_unloads_total",
                                  "Models autosessd unloaded behind a router to make way for another")
    saves_at_model_switch: int = _counter("saves_at_model_switch_total",
                                          "Conversations saved because their model was about to be unloaded")
    restores_after_model_switch: int = _counter("restores_after_model_switch_total",
                                                "Restores into a slot whose model had been unloaded")
    saves_before_sleep: int = _counter("saves_before_sleep_total",
                                       "Conversations saved because the engine was about to sleep (--sleep-idle-seconds)")
    engine_sleeps: int = _counter("engine_sleeps_total", "Times the engine was seen asleep, its slots emptied")
    restores_after_sleep: int = _counter("restores_after_sleep_total",
                                         "Restores into a slot the engine's sleep had emptied")
    engine_changes: int = _counter("engine_changes_total",
                                   "Engine restarts that came back with another model, chat template, context "
                                   "size or KV layout (files of the old one are not restored into it)")
    restores_refused: int = _counter("restores_refused_total",
                                     "Restores refused before the engine saw the file: not whole, or it cannot fit")
    quarantined: int = _counter("quarantined_files_total",
                                "Session files moved aside because they failed a check (never restored)")
    # The logs autosessd follows (tail.py, enginetail.py).
    log_rotations: int = _counter("log_rotations_total",
                                  "Followed logs (request log, engine log) found rotated: another file at their path")
    log_truncations: int = _counter("log_truncations_total",
                                    "Followed logs found truncated, or written again from their start")
    log_missing: int = _counter("log_missing_total",
                                "Times a followed log was found missing or unreadable (not written yet, removed, no permission)")
    restores_not_trusted: int = _counter("restores_not_trusted_total",
                                         "Restores after an engine restart not trusted: a request reached the slot "
                                         "while it was read (tail, engine log)")
    engine_log_bad_lines: int = _counter("engine_log_bad_lines_total",
                                         "Engine-log lines of a format autosessd does not know, skipped")
    engine_log_starts: int = _counter("engine_log_starts_total", "Engine starts seen in the engine's own log")
    engine_log_unseen: int = _counter("engine_log_unseen_requests_total",
                                      "Requests the engine ran that its log did not show (a build that logs "
                                      "otherwise, or a log level that hides them)")
    swa_retries: int = _counter("swa_retries_total",
                                "Requests on a sliding-window model whose prompt ends inside a file (a retry, a "
                                "regenerate): the file keeps only the window's last cells, so the turn passes over "
                                "it; a restore made without the request's tokens (the tails, the key rule) is read "
                                "again, or reused by llama-server with the window's oldest cells missing")

    def bump(self, name: str, by: int | float = 1) -> None:
        setattr(self, name, getattr(self, name) + by)


def counter_rows(c: Counters) -> list[tuple[str, str, str, int | float]]:
    """(metric, kind, help, value in the metric's unit) of every counter, in the order of the fields."""
    return [(f.metadata["metric"], "counter", f.metadata["help"], _scaled(getattr(c, f.name), f.metadata["scale"]))
            for f in dataclasses.fields(c)]


def _scaled(v: int | float, scale: float) -> int | float:
    return v if scale == 1 else v * scale


class Histogram:
    """A Prometheus histogram of durations in seconds (cumulative buckets, sum, count)."""

    BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

    def __init__(self, metric: str, help_: str):
        self.metric, self.help = metric, help_
        self.counts = [0] * (len(self.BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        for i, le in enumerate(self.BUCKETS):
            if seconds <= le:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += seconds

    def lines(self, prefix: str) -> list[str]:
        name = prefix + self.metric
        out = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        running = 0
        for le, n in zip([*map(repr, self.BUCKETS), "+Inf"], self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {running}"]


@dataclass
class Histograms:
    """The engine's save and restore durations (its own timings), for latency quantiles."""

    save: Histogram = field(default_factory=lambda: Histogram("save_duration_seconds",
                                                              "Engine time of each save (timings.save_ms)"))
    restore: Histogram = field(default_factory=lambda: Histogram("restore_duration_seconds",
                                                                 "Engine time of each restore (timings.restore_ms)"))


# What the skip of a step counts as.
_SKIP_COUNTERS = {policy.BELOW_MIN: "skipped_min_tokens", policy.NO_FILE: "skipped_no_file",
                  policy.MODEL_MISMATCH: "skipped_model_mismatch"}


def skipped(counters: Counters, step: Skip, result: TurnResult | None) -> None:
    """A save or restore the turn's rules skipped: counted, said, and told to the caller."""
    msg = f"skipped {step.what} of {auto_name(step.key)}: {step.reason}"
    if result is not None:
        result.skipped.append(msg)
    if step.reason in _SKIP_COUNTERS:
        counters.bump(_SKIP_COUNTERS[step.reason])
    # The routine ones (a conversation's first sight, a file already up to date, the save of a
    # short chat left) are in the turn's event: an INFO line on every switch would drown the
    # rest. A restore skipped below min tokens still says why at INFO.
    routine = step.reason in (policy.NO_FILE, policy.UP_TO_DATE) or (step.reason == policy.BELOW_MIN and
                                                                     step.what == "save")
    (log.debug if routine else log.info)("auto sessions: %s", msg)


# -- what one turn did ---------------------------------------------------------------------
@dataclass
class TurnResult:
    key: str | None
    slot: int | None = None  # the slot the request runs on (pin it there when several)
    saved: dict[str, Any] | None = None
    restored: dict[str, Any] | None = None
    prefix: dict[str, Any] | None = None  # a shared prefix read and saved before the request
    # Where the turn had the request's tokens from: "engine" (it asked: /apply-template +
    # /tokenize), "messages" (a file's marks told them, or the file to restore: recall.py), or
    # None (none needed: the request goes on from the held one, or is matched by its key).
    tokens_from: str | None = None
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ms: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # ms by PHASES name, those that ran

    def to_dict(self) -> dict[str, Any]:
        # As dataclasses.asdict has it (its values are flat dicts, lists of str and scalars),
        # at a tenth of its cost: it runs on every turn.
        d = dict(self.__dict__)
        for k in ("saved", "restored", "prefix"):
            if d[k] is not None:
                d[k] = dict(d[k])
        d["skipped"], d["errors"] = list(self.skipped), list(self.errors)
        d["phases"] = {k: round(v, 2) for k, v in self.phases.items()}
        return d

    def phases_line(self) -> str:
        """'save 59, restore 125, other 3' (ms, in PHASES order): the turn's log line."""
        parts = [f"{name} {self.phases[name]:,.0f}" for name in phases.PHASES if name in self.phases]
        other = self.ms - sum(self.phases.values())
        return ", ".join([*parts, f"other {max(other, 0):,.0f}"])


@dataclass
class RestoreLog:
    """What status shows of restores: per slot the last one (and the engine's cache_n for it,
    once its request ended), and the last one the engine did not reuse."""

    last: dict[int, dict[str, Any]] = field(default_factory=dict)
    not_reused: dict[str, Any] | None = None
    # The last request a file held that the sliding-window rule kept out (Turn._swa_retry).
    swa_retry: dict[str, Any] | None = None
    # The OpenAI chat body of each slot's restore awaiting verification, and the last few
    # restores the engine did not reuse with it (autosessctl doctor: where the prompt departed).
    # In memory only; never in status.
    bodies: dict[int, dict[str, Any]] = field(default_factory=dict)
    departed: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4))


# -- events --------------------------------------------------------------------------------
LATER_S = 0.001  # what a turn says runs this long after it, once its request is on its way


class Events:
    """Recent events for `events`, and live followers. A follower that falls behind by
    more than its queue is dropped rather than slowing the daemon down.

    A turn's `restored` and `turn` events (30-50 us each on a return, cold after the engine's
    work) are published LATER_S after it (emit_soon, on the loop), when its request is on its
    way and the engine works on it, instead of before the request is forwarded. Each has the
    number and time of when it happened; reading the events, emitting one at once, or the
    stop (Sessions.close) publishes all that waits first: no reader sees them out of order or
    misses one. The turn's log lines wait as long, in order with every other line
    (logs.soon)."""

    def __init__(self, keep: int = 1000):
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self._followers: set[asyncio.Queue] = set()
        self._seq = 0
        self._waiting: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._timer: asyncio.TimerHandle | None = None

    @property
    def recent(self) -> collections.deque[dict[str, Any]]:
        self.flush()
        return self._recent

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        self.flush()
        ev = self._event(type_, fields)
        self._publish(ev)
        return ev

    def emit_soon(self, type_: str, **fields: Any) -> None:
        """emit, said soon (the class docstring)."""
        self.soon(self._publish, self._event(type_, fields))

    def soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """fn(*args) LATER_S from now, in order with what else waits. On the event loop only
        (the turn's callers): with no loop running (a test calling it directly), now."""
        self._waiting.append((fn, args))
        if self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(LATER_S, self.flush)
            except RuntimeError:
                self.flush()

    def flush(self) -> None:
        """Say all that waits, in order."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._waiting:
            waiting, self._waiting = self._waiting, []
            for fn, args in waiting:
                try:
                    fn(*args)
                except Exception as e:  # a handler's failure must not lose the rest
                    log.exception("auto sessions: saying %s: %s", getattr(fn, "__name__", fn), e)

    def _event(self, type_: str, fields: dict[str, Any]) -> dict[str, Any]:
        self._seq += 1
        return {"seq": self._seq, "ts": round(time.time(), 3), "type": type_, **fields}

    def _publish(self, ev: dict[str, Any]) -> None:
        self._recent.append(ev)
        for q in list(self._followers):
            try:
                q.put_nowait(ev)
            except asyncio.QueueFull:
                self._followers.discard(q)
                with contextlib.suppress(asyncio.QueueFull):
                    q.get_nowait()
                    q.put_nowait(None)  # None tells the follower it was dropped

    @contextlib.contextmanager
    def follow(self, maxsize: int = 1000):
        q: asyncio.Queue = asyncio.Queue(maxsize)
        self.flush()  # what waits is in `recent`, which a follower is sent first
        self._followers.add(q)
        try:
            yield q
        finally:
            self._followers.discard(q)


# -- status, ls, metrics -------------------------------------------------------------------
def slot_entries(s: Sessions) -> list[dict[str, Any]]:
    """Each slot of one engine (of one model, behind a router) as status shows it."""
    return [{**sl.status(), "file": sl.view.file, "last_restore": s.restore_log.last.get(sl.id)}
            for sl in sorted(s.slots.values(), key=lambda x: x.id)]


def status(s: Sessions) -> dict[str, Any]:
    """GET /autosessd/status and `autosessctl status`. Blocking: scans the directory."""
    entries = s.store.scan(with_meta=False)
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
                   "saving_off": s.ctx.facts.off,
                   "sleep": s.sleep.describe() if getattr(s, "sleep", None) else None},
        "slots": slot_entries(s),
        "counters": asdict(s.counters),
        "last_not_reused": s.restore_log.not_reused,
        "last_swa_retry": s.restore_log.swa_retry,
        "turn_phases": s.ctx.turn_times.status(),
        "store": {"path": str(s.store.path), "auto_files": len(entries), "auto_bytes": sum(e.bytes for e in entries),
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


def auto_min_is_number(cfg: Any) -> bool:
    return isinstance(cfg.auto_sessions_min_tokens, int)


SPARED_HOW = ("tokens: the engine's own timings.cache_n after each restore it reused, less what the slot "
              "already shared with the request; seconds: those tokens priced at the engine's own measured "
              "prompt rate at that length (fitted from timings.prompt_ms of the prompts it read: "
              "ms = a·n + b·n² from an empty slot)")


def spared(s: Sessions) -> dict[str, Any]:
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

    def ls(self, s: Sessions) -> list[dict[str, Any]]:
        """Every session file: ours (auto: a conversation's, or a shared prefix) and people's
        (manual), newest first. `line`: the first-message key of the conversation an auto
        file holds; `words`: its first words, when ls_words() has read them. Blocking: rescans
        the index (people's files come and go without us)."""
        index = s.index
        if index is not None:
            index.scan()
        held = {sl.view.file for sl in s.slots.values() if sl.view.conversation() and sl.view.file}
        rows = [{"name": e.name, "kind": "prefix" if e.meta and e.meta.prefix else "auto", "key": e.key,
                 "line": e.meta.line if e.meta else None, "bytes": e.bytes, "saved_at": e.saved_at,
                 "n_tokens": e.meta.n_tokens if e.meta else None,
                 "model_ok": bool(e.meta and e.meta.model == s.model), "held": e.name in held}
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

    async def ls_words(self, s: Sessions, n_tokens: int = 40, max_chars: int = 72) -> list[dict[str, Any]]:
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
        ("shared_upload_failures_total", "counter", "Upload attempts that failed (each is retried)",
         sh["upload_failures"]),
        ("shared_uploaded_bytes_total", "counter", "Bytes sent to the shared bucket", sh["bytes_up"]),
        ("shared_downloads_total", "counter", "Saves downloaded from the shared bucket (hits)", sh["downloads"]),
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


# A metric row: (name without the prefix, kind, help, value, or [(labels, value), ...] for a labelled one).
Row = tuple[str, str, str, Any]
PREFIX = "autosessd_"


def _gauges(s: Sessions) -> list[Row]:
    """What is, not what happened: the directory against its budget, each slot, the threshold.
    Labels are bounded: a slot id (the engine's few slots), a state (slot.py's five), the version
    and the model's file name (one at a time)."""
    from .slot import Phase

    cfg = s.cfg
    entries = s.store.scan(with_meta=False)
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
        ("session_files", "gauge", "Auto session files in the session directory", len(entries)),
        ("session_bytes", "gauge", "Bytes of auto session files", sum(e.bytes for e in entries)),
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


def metrics(s: Sessions, extra: list[Row] = ()) -> str:
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
