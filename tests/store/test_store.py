"""The session directory: atomic finalize, scan, crash cleanup, prune, names."""

import json
import os
from pathlib import Path

import pytest

from autosessd.store.directory import Meta, Store, StoreError, auto_name, manual_name, temp_name
from autosessd.store.prune import Entry, plan_prune

K = [f"{i:016x}" for i in range(1, 30)]
MODEL = "m1"


def write_temp(store: Store, key: str, size: int, magic: bytes = b"qsgg") -> None:
    store.temp_path(key).write_bytes(magic + b"\0" * (size - len(magic)))


def save(store: Store, key: str, size: int = 100, saved_at: float = 1.0, n_tokens: int = 50) -> None:
    write_temp(store, key, size)
    store.verify_temp(key, size, b"qsgg")
    store.finalize(key, Meta(key, n_tokens, size, saved_at, MODEL, 1.0))


def manual_files(path):
    (path / "mine.bin").write_bytes(b"x" * 500)
    (path / "notes.txt").write_text("hello")
    (path / "auto-XYZ.bin").write_bytes(b"y" * 500)  # malformed key: not ours
    (path / "auto-0123456789abcdef.bin.bak").write_bytes(b"z")
    (path / "auto-0123456789ABCDEF.bin").write_bytes(b"z")  # upper case: not ours
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_finalize_makes_bin_and_metadata(tmp_path):
    s = Store(tmp_path)
    save(s, K[0], size=200, n_tokens=77)
    assert not s.temp_path(K[0]).exists()
    assert s.bin_path(K[0]).read_bytes()[:4] == b"qsgg"
    meta = json.loads(s.meta_path(K[0]).read_text())
    st = s.bin_path(K[0]).stat()
    digest = "xxh3-128:" + __import__("xxhash").xxh3_128(s.bin_path(K[0]).read_bytes()).hexdigest()
    assert meta == {"key": K[0], "n_tokens": 77, "bytes": 200, "saved_at": 1.0, "model": MODEL, "save_ms": 1.0,
                    "layout": None, "line": None, "n_prompt": None, "prefix": False, "digest": digest,
                    "ident": [st.st_ino, st.st_ctime_ns, 200],
                    "whole": "not a llama-server slot file of version 4"}  # why it is not kept as blocks
    assert s.read_meta(K[0]).n_tokens == 77
    [e] = s.scan()
    assert e.key == K[0] and e.bytes == 200 and e.meta.n_tokens == 77


def test_finalize_under_another_key_and_metadata_written_before_line_and_n_prompt(tmp_path):
    """A branch: the temporary of its line's key K[0] becomes auto-K[1].bin, whose metadata
    names the line. Metadata from before these fields still reads (as line and n_prompt unknown)."""
    s = Store(tmp_path)
    write_temp(s, K[0], 100)
    s.finalize(K[0], Meta(K[1], 50, 100, 1.0, MODEL, 1.0, line=K[0], n_prompt=40))
    assert not s.temp_path(K[0]).exists() and not s.bin_path(K[0]).exists()
    m = s.read_meta(K[1])
    assert (m.key, m.line, m.n_prompt, m.prefix) == (K[1], K[0], 40, False)
    s.meta_path(K[1]).write_text(json.dumps({"key": K[1], "n_tokens": 50, "bytes": 100, "saved_at": 1.0,
                                             "model": MODEL, "save_ms": 1.0}))
    m = s.read_meta(K[1])
    assert (m.line, m.n_prompt, m.prefix) == (None, None, False)


def test_verify_temp_refuses_size_mismatch_missing_and_bad_magic(tmp_path):
    s = Store(tmp_path)
    write_temp(s, K[0], 100)
    with pytest.raises(StoreError, match="100 bytes, the engine reported 120"):
        s.verify_temp(K[0], 120)
    with pytest.raises(StoreError, match="magic"):
        s.verify_temp(K[0], 100, b"GGUF")
    with pytest.raises(StoreError, match="not in"):
        s.verify_temp(K[1], 100)
    assert not s.bin_path(K[0]).exists()


