"""What the shared tier's tests share: a config for the test gateway, a local save in the engine's
file layout, and looks into the bucket (its objects, unfinished multipart uploads, a broken object
as a broken peer leaves it)."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time

from autosessd.base.config import parse
from autosessd.shared import SharedStore, parse_key
from autosessd.store import slotfile
from autosessd.store.directory import Meta, Store


MODEL = "5ca1ab1e0ddba11a"
KEY = "0123456789abcdef"
NAME = f"auto-{KEY}.bin"


def shared_cfg(gw, bucket, **kw):
    kw = {"prefix": "team/", "read_timeout_s": 10, "connect_timeout_s": 2, "retry_max_s": 2, **kw}
    extra = "".join(f"{k} = {v!r}\n" if isinstance(v, str) else f"{k} = {str(v).lower()}\n" if isinstance(v, bool)
                    else f"{k} = {v}\n" for k, v in kw.items())
    return parse((f'slot_save_path = "/srv/x"\n[shared]\nendpoint_url = "{gw.endpoint}"\nbucket = "{bucket}"\n'
                  f'{extra}').encode(), "test.toml").shared


def save(store: Store, key: str, tokens, state: bytes, saved_at: float | None = None) -> Meta:
    """A finalized local save in the engine's file layout, as sessions/facade.py leaves it."""
    data = slotfile.build(tokens, state)
    store.temp_path(key).write_bytes(data)
    meta = Meta(key=key, n_tokens=len(tokens), bytes=len(data), saved_at=saved_at or time.time(), model=MODEL,
                save_ms=1.0)
    return store.finalize(key, meta)  # with the file's digest, as an upload sends it


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def objects(gw, bucket) -> dict[str, int]:
    c = gw.client()
    return {o["Key"]: o["Size"] for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])}


def in_bucket(gw, bucket: str, key: str, host: str, n_tokens: int) -> bool:
    """The bucket holds host's save of auto-<key>.bin with n_tokens at least (its objects read as
    autosessd reads them)."""
    saves = (parse_key("team/", k, size, 0.0) for k, size in objects(gw, bucket).items())
    return any(s is not None and s.name == f"auto-{key}.bin" and s.host == host and s.n_tokens >= n_tokens
               for s in saves)


def unfinished_uploads(gw, bucket) -> list[str]:
    return [u["Key"] for u in gw.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def populate(sh: SharedStore, store: Store, key: str, saved_at: float, size: int = 1000) -> Meta:
    meta = save(store, key, [1] * 10, b"s" * size, saved_at)
    assert sh.upload_now(store.bin_path(key), meta) == "done"
    return meta


def put_broken(gw, bucket, h1, meta, data: bytes, host: str = "host9", saved_at: float | None = None) -> str:
    """What a broken peer leaves in the bucket: a newer object for the conversation with the
    saving host's metadata as autosessd writes it (its own byte count and digest), but other
    bytes (a torn or damaged upload). Returns its key."""
    newer = dataclasses.replace(meta, saved_at=saved_at or meta.saved_at + 10)
    key = h1.object_key(newer, NAME).replace(f"-{h1.host}.bin", f"-{host}.bin")
    md = {"autosessd-format": "1", "key": meta.key, "model": MODEL, "n-tokens": str(meta.n_tokens),
          "saved-at": repr(newer.saved_at), "save-ms": "1.0", "bytes": str(meta.bytes), "host": host,
          "digest": meta.digest}
    gw.client().put_object(Bucket=bucket, Key=key, Body=data, Metadata=md)
    return key


def at_once(*calls, timeout_s: float = 60) -> list:
    """Runs each call in a thread of its own, all let go at one moment (a barrier), as two hosts
    racing for one object: their results in order. A call's exception is raised here."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i, call):
        barrier.wait()
        try:
            results[i] = call()
        except Exception as e:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), f"a call still running after {timeout_s} s"
    if errors:
        raise errors[0]
    return results
