"""The directories autosessd uses are its own (issue 46, 4 and 11).

Every file in the staging directory and the store holds a conversation, and the engine writes its
saves where staging is: whoever owns a directory decides what appears in it. So each directory
autosessd uses is checked before it is used (check_dir): a real directory, not a symbolic link,
owned by the user autosessd runs as, and writable by nobody else (but control.group, when set).
One that autosessd makes itself (the tmpfs staging of `--exec`, /dev/shm/autosessd-<uid>/<tag>,
and its parent) must also be closed to everyone else (mode 0700; 0750/0770 with control.group):
another local user who made it first, or opened it since, is named with the refusal.

A tmpfs staging directory is memory: one whose store is gone would hold its copies until the next
boot. Each one says whose it is (CLAIM, a file naming its store) and the daemon using it holds a
lock on that file; at start reclaim() removes the sibling directories whose store no longer
exists and that nobody holds, and doctor names them (stale()).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import stat
import time
from pathlib import Path

CLAIM = ".autosessd-store"  # in a tmpfs staging directory: the absolute path of its store, locked while used


class NotOurs(Exception):
    """A directory autosessd will not use; says which and why."""


def owner_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_dir(path: str | Path, what: str, *, made_here: bool = False, group: int | None = None) -> None:
    """NotOurs unless `path` is a directory autosessd may use (the module's docstring). what: how
    the message names it (the config key). made_here: autosessd creates it (the tmpfs staging):
    closed to others too."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise NotOurs(f"{what} {path} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise NotOurs(f"{what} {path} is a symbolic link (to {os.readlink(path)}): autosessd uses only a directory "
                      f"of its own; give the directory's real path")
    if not stat.S_ISDIR(st.st_mode):
        raise NotOurs(f"{what} {path} is not a directory")
    me = os.geteuid()
    if st.st_uid != me:
        raise NotOurs(f"{what} {path} belongs to {owner_name(st.st_uid)}, not to {owner_name(me)} that autosessd runs "
                      f"as: whoever owns it decides what the engine reads from it; use a directory of your own")
    mode = stat.S_IMODE(st.st_mode)
    grouped = group is not None and st.st_gid == group
    open_to = mode & (0o007 if grouped else 0o077) if made_here else mode & (0o002 if grouped else 0o022)
    if open_to:
        want = ("0700" + (" (0770 with control.group)" if group is not None else "")) if made_here \
            else "not writable by group or others" + (" (but control.group)" if group is not None else "")
        raise NotOurs(f"{what} {path} has mode {mode:04o}, open to others: it must be {want}"
                      + (" (autosessd makes it 0700: someone made or opened it)" if made_here else "")
                      + f"; chmod {'700' if made_here else 'go-w'} {path}, or remove it")


def tighten(path: str | Path, what: str, group: int | None = None) -> str | None:
    """A directory autosessd made inside its store (blocks/, the quarantine): NotOurs when it is
    a symbolic link or another user's; when it is ours but open to others (an earlier version
    made blocks/ 0755 under umask 022), closed (0700; 0750 with control.group). → what was done."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NotOurs(f"{what} {path} is not a directory (a symbolic link?): autosessd uses only a directory of its "
                      f"own; remove it")
    if st.st_uid != os.geteuid():
        raise NotOurs(f"{what} {path} belongs to {owner_name(st.st_uid)}, not to {owner_name(os.geteuid())} that "
                      f"autosessd runs as; remove it")
    mode = stat.S_IMODE(st.st_mode)
    want = 0o750 if group is not None and st.st_gid == group else 0o700
    if mode & ~want & 0o777:
        os.chmod(path, mode & want)
        return f"{what} {path} was mode {mode:04o}, open to others: made {mode & want:04o}"
    return None


def claim(staging: Path, store: Path) -> int:
    """Write staging's CLAIM (the store it serves) and lock it for this process's life (the
    descriptor returned stays open). NotOurs when another process holds it."""
    p = staging / CLAIM
    deadline = time.monotonic() + 2.0  # a reclaim or a doctor looking at it holds it a moment
    while True:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            if time.monotonic() > deadline:
                raise NotOurs(f"staging {staging} is in use by another autosessd (it holds {p})") from None
            time.sleep(0.05)
            continue
        if os.path.lexists(p) and os.stat(p).st_ino == os.fstat(fd).st_ino:
            break
        os.close(fd)  # a reclaim removed the file it locked: lock the new one
    os.ftruncate(fd, 0)
    os.pwrite(fd, (str(store) + "\n").encode(), 0)
    return fd


def _claimed(d: Path) -> tuple[str | None, bool]:
    """(the store d's CLAIM names, whether someone holds it now); (None, False) when it has none."""
    try:
        fd = os.open(d / CLAIM, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None, False
    try:
        store = os.read(fd, 4096).decode(errors="replace").strip() or None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            held = False
        except OSError:
            held = True
        return store, held
    finally:
        os.close(fd)


def stale(parent: Path) -> list[tuple[Path, str, int]]:
    """The staging directories under `parent` (/dev/shm/autosessd-<uid>) whose store is gone
    and that nobody holds: (directory, its store, bytes it holds)."""
    out = []
    try:
        subs = list(os.scandir(parent))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for d in subs:
        if not d.is_dir(follow_symlinks=False):
            continue
        store, held = _claimed(Path(d.path))
        if store is None or held or os.path.isdir(store):
            continue
        size = 0
        with contextlib.suppress(OSError), os.scandir(d.path) as it:
            size = sum(e.stat(follow_symlinks=False).st_size for e in it if e.is_file(follow_symlinks=False))
        out.append((Path(d.path), store, size))
    return out


def reclaim(parent: Path) -> list[str]:
    """Remove the staging directories under `parent` whose store is gone and that nobody holds
    (stale()): what autosessd put there (its copies, its temporaries, the claim), then the
    directory when nothing else is left; each under the claim's lock, so that no daemon claims it
    meanwhile. → what was done."""
    done = []
    for d, _, _ in stale(parent):
        try:
            fd = os.open(d / CLAIM, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # claimed since
            store = os.read(fd, 4096).decode(errors="replace").strip()
            if not store or os.path.isdir(store):
                continue
            size, left = 0, []
            for e in os.scandir(d):
                ours = e.name == CLAIM or e.name.startswith(".autosessd-") or \
                    (e.name.startswith("auto-") and e.name.endswith(".bin"))
                if ours and e.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        size += e.stat(follow_symlinks=False).st_size
                        os.unlink(e.path)
                else:
                    left.append(e.name)
            if not left:
                with contextlib.suppress(OSError):
                    os.rmdir(d)
            done.append(f"staging {d} of {store}, which no longer exists ({size / 1e6:,.1f} MB)"
                        + (f"; kept what is not autosessd's: {', '.join(sorted(left)[:5])}" if left else ""))
        finally:
            os.close(fd)
    return done
