"""MkDocs hooks (mkdocs.yml `hooks:`): files the site shows that live outside docs/.

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
