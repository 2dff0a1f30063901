"""The house rules of issue 18, kept: a thin facade, no module a newcomer cannot read in one
sitting, and the store's lock and in-use set touched only by the store."""

import re
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "autosessd"


def lines(p: Path) -> int:
    return sum(1 for _ in p.open(encoding="utf-8"))


def test_the_facade_stays_thin_and_no_module_grows_past_700_lines():
    assert lines(PKG / "sessions.py") <= 450
    big = {p.relative_to(PKG).as_posix(): lines(p) for p in PKG.rglob("*.py") if lines(p) > 700}
    assert big == {}, f"split these (README, The code): {big}"


def test_no_bench_script_is_over_500_lines():
    """Issue 32: bench/run.py and bench/index.py were split by scenario; the rule holds for every script."""
    bench = PKG.parent / "bench"
    big = {p.name: lines(p) for p in bench.glob("*.py") if lines(p) > 500}
    assert big == {}, f"split these by scenario: {big}"


def test_only_the_store_touches_its_lock_and_in_use_set():
    offenders = [f"{p.relative_to(PKG)}:{i}" for p in PKG.rglob("*.py") if p.name != "store.py"
                 for i, ln in enumerate(p.open(encoding="utf-8"), 1) if re.search(r"store\._lock|store\.in_use\b", ln)]
    assert offenders == []
