"""MkDocs hooks (mkdocs.yml `hooks:`): files the site shows that live outside docs/, and the
command-line page's defaults as click means them.

The benchmark plot stays where `make bench` writes it (bench/results/switch-back.png, checked by
tests/project/test_plot.py); the site takes that very file as assets/switch-back.png instead of
a copy that could fall behind it."""

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = {"assets/switch-back.png": ROOT / "bench" / "results" / "switch-back.png"}


def on_files(files, config):
    for uri, path in OUTSIDE.items():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


# click 8.3 marks an option without a default with a sentinel, which mkdocs-click 0.9 prints as
# its repr in the Default column; such an option has no default. Any other sentinel would be a
# new click or mkdocs-click behaviour to look at, so it stops the build.
UNSET = "<code>Sentinel.UNSET</code>"


def on_page_content(html, page, config, files):
    html = html.replace(UNSET, "")
    if "Sentinel." in html:
        raise ValueError(f"{page.file.src_uri}: a click sentinel is shown on the page; see scripts/mkdocs_hooks.py")
    return html
