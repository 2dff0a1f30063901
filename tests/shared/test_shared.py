"""The shared tier's pure parts: bucket names, the prune plan, the download estimate, credentials."""

import dataclasses
import os

import pytest

from autosessd.shared import (RemoteSession, SharedError, Unavailable, estimate, model_id, parse_key,
                              plan_bucket_prune, read_credentials, stem_of)
from autosessd.shared.bucket import block_object, parse_block_key, plan_block_prune

P = "team/"
KEY = "0123456789abcdef"


def obj(stem="auto-" + KEY, us=1_700_000_000_000_000, n=100, host="h1", model="m1"):
    return f"{P}sessions/{model}/{stem}/{us:020d}-{n:010d}-{host}.bin"


def rs(stem="auto-" + KEY, saved=100.0, host="h1", size=10, modified=None, model="m1", n=100):
    key = obj(stem, round(saved * 1e6), n, host, model)
    return RemoteSession(key=key, model=model, name=stem + ".bin", saved_at=saved, n_tokens=n, host=host,
                         bytes=size, modified=saved if modified is None else modified)


def test_an_owned_name_parses_to_what_find_needs():
    s = parse_key(P, obj(n=27174, host="gpu-2.lan"), 5, 9.0)
    assert (s.model, s.name, s.n_tokens, s.host, s.bytes, s.saved_at) == \
        ("m1", f"auto-{KEY}.bin", 27174, "gpu-2.lan", 5, 1_700_000_000.0)
    assert s.conversation_key == KEY
    assert parse_key(P, obj(stem="parked-1"), 5, 9.0).conversation_key is None


@pytest.mark.parametrize("key", [
    "team/notes.txt",
    "team/sessions/readme",
    "team/sessions/m1/auto-x/garbage.bin",
    f"team/sessions/m1/auto-{KEY}/1700-100-h1.bin",  # digits not padded: not written by autosessd
    f"team/sessions/m1/auto-{KEY}/{0:020d}-{1:010d}-h1.bin.partial",
    f"team/sessions/m1/../auto-{KEY}/{0:020d}-{1:010d}-h1.bin",
    f"sessions/m1/auto-{KEY}/{0:020d}-{1:010d}-h1.bin",  # the pattern, but outside the prefix
    f"other/team/sessions/m1/auto-{KEY}/{0:020d}-{1:010d}-h1.bin",
])
def test_names_autosessd_does_not_own_are_never_sessions(key):
    assert parse_key(P, key, 1, 1.0) is None


def test_model_and_file_names_never_make_paths():
    assert model_id("3f2a9c0d1e2b4a5c") == "3f2a9c0d1e2b4a5c"
    odd = model_id("/models/gemma 3/ä.gguf")
    assert odd.startswith("h-") and "/" not in odd and odd == model_id("/models/gemma 3/ä.gguf")
    assert stem_of(f"auto-{KEY}.bin") == f"auto-{KEY}" and stem_of("parked.v2.bin") == "parked.v2"
    for bad in ("../x.bin", "a/b.bin", ".hidden.bin", "x.json", "x"):
        with pytest.raises(SharedError):
            stem_of(bad)


def test_prune_keeps_the_newest_current_saves_and_drops_superseded_after_grace():
    a_old, a_new = rs("auto-a", 100.0, "h1"), rs("auto-a", 200.0, "h2", modified=200.0)
    b = rs("auto-b", 150.0)
    c = rs("auto-c", 50.0)
    plan = plan_bucket_prune([a_old, a_new, b, c], keep=2, max_bytes=10**9, now=200.0 + 60, grace_s=30)
    assert {s.key for s in plan.keep} == {a_new.key, b.key}
    assert {s.key for s in plan.remove} == {a_old.key, c.key} and plan.superseded == 1
    # Within the grace period a superseded save stays: another host may be downloading it.
    plan = plan_bucket_prune([a_old, a_new], keep=5, max_bytes=10**9, now=200.0 + 10, grace_s=30)
    assert plan.remove == [] and plan.superseded == 0


