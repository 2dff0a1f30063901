"""The house rules of issue 18, kept: a thin facade, no module a newcomer cannot read in one
sitting, and the store's lock and in-use set touched only by the store."""

import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "autosessd"


def lines(p: Path) -> int:
    return sum(1 for _ in p.open(encoding="utf-8"))


def test_the_facade_stays_thin_and_no_module_grows_past_500_lines():
    """Issue 18 held the facade thin; issue 32 held every module to one sitting's read."""
    assert lines(PKG / "sessions" / "facade.py") <= 450
    big = {p.relative_to(PKG).as_posix(): lines(p) for p in PKG.rglob("*.py") if lines(p) > 500}
    assert big == {}, f"split these (README, The code): {big}"


def test_no_bench_script_or_test_module_is_over_500_lines():
    """Issue 32: bench/run.py and bench/index.py were split by scenario; test_slots.py,
    test_shared_s3.py and test_sessions_tokens.py by topic, their helpers shared beside them."""
    root = PKG.parent
    big = {p.relative_to(root).as_posix(): lines(p) for d in ("bench", "tests", "scripts") for p in (root / d).rglob("*.py")
           if lines(p) > 500}
    assert big == {}, f"split these by scenario or topic: {big}"


def test_only_the_store_touches_its_lock_and_in_use_set():
    offenders = [f"{p.relative_to(PKG)}:{i}" for p in PKG.rglob("*.py") if p.relative_to(PKG).as_posix() != "store/directory.py"
                 for i, ln in enumerate(p.open(encoding="utf-8"), 1) if re.search(r"store\._lock|store\.in_use\b", ln)]
    assert offenders == []


def test_each_package_says_what_it_owns_and_what_it_may_import():
    """Issue 32: a newcomer reads the layers from the tree and the packages' docstrings."""
    import ast
    for init in sorted(PKG.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        assert "May import:" in doc and len(doc) > 150, f"{init.relative_to(PKG)}: say what it owns and may import"


def test_the_tests_mirror_the_packages():
    """Issue 32: a package's tests sit in a folder of its name (cli: the commands, project: the
    tree's own rules); the shared fixtures and fakes stay in tests/ (conftest.py, harness.py)."""
    tests = PKG.parent / "tests"
    packages = {p.parent.name for p in PKG.glob("*/__init__.py")}
    folders = {p.parent.name for p in tests.glob("*/test_*.py")}
    assert packages <= folders, f"no tests/ folder for {sorted(packages - folders)}"
    assert folders <= packages | {"cli", "project"}, f"a tests/ folder of no package: {sorted(folders - packages)}"
    assert not list(tests.glob("test_*.py")), "a test outside the packages' folders"
