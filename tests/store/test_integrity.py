"""Issue 19 in-process: no file that is not whole reaches the engine, and hostile names in the
session directory cost nothing. On the stub engine, which records every restore it is asked
for (llama-server aborts on a file one byte short: the stub counting its restores stands for
"the engine saw it"). The real engine, the daemon and the real S3 gateway are in
test_integrity_real.py and test_shared_s3.py."""

import asyncio
import json
import os
import threading
import time

import pytest

from autosessd.base import files
from autosessd.store import slotfile
from autosessd.base.config import parse
from autosessd.engines.base import EngineRefused
from autosessd.store.index import TokenIndex
from autosessd.sessions.facade import Sessions
from autosessd.store.directory import Store
from autosessd.store.names import QUARANTINE
from stub_engine import StubEngine

A, B, C = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "cccccccccccccccc"


class Counting(StubEngine):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.restored: list[str] = []

    async def restore(self, slot, name):
        self.restored.append(name)
        return await super().restore(slot, name)


def make(tmp_path, n_ctx=None, **kw):
    d = tmp_path / "s"
    d.mkdir(exist_ok=True)
    cfg = parse(f'slot_save_path = "{d}"\nauto_sessions_min_tokens = 10\nstate_dir = "{tmp_path / "state"}"\n'.encode())
    return Sessions(cfg, Counting(d, **kw), Store(d), "stub-model", n_ctx=n_ctx), d


async def request(s, key, n):
    async with await s.admit() as t:
        turn = await s.turn(t, key)
        s.engine.ran(list(range(1000 * (ord(key[0]) - 96), 1000 * (ord(key[0]) - 96) + n)))
        await s.ended(t, key, "ok")
    await s.drain()
    return turn


async def saved_then_away(tmp_path, **kw):
    """A saved (50 tokens) and B on the slot: the next request of A restores A's file."""
    s, d = make(tmp_path, **kw)
    await request(s, A, 50)
    await request(s, B, 40)
    assert (d / f"auto-{A}.bin").exists() and s.engine.restored == []
    return s, d


def quarantined(d):
    return sorted(p.name for p in (d / QUARANTINE).glob("*.why")) if (d / QUARANTINE).exists() else []


@pytest.mark.parametrize("damage", ["one byte short", "one byte flipped", "a byte flipped, mtime put back",
                                    "a symbolic link"])
async def test_a_damaged_file_never_reaches_the_engine_and_is_moved_aside(tmp_path, damage):
    """19.2 and 19.6, and a flipped byte: the file the key rule would restore is checked first
    (its size against its metadata, always; its digest when its identity changed since it was
    saved). It is refused, moved aside with why, and the request re-reads (nothing restored)."""
    s, d = await saved_then_away(tmp_path)
    path = d / f"auto-{A}.bin"
    data = path.read_bytes()
    st = path.stat()
    if damage == "one byte short":
        os.truncate(path, len(data) - 1)
    elif damage.startswith("one byte flipped") or damage.startswith("a byte flipped"):
        with open(path, "r+b") as f:
            f.seek(len(data) - 3)
            f.write(bytes([data[-3] ^ 0x01]))
        if "mtime put back" in damage:
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:  # a link to a file outside the directory, under the auto name
        outside = tmp_path / "outside.bin"
        outside.write_bytes(data)
        path.unlink()
        path.symlink_to(outside)
    turn = await request(s, A, 55)
    assert s.engine.restored == [] and turn.restored is None  # the engine never saw it
    assert any("refused" in e for e in turn.errors), turn.errors
    assert s.counters.restores_refused == 1 and s.counters.quarantined == 1
    assert not path.exists() and not path.is_symlink() and len(quarantined(d)) == 1
    note = json.loads(next((d / QUARANTINE).glob("*.why")).read_text())
    assert note["name"] == f"auto-{A}.bin" and note["why"]
    rows = await asyncio.get_running_loop().run_in_executor(None, s.ls)
    assert [r["kind"] for r in rows if r["name"] == f"auto-{A}.bin"] == ["quarantined"]
    st = await asyncio.get_running_loop().run_in_executor(None, s.status)
    assert st["store"]["quarantined"]["files"] == 1 and st["counters"]["quarantined"] == 1
    if damage == "a symbolic link":
        assert (tmp_path / "outside.bin").read_bytes() == data  # the link moved, not what it points to