def test_prune_size_budget_and_newer_wins_by_name_not_arrival():
    # h1's save was made later but arrived earlier (modified earlier): it is still the current one.
    late_arrival = rs("auto-a", 100.0, "h2", size=4, modified=500.0)
    newer = rs("auto-a", 101.0, "h1", size=4, modified=400.0)
    plan = plan_bucket_prune([late_arrival, newer, rs("auto-b", 90.0, size=7)], keep=10, max_bytes=8,
                             now=1000.0, grace_s=0)
    assert [s.key for s in plan.keep] == [newer.key]
    assert {s.key for s in plan.remove} == {late_arrival.key, rs("auto-b", 90.0, size=7).key}


def manifest(stem, saved, host="h1", size=1, modified=None):
    s = rs(stem, saved, host, size, modified)
    return dataclasses.replace(s, key=s.key[:-4] + ".manifest", manifest=True)


def test_a_manifest_parses_as_a_save_and_blocks_by_their_key():
    k = obj(n=27174)[:-4] + ".manifest"
    s = parse_key(P, k, 5, 9.0)
    assert s.manifest and s.n_tokens == 27174 and s.host == "h1" and s.name == f"auto-{KEY}.bin"
    assert not parse_key(P, obj(), 5, 9.0).manifest
    assert parse_block_key(P, block_object(P, "ab" * 16)) == "ab" * 16
    for bad in (f"{P}blocks/{'ab' * 16}.blk.partial", f"{P}blocks/{'AB' * 16}.blk", f"{P}blocks/../x.blk",
                f"blocks/{'ab' * 16}.blk"):
        assert parse_block_key(P, bad) is None


def test_prune_counts_a_block_once_and_a_save_s_two_forms_as_one():
    a, b = manifest("auto-a", 200.0), manifest("auto-b", 100.0)
    a_whole = dataclasses.replace(rs("auto-a", 200.0, size=50))  # whole_files: the same save, whole
    blocks = {a.key: ("p1", "p2", "a1"), b.key: ("p1", "p2", "b1")}
    sizes = {"p1": 10, "p2": 10, "a1": 10, "b1": 10}
    # a costs 1 + 30 + 50 (its twin); b adds only its own block and manifest (1 + 10): both fit 92.
    plan = plan_bucket_prune([a, b, a_whole], keep=2, max_bytes=92, now=1000.0, grace_s=0,
                             blocks=blocks, block_bytes=sizes)
    assert plan.remove == [] and {s.key for s in plan.keep} == {a.key, a_whole.key, b.key}
    plan = plan_bucket_prune([a, b, a_whole], keep=1, max_bytes=10**9, now=1000.0, grace_s=0,
                             blocks=blocks, block_bytes=sizes)
    assert [s.key for s in plan.remove] == [b.key] and plan.freed == 1 + 10  # p1, p2 stay: a names them


def test_a_block_goes_only_unnamed_and_past_the_grace():
    listed = {"named": (10, 0.0), "young": (10, 950.0), "old": (10, 100.0)}
    assert plan_block_prune(listed, {"named"}, listed_at=1000.0, grace_s=600) == ["old"]
    assert plan_block_prune(listed, {"named"}, listed_at=1000.0, grace_s=0) == ["old", "young"]


def test_estimate_says_both_numbers_and_which_is_faster():
    e = estimate(1_000_000_000, 27_174, down_bytes_s=400e6, prefill_tokens_s=600, latency_s=0)
    assert e.worth and e.download_s == 2.5 and 45 < e.reread_s < 46
    line = e.line("auto-x.bin", 1_000_000_000, 27_174)
    assert "download ~2.5 s at 400 MB/s" in line and "re-reading 27,174 tokens ~45.3 s at 600 tokens/s" in line
    assert line.endswith("downloading")
    slow = estimate(1_000_000_000, 2_000, down_bytes_s=20e6, prefill_tokens_s=2_000)
    assert not slow.worth and slow.line("a.bin", 10**9, 2000).endswith("skipped, re-reading is faster")
    # Nothing measured yet: download (and so measure); it is never refused blind.
    assert estimate(10**9, 10, None, 600).worth and estimate(10**9, 10, 1e6, None).worth


