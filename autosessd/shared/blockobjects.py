"""Blocks and manifests in the bucket: a save the local store keeps as token blocks goes up as
the blocks the bucket lacks and then its manifest; a turn that restores such a save fetches
only the blocks this host lacks, writes the engine's file from them and from those it holds,
and checks each (downloads.py, fetching.py; bucket.py has the layout).

Upload (upload_manifest, on the upload worker's thread). The local manifest is read again (a
newer save or a forget since the job was queued supersedes it) and its blocks are pinned in
the local store until the manifest is in the bucket. For every block it names: one this host
sent or saw there within grace_s / 2 (by the server's clock, `_seen`) is counted on as it is;
any other is asked for (HEAD): a missing one, or one of another size, is sent from the local
block file (its bytes checked against its own header's digest first: a damaged local block is
never sent), and one there but older than grace_s / 2 is refreshed in place (a copy onto
itself, no bytes over the link). Then the manifest, last. Should that take longer than
grace_s / 4 the look is made again before the manifest goes. Together with the bucket prune's
rule (bucket.plan_block_prune: a block goes only when no manifest listed names it and it is
older than grace_s), no manifest in the bucket names a block the prune removed, and a crash
anywhere leaves at most blocks no manifest names (the prune takes them after grace_s).

Download (downloads.download_manifest, on a download thread). The manifest (one GET, a few KB
per 1,000 tokens) is parsed and checked against its object's name (conversation, tokens, model),
its block keys against the chain of its tokens (_not_its), its KV layout against this engine's.
The blocks this host lacks are fetched, four at a time, and written at their places in the
engine's file (placing.Placer) as their bytes arrive, those it holds read in likewise; each is
checked (size and header first, the payload's digest once it all came: fetching.py), and the
file is installed whole (Store.install) only when every block passed, then kept as blocks after
its restore (Upkeep.keep_as_blocks). A block that fails is a BadObject (the manifest is not
fetched again, the turn re-reads).

The bucket prune (lease.py) and forget (remove_saves) take blocks by manifests: read_blocks()
gives a manifest's blocks (a manifest never changes: read once, kept by key).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from typing import Any, Iterator

from ..base import files
from ..store import blocks as local_blocks
from ..store import slotfile
from ..store.blocks import HEADER, MAGIC_BLOCK, BlockStore, _digest_of, chain, tail_key
from ..store.directory import Meta, StoreError
from ..store.kvfile import Shape
from ..store.names import AUTO_BIN
from ..store.staging import Refused
from .bucket import (FORMAT_BLOCKS, SESSIONS, BadObject, RemoteSession, SharedError, _http_date, _why,
                     block_object, model_id, parse_block_key, stem_of)

log = logging.getLogger("autosessd.shared")

BLOCKS_AT_ONCE = 4  # blocks sent or fetched at once (a block of the Llama-3-8B shape: 16 MiB)
SEEN_KEPT = 200_000  # blocks remembered as in the bucket (key → Last-Modified)
MANIFESTS_KEPT = 5_000  # manifests' block lists remembered (by object key: a manifest never changes)
MANIFEST_MAX = 64 << 20  # a manifest larger than this is not read (1M tokens take ~6 MB)


@dataclasses.dataclass(frozen=True)
class Ref:
    """One block a manifest names: its key, cells (0: the tail) and payload bytes."""

    key: str
    n_cells: int
    payload: int
    digest: str
    cell_bytes: int  # its header's (the shape's cell meta; 0 for the tail)


def refs_of(meta: Meta) -> list[Ref]:
    """The blocks a manifest names, its tail last; ValueError when its shape is not one."""
    shape = Shape.from_json(meta.kv)
    out = [Ref(k, n, n * shape.cell_size(), d, shape.cell_bytes) for k, n, d in meta.blocks]
    if meta.tail:
        out.append(Ref(meta.tail[0], 0, meta.tail[1], meta.tail[2], 0))
    return out


def block_sizes(meta: Meta) -> tuple[tuple[str, int], ...]:
    """(key, bytes of its object) of every block a manifest names: what a download of it may fetch."""
    return tuple((r.key, HEADER.size + r.payload) for r in refs_of(meta))


def check_head(data: bytes | memoryview, ref: Ref) -> str:
    """The header at `data`'s start is the block's `ref` names: → its payload's digest, or ValueError."""
    if len(data) < HEADER.size:
        raise ValueError(f"{len(data):,} bytes, shorter than a block's header")
    magic, n, cb, raw_key, raw_digest = HEADER.unpack_from(data)
    if magic != MAGIC_BLOCK or raw_key.hex() != ref.key or n != ref.n_cells or cb != ref.cell_bytes:
        raise ValueError("its header is not that of the block its name says")
    return _digest_of(raw_digest)


