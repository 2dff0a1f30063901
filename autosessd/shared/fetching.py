"""A manifest's blocks one by one, for a download (downloads.download_manifest): one fetched
from the bucket, or one this host holds, streamed into the file the download writes (a
megabyte at a time) and checked against its digest once all of it came, before the file is
handed to anyone (a mixin of SharedStore, like the tier's other parts)."""

from __future__ import annotations

import logging
import time
from typing import Callable

from ..base import files
from ..store.blocks import HEADER
from ..store.directory import Store
from .blockobjects import Ref, check_digest, check_head
from .bucket import BadObject, LocalWrite, RemoteSession, SharedError, _why, block_object

log = logging.getLogger("autosessd.shared")

CHUNK = 1 << 20  # bytes of a block read and written at a time

Put = Callable[[int, bytes], None]  # (where in the block's payload, bytes): writes them in place


class BlockFetching:
    """SharedStore's block reads for a download (the state it uses is made in
    SharedStore.__init__: _client, bucket, prefix, _errors, _ClientError, counters under _lock,
    progress; _mark_bad is Downloads')."""

    def _stream_block(self, s: RemoteSession, r: Ref, deadline: float | None, put: Put) -> None:
        """Block `r` of manifest `s` from the bucket, its payload handed to put() as it arrives
        and checked once all of it came: a damaged one is remembered and refused (BadObject;
        what put() wrote of it the caller discards or writes again)."""
        self._in_time(s, deadline)
        obj = block_object(self.prefix, r.key)
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=obj)
            body = resp["Body"]
            try:
                if int(resp.get("ContentLength", -1)) != HEADER.size + r.payload:  # before reading it
                    why = (f"{int(resp.get('ContentLength', -1)):,} bytes, a block of {r.n_cells} cells has "
                           f"{HEADER.size + r.payload:,}")
                else:
                    why = self._pour(body.read, r, put, lambda: self._in_time(s, deadline), True)
            finally:
                body.close()
        except self._ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                raise BadObject(f"{s.key} names block {r.key}, which the bucket does not hold") from None
            raise SharedError(f"download of block {r.key}: {_why(e)}") from e
        except self._errors as e:
            raise SharedError(f"download of block {r.key}: {_why(e)}") from e
        if why is not None:
            self._mark_bad(obj, f"block {obj}: {why}")  # the manifest: counted by download()
            raise BadObject(f"{s.key} names block {r.key}, whose object is damaged: {why}")
        if self.progress:
            self.progress("down", obj, HEADER.size + r.payload)

    @staticmethod
    def _in_time(s: RemoteSession, deadline: float | None) -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise SharedError(f"download of {s.key}: past its time limit (download_timeout_s)")

    def _pour(self, read: Callable[[int], bytes], r: Ref, put: Put, between: Callable[[], None] | None,
              counted: bool) -> str | None:
        """Block `r` read by read(n): its header checked, its payload handed to put() a CHUNK
        at a time and hashed → None when its digest is its header's, else what is wrong.
        between() runs before each chunk; counted: the bytes are the bucket's (bytes_down)."""
        def count(n: int) -> None:
            if counted:
                with self._lock:
                    self.counters.bytes_down += n

        head = b""
        while len(head) < HEADER.size and (more := read(HEADER.size - len(head))):
            head += more
        count(len(head))
        try:
            want = check_head(head, r)
        except ValueError as e:
            return str(e)
        h, at = files.Hasher(), 0
        while at < r.payload:
            if between is not None:
                between()
            piece = read(min(CHUNK, r.payload - at))
            if not piece:
                return f"{HEADER.size + at:,} bytes, a block of {r.n_cells} cells has {HEADER.size + r.payload:,}"
            h.update(piece)
            try:
                put(at, piece)
            except OSError as e:
                raise LocalWrite(e) from e
            at += len(piece)
            count(len(piece))
        if read(1):
            return f"longer than a block of {r.n_cells} cells ({HEADER.size + r.payload:,} bytes)"
        try:
            check_digest(h.hexdigest(), want, r)
        except ValueError as e:
            return str(e)
        return None

    def _pour_held(self, store: Store, r: Ref, put: Put) -> bool:
        """Block `r` as this host holds it, handed to put() and checked against its own header
        (as _pour does) → False when it cannot be read or is damaged (said: the download
        fetches it instead, and a restore that reads it here sets it aside)."""
        try:
            f, _ = files.open_regular(store.blocks.path(r.key))
            with f:
                why = self._pour(f.read, r, put, None, False)
        except OSError as e:
            why = e.strerror or str(e)
        if why is not None:
            log.warning("auto sessions: shared: block %s here: %s; fetched from the bucket instead", r.key, why)
            return False
        return True
