"""The README a newcomer reads in five minutes, and the site it leads to (issue 40): the README
stays short with the two commands on its first screen, and every link in it reaches a file
(the site's own links and anchors are checked by `mkdocs build --strict` in make test)."""

from __future__ import annotations

import re

from harness import ROOT

README = ROOT / "README.md"


def test_the_readme_stays_a_five_minute_read_with_the_two_commands_first():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines (at most 220): move the detail into docs/"
    first_screen = "\n".join(lines[:40])
    assert "make demo" in first_screen and "make test" in first_screen


def test_every_link_in_the_readme_reaches_a_file():
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [x for x in links if not re.match(r"[a-z]+:", x)]
    assert local, "the README links into docs/"
    broken = [x for x in local if not (ROOT / x).exists()]
    assert not broken, f"README.md links to files that do not exist: {broken}"
    assert {"docs/reference/configuration.md", "docs/reference/cli.md", "docs/metrics.md",
            "docs/troubleshooting.md"} <= set(local)