def check_digest(got: str, want: str, ref: Ref) -> str:
    """The payload's digest `got` is the one its header says (`want`), and a tail's the one its
    manifest says (a tail is keyed by its digest): → got. ValueError otherwise. The header's
    decides, not the manifest's: two hosts may hold other bytes for one key (the same tokens'
    KV computed twice), and either is right for it."""
    if got != want:
        raise ValueError(f"its payload's digest is {got}, its header says {want}")
    if not ref.n_cells and got != ref.digest:
        raise ValueError(f"a tail whose digest is {got}, its manifest says {ref.digest}")
    return got


def _not_its(meta: Meta, refs: list[Ref], s: RemoteSession) -> str | None:
    """Why manifest `meta` is not the save its object's name `s` says, or None. Its block keys
    are those of its own tokens (the chain: KV of other tokens is never handed to the engine as
    this conversation's), every block but the last whole, its tail under the key of its bytes."""
    m = AUTO_BIN.match(s.name)
    if meta.layout:
        slotfile.KVLayout.from_fingerprint(meta.layout)  # raises on one that is not a layout
    if not meta.in_blocks or m is None or meta.key != m.group(1):
        return "names another conversation, or no blocks"
    if meta.n_tokens != s.n_tokens or len(meta.tokens or b"") != 4 * meta.n_tokens:
        return f"holds {len(meta.tokens or b'') // 4:,} tokens, its name says {s.n_tokens:,}"
    if model_id(meta.model) != s.model or not math.isfinite(meta.saved_at) \
            or round(meta.saved_at * 1e6) != round(s.saved_at * 1e6):
        return "its model or time is not its name's"
    cells = [r.n_cells for r in refs if r.n_cells]
    if sum(cells) > meta.n_tokens or any(n != local_blocks.BLOCK_TOKENS for n in cells[:-1]) \
            or (cells and not 0 < cells[-1] <= local_blocks.BLOCK_TOKENS):
        return "its blocks are not whole blocks of its tokens"
    shape = Shape.from_json(meta.kv)
    if [r.key for r in refs if r.n_cells] != chain(meta.model, shape, meta.tokens or b"", meta.n_cells):
        return "its block keys are not those of its tokens"
    if meta.tail and meta.tail[0] != tail_key(meta.model, shape, meta.tail[2]):
        return "its tail's key is not that of its bytes"
    return None


