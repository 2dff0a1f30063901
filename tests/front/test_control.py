"""The control socket in-process: framing, the malformed-input matrix, peer checks, hostile names."""

import asyncio
import json
import os
import stat

import pytest

from autosessd.front import protocol
from autosessd.base.config import parse
from autosessd.front.control import ControlServer, SocketInUse
from autosessd.sessions.facade import Sessions
from autosessd.store.directory import Store
from stub_engine import StubEngine


@pytest.fixture
async def server(tmp_path, session_dir, monkeypatch):
    cfg = parse(f'slot_save_path = "{session_dir}"\nauto_sessions_min_tokens = 10\n'
                f'state_dir = "{tmp_path / "state"}"\n[control]\nsocket = "{tmp_path / "run" / "a.sock"}"\n'.encode())
    engine = StubEngine(session_dir)
    sessions = Sessions(cfg, engine, Store(session_dir), "stub-model", "stub")
    monkeypatch.setattr(protocol, "IDLE_TIMEOUT_S", 0.5)
    srv = ControlServer(cfg, sessions)
    await srv.start()
    yield srv
    await srv.stop(1)


async def hold(s, key, n):
    """A request of conversation `key` ran through the FIFO and left n tokens in the slot."""
    async with await s.admit() as t:
        await s.turn(t, key)
        s.engine.ran(n)
        await s.ended(t, key, "ok")
    await s.drain()


async def ask(srv, raw: bytes):
    r, w = await asyncio.open_unix_connection(str(srv.path), limit=1 << 20)
    try:
        w.write(raw)
        await w.drain()
    except OSError:
        pass  # the server answered (busy, too large) and closed before reading it all
    line = await asyncio.wait_for(r.readline(), 5)
    w.close()
    return json.loads(line) if line else None


async def test_socket_mode_and_directory(server):
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(server.path.parent).st_mode) == 0o700


@pytest.mark.parametrize("raw, code", [
    (b"x" * (protocol.MAX_REQUEST + 10) + b"\n", "too_large"),
    (b"not json\n", "bad_request"),
    (b"[1, 2]\n", "bad_request"),
    (b"\xff\xfe\n", "bad_request"),
    (b'{"v": 1}\n', "bad_request"),
    (b'{"cmd": 5}\n', "bad_request"),
    (b'{"cmd": "nope"}\n', "unknown_command"),
    (b'{"v": 2, "cmd": "status"}\n', "version_mismatch"),
    (b'{"cmd": "status", "args": []}\n', "bad_args"),
    (b'{"cmd": "park", "args": {"name": 5}}\n', "bad_args"),
    (b'{"cmd": "prune", "args": {"keep": true}}\n', "bad_args"),
    (b'{"cmd": "prune", "args": {"keep": -1}}\n', "bad_args"),
    (b'{"cmd": "restore", "args": {}}\n', "bad_args"),
    (b'{"cmd": "status", "args": {"x": 1}}\n', "bad_args"),
    (b'{"cmd": "forget", "args": {"key": "../../etc/passwd"}}\n', "bad_args"),
    (b'{"cmd": "turn", "args": {"key": "zz"}}\n', "bad_args"),
    (b'{"cmd": "turn", "args": {}}\n', "bad_args"),
    (b"[" * 100000 + b"\n", "too_large"),
])
async def test_malformed_requests_get_clear_errors_and_daemon_keeps_serving(server, raw, code):
    reply = await ask(server, raw)
    assert reply["ok"] is False and reply["error"]["code"] == code, reply
    assert reply["error"]["message"]
    st = await ask(server, protocol.request("status"))
    assert st["ok"] and st["result"]["store"]["path"]


async def test_deep_nesting_within_the_size_cap(server):
    reply = await ask(server, b"[" * 30000 + b"\n")
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request"


async def test_idle_client_times_out_and_half_lines_are_ignored(server):
    r, w = await asyncio.open_unix_connection(str(server.path))
    line = await asyncio.wait_for(r.readline(), 5)
    assert json.loads(line)["error"]["code"] == "timeout"
    w.close()
    # A client that hangs up mid-line and one that hangs up before reading its answer.
    for raw in (b'{"cmd": "sta', protocol.request("status")):
        r, w = await asyncio.open_unix_connection(str(server.path))
        w.write(raw)
        await w.drain()
        w.close()
    assert (await ask(server, protocol.request("status")))["ok"]


