"""/autosessd/metrics as real tools read it: Debian's promtool lints the live endpoint, a real
Prometheus on loopback scrapes it (up == 1, a counter moves after a switch), and promtool parses
every query of the Grafana dashboard. The daemon is real (`autosessd run`); the engine behind it
is tests/fake_engine.py (what is measured here is autosessd's endpoint, not the engine).

promtool and prometheus come from Debian's prometheus package, installed by `make test`
(scripts/prometheus-tools) when root; otherwise these tests skip and say why, and with
AUTOSESSD_REQUIRE_PROMETHEUS=1 (.ci/run) they fail instead."""

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from harness import ROOT, Daemon, FakeEngine, chat_body, free_port, wait_until
from test_dashboard import dashboard_exprs

A = chat_body("conversation A " * 200)
B = chat_body("conversation B " * 200)


@pytest.fixture(scope="module")
def tools():
    r = subprocess.run([str(ROOT / "scripts" / "prometheus-tools"), "check"], capture_output=True, text=True)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["promtool/prometheus missing"])[-1]
        msg = f"no promtool/prometheus: {why} (make test installs Debian's prometheus package as root)"
        if os.environ.get("AUTOSESSD_REQUIRE_PROMETHEUS"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(reason=msg)
    return shutil.which("promtool"), shutil.which("prometheus")


@pytest.fixture
def daemon(tmp_path, session_dir):
    eng = FakeEngine(session_dir).start()
    d = Daemon(tmp_path, session_dir, eng.url).start()
    yield d
    d.stop()
    eng.stop()


def post(base, body):
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def scrape(d):
    with urllib.request.urlopen(d.gate_url + "/autosessd/metrics", timeout=10) as r:
        return r.headers.get("Content-Type"), r.read()


def test_promtool_accepts_the_live_endpoint(tools, daemon):
    promtool, _ = tools
    post(daemon.gate_url, A)
    post(daemon.gate_url, B)  # a switch: a save, the histograms filled
    ctype, text = scrape(daemon)
    assert ctype.startswith("text/plain; version=0.0.4")
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    # promtool prints one line per convention broken (units, _total, help, ...) and fails.
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), (r.stdout + r.stderr).decode()
    assert b"autosessd_saves_total 1" in text


def test_dashboard_queries_parse_as_promql(tools, tmp_path):
    """Each query of contrib/grafana/autosessd.json, Grafana's variables filled in, as a recording
    rule: `promtool check rules` parses its PromQL."""
    promtool, _ = tools
    rules = ["groups:", "- name: dashboard", "  rules:"]
    for i, e in enumerate(dashboard_exprs()):
        if e.startswith("label_values("):
            continue  # Grafana's own function, not PromQL
        e = e.replace("$__rate_interval", "5m").replace("$__range", "1h").replace("$job", ".*") \
             .replace("$instance", ".*")
        rules += [f"  - record: dashboard:q{i}", f"    expr: {json.dumps(e)}"]
    path = tmp_path / "rules.yml"
    path.write_text("\n".join(rules) + "\n")
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def query(port, q):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    with urllib.request.urlopen(url, timeout=5) as r:
        res = json.load(r)["data"]["result"]
    return float(res[0]["value"][1]) if res else None


def test_a_real_prometheus_scrapes_it_and_sees_a_switch(tools, daemon, tmp_path):
    _, prometheus = tools
    port = free_port()
    host = daemon.gate_url.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        f"scrape_configs:\n- job_name: autosessd\n  metrics_path: /autosessd/metrics\n"
        f"  static_configs:\n  - targets: ['{host}']\n")
    proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    try:
        def ask(q):
            try:
                return query(port, q)
            except OSError:
                return None

        assert wait_until(lambda: ask('up{job="autosessd"}') == 1, 60, 0.2, "Prometheus to scrape the gate")
        before = ask("autosessd_saves_total")
        assert before == 0
        post(daemon.gate_url, A)
        post(daemon.gate_url, B)  # the switch saves A
        assert wait_until(lambda: (ask("autosessd_saves_total") or 0) >= 1, 30, 0.2, "the save to be scraped")
        assert ask('autosessd_build_info{version!=""}') == 1
        assert ask('sum(autosessd_slot_state{slot="0"})') == 1  # one state per slot at a time
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        time.sleep(0)  # nothing else of Prometheus's outlives the test
