"""An engine restarted on the same port with another model or another chat template, behind
the gate (facts.py): autosessd reads the engine's facts again before its next save or
restore, so a file saved for the old model is never restored into the new one, and a return
is not matched by messages whose tokens the new template no longer makes.

The two models are the test model under two names (two GGUF files to llama-server: two model
fingerprints to autosessd): restoring one's file into the other would be reused, which is what
the first test shows does not happen. With two fine-tunes of one base it would be reused too,
and answer from the wrong model's state."""

import json
import urllib.request

import pytest

from harness import chat_body, engine_paths, going_on, long_text, wait_until, Daemon

pytestmark = pytest.mark.engine

A = chat_body(long_text(40) + "\nHow many marbles are in box 5?")  # ~700 tokens
B = chat_body(long_text(12, "jar") + "\nWhich jar is red?")


def post(base, body):
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r), r.headers


def restart(eng, d, args):
    """The engine stopped and started again on its port with `args` changed; until autosessd saw it."""
    said = "read again before the next save or restore"
    seen = d.logtext().count(said)
    eng.stop()
    eng.args = args(eng.args)
    eng.start()
    wait_until(lambda: d.logtext().count(said) > seen, 30, 0.2, "autosessd to see the engine's restart")


def test_an_engine_restarted_with_another_model_gets_none_of_the_old_models_files(engines, session_dir, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    for name in ("model-a.gguf", "model-b.gguf"):
        (models / name).symlink_to(engine_paths()["MODEL"])
    eng = engines(session_dir, model=models / "model-a.gguf")
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        a1, _ = post(d.gate_url, A)
        post(d.gate_url, B)  # A saved, for model-a
        assert d.status()["counters"]["saves"] == 1
        restart(eng, d, lambda args: [str(models / "model-b.gguf") if a.endswith("model-a.gguf") else a
                                      for a in args])
        a2, headers = post(d.gate_url, going_on(A, a1))
        assert "X-Autosessd-Restored" not in headers
        assert a2["timings"]["cache_n"] < 0.1 * a2["usage"]["prompt_tokens"]  # read again: nothing restored
        st = d.status()
        assert st["counters"]["restores"] == 0 and st["counters"]["engine_changes"] == 1
        assert st["engine"]["model"] == "model-b.gguf"
        assert "restarted with another model model-a.gguf → model-b.gguf" in d.logtext()
        # The new model's own conversations are kept as always.
        post(d.gate_url, B)
        a3, headers = post(d.gate_url, going_on(going_on(A, a1), a2))
        assert "X-Autosessd-Restored" in headers
        assert a3["timings"]["cache_n"] >= 0.9 * a3["usage"]["prompt_tokens"]
    finally:
        d.stop()


def test_an_engine_restarted_with_another_template_is_not_matched_by_the_old_ones_messages(engines, session_dir,
                                                                                             tmp_path):
    eng = engines(session_dir)
    d = Daemon(tmp_path, session_dir, eng.url).start()
    try:
        a1, _ = post(d.gate_url, A)
        post(d.gate_url, B)  # A saved, its messages marked under the default template (chatml: the GGUF has none)
        restart(eng, d, lambda args: [*args, "--chat-template", "gemma"])
        a2, headers = post(d.gate_url, going_on(A, a1))
        st = d.status()
        # Under Gemma's template the same messages are other tokens: the engine is asked for them, and
        # no file shares them, so nothing is restored (the old marks would restore A's file
        # for an engine that reuses none of it).
        assert st["counters"]["restores"] == 0 and st["counters"]["restores_not_reused"] == 0
        assert st["counters"]["engine_changes"] == 1
        assert "X-Autosessd-Restored" not in headers
        assert "restarted with another template" in d.logtext()
    finally:
        d.stop()
