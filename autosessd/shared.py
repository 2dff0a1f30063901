"""The shared tier: an S3-compatible bucket below the session directory (DESIGN §9).

Several engine hosts behind a load balancer point their autosessd at one bucket. A save,
once finalized locally, is uploaded off the request's path; a turn whose conversation has no
local file can find a save another host made and download it into the session directory.

Layout in the bucket. autosessd owns exactly these names under `prefix`; nothing else, under
the prefix or outside it, is ever read as a session, listed for prune, or deleted:

    <prefix>sessions/<model>/<stem>/<saved_at µs, 20 digits>-<n_tokens, 10 digits>-<host>.bin
    <prefix>leases/prune.json

  <model>  the engine's model fingerprint (16 hex, engines/llama_server.py); one that is not a
           plain name is replaced by a hash of it
  <stem>   the local file name without ".bin" (auto-<key>, or a parked name)
  <host>   the saving host ([shared] host, default the hostname)

One object per save, written once and never overwritten. That is what makes two hosts saving
the same conversation safe:
  * no torn or mixed object: S3 makes an object visible only when its PUT (or the whole
    multipart upload) has completed, and no object is ever written twice, so a reader gets
    exactly one save's bytes;
  * the newer save wins, whatever order the uploads arrive in: the current save of a
    conversation is the one whose name sorts last (saved_at, then host) — a slow upload of an
    older save that lands later is simply not the newest. No read-compare-write race exists
    because nothing is compared before a write. Saves superseded for longer than `grace_s` are
    removed by the bucket prune (a download that chose one just before has that long to finish);
  * a LIST tells everything find() needs (name, saved_at, n_tokens, host, size), so looking
    for a session costs one request per 1,000 objects, no HEAD per object.
"Newer" is the saving host's wall clock: hosts whose clocks disagree by more than the time
between two saves of one conversation may pick the other's save; NTP keeps that far below a turn.

Object metadata (x-amz-meta-*) repeats the local store.Meta (key, model, n_tokens, saved_at,
save_ms, bytes, host). The token list is not copied anywhere: it is the slot file's own header
(autosessd/slotfile.py), read with one ranged GET by tokens().

Uploads: upload_later() queues (one entry per local name: a newer save replaces a queued older
one) and returns at once; one worker thread uploads, multipart above `part_mb`, from a file
descriptor opened once, so a local save that replaces the file mid-upload cannot mix two saves
(the upload reads the old inode to its end, then the newer save is uploaded). A failed attempt
is retried with exponential backoff up to `retry_max_s`, without limit, until it succeeds or is
superseded (a newer local save of the name, the local file gone or changed, or a newer save of
it in the bucket). After an outage the retried upload first aborts this host's unfinished
multipart upload of the same object, so no parts are left behind.

Downloads: temporary (.autosessd-*.partial, removed by Store.cleanup after a crash) → size and
slot-file header verified → KV layout checked (refused when this engine cannot load it) →
fsync → Store.install: the file and the metadata taken from the same GET renamed in place
together, after the store's last look, as a local finalize makes a save visible. A name that
is in use locally (being saved, restored or downloaded: Store.in_use) is never replaced, and
a local save at least as new as the remote one is kept. Uploads do not
hold Store.in_use: an upload reads through the file descriptor it opened, so a save renamed
over the file meanwhile neither waits for it nor mixes into it (see Uploads).

Bucket prune: separate from local prune (its own keep / max_gb), run by one host at a time
under a lease object taken with conditional writes (PUT If-None-Match: * to create it, PUT
If-Match: <etag> to take over an expired one, renew it, or release it). Expiry is judged on
the server's clock (the lease's Last-Modified against the response's Date), so hosts' clocks
do not matter. Seen with RGW 16.2: both conditions are honoured on PUT (412 otherwise), but
If-Match matches only the ETag without its quotes; the quoted form is tried second, for
servers that want it. A conditional DELETE is ignored by RGW 16.2, so a lease is released by
rewriting it as released, never deleted.

Threads: boto3 is synchronous. The upload worker is one thread of its own; find(), tokens(),
download() and prune_bucket() block, and the daemon calls them with asyncio.to_thread (the
client is thread-safe). Nothing here raises into a request for a tier failure except as
SharedError, which the caller logs and answers by running the turn as if there were no bucket.
"""

from __future__ import annotations

import configparser
import dataclasses
import email.utils
import hashlib
import json
import logging
import os
import random
import re
import socket
import stat
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import quote, unquote

from . import slotfile
from .config import SharedConfig
from .store import AUTO_BIN, MANUAL_NAME, TEMP_PREFIX, InUse, Meta, NewerHere, Store

log = logging.getLogger("autosessd.shared")

