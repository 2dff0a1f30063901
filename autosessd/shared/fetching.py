"""A manifest's blocks one by one, for a download (downloads.download_manifest): one fetched
from the bucket and checked before it is used, or one this host holds, read and checked (a
mixin of SharedStore, like the tier's other parts)."""

from __future__ import annotations

import logging
import time

from ..base import files
from ..store.blocks import HEADER
from ..store.directory import Store
from .blockobjects import Ref, check_block
from .bucket import BadObject, RemoteSession, SharedError, _why, block_object

log = logging.getLogger("autosessd.shared")


class BlockFetching:
    """SharedStore's block reads for a download (the state it uses is made in
    SharedStore.__init__: _client, bucket, prefix, _errors, _ClientError, counters under _lock,
    progress; _mark_bad is Downloads')."""

    def _fetch_block(self, s: RemoteSession, r: Ref, deadline: float | None) -> bytes:
        """Block `r` of manifest `s` from the bucket, checked (check_block); a damaged one is
        remembered and refused (BadObject)."""
        if deadline is not None and time.monotonic() > deadline:
            raise SharedError(f"download of {s.key}: past its time limit (download_timeout_s)")
        obj = block_object(self.prefix, r.key)
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=obj)
            if int(resp.get("ContentLength", -1)) != HEADER.size + r.payload:  # before reading it
                resp["Body"].close()
                data = b""
            else:
                data = resp["Body"].read()
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
            self._mark_bad(obj, f"block {obj}: {e}")  # the manifest: counted by download()
            raise BadObject(f"{s.key} names block {r.key}, whose object is damaged: {e}") from None
        if self.progress:
            self.progress("down", obj, len(data))
        return data

    @staticmethod
    def _held(store: Store, r: Ref) -> bytes | None:
        """Block `r` as this host holds it, checked against its own header (check_block); None
        when it cannot be read or is damaged (said: the download fetches it instead, and a
        restore that reads it here sets it aside)."""
        try:
            f, _ = files.open_regular(store.blocks.path(r.key))
            with f:
                data = f.read()
            check_block(data, r)
            return data
        except (OSError, ValueError) as e:
            log.warning("auto sessions: shared: block %s here: %s; fetched from the bucket instead", r.key,
                        getattr(e, "strerror", None) or e)
            return None
