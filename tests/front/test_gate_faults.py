"""The gate with a fake engine that misbehaves on cue: the request never fails because of autosessd."""

import json
import os
import socket
import time
import urllib.error
import urllib.request

import pytest

from autosessd.base.keys import conversation_key
from fake_engine import answer_for
from harness import Daemon, FakeEngine, chat_body, saves_final, wait_until

A = chat_body("conversation A " * 200)
B = chat_body("conversation B " * 200)


def post(base, body, path="/v1/chat/completions", timeout=60):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.load(r)


@pytest.fixture
def fake(session_dir):
    started = []

    def make(*faults, **kw):
        f = FakeEngine(session_dir, list(faults), **kw).start()
        started.append(f)
        return f

    yield make
    for f in started:
        f.stop()


def test_save_that_hangs_gives_up_after_timeout_and_request_runs(fake, session_dir, tmp_path):
    """The engine never answers the save. autosessd gives up after engine.timeout_s and
    forwards the request unchanged; it never fails the request itself.

    Where the fake differs: it answers the chat while the save still hangs. llama-server runs
    a slot's tasks in order, so a save that really hung there would hold the chat behind it
    too; the answer would come whenever the engine got to it. So this asserts only what holds
    for both: the wait lasted at least the timeout, the save counts as failed, nothing was
    restored or kept, and the answer is the engine's answer to this very request."""
    eng = fake("hang-save")
    d = Daemon(tmp_path, session_dir, eng.url, timeout_s=1.5).start()
    try:
        post(d.gate_url, A)
        t0 = time.monotonic()
        status, body = post(d.gate_url, B)
        assert time.monotonic() - t0 >= 1.5  # the turn waited for the save until it gave up
        assert status == 200 and body["choices"][0]["message"]["content"] == answer_for(B)
        st = d.status()
        assert st["counters"]["save_failures"] == 1 and st["counters"]["restores"] == 0
        assert "did not answer POST /slots/0?action=save within 1.5 s" in d.logtext()
        assert not list(session_dir.glob("auto-*"))
    finally:
        d.stop()


@pytest.mark.parametrize("fault, why", [("500-save", "answered 500"), ("bad-json-save", "not JSON"),
                                        ("short-save", "the engine reported")])
def test_bad_save_answers_leave_the_request_alone(fake, session_dir, tmp_path, fault, why):
    eng = fake(fault)
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        post(d.gate_url, A)
        status, through_gate = post(d.gate_url, B)
        _, direct = post(eng.url, B)
        assert status == 200
        # The fake's answer depends on the conversation it was sent: B's, unchanged.
        assert through_gate["choices"] == direct["choices"]
        assert through_gate["choices"][0]["message"]["content"] == answer_for(B) != answer_for(A)
        st = d.status()
        assert st["counters"]["save_failures"] == 1
        assert f"auto sessions: save to auto-{conversation_key(A)}.bin: " in d.logtext() and why in d.logtext()
        assert not list(session_dir.glob("auto-*")) and not list(session_dir.glob(".autosessd-*"))
    finally:
        d.stop()


def test_restore_that_fails_leaves_the_request_alone(fake, session_dir, tmp_path):
    eng = fake("500-restore")
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        post(d.gate_url, A)
        post(d.gate_url, B)
        status, body = post(d.gate_url, A)
        assert status == 200 and body["choices"][0]["message"]["content"] == answer_for(A)
        st = d.status()
        assert st["counters"]["restore_failures"] == 1 and st["counters"]["saves"] == 2
        assert f"auto sessions: restore of auto-{conversation_key(A)}.bin: " in d.logtext()
        # The fake writes its files under the test's umask (0644, as an engine without
        # UMask=0077 would): what autosessd made visible is private all the same.
        saves_final(session_dir)  # B's save at the last switch is finalized after the request
        files = list(session_dir.glob("auto-*"))
        assert len(files) == 4 and {os.stat(f).st_mode & 0o777 for f in files} == {0o600}
    finally:
        d.stop()


def test_file_from_another_model_is_not_restored(fake, session_dir, tmp_path):
    eng = fake(model="model-one")
    d = Daemon(tmp_path, session_dir, eng.url).start()
    post(d.gate_url, A)
    post(d.gate_url, B)
    d.stop()
    eng.stop()
    eng2 = fake(model="model-two")
    d2 = Daemon(tmp_path, session_dir, eng2.url).start()
    try:
        status, _ = post(d2.gate_url, A)
        assert status == 200
        st = d2.status()
        assert st["counters"]["skipped_model_mismatch"] == 1 and st["counters"]["restores"] == 0
        assert "model mismatch" in d2.logtext()
    finally:
        d2.stop()


