"""What each slot held at the last stop (held.json in the state directory), for the restore
after a restart (the tail's by key, the engine log's by file). Written atomically at every
stop; a file of another model, or one that cannot be read, is as good as none."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Iterable

from .files import read_small
from .slot import Phase, Slot

log = logging.getLogger("autosessd")


def record(path: Path, model: str, slots: Iterable[Slot]) -> None:
    """Remember the held conversations (logged, never raised, when it cannot)."""
    data = {"model": model, "slots": {str(s.id): {"key": s.view.key, "n_tokens": s.view.n_tokens,
                                                  "file": s.view.file}
                                      for s in slots if s.view.key and s.view.phase is not Phase.UNKNOWN}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("auto sessions: could not record the held conversation in %s: %s", path, e)


def recorded(path: Path, model: str) -> dict[int, str]:
    """slot → the conversation it held at the last stop, for this model."""
    try:
        data = json.loads(read_small(path))
        if data.get("model") != model:
            return {}
        return {int(k): str(v["key"]) for k, v in data.get("slots", {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def recorded_files(path: Path, model: str) -> tuple[dict[int, str], float]:
    """slot → the session file that held its conversation at the last stop (the engine log's
    restore, by file), for this model; and when that was recorded (0: never)."""
    try:
        data = json.loads(path.read_text())
        if data.get("model") != model:
            return {}, 0.0
        files = {int(k): v["file"] for k, v in data.get("slots", {}).items() if isinstance(v.get("file"), str)}
        return files, path.stat().st_mtime
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}, 0.0
