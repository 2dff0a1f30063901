"""scripts/import_cycles.py, which `make test` runs before the tests: it must see a circle
closed only by a typing-only import, which is what kept 23 modules in one circle (issue 32)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_circle_closed_by_a_typing_only_import_is_found(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "circlepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import High\n")
    (pkg / "high.py").write_text("from .low import *\nclass High: ...\n")
    (pkg / "alone.py").write_text("from . import low\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load().main("circlepkg") == 1
    out = capsys.readouterr().out
    assert "a circle of 2 modules: circlepkg.high, circlepkg.low" in out and "alone" not in out
    (pkg / "low.py").write_text("")
    sys.modules.pop("circlepkg", None)
    assert load().main("circlepkg") == 0 and capsys.readouterr().out == ""


def test_a_circle_of_packages_without_a_circle_of_modules_is_found(tmp_path, monkeypatch, capsys):
    """Issue 32: the packages are the layers, so a.x -> b.y and b.z -> a.w is a circle even though
    no module reaches back to itself."""
    pkg = tmp_path / "ringpkg"
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from ..b import y\n")
    (pkg / "b" / "y.py").write_text("")
    (pkg / "b" / "z.py").write_text("from ..a import w\n")
    (pkg / "a" / "w.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load().main("ringpkg") == 1
    out = capsys.readouterr().out
    assert "a circle of 2 packages: ringpkg.a, ringpkg.b" in out and "a circle of 2 modules" not in out
    assert "ringpkg.b.z -> ringpkg.a.w" in out
    (pkg / "b" / "z.py").write_text("")
    for m in [m for m in sys.modules if m.startswith("ringpkg")]:
        sys.modules.pop(m)
    assert load().main("ringpkg") == 0 and capsys.readouterr().out == ""