async def test_a_whole_file_is_checked_by_a_stat_and_restored(tmp_path):
    s, d = await saved_then_away(tmp_path)
    meta = json.loads((d / f"auto-{A}.json").read_text())
    assert meta["digest"].startswith("xxh3-128:") and meta["ident"][2] == meta["bytes"]
    turn = await request(s, A, 55)
    assert s.engine.restored == [f"auto-{A}.bin"] and turn.restored is not None
    assert s.counters.restores_refused == 0 and quarantined(d) == []


async def test_a_file_copied_back_is_checked_once_by_its_digest_then_trusted(tmp_path, monkeypatch):
    """A file whose identity changed (restored from a backup: a new inode) but whose bytes are
    the same passes its digest check, and later restores need a stat only."""
    s, d = await saved_then_away(tmp_path)
    path = d / f"auto-{A}.bin"
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)
    digests = []
    real = files.digest_file
    monkeypatch.setattr(files, "digest_file", lambda p: digests.append(os.path.basename(p)) or real(p))
    await request(s, A, 50)  # restores A (the same 50 tokens: its file stays as it is)
    await request(s, B, 40)
    await request(s, A, 50)  # and again
    assert s.engine.restored == [f"auto-{A}.bin", f"auto-{B}.bin", f"auto-{A}.bin"]
    assert digests.count(f"auto-{A}.bin") == 1 and s.counters.restores_refused == 0


async def test_a_file_longer_than_the_engines_context_is_not_handed_to_it(tmp_path):
    """19.8: a save of more tokens than the target slot's context (another engine's, a bigger
    -c) is refused before the restore, with the reason; it is not damaged, so it stays."""
    s, d = await saved_then_away(tmp_path, n_ctx=30)
    turn = await request(s, A, 55)
    assert s.engine.restored == [] and s.counters.restores_refused == 1 and s.counters.quarantined == 0
    assert any("more than the engine's context of 30" in e for e in turn.errors)
    assert (d / f"auto-{A}.bin").exists()


async def test_a_refused_restore_says_the_engine_may_hold_spoiled_state_until_it_restarts(tmp_path):
    s, d = await saved_then_away(tmp_path)

    async def refusing(slot, name):
        raise EngineRefused("POST /slots answered 400: Unable to restore slot: invalid slot save file")

    s.engine.restore = refusing
    await request(s, A, 55)
    st = await asyncio.get_running_loop().run_in_executor(None, s.status)
    assert st["engine"]["suspect"]["file"] == f"auto-{A}.bin"
    await s.engine_restarted("the engine restarted")
    assert (await asyncio.get_running_loop().run_in_executor(None, s.status))["engine"]["suspect"] is None


# -- hostile names in the directory --------------------------------------------------------
def plant(d, kind, name):
    path = d / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "10 GB":
        with open(path, "wb") as f:
            f.truncate(10 * 1024 ** 3)
    return path


def bounded(fn, seconds=5.0):
    """fn() in a thread; it must return within `seconds` (a FIFO read would block for ever)."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} did not return within {seconds} s"
    return out.get("v")


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "10 GB"])
def test_metadata_that_is_not_a_small_regular_file_is_never_waited_on(tmp_path, kind):
    """19.3: auto-<16 hex>.json as a FIFO, a link to /dev/zero, a 10 GB file: read as metadata
    it blocked for ever (cleanup at start, every `ls`) or read without end. Now it is refused
    at once: no metadata, so its .bin counts as an interrupted save."""
    d = tmp_path / "s"
    d.mkdir()
    store = Store(d)
    (d / f"auto-{A}.bin").write_bytes(slotfile.build(list(range(50)), b"\0" * 500))
    plant(d, kind, f"auto-{A}.json")
    (d / f"auto-{B}.bin").write_bytes(slotfile.build(list(range(60)), b"\0" * 600))
    plant(d, kind, f"auto-{B}.json.x")  # not ours: left alone
    t0 = time.monotonic()
    assert bounded(lambda: store.read_meta(A)) is None
    assert bounded(lambda: store.scan()) is not None
    assert bounded(lambda: store.quarantined()) == []
    removed = bounded(store.cleanup)
    assert time.monotonic() - t0 < 5
    assert any(r.startswith(f"auto-{A}.bin") for r in removed)
    assert (d / f"auto-{B}.json.x").exists() or (d / f"auto-{B}.json.x").is_symlink()


def test_a_header_claiming_50_million_tokens_costs_nothing(tmp_path):
    """19.4: a small sparse file whose header claims 50 M tokens took the daemon to ~1 GB at
    every start (its index cache to 200 MB). The header is not read past the engine's context."""
    d = tmp_path / "s"
    d.mkdir()
    path = d / "huge.bin"
    with open(path, "wb") as f:
        f.write(slotfile.MAGIC_BYTES + (4).to_bytes(4, "little") + (50_000_000).to_bytes(4, "little"))
        f.truncate(12 + 4 * 50_000_000)  # sparse: 200 MB by its size, 4 kB on the disk
    idx = TokenIndex(d, tmp_path / "index.cache", max_tokens=8192)
    t0 = time.monotonic()
    report = idx.scan()
    assert time.monotonic() - t0 < 1.0
    assert "huge.bin" in report.skipped and "8,192 tokens" in report.skipped["huge.bin"]
    idx.save_cache()
    cache = tmp_path / "index.cache"
    assert not cache.exists() or cache.stat().st_size < 10_000


