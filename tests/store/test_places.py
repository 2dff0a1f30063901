"""The directories autosessd uses are its own (issue 46, 4 and 11): a staging directory another
user made first, opened to others, or a symbolic link is refused at start, naming it and its
owner; a tmpfs staging directory whose store is gone is removed at the next start and named by
doctor. The directory layout is the one `--exec` makes (/dev/shm/autosessd-<uid>/<tag>), under
the test's own directory."""

from __future__ import annotations

import os

import pytest

from autosessd.base.config import parse
from autosessd.sessions.checks import StartupError, check_store
from autosessd.store import places
from autosessd.store.directory import Store

OTHER = 65534  # nobody


def cfg_for(staging, store):
    return parse(f'slot_save_path = "{staging}"\nstore_path = "{store}"\n'.encode(), "t.toml")


@pytest.fixture
def tmpfs_like(tmp_path):
    """(staging, store): a staging directory as --exec makes it, and the store on the disk."""
    parent = tmp_path / f"autosessd-{os.getuid()}"
    parent.mkdir(mode=0o700)
    staging = parent / "0123456789ab"
    staging.mkdir(mode=0o700)
    store = tmp_path / "store"
    return staging, store


def close(store):
    if store.claim is not None:
        os.close(store.claim)


def test_a_staging_directory_of_our_own_is_used_and_claimed(tmpfs_like):
    staging, store = tmpfs_like
    s = check_store(cfg_for(staging, store))
    try:
        assert (staging / places.CLAIM).read_text().strip() == str(store.resolve())
        with pytest.raises(StartupError, match="in use by another autosessd"):
            check_store(cfg_for(staging, store))
    finally:
        close(s)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's needs root")
def test_a_tmpfs_staging_parent_another_user_made_first_is_refused_naming_its_owner(tmpfs_like):
    staging, store = tmpfs_like
    os.chown(staging.parent, OTHER, OTHER)
    os.chmod(staging.parent, 0o777)
    with pytest.raises(StartupError, match=r"belongs to nobody \(uid 65534\)") as e:
        check_store(cfg_for(staging, store))
    assert str(staging.parent) in str(e.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's needs root")
def test_a_staging_directory_another_user_owns_is_refused(tmp_path):
    staging, store = tmp_path / "sessions", tmp_path / "store"
    staging.mkdir()
    os.chown(staging, OTHER, OTHER)
    with pytest.raises(StartupError, match=f"slot_save_path {staging} belongs to nobody"):
        check_store(cfg_for(staging, store))


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o707])
def test_a_tmpfs_staging_directory_open_to_others_is_refused(tmpfs_like, mode):
    staging, store = tmpfs_like
    os.chmod(staging, mode)
    with pytest.raises(StartupError, match=f"has mode 0{mode:o}, open to others: it must be 0700"):
        check_store(cfg_for(staging, store))


def test_a_staging_directory_others_may_write_is_refused_and_a_readable_one_used(tmp_path):
    staging, store = tmp_path / "sessions", tmp_path / "store"
    staging.mkdir()
    os.chmod(staging, 0o755)  # mkdir -p as the quick start makes it: others may read names, not write
    close(check_store(cfg_for(staging, store)))
    os.chmod(staging, 0o777)
    with pytest.raises(StartupError, match="mode 0777, open to others"):
        check_store(cfg_for(staging, store))


def test_a_staging_directory_that_is_a_symbolic_link_is_refused(tmpfs_like, tmp_path):
    staging, store = tmpfs_like
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    staging.rmdir()
    staging.symlink_to(elsewhere)
    with pytest.raises(StartupError, match=f"is a symbolic link \\(to {elsewhere}\\)"):
        check_store(cfg_for(staging, store))