class BlockObjects:
    """SharedStore's blocks and manifests (a mixin over the state SharedStore.__init__ makes:
    _client, bucket, prefix, cfg, host, _errors, counters under _lock, progress, _stopping,
    and _seen and _manifests below)."""

    # -- names -------------------------------------------------------------------------
    def manifest_key(self, meta: Meta, name: str) -> str:
        us = round(meta.saved_at * 1e6)
        return (f"{self.prefix}{SESSIONS}{model_id(meta.model)}/{stem_of(name)}/"
                f"{us:020d}-{meta.n_tokens:010d}-{self.host}.manifest")

    def _server_now(self, r: dict) -> float:
        """The server's clock in a response (or an error's response), learned as the skew too."""
        now = _http_date(r.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date"))
        if now is None:
            return time.time() + self._clock_skew
        self._clock_skew = now - time.time()
        return now

    def _saw(self, key: str, modified: float) -> None:
        with self._lock:
            self._seen[key] = modified
            self._seen.move_to_end(key)
            while len(self._seen) > SEEN_KEPT:
                self._seen.popitem(last=False)

    def forget_seen(self, keys) -> None:
        with self._lock:
            for k in keys:
                self._seen.pop(k, None)

    # -- upload ------------------------------------------------------------------------
    def upload_manifest(self, meta: Meta, name: str, blocks: BlockStore, on_bytes) -> tuple[str, dict[str, int]]:
        """Send the blocks of `meta` (a local manifest whose blocks the caller pinned as it read
        it) the bucket lacks, then the manifest. → (its object key, what was done: blocks sent /
        skipped, bytes). SharedError for the bucket, Refused for a local block that cannot be sent."""
        key = self.manifest_key(meta, name)
        try:
            refs = refs_of(meta)
        except (ValueError, KeyError, TypeError) as e:
            raise Refused(f"{name}'s manifest: {e}") from None
        done = {"blocks_sent": 0, "blocks_skipped": 0, "block_bytes_sent": 0}
        grace = self.cfg.grace_s
        for again in range(3):
            t0 = time.monotonic()
            got = {"blocks_sent": 0, "blocks_skipped": 0, "block_bytes_sent": 0}
            self._ensure(refs, blocks, got, on_bytes)
            for k, v in got.items():
                done[k] += v if not again or k != "blocks_skipped" else 0
            if grace <= 0 or time.monotonic() - t0 <= grace / 4:
                break
            self.forget_seen(r.key for r in refs)  # slow: every block looked at again, then the manifest
        else:
            raise SharedError(f"upload of {name}: looking at its {len(refs):,} blocks took over grace_s / 4 "
                              f"({grace / 4:.0f} s) three times; tried again later")
        body = dataclasses.replace(meta, host=self.host, ident=None).to_json()
        md = {"autosessd-format": FORMAT_BLOCKS, "key": meta.key, "n-tokens": str(meta.n_tokens),
              "saved-at": repr(meta.saved_at), "bytes": str(meta.bytes), "host": self.host}
        try:
            self._client.put_object(Bucket=self.bucket, Key=key, Body=body, Metadata=md,
                                    ContentType="application/json")
        except self._errors as e:
            raise SharedError(f"upload of {name}'s manifest to {key}: {_why(e)}") from e
        on_bytes(len(body))
        self._named_by(key, tuple(r.key for r in refs))
        return key, done

    def _ensure(self, refs: list[Ref], blocks: BlockStore, done: dict[str, int], on_bytes) -> None:
        """Every block of `refs` in the bucket, and counted on for grace_s / 2 from now."""
        grace = self.cfg.grace_s
        now = time.time() + self._clock_skew
        with self._lock:
            todo = [r for r in refs if not (grace > 0 and now - self._seen.get(r.key, -1e18) < grace / 2 - 5)]
        done["blocks_skipped"] += len(refs) - len(todo)
        seen: set[str] = set()
        todo = [r for r in todo if not (r.key in seen or seen.add(r.key))]

        def one(r: Ref) -> None:
            if self._stopping:
                raise SharedError("upload cut short by a stop")
            obj = block_object(self.prefix, r.key)
            try:
                h = self._client.head_object(Bucket=self.bucket, Key=obj)
            except self._ClientError as e:
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
                    raise SharedError(f"looking for block {r.key} in the bucket: {_why(e)}") from e
                self._server_now(e.response)
                h = None
            except self._errors as e:
                raise SharedError(f"looking for block {r.key} in the bucket: {_why(e)}") from e
            # A block this host found damaged there is sent again (its bytes replace the object).
            if h is not None and int(h.get("ContentLength", -1)) == HEADER.size + r.payload and not self.is_bad(obj):
                server_now = self._server_now(h)
                modified = h["LastModified"].timestamp()
                if grace > 0 and server_now - modified >= grace / 2:
                    try:  # refreshed in place: its Last-Modified is now, no bytes over the link
                        c = self._client.copy_object(Bucket=self.bucket, Key=obj, CopySource={
                            "Bucket": self.bucket, "Key": obj}, MetadataDirective="REPLACE",
                            Metadata={"autosessd-format": FORMAT_BLOCKS}, ContentType="application/octet-stream")
                        modified = c["CopyObjectResult"]["LastModified"].timestamp()
                    except self._errors as e:
                        raise SharedError(f"refreshing block {r.key} in the bucket: {_why(e)}") from e
                with self._lock:
                    done["blocks_skipped"] += 1
                self._saw(r.key, modified)
                return
            data = self._read_local(blocks, r)
            try:
                p = self._client.put_object(Bucket=self.bucket, Key=obj, Body=data,
                                            Metadata={"autosessd-format": FORMAT_BLOCKS},
                                            ContentType="application/octet-stream")
            except self._errors as e:
                raise SharedError(f"upload of block {r.key}: {_why(e)}") from e
            with self._lock:
                done["blocks_sent"] += 1
                done["block_bytes_sent"] += len(data)
                self.bad.pop(obj, None)
            on_bytes(len(data))
            self._saw(r.key, self._server_now(p))

        self._each(one, todo)

    def _each(self, fn, items: list) -> None:
        """fn over items, BLOCKS_AT_ONCE at a time; after the first error no other is begun, and
        it is raised (a BadObject first) once those under way have ended."""
        if not items:
            return
        failed = threading.Event()

        def guarded(x) -> None:
            if failed.is_set():
                return
            try:
                fn(x)
            except BaseException:
                failed.set()
                raise

        with concurrent.futures.ThreadPoolExecutor(min(BLOCKS_AT_ONCE, len(items)),
                                                   thread_name_prefix="autosessd-blocks") as ex:
            futs = [ex.submit(guarded, x) for x in items]
            errors = [f.exception() for f in futs]
        for e in errors:
            if isinstance(e, BadObject):
                raise e
        for e in errors:
            if e is not None:
                raise e

    @staticmethod
    def _read_local(blocks: BlockStore, r: Ref) -> bytes:
        try:
            f, _ = files.open_regular(blocks.path(r.key))
            with f:
                data = f.read()
        except FileNotFoundError:
            raise Refused(f"block {r.key} is missing here") from None
        except OSError as e:
            raise Refused(f"block {r.key}: {e.strerror or e}", bad=False) from None
        try:  # its size, header and digest: a damaged local block is never sent
            if len(data) != HEADER.size + r.payload:
                raise ValueError(f"{len(data):,} bytes, a block of {r.n_cells} cells has {HEADER.size + r.payload:,}")
            h = files.Hasher()
            h.update(memoryview(data)[HEADER.size:])
            check_digest(h.hexdigest(), check_head(data, r), r)
        except ValueError as e:
            raise Refused(f"block {r.key} here is damaged, its bytes changed: {e}") from None
        return data

    def _send_blocks(self, job: Any, meta: Meta, blocks: BlockStore) -> str:
        """uploads._upload_blocks's sending: the blocks the bucket lacks, the manifest, counted."""
        newest = self.newest(meta.model, job.path.name)
        mine = (round(meta.saved_at * 1e6), self.host)
        if newest is not None and newest.order >= mine:
            return ("done" if newest.order == mine else
                    f"superseded: {newest.host} saved it later ({newest.saved_at:.3f} > {meta.saved_at:.3f})")
        sent = 0

        def on_bytes(n: int) -> None:
            nonlocal sent
            with self._lock:
                sent += n
                self.counters.bytes_up += n
                so_far = sent
            if self.progress:
                self.progress("up", job.path.name, so_far)

        try:
            key, done = self.upload_manifest(meta, job.path.name, blocks, on_bytes)
        except Refused as e:
            if not e.bad:
                raise StoreError(str(e)) from None  # unreadable for now: tried again
            raise
        with self._lock:
            c = self.counters
            c.manifests_up += 1
            c.blocks_up += done["blocks_sent"]
            c.blocks_skipped += done["blocks_skipped"]
            c.bytes_up_blocks += sent
            c.bytes_whole_files += meta.bytes
            forgotten = job.forgotten
        log.info("auto sessions: shared: %s up as a manifest: %d block(s) sent, %d already in the bucket; %s of "
                 "the whole file's %s", job.path.name, done["blocks_sent"], done["blocks_skipped"],
                 f"{sent / 1e6:,.1f} MB", f"{meta.bytes / 1e6:,.1f} MB")
        if forgotten:  # forget() listed the bucket before this manifest was there
            try:
                self._client.delete_object(Bucket=self.bucket, Key=key)
            except self._errors as e:
                raise SharedError(f"{key}: forgotten while it went up, and not removed: {_why(e)}") from e
            return "superseded: forgotten while it went up (its manifest removed)"
        return "done"

    # -- manifests ---------------------------------------------------------------------
    def read_manifest(self, s: RemoteSession, max_tokens: int | None = None) -> Meta:
        """The manifest of save `s` (one GET), checked against its name: BadObject when it is not
        the save its name says, SharedError when it could not be read."""
        if max_tokens is not None and s.n_tokens > max_tokens:
            raise SharedError(f"{s.key}: its name says {s.n_tokens:,} tokens, more than the engine's context "
                              f"of {max_tokens:,}: not read")
        try:
            data = self._manifest_bytes(s.key)
        except self._errors as e:
            raise SharedError(f"reading the manifest {s.key}: {_why(e)}") from e
        except ValueError as e:
            raise BadObject(f"{s.key}: {e}") from None
        try:
            meta = Meta.from_json(data)
            refs = refs_of(meta)
            why = _not_its(meta, refs, s)
        except Exception as e:  # whatever the bytes are (JSON of another shape, NaN, huge numbers)
            raise BadObject(f"{s.key}: not a manifest ({type(e).__name__}: {str(e)[:200]})") from None
        if why:
            raise BadObject(f"{s.key}: {why}")
        self._named_by(s.key, tuple(r.key for r in refs))
        return meta

    def _manifest_bytes(self, key: str) -> bytes:
        """One GET of a manifest object; ValueError when it is larger than any manifest."""
        r = self._client.get_object(Bucket=self.bucket, Key=key)
        if int(r.get("ContentLength", 0)) > MANIFEST_MAX:
            r["Body"].close()
            raise ValueError(f"a manifest of {int(r['ContentLength']):,} bytes")
        return r["Body"].read()

    def _named_by(self, key: str, blocks: tuple[str, ...]) -> None:
        """Remember which blocks manifest object `key` names (the oldest forgotten past MANIFESTS_KEPT)."""
        with self._lock:
            self._manifests[key] = blocks
            self._manifests.move_to_end(key)
            while len(self._manifests) > MANIFESTS_KEPT:
                self._manifests.popitem(last=False)

    def read_blocks(self, key: str) -> tuple[str, ...] | None:
        """The blocks the manifest object `key` names (cached: a manifest never changes); None
        when it could not be read."""
        with self._lock:
            got = self._manifests.get(key)
        if got is not None:
            return got
        try:
            keys = tuple(x.key for x in refs_of(Meta.from_json(self._manifest_bytes(key))))
        except self._errors as e:
            log.debug("auto sessions: shared: reading %s: %s", key, _why(e))
            return None
        except Exception as e:  # not readable as a manifest (another version's?): it protects every block
            log.warning("auto sessions: shared: %s is not a manifest this version reads (%s: %s); no block is "
                        "removed while it is there", key, type(e).__name__, str(e)[:200])
            return None
        self._named_by(key, keys)
        return keys

    def list_blocks(self) -> tuple[dict[str, tuple[int, float]], float]:
        """Every block object under the prefix: key → (bytes, Last-Modified); and the server's clock."""
        out: dict[str, tuple[int, float]] = {}
        now = time.time()
        for o, now in self._objects(self.prefix + "blocks/"):
            k = parse_block_key(self.prefix, o["Key"])
            if k is not None:
                out[k] = (int(o["Size"]), o["LastModified"].timestamp())
        return out, now

    def _objects(self, where: str) -> Iterator[tuple[dict[str, Any], float]]:
        kw = {"Bucket": self.bucket, "Prefix": where}
        now = time.time()
        while True:
            try:
                r = self._client.list_objects_v2(**kw)
            except self._errors as e:
                raise SharedError(f"listing {where} in {self.bucket}: {_why(e)}") from e
            now = self._server_now(r)
            for o in r.get("Contents", []):
                yield o, now
            if not r.get("IsTruncated"):
                return
            kw["ContinuationToken"] = r["NextContinuationToken"]

    def delete_blocks(self, keys: list[str]) -> list[str]:
        """Remove block objects (1,000 a request); → the keys that went."""
        gone = []
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            r = self._client.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": block_object(self.prefix, k)} for k in batch], "Quiet": True})
            failed = {e["Key"] for e in r.get("Errors", [])}
            gone += [k for k in batch if block_object(self.prefix, k) not in failed]
        self.forget_seen(keys)
        return gone

    def unchanged(self, keys: list[str], listed: dict[str, tuple[int, float]]) -> list[str]:
        """Of blocks `keys`, those still as `listed` showed them (one HEAD each, just before a
        removal): a block refreshed or sent again since (an upload counting on it; a refresh
        comes grace_s / 2 after its last write or more) is not removed. One that does not
        answer is not removed now either."""
        out: list[str] = []

        def one(k: str) -> None:
            try:
                h = self._client.head_object(Bucket=self.bucket, Key=block_object(self.prefix, k))
            except self._errors:
                return
            if h["LastModified"].timestamp() - listed[k][1] < 1.0:  # HEAD has whole seconds, a LIST ms
                with self._lock:
                    out.append(k)

        self._each(one, keys)
        return sorted(out)

    def remove_saves(self, stems: set[str]) -> tuple[list[str], list[str]]:
        """Every host's saves of these names removed from the bucket (forget), and the blocks only
        their manifests named, unless written within grace_s (a block another manifest names
        stays; while a manifest cannot be read, none goes: the bucket prune takes them later).
        → (keys removed, blocks as "blocks/<key>"; what could not be removed, and why).
        SharedError: no listing."""
        removed, failed = [], []
        saves = self.versions()
        named_by = {s.key: self.read_blocks(s.key) for s in saves if s.manifest}  # before any goes
        for s in saves:
            if stem_of(s.name) not in stems:
                continue
            try:
                self._client.delete_object(Bucket=self.bucket, Key=s.key)
                removed.append(s.key)
            except self._errors as e:
                failed.append(f"{s.key}: {_why(e)}")
        mine: set[str] = set()
        others: set[str] = set()
        unread = False
        for key, got in named_by.items():
            unread = unread or (got is None and key not in removed)
            (mine if key in removed else others).update(got or ())
        only = sorted(mine - others)
        if only and not unread:
            try:
                # As the bucket prune: a block written or refreshed within grace_s may be one an
                # upload of another conversation counts on (its manifest not up yet): the prune
                # takes it after grace_s, when no manifest names it.
                listed, now = self.list_blocks()
                grace = self.cfg.grace_s
                old = [k for k in only if k in listed and (grace <= 0 or now - listed[k][1] >= grace)]
                removed += [f"blocks/{k}" for k in self.delete_blocks(self.unchanged(old, listed))]
                if len(old) < len(only):
                    log.info("auto sessions: shared: %d block(s) only the forgotten saves named were written within "
                             "grace_s: the bucket prune removes them after it", len(only) - len(old))
            except self._errors as e:
                failed.append(f"{len(only)} block(s) of it: {_why(e)}")
        return removed, failed