async def test_several_requests_on_one_connection(server):
    r, w = await asyncio.open_unix_connection(str(server.path))
    w.write(protocol.request("status") + protocol.request("ls") + b"\n" + protocol.request("events"))
    await w.drain()
    replies = [json.loads(await r.readline()) for _ in range(3)]
    assert all(x["ok"] for x in replies)
    w.close()


async def test_hundreds_of_connections_at_once(server):
    async def one():
        return await ask(server, protocol.request("status"))

    replies = await asyncio.gather(*[one() for _ in range(300)])
    assert sum(1 for x in replies if x["ok"]) >= 200
    assert all(x["ok"] or x["error"]["code"] == "busy" for x in replies)
    assert (await ask(server, protocol.request("status")))["ok"]


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/b", ".hidden", "", "x" * 10_000, "a\0b", "a\nb",
                                  "auto-0123456789abcdef"])
async def test_hostile_park_and_restore_names(server, session_dir, name):
    await hold(server.sessions, "0123456789abcdef", 100)
    before = sorted(os.listdir(session_dir))
    for cmd, args in (("park", {"name": name}), ("restore", {"what": name})):
        reply = await ask(server, protocol.request(cmd, **args))
        assert reply["ok"] is False and reply["error"]["code"] == "failed", reply
    assert sorted(os.listdir(session_dir)) == before
    assert not os.path.exists("/etc/passwd.bin") and not (session_dir.parent / "x.bin").exists()


async def test_park_restore_forget_prune(server, session_dir):
    s = server.sessions
    await hold(s, "0123456789abcdef", 50)
    (session_dir / "notes.txt").write_text("mine")
    r = await ask(server, protocol.request("park"))
    assert r["ok"] and r["result"]["file"] == "auto-0123456789abcdef.bin" and r["result"]["n_tokens"] == 50
    r = await ask(server, protocol.request("park", name="keepme"))
    assert r["ok"] and (session_dir / "keepme.bin").exists()
    ls = (await ask(server, protocol.request("ls")))["result"]
    assert {x["name"]: x["kind"] for x in ls} == {"auto-0123456789abcdef.bin": "auto", "keepme.bin": "manual"}
    s.engine.ran(0)
    r = await ask(server, protocol.request("restore", what="keepme"))
    assert r["ok"] and len(s.engine.tokens) == 50
    r = await ask(server, protocol.request("prune", dry_run=True, keep=0))
    assert r["result"]["removed"][0]["file"] == "auto-0123456789abcdef.bin"
    assert (session_dir / "auto-0123456789abcdef.bin").exists()
    r = await ask(server, protocol.request("prune", keep=0))
    assert r["ok"] and not (session_dir / "auto-0123456789abcdef.bin").exists()
    assert (session_dir / "keepme.bin").exists() and (session_dir / "notes.txt").read_text() == "mine"
    r = await ask(server, protocol.request("forget", key="0123456789abcdef"))
    assert r["ok"] is False and r["error"]["code"] == "not_found"


async def test_turn_hook_runs_the_turn(server, session_dir):
    s = server.sessions
    r = await ask(server, protocol.request("turn", messages=[{"role": "user", "content": "Hello"}]))
    assert r["ok"] and r["result"]["key"] == "f7ff9e8b7bb2e09b"
    s.engine.ran(40)  # the serving layer ran A's request on the engine
    r = await ask(server, protocol.request("turn", key="aaaaaaaaaaaaaaaa"))
    assert r["result"]["saved"]["key"] == "f7ff9e8b7bb2e09b" and r["result"]["saved"]["n_tokens"] == 40
    s.engine.ran(30)
    r = await ask(server, protocol.request("turn", key="f7ff9e8b7bb2e09b"))
    assert r["result"]["restored"]["n_tokens"] == 40 and len(s.engine.tokens) == 40