def test_read_meta_refuses_a_pair_that_disagrees(tmp_path):
    s = Store(tmp_path)
    save(s, K[0], size=100)
    s.bin_path(K[0]).write_bytes(b"qsgg" + b"\0" * 10)  # overwritten behind our back
    assert s.read_meta(K[0]) is None
    s.meta_path(K[1]).write_text("{not json")
    assert s.read_meta(K[1]) is None


def test_cleanup_removes_temporaries_orphans_and_torn_pairs_only(tmp_path):
    s = Store(tmp_path)
    before = manual_files(tmp_path)
    save(s, K[0])                                   # good pair: stays
    write_temp(s, K[1], 10)                         # engine died mid-save
    (tmp_path / f".autosessd-{K[2]}.json.partial").write_text("{}")
    s.meta_path(K[3]).write_text(json.dumps({"key": K[3], "n_tokens": 1, "bytes": 1, "saved_at": 0,
                                             "model": "m", "save_ms": 0}))  # metadata without bin
    s.bin_path(K[4]).write_bytes(b"qsgg1234")        # crash between rename and metadata
    removed = s.cleanup()
    assert sorted(os.listdir(tmp_path)) == sorted([*before, auto_name(K[0]), f"auto-{K[0]}.json"])
    assert len(removed) == 4
    for name, data in before.items():
        assert (tmp_path / name).read_bytes() == data


def entries(*specs):
    return [Entry(key=K[i], bytes=b, mtime=0, meta=Meta(K[i], 1, b, t, MODEL, 0)) for i, b, t in specs]


@pytest.mark.parametrize(
    "files, keep, max_bytes, in_use, removed",
    [
        ([(0, 10, 1), (1, 10, 2), (2, 10, 3)], 2, 1000, set(), {0}),        # keep newest 2
        ([(0, 10, 1), (1, 10, 2), (2, 10, 3)], 5, 1000, set(), set()),      # under both limits
        ([(0, 40, 1), (1, 40, 2), (2, 40, 3)], 5, 100, set(), {0}),          # byte budget
        ([(0, 200, 3), (1, 10, 2)], 5, 100, set(), {0}),                      # newest alone is over budget
        ([(0, 10, 1), (1, 10, 2), (2, 10, 3)], 1, 1000, {auto_name(K[0])}, {1}),  # in use is kept
    ],
)
def test_plan_prune(files, keep, max_bytes, in_use, removed):
    plan = plan_prune(entries(*files), keep, max_bytes, in_use)
    assert {K.index(e.key) for e in plan.remove} == removed


def test_prune_keeps_newest_and_never_touches_other_files(tmp_path):
    s = Store(tmp_path)
    before = manual_files(tmp_path)
    for i in range(6):
        save(s, K[i], size=100, saved_at=float(i))
    plan = s.prune(keep=3, max_bytes=10**9, dry_run=True)
    assert len(plan.remove) == 3 and len(os.listdir(tmp_path)) == len(before) + 12
    plan = s.prune(keep=3, max_bytes=10**9)
    left = {e.key for e in s.scan()}
    assert left == {K[3], K[4], K[5]}
    assert not s.meta_path(K[0]).exists()
    for name, data in before.items():
        assert (tmp_path / name).read_bytes() == data
    # a byte budget of 150 leaves only the newest
    s.prune(keep=10, max_bytes=150)
    assert {e.key for e in s.scan()} == {K[5]}
    for name, data in before.items():
        assert (tmp_path / name).read_bytes() == data


def test_prune_never_removes_a_file_in_use(tmp_path):
    s = Store(tmp_path)
    for i in range(3):
        save(s, K[i], saved_at=float(i))
    with s.using(auto_name(K[0])):
        s.prune(keep=1, max_bytes=10**9)
        assert s.bin_path(K[0]).exists()
        with pytest.raises(StoreError, match="being written or read"):
            s.remove(K[0])
    assert {e.key for e in s.scan()} == {K[0], K[2]}


@pytest.mark.parametrize("bad", ["", "../x", "/etc/passwd", "a/b", ".hidden", "..", "x" * 10_000, "a\0b", "a\nb",
                                 "auto-0123456789abcdef", "auto-0123456789abcdef.bin", "sp ace"])
def test_manual_names_never_escape(bad):
    with pytest.raises(StoreError):
        manual_name(bad)


