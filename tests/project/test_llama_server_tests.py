"""scripts/llama-server-tests' own logic, without running llama.cpp's tests: the JUnit XML
read, the two runs compared, the wrapper that puts autosessd in front of every server."""

import importlib.machinery
import importlib.util
import subprocess

from harness import ROOT

_loader = importlib.machinery.SourceFileLoader("llama_server_tests", str(ROOT / "scripts" / "llama-server-tests"))
_spec = importlib.util.spec_from_loader(_loader.name, _loader)
lst = importlib.util.module_from_spec(_spec)
_loader.exec_module(lst)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="unit.test_basic" name="test_server_props" time="1.0"/>
<testcase classname="unit.test_completion" name="test_cancel_request" time="3.0"><failure message="x"/></testcase>
<testcase classname="unit.test_completion" name="test_completion[a-b]" time="2.0"><error message="y"/></testcase>
<testcase classname="unit.test_lora" name="test_lora" time="0.0"><skipped message="z"/></testcase>
</testsuite></testsuites>"""


def test_outcomes_are_read_from_pytest_junit_xml(tmp_path):
    xml = tmp_path / "run.xml"
    xml.write_text(JUNIT)
    assert lst.outcomes(xml) == {"unit/test_basic.py::test_server_props": "passed",
                                 "unit/test_completion.py::test_cancel_request": "failed",
                                 "unit/test_completion.py::test_completion[a-b]": "error",
                                 "unit/test_lora.py::test_lora": "skipped"}
    assert lst.outcomes(tmp_path / "missing.xml") == {}  # a run that never wrote its report


def test_only_tests_that_pass_alone_count_against_the_gate():
    alone = {"a": "passed", "b": "passed", "c": "failed", "d": "passed"}
    gate = {"a": "passed", "b": "failed", "c": "passed"}  # d did not run at all
    assert lst.compare(alone, gate) == {"kept": 1, "lost": ["b", "d"], "won": ["c"]}


def test_the_wrapper_runs_autosessd_exec_in_front_of_the_server(tmp_path):
    wrapper = lst.write_wrapper(tmp_path, "/opt/llama-server")
    text = wrapper.read_text()
    assert text.startswith("#!/bin/sh\n") and " -m autosessd run --config " in text
    assert text.rstrip().endswith('--exec -- /opt/llama-server "$@"')
    toml = (tmp_path / "autosessd.toml").read_text()
    from autosessd.base.config import parse

    cfg = parse(toml.encode())
    assert cfg.slot_save_path == str(tmp_path / "sessions") and cfg.stop_timeout_s < 5  # the tests wait 5 s
    # A server started with no --port is refused by autosessd, as a usage error.
    r = subprocess.run([str(wrapper), "-m", "model.gguf"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "has no --port" in r.stderr
