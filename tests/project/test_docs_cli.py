"""The command-line reference cannot drift from the commands (issue 40): docs/reference/cli.md
renders autosessd's and autosessctl's click commands at build time (mkdocs-click), and the man
pages are written from them (scripts/manpages.py). What is checked here: every command and
every option says what it does (an option without help would be a blank row on the page and in
the man page), and the committed man pages are what the commands make now."""

from __future__ import annotations

import re
import sys

import click

from autosessd.cli import autosessd_main
from autosessd.ctl import cli
from docs_common import DOCS
from harness import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import manpages  # noqa: E402

PROGRAMS = {"autosessd": (autosessd_main, "autosessd/cli.py"), "autosessctl": (cli, "autosessd/ctl.py")}


def commands():
    """(program, its source file, "autosessd run", the click command) for every command."""
    for prog, (group, source) in PROGRAMS.items():
        yield prog, source, prog, group
        for name, cmd in group.commands.items():
            yield prog, source, f"{prog} {name}", cmd


def test_every_command_and_option_says_what_it_does():
    bare = []
    for _, source, path, cmd in commands():
        if not (cmd.help or "").strip():
            bare.append(f"{path} ({source}): give the command a docstring")
        for p in cmd.params:
            if isinstance(p, click.Option) and not (p.help or "").strip():
                bare.append(f"{path} {'/'.join(p.opts)} ({source}): add help=\"…\" to its click.option")
    assert not bare, ("commands or options without help text; docs/reference/cli.md and the man pages are written "
                      "from it:\n  " + "\n  ".join(bare))


def test_the_page_renders_both_programs_from_click():
    page = (DOCS / "reference" / "cli.md").read_text()
    rendered = set(re.findall(r":module: (\S+)\n\s+:command: (\S+)", page))
    assert rendered == {("autosessd.cli", "autosessd_main"), ("autosessd.ctl", "cli")}, rendered


def test_the_man_pages_are_what_the_commands_make():
    stale = [name for name, text in manpages.pages().items()
             if not (ROOT / "man" / name).exists() or (ROOT / "man" / name).read_text(encoding="utf-8") != text]
    assert not stale, (f"man/{', man/'.join(stale)} differ from the click commands: run `make man` "
                       f"(python scripts/manpages.py) and commit man/")


def test_the_man_pages_name_every_option():
    for prog, (group, _) in PROGRAMS.items():
        text = manpages.pages()[f"{prog}.1"]
        for _, _, path, cmd in commands():
            if not path.startswith(prog):
                continue
            for p in cmd.params:
                if isinstance(p, click.Option) and p.name != "help":
                    assert manpages.esc(p.opts[-1]) in text, f"{prog}(1) does not name {path} {p.opts[-1]}"
