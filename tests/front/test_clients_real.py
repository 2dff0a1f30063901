"""Real chat clients in front of the gate (issue 49, docs/clients.md), installed from PyPI as people
install them (scripts/client-tool: llm 0.36, shell-gpt 1.5.1), run headless against autosessd's
gate in front of a real llama-server (Gemma 3 270M, one slot). Each drives two conversations of
its own, turn after turn, switching between them as a person does: every return is restored and
the engine reuses it (autosessd checks each restore against the engine's timings.cache_n:
restores_reused), no client sees an error, and what the client sends (its system prompt, side
requests) is as the recipe page says. A client missing: the test skips and says why
(AUTOSESSD_REQUIRE_CLIENTS=1: it fails)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness import Daemon, long_text

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def client_or_skip(name: str) -> str:
    r = subprocess.run([str(ROOT / "scripts" / "client-tool"), "path", name], capture_output=True, text=True)
    if r.returncode != 0:
        why = r.stderr.strip() or f"{name} is not installed"
        if os.environ.get("AUTOSESSD_REQUIRE_CLIENTS"):
            pytest.fail(f"AUTOSESSD_REQUIRE_CLIENTS is set: {why}")
        pytest.skip(reason=why)
    return r.stdout.strip()


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> str:
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{cmd[0]} failed ({r.returncode}): {r.stderr[-2000:]}"
    return r.stdout


def first_turn(topic: str) -> str:
    return long_text(30, topic) + f"\nWhich {topic} holds the most marbles? Answer in a few words."


def turns_through(d: Daemon, ask) -> dict:
    """Two conversations, A and B, three turns each, taking turns: A1 B1 A2 B2 A3 B3. Each of A2 …
    B3 is a return to a conversation the other pushed out of the one slot."""
    ask("A", first_turn("box"), new=True)
    ask("B", first_turn("jar"), new=True)
    for i in (2, 3):
        ask("A", f"And box {i}?")
        ask("B", f"And jar {i}?")
    return d.status()["counters"]


@pytest.fixture
def gate(engines, session_dir, tmp_path):
    # -n 24: the clients set no length of their own (shell-gpt) or a long one: answers stay short.
    eng = engines(session_dir, extra=["-n", "24"])
    d = Daemon(tmp_path, session_dir, eng.url).start()
    yield eng, d
    d.stop()


@pytest.mark.parametrize("model", ["gemma3"], indirect=True)
def test_llm_conversations_return_restored(gate, tmp_path, model):
    """llm keeps each conversation in its own log (SQLite) and sends it whole at each turn
    (`llm --cid ID`), with no system prompt of its own: the prompt grows by the turn only."""
    exe = client_or_skip("llm")
    eng, d = gate
    home = tmp_path / "llm-home"
    home.mkdir()
    (home / "extra-openai-models.yaml").write_text(
        f'- model_id: local\n  model_name: gemma-3-270m\n  api_base: "{d.gate_url}/v1"\n')
    env = {**os.environ, "LLM_USER_PATH": str(home), "HOME": str(tmp_path)}
    cids: dict[str, str] = {}

    def ask(conv: str, text: str, new: bool = False) -> None:
        cmd = [exe, "-m", "local", "-o", "temperature", "0", "-o", "max_tokens", "24"]  # streamed, as by default
        if not new:
            cmd += ["--cid", cids[conv]]
        out = run(cmd + [text], env, tmp_path)
        assert out.strip(), f"llm printed no answer for {conv}"
        if new:
            logs = json.loads(run([exe, "logs", "list", "--json", "-n", "1"], env, tmp_path))
            cids[conv] = logs[0]["conversation_id"]

    c = turns_through(d, ask)
    assert c["restores_reused"] >= 4 and c["restores_not_reused"] == 0, c  # A2 B2 A3 B3
    assert c["saves"] >= 4 and c["save_failures"] == 0, c


@pytest.mark.parametrize("model", ["gemma3"], indirect=True)
def test_shell_gpt_chats_return_restored(gate, tmp_path, model):
    """shell-gpt keeps each `--chat NAME` as a file and sends it whole at each turn, after its own
    system prompt (its default role: the OS and the shell, the same at every turn)."""
    exe = client_or_skip("sgpt")
    eng, d = gate
    env = {**os.environ, "HOME": str(tmp_path), "OPENAI_API_KEY": "none", "API_BASE_URL": f"{d.gate_url}/v1",
           "DEFAULT_MODEL": "gemma-3-270m", "CHAT_CACHE_PATH": str(tmp_path / "sgpt-chats"),
           "CACHE_PATH": str(tmp_path / "sgpt-cache"), "OPENAI_USE_FUNCTIONS": "false",
           "PRETTIFY_MARKDOWN": "false", "DISABLE_STREAMING": "true", "OS_NAME": "Debian", "SHELL_NAME": "bash"}

    def ask(conv: str, text: str, new: bool = False) -> None:
        out = run([exe, "--no-cache", "--chat", conv, text], env, tmp_path)
        assert out.strip(), f"sgpt printed no answer for {conv}"

    c = turns_through(d, ask)
    assert c["restores_reused"] >= 4 and c["restores_not_reused"] == 0, c
    assert c["saves"] >= 4 and c["save_failures"] == 0, c
