"""The turn (DESIGN §1) as pure decisions: plain values in, the step to take out.

No I/O and no clock here; sessions.py performs what these functions decide. The
turn has two decisions because the second depends on how the first went:

    plan_save(held, key, ...)                    -> Save | Skip | None
    plan_restore(held, key, save_outcome, ...)   -> Restore | Skip | None

    key is None          nothing at all (not a conversation request)
    key == held.key      nothing; the caller updates the token count afterwards
    otherwise            save the held conversation if it reached min_tokens
                         (and its file is not already up to date), then restore
                         auto-<key>.bin if it exists, fits this model and reached
                         min_tokens — unless the save failed while the held
                         state was durable: the engine still has a full state,
                         and replacing it with a weaker one is worse.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class Held:
    """What an engine slot holds, as far as autosessd knows."""

    key: str
    n_tokens: int
    durable: bool  # False after a cancelled request: a provisional state


@dataclass(frozen=True)
class FileInfo:
    """What the store knows of auto-<key>.bin."""

    n_tokens: int
    model: str


@dataclass(frozen=True)
class Save:
    key: str
    n_tokens: int


@dataclass(frozen=True)
class Restore:
    key: str
    n_tokens: int


@dataclass(frozen=True)
class Skip:
    what: str  # "save" or "restore"
    key: str
    reason: str


class SaveOutcome(Enum):
    NOT_TRIED = "not tried"
    SAVED = "saved"
    FAILED = "failed"


# Reasons, worded for the log line `auto sessions: skipped restore of auto-K.bin: <reason>`.
BELOW_MIN = "below min tokens"
NO_FILE = "no file"
MODEL_MISMATCH = "model mismatch"
UP_TO_DATE = "file up to date"
SAVE_FAILED_DURABLE = "the save of the held conversation failed and the engine still holds it"


def plan_save(held: Held | None, key: str | None, min_tokens: int, saved: FileInfo | None = None,
              model: str | None = None) -> Save | Skip | None:
    """Step 2: should the held conversation be saved before `key` runs?

    `saved` is what the store has for the held key already; a file with the same
    token count for the same model is up to date and is not written again.
    """
    if key is None or held is None or held.key == key:
        return None
    if held.n_tokens < min_tokens or held.n_tokens == 0:
        return Skip("save", held.key, BELOW_MIN)
    if saved is not None and saved.n_tokens == held.n_tokens and saved.model == model and held.durable:
        return Skip("save", held.key, UP_TO_DATE)
    return Save(held.key, held.n_tokens)


def plan_restore(held: Held | None, key: str | None, outcome: SaveOutcome, file: FileInfo | None,
                 model: str | None, min_tokens: int) -> Restore | Skip | None:
    """Step 3: should auto-<key>.bin be restored before `key` runs?"""
    if key is None or (held is not None and held.key == key):
        return None
    if outcome is SaveOutcome.FAILED and held is not None and held.durable:
        return Skip("restore", key, SAVE_FAILED_DURABLE)
    if file is None:
        return Skip("restore", key, NO_FILE)
    if model is None or file.model != model:
        return Skip("restore", key, MODEL_MISMATCH)
    if file.n_tokens < min_tokens or file.n_tokens == 0:
        return Skip("restore", key, BELOW_MIN)
    return Restore(key, file.n_tokens)


def restore_reused(n_restored: int, cache_n: int, n_prompt: int | None = None) -> bool:
    """Did the engine reuse a restored state? A conversation grows by appending, so its
    next prompt starts with the restored tokens (or, when the client cut the conversation
    short, the prompt is a prefix of them); an engine that reused the state reports most
    of the shared part in `timings.cache_n`. A sliding-window model run without
    --swa-full reports 0."""
    shared = min(n_restored, n_prompt) if n_prompt else n_restored
    return cache_n * 2 >= shared
