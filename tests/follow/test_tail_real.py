"""The request-log tail with the real engine: a serving layer's log lines make autosessd save
behind, and restore the held conversation after an engine restart."""

import json
import subprocess
import sys

import pytest

from autosessd.base.keys import conversation_key
from harness import Daemon, chat_body, long_text, wait_until

pytestmark = pytest.mark.engine

A = chat_body(long_text(70) + "\nHow many marbles are in box 5?")
B = chat_body(long_text(40, "jar") + "\nWhich jar is red?")
KA, KB = conversation_key(A), conversation_key(B)


def write(log, **d):
    with open(log, "a") as f:
        f.write(json.dumps(d) + "\n")


def status(d):
    r = subprocess.run([sys.executable, "-c", "from autosessd.cli import autosessctl_main; autosessctl_main()",
                        "--socket", str(d.socket), "--json", "status"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def serve(eng, log, rid, body, key=True):
    """What a serving layer does: log start, run the request, log end."""
    write(log, event="start", id=rid, slot=0, **({"key": conversation_key(body)} if key else
                                                  {"messages": body["messages"]}))
    r = eng.post("/v1/chat/completions", body)
    write(log, event="end", id=rid, slot=0, n_tokens=r["usage"]["total_tokens"], status="ok",
          n_prompt=r["usage"]["prompt_tokens"])
    return r


def test_save_behind_and_restore_after_engine_restart(engines, session_dir, tmp_path, model):
    eng = engines(session_dir)
    log = tmp_path / "serving" / "requests.jsonl"  # the directory exists, the file not yet
    log.parent.mkdir()
    d = Daemon(tmp_path, session_dir, eng.url, gate=False, args=["--request-log", str(log)]).start()
    try:
        a1 = serve(eng, log, "r1", A)
        wait_until(lambda: (session_dir / f"auto-{KA}.json").exists(), 15, what="A saved behind")
        meta = json.loads((session_dir / f"auto-{KA}.json").read_text())
        assert meta["n_tokens"] == eng.get("/slots")[0]["n_prompt_tokens"]

        with open(log, "ab") as f:
            f.write(b"garbage\n\xff\xfe\n" + b'{"event": "start", "id": "x", "key": "../../etc"}\n')
        serve(eng, log, "r2", B, key=False)  # messages instead of key
        wait_until(lambda: (session_dir / f"auto-{KB}.json").exists(), 15, what="B saved behind")
        assert status(d)["counters"]["bad_log_lines"] == 3

        # The daemon restarts mid-log: lines written meanwhile are read once, none replayed.
        d.stop()
        a_more = chat_body("")
        a_more["messages"] = A["messages"] + [{"role": "assistant", "content": a1["choices"][0]["message"]["content"]},
                                              {"role": "user", "content": "And in box 7?"}]
        serve(eng, log, "r3", a_more)
        d = Daemon(tmp_path, session_dir, eng.url, gate=False, args=["--request-log", str(log)]).start()
        # The save is counted when the engine has written it; its file is renamed into place
        # and its metadata written just after, off the loop: wait for the file, not the count.
        wait_until(lambda: json.loads((session_dir / f"auto-{KA}.json").read_text())["n_tokens"] > meta["n_tokens"],
                   15, what="A saved behind again, grown")
        st = status(d)
        assert st["counters"]["saves"] == 1 and st["counters"]["bad_log_lines"] == 0

        # The engine restarts: autosessd restores what it held (A) once the engine is idle.
        eng.restart()
        wait_until(lambda: status(d)["counters"]["restores"] == 1, 30, what="A restored after the restart")
        a2 = eng.post("/v1/chat/completions", a_more)
        assert a2["timings"]["cache_n"] >= 0.9 * a2["usage"]["prompt_tokens"]
    finally:
        d.stop()


def test_save_behind_never_saves_across_a_request_in_flight(engines, session_dir, tmp_path):
    """B ends while the next request (A) is already in flight: B is never saved, since the
    engine's slot is no longer B's once A runs; A is saved behind when it ends."""
    eng = engines(session_dir)
    log = tmp_path / "requests.jsonl"
    d = Daemon(tmp_path, session_dir, eng.url, gate=False, args=["--request-log", str(log)]).start()
    try:
        a1 = serve(eng, log, "r1", A)
        wait_until(lambda: (session_dir / f"auto-{KA}.json").exists(), 15, what="A saved behind")
        a_more = chat_body("")
        a_more["messages"] = A["messages"] + [{"role": "assistant", "content": a1["choices"][0]["message"]["content"]},
                                              {"role": "user", "content": "And in box 7?"}]
        write(log, event="start", id="r2", slot=0, key=KB)
        b = eng.post("/v1/chat/completions", B)
        write(log, event="start", id="r3", slot=0, key=KA)
        write(log, event="end", id="r2", slot=0, n_tokens=b["usage"]["total_tokens"], status="ok")
        a2 = eng.post("/v1/chat/completions", a_more)
        write(log, event="end", id="r3", slot=0, n_tokens=a2["usage"]["total_tokens"], status="ok")
        wait_until(lambda: status(d)["counters"]["saves"] == 2, 15, what="A saved behind after r3")
        # Counted once the engine wrote it; the file and metadata land just after (see above).
        n_engine = eng.get("/slots")[0]["n_prompt_tokens"]
        wait_until(lambda: json.loads((session_dir / f"auto-{KA}.json").read_text())["n_tokens"] == n_engine, 15,
                   what="A's file with the engine's count")
        assert not (session_dir / f"auto-{KB}.bin").exists()
    finally:
        d.stop()
