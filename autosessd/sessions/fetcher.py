"""The shared bucket as a turn sees it: a download before a restore (remote.py keeps the catalog).

At a restore, when nothing local is good enough, the catalog is
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
goes on as if there were no bucket. Nothing outside this module and remote.py touches the
SharedStore a Remote wraps.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Callable

from ..base import logs
from ..shared import AlreadyHere, BadObject, Incompatible, RemoteSession, SharedError
from ..store import slotfile
from ..store.directory import AUTO_BIN, Store, auto_name
from . import policy
from .policy import Fetch, FileInfo, Held, SaveOutcome
from .remote import Remote
from .report import TurnResult, fmt_bytes, fmt_tokens

if TYPE_CHECKING:
    from .context import Context
    from .saves import Saver

log = logging.getLogger("autosessd")


class Claim:
    """A downloaded file's name held in Store.in_use from before its download until the
    restore that follows has read it. A download given up on (its time limit) keeps the name
    until its thread has ended: until then it may still rename a whole file into place."""

    def __init__(self, store: Store, name: str):
        self.store, self.name = store, name
        self.fut: asyncio.Future | None = None
        self._released = False
        # Called once the name is let go after a download that came whole (on the event loop).
        self.after: Callable[[], None] | None = None
        store.acquire(name)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self.fut is not None and not self.fut.done():
            self.fut.add_done_callback(self._later)
        else:
            self.store.release(self.name)
            if self.after is not None:
                self.after()

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
        # A downloaded file's key, once its restore read it: kept as blocks later (Upkeep.keep_as_blocks).
        self.downloaded: Callable[[str], None] | None = None

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
        hit = remote.best(tokens, have + max(min_tokens, 1), ctx.reuse_window, prefer=auto_name(key),
                          skip=lambda r: r.name in writing or remote.shared.is_bad(r.key) or self._have_locally(r))
        fetch = policy.plan_fetch_by_tokens(held, outcome, found, (hit[0].name, hit[1]) if hit else None, shared,
                                            min_tokens)
        if fetch is None or hit is None:
            return found, None
        claim = await self._fetch(hit[0], fetch, result)
        if claim is None:
            return found, None
        self._came_from(key, hit[0], result)
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
        claim = await self._fetch(save, fetch, result)
        if claim is not None:
            self._came_from(key, save, result)
        return claim

    @staticmethod
    def _came_from(key: str, save: RemoteSession, result: TurnResult) -> None:
        """The header's "bucket HOST" is for the conversation's own save only: a download of
        another conversation's save (a shared prefix) does not make this one a guest here."""
        if save.name == auto_name(key):
            result.downloaded_from = save.host

    def arrival(self, key: str, result: TurnResult) -> None:
        """A switch to conversation `key`: did it move here? Yes when the bucket's newest save of
        it (as of the catalog's last reading: no I/O) is another host's and newer than this
        host's own file of it, or this host has none: its turns ran elsewhere since. Counted
        (arrivals), and said in the turn (the gate's X-Autosessd-Conversation header)."""
        remote = bucket(self.ctx)
        save = remote.newest(auto_name(key))
        if save is None or save.host == remote.shared.host:
            return
        meta = self.ctx.store.read_meta(key)
        if meta is not None and meta.saved_at >= save.saved_at:
            return
        result.moved_from = save.host
        self.ctx.counters.arrivals += 1
        # Why it may still not be downloaded, where people look (a new user saw `moved` and a
        # restore of this host's older copy, and nothing said why).
        logs.soon(log, logging.INFO, "auto sessions: %s moved here: its newest save is %s's (%s tokens; this host's: "
                  "%s): downloaded only when it holds %s tokens more than the best local copy and beats re-reading "
                  "them", key, save.host, fmt_tokens(save.n_tokens),
                  fmt_tokens(meta.n_tokens) if meta is not None else "none", fmt_tokens(max(self.ctx.min_tokens, 1)))

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
        # A manifest's download fetches only the blocks this host lacks (a shared prefix, an earlier turn).
        known = remote.catalog.manifests.get(save.key)
        n_bytes = remote.shared.missing_bytes(save, known[0] if known else None, ctx.store) if save.manifest else None
        est = remote.shared.decide(save, remote.prefill_tokens_s, fetch.gain, self._restore_rate(),
                                   unreachable=remote.unreachable(), n_bytes=n_bytes)
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
        if self.downloaded is not None and save.conversation_key:
            claim.after = functools.partial(self.downloaded, save.conversation_key)
        ms = (time.monotonic() - t0) * 1000
        got = save.bytes if n_bytes is None else n_bytes
        ctx.events.emit("downloaded", file=save.name, host=save.host, n_tokens=save.n_tokens, bytes=got,
                        ms=round(ms, 2))
        result.skipped.append(f"shared: downloaded {save.name} ({fmt_bytes(got)}"
                              f"{f' of {fmt_bytes(save.bytes)}: the blocks this host lacked' if save.manifest else ''})"
                              f" from {save.host} in {ms:,.0f} ms")
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
                ctx.index.add_file(save.name)  # whole, a manifest's too; the model its metadata names, the saving host's
            except (OSError, ValueError, slotfile.BadSlotFile) as e:
                raise SharedError(f"indexing the downloaded {save.name}: {e}") from None
