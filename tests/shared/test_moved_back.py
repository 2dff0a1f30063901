"""A conversation that went on on another host, back on a host whose slot still holds an older
copy of it (docs/several-hosts.md, issue 41): the bucket's newer save is weighed for a restore,
and the slot's older state is never saved over it. Sessions on the stub engine, the bucket's
catalog built by hand (sessions/remote.py), its download a fake that installs the file."""

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sessions"))

from autosessd.base.config import parse  # noqa: E402
from autosessd.sessions.remote import Catalog, Remote  # noqa: E402
from autosessd.shared import RemoteSession  # noqa: E402
from autosessd.store import slotfile  # noqa: E402
from autosessd.store.directory import TEMP_PREFIX, Meta  # noqa: E402
from autosessd.store.runs import TokenRun  # noqa: E402
from autosessd.store.slotfile import encode  # noqa: E402
from tokens_common import K, LONG_2, X, Y, body, chat, make, prompt  # noqa: E402

CFG = parse(b'slot_save_path = "/x"\n[shared]\nendpoint_url = "http://s3"\nbucket = "b01"\nhost = "here"\n',
            "t.toml").shared
NAME = f"auto-{K}.bin"
# X went on on host "there": two more turns, its save holding them and their answers.
X2 = body(*[(m["role"], m["content"]) for m in X["messages"]], ("assistant", "Aye."),
          ("user", "What of the wind? " + LONG_2))
X3 = body(*[(m["role"], m["content"]) for m in X2["messages"]], ("assistant", "Strong."), ("user", "Sail on."))
THERE = prompt(X2) + [ord(c) for c in "Strong."]


class FakeShared:
    """The tier as the turn uses it: this host's name, the estimate (always: download), and a
    download that installs the save's file (the stub engine's layout) as Store.install does."""

    host = "here"

    def __init__(self):
        self.uploads = []

    def is_bad(self, key):
        return False

    def decide(self, save, prefill_tokens_s, n_tokens=None, restore_bytes_s=None, unreachable=None, n_bytes=None):
        return SimpleNamespace(worth=True, blocked=None)

    def upload_later(self, path, meta):
        self.uploads.append((path.name, meta.n_tokens))

    def download(self, save, store, claimed=False, deadline=None, layout=None):
        data = slotfile.build(THERE, b"s" * 64)
        temp = store.path / f"{TEMP_PREFIX}{K}.download.partial"
        temp.write_bytes(data)
        store.install(temp, save.name, Meta(key=K, n_tokens=len(THERE), bytes=len(data), saved_at=save.saved_at,
                                            model="stub-model", save_ms=1.0, host=save.host), claimed=True)
        return store.path / save.name


def there_save(saved_at):
    s = RemoteSession(key=f"p/sessions/m/auto-{K}/{round(saved_at * 1e6):020d}-{len(THERE):010d}-there.bin",
                      model="stub-model", name=NAME, saved_at=saved_at, n_tokens=len(THERE), host="there",
                      bytes=1000, modified=saved_at)
    return s, encode(THERE)


@pytest.fixture
async def moved(tmp_path):
    """A host whose slot holds X after its first turn; meanwhile X went on on host "there"."""
    s = await make(tmp_path)
    await chat(s, X)
    shared = FakeShared()
    remote = Remote(shared=shared, cfg=CFG, model="stub-model")
    save, tokens = there_save(time.time() + 1)
    remote.catalog = Catalog({NAME: save}, {save.key: tokens}, TokenRun([(tokens, NAME)]), time.time())
    s.ctx.remote = remote
    yield s, shared
    remote.pool.shutdown()
    remote.downloads.shutdown()


def test_went_on_compares_tokens_and_hosts():
    r = Remote(shared=FakeShared(), cfg=CFG, model="stub-model")
    save, tokens = there_save(1.0)
    r.catalog = Catalog({NAME: save}, {save.key: tokens}, TokenRun([(tokens, NAME)]), 1.0)
    mine = encode(prompt(X))
    assert r.went_on(K, mine, len(prompt(X)) + 4, 1) == "there"
    assert r.went_on(K, mine, len(THERE), 1) is None  # the slot holds about as much
    assert r.went_on(K, encode(prompt(Y)), 10, 1) is None  # the save does not go on from the slot's tokens
    assert r.went_on(K, None, 10, 1) is None  # the slot's tokens are not known: nothing compared
    assert r.went_on("fedcba9876543210", mine, 10, 1) is None  # no save of that name
    r.shared.host = "there"
    assert r.went_on(K, mine, 10, 1) is None  # this host's own save: the local file knows
    r.pool.shutdown()
    r.downloads.shutdown()


async def test_the_slot_s_older_copy_is_not_saved_over_the_bucket_s_newer_save(moved):
    s, shared = moved
    turn, _, _ = await chat(s, body(("user", "Something else entirely, " + LONG_2)))
    assert turn.saved is None and s.counters.saves_covered_remote == 1
    assert not (s.store.path / NAME).exists() and shared.uploads == []


async def test_a_return_after_it_went_on_elsewhere_restores_the_bucket_s_save(moved):
    s, _ = moved
    turn, cache_n, n_prompt = await chat(s, X3)
    assert turn.moved_from == "there" and turn.downloaded_from == "there"
    assert turn.restored is not None and turn.restored["file"] == NAME
    assert cache_n >= len(prompt(X2)) and s.counters.arrivals == 1 and s.counters.fetched == 1


def test_a_save_refused_here_never_covers_what_a_slot_holds():
    """A save this host refused as not whole (BadObject) is no copy of the conversation: the
    slot's state may be the only good one, so it is saved as usual (went_on says None)."""
    class Refused(FakeShared):
        def is_bad(self, key):
            return True

    r = Remote(shared=Refused(), cfg=CFG, model="stub-model")
    save, tokens = there_save(1.0)
    r.catalog = Catalog({NAME: save}, {save.key: tokens}, TokenRun([(tokens, NAME)]), 1.0)
    assert r.went_on(K, encode(prompt(X)), len(prompt(X)) + 4, 1) is None
    r.pool.shutdown()
    r.downloads.shutdown()
