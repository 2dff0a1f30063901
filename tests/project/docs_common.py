"""What the documentation checks share (test_docs_*.py): the pages' Markdown tables, read as
rows of cells, and the way a config key's type and default are written there."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from harness import ROOT

DOCS = ROOT / "docs"


def section(page: Path, heading: str) -> str:
    """The text of a page under `heading` (a `## ` line), up to the next heading of that level."""
    text = page.read_text(encoding="utf-8")
    m = re.search(rf"^## {re.escape(heading)}\s*$", text, re.M)
    assert m, f"{page.relative_to(ROOT)} has no '## {heading}' section"
    end = re.search(r"^## ", text[m.end():], re.M)
    return text[m.end(): m.end() + end.start() if end else len(text)]


def table_rows(text: str) -> list[list[str]]:
    """Every body row of every Markdown table in text, as stripped cells (header and rule rows
    left out). A `|` inside a code span is written `\\|` in a table and comes back as `|`."""
    rows, in_table = [], False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if not in_table:  # the header row; the rule row follows
            in_table = True
            continue
        if all(re.fullmatch(r":?-+:?", c) for c in cells):
            continue
        rows.append(cells)
    return rows


def unquote(cell: str) -> str:
    """`x` -> x (a cell holding one code span), anything else unchanged."""
    m = re.fullmatch(r"`([^`]*)`", cell)
    return m.group(1) if m else cell


def type_name(f: dataclasses.Field) -> str:
    """A config field's type as the reference writes it."""
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    base = t.replace("| None", "").strip()
    names = {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
             "tuple[str, ...]": "string or list of strings", "int | str": '"auto" or integer',
             "float | str": '"auto" or number'}
    assert base in names, f"a config type the reference does not know how to write: {t} ({f.name})"
    return names[base]


def default_text(f: dataclasses.Field) -> str:
    """A config field's default as the reference writes it: a TOML value, `unset`, or `(required)`."""
    if f.default is not dataclasses.MISSING:
        v: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return "(table)"
    else:
        return "(required)"
    if v is None:
        return "unset"
    if v == "":
        return "(required)"
    if isinstance(v, bool):
        return f"`{str(v).lower()}`"
    if isinstance(v, float):
        return f"`{v:g}`"
    if isinstance(v, str):
        return f'`"{v}"`'
    if isinstance(v, tuple):  # a list of strings, as TOML writes it
        return "`[" + ", ".join(f'"{x}"' for x in v) + "]`"
    return f"`{v}`"