def test_credentials_file(tmp_path):
    f = tmp_path / "creds"
    f.write_text("[default]\naws_access_key_id = AK1\naws_secret_access_key = s3cr3t\n")
    os.chmod(f, 0o600)
    assert read_credentials(str(f)) == {"aws_access_key_id": "AK1", "aws_secret_access_key": "s3cr3t"}
    os.chmod(f, 0o644)
    with pytest.raises(Unavailable, match="readable by others .*chmod 600"):
        read_credentials(str(f))
    f.write_text("[default]\naws_access_key_id = AK1\n")
    os.chmod(f, 0o600)
    with pytest.raises(Unavailable, match="lacks aws_secret_access_key"):
        read_credentials(str(f))
    with pytest.raises(Unavailable, match="No such file"):
        read_credentials(str(tmp_path / "missing"))


# -- SharedStore.download with a stub client ---------------------------------------------------
# What a download does with the bytes and the metadata a GET returns, and what it learns from a
# failure. The stub stands in for boto3's client (get_object only); the real calls run against
# a real S3 server in test_shared_s3.py.

import struct  # noqa: E402
import types  # noqa: E402

from autosessd import shared as shared_mod
from autosessd.shared import downloads as downloads_mod  # noqa: E402
from autosessd.base.config import parse  # noqa: E402
from autosessd.shared import SharedStore  # noqa: E402
from autosessd.store.directory import Store  # noqa: E402

SHARED_CFG = parse(b'slot_save_path = "/x"\n[shared]\nendpoint_url = "http://127.0.0.1:9"\nbucket = "b01"\n'
                   b'host = "here"\n', "t.toml").shared


def slot_bytes(n_tokens=5, n_stream=1, pad=4096):
    """A slot file as llama-server writes it: header, token payload, then the KV block's stream
    counts (an empty slot: no cells), padded."""
    toks = list(range(1, n_tokens + 1))
    words = [-1, 1, n_tokens, *toks, 0]
    head = struct.pack(f"<III{len(words)}i", 0x67677371, 4, len(words), *words)
    return head + struct.pack(f"<I{n_stream}I", n_stream, *[0] * n_stream) + b"\0" * pad


class _Body:
    def __init__(self, data, fail_after=None, on_read=None):
        self.data, self.fail_after, self.on_read, self.pos = data, fail_after, on_read, 0

    def read(self, n=-1):
        if self.on_read:
            self.on_read()
        if self.fail_after is not None and self.pos >= self.fail_after:
            raise OSError("Read timed out")
        n = len(self.data) - self.pos if n < 0 else n
        if self.fail_after is not None:
            n = min(n, self.fail_after - self.pos)
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out

    def close(self):
        pass


class _Client:
    """get_object of one object: its bytes and x-amz-meta-*; calls are recorded."""

    def __init__(self, data, metadata=None, fail_after=None, on_read=None):
        self.data, self.metadata, self.fail_after, self.on_read = data, metadata or {}, fail_after, on_read
        self.calls = []

    def get_object(self, **kw):
        self.calls.append(("get_object", kw))
        return {"Body": _Body(self.data, self.fail_after, self.on_read), "Metadata": dict(self.metadata)}

    def __getattr__(self, name):  # any other request is one a download must not make
        def call(**kw):
            self.calls.append((name, kw))
            raise AssertionError(f"unexpected {name}")
        return call


@pytest.fixture
def tier(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AK")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SK")
    sh = SharedStore(SHARED_CFG)
    (tmp_path / "s").mkdir()
    store = Store(tmp_path / "s")
    return sh, store


def remote_save(data, saved=100.0, host="there", key=KEY):
    n = slotfile_tokens(data)
    return RemoteSession(key=obj("auto-" + key, round(saved * 1e6), n, host), model="m1",
                         name=f"auto-{key}.bin", saved_at=saved, n_tokens=n, host=host, bytes=len(data),
                         modified=saved)


def slotfile_tokens(data):
    from autosessd.store.slotfile import parse_header
    return len(parse_header(data).tokens)