FORMAT = "1"  # x-amz-meta-autosessd-format: the layout above
SESSIONS = "sessions/"
LEASE = "leases/prune.json"
_OBJ = re.compile(r"^sessions/(?P<model>[A-Za-z0-9._-]{1,64})/(?P<stem>[A-Za-z0-9_-][A-Za-z0-9._-]{0,127})/"
                  r"(?P<us>\d{20})-(?P<n>\d{10})-(?P<host>[A-Za-z0-9][A-Za-z0-9.-]{0,62})\.bin$")
_MODEL_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_HOST_BAD = re.compile(r"[^A-Za-z0-9.-]+")
# An unfinished multipart upload older than this is abandoned (its host died mid-upload);
# a live one of a 20 GB file over a slow link still finishes well within it.
STALE_MULTIPART_S = 24 * 3600
CHUNK = 1 << 20
# A failed download teaches the rate (bytes that arrived / time spent) only when it took this
# long: a refused connection says nothing about the link's speed.
DOWN_RATE_MIN_S = 1.0
DOWN_BACKOFF_S = 10.0  # the first pause of downloads after a failed one; doubles up to retry_max_s


class SharedError(Exception):
    """A shared-tier operation that did not happen; says what and why. The turn goes on without it."""


class AlreadyHere(SharedError):
    """A download found the local save as new as the bucket's: nothing was downloaded (not a failure)."""


class Incompatible(SharedError):
    """The bucket's save has a KV layout this engine cannot load: refused, the local file stays."""


class Unavailable(SharedError):
    """The tier cannot run here at all (boto3 missing, no credentials): a setup problem."""


@dataclass(frozen=True)
class RemoteSession:
    """One save in the bucket, as a LIST shows it."""

    key: str  # the object's key, prefix included
    model: str  # the model id in the key (the engine's fingerprint when it is a plain name)
    name: str  # the local file name it restores to: <stem>.bin
    saved_at: float  # the saving host's clock, seconds
    n_tokens: int
    host: str
    bytes: int
    modified: float  # the store's Last-Modified, seconds (the server's clock)

    @property
    def conversation_key(self) -> str | None:
        m = AUTO_BIN.match(self.name)
        return m.group(1) if m else None

    @property
    def order(self) -> tuple[int, str]:
        """Newer sorts later: saved_at in µs (as in the name), then host."""
        return (round(self.saved_at * 1e6), self.host)


@dataclass(frozen=True)
class Estimate:
    """Download-and-restore against re-reading the prompt, in seconds. None: not known yet."""

    download_s: float | None
    reread_s: float | None
    down_bytes_s: float | None
    prefill_tokens_s: float | None
    # Why no download is tried at all right now (the bucket does not answer, or a download just
    # failed and its backoff runs): a turn must not wait out a timeout it can foresee.
    blocked: str | None = None

    @property
    def worth(self) -> bool:
        """Download unless it is known to cost more, or the bucket is known not to answer.
        Unknown throughput: download, and so measure it."""
        if self.blocked is not None:
            return False
        if self.download_s is None or self.reread_s is None:
            return True
        return self.download_s < self.reread_s

    def line(self, name: str, n_bytes: int, n_tokens: int) -> str:
        if self.blocked is not None:
            return f"shared: {name} ({n_bytes / 1e9:.2f} GB): not downloaded: {self.blocked}"
        down = (f"download ~{self.download_s:.1f} s at {self.down_bytes_s / 1e6:,.0f} MB/s"
                if self.download_s is not None else "download time unknown (nothing measured yet)")
        reread = (f"re-reading {n_tokens:,} tokens ~{self.reread_s:.1f} s at {self.prefill_tokens_s:,.0f} tokens/s"
                  if self.reread_s is not None else f"re-reading {n_tokens:,} tokens: prefill rate unknown")
        return (f"shared: {name} ({n_bytes / 1e9:.2f} GB): {down} vs {reread}: "
                f"{'downloading' if self.worth else 'skipped, re-reading is faster'}")


def estimate(n_bytes: int, n_tokens: int, down_bytes_s: float | None, prefill_tokens_s: float | None,
             restore_bytes_s: float | None = None, latency_s: float = 0.05) -> Estimate:
    """Pure: time to download n_bytes and restore them vs time to prefill n_tokens.

    down_bytes_s: measured download throughput (SharedStore keeps it); prefill_tokens_s: the
    engine's prompt rate (llama-server reports timings.prompt_per_second); restore_bytes_s: the
    local restore's rate when known (a restore reads the file back from the page cache)."""
    download_s = None
    if down_bytes_s and down_bytes_s > 0:
        download_s = latency_s + n_bytes / down_bytes_s
        if restore_bytes_s and restore_bytes_s > 0:
            download_s += n_bytes / restore_bytes_s
    reread_s = n_tokens / prefill_tokens_s if prefill_tokens_s and prefill_tokens_s > 0 else None
    return Estimate(download_s, reread_s, down_bytes_s, prefill_tokens_s)


