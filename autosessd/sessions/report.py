"""What autosessd records for people as it works: its counters, histograms, events, the
restores' log, a turn's result, and numbers written for people. Every room writes here;
nothing here reads a room (views.py turns it, with the rooms' state, into status and metrics).

Every counter is a field of `Counters` that carries its metric name and help text, so the
status (`autosessctl status --json`, GET /autosessd/status) and GET /autosessd/metrics are
generated from the one list and no counter can be left out of either (a test checks it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..store.directory import auto_name
from . import phases, policy
from .policy import Skip

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
                                            "Restores of a save whose finalize (fsync) still ran, read from its "
                                            "temporary instead of waiting for it")
    finalize_retries: int = _counter("finalize_retries_total",
                                     "Finalizes tried again after a failed try (each failed try is also a save "
                                     "failure); its bytes were kept")
    forgets: int = _counter("forgets_total", "Conversations forgotten (autosessctl forget)")
    assemblies: int = _counter("assemblies_total",
                               "Restores of a conversation kept as token blocks with no copy in staging: the file "
                               "(or the first tokens a request shares) assembled from its blocks")
    bytes_assembled: int = _counter("assembled_bytes_total", "Block bytes read to assemble those files")
    tails_saved: int = _counter("tails_saved_total",
                                "Saves of a sliding-window or hybrid model kept as the token blocks of its "
                                "full-attention layers and a tail (the window's cells, or the recurrent state)")
    tail_bytes_saved: int = _counter("tail_bytes_saved_total", "Bytes of those tails")
    tail_restores: int = _counter("tail_restores_total",
                                  "Restores of such a save (its blocks and its tail, whole: a tail holds the state at "
                                  "its last position only)")
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
    rewinds: int = _counter("rewinds_total",
                            "Slots taken back to one token before their last prompt's end before a save (a model "
                            "with recurrent layers or a window: the state its next request, or a retry, reuses)")
    ms_rewound: float = _counter("rewind_seconds_total",
                                 "Time those rewinds took (the engine's read of the last tokens, and the look after it)",
                                 0.0, 0.001)
    rewinds_reread: int = _counter("rewinds_reread_total",
                                   "Of those, rewinds for which the engine read the prompt again (it had no context "
                                   "checkpoint near the prompt's end)")
    rewinds_not_done: int = _counter("rewinds_not_done_total",
                                     "Saves on such a model of a state not taken back (its prompt's tokens not known, "
                                     "or the rewind failed): a restore of it is reused only by a request that goes "
                                     "on from its very end")
    fetched: int = _counter("fetched_total", "Saves downloaded from the shared bucket for a turn's restore")
    saves_covered_remote: int = _counter("saves_covered_remote_total",
                                         "Saves not made: another host's newer save in the shared bucket held all "
                                         "the slot held and more (the conversation went on there)")
    arrivals: int = _counter("arrivals_total",
                             "Conversations that moved here: at a switch to them, the bucket's newest save of them "
                             "was another host's, newer than this host's own (downloaded or re-read)")
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
    rewound: dict[str, Any] | None = None  # the slot taken back before its save (rewind.py)
    # Where the turn had the request's tokens from: "engine" (it asked: /apply-template +
    # /tokenize), "messages" (a file's marks told them, or the file to restore: recall.py), or
    # None (none needed: the request goes on from the held one, or is matched by its key).
    tokens_from: str | None = None
    # Several hosts on one bucket: the host whose save of this conversation was the bucket's newest
    # and newer than anything here when the turn began (it moved here: fetcher.Fetcher.arrival),
    # and the host whose save this turn downloaded for its restore.
    moved_from: str | None = None
    downloaded_from: str | None = None
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ms: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # ms by PHASES name, those that ran

    def to_dict(self) -> dict[str, Any]:
        # As dataclasses.asdict has it (its values are flat dicts, lists of str and scalars),
        # at a tenth of its cost: it runs on every turn.
        d = dict(self.__dict__)
        for k in ("saved", "restored", "prefix", "rewound"):
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