def test_a_failed_download_teaches_the_rate_and_pauses_downloads(tier, monkeypatch):
    sh, store = tier
    data = slot_bytes(pad=3 * 1024 * 1024)
    clock = [1000.0]
    # A stalled link: every read takes 30 s of the (fake) clock, the second one times out.
    monkeypatch.setattr(downloads_mod, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=__import__("time").time))
    sh._client = _Client(data, fail_after=shared_mod.CHUNK, on_read=lambda: clock.__setitem__(0, clock[0] + 30))
    s = remote_save(data)
    with pytest.raises(SharedError):
        sh.download(s, store)
    assert not (store.path / s.name).exists()
    # 1 MiB over 60 s: about 17 kB/s, learned from the failure; not "unknown, so download".
    assert sh.download_bytes_per_s is not None and sh.download_bytes_per_s < 20e3
    # Right after it, no download is tried at all, whatever the estimate; said and counted.
    est = sh.decide(s, prefill_tokens_s=1.0)
    assert not est.worth and "failed" in est.blocked
    assert sh.status()["downloads_skipped_unreachable"] == 1
    # After the backoff the learned rate decides: re-reading 5 tokens at 1,000 tokens/s wins.
    clock[0] += 3600
    est = sh.decide(s, prefill_tokens_s=1000.0)
    assert est.blocked is None and not est.worth and est.download_s > est.reread_s
    # A bucket that does not answer a LIST: no download is tried either.
    est = sh.decide(s, prefill_tokens_s=None, unreachable="listing: connection refused")
    assert not est.worth and "does not answer" in est.blocked
    assert sh.status()["downloads_skipped_unreachable"] == 2


def put_local(store, data, saved_at, key=KEY, layout=None):
    from autosessd.store.directory import Meta
    (store.path / f"auto-{key}.bin").write_bytes(data)
    store.write_meta(Meta(key=key, n_tokens=slotfile_tokens(data), bytes=len(data), saved_at=saved_at, model="m1",
                          save_ms=1.0, layout=layout))


def test_a_download_takes_its_metadata_from_the_get_it_read(tier):
    sh, store = tier
    data = slot_bytes(n_tokens=7)
    sh._client = _Client(data, {"model": "m1", "line": KEY, "n-prompt": "6", "layout": "s1", "save-ms": "3.5"})
    s = remote_save(data, saved=200.0)
    path = sh.download(s, store)
    assert path.read_bytes() == data
    meta = store.read_meta(KEY)
    assert (meta.saved_at, meta.line, meta.n_prompt, meta.layout, meta.save_ms) == (200.0, KEY, 6, "s1", 3.5)
    # One GET, nothing else: no HEAD between the rename and the metadata.
    assert [c[0] for c in sh._client.calls] == ["get_object"]
    assert sh.status()["downloads"] == 1


def test_a_download_never_replaces_a_name_taken_or_saved_here_meanwhile(tier):
    sh, store = tier
    old, newer, remote_data = slot_bytes(3), slot_bytes(4), slot_bytes(7)
    put_local(store, old, saved_at=100.0)
    s = remote_save(remote_data, saved=200.0)
    # A save takes the name while the bytes arrive: the download does not rename over it.
    sh._client = _Client(remote_data, on_read=lambda: store.in_use.update({s.name: 1}))
    with pytest.raises(SharedError, match="taken here"):
        sh.download(s, store)
    assert (store.path / s.name).read_bytes() == old
    store.in_use.clear()
    # A local save as new finalized meanwhile: it stays, and nothing is counted as downloaded.
    sh._client = _Client(remote_data, on_read=lambda: put_local(store, newer, saved_at=300.0))
    with pytest.raises(shared_mod.AlreadyHere):
        sh.download(s, store)
    assert (store.path / s.name).read_bytes() == newer and store.read_meta(KEY).saved_at == 300.0
    st = sh.status()
    assert st["downloads"] == 0 and st["downloads_kept_local"] == 1
    assert not [p for p in store.path.iterdir() if p.name.endswith(".partial")]


def test_a_download_s_fsyncs_never_hold_up_the_store_for_the_event_loop(tier, monkeypatch):
    """Store.acquire runs on the event loop (a turn claims a name, a save its file): the last
    step of a download must not hold the store's lock while the disk syncs."""
    import threading
    sh, store = tier
    data = slot_bytes(n_tokens=7)
    sh._client = _Client(data)
    s = remote_save(data, saved=200.0)
    final = store.path / s.name
    in_fsync, go_on = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def fsync(fd):
        if final.exists():  # renamed into place: the directory's fsync (and the metadata's, once)
            in_fsync.set()
            assert go_on.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    t = threading.Thread(target=sh.download, args=(s, store))
    t.start()
    acquired = threading.Event()
    try:
        assert in_fsync.wait(10)
        threading.Thread(target=lambda: (store.acquire(s.name), acquired.set()), daemon=True).start()
        assert acquired.wait(2), "Store.acquire waited for a download's fsync"
    finally:
        go_on.set()
        t.join(10)
    store.release(s.name)
    assert store.read_meta(KEY).saved_at == 200.0 and sh.status()["downloads"] == 1