# -- ls ----------------------------------------------------------------------------------
async def test_a_file_that_cannot_be_detokenized_loses_its_words_only(tmp_path):
    """19.7: one file holding a token outside the vocabulary made /detokenize answer 500 and
    every older file showed no first words. Now only that file says why."""
    s, d = make(tmp_path)
    await s.prepare()
    await request(s, A, 50)
    await request(s, B, 40)
    await request(s, C, 30)
    await request(s, A, 50)  # C saved
    real = s.engine.detokenize

    async def detokenize(tokens, timeout_s=None):
        if tokens and tokens[0] == 2000:  # B's
            raise EngineRefused("POST /detokenize answered 500: invalid token id 2000")
        return await real(tokens)

    s.engine.detokenize = detokenize
    rows = {r["name"]: r for r in await s.ls_words()}
    assert rows[f"auto-{B}.bin"]["words"] is None and "invalid token" in rows[f"auto-{B}.bin"]["words_error"]
    assert rows[f"auto-{A}.bin"]["words"] is not None and rows[f"auto-{C}.bin"]["words"] is not None


# -- the control socket's events follower --------------------------------------------------
async def test_an_events_follower_that_sends_data_is_not_buffered(tmp_path):
    """19.11: after `events -f` whatever the peer sent was kept in memory (300 MB grew the
    daemon by 321 MB). It is read and dropped."""
    import resource

    from autosessd.front import protocol
    from autosessd.front.control import ControlServer

    s, d = make(tmp_path)
    cfg = parse(f'slot_save_path = "{d}"\nstate_dir = "{tmp_path / "state"}"\n[control]\nsocket = '
                f'"{tmp_path / "run" / "c.sock"}"\n'.encode())
    srv = ControlServer(cfg, s)
    await srv.start()
    try:
        r, w = await asyncio.open_unix_connection(str(srv.path))
        w.write(json.dumps({"v": protocol.VERSION, "cmd": "events", "args": {"follow": True}}).encode() + b"\n")
        await w.drain()
        assert json.loads(await r.readline())["ok"]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        chunk = b"x" * (1 << 20)
        for _ in range(200):  # 200 MB
            w.write(chunk)
            await w.drain()
        s.events.emit("test")
        assert json.loads(await asyncio.wait_for(r.readline(), 10))["event"]["type"] == "test"
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        assert grown_mb < 50, f"the daemon kept what the follower sent: +{grown_mb:.0f} MB"
        w.close()
    finally:
        await srv.stop(1)


async def test_a_file_chosen_by_its_tokens_is_checked_as_one_chosen_by_name(tmp_path):
    """19.2: the token index chose a file by the tokens its header held when it was indexed;
    the file was cut short since. It is refused before the engine sees it."""
    s, d = make(tmp_path)
    await s.prepare()

    async def chat(text):
        b = {"messages": [{"role": "user", "content": text}]}
        from autosessd.base.keys import conversation_key
        key = conversation_key(b)
        async with await s.admit() as t:
            turn = await s.turn(t, key, body=b)
            s.engine.chat(b, "Aye.")
            await s.ended(t, key, "ok")
        await s.drain()
        return key, turn

    ka, _ = await chat("Arr, the sea is wide and the ships are many. " * 4)
    await chat("Objection sustained; the contract is void for vagueness. " * 4)
    path = d / f"auto-{ka}.bin"
    os.truncate(path, path.stat().st_size - 1)
    _, turn = await chat("Arr, the sea is wide and the ships are many. " * 4)
    assert s.engine.restored == [] and turn.restored is None and s.counters.restores_refused == 1
    assert s.index.get(f"auto-{ka}.bin") is None and len(quarantined(d)) == 1
