"""The upload worker under faults of the local store (issue 46, 1): a queued upload whose save is
forgotten, pruned or damaged meanwhile, or a failure nobody foresaw, never ends the worker;
every upload after it still goes up, and the failure is counted and said. Against the real
Ceph RGW; the saves are kept as token blocks (kv_common's files, blocks of 4 tokens)."""

from __future__ import annotations

import time

import pytest

from autosessd.store import blocks
from autosessd.store.directory import Meta
from harness import wait_until
from kv_common import slot_file
from shared_common import MODEL, in_bucket

pytestmark = pytest.mark.s3

A, B, C = "a" * 16, "b" * 16, "c" * 16


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(blocks, "BLOCK_TOKENS", 4)


def save(store, key, first):
    tokens = list(range(first, first + 20))
    data = slot_file(tokens)
    store.temp_path(key).write_bytes(data)
    meta = store.finalize(key, Meta(key, len(tokens), len(data), time.time(), MODEL, 1.0))
    assert meta.in_blocks
    return meta


def queue(h, store, key, first):
    meta = save(store, key, first)
    h.upload_later(store.hot_path(key), meta)
    return meta


def test_a_queued_upload_whose_save_is_forgotten_or_damaged_never_stops_the_uploads(hosts, s3_gateway, s3_bucket):
    [(h, s)] = hosts(1)
    queue(h, s, A, 100)
    s.remove(A)  # forgotten (or pruned) while its upload waited
    queue(h, s, B, 200)
    s.hot_budget = 0  # no copy: an upload assembles the file from its blocks
    s.trim_hot()
    damaged = s.blocks.path(s.read_meta(B).blocks[2][0])
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    queue(h, s, C, 300)
    s.trim_hot()
    h.start(s)
    wait_until(lambda: in_bucket(s3_gateway, s3_bucket, C, "host1", 20) and h.pending() == 0, 60,
               what="the upload queued after the forgotten and the damaged ones")
    st = h.status()
    assert st["uploads_done"] == 1 and st.get("uploads_dropped") == 1 and st["upload_failures"] == 1
    assert f"auto-{B}.bin" in st["last_upload_error"] and "bytes changed" in st["last_upload_error"]
    assert not in_bucket(s3_gateway, s3_bucket, A, "host1", 1) and not in_bucket(s3_gateway, s3_bucket, B, "host1", 1)
    queue(h, s, A, 400)  # the worker still takes jobs
    wait_until(lambda: in_bucket(s3_gateway, s3_bucket, A, "host1", 20), 60, what="a later upload")
    assert h.drain(5) == 0


def test_an_error_nobody_foresaw_is_retried_and_the_worker_goes_on(hosts, s3_gateway, s3_bucket, monkeypatch):
    [(h, s)] = hosts(1)
    real = type(h)._upload
    failed = []

    def once(self, job):
        if not failed:
            failed.append(job.path.name)
            raise RuntimeError("a bug in the upload")
        return real(self, job)

    monkeypatch.setattr(type(h), "_upload", once)
    queue(h, s, A, 100)
    h.start(s)
    wait_until(lambda: in_bucket(s3_gateway, s3_bucket, A, "host1", 20) and h.pending() == 0, 60,
               what="the upload tried again")
    st = h.status()
    assert failed == [f"auto-{A}.bin"] and st["upload_failures"] == 1 and st["uploads_done"] == 1
    assert "RuntimeError: a bug in the upload" in st["last_upload_error"]