def test_a_save_of_a_kv_layout_this_engine_cannot_load_never_replaces_the_local_file(tier):
    from autosessd.store.slotfile import KVLayout
    sh, store = tier
    local = slot_bytes(3, n_stream=4)
    put_local(store, local, saved_at=100.0, layout="s4")
    one_stream = slot_bytes(7, n_stream=1)
    s = remote_save(one_stream, saved=200.0)
    # Recorded in the object's metadata: refused before any byte is read.
    sh._client = _Client(one_stream, {"layout": "s1"})
    with pytest.raises(shared_mod.Incompatible, match="s1, this engine's is s4"):
        sh.download(s, store, layout=KVLayout(4))
    assert sh.status()["bytes_down"] == 0
    # An object without it: the downloaded file's own KV block says, before the rename.
    sh._client = _Client(one_stream)
    with pytest.raises(shared_mod.Incompatible):
        sh.download(s, store, layout=KVLayout(4))
    assert (store.path / s.name).read_bytes() == local and store.read_meta(KEY).saved_at == 100.0
    st = sh.status()
    assert st["downloads_refused_layout"] == 2 and st["download_failures"] == 0
    assert not [p for p in store.path.iterdir() if p.name.endswith(".partial")]
    # The same layout is downloaded.
    sh._client = _Client(slot_bytes(7, n_stream=4))
    sh.download(remote_save(slot_bytes(7, n_stream=4), saved=200.0), store, layout=KVLayout(4))
    assert store.read_meta(KEY).layout == "s4"


def test_the_process_exits_after_a_stop_while_a_bucket_thread_still_waits():
    """A download (or LIST, or s3transfer part) stuck on a dead bucket: the interpreter would
    join its ThreadPoolExecutor thread at exit, however long. The thread here waits for ever
    (a stand-in for a read that takes read_timeout_s); the process must still end, with its code."""
    import subprocess
    import sys
    code = ("import concurrent.futures, threading, logging\n"
            "from autosessd import cli\n"
            "logging.basicConfig()\n"
            "ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='autosessd-download')\n"
            "started = threading.Event()\n"
            "ex.submit(lambda: (started.set(), threading.Event().wait()))\n"
            "started.wait()\n"
            "ex.shutdown(wait=False, cancel_futures=True)\n"
            "cli.exit_after_stop(3)\n")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit: it joined the bucket thread")
    assert p.returncode == 3, p.stderr
    assert "still waiting on the bucket (autosessd-download" in p.stderr
    # Without such a thread the ordinary exit runs (atexit handlers, buffered output).
    p = subprocess.run([sys.executable, "-c", "from autosessd import cli\nprint('out')\ncli.exit_after_stop(4)"],
                       capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout) == (4, "out\n")


def test_a_restart_uploads_only_this_host_s_saves_that_the_bucket_prune_would_keep(tier):
    import dataclasses

    from autosessd.store.directory import Meta
    sh, store = tier
    sh.cfg = dataclasses.replace(sh.cfg, keep=2)
    keys = [f"{i:016x}" for i in range(1, 5)]
    for i, k in enumerate(keys):
        data = slot_bytes(3 + i)
        (store.path / f"auto-{k}.bin").write_bytes(data)
        # keys[3], the newest, came from another host (a download); the other three were saved here.
        store.write_meta(Meta(key=k, n_tokens=3 + i, bytes=len(data), saved_at=100.0 + i, model="m1", save_ms=1.0,
                              host="there" if i == 3 else None))
    queued = []
    sh.find = lambda model: []  # the bucket lacks them all (its prune removed them)
    sh.upload_later = lambda path, meta: queued.append(meta.key)
    sh._requeue_missing(store, "m1")
    # keep = 2: of this host's own, the two newest; never the downloaded one (its host uploads it).
    assert sorted(queued) == [keys[1], keys[2]]
    # A downloaded file keeps the name of the host it came from.
    data = slot_bytes(7)
    sh._client = _Client(data)
    sh.download(remote_save(data, saved=500.0, key="00000000000000ff"), store)
    assert store.read_meta("00000000000000ff").host == "there"
