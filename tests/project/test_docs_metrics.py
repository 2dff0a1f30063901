"""docs/metrics.md cannot drift from /autosessd/metrics (issue 40): every metric family the
endpoint can export is in the page's 'Every metric' table with its type, labels and help text,
and every metric the table names is exported.

"Can export": the gate's endpoint over a Sessions on the stub engine (as test_dashboard.py
renders it), with the parts that add their own rows switched on: a shared bucket (its status
zeros) and a router's models (one model)."""

from __future__ import annotations

import re
from types import SimpleNamespace

from autosessd.base.config import parse
from autosessd.modes.models import Router
from autosessd.sessions.facade import Sessions
from autosessd.store.directory import Store
from docs_common import DOCS, section, table_rows, unquote
from stub_engine import StubEngine

PAGE = DOCS / "metrics.md"
WHERE = "docs/metrics.md"


class Zeros(dict):
    """A shared tier's status() where every figure is 0: only the rows' names matter here."""

    def __missing__(self, key):
        return Zeros() if key == "catalog" else 0


def exported(tmp_path) -> dict[str, dict]:
    """name -> {"type", "help", "labels"} of every family the full endpoint renders."""
    from autosessd.front.gate import Gate

    cfg = parse(f'slot_save_path = "{tmp_path}"\nstate_dir = "{tmp_path / "state"}"\n'
                f'[gate]\nlisten = "127.0.0.1:1"\n'.encode())
    sessions = Sessions(cfg, StubEngine(tmp_path), Store(tmp_path), "m")
    sessions.remote = SimpleNamespace(status=Zeros)
    one_model = SimpleNamespace(models={"ga": SimpleNamespace(id="ga", status="loaded", loads=1)})
    sessions.metric_rows = lambda: Router.metric_rows(one_model)
    text = Gate(cfg, sessions).metrics()
    out: dict[str, dict] = {}
    for line in text.splitlines():
        if m := re.match(r"# HELP (\S+) (.*)", line):
            out[m.group(1)] = {"help": m.group(2), "labels": set()}
        elif m := re.match(r"# TYPE (\S+) (\S+)", line):
            out[m.group(1)]["type"] = m.group(2)
        elif m := re.match(r"([a-z_0-9]+)\{(.*)\} ", line):
            family = next(n for n in (m.group(1), re.sub(r"_(bucket|sum|count)$", "", m.group(1))) if n in out)
            out[family]["labels"] |= set(re.findall(r'([a-z_]+)="', m.group(2)))
    return out


def documented() -> dict[str, list[str]]:
    rows = table_rows(section(PAGE, "Every metric"))
    assert rows, f"{WHERE}: no table under 'Every metric'"
    out = {}
    for cells in rows:
        assert len(cells) == 4, f"{WHERE}: a row of 4 cells (metric | type | labels | meaning), got {cells}"
        out[unquote(cells[0])] = cells
    return out


def labels_text(labels: set[str]) -> str:
    return ", ".join(f"`{x}`" for x in sorted(labels)) or "—"


def test_every_exported_metric_is_documented(tmp_path):
    docs = documented()
    missing = [f"{name} ({m['type']}): add to the table under 'Every metric':\n"
               f"    | `{name}` | {m['type']} | {labels_text(m['labels'])} | {m['help']} |"
               for name, m in exported(tmp_path).items() if name not in docs]
    assert not missing, f"metrics /autosessd/metrics exports that {WHERE} lacks:\n  " + "\n  ".join(missing)


def test_every_documented_metric_is_exported(tmp_path):
    gone = sorted(set(documented()) - set(exported(tmp_path)))
    assert not gone, (f"{WHERE} documents metrics /autosessd/metrics does not export: {gone}; remove their rows "
                      f"(a renamed one goes in the table of renamed metrics)")


def test_each_rows_type_labels_and_help_are_the_endpoints(tmp_path):
    docs, wrong = documented(), []
    for name, m in exported(tmp_path).items():
        cells = docs.get(name)
        if cells is None:
            continue
        if cells[1] != m["type"] or cells[2] != labels_text(m["labels"]):
            wrong.append(f"{name}: the row says {cells[1]} | {cells[2]}; the endpoint: {m['type']} | "
                         f"{labels_text(m['labels'])}")
        if m["help"] not in cells[3]:
            wrong.append(f"{name}: the meaning must hold its HELP text: {m['help']!r}")
    assert not wrong, f"fix these rows in {WHERE}:\n  " + "\n  ".join(wrong)