def test_staging_of_stores_that_no_longer_exist_is_removed_at_start(tmpfs_like, tmp_path):
    staging, store = tmpfs_like
    parent = staging.parent
    gone = parent / "aaaaaaaaaaaa"  # its store was removed (a test's tmp_path, a user's old directory)
    gone.mkdir(mode=0o700)
    (gone / places.CLAIM).write_text(str(tmp_path / "removed-store") + "\n")
    (gone / "auto-0123456789abcdef.bin").write_bytes(b"x" * 1000)
    (gone / ".autosessd-0123456789abcdef.1.asm.partial").write_bytes(b"y")
    kept = parent / "bbbbbbbbbbbb"  # a person's file in it: the directory stays, with that file
    kept.mkdir(mode=0o700)
    (kept / places.CLAIM).write_text(str(tmp_path / "removed-too") + "\n")
    (kept / "mine.bin").write_bytes(b"z")
    live = parent / "cccccccccccc"  # its store exists: another daemon's, not running now
    live.mkdir(mode=0o700)
    (tmp_path / "live-store").mkdir()
    (live / places.CLAIM).write_text(str(tmp_path / "live-store") + "\n")
    held = parent / "dddddddddddd"  # in use by a running daemon whose store was removed under it
    held.mkdir(mode=0o700)
    fd = places.claim(held, tmp_path / "removed-while-running")
    try:
        assert {d.name for d, _, _ in places.stale(parent)} == {gone.name, kept.name}
        s = check_store(cfg_for(staging, store))
        close(s)
        assert not gone.exists() and sorted(os.listdir(kept)) == ["mine.bin"] and live.exists() and held.exists()
    finally:
        os.close(fd)


def test_doctor_names_an_unsafe_staging_directory_and_stale_ones(tmpfs_like, tmp_path):
    from autosessd.front import doctor

    staging, store_dir = tmpfs_like
    store_dir.mkdir()
    s = Store(store_dir, staging=staging)

    class Sess:
        store = s

        class ctx:
            cfg = cfg_for(staging, store_dir)

    assert doctor._staging_facts(Sess) == (None, ())
    os.chmod(staging, 0o777)
    stale = staging.parent / "eeeeeeeeeeee"
    stale.mkdir(mode=0o700)
    (stale / places.CLAIM).write_text(str(tmp_path / "no-such-store") + "\n")
    unsafe, stale_found = doctor._staging_facts(Sess)
    assert "mode 0777, open to others" in unsafe and len(stale_found) == 1 and str(stale) in stale_found[0]
    facts = doctor.Facts(flags={}, swa_window=0, empties_idle=False, n_slots=1, slots_visible=True,
                         save_path=str(staging), n_ctx=None, largest_file=None, files_over_ctx=0, arch=None,
                         recurrent=False, reused=0, not_reused=0, not_reused_cause=None, staging_unsafe=unsafe,
                         hot_bytes=3 * 10**9, hot_budget=10**9, stale_staging=stale_found)
    found = [(f.setting, f.says) for f in doctor.checks(facts) if f.status == "problem"]
    assert ("staging", unsafe) in found
    assert any(setting == "staging_max_gb" and "over their budget" in says for setting, says in found)
    assert any(setting == "staging" and "no longer exist" in says for setting, says in found)


def test_a_store_with_blocks_starts_again_and_an_older_open_blocks_directory_is_closed(tmpfs_like):
    import time

    from autosessd.store.directory import Meta
    from kv_common import slot_file

    staging, store_dir = tmpfs_like
    old = os.umask(0o022)
    try:
        s = check_store(cfg_for(staging, store_dir))
        data = slot_file(list(range(300)))
        s.temp_path("a" * 16).write_bytes(data)
        assert s.finalize("a" * 16, Meta("a" * 16, 300, len(data), time.time(), "m", 1.0)).in_blocks
        close(s)
        assert os.stat(store_dir / "blocks").st_mode & 0o777 == 0o700
        os.chmod(store_dir / "blocks", 0o755)  # as an earlier version made it
        close(check_store(cfg_for(staging, store_dir)))
        assert os.stat(store_dir / "blocks").st_mode & 0o777 == 0o700
    finally:
        os.umask(old)