async def test_events_follow_sees_a_save_and_ends_on_hangup(server):
    s = server.sessions
    r, w = await asyncio.open_unix_connection(str(server.path))
    w.write(protocol.request("events", follow=True))
    await w.drain()
    assert json.loads(await r.readline())["result"]["following"] is True
    await hold(s, "0123456789abcdef", 20)
    assert (await ask(server, protocol.request("park")))["ok"]
    types = []
    while "saved" not in types:
        types.append(json.loads(await asyncio.wait_for(r.readline(), 5))["event"]["type"])
    assert types == ["turn", "saving", "saved"]
    w.close()
    await asyncio.sleep(0.1)
    assert not s.events._followers


async def test_a_second_daemon_on_the_same_socket_is_refused(server):
    other = ControlServer(server.cfg, server.sessions)
    with pytest.raises(SocketInUse, match="another autosessd is running"):
        await other.start()


async def test_stale_socket_is_replaced(tmp_path, session_dir):
    import socket as so

    path = tmp_path / "run" / "a.sock"
    path.parent.mkdir()
    s = so.socket(so.AF_UNIX)
    s.bind(str(path))
    s.close()  # the file stays, nobody listens: a crashed daemon's socket
    cfg = parse(f'slot_save_path = "{session_dir}"\nstate_dir = "{session_dir}-state"\n[control]\nsocket = "{path}"\n'.encode())
    srv = ControlServer(cfg, Sessions(cfg, StubEngine(session_dir), Store(session_dir), "m"))
    await srv.start()
    try:
        assert (await ask(srv, protocol.request("status")))["ok"]
    finally:
        await srv.stop(1)
    assert not path.exists()


def test_peer_check():
    srv = ControlServer.__new__(ControlServer)
    srv.gid = None
    assert srv.allowed(os.getuid(), 0) and srv.allowed(0, 0)
    assert not srv.allowed(os.getuid() + 12345, 12345) and not srv.allowed(None, None)
    srv.gid = 4242
    assert srv.allowed(54321, 4242)


class _Uploads:
    """Stands in for remote.Remote where only the calls matter: which saves were queued for
    the shared bucket (the real tier is tested against a real S3 server: test_shared_s3.py,
    test_shared_daemon.py)."""

    def __init__(self):
        self.shared = self
        self.queued: list[str] = []

    def upload_later(self, path, meta):
        self.queued.append(os.path.basename(path))

    def status(self):
        return {}


async def test_auto_saves_are_queued_for_the_bucket_and_parked_names_stay_local(server, session_dir):
    s = server.sessions
    s.remote = up = _Uploads()
    await hold(s, "0123456789abcdef", 50)
    assert (await ask(server, protocol.request("park", name="keepme")))["ok"]
    assert (await ask(server, protocol.request("park")))["ok"]
    await s.drain()  # the finalize's callback queues the upload
    assert up.queued == ["auto-0123456789abcdef.bin"] and (session_dir / "keepme.bin").exists()


async def test_prune_shared_on_a_daemon_without_a_bucket_says_so(server):
    r = await ask(server, protocol.request("prune", shared=True, dry_run=True))
    assert r["ok"] is False and "no shared bucket" in r["error"]["message"] and "[shared]" in r["error"]["message"]


def test_status_text_names_downloads_the_bucket_tier_did_not_try():
    """A failing bucket and a save of another KV layout are why a turn re-read: status says so."""
    from autosessd.ctl_text import shared_lines

    sh = {"bucket": "b", "prefix": "p/", "endpoint": "http://s3", "host": "h1", "catalog": {},
          "uploads_pending": 0, "uploads_retrying": 0, "uploads_done": 3, "upload_failures": 0, "bytes_up": 1,
          "downloads": 1, "download_failures": 2, "downloads_skipped_slower": 0, "downloads_skipped_unreachable": 5,
          "downloads_refused_layout": 1, "bytes_down": 1, "download_ms_total": 12.0}
    text = "\n".join(shared_lines(sh))
    assert "5 while the bucket failed" in text and "1 refused (another KV layout)" in text
