"""The shared bucket as the daemon runs it: what a turn asks of it, and what runs beside.

autosessd/shared/ is the tier itself (layout, uploads, downloads, the bucket prune); this
module keeps the part of it a turn reads fast, and the periodic work, off the request's path.

Why a catalog. A turn cannot afford to ask the bucket: one LIST costs 44 ms on loopback RGW
for one conversation's folder and 73 ms for 1,000 saves (bench: measured with boto3, RGW 16.2)
— ten restores' worth — and a remote save's tokens cost one ranged GET more. So:

    catalog    the current save of every conversation of this engine's model, each with its
               token list (read once: an object never changes), read again every list_every_s
               in a thread; a save another host uploaded is found here within that long
    best()     the catalog's save sharing the longest prefix with a request's tokens: one
               bisect in a sorted run (runs.TokenRun), on the loop, no I/O
    newest()   the catalog's save of one name: the key rule for requests without tokens
    prefill    a moving average of the engine's prompt rate (timings.prompt_per_second of
               responses that read PREFILL_MIN tokens or more): the estimate weighs a download
               against re-reading with it
    prune      the bucket prune, every prune_every_s (shared.prune_bucket: under the lease,
               one host at a time)

Everything blocking (LIST, GET, the prune) runs on this module's own threads, so bucket I/O
never delays a finalize on the default executor. A failure is logged when it starts and when
it ends, not at every try; the local tier works the same meanwhile.

The turn's side of it (Fetcher: a download before a restore) is fetcher.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..base.config import SharedConfig
from ..shared import BadObject, RemoteSession, SharedError, SharedStore
from ..shared.blockobjects import block_sizes
from ..store.directory import AUTO_BIN, Meta, auto_name
from ..store.runs import TokenRun, decode, swa_usable
from ..store.slotfile import comparable, encode

log = logging.getLogger("autosessd")

PREFILL_MIN = 256  # a prompt rate read from fewer tokens says more about overhead than about prefill
PREFILL_WEIGHT = 0.3  # of a new sample in the moving average
HEADERS_AT_ONCE = 4  # ranged GETs of new saves' token lists in parallel
# The shared tier's threads (here, shared/uploads.py's worker, s3transfer's under it when it
# runs in one): what a stop looks for before the process exits.
THREAD_PREFIXES = ("autosessd-bucket", "autosessd-download", "autosessd-headers", "autosessd-shared",
                   "ThreadPoolExecutor")


def bucket_threads_alive() -> list[str]:
    """Names of this process's shared-tier threads still running (a stop's last look)."""
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIXES) and t.is_alive()]


@dataclass(frozen=True)
class Catalog:
    """One reading of the bucket: swapped whole, so a turn on the loop reads one consistent
    catalog while a thread builds the next."""

    saves: dict[str, RemoteSession] = field(default_factory=dict)  # by local file name
    tokens: dict[str, bytes] = field(default_factory=dict)  # by object key: encoded, comparable part
    run: TokenRun = field(default_factory=TokenRun)  # (tokens, name) of the saves whose tokens are read
    listed_at: float = 0.0  # time.time() when the LIST was sent; 0: never listed
    # By object key, a manifest save's blocks: (key, bytes of its object) each, and the whole file's bytes.
    manifests: dict[str, tuple[tuple[tuple[str, int], ...], int]] = field(default_factory=dict)


def _said_if_failed(task: asyncio.Task) -> None:
    """A reading of the bucket's catalog outside its loop: a bug in it is logged, as there."""
    if not task.cancelled() and task.exception() is not None:
        log.error("auto sessions: shared: reading the bucket: %s", task.exception(), exc_info=task.exception())