@dataclass(frozen=True)
class BucketPrunePlan:
    remove: list[RemoteSession]
    keep: list[RemoteSession]
    superseded: int  # of `remove`, older saves of a conversation that has a newer one

    @property
    def freed(self) -> int:
        return sum(s.bytes for s in self.remove)


def plan_bucket_prune(saves: Iterable[RemoteSession], keep: int, max_bytes: int, now: float,
                      grace_s: float) -> BucketPrunePlan:
    """Pure. The newest save of each (model, name) is current; older ones go once they have been
    superseded for grace_s (server clock: `now` and `modified` both come from the store). Of the
    current saves the newest `keep` and at most max_bytes stay."""
    groups: dict[tuple[str, str], list[RemoteSession]] = {}
    for s in saves:
        groups.setdefault((s.model, s.name), []).append(s)
    current, remove, kept = [], [], []
    superseded = 0
    for versions in groups.values():
        versions.sort(key=lambda s: s.order, reverse=True)
        current.append(versions[0])
        newest_seen = versions[0].modified
        for old in versions[1:]:
            # Superseded since the newer one appeared; its own age does not matter. (`now`
            # comes from an HTTP Date, whole seconds: an age is under-, never overestimated.)
            if grace_s <= 0 or now - newest_seen >= grace_s:
                remove.append(old)
                superseded += 1
            else:
                kept.append(old)
    total = 0
    n = 0
    for s in sorted(current, key=lambda s: s.order, reverse=True):
        if n < keep and total + s.bytes <= max_bytes:
            kept.append(s)
            total += s.bytes
            n += 1
        else:
            remove.append(s)
    return BucketPrunePlan(remove=remove, keep=kept, superseded=superseded)


def model_id(model: str) -> str:
    """The model's folder in the bucket: the fingerprint itself when it is a plain name."""
    return model if _MODEL_ID.match(model) else "h-" + hashlib.sha1(model.encode()).hexdigest()[:16]


def default_host() -> str:
    h = _HOST_BAD.sub("-", socket.gethostname()).strip("-.")[:63]
    return h or "host"


def stem_of(name: str) -> str:
    """A local session file name → its stem in the bucket; SharedError when it is not one."""
    if not name.endswith(".bin") or not (AUTO_BIN.match(name) or MANUAL_NAME.match(name)) or "/" in name:
        raise SharedError(f"{name[:64]!r} is not a session file name")
    return name[:-4]


def parse_key(prefix: str, key: str, size: int, modified: float) -> RemoteSession | None:
    """A listed object → RemoteSession, or None when the name is not one autosessd owns."""
    if not key.startswith(prefix):
        return None
    m = _OBJ.match(key[len(prefix):])
    if not m:
        return None
    return RemoteSession(key=key, model=m["model"], name=m["stem"] + ".bin", saved_at=int(m["us"]) / 1e6,
                         n_tokens=int(m["n"]), host=m["host"], bytes=size, modified=modified)


def read_credentials(path: str) -> dict[str, str]:
    """AWS's credentials INI ([default] or the file's only section): aws_access_key_id,
    aws_secret_access_key, optionally aws_session_token. Refused when others can read it."""
    try:
        st = os.stat(path)
        text = Path(path).read_text()
    except OSError as e:
        raise Unavailable(f"credentials_file {path}: {e.strerror or e}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise Unavailable(f"credentials_file {path} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                          f"chmod 600 it")
    cp = configparser.ConfigParser()
    try:
        cp.read_string(text, source=path)
    except configparser.Error as e:
        raise Unavailable(f"credentials_file {path}: not an INI file ({e.message.splitlines()[0]})") from None
    sections = cp.sections()
    section = "default" if "default" in sections else (sections[0] if len(sections) == 1 else None)
    if section is None:
        raise Unavailable(f"credentials_file {path}: needs a [default] section (found {', '.join(sections) or 'none'})")
    sec = cp[section]
    missing = [k for k in ("aws_access_key_id", "aws_secret_access_key") if not sec.get(k)]
    if missing:
        raise Unavailable(f"credentials_file {path}: [{section}] lacks {' and '.join(missing)}")
    out = {"aws_access_key_id": sec["aws_access_key_id"], "aws_secret_access_key": sec["aws_secret_access_key"]}
    if sec.get("aws_session_token"):
        out["aws_session_token"] = sec["aws_session_token"]
    return out


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
    due: float = 0.0  # time.monotonic() before which it is not tried
    last_error: str | None = None


@dataclass
class Counters:
    uploads_done: int = 0
    uploads_superseded: int = 0
    upload_failures: int = 0  # failed attempts (each is retried)
    bytes_up: int = 0
    downloads: int = 0  # hits: a remote save brought into the session directory
    download_failures: int = 0
    downloads_skipped_slower: int = 0
    downloads_skipped_unreachable: int = 0  # the bucket was failing, or a download's backoff ran
    downloads_kept_local: int = 0  # the local file was as new: nothing downloaded
    downloads_refused_layout: int = 0  # a KV layout this engine cannot load: the local file stayed
    bytes_down: int = 0
    download_ms_total: float = 0.0
    last_download_ms: float | None = None
    last_upload_error: str | None = None
    last_download_error: str | None = None
    last_prune: dict[str, Any] | None = None


