"""SharedStore: the tier as the daemon wires it in — the client, its configuration, the
counters, the listing, status — composed with the uploads, the downloads and the bucket prune.

Each of those three is a mixin over the one state SharedStore.__init__ makes (the client, one
lock for every counter and queue, the upload queue, the download rate and backoff): they were
one class, they share that state, and tests replace parts of an instance (its _client, its
find) for all of them at once. Each mixin's docstring names what of it it uses.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..base.config import SharedConfig
from ..store import slotfile
from ..store.directory import Store
from .bucket import (SESSIONS, RemoteSession, SharedError, Unavailable, _http_date, _why, default_host, model_id,
                     parse_key, read_credentials, stem_of)
from .blockobjects import BlockObjects
from .downloads import Downloads
from .fetching import BlockFetching
from .lease import BucketPrune
from .uploads import Uploads, _Job

log = logging.getLogger("autosessd.shared")


@dataclass
class Counters:
    uploads_done: int = 0
    uploads_superseded: int = 0
    upload_failures: int = 0  # failed attempts (each is retried, but for those dropped)
    uploads_dropped: int = 0  # saves that could not be read to be sent (damaged): never retried
    bytes_up: int = 0
    manifests_up: int = 0  # saves sent as a manifest and the blocks the bucket lacked
    blocks_up: int = 0  # blocks sent
    blocks_skipped: int = 0  # blocks a manifest named that the bucket held already: not sent
    bytes_up_blocks: int = 0  # bytes those saves sent (blocks and manifests) ...
    bytes_whole_files: int = 0  # ... and what they would have sent as whole files
    blocks_fetched: int = 0  # blocks downloaded for a manifest ...
    bytes_fetched: int = 0
    blocks_held: int = 0  # ... and those its host held already (not downloaded)
    bytes_held: int = 0
    downloads: int = 0  # hits: a remote save brought into the session directory
    downloads_moved: int = 0  # of those, saves another host made: conversations that moved here
    bytes_down_moved: int = 0  # their bytes
    download_failures: int = 0
    downloads_skipped_slower: int = 0
    downloads_skipped_unreachable: int = 0  # the bucket was failing, or a download's backoff ran
    downloads_kept_local: int = 0  # the local file was as new: nothing downloaded
    downloads_refused_layout: int = 0  # a KV layout this engine cannot load: the local file stayed
    downloads_refused_bad: int = 0  # not the save its host made (size, digest, header): remembered, not retried
    bytes_down: int = 0
    download_ms_total: float = 0.0
    last_download_ms: float | None = None
    last_upload_error: str | None = None
    last_download_error: str | None = None
    last_prune: dict[str, Any] | None = None


class SharedStore(Uploads, Downloads, BlockFetching, BlockObjects, BucketPrune):
    """The interface the daemon wires in (see each module's docstring for what each part guarantees).

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
        self._store: Store | None = None  # the local store, once started: an upload may assemble a copy
        self._down_rate: float | None = None  # bytes/s, moving average of downloads (failed ones too)
        # After a failed download no other is tried until this time.monotonic() (doubling per
        # failure up to retry_max_s, reset by a success): a dead or crawling bucket costs one
        # turn its timeout, not every turn.
        self._down_backoff_until = 0.0
        self._down_backoff_s = 0.0
        self._blocked_said = False  # the skip is logged once per outage, not at every turn
        # Objects refused as not whole (downloads.BadObject): key → why. Under _lock.
        self.bad: dict[str, str] = {}
        # Blocks this host sent or saw in the bucket: key → Last-Modified (server clock); the
        # server's clock less this host's; manifests' block lists by object key. Under _lock.
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._clock_skew = 0.0
        self._manifests: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        # Observers of transfer progress (tests stop the gateway mid-transfer with it):
        # called with ("up" | "down", key, bytes so far) from the transferring thread.
        self.progress: Callable[[str, str, int], None] | None = None

    def check(self) -> str | None:
        """None when the bucket answers; otherwise why not (for a start-up log line)."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except self._errors as e:
            return f"bucket {self.bucket} at {self.cfg.endpoint_url}: {_why(e)}"
        return None

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
        """The current save of every conversation (newest first): what another host would restore.
        An object this host refused as not whole (bad) is passed over: the conversation's newest
        good save is its current one here."""
        best: dict[tuple[str, str], RemoteSession] = {}
        for s in self.versions(model):
            if self.is_bad(s.key):
                continue
            k = (s.model, s.name)
            if k not in best or (s.order, s.manifest) > (best[k].order, best[k].manifest):  # a twin: the manifest
                best[k] = s
        return sorted(best.values(), key=lambda s: s.order, reverse=True)

    def find(self, model: str, name: str | None = None) -> list[RemoteSession]:
        """Current saves for this model (one name, or all), newest first."""
        found = self.list(model)
        return [s for s in found if name is None or s.name == name]

    def unfinished(self) -> Iterator[tuple[RemoteSession, dict[str, Any]]]:
        """The unfinished multipart uploads under the prefix of names autosessd owns, every page:
        each as its key reads (the save, its host) with S3's entry (Key, UploadId, Initiated)."""
        kw = {"Bucket": self.bucket, "Prefix": self.prefix + SESSIONS}
        while True:
            r = self._client.list_multipart_uploads(**kw)
            for u in r.get("Uploads", []):
                s = parse_key(self.prefix, u["Key"], 0, 0.0)
                if s is not None:  # else not a name autosessd owns
                    yield s, u
            if not r.get("IsTruncated"):
                return
            kw["KeyMarker"], kw["UploadIdMarker"] = r.get("NextKeyMarker"), r.get("NextUploadIdMarker")

    def abort(self, upload: dict[str, Any]) -> None:
        """Abort one unfinished multipart upload (an entry of unfinished())."""
        self._client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])

    def newest(self, model: str, name: str, whole: bool = False) -> RemoteSession | None:
        """The current save of one name (one LIST of its own folder); whole: of its whole files."""
        saves = [s for s in self._list(model, stem_of(name))[0] if not (whole and s.manifest)]
        return max(saves, key=lambda s: s.order, default=None)

    def tokens(self, s: RemoteSession, max_tokens: int | None = None) -> tuple[int, ...]:
        """The token list the save holds, from its slot-file header: one ranged GET. Not cached
        here: remote.Remote's catalog keeps each save's tokens (encoded) and reads only new ones.
        max_tokens: a save claiming more (by its name or its header) is not read."""
        if max_tokens is not None and s.n_tokens > max_tokens:
            raise SharedError(f"{s.key}: its name says {s.n_tokens:,} tokens, more than the engine's context "
                              f"of {max_tokens:,}: not read")
        # The server's payload is -1, 1, n, the tokens, n_media (0 without media): n + 4 words.
        # Media chunks (rare) make it longer: then a second GET of the exact length.
        data = self._range(s.key, 0, min(s.bytes, 12 + 4 * (s.n_tokens + 4 + 256)))
        if len(data) >= 12:
            n_words = struct.unpack_from("<I", data, 8)[0]
            end = 12 + 4 * n_words
            bound = slotfile.max_words(max_tokens)
            if len(data) < end <= s.bytes and (bound is None or n_words <= bound):
                data = self._range(s.key, 0, end)
        try:
            return slotfile.parse_header(data, s.bytes, max_tokens).tokens
        except slotfile.BadSlotFile as e:
            raise SharedError(f"{s.key}: {e}") from None

    def _range(self, key: str, start: int, n: int) -> bytes:
        try:
            r = self._client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + n - 1}")
            return r["Body"].read()
        except self._errors as e:
            raise SharedError(f"reading the header of {key}: {_why(e)}") from e

    # -- status --------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self._lock:
            c = self.counters
            retrying = sum(1 for j in self._jobs.values() if j.attempts)
            return {
                "endpoint": self.cfg.endpoint_url, "bucket": self.bucket, "prefix": self.prefix, "host": self.host,
                "uploads_pending": len(self._jobs) + (1 if self._running else 0), "uploads_retrying": retrying,
                "uploads_done": c.uploads_done, "uploads_superseded": c.uploads_superseded,
                "upload_failures": c.upload_failures, "uploads_dropped": c.uploads_dropped,
                "last_upload_error": c.last_upload_error,
                "bytes_up": c.bytes_up,
                "manifests_up": c.manifests_up, "blocks_up": c.blocks_up, "blocks_skipped": c.blocks_skipped,
                "bytes_up_blocks": c.bytes_up_blocks, "bytes_whole_files": c.bytes_whole_files,
                "blocks_fetched": c.blocks_fetched, "bytes_fetched": c.bytes_fetched,
                "blocks_held": c.blocks_held, "bytes_held": c.bytes_held,
                "downloads": c.downloads, "downloads_moved": c.downloads_moved,
                "bytes_down_moved": c.bytes_down_moved, "download_failures": c.download_failures,
                "downloads_skipped_slower": c.downloads_skipped_slower,
                "downloads_skipped_unreachable": c.downloads_skipped_unreachable,
                "downloads_kept_local": c.downloads_kept_local,
                "downloads_refused_layout": c.downloads_refused_layout,
                "downloads_refused_bad": c.downloads_refused_bad, "bad_objects": len(self.bad),
                "last_download_error": c.last_download_error,
                "bytes_down": c.bytes_down, "download_ms_total": round(c.download_ms_total, 1),
                "last_download_ms": None if c.last_download_ms is None else round(c.last_download_ms, 1),
                "download_mb_s": None if self._down_rate is None else round(self._down_rate / 1e6, 1),
                "last_prune": c.last_prune,
            }
