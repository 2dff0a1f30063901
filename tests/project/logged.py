"""The warnings and errors autosessd logs, read from its source (for test_docs_warnings.py).

Each `log.warning/error/critical/exception(...)` whose message is a literal (or an f-string),
written as a person sees it in the log with every placeholder (%s, %d, {x}, …) as `…`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

LEVELS = {"warning": "WARNING", "error": "ERROR", "critical": "CRITICAL", "exception": "ERROR"}
PLACEHOLDER = re.compile(r"%[-+ #0]*\d*(?:\.\d+)?[sdrgfoxei%]")


def is_logger(node: ast.expr) -> bool:
    text = ast.unparse(node)
    return text.split(".")[-1] in ("log", "logger", "_log") or "getLogger" in text


def shown(arg: ast.expr) -> str | None:
    """The message with its placeholders as `…`, or None when it is not written in the call."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        text = PLACEHOLDER.sub(lambda m: "%" if m.group(0) == "%%" else "…", arg.value)
    elif isinstance(arg, ast.JoinedStr):
        text = "".join(v.value if isinstance(v, ast.Constant) else "…" for v in arg.values)
    else:
        return None
    return " ".join(text.split())


def logged(package: Path) -> list[tuple[str, int, str, str]]:
    """(file relative to the repository, line, level, message as shown) of every such call."""
    out = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LEVELS
                    and is_logger(node.func.value) and node.args):
                text = shown(node.args[0])
                if text is not None:
                    out.append((path.relative_to(package.parent).as_posix(), node.lineno, LEVELS[node.func.attr], text))
    return out