@pytest.mark.parametrize("good, file", [("mine", "mine.bin"), ("v1.2_x-y", "v1.2_x-y.bin"), ("a.bin", "a.bin")])
def test_manual_names(good, file):
    assert manual_name(good) == file


def test_space_check_uses_density_of_earlier_saves(tmp_path, monkeypatch):
    s = Store(tmp_path)
    save(s, K[0], size=1000, n_tokens=10)  # 100 bytes per token
    assert s.estimate_bytes(50) == 5000
    monkeypatch.setattr(s, "free_bytes", lambda: 64 * 1024 * 1024 + 4000)
    assert s.check_space(30) is None
    assert "disk full" in s.check_space(50)


def test_temp_names_are_hidden_and_distinct():
    assert temp_name(K[0]).startswith(".") and auto_name(K[0]) == f"auto-{K[0]}.bin"


def test_plan_prune_makes_room_oldest_first_never_in_use():
    files = entries((0, 100, 1), (1, 100, 2), (2, 100, 3), (3, 100, 4))
    plan = plan_prune(files, 10, 10**9, {auto_name(K[0])}, must_free=150)
    assert {K.index(e.key) for e in plan.remove} == {1, 2}
    assert plan_prune(files, 10, 10**9, set(), must_free=0).remove == []


def readable_as_nobody(path) -> str:
    """Open path for reading in a forked child running as uid/gid 65534: "read" or the error."""
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rd)
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            with open(path, "rb") as f:
                f.read(1)
            out = "read"
        except BaseException as e:  # noqa: BLE001 - report anything to the parent
            out = type(e).__name__
        os.write(wr, out.encode())
        os._exit(0)
    os.close(wr)
    with os.fdopen(rd) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


