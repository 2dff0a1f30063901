"""The shared tier against a real S3 server (Ceph RADOS Gateway, scripts/s3-gateway), never a mock.

Two "hosts" are two SharedStore instances with their own session directories and host names,
pointed at one bucket, as two machines behind a load balancer would be.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time

import pytest

from autosessd.store import slotfile
from autosessd.engines.llama_server import LlamaServer
from autosessd.store.slotfile import encode
from autosessd.base.keys import conversation_key
from autosessd.sessions.remote import Remote
from autosessd.shared import AlreadyHere, SharedError, SharedStore, Unavailable
from autosessd.store.directory import Meta, temp_name
from harness import chat_body, long_text, wait_until
from shared_common import KEY, MODEL, NAME, at_once, objects, populate, save, sha, shared_cfg, unfinished_uploads

pytestmark = pytest.mark.s3


def test_round_trip_a_slot_file_to_another_host(hosts, s3_gateway, s3_bucket):
    (h1, s1), (h2, s2) = hosts(2)
    tokens = list(range(1000, 1300))
    meta = save(s1, KEY, tokens, os.urandom(50_000))
    assert h1.upload_now(s1.bin_path(KEY), meta) == "done"

    [found] = h2.find(MODEL)
    assert (found.name, found.n_tokens, found.host, found.bytes) == (NAME, 300, "host1", meta.bytes)
    assert abs(found.saved_at - meta.saved_at) < 1e-6 and found.conversation_key == KEY
    assert h2.tokens(found) == tuple(tokens)
    assert h2.find("another-model") == [] and h2.find(MODEL, "auto-ffffffffffffffff.bin") == []

    path = h2.download(found, s2)
    assert path == s2.bin_path(KEY) and sha(path) == sha(s1.bin_path(KEY))
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    # The session directory holds exactly what a local save leaves: the file and its metadata.
    assert sorted(p.name for p in s2.path.iterdir()) == [NAME, f"auto-{KEY}.json"]
    got = s2.read_meta(KEY)
    assert (got.n_tokens, got.bytes, got.model) == (300, meta.bytes, MODEL) and abs(got.saved_at - meta.saved_at) < 1e-6
    st1, st2 = h1.status(), h2.status()
    assert st1["bytes_up"] == meta.bytes and st2["bytes_down"] == meta.bytes and st2["downloads"] == 1
    assert st2["last_download_ms"] > 0 and st2["download_mb_s"] > 0
    # The object carries the save's metadata for people and tools.
    md = s3_gateway.client().head_object(Bucket=s3_bucket, Key=found.key)["Metadata"]
    assert md["key"] == KEY and md["n-tokens"] == "300" and md["host"] == "host1" and md["autosessd-format"] == "1"


def test_upload_later_is_queued_and_only_the_newest_save_of_a_name_goes(hosts, s3_gateway, s3_bucket):
    [(h1, s1)] = hosts(1)
    older = save(s1, KEY, [1] * 50, b"old" * 100, saved_at=1000.0)
    h1.upload_later(s1.bin_path(KEY), older)
    newer = save(s1, KEY, [2] * 60, b"new" * 100, saved_at=2000.0)
    h1.upload_later(s1.bin_path(KEY), newer)
    assert h1.status()["uploads_pending"] == 1  # the worker has not started: nothing was sent yet
    assert objects(s3_gateway, s3_bucket) == {}
    h1.start()
    wait_until(lambda: h1.status()["uploads_done"] == 1 and h1.pending() == 0, 30, what="the upload")
    [only] = h1.list()
    assert only.n_tokens == 60 and only.saved_at == 2000.0
    assert list(objects(s3_gateway, s3_bucket)) == [only.key]


def test_a_big_file_goes_up_in_parts_and_comes_back_whole(hosts, s3_gateway, s3_bucket):
    (h1, s1), (h2, s2) = hosts(2, part_mb=5)
    meta = save(s1, KEY, list(range(2000)), os.urandom(23 * 1024 * 1024))
    assert h1.upload_now(s1.bin_path(KEY), meta) == "done"
    [found] = h2.find(MODEL)
    etag = s3_gateway.client().head_object(Bucket=s3_bucket, Key=found.key)["ETag"]
    assert etag.strip('"').endswith("-5"), etag  # a multipart object's ETag counts its parts
    assert sha(h2.download(found, s2)) == sha(s1.bin_path(KEY))
    assert unfinished_uploads(s3_gateway, s3_bucket) == []


def test_a_save_replacing_the_file_mid_upload_never_mixes_into_the_object(hosts, s3_gateway, s3_bucket):
    """The next save of a conversation renames a new file over the one being uploaded: the
    upload goes on with the inode it opened, then the newer save follows."""
    [(h1, s1)] = hosts(1, part_mb=5)
    first = save(s1, KEY, [1] * 100, b"A" * (60 * 1024 * 1024), saved_at=1000.0)
    first_bytes = s1.bin_path(KEY).read_bytes()
    replaced = threading.Event()

    def on_progress(direction, key, n):
        if not replaced.is_set():
            replaced.set()
            h1.upload_later(s1.bin_path(KEY), save(s1, KEY, [2] * 100, b"B" * (60 * 1024 * 1024), saved_at=2000.0))

    h1.progress = on_progress
    assert h1.upload_now(s1.bin_path(KEY), first) == "done" and replaced.is_set()
    [older] = h1.versions()
    body = s3_gateway.client().get_object(Bucket=s3_bucket, Key=older.key)["Body"].read()
    assert body == first_bytes  # wholly the first save: not one part of the second
    h1.progress = None
    h1.start()
    wait_until(lambda: h1.status()["uploads_done"] == 1, 60, what="the newer save's upload")
    [current] = h1.list()
    assert current.saved_at == 2000.0
    body = s3_gateway.client().get_object(Bucket=s3_bucket, Key=current.key)["Body"].read()
    assert body == s1.bin_path(KEY).read_bytes() and body != first_bytes


def test_gateway_down_mid_upload_leaves_nothing_torn_and_the_upload_resumes(hosts, s3_gateway, s3_bucket):
    [(h1, s1)] = hosts(1, part_mb=5)
    meta = save(s1, KEY, list(range(500)), os.urandom(40 * 1024 * 1024))
    before = sha(s1.bin_path(KEY))
    cut = threading.Event()

    def on_progress(direction, key, n):
        if direction == "up" and not cut.is_set():
            cut.set()
            s3_gateway.down()  # the first part is on its way: the gateway dies under it

    h1.progress = on_progress
    h1.start()
    h1.upload_later(s1.bin_path(KEY), meta)
    wait_until(lambda: h1.status()["upload_failures"] >= 1, 60, what="the upload to fail")
    st = h1.status()
    assert st["uploads_retrying"] == 1 and st["uploads_done"] == 0 and "upload of" in st["last_upload_error"]
    assert sha(s1.bin_path(KEY)) == before and s1.read_meta(KEY) == meta  # the local save is untouched
    s3_gateway.up()
    # Nothing torn became visible: the bucket holds no object until the whole save has arrived.
    assert all(size == meta.bytes for size in objects(s3_gateway, s3_bucket).values())
    wait_until(lambda: h1.status()["uploads_done"] == 1, 60, what="the upload to resume")
    [key] = objects(s3_gateway, s3_bucket)
    body = s3_gateway.client().get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    assert hashlib.sha256(body).hexdigest() == before
    # The cut multipart upload was aborted when the retry began: no hidden parts remain.
    assert unfinished_uploads(s3_gateway, s3_bucket) == []


def test_gateway_down_mid_download_fails_cleanly_and_keeps_the_local_file(hosts, s3_gateway, s3_bucket):
    (h1, s1), (h2, s2) = hosts(2)
    meta = save(s1, KEY, list(range(500)), os.urandom(40 * 1024 * 1024), saved_at=2000.0)
    h1.upload_now(s1.bin_path(KEY), meta)
    old = save(s2, KEY, [7] * 20, b"older local save", saved_at=1000.0)
    old_sha = sha(s2.bin_path(KEY))
    [found] = h2.find(MODEL)
    cut = threading.Event()

    def on_progress(direction, key, n):
        if direction == "down" and not cut.is_set():
            cut.set()
            s3_gateway.down()

    h2.progress = on_progress
    try:
        with pytest.raises(SharedError, match="download of"):
            h2.download(found, s2)
    finally:
        s3_gateway.up()
    # Nothing torn locally: the older file and its metadata as they were, no temporary left.
    assert sorted(p.name for p in s2.path.iterdir()) == [NAME, f"auto-{KEY}.json"]
    assert sha(s2.bin_path(KEY)) == old_sha and s2.read_meta(KEY) == old
    assert h2.status()["download_failures"] == 1 and h2.status()["downloads"] == 0
    h2.progress = None
    h2.download(found, s2)
    assert sha(s2.bin_path(KEY)) == sha(s1.bin_path(KEY)) and s2.read_meta(KEY).saved_at == 2000.0


def test_a_download_never_replaces_a_file_in_use_or_a_newer_local_save(hosts):
    (h1, s1), (h2, s2) = hosts(2)
    h1.upload_now(s1.bin_path(KEY), save(s1, KEY, [1] * 30, b"remote", saved_at=2000.0))
    [found] = h2.find(MODEL)
    mine = save(s2, KEY, [2] * 30, b"local, older", saved_at=1000.0)
    local_sha = sha(s2.bin_path(KEY))
    with s2.using(NAME):  # the engine is restoring it, or a save is writing it
        with pytest.raises(SharedError, match="being written or read"):
            h2.download(found, s2)
    assert sha(s2.bin_path(KEY)) == local_sha and s2.read_meta(KEY) == mine
    with s2.using(NAME), s2.using(NAME):  # the caller's claim, and someone else's
        with pytest.raises(SharedError, match="being written or read"):
            h2.download(found, s2, claimed=True)
    assert sha(s2.bin_path(KEY)) == local_sha
    with s2.using(NAME):  # only the caller's claim, held on through the restore that follows
        h2.download(found, s2, claimed=True)
        assert NAME in s2.in_use
    assert s2.read_meta(KEY).saved_at == 2000.0 and s2.bin_path(KEY).read_bytes().endswith(b"remote")
    newest = save(s2, KEY, [3] * 30, b"local, newest", saved_at=3000.0)
    with pytest.raises(AlreadyHere):
        h2.download(found, s2)
    assert s2.read_meta(KEY) == newest and h2.status()["downloads_kept_local"] == 1


@pytest.mark.parametrize("meta_fields", [
    {"line": "fedcba9876543210", "n_prompt": 30, "layout": "s1-v0-l18-k1"},  # a branch of another line
    {"prefix": True, "n_prompt": 40, "layout": "s1"},  # a shared prefix
    {},  # what older metadata had: none of them
])
def test_a_download_carries_what_the_turn_reads_of_a_save(hosts, meta_fields):
    """The turn on the other host tells from the metadata whether a file is the conversation's
    own (line, n_prompt), a shared prefix, and whether its engine can load it (layout)."""
    (h1, s1), (h2, s2) = hosts(2)
    data = slotfile.build([1] * 40, b"x" * 1000)
    s1.temp_path(KEY).write_bytes(data)
    meta = Meta(key=KEY, n_tokens=40, bytes=len(data), saved_at=time.time(), model=MODEL, save_ms=2.5, **meta_fields)
    meta = s1.finalize(KEY, meta)
    assert h1.upload_now(s1.bin_path(KEY), meta) == "done"
    [found] = h2.find(MODEL)
    h2.download(found, s2)
    got = s2.read_meta(KEY)
    assert abs(got.saved_at - meta.saved_at) < 1e-6 and got.digest == meta.digest
    # ... and the host it came from (a restart does not upload it as this host's own). The
    # identity is each directory's own (the download's is checked as it arrived), and so is
    # `whole`, why the saving host's store kept it uncut (this host's own import decides).
    assert dataclasses.replace(got, saved_at=meta.saved_at) == dataclasses.replace(meta, host="host1", ident=None,
                                                                                  whole=None)


def test_a_download_past_its_time_limit_stops_and_leaves_nothing(hosts):
    (h1, s1), (h2, s2) = hosts(2)
    meta = save(s1, KEY, list(range(100)), os.urandom(3 * 1024 * 1024))
    h1.upload_now(s1.bin_path(KEY), meta)
    [found] = h2.find(MODEL)
    with pytest.raises(SharedError, match="past its time limit"):
        h2.download(found, s2, deadline=time.monotonic() - 1)
    assert list(s2.path.iterdir()) == [] and h2.status()["download_failures"] == 1
    h2.download(found, s2, deadline=time.monotonic() + 60)
    assert sha(s2.bin_path(KEY)) == sha(s1.bin_path(KEY))


def test_a_stop_gives_queued_uploads_a_try_and_does_not_wait_on_a_bucket_that_is_down(hosts, s3_gateway, s3_bucket):
    """drain(): what the daemon's stop calls after its last save. A large timeout: the drain
    must end by itself once every upload left has failed again (pytest's timeout guards it)."""
    [(h1, s1)] = hosts(1, retry_max_s=3600)
    h1.start()
    first = save(s1, KEY, [1] * 10, b"first" * 100)
    h1.upload_later(s1.bin_path(KEY), first)
    assert h1.drain(60) == 0 and len(objects(s3_gateway, s3_bucket)) == 1
    s3_gateway.down()
    try:
        other = "00000000000000aa"
        h1.upload_later(s1.bin_path(other), save(s1, other, [2] * 10, b"second" * 100))
        assert h1.drain(3600) == 1
        st = h1.status()
        assert st["uploads_retrying"] == 1 and st["upload_failures"] >= 1
    finally:
        s3_gateway.up()
    # Its next try is an hour away (retry_max_s); the drain at a stop tries it now.
    assert h1.drain(3600) == 0 and h1.status()["uploads_done"] == 2
    assert len(objects(s3_gateway, s3_bucket)) == 2


def test_the_catalog_reads_each_save_s_tokens_once_and_follows_newer_saves(hosts):
    (h1, s1), (h2, _) = hosts(2)
    base = list(range(1000, 1100))
    a, b = "00000000000000a1", "00000000000000b1"
    h1.upload_now(s1.bin_path(a), save(s1, a, base + [1] * 50, b"a" * 500, saved_at=1000.0))
    h1.upload_now(s1.bin_path(b), save(s1, b, base[:60] + [2] * 20, b"b" * 500, saved_at=1000.0))
    other = Meta(key=KEY, n_tokens=10, bytes=0, saved_at=1000.0, model="another-model", save_ms=1.0)
    data = slotfile.build(base, b"o" * 10)
    s1.temp_path(KEY).write_bytes(data)
    s1.finalize(KEY, other := dataclasses.replace(other, n_tokens=len(base), bytes=len(data)))
    h1.upload_now(s1.bin_path(KEY), other)
    remote = Remote(h2, h2.cfg, MODEL)
    try:
        cat = remote.refresh()
        assert sorted(cat.saves) == [f"auto-{a}.bin", f"auto-{b}.bin"]  # this model's only
        q = encode(base + [1] * 50 + [7])
        hit, n = remote.best(q, 1)
        assert (hit.name, n) == (f"auto-{a}.bin", 150)
        read = []
        real = h2.tokens
        h2.tokens = lambda s: read.append(s.key) or real(s)
        try:
            assert remote.refresh().tokens == cat.tokens and read == []  # nothing read again
        finally:
            h2.tokens = real
        # Host 1 saves a again, departing earlier: the catalog follows the newer save.
        h1.upload_now(s1.bin_path(a), save(s1, a, base[:80] + [3] * 10, b"a2" * 500, saved_at=2000.0))
        remote.refresh()
        hit, n = remote.best(q, 1)
        assert (hit.name, hit.saved_at, n) == (f"auto-{a}.bin", 2000.0, 80)
        assert remote.status()["catalog"]["saves"] == 2 and remote.status()["catalog"]["list_ms"] > 0
    finally:
        remote.pool.shutdown()
        remote.downloads.shutdown()


def test_two_hosts_saving_one_key_48_times_the_object_is_always_one_whole_save(hosts, s3_gateway, s3_bucket,
                                                                                tmp_path):
    (h1, s1), (h2, s2), (reader, s3) = hosts(3)
    t0 = time.time()
    for i in range(48):  # each of the four orders (i % 4) twelve times
        # Which host saved later changes from round to round; in odd rounds the older save is
        # sent last, after the newer one has fully arrived (arrival order must not decide).
        newer_host = i % 4 < 2
        metas = {}
        for h, (sh, st) in enumerate(((h1, s1), (h2, s2))):
            saved_at = t0 + i + (0.5 if (h == 0) == newer_host else 0.25)
            toks = [h * 100_000 + i * 10 + j for j in range(40)]
            metas[h] = save(st, KEY, toks, hashlib.sha256(f"{h}-{i}".encode()).digest() * 200, saved_at)
        want = 0 if newer_host else 1
        if i % 2:
            older = 1 - want
            for h in (want, older):
                sh, st = ((h1, s1), (h2, s2))[h]
                sh.upload_now(st.bin_path(KEY), metas[h])
        else:
            at_once(lambda: h1.upload_now(s1.bin_path(KEY), metas[0]),
                    lambda: h2.upload_now(s2.bin_path(KEY), metas[1]))
        current = reader.newest(MODEL, NAME)
        assert current.host == f"host{want + 1}" and abs(current.saved_at - metas[want].saved_at) < 1e-6, i
        got = reader.download(current, s3)
        assert got.read_bytes() == (s1, s2)[want].bin_path(KEY).read_bytes(), f"round {i}: not one whole save"
        assert reader.tokens(current) == tuple(want * 100_000 + i * 10 + j for j in range(40))
    # Every object in the bucket is one whole save of one host (never a mixture).
    sizes = set(objects(s3_gateway, s3_bucket).values())
    assert sizes == {len(slotfile.build([0] * 40, b"x" * 32 * 200))}


def test_start_queues_local_saves_the_bucket_lacks(hosts):
    (h1, s1), (h2, s2) = hosts(2)
    populate(h1, s1, KEY, 1000.0)
    save(s1, "00000000000000aa", [5] * 10, b"never uploaded", 1500.0)
    newer = save(s1, KEY, [6] * 10, b"saved again while the tier was down", 1600.0)
    h1.start(s1, MODEL)
    wait_until(lambda: h1.status()["uploads_done"] == 2 and h1.pending() == 0, 30, what="the queued uploads")
    assert {(s.name, s.saved_at) for s in h2.list(MODEL)} == {(NAME, newer.saved_at),
                                                              ("auto-00000000000000aa.bin", 1500.0)}


def test_credentials_from_a_file_and_a_clear_error_without_them(s3_gateway, s3_bucket, tmp_path, monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    # No ~/.aws files either: what is left is only what the config names.
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(Unavailable, match="no S3 credentials: set AWS_ACCESS_KEY_ID"):
        SharedStore(shared_cfg(s3_gateway, s3_bucket))
    f = tmp_path / "creds"
    f.write_text(f"[default]\naws_access_key_id = {s3_gateway.env['AWS_ACCESS_KEY_ID']}\n"
                 f"aws_secret_access_key = {s3_gateway.env['AWS_SECRET_ACCESS_KEY']}\n")
    f.chmod(0o600)
    sh = SharedStore(shared_cfg(s3_gateway, s3_bucket, credentials_file=str(f)))
    assert sh.check() is None and sh.list() == []
    f.chmod(0o640)
    with pytest.raises(Unavailable, match="readable by others"):
        SharedStore(shared_cfg(s3_gateway, s3_bucket, credentials_file=str(f)))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_gateway.env["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_gateway.env["AWS_SECRET_ACCESS_KEY"])
    why = SharedStore(shared_cfg(s3_gateway, "no-such-bucket-here")).check()
    assert "bucket no-such-bucket-here at http://127.0.0.1:" in why and "404" in why


@pytest.mark.engine
async def test_a_conversation_saved_on_one_host_continues_on_another(engines, hosts):
    """Host 1's engine saves conversation A; host 2's engine, with its own session directory,
    gets the file through the bucket, restores it and answers A's next request from it."""
    (h1, s1), (h2, s2) = hosts(2)
    e1, e2 = engines(s1.path), engines(s2.path)
    body = chat_body(long_text(70) + "\nHow many marbles are in box 5?")  # ~1,250 tokens
    key = conversation_key(body)
    first = e1.post("/v1/chat/completions", body)
    eng1, eng2 = LlamaServer(e1.url, timeout_s=30), LlamaServer(e2.url, timeout_s=30)
    try:
        model, model2 = (await eng1.info()).model, (await eng2.info()).model
    finally:
        await eng1.close()
        await eng2.close()
    assert model == model2  # the fingerprint names the weights, not the host or the path
    # The save as sessions/facade.py makes it: engine → temporary → verified → finalized → queued.
    r = e1.post("/slots/0?action=save", {"filename": temp_name(key)})
    s1.verify_temp(key, r["n_written"], slotfile.MAGIC_BYTES)
    meta = Meta(key=key, n_tokens=r["n_saved"], bytes=r["n_written"], saved_at=time.time(), model=model,
                save_ms=r["timings"]["save_ms"])
    s1.finalize(key, meta)
    h1.start()
    h1.upload_later(s1.bin_path(key), meta)
    wait_until(lambda: h1.status()["uploads_done"] == 1, 60, what="host 1's upload")

    [found] = h2.find(model2, f"auto-{key}.bin")
    assert found.n_tokens == meta.n_tokens and found.host == "host1"
    h2.download(found, s2)
    restored = e2.post("/slots/0?action=restore", {"filename": found.name})
    assert restored["n_restored"] == meta.n_tokens
    second = e2.post("/v1/chat/completions", body)
    assert second["timings"]["cache_n"] >= 0.9 * second["usage"]["prompt_tokens"]
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
