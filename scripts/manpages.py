#!/usr/bin/env python3
"""The man pages autosessd(1) and autosessctl(1), written from the click commands themselves.

`python scripts/manpages.py` (make man) writes man/autosessd.1 and man/autosessctl.1; the wheel
installs them as share/man/man1/ (pyproject.toml's data-files: pipx links them into its man
directory, a venv's prefix is where `man -M` finds them). The commands, options and their help
come from click, so they cannot drift: tests/project/test_docs_cli.py fails when the committed
pages differ from what this writes. The sections click does not know (files, signals, exit
status) are below, once."""

from __future__ import annotations

import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "man"

AUTOSESSD_TEXT = r"""
.SH FILES
.TP
.I /etc/autosessd/autosessd.toml
The configuration, when neither \fB\-\-config\fR nor \fB$AUTOSESSD_CONFIG\fR names one and
\fI$XDG_CONFIG_HOME/autosessd/autosessd.toml\fR does not exist.
.TP
.I slot_save_path
The session directory shared with the engine (its \fB\-\-slot\-save\-path\fR): autosessd owns
only \fBauto\-\fR\fI<16 hex>\fR\fB.bin\fR and \fB.json\fR there; every other file is never touched.
.TP
.I state_dir
What was held at the last stop (\fBheld.json\fR), the token index's cache, the savings totals;
default \fI$XDG_STATE_HOME/autosessd\fR, \fI/var/lib/autosessd\fR for root.
.SH ENVIRONMENT
.TP
.B AUTOSESSD_CONFIG
The configuration file, when \fB\-\-config\fR is not given.
.TP
.B AWS_ACCESS_KEY_ID\fR, \fBAWS_SECRET_ACCESS_KEY
The shared bucket's credentials (\fB[shared]\fR), never in the configuration file.
.SH SIGNALS
.TP
.B SIGTERM\fR, \fBSIGINT
Stop: take no more requests, give those in flight up to 30 s, save what the idle slots hold,
record it, exit 0, all within \fBstop_timeout_s\fR. A second SIGINT exits at once.
.TP
.B SIGHUP
Reload the configuration file: policy keys apply at once, the rest at the next start; a bad
file is reported and the running configuration kept.
.SH EXIT STATUS
.TP
.B 0
Stopped.
.TP
.B 1
The start failed (the engine unreachable or not saving into \fBslot_save_path\fR, an address in
use), or with \fB\-\-exec\fR the engine exited by itself.
.TP
.B 2
A bad configuration or command line, said with the file, the key and the reason.
.SH SEE ALSO
.BR autosessctl (1),
.BR llama-server (1).
The documentation site: \fBmake docs\fR in the source tree, or its \fIdocs/\fR folder.
"""

AUTOSESSCTL_TEXT = r"""
.SH EXIT STATUS
.TP
.B 0
Done.
.TP
.B 1
The daemon refused or the action failed; the message says why.
.TP
.B 2
Usage.
.TP
.B 3
The daemon is not running: no socket, or nobody answers; the message names the path.
.TP
.B 4
Permission denied: the socket's mode, or the peer-credential check.
.SH FILES
.TP
.I $XDG_RUNTIME_DIR/autosessd/autosessd.sock
The control socket, unless \fB\-\-socket\fR or \fBcontrol.socket\fR says otherwise
(\fI/run/autosessd/autosessd.sock\fR for root).
.TP
.I /run/autosessd/autosessd.sock
A system service's socket (the systemd unit's \fB\-\-socket\fR), used when nothing is at
the default path and \fI/run/autosessd\fR exists; a user reaches it as a member of
\fBcontrol.group\fR.
.SH SEE ALSO
.BR autosessd (1).
The documentation site: \fBmake docs\fR in the source tree, or its \fIdocs/\fR folder.
"""


def esc(text: str) -> str:
    """roff: backslashes and hyphens escaped, no line starting with a control character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join(("\\&" + ln if ln[:1] in ".'" else ln) for ln in text.splitlines())


def options(ctx: click.Context, cmd: click.Command, with_help: bool = True) -> list[str]:
    out = []
    for p in cmd.get_params(ctx):
        rec = p.get_help_record(ctx)
        if rec is None or not isinstance(p, click.Option) or (p.name == "help" and not with_help):
            continue
        names, help_ = rec
        out += [".TP", f"\\fB{esc(names)}\\fR", esc(" ".join(help_.split()))]
    return out


def usage(ctx: click.Context, cmd: click.Command) -> str:
    return " ".join(cmd.collect_usage_pieces(ctx))


def page(name: str, whatis: str, group: click.Group, section_text: str) -> str:
    from autosessd import __version__

    root = click.Context(group, info_name=name, **group.context_settings)
    lines = [f'.TH {name.upper()} 1 "" "{name} {__version__}" "User Commands"', ".SH NAME",
             f"{name} \\- {esc(whatis)}", ".SH SYNOPSIS",
             f"\\fB{name}\\fR {esc(usage(root, group))}", ".SH DESCRIPTION", esc(" ".join(group.help.split()))]
    top = options(root, group)
    if top:
        lines += [".SH OPTIONS", *top]
    lines.append(".SH COMMANDS")
    for sub_name, sub in group.commands.items():
        ctx = click.Context(sub, info_name=sub_name, parent=root, **sub.context_settings)
        lines += [".SS " + esc(f"{name} {sub_name} {usage(ctx, sub)}"), esc(" ".join((sub.help or "").split()))]
        lines += options(ctx, sub, with_help=False)
    return "\n".join(lines) + section_text


def pages() -> dict[str, str]:
    from autosessd.cli import autosessd_main
    from autosessd.ctl import cli

    return {"autosessd.1": page("autosessd", "keep long LLM conversations warm beside llama-server", autosessd_main,
                                AUTOSESSD_TEXT),
            "autosessctl.1": page("autosessctl", "steer a running autosessd", cli, AUTOSESSCTL_TEXT)}


def main() -> int:
    OUT.mkdir(exist_ok=True)
    for name, text in pages().items():
        (OUT / name).write_text(text, encoding="utf-8")
        print(f"wrote {(OUT / name).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
