"""`autosessctl forget` reaches the shared bucket: a forgotten conversation's saves leave it,
every host's, so that no host downloads it back; a queued upload of it is dropped and one going
up while it is forgotten is removed once it lands. Against the real Ceph RGW (what S3 does on a
DELETE and a LIST is what is relied on); the progress hook holds an upload mid-body, which the
gateway cannot do on cue."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from autosessd.sessions.remote import Remote
from harness import wait_until
from shared_common import MODEL, in_bucket, objects, populate, save

pytestmark = pytest.mark.s3

A, B = "a" * 16, "b" * 16


def saves_of(gw, bucket, key) -> list[str]:
    return [k for k in objects(gw, bucket) if f"/auto-{key}/" in k]


def test_forget_removes_every_hosts_saves_of_the_conversation_and_its_queued_upload(hosts, s3_gateway, s3_bucket):
    (h1, s1), (h2, s2) = hosts(2)
    populate(h1, s1, A, time.time() - 20)
    populate(h2, s2, A, time.time() - 10)  # the conversation moved to host2 and was saved there too
    populate(h1, s1, B, time.time() - 5)
    newer = save(s1, A, [1] * 12, b"t" * 1000)  # a newer save of A, queued (the worker is not started)
    h1.upload_later(s1.bin_path(A), newer)
    assert len(saves_of(s3_gateway, s3_bucket, A)) == 2 and h1.pending() == 1

    removed = h1.forget({f"auto-{A}.bin"})

    assert len(removed) == 2 and saves_of(s3_gateway, s3_bucket, A) == []
    assert in_bucket(s3_gateway, s3_bucket, B, "host1", 10)  # another conversation is untouched
    assert h1.pending() == 0  # the queued upload went with it: nothing brings it back
    h1.start(s1)
    time.sleep(0.5)
    assert h1.drain(5) == 0 and saves_of(s3_gateway, s3_bucket, A) == []


@pytest.mark.parametrize("size", [11 << 20, 200_000], ids=["in-parts", "one-put"])
def test_an_upload_going_up_when_its_conversation_is_forgotten_leaves_nothing(hosts, s3_gateway, s3_bucket, size):
    """In parts: forget aborts it (no object is ever complete). In one PUT: the hook runs as its
    body has gone; the object is removed by forget's look or once it lands, whichever comes
    second. Either way no object, no failure counted, and the upload is not tried again."""
    [(h, s)] = hosts(1, part_mb=5)
    meta = save(s, A, [1] * 10, b"s" * size)
    mid_body, forgotten = threading.Event(), threading.Event()

    def hold(direction, key, n):
        if direction == "up" and not forgotten.is_set():
            mid_body.set()
            forgotten.wait(30)  # a part went up; the upload stands still, its object not complete

    h.progress = hold
    h.start(s)
    h.upload_later(s.bin_path(A), meta)
    assert mid_body.wait(30)
    try:
        h.forget({f"auto-{A}.bin"})
    finally:
        forgotten.set()
    wait_until(lambda: h.pending() == 0, 30, what="the upload in flight to land")
    assert saves_of(s3_gateway, s3_bucket, A) == []
    assert h.status()["uploads_done"] == 0 and h.status()["upload_failures"] == 0
    h.drain(2)
    assert saves_of(s3_gateway, s3_bucket, A) == []


async def test_a_forgotten_conversation_leaves_the_catalog_and_an_older_save_landing_later_stays_out(
        hosts, s3_gateway, s3_bucket):
    """Another host's upload of the conversation from before the forget lands after it (its
    queue was slow): this host's catalog never takes it in, so no turn here downloads it back."""
    (h1, s1), (h2, s2) = hosts(2)
    populate(h1, s1, A, time.time() - 30)
    late = save(s2, A, [1] * 10, b"u" * 1000, time.time() - 20)
    remote = Remote(shared=h1, cfg=h1.cfg, model=MODEL)
    try:
        await asyncio.to_thread(remote.refresh)
        assert f"auto-{A}.bin" in remote.catalog.saves
        assert len(await remote.forget({f"auto-{A}.bin"})) == 1
        assert f"auto-{A}.bin" not in remote.catalog.saves
        assert h2.upload_now(s2.bin_path(A), late) == "done"  # saved before the forget, landing after
        await asyncio.to_thread(remote.refresh)
        assert f"auto-{A}.bin" not in remote.catalog.saves
        populate(h2, s2, A, time.time() + 1)  # a new save of it after the forget: a new conversation turn
        await asyncio.to_thread(remote.refresh)
        assert f"auto-{A}.bin" in remote.catalog.saves
    finally:
        await remote.close()
