"""bench/plot.py: `make bench` draws scenario 1 (time to first token of a switch back, by size, on
a log scale) as the PNG docs/benchmarks.md shows above its tables."""

import json
import re
import subprocess
import sys

from harness import ROOT

sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))
import plot  # noqa: E402


def scenario1():
    def row(med):
        return {"ttft_median_s": med, "ttft_min_s": med * 0.9, "ttft_max_s": med * 1.1, "cache_n_median": 0,
                "ttft_s": [med]}

    return {"sizes": {str(n): {"prompt_tokens": n, "a_over_c": 1.0,
                               "rows": {"a. engine alone, --cache-ram 0": row(n / 500),
                                        "b. engine alone, default RAM cache": row(0.03),
                                        "c. autosessd gate, engine --cache-ram 0": row(0.035),
                                        "d. autosessd gate, engine default RAM cache": row(0.03)}}
                      for n in (1184, 4974, 21334)}}


def test_plot_writes_a_png(tmp_path):
    results = {"machine": {"cpus": 2, "engine": "llama-server"}, "reps": 3, "scenarios": {"1": scenario1()}}
    src = tmp_path / "r.json"
    src.write_text(json.dumps(results))
    out = tmp_path / "p.png"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "plot.py"), str(src), str(out)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_benchmarks_page_shows_the_plot_make_bench_made():
    """docs/benchmarks.md shows the very PNG `make bench` writes: the site's hook
    (scripts/mkdocs_hooks.py) publishes bench/results/switch-back.png as assets/switch-back.png."""
    from mkdocs_hooks import OUTSIDE

    page = (ROOT / "docs" / "benchmarks.md").read_text()
    shown = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page)
    assert "assets/switch-back.png" in shown
    png = ROOT / "bench" / "results" / "switch-back.png"
    assert OUTSIDE["assets/switch-back.png"] == png
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Above the tables of the benchmarks.
    assert page.index("switch-back.png") < page.index("**1. Switch back**")
    assert plot.DEFAULT_OUT == png
