"""Several hosts behind SMG (issue 41, docs/several-hosts.md): three hosts on loopback, each a
real llama-server with `autosessd run` and the same [shared] bucket on the real Ceph RGW,
behind SMG (PyPI `smg` 1.13.0, scripts/smg-tool) started with contrib/smg/front-door as users
start it, only its addresses given.

Clients that name their conversations (X-Conversation-Id): every turn lands on one host and
reuses its cache there; a host stopped with SIGTERM:
its conversations go on on the others, restored from the bucket, with no client error; when it
comes back, the next turn still reuses all of the conversation wherever SMG sends it.
SMG missing: the test skips and says why (AUTOSESSD_REQUIRE_SMG=1: it fails)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness import Daemon, answer, free_port, long_text, wait_until
from test_front_door_real import SYSTEM, shared, start_hosts

ROOT = Path(__file__).resolve().parents[2]
FRONT_DOOR = ROOT / "contrib" / "smg" / "front-door"


def smg_or_skip() -> str:
    r = subprocess.run([str(ROOT / "scripts" / "smg-tool"), "path"], capture_output=True, text=True)
    if r.returncode != 0:
        why = r.stderr.strip() or "smg is not installed"
        if os.environ.get("AUTOSESSD_REQUIRE_SMG"):
            pytest.fail(f"AUTOSESSD_REQUIRE_SMG is set: {why}")
        pytest.skip(why)
    return r.stdout.strip()


def post(url: str, body: dict, conversation: str) -> tuple[dict, dict]:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-Conversation-Id": conversation})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200
        return json.load(r), {k.lower(): v for k, v in r.headers.items()}


def models(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
            return json.load(r)
    except (OSError, urllib.error.URLError, ValueError):
        return None


@pytest.mark.s3
@pytest.mark.parametrize("model", ["kv8b"], indirect=True)
def test_conversations_named_by_the_client_stay_on_their_host_and_move_with_a_restore_when_it_stops(
        engines, model, s3_gateway, s3_bucket, aws_env, tmp_path):
    binary = smg_or_skip()
    daemons: dict[str, Daemon] = {}
    proxy = None
    try:
        start_hosts(engines, tmp_path, 3, (s3_gateway.endpoint, s3_bucket), "", daemons, {})
        port = free_port()
        proxy = subprocess.Popen(
            [str(FRONT_DOOR), "127.0.0.1", str(port), *[f"http://127.0.0.1:{d.gate_port}" for d in daemons.values()]],
            env={**os.environ, "SMG": binary}, stdout=open(tmp_path / "smg.log", "w"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: models(url), 120, 0.5, what="SMG to answer /v1/models")
        # SMG asks for a model its workers list (each host's engine: the model file's path).
        model_id = models(url)["data"][0]["id"]

        # Four conversations x 3 turns, round robin, each named by the client.
        names = [f"conv-{t}" for t in ("box", "jar", "cup", "bag")]
        convs = [{"model": model_id, "messages": [SYSTEM, {"role": "user", "content": long_text(6, t) + " Which is red?"}],
                  "temperature": 0, "max_tokens": 8, "seed": 1} for t in ("box", "jar", "cup", "bag")]
        host_of: dict[int, str] = {}
        last_prompt: dict[int, int] = {}

        def turn(i: int, n: int) -> tuple[dict, dict]:
            out, h = post(url, convs[i], names[i])
            last_prompt[i] = out["usage"]["prompt_tokens"]
            convs[i] = {**convs[i], "messages": convs[i]["messages"] + [
                {"role": "assistant", "content": answer(out)}, {"role": "user", "content": f"And turn {n + 1}? " + (
                    # Turn 4 runs on another host: it adds more than auto_sessions_min_tokens (64),
                    # so its save is worth downloading over the first host's older copy.
                    long_text(6, f"turn{n + 1}") if n == 3 else "")}]}
            return out, h

        for n in range(1, 4):
            for i in range(len(convs)):
                before = last_prompt.get(i)
                out, h = turn(i, n)
                host = h["x-autosessd-host"]
                assert host_of.setdefault(i, host) == host, f"conversation {i} moved from {host_of[i]} to {host}"
                if before is not None:  # its host reused all it held of it
                    assert out["timings"]["cache_n"] >= before, (i, n, out["timings"], h)

        victim = host_of[0]
        moved = [i for i, x in host_of.items() if x == victim]
        assert daemons[victim].stop(signal.SIGTERM) == 0  # its stop save goes up before it exits
        gone = time.time()
        others = [x for name, x in daemons.items() if name != victim]
        for x in others:
            wait_until(lambda: (shared(x)["catalog"]["listed_at"] or 0) > gone
                       and shared(x)["catalog"]["with_tokens"] >= len(moved), 60, 0.2, what="the catalog")
        for i in moved:
            before = last_prompt[i]
            out, h = turn(i, 4)  # no client error: SMG retries elsewhere
            assert h["x-autosessd-host"] != victim
            assert h["x-autosessd-conversation"] == f"bucket {victim}", h
            assert out["timings"]["cache_n"] >= before, (i, before, out["timings"], h)
            host_of[i] = h["x-autosessd-host"]

        # The host comes back, its disk and its engine's slots holding the older copies. SMG
        # sends the conversations back to it (the first of the two hosts it keeps a key): the
        # engine reuses all of the last prompt, restored from the newer save in the bucket.
        daemons[victim].start()
        gone = time.time()
        for x in others:  # each other host's save of the last turn is in the bucket
            wait_until(lambda: shared(x)["uploads_pending"] == 0, 60, 0.2, what="the uploads")
        wait_until(lambda: (shared(daemons[victim])["catalog"]["listed_at"] or 0) > gone, 60, 0.2, what="the catalog")
        time.sleep(3)  # SMG sees it healthy again after 2 checks a second apart
        for i in moved:
            before = last_prompt[i]
            out, h = turn(i, 5)
            assert h["x-autosessd-host"] == victim and h["x-autosessd-conversation"] == f"bucket {host_of[i]}", h
            assert out["timings"]["cache_n"] >= before, (i, before, out["timings"], h)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for d in daemons.values():
            d.stop()
