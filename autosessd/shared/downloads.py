"""Downloads: a save another host made, from the bucket into the session directory.

decide() weighs downloading a save (bytes at the measured rate, plus the restore) against
re-reading its tokens (the engine's prompt rate) and says both numbers; no download is tried
while the bucket does not answer or after a failed download, until its backoff has run out
(doubling per failure up to retry_max_s, reset by a success): a dead or crawling bucket costs
one turn its timeout, not every turn. A failed download still teaches the rate. An object
that arrived whole but is not what its host saved (BadObject) says nothing of the bucket: it
starts no backoff, and its key is remembered (bad) so that it is never fetched again.

download(): temporary (.autosessd-*.partial, removed by Store.cleanup after a crash), its
digest (files.DIGEST) computed as the bytes arrive → size against the LIST and against the
saving host's own record (x-amz-meta-bytes), digest against its x-amz-meta-digest, slot-file
header against the name → KV layout checked (refused when this engine cannot load it) →
fsync → Store.install: the file and the metadata taken from the same GET renamed in place
together, after the store's last look, as a local finalize makes a save visible. A name that
is in use locally (being saved, restored or downloaded: Store.in_use) is never replaced, and
a local save at least as new as the remote one is kept.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from ..base import files
from ..store import slotfile
from ..store.directory import AUTO_BIN, TEMP_PREFIX, InUse, Meta, NewerHere, Store
from ..store.blocks import HEADER, BadBlock, BlockRef, TailRef
from ..store.placing import Placer
from ..store.kvfile import Shape
from ..store.names import marks_from
from .blockobjects import Ref, refs_of
from .bucket import (AlreadyHere, BadObject, Estimate, Incompatible, LocalFailure, LocalWrite, RemoteSession,
                     SharedError, _why, estimate, stem_of)

log = logging.getLogger("autosessd.shared")

CHUNK = 1 << 20
# A failed download teaches the rate (bytes that arrived / time spent) only when it took this
# long: a refused connection says nothing about the link's speed.
DOWN_RATE_MIN_S = 1.0
DOWN_BACKOFF_S = 10.0  # the first pause of downloads after a failed one; doubles up to retry_max_s
BAD_KEPT = 10_000  # bad objects remembered (the oldest forgotten first)


class Downloads:
    """SharedStore's downloads (a mixin: the state it uses is made in SharedStore.__init__ —
    _client, bucket, cfg, host, _errors, counters under _lock, _down_rate, _down_backoff_until,
    _down_backoff_s, _blocked_said, progress, bad)."""

    def is_bad(self, key: str) -> bool:
        """An object refused as not whole (BadObject): never fetched again."""
        with self._lock:
            return key in self.bad

    def _remember_bad(self, key: str, why: str) -> None:
        self._mark_bad(key, why)
        with self._lock:
            self.counters.downloads_refused_bad += 1
            self.counters.last_download_error = why
        log.warning("auto sessions: shared: %s; this object is not fetched again", why)

    def _mark_bad(self, key: str, why: str) -> None:
        """`key` refused as not whole (the oldest forgotten past BAD_KEPT); not counted."""
        with self._lock:
            self.bad[key] = why
            while len(self.bad) > BAD_KEPT:
                del self.bad[next(iter(self.bad))]

    def decide(self, s: RemoteSession, prefill_tokens_s: float | None, n_tokens: int | None = None,
               restore_bytes_s: float | None = None, unreachable: str | None = None,
               n_bytes: int | None = None) -> Estimate:
        """Whether downloading `s` beats re-reading n_tokens (default: the tokens it holds),
        from the measured download rate; logs both numbers and counts a skip. Never while the
        bucket is failing (unreachable: why) or a failed download's backoff runs. n_bytes: what
        the download fetches (a manifest's blocks this host lacks; default: the save's bytes)."""
        n = s.n_tokens if n_tokens is None else n_tokens
        est = estimate(s.bytes if n_bytes is None else n_bytes, n, self._down_rate, prefill_tokens_s,
                       restore_bytes_s, restore_n_bytes=s.bytes)  # the restore reads all of it
        if self.is_bad(s.key):
            return dataclasses.replace(est, blocked=f"{s.key} was refused before: {self.bad.get(s.key)}")
        blocked = self.download_blocked(unreachable)
        if blocked is not None:
            est = dataclasses.replace(est, blocked=blocked)
            with self._lock:
                self.counters.downloads_skipped_unreachable += 1
                said, self._blocked_said = self._blocked_said, True
            (log.debug if said else log.warning)("auto sessions: %s (said once until downloads are tried again)",
                                                 est.line(s.name, s.bytes if n_bytes is None else n_bytes, n))
            return est
        with self._lock:
            self._blocked_said = False
        log.info("auto sessions: %s", est.line(s.name, s.bytes if n_bytes is None else n_bytes, n))
        if not est.worth:
            with self._lock:
                self.counters.downloads_skipped_slower += 1
        return est

    def download_blocked(self, unreachable: str | None = None) -> str | None:
        """Why no download should be tried now, or None. unreachable: why the caller's last LIST
        of the bucket failed (remote.Remote keeps it)."""
        if unreachable:
            return f"the bucket does not answer ({unreachable})"
        left = self._down_backoff_until - time.monotonic()
        if left > 0:
            return (f"a download failed {self._down_backoff_s - left:.0f} s ago "
                    f"({self.counters.last_download_error}); the next is tried in {left:.0f} s")
        return None

    @property
    def download_bytes_per_s(self) -> float | None:
        return self._down_rate

    def download(self, s: RemoteSession, store: Store, claimed: bool = False, deadline: float | None = None,
                 layout: slotfile.KVLayout | None = None) -> Path:
        """Bring save `s` into the session directory as s.name; → its path. SharedError when
        it cannot; then nothing under that name changed. Blocking: run it in a thread.

        deadline (time.monotonic()): past it the download stops between two chunks and fails
        (a turn waits for it: a stalled link must not hold the request; one read is bounded by
        read_timeout_s).

        layout: this engine's KV layout when known. A save of a layout it cannot load (one KV
        stream against -np N without a unified cache, other cache types) is refused before it
        replaces anything: the local file, loadable or not, stays (Incompatible).

        The name is held in Store.in_use for the download (prune leaves it alone) and a name
        someone else holds is never replaced. claimed=True: the caller acquired the name
        itself (on the event loop, to keep holding it through the restore that follows).

        The .bin and its .json are put in place by Store.install (the file, then its
        metadata, both taken from the one GET: no second request between them), after its
        last look that nobody took the name and no local save at least as new finalized
        meanwhile."""
        if s.manifest:
            return self._download_blocks(s, store, claimed, deadline, layout)
        name = s.name
        final = store.path / name
        conv = s.conversation_key
        self._may_replace(s, store, claimed)
        temp = _temp(store, name)
        if not claimed:
            store.acquire(name)
        t0 = time.monotonic()
        got = 0
        hasher = files.Hasher()
        try:
            try:
                with os.fdopen(_create(store, temp), "wb") as out:
                    r = self._client.get_object(Bucket=self.bucket, Key=s.key)
                    body = r["Body"]
                    md = _object_meta(r.get("Metadata") or {})
                    # The saving host recorded its layout: an incompatible save costs no bytes.
                    theirs = slotfile.KVLayout.from_fingerprint(md["layout"]) if md.get("layout") else None
                    if theirs is not None:
                        self._check_layout(s, theirs, layout, body)
                    while chunk := body.read(CHUNK):
                        if deadline is not None and time.monotonic() > deadline:
                            body.close()
                            raise SharedError(f"download of {s.key}: stopped after {got:,} of {s.bytes:,} bytes: "
                                              f"past its time limit (download_timeout_s)")
                        out.write(chunk)
                        hasher.update(chunk)
                        got += len(chunk)
                        with self._lock:
                            self.counters.bytes_down += len(chunk)
                        if self.progress:
                            self.progress("down", s.key, got)
                    out.flush()
                    os.fsync(out.fileno())
                if got != s.bytes:
                    raise SharedError(f"download of {s.key}: {got:,} bytes arrived, the object has {s.bytes:,}")
                digest = hasher.hexdigest()
                self._check_whole(s, md, got, digest)
                try:
                    header = slotfile.read_header(temp)
                except slotfile.BadSlotFile as e:
                    raise BadObject(f"download of {s.key}: not a slot file: {e}") from None
                if header.n_tokens != s.n_tokens:
                    raise BadObject(f"download of {s.key}: its header holds {header.n_tokens:,} tokens, "
                                    f"its name says {s.n_tokens:,}")
                if theirs is None:
                    # Older objects lack it in their metadata: the file's own KV block says.
                    try:
                        theirs = slotfile.read_layout(temp)
                    except slotfile.BadSlotFile:
                        theirs = None  # not readable here: the restore's own check decides
                    if theirs is not None:
                        self._check_layout(s, theirs, layout, None)
            except (slotfile.BadSlotFile, *self._errors) as e:
                raise SharedError(f"download of {s.key}: {_why(e)}") from e
            meta = self._local_meta(s, conv, md, theirs) if conv else None
            if meta is not None:
                # Its identity changes with the rename: Store.install remembers it as checked
                # for this run; after a restart its first restore checks the digest once.
                meta = dataclasses.replace(meta, digest=digest)
            # The last look and the renames, in one section of the store's lock: the name is
            # not taken by anyone but this download (which holds one count of it, claimed or
            # acquired above), and a local save finalized meanwhile (another slot) stays.
            self._install(store, temp, s, meta)
        except BaseException as e:
            self._failed(s, e, t0, got)
            raise
        finally:
            if not claimed:
                store.release(name)
            temp.unlink(missing_ok=True)
        ms = self._succeeded(s, t0, s.bytes)
        log.info("auto sessions: shared: downloaded %s tokens (%.2f GB) from %s's save to %s in %.0f ms",
                 f"{s.n_tokens:,}", s.bytes / 1e9, s.host, name, ms)
        return final

    def _download_blocks(self, s: RemoteSession, store: Store, claimed: bool, deadline: float | None,
                         layout: slotfile.KVLayout | None) -> Path:
        """download() of a manifest: its blocks this host lacks, then the manifest
        (blockobjects.download_manifest), counted as download() counts a whole file."""
        t0 = time.monotonic()
        got = {"blocks_fetched": 0, "bytes_fetched": 0, "blocks_held": 0, "bytes_held": 0}
        try:
            self.download_manifest(s, store, claimed, deadline, layout, got)
        except BaseException as e:
            self._failed(s, e, t0, got["bytes_fetched"])
            raise
        with self._lock:
            c = self.counters
            c.blocks_fetched += got["blocks_fetched"]
            c.bytes_fetched += got["bytes_fetched"]
            c.blocks_held += got["blocks_held"]
            c.bytes_held += got["bytes_held"]
        ms = self._succeeded(s, t0, got["bytes_fetched"], learn=got["bytes_fetched"] >= CHUNK)
        log.info("auto sessions: shared: downloaded %s's manifest of %s (%s tokens) in %.0f ms: %d block(s), "
                 "%.2f GB fetched; %d block(s), %.2f GB held here already", s.host, s.name, f"{s.n_tokens:,}", ms,
                 got["blocks_fetched"], got["bytes_fetched"] / 1e9, got["blocks_held"], got["bytes_held"] / 1e9)
        return store.path / s.name

    def _succeeded(self, s: RemoteSession, t0: float, n_bytes: int, learn: bool = True) -> float:
        """A download done: counted, its rate learned (unless `learn` is false: a manifest whose
        blocks were nearly all here says nothing of the link), the backoff reset. → its ms."""
        ms = (time.monotonic() - t0) * 1000
        with self._lock:
            self.counters.downloads += 1
            if s.host != self.host:  # another host's save: the conversation moved here
                self.counters.downloads_moved += 1
                self.counters.bytes_down_moved += n_bytes
            self.counters.download_ms_total += ms
            self.counters.last_download_ms = ms
            if learn:
                self._learn_rate(n_bytes / max(ms / 1000, 1e-6))
            self._down_backoff_s = 0.0
            self._down_backoff_until = 0.0
        return ms

    def _failed(self, s: RemoteSession, e: BaseException, t0: float, got: int) -> None:
        """A download that did not happen, counted by why: nothing to do (AlreadyHere), the
        object (BadObject: remembered, no backoff), the layout, this host's disk (LocalFailure: a
        failure, no backoff), or the bucket or the link (a failure: its backoff starts)."""
        if isinstance(e, AlreadyHere):
            return
        if isinstance(e, BadObject):
            self._remember_bad(s.key, str(e))
            return
        if isinstance(e, Incompatible):
            with self._lock:
                self.counters.downloads_refused_layout += 1
                self.counters.last_download_error = str(e)
            return
        spent = time.monotonic() - t0
        with self._lock:
            self.counters.download_failures += 1
            self.counters.last_download_error = str(e)
            if isinstance(e, LocalFailure):  # this host's disk: says nothing of the bucket or the link
                return
            # What the failed try says about the link: bytes that arrived over the time it
            # took. A stalled link thus drives the estimate towards re-reading, instead of
            # leaving it unknown (and so "download") for ever.
            if spent >= DOWN_RATE_MIN_S:
                self._learn_rate(max(got, 1) / spent)
            self._down_backoff_s = min(max(self.cfg.retry_max_s, 1.0),
                                       max(DOWN_BACKOFF_S, 2 * self._down_backoff_s))
            self._down_backoff_until = time.monotonic() + self._down_backoff_s

    def _may_replace(self, s: RemoteSession, store: Store, claimed: bool) -> None:
        """Before a download of `s`: nobody but the caller (claimed) holds its name here, and no
        local save of its conversation is as new (AlreadyHere, counted)."""
        if store.users(s.name) > (1 if claimed else 0):
            raise SharedError(f"{s.name} is being written or read here; a download does not replace it")
        local = store.read_meta(s.conversation_key) if s.conversation_key else None
        if local is not None and local.saved_at >= s.saved_at:
            with self._lock:
                self.counters.downloads_kept_local += 1
            raise AlreadyHere(f"{s.name}: the local save is as new as {s.host}'s")

    def _install(self, store: Store, temp: Path, s: RemoteSession, meta: Meta | None) -> None:
        """Store.install of a download (the caller holds the name), its refusals in the tier's
        terms: someone took the name meanwhile (SharedError), or a local save as new landed
        (AlreadyHere, counted)."""
        try:
            store.install(temp, s.name, meta, claimed=True)
        except InUse:
            raise SharedError(f"{s.name} was taken here during the download (a save or a restore); "
                              f"it is not replaced") from None
        except NewerHere:
            with self._lock:
                self.counters.downloads_kept_local += 1
            raise AlreadyHere(f"{s.name}: a local save as new as {s.host}'s finalized during the download") from None

    @staticmethod
    def _check_whole(s: RemoteSession, md: dict[str, str], got: int, digest: str) -> None:
        """The bytes that arrived are the save its host made: its own count (x-amz-meta-bytes,
        written by the host that saved it; the LIST's size is only the object's), and its
        digest when the host recorded one (older objects did not)."""
        recorded = md.get("bytes")
        if recorded is not None and recorded != str(got):
            raise BadObject(f"download of {s.key}: {got:,} bytes arrived, its host saved {recorded} "
                            f"(a torn or damaged upload)")
        if md.get("digest") and md["digest"] != digest:
            raise BadObject(f"download of {s.key}: its digest is {digest}, its host saved {md['digest']}")

    def _check_layout(self, s: RemoteSession, theirs: slotfile.KVLayout, ours: slotfile.KVLayout | None,
                      body: Any) -> None:
        if ours is None or theirs.compatible(ours):
            return
        if body is not None:
            body.close()
        raise Incompatible(f"{s.name} from {s.host}: saved with KV layout {theirs.fingerprint()}, this engine's is "
                           f"{ours.fingerprint()} (run every host with the same model and the same -np / "
                           f"--kv-unified / cache type / flash attention flags); the local file stays")

    def _learn_rate(self, rate: float) -> None:
        # A moving average: one slow download (a busy link) does not decide the next alone.
        # Under _lock.
        self._down_rate = rate if self._down_rate is None else 0.5 * self._down_rate + 0.5 * rate

    def _local_meta(self, s: RemoteSession, conv: str, md: dict[str, str],
                    layout: slotfile.KVLayout | None) -> Meta:
        """The local metadata of a downloaded save: what its name says, and what the saving
        host recorded in the object's metadata (older objects lack the last five: None, ())."""

        def num(k: str, kind: type) -> Any:
            try:
                return kind(md[k]) if k in md else None
            except ValueError:
                return None

        line = md.get("line")
        return Meta(key=conv, n_tokens=s.n_tokens, bytes=s.bytes, saved_at=s.saved_at,
                    model=md.get("model", s.model), save_ms=num("save-ms", float) or 0.0,
                    line=line if line and AUTO_BIN.match(f"auto-{line}.bin") else None,
                    n_prompt=num("n-prompt", int), prefix=md.get("prefix") == "1",
                    layout=layout.fingerprint() if layout is not None else None, host=s.host,
                    marks=marks_from(md.get("marks", "")))

    # -- download ------------------------------------------------------------------------
    @staticmethod
    def missing_bytes(s: RemoteSession, sizes: tuple[tuple[str, int], ...] | None, store: Store) -> int:
        """Bytes a download of `s` would fetch: of its blocks (blockobjects.block_sizes), those
        this host lacks (its size when they are not known)."""
        if sizes is None or store.blocks is None:
            return s.bytes
        return sum(n for key, n in dict(sizes).items() if not store.blocks.path(key).exists())

    def download_manifest(self, s: RemoteSession, store: Store, claimed: bool, deadline: float | None,
                          layout: slotfile.KVLayout | None, got: dict[str, int]) -> None:
        """Bring save `s` (a manifest) into the local store as the engine's file, from the
        blocks this host lacks (fetched, 4 at a time) and those it holds (read here): each block
        written in place (placing.Placer) into one temporary as its bytes come, a megabyte at
        a time, and checked against its own digest once all came; the file, fsynced once, is
        installed whole only when every block passed, as a whole file's download is. The user's
        turn waits for one write of the file, not for a block store's write and an assembly
        after it. The caller keeps it as blocks after the restore (Store.import_whole:
        fetcher.py). `got` counts what was fetched and held (a failure leaves in it what had
        arrived). AlreadyHere, BadObject, Incompatible, SharedError as download() has them;
        nothing under the name changes on any of them."""
        name, conv = s.name, s.conversation_key
        if conv is None or store.blocks is None:
            raise SharedError(f"{name}: a manifest is restored only into a block store of an auto name")
        self._may_replace(s, store, claimed)
        meta = self.read_manifest(s)
        if meta.layout:
            self._check_layout(s, slotfile.KVLayout.from_fingerprint(meta.layout), layout, None)
        refs = refs_of(meta)
        if not claimed:
            store.acquire(name)
        temp = _temp(store, name)
        try:
            with store.blocks.pinned([r.key for r in refs]):
                jobs: list[tuple[bool, int | None, Ref]] = []  # (held here, its place: None the tail, ref)
                for i, r in enumerate(refs):
                    have = store.blocks.info(r.key)
                    jobs.append((have is not None and have[0] == r.n_cells, i if r.n_cells else None, r))
                fd = _create(store, temp)
                placer: Placer | None = None
                try:
                    try:
                        placer = Placer(fd, Shape.from_json(meta.kv), meta.tokens or b"",
                                        [BlockRef(*b) for b in meta.blocks],
                                        TailRef(*meta.tail) if meta.tail else None)
                    except (BadBlock, ValueError, KeyError, TypeError) as e:
                        raise BadObject(f"{s.key}: not a file its blocks can make: {e}") from None
                    except OSError as e:  # its header, or the room a transposed V's map needs
                        raise LocalFailure(f"download of {s.key}: writing it here: {e.strerror or e}") from e
                    if placer.size != meta.bytes:
                        raise BadObject(f"{s.key}: its blocks make a file of {placer.size:,} bytes, "
                                        f"it says {meta.bytes:,}")

                    def one(job: tuple[bool, int | None, Ref]) -> None:
                        held, i, r = job
                        if i is None:  # the tail
                            put, done = placer.write_tail, placer.tail_done
                        else:
                            put, done = functools.partial(placer.write, i), functools.partial(placer.done, i)
                        # One this host holds is read here; one it lacks, or cannot read, fetched.
                        fetched = not (held and self._pour_held(store, r, put))
                        if fetched:
                            self._stream_block(s, r, deadline, put)
                        done()
                        with self._lock:
                            got["blocks_fetched" if fetched else "blocks_held"] += 1
                            got["bytes_fetched" if fetched else "bytes_held"] += HEADER.size + r.payload

                    try:
                        fetched, held = [j for j in jobs if not j[0]], [j for j in jobs if j[0]]
                        # Reads here between the fetches: placed while the bytes of others arrive.
                        order = [j for pair in itertools.zip_longest(fetched, held) for j in pair if j is not None]
                        self._each(one, order)
                        placer.finish()
                        # Its own digest (the file the blocks make holds the cells in position
                        # order in the first stream, which the saving host's engine file, the
                        # manifest's digest, need not), read meanwhile from the page cache: the
                        # user waits for the disk once, not for the disk and then a read.
                        with concurrent.futures.ThreadPoolExecutor(1, "autosessd-digest") as pool:
                            reading = pool.submit(files.digest_fd, fd)
                            os.fsync(fd)  # a transposed V's mapped pages too: they are the file's
                            try:
                                digest = reading.result()
                            except OSError as e:
                                raise LocalFailure(f"download of {s.key}: reading it back: "
                                                   f"{e.strerror or e}") from e
                    except LocalWrite as e:
                        raise LocalFailure(f"download of {s.key}: writing it here: {e}") from e.error
                    except OSError as e:
                        raise LocalFailure(f"download of {s.key}: writing it here: {e.strerror or e}") from e
                finally:
                    try:
                        if placer is not None:
                            placer.close()
                    finally:
                        os.close(fd)
            whole = dataclasses.replace(meta, host=s.host, ident=None, blocks=(), tail=None, kv=None, tokens=None,
                                        whole=None, digest=digest)
            self._install(store, temp, s, whole)
        finally:
            if not claimed:
                store.release(name)
            temp.unlink(missing_ok=True)


def _temp(store: Store, name: str) -> Path:
    """Where a download of `name` is written before Store.install puts it in place (a crash's
    leftover goes at Store.cleanup)."""
    return store.path / f"{TEMP_PREFIX}{stem_of(name)}.{uuid.uuid4().hex[:8]}.download.partial"


def _create(store: Store, temp: Path) -> int:
    """`temp` created for reading and writing, with the store's mode and group when it has them
    (0640 + control.group), else 0600. → its descriptor."""
    fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        group = getattr(store, "group", None)
        if group is not None:
            os.fchown(fd, -1, group)
        os.fchmod(fd, getattr(store, "mode", 0o600))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _object_meta(md: dict[str, str]) -> dict[str, str]:
    """x-amz-meta-* as a GET returns them (lower-case names), the model name unquoted."""
    md = {k.lower(): v for k, v in md.items()}
    if "model" in md:
        md["model"] = unquote(md["model"])
    return md
