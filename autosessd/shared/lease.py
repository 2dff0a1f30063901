"""The bucket prune, and the lease that lets one host at a time run it.

Bucket prune: separate from local prune (its own keep / max_gb), run by one host at a time
under a lease object taken with conditional writes (PUT If-None-Match: * to create it, PUT
If-Match: <etag> to take over an expired one, renew it, or release it). Expiry is judged on
the server's clock (the lease's Last-Modified against the response's Date), so hosts' clocks
do not matter. Seen with RGW 16.2: both conditions are honoured on PUT (412 otherwise), but
If-Match matches only the ETag without its quotes; the quoted form is tried second, for
servers that want it. A conditional DELETE is ignored by RGW 16.2, so a lease is released by
rewriting it as released, never deleted.

What goes is bucket.plan_bucket_prune's: superseded saves past grace_s, then the oldest current
ones beyond keep / max_gb (a block counted once, whatever names it); then bucket.plan_block_prune's:
the blocks no manifest left names and nobody wrote or refreshed for grace_s (no block goes while
a manifest that could not be read is there); multipart uploads abandoned for a day (their host
died mid-upload) are aborted. Manifests go before blocks: a prune stopped anywhere (kill -9)
leaves blocks no manifest names, never a manifest naming a missing block; and each block is
looked at again just before its removal (one written since stays). Only names autosessd owns
(bucket.py's layout) are ever touched.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any, Protocol

from .bucket import LEASE, SharedError, _http_date, _why, plan_block_prune, plan_bucket_prune


log = logging.getLogger("autosessd.shared")

# An unfinished multipart upload older than this is abandoned (its host died mid-upload);
# a live one of a 20 GB file over a slow link still finishes well within it.
STALE_MULTIPART_S = 24 * 3600


class Holder(Protocol):
    """What a lease uses of the bucket's client (tier.SharedStore, which prunes under it)."""

    _client: Any  # boto3's S3 client
    _ClientError: Any  # botocore's ClientError
    bucket: str
    host: str


class Lease:
    """The bucket prune's lease: one object, changed only by conditional PUTs (see the module
    docstring). held() is true from a successful acquire or renew until lease_s minus a margin
    later by this host's monotonic clock, so a holder stops acting before anyone may take over."""

    def __init__(self, shared: Holder, key: str, ttl_s: float):
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


class BucketPrune:
    """SharedStore's bucket prune (a mixin: it uses SharedStore's _client, bucket, prefix, cfg,
    _errors, counters under _lock, and its listings, _list and unfinished, and blockobjects'
    read_blocks, list_blocks and delete_blocks)."""

    def prune_bucket(self, dry_run: bool = False, keep: int | None = None, max_gb: float | None = None,
                     stop: threading.Event | None = None) -> dict:
        """Remove superseded saves past grace_s and the oldest current ones beyond keep / max_gb,
        holding the lease; abort abandoned multipart uploads under the prefix. Touches only
        names autosessd owns (the pattern in bucket.py's docstring). stop: set at the daemon's
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
            # The blocks each manifest names (read once per manifest: they never change), and
            # every block there is. A manifest that cannot be read now protects every block.
            named_by: dict[str, tuple[str, ...]] = {}
            unread = 0
            for i, s in enumerate(x for x in saves if x.manifest):
                if i % 200 == 199:  # reading many manifests for the first time takes a while
                    if stop is not None and stop.is_set():
                        raise SharedError("bucket prune: cut short by a stop")
                    if not lease.held() or not lease.renew():
                        raise SharedError("bucket prune: lost the lease (another host took it over)")
                got = self.read_blocks(s.key)
                if got is None:
                    unread += 1
                else:
                    named_by[s.key] = got
            listed, _ = self.list_blocks()
            plan = plan_bucket_prune(saves, keep, max_bytes, now, self.cfg.grace_s, named_by,
                                     {k: v[0] for k, v in listed.items()})
            # freed_bytes: the saves' own objects; the blocks they free come after, block_bytes_freed.
            report = {"done": True, "dry_run": dry_run, "saves": len(saves), "remove": len(plan.remove),
                      "superseded": plan.superseded, "freed_bytes": sum(s.bytes for s in plan.remove),
                      "blocks": len(listed)}
            gone: set[str] = set()
            if dry_run:
                gone = {s.key for s in plan.remove}
            else:
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
                    gone.update(s.key for s in batch if s.key not in failed)
                aborted = 0 if stop is not None and stop.is_set() else self._abort_abandoned(now)
                report.update(removed=removed, freed_bytes=freed, aborted_uploads=aborted)
            # Then the blocks no manifest left names, unwritten for grace_s (bucket.plan_block_prune).
            if unread:
                report["blocks_kept_why"] = f"{unread} manifest(s) could not be read: no block removed"
                doomed = []
            else:
                named = {b for k, keys in named_by.items() if k not in gone for b in keys}
                doomed = plan_block_prune(listed, named, now, self.cfg.grace_s)
            report["blocks_remove"] = len(doomed)
            report["block_bytes_freed"] = sum(listed[k][0] for k in doomed)
            if doomed and not dry_run:
                if stop is not None and stop.is_set():
                    raise SharedError("bucket prune: cut short by a stop")
                if not lease.held() or not lease.renew():
                    raise SharedError("bucket prune: lost the lease (another host took it over)")
                report["blocks_removed"] = len(self.delete_blocks(self.unchanged(doomed, listed)))
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
        log.info("auto sessions: shared: bucket prune %s %d of %d saves (%d superseded), %.2f GB; %d of %d blocks "
                 "(%.2f GB)", "would remove" if dry_run else "removed", report["remove"] if dry_run else removed,
                 report["saves"], plan.superseded, (report["freed_bytes"] if dry_run else freed) / 1e9,
                 report["blocks_remove"] if dry_run else report.get("blocks_removed", 0), report["blocks"],
                 report["block_bytes_freed"] / 1e9)
        return report

    def _abort_abandoned(self, now: float) -> int:
        n = 0
        for _, u in self.unfinished():
            if now - u["Initiated"].timestamp() > max(STALE_MULTIPART_S, self.cfg.grace_s):
                self.abort(u)
                n += 1
        return n