@pytest.fixture
def open_dir():
    """A directory anyone may traverse (pytest's tmp_path is 0700 and would hide the files
    by itself), so only the files' own modes protect them."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="autosessd-modes-")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d)


def finalize_under_engine_umask(s: Store, open_dir) -> list:
    old = os.umask(0o022)  # what an engine without UMask=0077 writes with
    try:
        save(s, K[0])
        write_temp(s, K[1], 100)
        s.finalize_manual(K[1], "mine")
    finally:
        os.umask(old)
    return [s.bin_path(K[0]), s.meta_path(K[0]), open_dir / "mine.bin"]


def test_finalized_files_are_private_whatever_the_engine_umask(open_dir):
    for f in finalize_under_engine_umask(Store(open_dir), open_dir):
        assert f.stat().st_mode & 0o777 == 0o600, f.name


def test_another_user_cannot_read_session_files(open_dir):
    if os.geteuid() != 0:
        pytest.skip(reason="reading as another uid (65534) needs root")
    files = finalize_under_engine_umask(Store(open_dir), open_dir)
    (open_dir / "open.txt").write_text("x")
    os.chmod(open_dir / "open.txt", 0o644)
    assert readable_as_nobody(open_dir / "open.txt") == "read"  # the check sees a readable file as readable
    for f in files:
        assert readable_as_nobody(f) == "PermissionError", f.name


def test_with_control_group_files_are_group_readable(open_dir):
    gid = os.getgid()
    s = Store(open_dir, group=gid)
    old = os.umask(0o077)  # the group bit is set by us, not left to the umask
    try:
        save(s, K[0])
    finally:
        os.umask(old)
    for f in (s.bin_path(K[0]), s.meta_path(K[0])):
        st = f.stat()
        assert st.st_mode & 0o777 == 0o640 and st.st_gid == gid, f.name


def test_space_check_does_not_scan_the_directory_at_every_save(tmp_path, monkeypatch):
    s = Store(tmp_path)
    save(s, K[0], size=1000, n_tokens=10)  # 100 bytes per token
    s2 = Store(tmp_path)  # a new start: its cleanup looks at every file once
    s2.cleanup()
    scans = []
    real_scan = s2.scan
    monkeypatch.setattr(s2, "scan", lambda *a, **kw: scans.append(1) or real_scan(*a, **kw))
    monkeypatch.setattr(s2, "free_bytes", lambda: 10**12)
    for _ in range(5):
        assert s2.check_space(50) is None
    assert s2.estimate_bytes(50) == 5000 and scans == []
    save(s2, K[1], size=4000, n_tokens=10)  # a denser save raises the figure, still without a scan
    assert s2.estimate_bytes(50) == 20000 and scans == []


def test_a_file_taken_into_use_while_prune_runs_is_kept(tmp_path, monkeypatch):
    """Prune runs in a worker thread while the loop marks files in use: one taken into use
    after the plan chose it is still not removed, nor reported as removed."""
    import autosessd.store.directory as store_mod

    s = Store(tmp_path)
    for i in range(3):
        save(s, K[i], saved_at=float(i))
    real_plan = store_mod.plan_prune

    def plan_then_loop_acquires(*a, **kw):
        plan = real_plan(*a, **kw)
        s.acquire(auto_name(K[0]))  # the loop, between the plan and the unlink
        return plan

    monkeypatch.setattr(store_mod, "plan_prune", plan_then_loop_acquires)
    plan = s.prune(keep=1, max_bytes=10**9)
    assert s.bin_path(K[0]).exists() and s.read_meta(K[0]) is not None
    assert {e.key for e in plan.remove} == {K[1]}


# -- install: a download from the shared tier put in place --------------------------------------

def download_temp(s: Store, size: int, fill: bytes = b"d") -> Path:
    """What a download leaves before install: a whole, fsynced temporary of its own name."""
    temp = s.path / f".autosessd-auto-{K[0]}.1234abcd.download.partial"
    temp.write_bytes(b"qsgg" + fill * (size - 4))
    return temp


def remote_meta(size: int, saved_at: float) -> Meta:
    return Meta(K[0], 50, size, saved_at, MODEL, 1.0, host="there")


def test_install_puts_the_file_and_its_metadata_in_place(tmp_path):
    s = Store(tmp_path)
    save(s, K[0], size=100, saved_at=1.0)
    name = auto_name(K[0])
    with s.using(name):  # the download's own claim
        assert s.users(name) == 1
        s.install(download_temp(s, 300), name, remote_meta(300, 2.0), claimed=True)
    assert s.users(name) == 0
    assert s.bin_path(K[0]).read_bytes()[4:] == b"d" * 296
    assert s.read_meta(K[0]) == remote_meta(300, 2.0)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    # A parked name has no metadata.
    temp = download_temp(s, 50)
    s.install(temp, "parked.bin", None, claimed=False)
    assert (tmp_path / "parked.bin").stat().st_size == 50 and not temp.exists()


def test_install_never_replaces_a_name_held_here_nor_a_local_save_as_new(tmp_path):
    from autosessd.store.directory import InUse, NewerHere

    s = Store(tmp_path)
    save(s, K[0], size=100, saved_at=5.0)
    name, mine = auto_name(K[0]), s.read_meta(K[0])

    def leaves_all_as_it_was(temp):
        assert s.read_meta(K[0]) == mine and s.bin_path(K[0]).stat().st_size == 100
        assert temp.exists()  # the caller's to remove
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [temp.name]

    with s.using(name):  # a save or a restore here, and the caller holds nothing
        temp = download_temp(s, 300)
        with pytest.raises(InUse, match="being written or read"):
            s.install(temp, name, remote_meta(300, 9.0), claimed=False)
        leaves_all_as_it_was(temp)
        with s.using(name):  # the caller's claim and someone else's
            with pytest.raises(InUse):
                s.install(temp, name, remote_meta(300, 9.0), claimed=True)
        leaves_all_as_it_was(temp)
    # A local save as new (or newer) stays; an older one is replaced.
    for saved_at in (5.0, 4.0):
        with pytest.raises(NewerHere):
            s.install(temp, name, remote_meta(300, saved_at), claimed=False)
        leaves_all_as_it_was(temp)
    s.install(temp, name, remote_meta(300, 5.5), claimed=False)
    assert s.read_meta(K[0]).saved_at == 5.5


def test_acquire_does_not_wait_for_an_install_s_fsyncs(tmp_path, monkeypatch):
    """acquire() runs on the event loop: install must not hold _lock across an fsync (a slow
    disk would stall every turn). The fsyncs after the rename block here until released."""
    import threading

    s = Store(tmp_path)
    name = auto_name(K[0])
    final = s.bin_path(K[0])
    in_fsync, go_on = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def fsync(fd):
        if final.exists():  # the rename is done: this is the directory's fsync
            in_fsync.set()
            assert go_on.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    temp = download_temp(s, 300)
    t = threading.Thread(target=s.install, args=(temp, name, remote_meta(300, 2.0)), kwargs={"claimed": False})
    t.start()
    acquired = threading.Event()
    try:
        assert in_fsync.wait(10)
        threading.Thread(target=lambda: (s.acquire(name), acquired.set()), daemon=True).start()
        assert acquired.wait(2), "acquire() waited for install's fsync"
    finally:
        go_on.set()
        t.join(10)
    assert s.users(name) == 1 and s.read_meta(K[0]).saved_at == 2.0


def test_a_crash_between_install_s_renames_leaves_no_save_a_reader_takes(tmp_path, monkeypatch):
    """The new .bin is in place, its metadata not (the process died): the pair disagrees, so
    it reads as absent, and cleanup at the next start removes it and every temporary."""
    s = Store(tmp_path)
    save(s, K[0], size=100, saved_at=1.0)
    real_replace = os.replace
    calls = []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt("the process dies here")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        s.install(download_temp(s, 300), auto_name(K[0]), remote_meta(300, 2.0), claimed=False)
    monkeypatch.setattr(os, "replace", real_replace)
    assert s.read_meta(K[0]) is None and s.scan()[0].meta is None
    (tmp_path / f".autosessd-{K[0]}.0000ffff.install.json.partial").write_text("{}")  # one a crash left
    s2 = Store(tmp_path)
    assert sorted(s2.cleanup()) == sorted([f"auto-{K[0]}.bin (no valid metadata (interrupted save))",
                                           f".autosessd-{K[0]}.0000ffff.install.json.partial (leftover temporary)"])
    assert list(tmp_path.iterdir()) == []


def test_a_file_unchanged_since_its_save_is_checked_by_stats_alone_and_a_changed_one_is_read(tmp_path):
    """Issue 23: the restore's check runs on the event loop when a few lstats decide it (a
    thread's round trip cost more than the check); a file whose identity changed needs its
    digest, read in a thread, and a flipped byte is still caught there."""
    from autosessd.store.integrity import NEEDS_READ

    s = Store(tmp_path)
    save(s, "a" * 16)
    name = auto_name("a" * 16)
    assert s.check_whole(name, 1, stat_only=True) is None
    os.chmod(tmp_path / name, 0o600)  # the ctime moves: the identity changed, the bytes did not
    assert s.check_whole(name, 1, stat_only=True) is NEEDS_READ
    assert s.check_whole(name, 1) is None
    assert s.check_whole(name, 1, stat_only=True) is None  # checked once: stats again from now on
    with open(tmp_path / name, "r+b") as f:
        f.seek(50)
        byte = f.read(1)
        f.seek(50)
        f.write(bytes([byte[0] ^ 1]))
    assert s.check_whole(name, 1, stat_only=True) is NEEDS_READ
    assert "digest" in s.check_whole(name, 1)


def test_the_metadata_written_is_read_back_without_reading_its_file(tmp_path, monkeypatch):
    """The turn after a save reads the file's metadata on the event loop: it costs two lstats
    (the writer left it cached under the identity it has after its rename), not a read and a
    parse. What is cached is what a reader of the file would get; a metadata file replaced
    by other means is read again."""
    from autosessd.base import files

    s = Store(tmp_path)
    reads = []
    real = files.read_small
    monkeypatch.setattr(files, "read_small", lambda path, *a, **k: reads.append(Path(path).name) or real(path, *a, **k))
    save(s, K[0], size=200, n_tokens=77)
    s.install(download_temp(s, 300), auto_name(K[1]), Meta(K[1], 50, 300, 2.0, MODEL, 1.0, host="there"), claimed=False)
    got = [s.read_meta(K[0]), s.read_meta(K[1])]
    assert reads == []
    assert got == [Meta.from_json(s.meta_path(k).read_bytes()) for k in K[:2]]
    # Another size: caught by the identity even where the ctime is coarse (tmpfs, older kernels).
    s.meta_path(K[0]).write_bytes(s.meta_path(K[0]).read_bytes().replace(b'"n_tokens": 77', b'"n_tokens": 7777'))
    assert s.read_meta(K[0]).n_tokens == 7777 and reads == [s.meta_path(K[0]).name]
