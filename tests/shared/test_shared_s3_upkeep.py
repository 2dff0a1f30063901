"""The bucket's upkeep against the real S3 server (Ceph RADOS Gateway, scripts/s3-gateway): prune
by one host at a time under the prune lease, and integrity — a broken object is refused, remembered
and stops no other download (issue 19). Transfers between hosts are in test_shared_s3.py."""

from __future__ import annotations

import pytest

from autosessd.shared import Lease
from harness import wait_until
from shared_common import KEY, MODEL, NAME, at_once, objects, populate, put_broken, save

pytestmark = pytest.mark.s3


def test_bucket_prune_by_one_host_at_a_time_touches_only_what_autosessd_owns(hosts, s3_gateway, s3_bucket):
    (h1, s1), (h2, s2) = hosts(2, keep=3, grace_s=0)
    keys = [f"{i:016x}" for i in range(5)]
    for i, k in enumerate(keys):
        populate((h1, h2)[i % 2], (s1, s2)[i % 2], k, 1000.0 + i)
    superseded = h1.newest(MODEL, f"auto-{keys[4]}.bin").key
    populate(h2, s2, keys[4], 2000.0)  # h2's later save of h1's conversation
    c = s3_gateway.client()
    foreign = ["team/notes.txt", "team/sessions/readme", f"team/sessions/{MODEL}/auto-{keys[0]}/garbage.bin",
               f"sessions/{MODEL}/auto-{keys[0]}/{0:020d}-{10:010d}-host1.bin",  # the pattern outside the prefix
               "elsewhere/data.bin"]
    for k in foreign:
        c.put_object(Bucket=s3_bucket, Key=k, Body=b"not autosessd's")
    before = objects(s3_gateway, s3_bucket)

    reports = at_once(h1.prune_bucket, h2.prune_bucket)
    done = [r for r in reports if r["done"]]
    refused = [r for r in reports if not r["done"]]
    # Either both ran one after the other (the first released before the second looked), or
    # one ran and the other was refused by the lease; never two at once.
    assert len(done) >= 1 and all("lease is held by host" in r["why"] for r in refused)
    after = objects(s3_gateway, s3_bucket)
    assert all(k in after for k in foreign)
    kept = {h1.newest(MODEL, f"auto-{k}.bin") for k in keys}
    kept.discard(None)
    assert sorted(s.saved_at for s in kept) == [1002.0, 1003.0, 2000.0]
    gone = set(before) - set(after)
    assert superseded in gone and len(gone) == 3
    assert all(k.startswith(f"team/sessions/{MODEL}/") for k in gone)  # only names autosessd owns
    assert sum(r.get("removed", 0) for r in done) == 3  # two oldest conversations + one superseded save
    assert h1.status()["last_prune"] or h2.status()["last_prune"]


def test_the_prune_lease_is_exclusive_expires_and_is_released(hosts):
    (h1, _), (h2, _) = hosts(2, lease_s=10)
    for round_ in range(20):
        # Both race for it at once: the conditional PUT lets exactly one through.
        a, b = Lease(h1, "team/leases/prune.json", 10), Lease(h2, "team/leases/prune.json", 10)
        got_a, got_b = at_once(a.acquire, b.acquire, timeout_s=30)
        assert sorted(held for held, _ in (got_a, got_b)) == [False, True], (round_, got_a, got_b)
        (a if got_a[0] else b).release()
    # A holder that vanished without releasing: the lease is taken over once it has expired.
    gone = Lease(h1, "team/leases/prune.json", 10)
    assert gone.acquire()[0]
    other = Lease(h2, "team/leases/prune.json", 10)
    held, why = other.acquire()
    assert not held and "held by host1" in why
    wait_until(lambda: other.acquire()[0], 40, 0.5, "the expired lease to be taken over")
    assert not gone.renew()  # the old holder learns it lost the lease before acting again


# -- integrity (issue 19) -------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["one byte short", "one byte flipped"])
def test_a_broken_object_is_refused_remembered_and_does_not_stop_other_downloads(hosts, s3_gateway, s3_bucket,
                                                                                 damage):
    """19.1, 19.5, and a flipped byte in the bucket: a newer object of A that is one byte short
    (or has one byte changed) with its host's metadata. It used to be downloaded (checked only
    against the LIST's size and the header), kept and restored: the engine aborted, at every
    host, after every restart. Now: refused while it arrives, nothing under the name changes,
    its key is remembered (never fetched again), and no backoff stops the next good download."""
    from autosessd.shared import BadObject

    (h1, s1), (h2, s2) = hosts(2)
    meta = save(s1, KEY, list(range(2, 42)), b"kv state" * 300, saved_at=1000.0)
    assert h1.upload_now(s1.bin_path(KEY), meta) == "done"
    whole = s1.bin_path(KEY).read_bytes()
    broken = whole[:-1] if damage == "one byte short" else whole[:-5] + bytes([whole[-5] ^ 1]) + whole[-4:]
    bad_key = put_broken(s3_gateway, s3_bucket, h1, meta, broken)
    other = "fedcba9876543210"
    h1.upload_now(s1.bin_path(other), save(s1, other, list(range(100, 140)), b"other" * 300, saved_at=1000.0))
    newest = h2.newest(MODEL, NAME)
    assert newest.key == bad_key  # the broken one is the newest save of A
    with pytest.raises(BadObject, match="its host saved" if damage == "one byte short" else "digest"):
        h2.download(newest, s2)
    assert not s2.bin_path(KEY).exists() and not list(s2.path.glob(".autosessd-*"))
    assert h2.is_bad(bad_key) and h2.status()["downloads_refused_bad"] == 1
    est = h2.decide(newest, prefill_tokens_s=1.0)
    assert not est.worth and "refused before" in est.blocked  # never fetched again
    assert h2.download_blocked() is None  # the bucket is not taken for down: the next save comes at once
    [good] = h2.find(MODEL, f"auto-{other}.bin")
    h2.download(good, s2)
    assert s2.bin_path(other).read_bytes() == s1.bin_path(other).read_bytes()
    # The broken object passed over, A's current save here is its older, whole one.
    [older] = h2.find(MODEL, NAME)
    assert older.key != bad_key
    h2.download(older, s2)
    assert s2.bin_path(KEY).read_bytes() == whole and s2.read_meta(KEY).digest == meta.digest