class Lease:
    """The bucket prune's lease: one object, changed only by conditional PUTs (see the module
    docstring). held() is true from a successful acquire or renew until lease_s minus a margin
    later by this host's monotonic clock, so a holder stops acting before anyone may take over."""

    def __init__(self, shared: "SharedStore", key: str, ttl_s: float):
        self.shared, self.key, self.ttl_s = shared, key, ttl_s
        self.etag: str | None = None
        self.token = uuid.uuid4().hex
        self._until = 0.0

    def held(self) -> bool:
        return self.etag is not None and time.monotonic() < self._until

    def _body(self, released: bool = False) -> bytes:
        return json.dumps({"host": self.shared.host, "token": self.token, "ttl_s": self.ttl_s,
                           "released": released}).encode()

    def _put(self, body: bytes, **cond: str) -> str | None:
        """One conditional PUT; the new ETag, or None when the condition failed (412)."""
        c = self.shared._client
        try:
            t0 = time.monotonic()
            r = c.put_object(Bucket=self.shared.bucket, Key=self.key, Body=body,
                             ContentType="application/json", **cond)
        except self.shared._ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412") or \
                    e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412:
                return None
            raise
        self._until = t0 + self.ttl_s * 0.8
        return r["ETag"]

    def _put_if_match(self, body: bytes, etag: str) -> str | None:
        # RGW 16.2 matches the ETag without quotes; others may want it quoted. A 412 writes
        # nothing, so trying both forms is safe.
        bare = etag.strip('"')
        return self._put(body, IfMatch=bare) or self._put(body, IfMatch=f'"{bare}"')

    def acquire(self) -> tuple[bool, str]:
        """(held, why not). Creates the lease, or takes over one that is released or expired."""
        new = self._put(self._body(), IfNoneMatch="*")
        if new:
            self.etag = new
            return True, ""
        c = self.shared._client
        try:
            r = c.get_object(Bucket=self.shared.bucket, Key=self.key)
            body = r["Body"].read()
        except self.shared._ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return False, "the lease vanished while taking it; try again"
            raise
        try:
            info = json.loads(body)
            holder, ttl, released = str(info.get("host")), float(info.get("ttl_s", self.ttl_s)), bool(
                info.get("released"))
        except (ValueError, TypeError, AttributeError):
            holder, ttl, released = "?", self.ttl_s, True  # unreadable: treat as free (it is ours to own)
        server_now = _http_date(r["ResponseMetadata"]["HTTPHeaders"].get("date")) or time.time()
        age = server_now - r["LastModified"].timestamp()
        if not released and age < ttl:
            return False, f"held by {holder} (renewed {age:.0f} s ago, expires after {ttl:.0f} s)"
        new = self._put_if_match(self._body(), r["ETag"])
        if not new:
            return False, "another host took the expired lease first"
        self.etag = new
        return True, ""

    def renew(self) -> bool:
        if self.etag is None:
            return False
        new = self._put_if_match(self._body(), self.etag)
        self.etag = new
        return new is not None

    def release(self) -> None:
        if self.etag is None:
            return
        try:
            self._put_if_match(self._body(released=True), self.etag)
        finally:
            self.etag = None
            self._until = 0.0