class Remote:
    def __init__(self, shared: SharedStore, cfg: SharedConfig, model: str, max_tokens: int | None = None):
        """max_tokens: the engine's context; saves claiming more are left out of the catalog."""
        self.shared = shared
        self.cfg = cfg
        self.model = model
        self.max_tokens = max_tokens
        self.catalog = Catalog()
        self.prefill_tokens_s: float | None = None
        self.list_ms: float | None = None  # the last LIST of this model's saves
        self.list_failures = 0
        self.last_list_error: str | None = None
        self.header_failures = 0
        self._failing = False
        self._tasks: list[asyncio.Task] = []
        # Names forgotten here → when (time.time()): their saves from before that are never taken
        # into the catalog again (a reading sent before the forget, another host's older upload
        # landing after it).
        self.forgotten: dict[str, float] = {}
        # Bucket I/O on threads of its own: a download of gigabytes or a slow LIST never
        # holds up a finalize or a status on the default executor.
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="autosessd-bucket")
        # Downloads wait on no LIST or prune: a turn's download starts at once (the turns'
        # downloads run at most one per slot, so 4 threads rarely queue).
        self.downloads = concurrent.futures.ThreadPoolExecutor(max_workers=4,
                                                               thread_name_prefix="autosessd-download")
        # Set at close: a refresh or prune in a thread stops at its next step instead of
        # running on past the stop (the interpreter joins these threads at exit).
        self.closing = threading.Event()

    # -- life ----------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._refresh_loop()))
        if self.cfg.prune_every_s > 0:
            self._tasks.append(loop.create_task(self._prune_loop()))

    async def close(self) -> None:
        self.closing.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        # A thread in a LIST, a header GET or a prune stops at its next step (closing), the
        # request in flight bounded by the client's timeouts; a download stops at its next
        # chunk (its deadline). What still runs at the process's end: cli.run's last resort.
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.downloads.shutdown(wait=False, cancel_futures=True)

    def engine_changed(self, model: str, max_tokens: int | None) -> None:
        """The engine restarted with another model or context (facts.py): the catalog listed the
        old model's saves; empty until the next reading, which comes at once."""
        self.model, self.max_tokens = model, max_tokens
        self.catalog = Catalog()
        if not self.closing.is_set():
            task = asyncio.get_running_loop().create_task(self.run(self.refresh))
            task.add_done_callback(_said_if_failed)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the bucket's threads."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def forget(self, names: set[str]) -> list[str]:
        """A conversation forgotten here: its saves leave the catalog at once and the bucket
        (SharedStore.forget: every host's). → the object keys removed; SharedError as there."""
        now = time.time()
        self.forgotten.update({n: now for n in names})
        old = self.catalog
        if names & old.saves.keys():
            saves = {n: s for n, s in old.saves.items() if n not in names}
            kept = {s.key for s in saves.values()}
            self.catalog = Catalog(saves, {k: t for k, t in old.tokens.items() if k in kept},
                                   TokenRun([(t, n) for t, n in old.run.items if n not in names]), old.listed_at,
                                   {k: m for k, m in old.manifests.items() if k in kept})
        return await self.run(self.shared.forget, names)

    # -- the catalog -----------------------------------------------------------------
    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.run(self.refresh)
            except Exception as e:  # a bug must not end the loop: the next reading may work
                log.exception("auto sessions: shared: reading the bucket: %s", e)
            await asyncio.sleep(self.cfg.list_every_s)

    def refresh(self) -> Catalog:
        """Read the bucket's saves of this model, and the token lists of saves new since the
        last reading; swap the catalog in. Blocking. Never raises SharedError: a failed LIST
        keeps the catalog as it was (its saves stay where they are or a download says so)."""
        t0 = time.perf_counter()
        # The reading is as of when the LIST was sent: a save uploaded before then is in it
        # (a test waits for a reading after an upload so).
        asked = time.time()
        model = self.model  # a reading of one model's saves is never swapped in for another's
        try:
            saves = self.shared.find(model)
        except SharedError as e:
            self.list_failures += 1
            self.last_list_error = str(e)
            if not self._failing:
                self._failing = True
                log.warning("auto sessions: shared: cannot read the bucket (%s); turns use the saves known from "
                            "its last reading, and the local directory as always", e)
            return self.catalog
        self.list_ms = (time.perf_counter() - t0) * 1000
        # Only auto files: a turn downloads under the save's own name, and a name a person parked
        # here must never be replaced by a file of that name from another host (autosessd
        # uploads no parked names; anything else under the prefix is not ours to bring in).
        saves = [s for s in saves if AUTO_BIN.match(s.name)
                 and not (s.name in self.forgotten and s.saved_at <= self.forgotten[s.name])]
        if self._failing:
            self._failing = False
            self.last_list_error = None
            log.info("auto sessions: shared: the bucket answers again")
        old = self.catalog
        tokens = {s.key: old.tokens[s.key] for s in saves if s.key in old.tokens}
        manifests = {s.key: old.manifests[s.key] for s in saves if s.key in old.manifests}
        new = [s for s in saves if s.key not in tokens]
        if new:
            ex = concurrent.futures.ThreadPoolExecutor(HEADERS_AT_ONCE, thread_name_prefix="autosessd-headers")
            try:
                futs = {ex.submit(self._tokens_of, s): s for s in new}
                pending = set(futs)
                while pending:
                    done, pending = concurrent.futures.wait(pending, timeout=0.2)
                    if self.closing.is_set():
                        return self.catalog  # a stop: the headers not read yet are not waited for
                    for fut in done:
                        got = fut.result()
                        if got is not None:
                            tokens[futs[fut].key] = got[0]
                            if got[1] is not None:
                                manifests[futs[fut].key] = got[1]
            finally:
                ex.shutdown(wait=False, cancel_futures=True)
        # A manifest's size is its whole file's, as the manifest says (its object is a few KB).
        by_name = {s.name: (dataclasses.replace(s, bytes=manifests[s.key][1]) if s.key in manifests else s)
                   for s in saves}
        if model != self.model:
            return self.catalog  # the engine came back with another model meanwhile (engine_changed)
        if tokens.keys() == old.tokens.keys() and by_name.keys() == old.saves.keys():
            run = old.run  # nothing came or went: the sorted run stays
        else:
            run = TokenRun([(tokens[s.key], s.name) for s in saves if s.key in tokens])
        self.catalog = Catalog(by_name, tokens, run, asked, manifests)
        return self.catalog

    def _tokens_of(self, s: RemoteSession) -> tuple[bytes, tuple[tuple[tuple[str, int], ...], int] | None] | None:
        """(the save's tokens, encoded; for a manifest save its blocks and bytes, as
        Catalog.manifests keeps them), or None: not read now."""
        if self.closing.is_set():
            return None
        try:
            if s.manifest:
                meta = self.shared.read_manifest(s, self.max_tokens)
                return encode(comparable(decode(meta.tokens or b""))), (block_sizes(meta), meta.bytes)
            return encode(comparable(self.shared.tokens(s, self.max_tokens))), None
        except BadObject as e:  # not what its name says: remembered, never read again
            self.shared._remember_bad(s.key, str(e))
            return None
        except SharedError as e:
            # Another reading tries again (the object may be gone: pruned, superseded).
            self.header_failures += 1
            log.debug("auto sessions: shared: %s", e)
            return None

    def unreachable(self) -> str | None:
        """Why the last LIST failed while it still does (downloads are not tried meanwhile), or None."""
        return self.last_list_error if self._failing else None

    def newest(self, name: str) -> RemoteSession | None:
        """The bucket's current save of `name`, as of the last reading."""
        return self.catalog.saves.get(name)

    def went_on(self, key: str, tokens: bytes | None, n_tokens: int | None, more: int) -> str | None:
        """Did conversation `key` go on on another host from what a slot here holds (tokens:
        the start of it, encoded; n_tokens: all of it)? Yes when the bucket's newest save of
        auto-<key>.bin (as of the last reading: no I/O) is another host's, its tokens begin
        with `tokens`, and it holds at least n_tokens + more: → that host's name, else None.
        The slot's state is then an older copy of that save: saving it would pass for the newer
        save (the bucket's order is by time) though it holds less."""
        if not tokens or n_tokens is None:
            return None  # what the slot holds is not known token for token: nothing to compare
        save = self.newest(auto_name(key))
        if save is None or save.host == self.shared.host or save.n_tokens < n_tokens + more:
            return None
        if self.shared.is_bad(save.key):
            return None  # refused here as not whole: the slot's state may be the only good copy
        theirs = self.catalog.tokens.get(save.key)
        return save.host if theirs is not None and theirs.startswith(tokens) else None

    def best(self, tokens: bytes, min_lcp: int, window: int | None = None,
             skip: Callable[[RemoteSession], bool] | None = None, prefer: str | None = None
             ) -> tuple[RemoteSession, int] | None:
        """The save sharing the longest prefix with `tokens` (encoded), at least min_lcp: (save,
        tokens shared), or None. window: the model's sliding window (index.TokenIndex.best:
        the engine keeps the prefix only when the file holds fewer than that past it). skip:
        saves not to offer (a local copy as new). Among equals: `prefer`, then the smaller."""
        cat = self.catalog
        top, tied = 0, []
        for step in (-1, 1):
            for n, name in cat.run.side(tokens, max(1, min_lcp), step):
                s = cat.saves.get(name)
                if s is None or not swa_usable(s.n_tokens, n, window) or (skip and skip(s)):
                    continue
                if n > top:
                    top, tied = n, [s]
                elif n == top:
                    tied.append(s)
                else:
                    break  # further out shares less
        if not tied:
            return None
        return min(tied, key=lambda s: (s.name != prefer, s.n_tokens, s.name)), top

    # -- the prompt rate -------------------------------------------------------------------
    def saw_prefill(self, n_tokens: int | None, ms: float | None) -> None:
        """A response's prompt reading: n_tokens read (timings.prompt_n) in ms."""
        if not n_tokens or not ms or n_tokens < PREFILL_MIN or ms <= 0:
            return
        rate = n_tokens / (ms / 1000)
        prev = self.prefill_tokens_s
        self.prefill_tokens_s = rate if prev is None else (1 - PREFILL_WEIGHT) * prev + PREFILL_WEIGHT * rate

    # -- the bucket prune --------------------------------------------------------------------
    async def _prune_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.prune_every_s)
            try:
                await self.prune()
            except SharedError as e:
                log.warning("auto sessions: shared: bucket prune: %s", e)
            except Exception as e:
                log.exception("auto sessions: shared: bucket prune: %s", e)

    async def prune(self, dry_run: bool = False, keep: int | None = None, max_gb: float | None = None) -> dict:
        return await self.run(lambda: self.shared.prune_bucket(dry_run, keep, max_gb, stop=self.closing))

    # -- uploads ---------------------------------------------------------------------------------
    def upload_later(self, path: Path, meta: Meta) -> None:
        """Queue a finalized save for upload (the worker thread uploads it; a newer save of the
        name replaces it in the queue)."""
        try:
            self.shared.upload_later(path, meta)
        except SharedError as e:
            log.warning("auto sessions: shared: not uploading %s: %s", path.name, e)

    # -- status ----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        cat = self.catalog
        return {**self.shared.status(),
                "catalog": {"saves": len(cat.saves), "with_tokens": len(cat.run.items),
                            "listed_at": round(cat.listed_at, 3) or None,
                            "list_ms": None if self.list_ms is None else round(self.list_ms, 1),
                            "list_every_s": self.cfg.list_every_s, "list_failures": self.list_failures,
                            "last_list_error": self.last_list_error, "header_failures": self.header_failures},
                "prefill_tokens_s": None if self.prefill_tokens_s is None else round(self.prefill_tokens_s, 1)}
