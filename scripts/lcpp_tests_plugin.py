"""A pytest plugin for llama.cpp's own server tests (tools/server/tests), loaded by
scripts/llama-server-tests with `-p lcpp_tests_plugin`.

Those tests download their models from Hugging Face (utils.ServerPreset: stories260K,
bert-bge-small, jina-reranker, ...), which this machine cannot reach. Every server a test
starts with a model from Hugging Face or a URL gets the local GGUF named by
AUTOSESSD_LCPP_MODEL instead (the Gemma 3 270M the rest of autosessd's tests use); a server
with no model (the router preset) keeps none. ServerPreset.load_all, which starts every preset
once to fill the download cache, does nothing: there is nothing to download.

So a test that depends on its own model (an exact text from stories260K, an embedding size,
a reranker, a LoRA or draft model, an image model) fails against the engine alone, and the
script compares only what passes there. Nothing else of the tests is changed.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.getcwd())  # the tests' own directory: utils.py

import utils  # noqa: E402  (llama.cpp's tools/server/tests/utils.py)

MODEL = os.environ["AUTOSESSD_LCPP_MODEL"]
_start = utils.ServerProcess.start


def _start_with_local_model(self, *args, **kwargs):
    if self.model_hf_repo or self.model_hf_file or self.model_url:
        self.model_hf_repo = self.model_hf_file = self.model_url = None
        self.model_file = MODEL
    return _start(self, *args, **kwargs)


utils.ServerProcess.start = _start_with_local_model
utils.ServerPreset.load_all = staticmethod(lambda: None)


def pytest_runtest_logreport(report):
    """One line per test as it ends (the run's log shows where it is and what each costs)."""
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        print(f"\n[{report.duration:6.1f} s] {report.outcome:7s} {report.nodeid}", file=sys.stderr, flush=True)
