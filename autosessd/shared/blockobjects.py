"""Blocks and manifests in the bucket: a save the local store keeps as token blocks goes up as
the blocks the bucket lacks and then its manifest; a turn that restores such a save fetches
only the blocks this host lacks, checks each, and installs the manifest (bucket.py's layout).

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

Download (download_manifest, on a download thread). The manifest (one GET, a few KB per 1,000
tokens) is parsed and checked against its object's name (conversation, tokens, model), its KV
layout against this engine's. The blocks this host lacks are fetched, four at a time, each
checked before anything is written: its object's size, its header (magic, key, cells) and its
payload's digest against the header's; a block that fails is a BadObject (the manifest is not
fetched again, the turn re-reads). Each is then stored as a local block (BlockStore.put: a
block already there is kept; both are the same tokens' KV), the directories fsynced, and the
manifest installed under the conversation's name (Store.install), naming the blocks
as this host holds them. The blocks are pinned from before the first is looked at until the
manifest names them.

The bucket prune and forget take blocks by manifests (lease.py, uploads.forget): read_blocks()
gives a manifest's blocks (a manifest never changes: read once, kept by key).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from typing import Any, Iterator

from ..base import files
from ..store import slotfile
from ..store.blocks import HEADER, MAGIC_BLOCK, BlockStore, _digest_of, chain
from ..store.directory import InUse, Meta, NewerHere, Store
from ..store.kvfile import Shape
from ..store.names import AUTO_BIN
from ..store.staging import Refused
from .bucket import (FORMAT_BLOCKS, SESSIONS, AlreadyHere, BadObject, RemoteSession, SharedError, _http_date, _why,
                     block_object, model_id, parse_block_key, stem_of)

log = logging.getLogger("autosessd.shared")

BLOCKS_AT_ONCE = 4  # blocks sent or fetched at once (a block of the Llama-3-8B shape: 16 MiB)
SEEN_KEPT = 200_000  # blocks remembered as in the bucket (key → Last-Modified)
MANIFESTS_KEPT = 20_000  # manifests' block lists remembered (by object key: a manifest never changes)
MANIFEST_MAX = 64 << 20  # a manifest larger than this is not read (1M tokens take ~6 MB)


@dataclasses.dataclass(frozen=True)
class Ref:
    """One block a manifest names: its key, cells (0: the tail) and payload bytes."""

    key: str
    n_cells: int
    payload: int
    digest: str


def refs_of(meta: Meta) -> list[Ref]:
    """The blocks a manifest names, its tail last; ValueError when its shape is not one."""
    shape = Shape.from_json(meta.kv)
    out = [Ref(k, n, n * shape.cell_size(), d) for k, n, d in meta.blocks]
    if meta.tail:
        out.append(Ref(meta.tail[0], 0, meta.tail[1], meta.tail[2]))
    return out


def check_block(data: bytes | memoryview, ref: Ref) -> str:
    """A block file's bytes (header and payload) are a whole block `ref` names: → its payload's
    digest. ValueError saying what is wrong otherwise. The digest is the block's own header's:
    two hosts may hold other bytes for one key (the same tokens' KV computed twice), and
    either is right for it."""
    if len(data) != HEADER.size + ref.payload:
        raise ValueError(f"{len(data):,} bytes, a block of {ref.n_cells} cells has {HEADER.size + ref.payload:,}")
    magic, n, _cb, raw_key, raw_digest = HEADER.unpack_from(data)
    if magic != MAGIC_BLOCK or raw_key.hex() != ref.key or n != ref.n_cells:
        raise ValueError("its header is not that of the block its name says")
    h = files.Hasher()
    h.update(memoryview(data)[HEADER.size:])
    if h.hexdigest() != _digest_of(raw_digest):
        raise ValueError(f"its payload's digest is {h.hexdigest()}, its header says {_digest_of(raw_digest)}")
    return h.hexdigest()


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
        return _http_date(r.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")) or time.time()

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
    def upload_manifest(self, meta: Meta, name: str, store: Store, on_bytes) -> tuple[str, dict[str, int]]:
        """Send the blocks of `meta` (a local manifest, read again by the caller) the bucket lacks,
        then the manifest. → (its object key, what was done: blocks sent / skipped, bytes).
        SharedError for the bucket, Refused for a local block that cannot be sent."""
        key = self.manifest_key(meta, name)
        try:
            refs = refs_of(meta)
        except (ValueError, KeyError, TypeError) as e:
            raise Refused(f"{name}'s manifest: {e}") from None
        done = {"blocks_sent": 0, "blocks_skipped": 0, "block_bytes_sent": 0}
        with store.blocks.pinned([r.key for r in refs]):
            t0 = time.monotonic()
            self._ensure(refs, store.blocks, done, on_bytes)
            grace = self.cfg.grace_s
            if grace > 0 and time.monotonic() - t0 > grace / 4:
                with self._lock:  # slow: every block is looked at again before the manifest names it
                    for r in refs:
                        self._seen.pop(r.key, None)
                self._ensure(refs, store.blocks, {"blocks_sent": 0, "blocks_skipped": 0, "block_bytes_sent": 0},
                             on_bytes)
            body = dataclasses.replace(meta, host=self.host, ident=None).to_json()
            md = {"autosessd-format": FORMAT_BLOCKS, "key": meta.key, "n-tokens": str(meta.n_tokens),
                  "saved-at": repr(meta.saved_at), "bytes": str(meta.bytes), "host": self.host}
            try:
                self._client.put_object(Bucket=self.bucket, Key=key, Body=body, Metadata=md,
                                        ContentType="application/json")
            except self._errors as e:
                raise SharedError(f"upload of {name}'s manifest to {key}: {_why(e)}") from e
            on_bytes(len(body))
        with self._lock:
            self._manifests[key] = tuple(r.key for r in refs)
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
                h = None
            except self._errors as e:
                raise SharedError(f"looking for block {r.key} in the bucket: {_why(e)}") from e
            if h is not None and int(h.get("ContentLength", -1)) == HEADER.size + r.payload:
                server_now = self._server_now(h)
                modified = h["LastModified"].timestamp()
                self._clock_skew = server_now - time.time()
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
            on_bytes(len(data))
            self._saw(r.key, self._server_now(p))

        self._each(one, todo)

    def _each(self, fn, items: list) -> None:
        """fn over items, BLOCKS_AT_ONCE at a time; the first error raised after all have ended."""
        if not items:
            return
        with concurrent.futures.ThreadPoolExecutor(min(BLOCKS_AT_ONCE, len(items)),
                                                   thread_name_prefix="autosessd-blocks") as ex:
            futs = [ex.submit(fn, x) for x in items]
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
        try:
            check_block(data, r)
        except ValueError as e:
            raise Refused(f"block {r.key} here is damaged, its bytes changed: {e}") from None
        return data

    # -- manifests ---------------------------------------------------------------------
    def read_manifest(self, s: RemoteSession, max_tokens: int | None = None) -> Meta:
        """The manifest of save `s` (one GET), checked against its name: BadObject when it is not
        the save its name says, SharedError when it could not be read."""
        if max_tokens is not None and s.n_tokens > max_tokens:
            raise SharedError(f"{s.key}: its name says {s.n_tokens:,} tokens, more than the engine's context "
                              f"of {max_tokens:,}: not read")
        try:
            r = self._client.get_object(Bucket=self.bucket, Key=s.key)
            if int(r.get("ContentLength", 0)) > MANIFEST_MAX:
                r["Body"].close()
                raise BadObject(f"{s.key}: a manifest of {int(r['ContentLength']):,} bytes")
            data = r["Body"].read()
        except self._errors as e:
            raise SharedError(f"reading the manifest {s.key}: {_why(e)}") from e
        try:
            meta = Meta.from_json(data)
            refs = refs_of(meta)
        except (ValueError, KeyError, TypeError) as e:
            raise BadObject(f"{s.key}: not a manifest ({str(e)[:200]})") from None
        m = AUTO_BIN.match(s.name)
        why = None
        if not meta.in_blocks or m is None or meta.key != m.group(1):
            why = "names another conversation, or no blocks"
        elif meta.n_tokens != s.n_tokens or len(meta.tokens or b"") != 4 * meta.n_tokens:
            why = f"holds {len(meta.tokens or b'') // 4:,} tokens, its name says {s.n_tokens:,}"
        elif model_id(meta.model) != s.model or round(meta.saved_at * 1e6) != round(s.saved_at * 1e6):
            why = "its model or time is not its name's"
        elif sum(r.n_cells for r in refs) > meta.n_tokens:
            why = "its blocks hold more cells than its tokens"
        elif [r.key for r in refs if r.n_cells] != chain(meta.model, Shape.from_json(meta.kv), meta.tokens or b"",
                                                          meta.n_cells):
            # A block's key is the hash of every token up to its end: KV of other tokens is
            # never handed to the engine as this conversation's (nor blocks of another size).
            why = "its block keys are not those of its tokens"
        if why:
            raise BadObject(f"{s.key}: {why}")
        with self._lock:
            self._manifests[s.key] = tuple(r.key for r in refs)
            while len(self._manifests) > MANIFESTS_KEPT:
                self._manifests.popitem(last=False)
        return meta

    def read_blocks(self, key: str, size: int) -> tuple[str, ...] | None:
        """The blocks the manifest object `key` names (cached: a manifest never changes); None
        when it could not be read."""
        with self._lock:
            got = self._manifests.get(key)
        if got is not None:
            return got
        try:
            r = self._client.get_object(Bucket=self.bucket, Key=key)
            meta = Meta.from_json(r["Body"].read(MANIFEST_MAX + 1))
            keys = tuple(x.key for x in refs_of(meta))
        except (ValueError, KeyError, TypeError) as e:
            log.warning("auto sessions: shared: %s is not a manifest (%s)", key, str(e)[:200])
            return ()  # names nothing: it protects no block
        except self._errors as e:
            log.debug("auto sessions: shared: reading %s: %s", key, _why(e))
            return None
        with self._lock:
            self._manifests[key] = keys
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

    def remove_saves(self, stems: set[str]) -> tuple[list[str], list[str]]:
        """Every host's saves of these names removed from the bucket (forget), and the blocks only
        their manifests named (a block another manifest names stays; while a manifest cannot
        be read, none goes: the bucket prune takes them later). → (keys removed, blocks as
        "blocks/<key>"; what could not be removed, and why). SharedError: no listing."""
        removed, failed = [], []
        saves = self.versions()
        named_by = {s.key: self.read_blocks(s.key, s.bytes) for s in saves if s.manifest}  # before any goes
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
                removed += [f"blocks/{k}" for k in self.delete_blocks(only)]
            except self._errors as e:
                failed.append(f"{len(only)} block(s) of it: {_why(e)}")
        return removed, failed

    # -- download ------------------------------------------------------------------------
    def missing_bytes(self, s: RemoteSession, meta: Meta | None, store: Store) -> int:
        """Bytes a download of `s` would fetch: its blocks this host lacks (its size when the
        manifest is not known)."""
        if meta is None:
            return s.bytes
        try:
            return sum(HEADER.size + r.payload for r in refs_of(meta) if not store.blocks.path(r.key).exists())
        except (ValueError, KeyError, TypeError):
            return s.bytes

    def download_manifest(self, s: RemoteSession, store: Store, claimed: bool, deadline: float | None,
                          layout: slotfile.KVLayout | None) -> dict[str, int]:
        """Bring save `s` (a manifest) into the local store: the blocks this host lacks, then the
        manifest (the module docstring). → what was fetched. AlreadyHere, BadObject,
        Incompatible, SharedError as download() has them; nothing under the name changes on
        any of them (fetched blocks no manifest names go at the local prune's sweep)."""
        name, conv = s.name, s.conversation_key
        if conv is None or store.blocks is None:
            raise SharedError(f"{name}: a manifest is restored only into a block store of an auto name")
        if store.users(name) > (1 if claimed else 0):
            raise SharedError(f"{name} is being written or read here; a download does not replace it")
        local = store.read_meta(conv)
        if local is not None and local.saved_at >= s.saved_at:
            with self._lock:
                self.counters.downloads_kept_local += 1
            raise AlreadyHere(f"{name}: the local save is as new as {s.host}'s")
        meta = self.read_manifest(s)
        if meta.layout:
            self._check_layout(s, slotfile.KVLayout.from_fingerprint(meta.layout), layout, None)
        refs = refs_of(meta)
        got = {"blocks_fetched": 0, "bytes_fetched": 0, "blocks_held": 0, "bytes_held": 0}
        if not claimed:
            store.acquire(name)
        try:
            with store.blocks.pinned([r.key for r in refs]):
                need, seen = [], set()
                for r in refs:
                    have = store.blocks.info(r.key)
                    if have is not None and have[0] == r.n_cells:
                        got["blocks_held"] += 1
                        got["bytes_held"] += HEADER.size + r.payload
                    elif r.key not in seen:
                        seen.add(r.key)
                        need.append(r)

                def fetch(r: Ref) -> None:
                    if deadline is not None and time.monotonic() > deadline:
                        raise SharedError(f"download of {s.key}: past its time limit (download_timeout_s)")
                    obj = block_object(self.prefix, r.key)
                    try:
                        data = self._client.get_object(Bucket=self.bucket, Key=obj)["Body"].read()
                    except self._ClientError as e:
                        if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                            raise BadObject(f"{s.key} names block {r.key}, which the bucket does not hold") from None
                        raise SharedError(f"download of block {r.key}: {_why(e)}") from e
                    except self._errors as e:
                        raise SharedError(f"download of block {r.key}: {_why(e)}") from e
                    with self._lock:
                        self.counters.bytes_down += len(data)
                    try:
                        check_block(data, r)
                    except ValueError as e:
                        with self._lock:  # the manifest is remembered and counted by download()
                            self.bad[obj] = f"block {obj}: {e}"
                        raise BadObject(f"{s.key} names block {r.key}, whose object is damaged: {e}") from None
                    mv = memoryview(data)
                    _, cb = HEADER.unpack_from(data)[1:3]
                    store.blocks.put(r.key, r.n_cells, cb, [mv[HEADER.size:]])
                    with self._lock:
                        got["blocks_fetched"] += 1
                        got["bytes_fetched"] += len(data)
                    if self.progress:
                        self.progress("down", obj, len(data))

                try:
                    self._each(fetch, need)
                except OSError as e:
                    raise SharedError(f"download of {s.key}: storing its blocks here: {e.strerror or e}") from e
                store.blocks.sync([r.key for r in need])
                mine = []
                for r in refs:  # as this host holds them: a block here first keeps its own bytes
                    have = store.blocks.info(r.key)
                    if have is None or have[0] != r.n_cells:
                        raise SharedError(f"download of {s.key}: block {r.key} went missing here meanwhile")
                    mine.append(dataclasses.replace(r, digest=have[1]))
                blocks_ = tuple((r.key, r.n_cells, r.digest) for r in mine if r.n_cells)
                tail = next(((r.key, r.payload, r.digest) for r in mine if not r.n_cells), None)
                local_meta = dataclasses.replace(meta, host=s.host, ident=None, blocks=blocks_, tail=tail)
                try:
                    store.install(None, name, local_meta, claimed=True)
                except InUse:
                    raise SharedError(f"{name} was taken here during the download (a save or a restore); "
                                      f"it is not replaced") from None
                except NewerHere:
                    with self._lock:
                        self.counters.downloads_kept_local += 1
                    raise AlreadyHere(f"{name}: a local save as new as {s.host}'s finalized during the download") \
                        from None
        finally:
            if not claimed:
                store.release(name)
        return got
