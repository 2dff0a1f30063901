"""contrib/grafana/autosessd.json: every metric its queries name is one /autosessd/metrics serves."""

import json
import re

from autosessd.base.config import parse
from autosessd.sessions.facade import Sessions
from autosessd.store.directory import Store
from harness import ROOT
from stub_engine import StubEngine

DASHBOARD = ROOT / "contrib" / "grafana" / "autosessd.json"
NAME = re.compile(r"\bautosessd_[a-z0-9_]+")


def served_names(tmp_path) -> set[str]:
    """Every metric family the gate's endpoint serves (its # TYPE lines), with a histogram's series."""
    from autosessd.front.gate import Gate

    cfg = parse(f'slot_save_path = "{tmp_path}"\nstate_dir = "{tmp_path / "state"}"\n'
                f'[gate]\nlisten = "127.0.0.1:1"\n'.encode())
    text = Gate(cfg, Sessions(cfg, StubEngine(tmp_path), Store(tmp_path), "m")).metrics()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names |= {name + "_bucket", name + "_sum", name + "_count"}
    return names


def dashboard_exprs() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in d["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_every_metric_the_dashboard_queries_exists(tmp_path):
    served = served_names(tmp_path)
    used = {n for e in dashboard_exprs() for n in NAME.findall(e)}
    assert used, "the dashboard names no metric"
    assert used <= served, f"the dashboard queries metrics autosessd does not serve: {sorted(used - served)}"
    # What the issue asks it to show is there.
    for want in ("autosessd_prefill_avoided_seconds_total", "autosessd_restores_reused_total",
                 "autosessd_restores_not_reused_total", "autosessd_save_duration_seconds_bucket",
                 "autosessd_restore_duration_seconds_bucket", "autosessd_session_bytes",
                 "autosessd_session_budget_bytes", "autosessd_slot_tokens"):
        assert want in used, want


def test_dashboard_is_importable_json():
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] == "autosessd" and d["panels"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        assert p["targets"] and all(t["refId"] and t["expr"] for t in p["targets"]), p["title"]
