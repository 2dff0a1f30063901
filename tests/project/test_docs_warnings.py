"""docs/troubleshooting.md explains every warning autosessd logs (issue 40): each
log.warning/error/critical/exception call in autosessd/ whose message is written in the call
has its row under 'Every warning in the log', found by the message's start as a person sees
it in the log (placeholders as `…`)."""

from __future__ import annotations

from docs_common import DOCS, section
from harness import ROOT
from logged import logged

PAGE = DOCS / "troubleshooting.md"
WHERE = "docs/troubleshooting.md"
HEAD = 72  # the start of a line the page must hold, cut at a word


def head(text: str) -> tuple[str, bool]:
    if len(text) <= HEAD:
        return text, False
    cut = text[:HEAD]
    return cut[:cut.rfind(" ")], True


def test_every_warning_autosessd_logs_is_explained():
    page = " ".join(section(PAGE, "Every warning in the log").replace("\\|", "|").split())
    missing = []
    for where, line, level, text in logged(ROOT / "autosessd"):
        start, cut = head(text)
        if start not in page:
            missing.append(f"{where}:{line} logs ({level}) `{text}`: add to the table of its part under "
                           f"'Every warning in the log':\n    | `{start}{' …' if cut else ''}` | {level} | "
                           f"<what it means, and what to change> |")
    assert not missing, f"warnings autosessd logs that {WHERE} does not explain:\n  " + "\n  ".join(missing)


def test_the_log_lines_are_read_from_the_source():
    """The reader finds what is logged: a known warning of each kind of call, and no fewer than
    when the page was written (110 calls)."""
    found = logged(ROOT / "autosessd")
    texts = {t for _, _, _, t in found}
    assert "second interrupt: exiting now" in texts
    assert "reload refused, keeping the running config: …" in texts  # %s as …
    assert any(t.startswith("engine log: the engine ran requests that … does not show launched") for t in texts)
    assert len(found) >= 100
