"""Several hosts behind SMG (issue 41, docs/several-hosts.md): three hosts on loopback, each a
real llama-server with `autosessd run` and the same [shared] bucket on the real Ceph RGW,
behind SMG (PyPI `smg` 1.13.0, scripts/smg-tool) started with contrib/smg/front-door as users
start it, only its addresses (and a free port for SMG's own metrics) given.

Clients that name their conversations (X-SMG-Routing-Key, which SMG passes on and autosessd
takes as the conversation's id where gate.conversation_id_headers lists it, as the docs say;
X-Conversation-Id, which SMG routes by and drops): every turn
lands on one host and reuses its cache there; a host stopped with SIGTERM: a request sent at
once is retried on another host, no client error, and its other conversations go on on the
others restored from the bucket; when it comes back SMG sends them back to it, and it restores
the newer saves from the bucket, not its own older copies.
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

from autosessd.base.keys import conversation_id_key, conversation_key
from harness import Daemon, answer, free_port, long_text, wait_until
from shared_common import in_bucket
from test_front_door_real import SYSTEM, files, front_door_or_skip, post, start_hosts, stop_all, wait_listed

ROOT = Path(__file__).resolve().parents[2]
FRONT_DOOR = ROOT / "contrib" / "smg" / "front-door"


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def healthy(proxy: subprocess.Popen, url: str, log: Path) -> set[str]:
    """The gate URLs SMG sees healthy (GET /workers)."""
    if proxy.poll() is not None:
        raise AssertionError(f"smg exited with {proxy.returncode}:\n{log.read_text()[-3000:]}")
    try:
        return {w["url"] for w in get(url + "/workers")["workers"] if w["is_healthy"]}
    except (OSError, urllib.error.URLError, ValueError, KeyError):
        return set()


@pytest.mark.s3
@pytest.mark.parametrize("model", ["kv8b"], indirect=True)
def test_conversations_named_by_the_client_stay_on_their_host_and_move_with_a_restore_when_it_stops(
        engines, model, s3_gateway, s3_bucket, aws_env, tmp_path):
    binary = front_door_or_skip("smg")
    daemons: dict[str, Daemon] = {}
    proxy = None
    try:
        # Saved after each reply (docs/several-hosts.md, SMG): a conversation SMG sends back to
        # a host that returns finds there the newer save of the host it went on on.
        start_hosts(engines, tmp_path, 3, (s3_gateway.endpoint, s3_bucket), "idle_save_switched_s = 0\n",
                    daemons, {}, gate_toml='conversation_id_headers = ["X-Conversation-Id", "X-SMG-Routing-Key"]\n')
        gate_of = {name: f"http://127.0.0.1:{d.gate_port}" for name, d in daemons.items()}
        port, log = free_port(), tmp_path / "smg.log"
        proxy = subprocess.Popen([str(FRONT_DOOR), "127.0.0.1", str(port), *gate_of.values(),
                                  "--", "--prometheus-port", str(free_port())],
                                 env={**os.environ, "SMG": binary}, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: healthy(proxy, url, log) == set(gate_of.values()), 120, 0.5,
                   what="SMG to see the 3 hosts healthy")
        # SMG asks for a model its workers list (each host's engine: the model file's path).
        model_id = get(url + "/v1/models")["data"][0]["id"]

        # Four conversations x 3 turns, round robin, each named by the client: two by the header
        # SMG passes on, two by the one it drops.
        names = [f"conv-{t}" for t in ("box", "jar", "cup", "bag")]
        header = {i: {("X-SMG-Routing-Key" if i % 2 == 0 else "X-Conversation-Id"): n} for i, n in enumerate(names)}
        convs = [{"model": model_id, "messages": [SYSTEM, {"role": "user", "content": long_text(6, t) + " Which is red?"}],
                  "temperature": 0, "max_tokens": 8, "seed": 1} for t in ("box", "jar", "cup", "bag")]
        host_of: dict[int, str] = {}
        last_prompt: dict[int, int] = {}

        def turn(i: int, n: int) -> tuple[dict, dict]:
            out, h = post(url, convs[i], header[i])
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
        # The header SMG passes on is the conversation's id at autosessd too: its host holds it
        # in a slot under that key, or saved it so when another took the slot. The one SMG drops
        # leaves autosessd the first user message.
        key_of = {i: conversation_id_key(names[i]) if i % 2 == 0 else conversation_key(convs[i]) for i in host_of}
        for i in host_of:
            d, key = daemons[host_of[i]], key_of[i]
            held = {x["held"] for x in d.status()["slots"]}
            assert key in held or f"auto-{key}.bin" in files(d), (i, held, files(d))

        # The host with the most conversations (two at least: four on three hosts) stops.
        victim = max(daemons, key=lambda name: list(host_of.values()).count(name))
        moved = [i for i, x in host_of.items() if x == victim]
        assert daemons[victim].stop(signal.SIGTERM) == 0  # its stop save goes up before it exits
        gone = time.time()
        # A request at once: SMG may still see the host healthy; its retries outlast the checks
        # that take it out, and the request is answered by another host.
        out, h = turn(moved[0], 4)
        assert h["x-autosessd-host"] != victim
        host_of[moved[0]] = h["x-autosessd-host"]
        others = [x for name, x in daemons.items() if name != victim]
        for x in others:
            wait_listed(x, gone, len(moved))
        for i in moved[1:]:
            before = last_prompt[i]
            out, h = turn(i, 4)
            assert h["x-autosessd-host"] != victim
            assert h["x-autosessd-conversation"] == f"bucket {victim}", h
            assert out["timings"]["cache_n"] >= before, (i, before, out["timings"], h)
            host_of[i] = h["x-autosessd-host"]

        # The host comes back, its disk and its engine's slots holding the older copies, once
        # the others' saves of turn 4 are in the bucket. SMG sends the conversations back to it
        # (the first of the two hosts it keeps a key): the engine reuses all of the last prompt,
        # restored from the newer save in the bucket.
        for i in moved:  # each moved conversation's save of turn 4, in the bucket, by its new host
            wait_until(lambda: in_bucket(s3_gateway, s3_bucket, key_of[i], host_of[i], last_prompt[i]), 60, 0.5,
                       what=f"{host_of[i]}'s save of conversation {i}")
        back = time.time()
        daemons[victim].start()
        wait_listed(daemons[victim], back, what="the returning host's catalog")
        wait_until(lambda: gate_of[victim] in healthy(proxy, url, log), 60, 0.2, what="SMG to see it healthy")
        for i in moved:
            before = last_prompt[i]
            out, h = turn(i, 5)
            assert h["x-autosessd-host"] == victim and h["x-autosessd-conversation"] == f"bucket {host_of[i]}", h
            assert out["timings"]["cache_n"] >= before, (i, before, out["timings"], h)
    finally:
        stop_all(proxy, daemons)
