"""`pipx install .` puts autosessd and autosessctl on PATH: the console scripts pyproject.toml
declares resolve to the entry points (a pipx install was run by hand; see the README)."""

import importlib
import sys

from harness import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def test_console_scripts_resolve():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    scripts = project["scripts"]
    assert set(scripts) == {"autosessd", "autosessctl"}
    for target in scripts.values():
        module, _, func = target.partition(":")
        assert callable(getattr(importlib.import_module(module), func))
    assert any(d.startswith("matplotlib") for d in project["optional-dependencies"]["bench"])
