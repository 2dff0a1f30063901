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


def test_the_wheel_carries_the_man_pages_and_every_service_file():
    """Issue 40: the wheel installs man/ as share/man/man1 and the systemd units, launchd agents and
    the Grafana dashboard under share/autosessd/ (docs/service.md says where they land). A unit
    added to systemd/ or launchd/ without its data-files line would be missing from the wheel."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    listed = {f for files in data.values() for f in files}
    for f in listed:
        assert (ROOT / f).is_file(), f"pyproject.toml's data-files names {f}, which does not exist"
    shipped = {p.relative_to(ROOT).as_posix() for d in ("man", "systemd", "launchd") for p in (ROOT / d).iterdir()}
    assert shipped <= listed, f"add to [tool.setuptools.data-files] in pyproject.toml: {sorted(shipped - listed)}"
    assert data["share/man/man1"] == ["man/autosessd.1", "man/autosessctl.1"]