def _http_date(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None


class SharedStore:
    """The interface the daemon wires in (see the module docstring for what each part guarantees).

    start(store, model)          start the upload worker; re-queue local saves the bucket lacks
    stop(timeout)                stop it (an upload in flight finishes or is abandoned unfinished)
    upload_later(path, meta)     queue a finalized save (returns at once)
    find(model, name=None)       current remote saves of a model, newest first
    list(model=None)             current remote saves (all models)
    tokens(session)              the token list in its header (one ranged GET)
    decide(session, n_tokens, prefill_tokens_s)  Estimate, logged; worth → download
    download(session, store)     into the session directory, atomically; → local path
    prune_bucket(dry_run=False)  under the lease; → report dict
    status()                     counters for autosessctl status and metrics
    """

    def __init__(self, cfg: SharedConfig):
        try:
            import boto3
            from boto3.s3.transfer import ProgressCallbackInvoker, TransferConfig, create_transfer_manager
            from s3transfer.exceptions import CancelledError
            from botocore.config import Config as BotoConfig
            from botocore.exceptions import BotoCoreError, ClientError
        except ImportError:
            raise Unavailable("[shared] needs boto3: pip install 'autosessd[shared]'") from None
        self.cfg = cfg
        self.bucket = cfg.bucket
        self.prefix = cfg.prefix
        self.host = cfg.host or default_host()
        self._ClientError = ClientError
        self._create_transfer_manager, self._ProgressCallbackInvoker = create_transfer_manager, ProgressCallbackInvoker
        self._cancelled: tuple[type[BaseException], ...] = (CancelledError,)
        self._transfer_future: Any = None  # the upload in flight (s3transfer's TransferFuture); under _lock
        self._errors: tuple[type[BaseException], ...] = (BotoCoreError, ClientError, OSError)
        creds = read_credentials(cfg.credentials_file) if cfg.credentials_file else {}
        boto_cfg = BotoConfig(
            connect_timeout=cfg.connect_timeout_s, read_timeout=cfg.read_timeout_s,
            # One quick retry inside a call; the upload queue does the patient retrying.
            retries={"max_attempts": 2, "mode": "standard"},
            # Path-style works on every S3-compatible server (RGW, MinIO, R2) without DNS per bucket.
            s3={"addressing_style": "path"},
            # botocore >= 1.36 sends CRC checksums by default, which several S3-compatible
            # servers refuse; the download checks size and header itself.
            request_checksum_calculation="when_required", response_checksum_validation="when_required",
            max_pool_connections=16)
        session = boto3.session.Session(**creds)
        if session.get_credentials() is None:
            raise Unavailable("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in autosessd's "
                              "environment, or name a file with [shared] credentials_file")
        client = session.client("s3", endpoint_url=cfg.endpoint_url, region_name=cfg.region, config=boto_cfg)
        self._client = client
        part = cfg.part_mb * 1024 * 1024
        # From an open file, s3transfer reads the parts one after another into memory (at most
        # max_in_memory_upload_chunks of them: 6 x part_mb): the inode opened is the one sent.
        # (From a file name it would reopen the path for every part, and a save renamed over
        # it meanwhile would mix two saves in one object.)
        self._transfer = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=4,
                                        use_threads=True)
        self._transfer.max_in_memory_upload_chunks = 6  # s3transfer's own knob; boto3's __init__ lacks it
        self.counters = Counters()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._jobs: dict[str, _Job] = {}  # by stem; at most one queued save per name
        self._running: _Job | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._reconcile: tuple[Store, str] | None = None
        self._down_rate: float | None = None  # bytes/s, moving average of downloads (failed ones too)
        # After a failed download no other is tried until this time.monotonic() (doubling per
        # failure up to retry_max_s, reset by a success): a dead or crawling bucket costs one
        # turn its timeout, not every turn.
        self._down_backoff_until = 0.0
        self._down_backoff_s = 0.0
        self._blocked_said = False  # the skip is logged once per outage, not at every turn
        # Observers of transfer progress (tests stop the gateway mid-transfer with it):
        # called with ("up" | "down", key, bytes so far) from the transferring thread.
        self.progress: Callable[[str, str, int], None] | None = None

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
            if self._thread is not None:
                return
            self._stopping = False
            self._reconcile = (store, model) if store is not None and model else None
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

    def check(self) -> str | None:
        """None when the bucket answers; otherwise why not (for a start-up log line)."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except self._errors as e:
            return f"bucket {self.bucket} at {self.cfg.endpoint_url}: {_why(e)}"
        return None

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

    def _work(self) -> None:
        if self._reconcile is not None:
            try:
                self._requeue_missing(*self._reconcile)
            except (SharedError, *self._errors) as e:
                log.warning("auto sessions: shared: could not compare the bucket with %s at start: %s",
                            self._reconcile[0].path, _why(e))
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
            except (SharedError, *self._errors) as e:
                why = _why(e)
                job.attempts += 1
                job.last_error = why
                delay = min(self.cfg.retry_max_s, 2.0 ** (job.attempts - 1)) * random.uniform(0.5, 1.0)
                job.due = time.monotonic() + delay
                with self._cond:
                    self.counters.upload_failures += 1
                    self.counters.last_upload_error = f"{job.path.name}: {why}"
                    # A newer save of the name queued meanwhile replaces the failed one.
                    if job.stem not in self._jobs:
                        self._jobs[job.stem] = job
                log.warning("auto sessions: shared: upload of %s failed (attempt %d, next in %.0f s): %s",
                            job.path.name, job.attempts, delay, why)
            finally:
                with self._lock:
                    self._running = None

    def _upload(self, job: _Job) -> str:
        meta = job.meta
        key = self.object_key(meta, job.path.name)
        try:
            f = open(job.path, "rb")
        except FileNotFoundError:
            return "superseded: the local file is gone"
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
            newest = self.newest(meta.model, job.path.name)
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
            # the KV layout (can that engine load it?).
            if meta.line is not None:
                md["line"] = meta.line
            if meta.n_prompt is not None:
                md["n-prompt"] = str(meta.n_prompt)
            if meta.prefix:
                md["prefix"] = "1"
            if meta.layout is not None:
                md["layout"] = meta.layout
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
        return "done"

    def _abort_unfinished(self, key: str) -> None:
        """Abort this host's unfinished multipart uploads of exactly this object (an earlier
        attempt cut by an outage). The key names this host and this save: nobody else's."""
        r = self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=key)
        for u in r.get("Uploads", []):
            if u["Key"] == key:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=u["UploadId"])

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
                candidates[self.object_key(e.meta, e.name)] = (store.bin_path(e.key), e.meta)
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

    # -- listing -------------------------------------------------------------------
    def versions(self, model: str | None = None) -> list[RemoteSession]:
        """Every save autosessd owns under the prefix (of one model, or all)."""
        return self._list(model)[0]

    def _list(self, model: str | None = None, stem: str | None = None) -> tuple[list[RemoteSession], float]:
        """(saves under the prefix — of one model, or one model's one name — , the server's clock)."""
        where = self.prefix + SESSIONS
        if model is not None:
            where += model_id(model) + "/" + (stem + "/" if stem is not None else "")
        out: list[RemoteSession] = []
        server_now = None
        kw = {"Bucket": self.bucket, "Prefix": where}
        while True:
            try:
                r = self._client.list_objects_v2(**kw)
            except self._errors as e:
                raise SharedError(f"listing {where} in {self.bucket}: {_why(e)}") from e
            server_now = server_now or _http_date(r["ResponseMetadata"]["HTTPHeaders"].get("date"))
            for o in r.get("Contents", []):
                s = parse_key(self.prefix, o["Key"], int(o["Size"]), o["LastModified"].timestamp())
                if s is not None:
                    out.append(s)
            if not r.get("IsTruncated"):
                return out, server_now or time.time()
            kw["ContinuationToken"] = r["NextContinuationToken"]

    def list(self, model: str | None = None) -> list[RemoteSession]:
        """The current save of every conversation (newest first): what another host would restore."""
        best: dict[tuple[str, str], RemoteSession] = {}
        for s in self.versions(model):
            k = (s.model, s.name)
            if k not in best or s.order > best[k].order:
                best[k] = s
        return sorted(best.values(), key=lambda s: s.order, reverse=True)

    def find(self, model: str, name: str | None = None) -> list[RemoteSession]:
        """Current saves for this model (one name, or all), newest first."""
        found = self.list(model)
        return [s for s in found if name is None or s.name == name]

    def newest(self, model: str, name: str) -> RemoteSession | None:
        """The current save of one name (one LIST of its own folder)."""
        saves = self._list(model, stem_of(name))[0]
        return max(saves, key=lambda s: s.order, default=None)

    def tokens(self, s: RemoteSession) -> tuple[int, ...]:
        """The token list the save holds, from its slot-file header: one ranged GET. Not cached
        here: remote.Remote's catalog keeps each save's tokens (encoded) and reads only new ones."""
        # The server's payload is -1, 1, n, the tokens, n_media (0 without media): n + 4 words.
        # Media chunks (rare) make it longer: then a second GET of the exact length.
        data = self._range(s.key, 0, min(s.bytes, 12 + 4 * (s.n_tokens + 4 + 256)))
        if len(data) >= 12:
            end = 12 + 4 * struct.unpack_from("<I", data, 8)[0]
            if len(data) < end <= s.bytes:
                data = self._range(s.key, 0, end)
        try:
            return slotfile.parse_header(data, s.bytes).tokens
        except slotfile.BadSlotFile as e:
            raise SharedError(f"{s.key}: {e}") from None

    def _range(self, key: str, start: int, n: int) -> bytes:
        try:
            r = self._client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + n - 1}")
            return r["Body"].read()
        except self._errors as e:
            raise SharedError(f"reading the header of {key}: {_why(e)}") from e

    # -- downloads -----------------------------------------------------------------
    def decide(self, s: RemoteSession, prefill_tokens_s: float | None, n_tokens: int | None = None,
               restore_bytes_s: float | None = None, unreachable: str | None = None) -> Estimate:
        """Whether downloading `s` beats re-reading n_tokens (default: the tokens it holds),
        from the measured download rate; logs both numbers and counts a skip. Never while the
        bucket is failing (unreachable: why) or a failed download's backoff runs."""
        n = s.n_tokens if n_tokens is None else n_tokens
        est = estimate(s.bytes, n, self._down_rate, prefill_tokens_s, restore_bytes_s)
        blocked = self.download_blocked(unreachable)
        if blocked is not None:
            est = dataclasses.replace(est, blocked=blocked)
            with self._lock:
                self.counters.downloads_skipped_unreachable += 1
                said, self._blocked_said = self._blocked_said, True
            (log.debug if said else log.warning)("auto sessions: %s (said once until downloads are tried again)",
                                                 est.line(s.name, s.bytes, n))
            return est
        with self._lock:
            self._blocked_said = False
        log.info("auto sessions: %s", est.line(s.name, s.bytes, n))
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
        name = s.name
        stem = stem_of(name)
        final = store.path / name
        conv = s.conversation_key
        if store.users(name) > (1 if claimed else 0):
            raise SharedError(f"{name} is being written or read here; a download does not replace it")
        local = store.read_meta(conv) if conv else None
        if local is not None and local.saved_at >= s.saved_at:
            with self._lock:
                self.counters.downloads_kept_local += 1
            raise AlreadyHere(f"{name}: the local save is as new as {s.host}'s")
        temp = store.path / f"{TEMP_PREFIX}{stem}.{uuid.uuid4().hex[:8]}.download.partial"
        # The store's mode and group when it has them (0640 + control.group), else 0600.
        mode, group = getattr(store, "mode", 0o600), getattr(store, "group", None)
        if not claimed:
            store.acquire(name)
        t0 = time.monotonic()
        got = 0
        try:
            try:
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                if group is not None:
                    os.fchown(fd, -1, group)
                os.fchmod(fd, mode)
                with os.fdopen(fd, "wb") as out:
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
                        got += len(chunk)
                        with self._lock:
                            self.counters.bytes_down += len(chunk)
                        if self.progress:
                            self.progress("down", s.key, got)
                    out.flush()
                    os.fsync(out.fileno())
                if got != s.bytes:
                    raise SharedError(f"download of {s.key}: {got:,} bytes arrived, the object has {s.bytes:,}")
                header = slotfile.read_header(temp)
                if header.n_tokens != s.n_tokens:
                    raise SharedError(f"download of {s.key}: its header holds {header.n_tokens:,} tokens, "
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
            # The last look and the renames, in one section of the store's lock: the name is
            # not taken by anyone but this download (which holds one count of it, claimed or
            # acquired above), and a local save finalized meanwhile (another slot) stays.
            try:
                store.install(temp, name, meta, claimed=True)
            except InUse:
                raise SharedError(f"{name} was taken here during the download (a save or a restore); "
                                  f"it is not replaced") from None
            except NewerHere:
                with self._lock:
                    self.counters.downloads_kept_local += 1
                raise AlreadyHere(f"{name}: a local save as new as {s.host}'s finalized during the download") from None
        except AlreadyHere:
            raise
        except Incompatible as e:
            with self._lock:
                self.counters.downloads_refused_layout += 1
                self.counters.last_download_error = str(e)
            raise
        except BaseException as e:
            spent = time.monotonic() - t0
            with self._lock:
                self.counters.download_failures += 1
                self.counters.last_download_error = str(e)
                # What the failed try says about the link: bytes that arrived over the time it
                # took. A stalled link thus drives the estimate towards re-reading, instead of
                # leaving it unknown (and so "download") for ever.
                if spent >= DOWN_RATE_MIN_S:
                    self._learn_rate(max(got, 1) / spent)
                self._down_backoff_s = min(max(self.cfg.retry_max_s, 1.0),
                                           max(DOWN_BACKOFF_S, 2 * self._down_backoff_s))
                self._down_backoff_until = time.monotonic() + self._down_backoff_s
            raise
        finally:
            if not claimed:
                store.release(name)
            try:
                temp.unlink()
            except FileNotFoundError:
                pass
        ms = (time.monotonic() - t0) * 1000
        rate = s.bytes / max(ms / 1000, 1e-6)
        with self._lock:
            self.counters.downloads += 1
            self.counters.download_ms_total += ms
            self.counters.last_download_ms = ms
            self._learn_rate(rate)
            self._down_backoff_s = 0.0
            self._down_backoff_until = 0.0
        log.info("auto sessions: shared: downloaded %s tokens (%.2f GB) from %s's save to %s in %.0f ms",
                 f"{s.n_tokens:,}", s.bytes / 1e9, s.host, name, ms)
        return final

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
        host recorded in the object's metadata (older objects lack the last four: None)."""

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
                    layout=layout.fingerprint() if layout is not None else None, host=s.host)

    # -- bucket prune --------------------------------------------------------------
    def prune_bucket(self, dry_run: bool = False, keep: int | None = None, max_gb: float | None = None,
                     stop: threading.Event | None = None) -> dict:
        """Remove superseded saves past grace_s and the oldest current ones beyond keep / max_gb,
        holding the lease; abort abandoned multipart uploads under the prefix. Touches only
        names autosessd owns (the pattern in the module docstring). stop: set at the daemon's
        stop; the prune ends before its next batch (the lease is released)."""
        keep = self.cfg.keep if keep is None else keep
        max_bytes = int((self.cfg.max_gb if max_gb is None else max_gb) * 1e9)
        lease = Lease(self, self.prefix + LEASE, self.cfg.lease_s)
        try:
            held, why = lease.acquire()
        except self._errors as e:
            raise SharedError(f"bucket prune: taking the lease: {_why(e)}") from e
        if not held:
            report = {"done": False, "why": f"another host prunes: the lease is {why}"}
            log.info("auto sessions: shared: bucket prune skipped: lease %s", why)
            return report
        removed = aborted = 0
        freed = 0
        try:
            saves, now = self._list()
            plan = plan_bucket_prune(saves, keep, max_bytes, now, self.cfg.grace_s)
            report = {"done": True, "dry_run": dry_run, "saves": len(saves), "remove": len(plan.remove),
                      "superseded": plan.superseded, "freed_bytes": plan.freed}
            if not dry_run:
                todo = list(plan.remove)
                while todo:
                    if stop is not None and stop.is_set():
                        raise SharedError("bucket prune: cut short by a stop")
                    batch, todo = todo[:500], todo[500:]
                    # Renewed before every batch: a long prune never outlives its lease.
                    if not lease.held() or not lease.renew():
                        raise SharedError("bucket prune: lost the lease (another host took it over)")
                    r = self._client.delete_objects(Bucket=self.bucket, Delete={
                        "Objects": [{"Key": s.key} for s in batch], "Quiet": True})
                    failed = {e["Key"] for e in r.get("Errors", [])}
                    removed += sum(1 for s in batch if s.key not in failed)
                    freed += sum(s.bytes for s in batch if s.key not in failed)
                aborted = 0 if stop is not None and stop.is_set() else self._abort_abandoned(now)
                report.update(removed=removed, freed_bytes=freed, aborted_uploads=aborted)
        except self._errors as e:
            raise SharedError(f"bucket prune: {_why(e)}") from e
        finally:
            try:
                lease.release()
            except self._errors as e:
                log.warning("auto sessions: shared: releasing the prune lease: %s (it expires by itself)", _why(e))
        report["at"] = time.time()
        with self._lock:
            self.counters.last_prune = report
        log.info("auto sessions: shared: bucket prune %s %d of %d saves (%d superseded), %.2f GB",
                 "would remove" if dry_run else "removed", report["remove"] if dry_run else removed,
                 report["saves"], plan.superseded, (plan.freed if dry_run else freed) / 1e9)
        return report

    def _abort_abandoned(self, now: float) -> int:
        n = 0
        kw = {"Bucket": self.bucket, "Prefix": self.prefix + SESSIONS}
        while True:
            r = self._client.list_multipart_uploads(**kw)
            for u in r.get("Uploads", []):
                if parse_key(self.prefix, u["Key"], 0, 0) is None:
                    continue  # not a name autosessd owns
                if now - u["Initiated"].timestamp() > max(STALE_MULTIPART_S, self.cfg.grace_s):
                    self._client.abort_multipart_upload(Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])
                    n += 1
            if not r.get("IsTruncated"):
                return n
            kw["KeyMarker"], kw["UploadIdMarker"] = r.get("NextKeyMarker"), r.get("NextUploadIdMarker")

    # -- status --------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self._lock:
            c = self.counters
            retrying = sum(1 for j in self._jobs.values() if j.attempts)
            return {
                "endpoint": self.cfg.endpoint_url, "bucket": self.bucket, "prefix": self.prefix, "host": self.host,
                "uploads_pending": len(self._jobs) + (1 if self._running else 0), "uploads_retrying": retrying,
                "uploads_done": c.uploads_done, "uploads_superseded": c.uploads_superseded,
                "upload_failures": c.upload_failures, "last_upload_error": c.last_upload_error,
                "bytes_up": c.bytes_up,
                "downloads": c.downloads, "download_failures": c.download_failures,
                "downloads_skipped_slower": c.downloads_skipped_slower,
                "downloads_skipped_unreachable": c.downloads_skipped_unreachable,
                "downloads_kept_local": c.downloads_kept_local,
                "downloads_refused_layout": c.downloads_refused_layout, "last_download_error": c.last_download_error,
                "bytes_down": c.bytes_down, "download_ms_total": round(c.download_ms_total, 1),
                "last_download_ms": None if c.last_download_ms is None else round(c.last_download_ms, 1),
                "download_mb_s": None if self._down_rate is None else round(self._down_rate / 1e6, 1),
                "last_prune": c.last_prune,
            }


def _object_meta(md: dict[str, str]) -> dict[str, str]:
    """x-amz-meta-* as a GET returns them (lower-case names), the model name unquoted."""
    md = {k.lower(): v for k, v in md.items()}
    if "model" in md:
        md["model"] = unquote(md["model"])
    return md


def _why(e: BaseException) -> str:
    """A boto error in one line: the S3 error code and message, or the connection problem."""
    resp = getattr(e, "response", None)
    if isinstance(resp, dict) and resp.get("Error"):
        err = resp["Error"]
        code = err.get("Code") or resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        msg = err.get("Message") or ""
        return f"{code}{': ' + msg if msg and msg != 'None' else ''}"
    return str(e) or type(e).__name__
