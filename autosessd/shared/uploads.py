"""Uploads: a finalized local save, off the request's path, into the bucket (bucket.py's layout).

upload_later() queues (one entry per local name: a newer save replaces a queued older one) and
returns at once; one worker thread uploads, multipart above `part_mb`, from a file descriptor
opened once, so a local save that replaces the file mid-upload cannot mix two saves (the
upload reads the old inode to its end, then the newer save is uploaded). A failed attempt is
retried with exponential backoff up to `retry_max_s`, without limit, until it succeeds or is
superseded (a newer local save of the name, the local file gone or changed, or a newer save of
it in the bucket). After an outage the retried upload first aborts this host's unfinished
multipart upload of the same object, so no parts are left behind.

Uploads do not hold Store.in_use: an upload reads through the file descriptor it opened, so a
save renamed over the file meanwhile neither waits for it nor mixes into it.

forget(names): a forgotten conversation's saves leave the bucket, every host's (no host
downloads it back), its queued uploads are dropped and one in flight is deleted when it lands.

At start (start(store, model)) the worker first re-queues this host's local saves that the
bucket lacks and its prune would keep (_requeue_missing); at a stop, drain() gives every
queued upload one more try within the stop's time.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable
from urllib.parse import quote

from ..store import slotfile
from ..store.directory import Meta, Store, StoreError
from ..store.staging import Refused
from .bucket import FORMAT, SESSIONS, SharedError, _why, model_id, parse_key, plan_bucket_prune, stem_of

log = logging.getLogger("autosessd.shared")

LOCAL_TRIES = 8  # an upload whose local save cannot be read this many times is dropped (counted)


def _read_header_fd(f, size: int) -> slotfile.SlotHeader:
    """slotfile.read_header on an open file (the upload reads the inode it opened, not the path)."""
    f.seek(0)
    head = f.read(12)
    if len(head) < 12:
        raise slotfile.BadSlotFile(f"{len(head)} bytes, too short for a slot file")
    _, _, n_words = struct.unpack("<III", head)
    if 12 + 4 * n_words > size:
        raise slotfile.BadSlotFile(f"header claims {n_words:,} words, more than the file's {size:,} bytes hold")
    return slotfile.parse_header(head + f.read(4 * n_words), size)


@dataclass
class _Job:
    path: Path
    meta: Meta
    stem: str
    attempts: int = 0
    local_failures: int = 0  # attempts that failed reading the local save (not the bucket)
    due: float = 0.0  # time.monotonic() before which it is not tried
    last_error: str | None = None
    forgotten: bool = False  # its conversation was forgotten while it went up: its object goes when it lands


class Uploads:
    """SharedStore's uploads (a mixin: the state it uses is made in SharedStore.__init__ —
    _jobs, _running, _cond/_lock, _thread, _stopping, _reconcile, _transfer_future, _transfer,
    counters — and the listing, find/newest, is SharedStore's own)."""

    # -- names ---------------------------------------------------------------------
    def object_key(self, meta: Meta, name: str) -> str:
        us = round(meta.saved_at * 1e6)
        return (f"{self.prefix}{SESSIONS}{model_id(meta.model)}/{stem_of(name)}/"
                f"{us:020d}-{meta.n_tokens:010d}-{self.host}.bin")

    # -- lifecycle -----------------------------------------------------------------
    def start(self, store: Store | None = None, model: str | None = None) -> None:
        """Start the upload worker. With the local store and the engine's model, first re-queue
        local saves of that model that the bucket lacks (uploads lost at a stop or crash)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._reconcile = (store, model) if store is not None and model else None
            self._store = store
            self._thread = threading.Thread(target=self._work, name="autosessd-shared-upload", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker; one upload in flight gets `timeout` seconds to finish. Queued
        uploads stay queued for a later start() in this process; after an exit,
        start(store, model) finds them again in the session directory."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            t = self._thread
        deadline = time.monotonic() + timeout
        if t is not None:
            t.join(timeout)
        with self._lock:
            fut = self._transfer_future
        if fut is not None:
            # Not finished in its time: no further part is sent (the parts in flight end
            # within read_timeout_s), and its unfinished multipart upload is aborted at the
            # next start's retry, or by the bucket prune.
            fut.cancel()
            if t is not None:
                t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            pending = len(self._jobs) + (1 if self._running else 0)
            self._thread = None
        if pending:
            log.info("auto sessions: shared: stopped with %d upload(s) not done; they are queued again at start",
                     pending)

    def drain(self, timeout: float) -> int:
        """At a stop, before stop(): give every queued upload a try now (one waiting out its
        backoff too), and wait until the queue is empty, or every upload left has failed again
        since the drain began (the bucket does not take them: waiting longer would only hold
        the stop; start(store, model) queues them again at the next start), or `timeout`.
        Returns how many uploads are not done."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._thread is None:
                return len(self._jobs) + (1 if self._running else 0)
            now = time.monotonic()
            for j in self._jobs.values():
                j.due = min(j.due, now)
            # Attempts so far, per name: a job with more has failed again during the drain.
            marks = {stem: j.attempts for stem, j in self._jobs.items()}
            if self._running is not None:
                marks[self._running.stem] = self._running.attempts
            self._cond.notify_all()
            while True:
                left = len(self._jobs) + (1 if self._running else 0)
                if not left:
                    return 0
                if self._running is None and all(j.attempts > marks.get(j.stem, 0) for j in self._jobs.values()):
                    return left
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return left
                # The worker does not notify every change: look again at least every 0.1 s.
                self._cond.wait(min(0.1, remaining))

    # -- uploads -------------------------------------------------------------------
    def upload_later(self, path: str | Path, meta: Meta) -> None:
        """Queue a finalized local save for upload; returns at once. A queued older save of the
        same name is replaced (only the newest is worth sending)."""
        path = Path(path)
        stem = stem_of(path.name)
        with self._cond:
            old = self._jobs.get(stem)
            if old is not None and old.meta.saved_at <= meta.saved_at:
                self.counters.uploads_superseded += 1
            if old is None or old.meta.saved_at <= meta.saved_at:
                self._jobs[stem] = _Job(path, meta, stem)
            self._cond.notify_all()

    def upload_now(self, path: str | Path, meta: Meta) -> str:
        """Upload one save in the calling thread: "done" or "superseded: why". SharedError
        when it failed (the queue retries; tests and tools call this directly)."""
        path = Path(path)
        return self._upload(_Job(path, meta, stem_of(path.name)))

    def pending(self) -> int:
        with self._lock:
            return len(self._jobs) + (1 if self._running else 0)

    def forget(self, names: Iterable[str]) -> list[str]:
        """The bucket's saves of these local names (a forgotten conversation's file and its
        branches) removed, whichever host uploaded them: no host downloads them again. Their
        queued uploads are dropped; one going up now is deleted once it lands (_upload); this
        host's unfinished multipart uploads of them are aborted. → the object keys removed.
        Blocking. SharedError when the bucket could not be listed or an object not removed
        (the caller says so: what was removed stays removed)."""
        stems = {stem_of(n) for n in names}
        with self._cond:
            for stem in stems:
                if self._jobs.pop(stem, None) is not None:
                    self.counters.uploads_superseded += 1
            if self._running is not None and self._running.stem in stems:
                self._running.forgotten = True
        removed, failed = self.remove_saves(stems)
        try:
            for s, u in self.unfinished():
                if s.host == self.host and stem_of(s.name) in stems:
                    self.abort(u)
        except self._errors as e:
            failed.append(f"unfinished uploads under {self.prefix + SESSIONS}: {_why(e)}")
        if removed:
            log.info("auto sessions: shared: forgot %s: %d save(s) removed from the bucket", ", ".join(sorted(names)),
                     len(removed))
        if failed:
            raise SharedError(f"{len(removed)} save(s) removed from the bucket, but not: {'; '.join(failed)}")
        return removed

    def _work(self) -> None:
        """The worker's loop. No job's failure ends it: a failure is counted, said, and the job
        retried with backoff (the bucket, or an error nobody foresaw) or dropped (its local save
        is gone, or damaged: no later try can send it); every job after it is still sent."""
        if self._reconcile is not None:
            try:
                self._requeue_missing(*self._reconcile)
            except (SharedError, *self._errors) as e:
                log.warning("auto sessions: shared: could not compare the bucket with %s at start: %s",
                            self._reconcile[0].path, _why(e))
            except Exception as e:
                log.exception("auto sessions: shared: could not compare the bucket with %s at start: %s",
                              self._reconcile[0].path, e)
        while True:
            with self._cond:
                job = None
                while not self._stopping:
                    now = time.monotonic()
                    due = [j for j in self._jobs.values() if j.due <= now]
                    if due:
                        job = min(due, key=lambda j: j.due)
                        del self._jobs[job.stem]
                        self._running = job
                        break
                    nxt = min((j.due for j in self._jobs.values()), default=None)
                    self._cond.wait(None if nxt is None else max(0.0, nxt - now))
                if self._stopping:
                    return
            try:
                outcome = self._upload(job)
                with self._lock:
                    if outcome == "done":
                        self.counters.uploads_done += 1
                    else:
                        self.counters.uploads_superseded += 1
                (log.info if outcome == "done" else log.debug)("auto sessions: shared: upload of %s: %s",
                                                               job.path.name, outcome)
            except Refused as e:  # its save damaged: no later try can send it
                with self._cond:
                    self.counters.upload_failures += 1
                    self.counters.uploads_dropped += 1
                    self.counters.last_upload_error = f"{job.path.name}: {e}"
                log.warning("auto sessions: shared: upload of %s dropped: the local save cannot be read: %s",
                            job.path.name, e)
            except Exception as e:  # the bucket, the local disk, or a bug: tried again later
                with self._cond:
                    gone = job.forgotten
                    if gone:  # forget() aborted its multipart upload: no failure, and not tried again
                        self.counters.uploads_superseded += 1
                if gone:
                    log.info("auto sessions: shared: upload of %s stopped: its conversation was forgotten",
                             job.path.name)
                    continue
                why = _why(e) if isinstance(e, (SharedError, *self._errors)) else f"{type(e).__name__}: {e}"
                if not isinstance(e, (SharedError, *self._errors, StoreError)):
                    log.exception("auto sessions: shared: upload of %s: %s", job.path.name, why)
                job.local_failures += not isinstance(e, (SharedError, *self._errors))
                if job.local_failures >= LOCAL_TRIES:  # the local save stays unreadable: not for ever
                    with self._cond:
                        self.counters.upload_failures += 1
                        self.counters.uploads_dropped += 1
                        self.counters.last_upload_error = f"{job.path.name}: {why}"
                    log.warning("auto sessions: shared: upload of %s dropped: the local save could not be read "
                                "%d times: %s", job.path.name, job.local_failures, why)
                    continue
                job.attempts += 1
                job.last_error = why
                delay = min(self.cfg.retry_max_s, 2.0 ** (job.attempts - 1)) * random.uniform(0.5, 1.0)
                job.due = time.monotonic() + delay
                with self._cond:
                    self.counters.upload_failures += 1
                    self.counters.last_upload_error = f"{job.path.name}: {why}"
                    # A newer save of the name queued meanwhile replaces the failed one; a
                    # forgotten one is not tried again.
                    if job.stem not in self._jobs and not job.forgotten:
                        self._jobs[job.stem] = job
                log.warning("auto sessions: shared: upload of %s failed (attempt %d, next in %.0f s): %s",
                            job.path.name, job.attempts, delay, why)
            finally:
                with self._lock:
                    self._running = None

    def _upload(self, job: _Job) -> str:
        """One attempt at a job: a save kept as token blocks goes up as its manifest and the blocks
        the bucket lacks (and as a whole file too with [shared] whole_files, for hosts of the
        version before manifests); any other as its whole file. → "done" or "superseded: why"."""
        if self._store is not None and job.meta.in_blocks:
            outcome = self._upload_blocks(job)
            if outcome != "done" or not self.cfg.whole_files:
                return outcome
        return self._upload_whole(job)

    def _upload_blocks(self, job: _Job) -> str:
        store = self._store
        assert store is not None and store.blocks is not None
        # Its manifest as it is now, its blocks pinned in the same section: no prune or later
        # save takes one of them before the bucket has them.
        meta, _, pins = store.hot.pinned_manifest(job.meta.key)
        try:
            if meta is None or meta.saved_at != job.meta.saved_at or not meta.in_blocks:
                return "superseded: the local save is gone, or saved again since"
            return self._send_blocks(job, meta, store.blocks)
        finally:
            store.blocks.unpin(pins)

    def _upload_whole(self, job: _Job) -> str:
        meta = job.meta
        key = self.object_key(meta, job.path.name)
        try:
            f, digest = self._open(job)
        except FileNotFoundError:
            return "superseded: the local file is gone"
        except Refused as e:
            if not e.bad:
                raise StoreError(str(e)) from None  # unreadable for now: tried again
            raise
        if digest is not None and digest != meta.digest:
            # Assembled from blocks (position order, not the engine's cache order): the bytes
            # sent are those, and a download checks them against their own digest.
            meta = dataclasses.replace(meta, digest=digest)
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != meta.bytes:
                return f"superseded: the local file changed ({size:,} bytes, the save had {meta.bytes:,})"
            try:
                header = _read_header_fd(f, size)
            except slotfile.BadSlotFile as e:
                return f"superseded: not a slot file this code reads ({e})"
            if header.n_tokens != meta.n_tokens:
                return f"superseded: the file holds {header.n_tokens:,} tokens, the save had {meta.n_tokens:,}"
            # Beside a manifest of the same save (whole_files) only whole files are compared.
            newest = self.newest(meta.model, job.path.name, whole=job.meta.in_blocks)
            mine = (round(meta.saved_at * 1e6), self.host)
            if newest is not None and newest.order >= mine:
                return ("done" if newest.order == mine else
                        f"superseded: {newest.host} saved it later ({newest.saved_at:.3f} > {meta.saved_at:.3f})")
            if job.attempts:
                self._abort_unfinished(key)
            f.seek(0)
            sent = 0

            def on_bytes(n: int) -> None:
                nonlocal sent
                sent += n
                with self._lock:
                    self.counters.bytes_up += n
                if self.progress:
                    self.progress("up", key, sent)

            md = {"autosessd-format": FORMAT, "key": meta.key, "model": quote(meta.model, safe="")[:512],
                  "n-tokens": str(meta.n_tokens), "saved-at": repr(meta.saved_at), "save-ms": str(meta.save_ms),
                  "bytes": str(meta.bytes), "host": self.host}
            # What the turn on another host reads from the metadata a download writes: the
            # conversation's line and prompt length (is the file its own?), a shared prefix,
            # the KV layout (can that engine load it?), the messages its tokens came from (a
            # return matched without tokenizing: "k:n:chain;…", well under S3's 2 KB).
            if meta.line is not None:
                md["line"] = meta.line
            if meta.n_prompt is not None:
                md["n-prompt"] = str(meta.n_prompt)
            if meta.prefix:
                md["prefix"] = "1"
            if meta.layout is not None:
                md["layout"] = meta.layout
            if meta.digest is not None:
                md["digest"] = meta.digest  # a download checks the bytes that arrive against it
            if meta.marks:
                md["marks"] = ";".join(m.to_text() for m in meta.marks)
            try:
                # upload_fileobj's own steps, keeping the future: stop() cancels it, so that
                # s3transfer's threads (joined at the interpreter's exit) send no further part.
                with self._create_transfer_manager(self._client, self._transfer) as mgr:
                    fut = mgr.upload(f, self.bucket, key, extra_args={
                        "Metadata": md, "ContentType": "application/octet-stream"},
                        subscribers=[self._ProgressCallbackInvoker(on_bytes)])
                    with self._lock:
                        self._transfer_future = fut
                        stopping = self._stopping
                    if stopping:
                        fut.cancel()
                    try:
                        fut.result()
                    finally:
                        with self._lock:
                            self._transfer_future = None
            except self._cancelled as e:
                raise SharedError(f"upload of {job.path.name} to {key}: cut short by a stop") from e
            except self._errors as e:
                raise SharedError(f"upload of {job.path.name} to {key}: {_why(e)}") from e
        with self._lock:
            forgotten = job.forgotten
        if forgotten:  # forget() listed the bucket before this object was there
            try:
                self._client.delete_object(Bucket=self.bucket, Key=key)
            except self._errors as e:
                raise SharedError(f"{key}: forgotten while it went up, and not removed: {_why(e)}") from e
            log.info("auto sessions: shared: %s was forgotten while it went up: its object is removed", job.path.name)
            return "superseded: forgotten while it went up (its object removed)"
        return "done"

    def _abort_unfinished(self, key: str) -> None:
        """Abort this host's unfinished multipart uploads of exactly this object (an earlier
        attempt cut by an outage). The key names this host and this save: nobody else's."""
        r = self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=key)
        for u in r.get("Uploads", []):
            if u["Key"] == key:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=u["UploadId"])

    def _open(self, job: _Job):
        """The save's bytes and their digest (None: the save's own). A conversation kept as token
        blocks is read as Store.stage hands it to the engine (its copy in staging, or assembled
        again when the copy went), held while it is opened: an open file stays readable when the
        copy is later let go, and the digest is that of those very bytes."""
        store = self._store
        if store is None or not job.meta.in_blocks:
            return open(job.path, "rb"), None
        now = store.read_meta(job.meta.key)
        if now is None or now.saved_at != job.meta.saved_at:
            raise FileNotFoundError(job.path)  # forgotten, pruned or saved again since it was queued
        with store.using(job.path.name):
            staged = store.stage(job.path.name)
            f = open(store.staging / staged.name, "rb")
        if staged.temporary:
            store.unstage(staged)
        return f, staged.digest

    def _requeue_missing(self, store: Store, model: str) -> None:
        """Queue this host's local saves the bucket lacks, of those its prune would keep.

        Only saves made here (Meta.host None or this host): a file downloaded from another
        host is that host's to upload. And only those that the bucket prune's keep / max_gb
        would keep beside what the bucket holds: a save it removed is not sent again at
        every restart, to be removed again."""
        current = self.find(model)
        remote = {r.name: r for r in current}
        candidates: dict[str, tuple[Path, Meta]] = {}
        for e in store.scan():
            if e.meta is None or e.meta.model != model or e.meta.host not in (None, self.host):
                continue
            r = remote.get(e.name)
            if r is None or round(r.saved_at * 1e6) < round(e.meta.saved_at * 1e6):
                path = store.hot_path(e.key) if e.meta.in_blocks else store.bin_path(e.key)
                key = self.manifest_key(e.meta, e.name) if e.meta.in_blocks else self.object_key(e.meta, e.name)
                candidates[key] = (path, e.meta)
        if not candidates:
            return
        now = time.time()
        would_be = [parse_key(self.prefix, k, m.bytes, now) for k, (_, m) in candidates.items()]
        plan = plan_bucket_prune(current + [s for s in would_be if s is not None], self.cfg.keep,
                                 int(self.cfg.max_gb * 1e9), now, self.cfg.grace_s)
        kept = {s.key for s in plan.keep}
        n = 0
        for k, (path, meta) in candidates.items():
            if k in kept:
                self.upload_later(path, meta)
                n += 1
        if n:
            log.info("auto sessions: shared: %d local save(s) not in the bucket yet, queued for upload", n)
        if n < len(candidates):
            log.info("auto sessions: shared: %d local save(s) not in the bucket not queued: beyond [shared] keep / "
                     "max_gb, the bucket prune would remove them", len(candidates) - n)
