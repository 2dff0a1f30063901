"""docs/reference/configuration.md cannot drift from the config (issue 40): every key of
autosessd/base/config.py (and shared_config.py) has its row, with the type, default and
`autosessd run` flag the code gives it and a meaning; every row names a key that exists; and
the example TOML names only keys that exist."""

from __future__ import annotations

import dataclasses
import re
import sys

from autosessd.base.config import _SECTIONS, Config
from autosessd.cli import RUN_FLAGS
from docs_common import DOCS, default_text, section, table_rows, type_name, unquote

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PAGE = DOCS / "reference" / "configuration.md"
WHERE = "docs/reference/configuration.md"


def code_keys() -> dict[str, tuple[dataclasses.Field, str]]:
    """Every config key, dotted ("engine.url"), with its field and the class that defines it."""
    keys = {f.name: (f, "Config") for f in dataclasses.fields(Config) if f.name not in _SECTIONS and f.name != "source"}
    for name, cls in _SECTIONS.items():
        keys |= {f"{name}.{f.name}": (f, cls.__name__) for f in dataclasses.fields(cls)}
    return keys


def flags() -> dict[str, str]:
    return {key: "--" + name.replace("_", "-") for name, key in RUN_FLAGS.items()}


def documented() -> dict[str, list[str]]:
    rows = table_rows(section(PAGE, "Every key"))
    assert rows, f"{WHERE}: no key tables under 'Every key'"
    out: dict[str, list[str]] = {}
    for cells in rows:
        assert len(cells) == 5, f"{WHERE}: a row of 5 cells (key | type | default | flag | meaning), got {cells}"
        key = unquote(cells[0])
        assert key not in out, f"{WHERE}: {key} has two rows"
        out[key] = cells
    return out


def expected_row(key: str, f: dataclasses.Field) -> str:
    flag = flags().get(key)
    return (f"| `{key}` | {type_name(f)} | {default_text(f)} | {f'`{flag}`' if flag else '—'} | "
            f"<what it does, in what unit, what unset or 0 means> |")


def table_of(key: str) -> str:
    section_name = key.partition(".")[0] if "." in key else None
    return f"the [{section_name}] table" if section_name else "the 'Top level' table"


def test_every_config_key_is_documented():
    docs = documented()
    missing = [f"{k} ({cls} in autosessd/base/{'shared_config' if cls == 'SharedConfig' else 'config'}.py): add to "
               f"{table_of(k)} under 'Every key':\n    {expected_row(k, f)}"
               for k, (f, cls) in code_keys().items() if k not in docs]
    assert not missing, f"config keys without a row in {WHERE}:\n  " + "\n  ".join(missing)


def test_every_documented_key_exists():
    keys = code_keys()
    gone = [k for k in documented() if k not in keys]
    assert not gone, (f"{WHERE} documents keys the config does not have (autosessd/base/config.py): {gone}; "
                      f"remove their rows, or add the keys")


def test_each_rows_type_default_and_flag_are_the_codes():
    wrong = []
    for key, (f, _) in code_keys().items():
        cells = documented().get(key)
        if cells is None:
            continue  # test_every_config_key_is_documented says so
        want = [type_name(f), default_text(f), f"`{flags()[key]}`" if key in flags() else "—"]
        if cells[1:4] != want:
            wrong.append(f"{key}: the row says {' | '.join(cells[1:4])}; the code: {' | '.join(want)}")
        if len(re.sub(r"[^A-Za-z]", "", cells[4])) < 10:
            wrong.append(f"{key}: say what it means (the last cell)")
    assert not wrong, f"fix these rows in {WHERE}:\n  " + "\n  ".join(wrong)


def test_the_example_names_only_keys_that_exist():
    text = section(PAGE, "An example")
    example = re.search(r"```toml\n(.*?)```", text, re.S)
    assert example, f"{WHERE}: 'An example' has no ```toml block"
    raw = tomllib.loads(example.group(1))
    named = {f"{t}.{k}" for t, v in raw.items() if isinstance(v, dict) for k in v}
    named |= {k for k, v in raw.items() if not isinstance(v, dict)}
    assert named <= set(code_keys()), f"{WHERE}'s example names keys that do not exist: {sorted(named - set(code_keys()))}"
