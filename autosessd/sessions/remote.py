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

The turn's side (Fetcher). At a restore, when nothing local is good enough, the catalog is
asked — no request to the bucket on the turn's path:

    by tokens the bucket's save sharing min_tokens more than the slot and the best local
              file (policy.plan_fetch_by_tokens); a save whose local copy is as new is skipped
    by key    its save of auto-<key>.bin when the local one is missing, unusable, or older
              and min_tokens shorter (policy.plan_fetch_by_key)

then the estimate (the measured download rate against the engine's prompt rate) decides
whether the download beats re-reading what it adds. A download is claimed in Store.in_use
(Claim) from before it starts until the restore has read the file (no prune removes it, no
other download replaces it), indexed, and restored as a local file is, verified by cache_n.
One that fails or runs past download_timeout_s leaves nothing under its name, and the turn
goes on as if there were no bucket. Nothing outside this module touches the SharedStore a
Remote wraps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..base.config import SharedConfig
from ..shared import AlreadyHere, BadObject, Incompatible, RemoteSession, SharedError, SharedStore
from ..store import slotfile
from ..store.directory import AUTO_BIN, Meta, Store, auto_name
from ..store.runs import TokenRun, swa_usable
from ..store.slotfile import comparable, encode
from . import policy
from .policy import Fetch, FileInfo, Held, SaveOutcome
from .report import TurnResult, fmt_bytes

if TYPE_CHECKING:
    from .context import Context
    from .saves import Saver

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
    listed_at: float = 0.0  # time.time() of the LIST; 0: never listed


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
        saves = [s for s in saves if AUTO_BIN.match(s.name)]
        if self._failing:
            self._failing = False
            self.last_list_error = None
            log.info("auto sessions: shared: the bucket answers again")
        old = self.catalog
        tokens = {s.key: old.tokens[s.key] for s in saves if s.key in old.tokens}
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
                            tokens[futs[fut].key] = got
            finally:
                ex.shutdown(wait=False, cancel_futures=True)
        by_name = {s.name: s for s in saves}
        if model != self.model:
            return self.catalog  # the engine came back with another model meanwhile (engine_changed)
        if tokens.keys() == old.tokens.keys() and by_name.keys() == old.saves.keys():
            run = old.run  # nothing came or went: the sorted run stays
        else:
            run = TokenRun([(tokens[s.key], s.name) for s in saves if s.key in tokens])
        self.catalog = Catalog(by_name, tokens, run, time.time())
        return self.catalog

    def _tokens_of(self, s: RemoteSession) -> bytes | None:
        if self.closing.is_set():
            return None
        try:
            return encode(comparable(self.shared.tokens(s, self.max_tokens)))
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


class Claim:
    """A downloaded file's name held in Store.in_use from before its download until the
    restore that follows has read it. A download given up on (its time limit) keeps the name
    until its thread has ended: until then it may still rename a whole file into place."""

    def __init__(self, store: Store, name: str):
        self.store, self.name = store, name
        self.fut: asyncio.Future | None = None
        self._released = False
        store.acquire(name)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self.fut is not None and not self.fut.done():
            self.fut.add_done_callback(self._later)
        else:
            self.store.release(self.name)

    def _later(self, fut: asyncio.Future) -> None:
        if not fut.cancelled():
            fut.exception()  # already logged as given up; retrieved so asyncio does not say it again
        self.store.release(self.name)


def bucket(ctx: Context) -> Remote:
    """ctx.remote, which is a Remote wherever a bucket is configured (the daemon sets it)."""
    assert isinstance(ctx.remote, Remote), "no shared bucket"
    return ctx.remote


class Fetcher:
    """The bucket as the turn sees it: a download before a restore (the module docstring)."""

    def __init__(self, ctx: Context, saver: Saver):
        self.ctx = ctx
        self.saver = saver

    async def by_tokens(self, key: str, held: Held | None, outcome: SaveOutcome, tokens: bytes, shared: int,
                        found: tuple[str, int] | None, result: TurnResult
                        ) -> tuple[tuple[str, int] | None, Claim | None]:
        """The bucket's save sharing the longest prefix with the request, when it shares
        min_tokens more than the slot and the best local file (policy.plan_fetch_by_tokens) and
        its download beats re-reading: downloaded and indexed. → (what to restore, the claim
        on it), or (found, None): the local choice stands."""
        ctx = self.ctx
        remote, index = bucket(ctx), ctx.index
        assert index is not None
        min_tokens = ctx.min_tokens
        have = max(shared, found[1] if found is not None else 0)
        writing = self.saver.writing()
        hit = remote.best(tokens, have + max(min_tokens, 1), ctx.swa_window, prefer=auto_name(key),
                          skip=lambda r: r.name in writing or remote.shared.is_bad(r.key) or self._have_locally(r))
        fetch = policy.plan_fetch_by_tokens(held, outcome, found, (hit[0].name, hit[1]) if hit else None, shared,
                                            min_tokens)
        if fetch is None or hit is None:
            return found, None
        claim = await self._fetch(hit[0], fetch, result)
        if claim is None:
            return found, None
        # The file's own tokens, now in the local index, decide (they are the object's).
        lcp = index.lcp(fetch.name, tokens)
        if lcp is None or lcp < have + max(min_tokens, 1):
            claim.release()
            return found, None
        return (fetch.name, lcp), claim

    async def by_key(self, key: str, held: Held | None, outcome: SaveOutcome, file: FileInfo | None,
                     result: TurnResult) -> Claim | None:
        """The key rule with a bucket: its current save of auto-<key>.bin, downloaded when the
        local one is missing, unusable, or older and shorter (policy.plan_fetch_by_key) and
        the download beats re-reading. → the claim on the file, or None."""
        ctx = self.ctx
        save = bucket(ctx).newest(auto_name(key))
        meta = ctx.store.read_meta(key) if file is not None else None
        fetch = policy.plan_fetch_by_key(held, key, outcome, file, meta.saved_at if meta else None,
                                         save.n_tokens if save else None, save.saved_at if save else None,
                                         ctx.model, ctx.min_tokens, ctx.engine_layout)
        if fetch is None or save is None or save.name in self.saver.writing():
            return None
        return await self._fetch(save, fetch, result)

    def holds(self, tokens: bytes, n: int) -> bool:
        """Does the bucket hold a save sharing at least n tokens with `tokens` (encoded) that the
        local index has not weighed already (a save newer than the local file of its name)?
        recall.py asks before it restores a file without the request's tokens."""
        remote = bucket(self.ctx)
        writing = self.saver.writing()
        return remote.best(tokens, n, None, skip=lambda r: r.name in writing or remote.shared.is_bad(r.key)
                           or self._have_locally(r)) is not None

    def _have_locally(self, r: RemoteSession) -> bool:
        """A local file of that name is as new as the bucket's save (the local index already
        weighed it): nothing to download."""
        m = AUTO_BIN.match(r.name)
        meta = self.ctx.store.read_meta(m.group(1)) if m else None
        return meta is not None and meta.saved_at >= r.saved_at

    def _restore_rate(self) -> float | None:
        """Bytes per second of this engine's restores so far (the estimate adds the restore)."""
        c = self.ctx.counters
        return c.bytes_restored / (c.ms_restored / 1000) if c.ms_restored > 0 else None

    async def _fetch(self, save: RemoteSession, fetch: Fetch, result: TurnResult) -> Claim | None:
        """Download `save` for this turn's restore if the estimate says it beats re-reading
        the fetch.gain tokens it adds (logged either way). The request waits for it, at most
        download_timeout_s. → the claim on its name (held until the restore that follows has
        read it: no prune removes it, no other download replaces it), or None: the turn goes
        on without it, as if there were no bucket."""
        ctx = self.ctx
        remote = bucket(ctx)
        est = remote.shared.decide(save, remote.prefill_tokens_s, fetch.gain, self._restore_rate(),
                                   unreachable=remote.unreachable())
        if not est.worth:
            why = est.blocked or f"re-reading its {fetch.gain:,} tokens is faster"
            result.skipped.append(f"shared: {save.name} not downloaded: {why}")
            return None
        limit = remote.cfg.download_timeout_s
        claim = Claim(ctx.store, save.name)
        t0 = time.monotonic()
        # "started": time.monotonic() when its thread took it up, or None when the turn gave up
        # before that (dict.setdefault is atomic: whichever comes first decides).
        state: dict[str, float | None] = {}
        try:
            # Downloads have their own threads (no LIST or prune ahead of them), and the
            # time limit counts from when the thread starts it.
            claim.fut = asyncio.get_running_loop().run_in_executor(remote.downloads, self._download, save, limit,
                                                                   state)
            # The thread stops itself at the limit, between two chunks; one read can take up
            # to read_timeout_s beyond it.
            end = t0 + limit + remote.cfg.read_timeout_s
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(claim.fut), max(0.0, end - time.monotonic()))
                    break
                except asyncio.TimeoutError:
                    began = state.setdefault("started", None)  # not started yet: it never will be
                    if began is None or began + limit + remote.cfg.read_timeout_s <= end:
                        raise
                    end = began + limit + remote.cfg.read_timeout_s
        except AlreadyHere as e:
            # Nothing came from the bucket: the local file is as new (a save finalized here
            # meanwhile); restore that, not counted or reported as a download.
            log.debug("auto sessions: shared: %s", e)
            return claim
        except (Incompatible, BadObject) as e:  # this object, not the bucket: the next turn may download another
            claim.release()
            log.warning("auto sessions: shared: not downloaded: %s", e)
            result.skipped.append(f"shared: {e}")
            return None
        except (SharedError, OSError, asyncio.TimeoutError) as e:
            claim.release()
            why = str(e) or f"no answer within {limit:g} s (download_timeout_s)"
            ctx.counters.fetch_failures += 1
            log.warning("auto sessions: shared: %s from %s: %s; the request re-reads its prompt instead", save.name,
                        save.host, why)
            result.errors.append(f"shared: download of {save.name}: {why}")
            ctx.events.emit("download_failed", file=save.name, host=save.host, error=why)
            return None
        except BaseException:
            claim.release()
            raise
        ctx.counters.fetched += 1
        ms = (time.monotonic() - t0) * 1000
        ctx.events.emit("downloaded", file=save.name, host=save.host, n_tokens=save.n_tokens, bytes=save.bytes,
                        ms=round(ms, 2))
        result.skipped.append(f"shared: downloaded {save.name} ({fmt_bytes(save.bytes)}) from {save.host} in "
                              f"{ms:,.0f} ms")
        return claim

    def _download(self, save: RemoteSession, limit: float, state: dict[str, float | None]) -> None:
        """In a download thread: the download (the name claimed by the caller), at most `limit`
        seconds from now, then the index."""
        ctx = self.ctx
        assert ctx.remote is not None
        began = state.setdefault("started", time.monotonic())
        if began is None:
            raise SharedError(f"download of {save.name}: the turn stopped waiting before it began")
        ctx.remote.shared.download(save, ctx.store, claimed=True, deadline=began + limit, layout=ctx.engine_layout)
        if ctx.index is not None:
            try:
                ctx.index.add_file(save.name)  # the model its metadata names, the saving host's
            except (OSError, ValueError, slotfile.BadSlotFile) as e:
                raise SharedError(f"indexing the downloaded {save.name}: {e}") from None