def test_gate_never_reaches_another_host(fake, session_dir, tmp_path):
    eng = fake()
    d = Daemon(tmp_path, session_dir, eng.url).start()

    def raw(request: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", d.gate_port)) as s:
            s.sendall(request)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return data

    try:
        # An absolute-form URI goes to the configured engine (which answers ok), never to its host.
        data = raw(b"GET http://203.0.113.9:81/health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert data.startswith(b"HTTP/1.1 200") and (b'"status": "ok"' in data or b'"status":"ok"' in data)
        # A foreign Host while the gate listens on loopback: a page reaching it through DNS
        # rebinding. Refused before anything is forwarded, in the API's error shape (issue 19.9).
        data = raw(b"GET /health HTTP/1.1\r\nHost: rebind.example:8080\r\nConnection: close\r\n\r\n")
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 403")
        err = json.loads(body)["error"]
        assert err["src"] == "autosessd" and "DNS rebinding" in err["message"] and "allowed_hosts" in err["message"]
    finally:
        d.stop()


def test_request_log_lines(fake, session_dir, tmp_path):
    eng = fake()
    log = tmp_path / "gate.jsonl"
    d = Daemon(tmp_path, session_dir, eng.url, args=["--gate-request-log", str(log)]).start()
    try:
        post(d.gate_url, A)
        lines = [json.loads(x) for x in wait_until(lambda: log.exists() and log.read_text().count("\n") >= 2 and
                                                   log.read_text().splitlines(), 10, what="two log lines")]
        start, end = lines
        assert start["event"] == "start" and start["key"] == conversation_key(A) and start["slot"] == 0
        assert end["event"] == "end" and end["id"] == start["id"] and end["status"] == "ok"
        assert end["n_tokens"] > 0
    finally:
        d.stop()


def test_request_log_follows_rotation_by_rename(fake, session_dir, tmp_path):
    eng = fake()
    log = tmp_path / "gate.jsonl"
    d = Daemon(tmp_path, session_dir, eng.url, args=["--gate-request-log", str(log)]).start()
    try:
        post(d.gate_url, A)
        log.rename(tmp_path / "gate.jsonl.1")
        post(d.gate_url, B)
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        assert [x["event"] for x in lines] == ["start", "end"]
        assert lines[0]["key"] == conversation_key(B)
        assert len((tmp_path / "gate.jsonl.1").read_text().splitlines()) == 2
    finally:
        d.stop()


def test_a_body_over_the_limit_gets_413_from_the_gate(fake, session_dir, tmp_path):
    eng = fake()
    d = Daemon(tmp_path, session_dir, eng.url, gate_toml="max_body_mb = 0.5").start()
    try:
        big = chat_body("x" * 600_000)
        for chunked in (False, True):  # with Content-Length, and streamed without one
            data = json.dumps(big).encode()
            req = urllib.request.Request(d.gate_url + "/v1/chat/completions",
                                         data=iter([data]) if chunked else data,
                                         headers={"Content-Type": "application/json",
                                                  **({"Transfer-Encoding": "chunked"} if chunked else {})})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=30)
            assert e.value.code == 413
            err = json.load(e.value)["error"]
            assert err["src"] == "autosessd" and "gate.max_body_mb = 0.5" in err["message"], err
        assert d.status()["counters"]["turns"] == 0  # refused before the turn
        status, _ = post(d.gate_url, chat_body("y" * 400_000))  # under the limit: forwarded
        assert status == 200
    finally:
        d.stop()


def test_sigterm_while_the_stop_save_hangs_exits_within_stop_timeout(fake, session_dir, tmp_path):
    """The engine never answers the stop save. Its own timeout (engine.timeout_s, 120 s here)
    would hold the stop for two minutes; stop_timeout_s bounds the whole stop."""
    eng = fake("hang-save")
    d = Daemon(tmp_path, session_dir, eng.url, timeout_s=120, extra_toml="stop_timeout_s = 3").start()
    post(d.gate_url, A)  # held, and over min tokens: the stop saves it
    rc = d.stop(timeout=60)  # killed (rc -9) if it waits for the engine's timeout
    assert rc == 0
    log = d.logtext()
    assert f"stop: gave up on the stop save of slot 0 (conversation {conversation_key(A)}) after " \
           f"stop_timeout_s = 3 s" in log, log
    assert not list(session_dir.glob("auto-*"))


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_gate_listens_on_every_address_in_the_list(fake, session_dir, tmp_path):
    """llama-server takes --host 127.0.0.1,::1; a client that reaches the engine on either
    loopback reaches the gate the same way."""
    if not _ipv6_loopback():
        pytest.skip(reason="this machine has no IPv6 loopback (::1)")
    from harness import free_port

    eng = fake()
    port = free_port()
    d = Daemon(tmp_path, session_dir, eng.url, gate=False,
               extra_toml=f'[gate]\nlisten = ["127.0.0.1:{port}", "[::1]:{port}"]').start()
    try:
        for base in (f"http://127.0.0.1:{port}", f"http://[::1]:{port}"):
            status, body = post(base, A)
            assert status == 200 and body["choices"], base
        with urllib.request.urlopen(f"http://[::1]:{port}/autosessd/status", timeout=10) as r:
            st = json.load(r)
        assert st["inputs"]["gate"]["listen"] == [f"127.0.0.1:{port}", f"[::1]:{port}"]
        assert st["counters"]["turns"] == 2
    finally:
        d.stop()


def test_a_flood_of_connections_is_capped_timed_out_and_logged_once(fake, session_dir, tmp_path):
    """19.11: 1,100 half-sent requests used to exhaust systemd's 1,024 descriptors and make the
    gate, /autosessd/status and autosessctl status all time out, logging ~17 MB/s. Now the
    open-file limit is raised at start, connections past gate.max_connections get a 503 and
    are closed, a connection that sends no whole request within gate.header_timeout_s gets a
    408 and is closed, the refusals are logged once per interval, and requests go on."""
    import resource

    eng = fake()
    soft0, hard0 = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard0), hard0))  # systemd's default soft limit
    try:
        d = Daemon(tmp_path, session_dir, eng.url, gate_toml="max_connections = 20\nheader_timeout_s = 1.0\n").start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft0, hard0))
    held = []
    try:
        soft = int(next(line.split()[3] for line in open(f"/proc/{d.proc.pid}/limits")
                        if line.startswith("Max open files")))
        hard = int(next(line.split()[4] for line in open(f"/proc/{d.proc.pid}/limits")
                        if line.startswith("Max open files")))
        assert soft == hard == hard0  # raised from the 1,024 it was started with
        for _ in range(60):  # half-sent requests, far more than the cap
            s = socket.create_connection(("127.0.0.1", d.gate_port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            held.append(s)
        answers = []
        for s in held[20:]:
            s.settimeout(5)
            answers.append(s.recv(200))
        assert all(a.startswith(b"HTTP/1.1 503") and b"max_connections" in a for a in answers), answers[:3]
        t0 = time.monotonic()
        for s in held[:20]:  # the first 20 never finished their headers: closed after 1 s
            s.settimeout(5)
            data = s.recv(200)
            assert data.startswith(b"HTTP/1.1 408") or data == b""
        assert time.monotonic() - t0 < 4
        assert post(d.gate_url, A, timeout=10)[0] == 200  # the gate serves again
        assert d.status()["inputs"]["gate"]["refused"]["connections"] == 40
        log = d.logtext()
        assert 1 <= log.count("gate: refused") <= 3  # once per interval, not 60 lines
    finally:
        for s in held:
            s.close()
        d.stop()


def test_a_client_that_hangs_up_at_done_had_its_whole_answer(fake, session_dir, tmp_path):
    """The OpenAI SDK closes a stream as soon as it reads `data: [DONE]`, before the response's
    own end (shell-gpt, llm and others through it). Here the engine ends its response 1 s after
    [DONE] (fault eof-s), so the hang-up always comes first: the request counts as ended with its
    answer (its cache_n, what the slot holds), not as cancelled by the client."""
    eng = fake("eof-s=1")
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        host, port = d.gate_url[len("http://"):].split(":")
        body = json.dumps({**A, "stream": True}).encode()
        with socket.create_connection((host, int(port)), timeout=30) as c:
            c.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n".encode()
                      + b"Content-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            got = b""
            while b"data: [DONE]" not in got:
                chunk = c.recv(65536)
                assert chunk, got
                got += chunk
        assert b'"timings"' in got  # the client had the whole answer, then hung up
        wait_until(lambda: "ended ok" in d.logtext() or "went away" in d.logtext(), 30, what="the request's end")
        assert "went away" not in d.logtext(), d.logtext()[-2000:]
        slot = lambda: d.status()["slots"][0]  # noqa: E731
        wait_until(lambda: slot()["state"] == "held" and slot()["held"] == conversation_key(A), 10,
                   what="the slot held A")
    finally:
        d.stop()
