"""Several hosts on one bucket, through the daemon as users run it: `autosessd run` with a
[shared] table, its gate in front of an engine, against the real S3 server (Ceph RADOS
Gateway, scripts/s3-gateway), never a mock.

Two "hosts" are two engine + autosessd pairs with their own session directories and host
names on one bucket (the two_hosts fixture). The start checks need no gateway at all.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

import pytest

from autosessd.store import slotfile
from autosessd.base.keys import conversation_key
from autosessd.store.directory import auto_name
from harness import Daemon, Engine, FakeEngine, chat_body, free_port, going_on, long_text, saves_final, wait_until
from shared_common import in_bucket, objects, unfinished_uploads


def shared_toml(endpoint: str, bucket: str, host: str, **kw) -> str:
    kw = {"prefix": "team/", "host": host, "list_every_s": 0.5, "retry_max_s": 2, "connect_timeout_s": 2,
          "read_timeout_s": 10, **kw}
    return (f'[shared]\nendpoint_url = "{endpoint}"\nbucket = "{bucket}"\n'
            + "".join(f"{k} = {json.dumps(v)}\n" for k, v in kw.items()))


def post(base: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        return json.load(r)


def metrics(d: Daemon) -> str:
    with urllib.request.urlopen(d.gate_url + "/autosessd/metrics", timeout=10) as r:
        return r.read().decode()


def ctl(d: Daemon, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-c", "from autosessd.cli import autosessctl_main; autosessctl_main()",
                        "--socket", str(d.socket), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def shared(d: Daemon) -> dict:
    return d.status()["shared"]


def whole_local_files(d: Path) -> None:
    """Nothing torn in a session directory: no temporary left once the saves in flight are
    final (a save's finalize runs after its request), every auto file whole (its size is its
    metadata's, its header readable)."""
    saves_final(d)
    for p in d.glob("auto-*.bin"):
        meta = json.loads(p.with_suffix(".json").read_text())
        assert p.stat().st_size == meta["bytes"], p.name
        assert slotfile.read_header(p).n_tokens == meta["n_tokens"], p.name


@pytest.fixture
def stopping():
    """Daemons and engines stopped after the test, whatever happened."""
    things: list = []
    yield things.append
    for t in reversed(things):
        t.stop()


class Host(NamedTuple):
    """One of two_hosts: its session directory, the engine saving there, its daemon."""

    sessions: Path
    engine: Engine | FakeEngine
    daemon: Daemon


def fake_engines(bytes_per_token: int):
    """An engine factory for two_hosts: the fake engine (no model), its saves bytes_per_token a token."""
    return lambda save_dir: FakeEngine(save_dir, bytes_per_token=bytes_per_token).start()


@pytest.fixture
def two_hosts(s3_gateway, s3_bucket, aws_env, tmp_path):
    """two_hosts(engine, start=True, host2=None, toml="", **shared) → (host 1, host 2): two hosts on the
    test's bucket, as two machines behind a load balancer. Host n has its session directory
    tmp_path/sn, an engine on it (engine(directory) starts one: the `engines` fixture, or
    fake_engines(...)) and `autosessd run` in tmp_path/hn with a [shared] table naming it hostn
    (shared_toml with **shared; host 2's also with host2's keys; toml: top-level keys before
    it, for both). Both daemons are started
    unless start=False, which leaves that to the test. Every daemon, then every engine, is
    stopped after the test, whatever happened (a failing stop does not skip the others)."""
    with contextlib.ExitStack() as stops:
        def make(engine, start: bool = True, host2: dict | None = None, toml: str = "",
                 **shared) -> tuple[Host, Host]:
            hosts = []
            for n, own in ((1, {}), (2, host2 or {})):
                s, h = tmp_path / f"s{n}", tmp_path / f"h{n}"
                s.mkdir()
                e = engine(s)
                stops.callback(e.stop)  # an `engines` engine's own stop at its teardown is then a no-op
                h.mkdir()
                d = Daemon(h, s, e.url, extra_toml=toml + shared_toml(s3_gateway.endpoint, s3_bucket, f"host{n}",
                                                                      **{**shared, **own}))
                stops.callback(d.stop)
                hosts.append(Host(s, e, d))
            if start:
                for host in hosts:
                    host.daemon.start()
            return hosts[0], hosts[1]

        yield make


# -- the start ----------------------------------------------------------------------------
def test_shared_without_credentials_refuses_the_start_saying_what_is_missing(tmp_path, monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    # boto3's chain must find nothing: no files, no instance metadata service.
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    (tmp_path / "s").mkdir()
    d = Daemon(tmp_path, tmp_path / "s", f"http://127.0.0.1:{free_port()}", gate=False,
               extra_toml=shared_toml(f"http://127.0.0.1:{free_port()}", "sessions", "host1"))
    with pytest.raises(AssertionError, match="exited with 1"):
        d.start(timeout=60)
    assert "cannot start: [shared] in" in d.logtext() and "no S3 credentials" in d.logtext()


def test_a_bucket_that_does_not_answer_is_a_warning_and_the_host_works_alone(tmp_path, monkeypatch, stopping):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    s = tmp_path / "s"
    s.mkdir()
    eng = FakeEngine(s).start()
    stopping(eng)
    # No save while idle: B's, 3 s after its reply, would be a second upload pending.
    d = Daemon(tmp_path, s, eng.url, extra_toml="idle_save_s = 0\n" + shared_toml(
        f"http://127.0.0.1:{free_port()}", "sessions", "host1"))
    stopping(d)
    d.start()
    assert "auto sessions: shared: bucket sessions at http://127.0.0.1:" in d.logtext()
    a, b = chat_body(long_text(30) + "\nBox 5?"), chat_body(long_text(30, "jar") + "\nJar 2?")
    post(d.gate_url, a)
    post(d.gate_url, b)  # a switch: A is saved locally, its upload waits for the bucket
    wait_until(lambda: (s / auto_name(conversation_key(a))).exists(), 30, what="A's local save")
    wait_until(lambda: shared(d)["upload_failures"] >= 1, 30, what="the upload to be tried")
    st = shared(d)
    assert st["uploads_pending"] == 1 and st["uploads_done"] == 0
    assert "uploads are failing" in ctl(d, "status").stdout
    # The stop does not wait on a bucket that does not take the upload.
    assert d.stop(timeout=30) == 0
    assert "upload(s) not done" in d.logtext()


# -- two hosts, one bucket ----------------------------------------------------------------
@pytest.mark.s3
@pytest.mark.engine
def test_a_conversation_from_host_1_continues_on_host_2_through_its_gate(engines, s3_gateway, s3_bucket,
                                                                         two_hosts, model):
    # No save while idle: A's, 3 s after host 1's third answer, would leave its stop nothing to save.
    (_, _, d1), (s2, _, d2) = two_hosts(engines, toml="idle_save_s = 0\n")
    a = chat_body(long_text(70) + "\nHow many marbles are in box 5?")  # ~1,250 tokens
    b = chat_body(long_text(20, "jar") + "\nWhich jar is red?")
    first = post(d1.gate_url, a)
    # The engine's prompt rate, which the estimate weighs a download against, is measured.
    wait_until(lambda: shared(d1)["prefill_tokens_s"], 30, what="host 1's prompt rate")
    post(d1.gate_url, b)  # the switch saves A on host 1 and queues its upload
    wait_until(lambda: shared(d1)["uploads_done"] >= 1, 60, what="host 1's upload of A")
    # Host 2 reads the bucket every list_every_s: A's save and its tokens are in its catalog.
    wait_until(lambda: shared(d2)["catalog"]["with_tokens"] >= 1, 30, what="host 2 to see A's save")

    a2 = {**a, "messages": a["messages"] + [first["choices"][0]["message"],
                                            {"role": "user", "content": "And how many are in box 7?"}]}
    second = post(d2.gate_url, a2)  # the load balancer sent A's next request to host 2
    reused, prompt = second["timings"]["cache_n"], second["usage"]["prompt_tokens"]
    assert reused >= 0.9 * prompt, f"host 2 reused {reused} of {prompt} tokens"
    # Host 1's save went up as its manifest and blocks; host 2 keeps it so (no whole file came down).
    assert (s2 / f"auto-{conversation_key(a)}.json").exists()
    st = shared(d2)
    assert st["downloads"] == 1 and st["bytes_down"] > 0 and st["download_ms_total"] > 0
    assert st["blocks_fetched"] > 0 and shared(d1)["manifests_up"] >= 1
    assert "downloading" in d2.logtext() and "re-reading" in d2.logtext()  # the estimate, logged
    # Host 1 answers the same request from its own file: the same answer at temperature 0.
    third = post(d1.gate_url, a2)
    assert second["choices"][0]["message"]["content"] == third["choices"][0]["message"]["content"]

    assert "autosessd_shared_downloads_total 1" in metrics(d2)
    assert "autosessd_shared_uploads_total" in metrics(d1)
    text = ctl(d2, "status").stdout
    assert f"shared    s3 {s3_bucket}/team/" in text and "downloads 1 hits" in text
    report = json.loads(ctl(d1, "prune", "--shared", "--dry-run", "--json").stdout)
    assert report["shared"] and report["done"] and report["dry_run"] and report["saves"] >= 1

    # SIGTERM on host 1: its stop save (it holds A again, now longer) goes up before it exits.
    # Before it, B's save at third's switch is up (its upload is queued after its finalize).
    wait_until(lambda: in_bucket(s3_gateway, s3_bucket, conversation_key(b), "host1", 1), 60,
               what="host 1's upload of B")
    wait_until(lambda: shared(d1)["uploads_pending"] == 0, 60, what="host 1's uploads so far")
    before = shared(d1)["uploads_done"]
    assert d1.stop(signal.SIGTERM) == 0
    assert "upload(s) not done" not in d1.logtext()
    assert len([k for k in objects(s3_gateway, s3_bucket) if k.endswith(("-host1.bin", "-host1.manifest"))]) \
        == before + 1


@pytest.mark.s3
def test_the_gateway_down_mid_upload_and_mid_download_requests_succeed_and_nothing_is_torn(
        s3_gateway, s3_bucket, two_hosts):
    """The fake engine makes a ~300 MB save (it holds no model): big enough that the gateway
    can be killed while the daemon's upload, and then its download, is under way."""
    # No save while idle: B's, 3 s after its reply, would be a second upload pending.
    (s1, _, d1), (s2, _, d2) = two_hosts(fake_engines(250_000), toml="idle_save_s = 0\n", part_mb=8,
                                         prune_every_s=10)
    a = chat_body(long_text(70) + "\nHow many marbles are in box 5?")
    b = chat_body("a short other conversation " * 40)
    post(d1.gate_url, a)
    post(d1.gate_url, b)  # the switch saves A (~300 MB) and queues its upload
    wait_until(lambda: shared(d1)["bytes_up"] > 0, 120, 0.01, what="host 1's upload to begin")
    s3_gateway.down()
    try:
        wait_until(lambda: shared(d1)["upload_failures"] >= 1, 60, what="the cut upload to fail")
        st = shared(d1)
        assert st["uploads_done"] == 0 and st["uploads_pending"] == 1, st
        post(d1.gate_url, a)  # requests go on meanwhile
        whole_local_files(s1)
    finally:
        s3_gateway.up()
    wait_until(lambda: shared(d1)["uploads_done"] >= 1, 120, what="the upload to resume")
    # B's save (the switch back to A during the outage) goes up too; then nothing is in flight.
    wait_until(lambda: shared(d1)["uploads_pending"] == 0, 120, what="host 1's uploads to finish")
    size = (s1 / auto_name(conversation_key(a))).stat().st_size
    # Only whole saves in the bucket (S3 shows an object once complete); the cut multipart
    # upload was aborted when the retry began.
    assert set(objects(s3_gateway, s3_bucket).values()) <= {size, *(
        p.stat().st_size for p in s1.glob("auto-*.bin"))}
    assert unfinished_uploads(s3_gateway, s3_bucket) == []

    # Host 2 gets A's next request; the gateway dies while the download is under way.
    # A and B are both up: host 2's catalog must hold both (B alone, listed before A's upload
    # resumed, would send the request on before A can be found).
    wait_until(lambda: shared(d2)["catalog"]["saves"] >= 2, 30, what="host 2 to see A's save")
    a2 = {**a, "messages": a["messages"] + [{"role": "assistant", "content": "x"},
                                            {"role": "user", "content": "And box 7?"}]}
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(r=post(d2.gate_url, a2)))
    t.start()
    try:
        wait_until(lambda: shared(d2)["bytes_down"] > 0 or not t.is_alive(), 120, 0.005,
                   what="host 2's download to begin")
        s3_gateway.down()
        t.join(120)
        assert got.get("r", {}).get("choices"), "the request failed"
        st = shared(d2)
        assert st["download_failures"] == 1 and st["downloads"] == 0, st
        whole_local_files(s2)
        assert not (s2 / auto_name(conversation_key(a))).exists()  # the download left nothing under its name
        assert "the request re-reads its prompt instead" in d2.logtext()
    finally:
        s3_gateway.up()
    # Beside the turns, the bucket prune runs by itself (prune_every_s), one host at a time.
    wait_until(lambda: any((shared(d)["last_prune"] or {}).get("done") for d in (d1, d2)), 60,
               what="a periodic bucket prune")


@pytest.mark.s3
def test_a_download_past_download_timeout_s_is_given_up_and_the_request_re_reads(two_hosts):
    # Host 2's link cannot bring ~25 MB in a millisecond: every download runs past its limit.
    (_, _, d1), (s2, _, d2) = two_hosts(fake_engines(20_000), host2={"download_timeout_s": 0.001})
    a = chat_body(long_text(70) + "\nHow many marbles are in box 5?")
    post(d1.gate_url, a)
    post(d1.gate_url, chat_body("a short other conversation " * 40))
    wait_until(lambda: shared(d1)["uploads_done"] >= 1, 60, what="host 1's upload of A")
    wait_until(lambda: shared(d2)["catalog"]["saves"] >= 1, 30, what="host 2 to see A's save")
    a2 = {**a, "messages": a["messages"] + [{"role": "assistant", "content": "x"},
                                            {"role": "user", "content": "And box 7?"}]}
    r = post(d2.gate_url, a2)
    assert r["choices"] and r["timings"]["cache_n"] == 0  # it ran, re-reading its prompt
    st = shared(d2)
    assert st["download_failures"] == 1 and st["downloads"] == 0, st
    assert "past its time limit (download_timeout_s)" in d2.logtext()
    whole_local_files(s2)
    assert not (s2 / auto_name(conversation_key(a))).exists()


@pytest.mark.s3
def test_sigterm_gives_an_upload_waiting_out_its_backoff_its_try_before_the_exit(s3_gateway, s3_bucket, aws_env,
                                                                                 tmp_path, stopping):
    s1 = tmp_path / "s1"
    s1.mkdir()
    eng = FakeEngine(s1).start()
    stopping(eng)
    # No save while idle: its new upload would be tried as the gateway comes back, while this
    # test is about the one waiting out its backoff.
    d = Daemon(tmp_path, s1, eng.url, extra_toml="idle_save_s = 0\n" + shared_toml(s3_gateway.endpoint, s3_bucket,
                                                                                  "host1", retry_max_s=600))
    stopping(d)
    d.start()
    a = chat_body(long_text(30) + "\nBox 5?")
    s3_gateway.down()
    try:
        post(d.gate_url, a)
        post(d.gate_url, chat_body(long_text(30, "jar") + "\nJar 2?"))  # the switch saves A
        # Five failed tries: the next waits 8-16 s (doubling from 1 s), longer than what follows.
        wait_until(lambda: shared(d)["upload_failures"] >= 5, 90, what="A's upload to back off")
    finally:
        s3_gateway.up()
    assert shared(d)["uploads_done"] == 0
    assert d.stop(signal.SIGTERM) == 0
    # A (waiting out its backoff) and B (the stop save) went up before the exit.
    assert "upload(s) not done" not in d.logtext()
    names = sorted(k.split("/")[3] for k in objects(s3_gateway, s3_bucket))
    assert names == sorted([auto_name(conversation_key(a))[:-4],
                            auto_name(conversation_key(chat_body(long_text(30, "jar") + "\nJar 2?")))[:-4]])


@pytest.mark.s3
@pytest.mark.engine
def test_a_torn_save_in_the_bucket_is_refused_and_never_reaches_the_engine(engines, s3_gateway, s3_bucket,
                                                                            two_hosts):
    """19.1: a newer object for conversation A, one byte short, with its host's metadata (a
    torn upload of a broken peer). Host 2's turn for A's next request used to download it,
    keep it and restore it: the engine aborted (GGML_ASSERT), and again after every restart.
    Now it is refused as it arrives and remembered; the request re-reads, the engine lives on,
    and A's next request there gets A's whole, older save.
    Now that A goes up as a manifest (issue 48), the torn object is A's manifest cut in half:
    refused when the catalog reads it, so that the turn restores host 1's good, older save at once."""
    (_, _, d1), (s2, e2, d2) = two_hosts(engines, start=False)  # host 2 starts once the torn object is up
    d1.start()
    a = chat_body(long_text(70) + "\nHow many marbles are in box 5?")
    b = chat_body(long_text(20, "jar") + "\nWhich jar is red?")
    first = post(d1.gate_url, a)
    wait_until(lambda: shared(d1)["prefill_tokens_s"], 30, what="host 1's prompt rate")
    post(d1.gate_url, b)
    wait_until(lambda: shared(d1)["uploads_done"] >= 1, 60, what="host 1's upload of A")
    key = conversation_key(a)
    c = s3_gateway.client()
    [good] = [k for k in objects(s3_gateway, s3_bucket) if f"/auto-{key}/" in k]
    obj = c.get_object(Bucket=s3_bucket, Key=good)
    data, md = obj["Body"].read(), obj["Metadata"]
    assert good.endswith(".manifest")
    us, n, _ = good.rsplit("/", 1)[1].split(".", 1)[0].split("-")
    torn_key = good.rsplit("/", 1)[0] + f"/{int(us) + 10_000_000:020d}-{n}-host9.manifest"
    c.put_object(Bucket=s3_bucket, Key=torn_key, Body=data[:len(data) // 2],  # cut inside its JSON
                 Metadata={**md, "host": "host9", "saved-at": repr(int(us) / 1e6 + 10)})
    d2.start()  # its first reading of the bucket has the torn object as A's newest save
    # Host 2's estimate needs its own engine's prompt rate: one request of another conversation.
    post(d2.gate_url, chat_body(long_text(20, "cup") + "\nWhich cup?"))
    wait_until(lambda: shared(d2)["catalog"]["with_tokens"] >= 1 and shared(d2)["prefill_tokens_s"], 30,
               what="host 2 to read the bucket")
    pid = e2.proc.pid
    a2 = {**a, "messages": a["messages"] + [first["choices"][0]["message"],
                                            {"role": "user", "content": "And how many are in box 7?"}]}
    second = post(d2.gate_url, a2)
    assert second["timings"]["cache_n"] >= 0.9 * second["usage"]["prompt_tokens"] - 200  # host 1's save
    assert e2.proc.poll() is None and e2.proc.pid == pid and e2.healthy()
    st = shared(d2)
    assert st["downloads_refused_bad"] == 1 and st["bad_objects"] == 1
    assert not (s2 / auto_name(key)).exists() or json.loads((s2 / f"auto-{key}.json").read_text())["host"] == "host1"
    # The next reading of the bucket passes over the torn object: A's whole save is current.
    post(d2.gate_url, b)  # A leaves host 2's slot
    saves_final(s2)  # its save there, finalized after the request, would come back after the unlinks
    (s2 / auto_name(key)).unlink(missing_ok=True)
    (s2 / f"auto-{key}.json").unlink(missing_ok=True)
    after = time.time()
    wait_until(lambda: (shared(d2)["catalog"]["listed_at"] or 0) > after, 30, 0.1,
               what="host 2 to read the bucket again")
    # A goes on from its answer (a client's next request): a whole save of A, the newest,
    # is downloaded and restored. (B's own request may have downloaded host 1's B.)
    before = shared(d2)["downloads"]
    third = post(d2.gate_url, going_on(a2, second, "And in box 8?"))
    assert third["timings"]["cache_n"] >= 0.9 * third["usage"]["prompt_tokens"] - 200
    assert shared(d2)["downloads"] == before + 1 and shared(d2)["downloads_refused_bad"] == 1
