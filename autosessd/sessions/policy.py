"""The turn (DESIGN §1) as pure decisions: plain values in, the step to take out.

No I/O and no clock here; sessions/facade.py performs what these functions decide. The
turn has two decisions because the second depends on how the first went:

    plan_save(held, occasion, ..., key)          -> Save | Skip | None
    plan_restore(held, key, save_outcome, ...)   -> Restore | Skip | None      (by the key)
    plan_restore_by_tokens(held, key, ...)       -> RestoreFile | Skip         (by the tokens)
    plan_fetch_by_tokens / plan_fetch_by_key     -> Fetch | None   (first download from the bucket)

A chat request whose tokens the engine gave (sessions/facade.py) is matched by its tokens:
plan_restore_by_tokens. Other requests (another API's body, an engine that cannot
tokenize, the tail and a hook that send only a key) keep the key rule: plan_restore.

plan_save is the one "save or not" decision: the turn (a switch, or a keyless
request that will replace the slot's contents), the stop and the tail's save-behind
all ask it.

    key is None          no restore; the held conversation is saved as at a switch
                         (a keyless request replaces what the slot holds), and the
                         request itself is forwarded untouched
    key == held.key      nothing; the token count is updated after the request —
                         unless its tokens depart from the held conversation's
                         (Occasion.BRANCH): then as at a switch
    otherwise            save the held conversation if it reached min_tokens
                         (and its file is not already up to date), then restore
                         auto-<key>.bin if it exists, fits this model and reached
                         min_tokens — unless the save failed while the held
                         state was durable: the engine still has a full state,
                         and replacing it with a weaker one is worse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..store.slotfile import KVLayout


@dataclass(frozen=True)
class Held:
    """A conversation an engine slot holds, as far as autosessd knows (sessions/facade.py's view of
    a HELD or RESTORED slot, reduced to what the decisions need)."""

    key: str
    n_tokens: int | None  # the engine's count; None when it cannot be read (an engine run with --no-slots)
    durable: bool  # False after a cancelled request: a provisional state


@dataclass(frozen=True)
class FileInfo:
    """What the store knows of auto-<key>.bin."""

    n_tokens: int
    model: str
    layout: KVLayout | None = None  # what decides whether an engine can load it; None: not recorded


@dataclass(frozen=True)
class Save:
    key: str
    n_tokens: int | None


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
LAYOUT_MISMATCH = "saved with another KV layout (slots without a unified cache, cache types or flash attention differ)"
UP_TO_DATE = "file up to date"
SAVE_FAILED_DURABLE = "the save of the held conversation failed and the engine still holds it"
PROVISIONAL = "a cancelled request left a partial state"


class Occasion(Enum):
    """Why a save is considered. The turn, the stop and the tail's save-behind all decide
    with plan_save; only the occasion differs."""

    SWITCH = "switch"    # a request of another conversation is next on the slot
    BRANCH = "branch"    # a request of the held conversation's first message that does not go on from it
                         # (another system prompt, an edited message: its tokens depart from the held ones):
                         # the engine keeps only what they share, so the rest is lost unless saved
    KEYLESS = "keyless"  # a request without a conversation (raw completion, embedding) is next:
                         # it replaces the slot's contents as surely as a switch does
    STOP = "stop"        # the daemon stops
    UNLOAD = "unload"    # the model is about to be unloaded (a model switch behind a router, sleep)
    BEHIND = "behind"    # tail: the held conversation's request ended and the engine is idle
    IDLE = "idle"        # the slot stayed idle after a reply (idle.py): saved before a switch needs it


def plan_save(held: Held | None, occasion: Occasion, min_tokens: int, saved: FileInfo | None = None,
              model: str | None = None, key: str | None = None) -> Save | Skip | None:
    """Step 2: should the held conversation be saved now (before `key` runs, at a switch)?

    `saved` is what the store has for the held key already; a file with the same token
    count for the same model is up to date and is not written again. A count that cannot
    be read (None) is saved, and sessions/facade.py drops the file if the engine's own count
    turns out below min_tokens.
    """
    if held is None:
        return None
    if occasion is Occasion.SWITCH and held.key == key:
        return None
    n = held.n_tokens
    if n is not None and (n < min_tokens or n == 0):
        return Skip("save", held.key, BELOW_MIN)
    if saved is not None and n is not None and saved.n_tokens == n and saved.model == model and held.durable:
        return Skip("save", held.key, UP_TO_DATE)
    if occasion in (Occasion.BEHIND, Occasion.IDLE) and not held.durable:
        # A cancelled request's partial state is worth a save only when it is about to be lost.
        return Skip("save", held.key, PROVISIONAL)
    return Save(held.key, n)


def plan_restore(held: Held | None, key: str | None, outcome: SaveOutcome, file: FileInfo | None,
                 model: str | None, min_tokens: int, layout: KVLayout | None = None) -> Restore | Skip | None:
    """Step 3: should auto-<key>.bin be restored before `key` runs? `layout` is the engine's
    KV layout as far as known: a file it cannot load is never restored into a failure."""
    if key is None or (held is not None and held.key == key):
        return None
    if outcome is SaveOutcome.FAILED and held is not None and held.durable:
        return Skip("restore", key, SAVE_FAILED_DURABLE)
    if file is None:
        return Skip("restore", key, NO_FILE)
    if model is None or file.model != model:
        return Skip("restore", key, MODEL_MISMATCH)
    if file.layout is not None and layout is not None and not file.layout.compatible(layout):
        return Skip("restore", key, LAYOUT_MISMATCH)
    if file.n_tokens < min_tokens or file.n_tokens == 0:
        return Skip("restore", key, BELOW_MIN)
    return Restore(key, file.n_tokens)


@dataclass(frozen=True)
class RestoreFile:
    """Restore this file: of the session files, the one sharing the longest prefix with the
    request's tokens (index.best), `shared` tokens of it."""

    name: str
    shared: int


NO_MATCH = "no file shares enough tokens with the request"


def plan_restore_by_tokens(held: Held | None, key: str, outcome: SaveOutcome, found: tuple[str, int] | None,
                           shared_now: int, min_tokens: int) -> RestoreFile | Skip:
    """Step 3 when the request's tokens are known (DESIGN §9): restore `found` (the index's
    best file for them, (name, tokens shared)) only if it shares at least min_tokens more
    than the slot already shares with the request (shared_now): a file is restored for its
    tokens, never for its name. The rule of a failed save holds as in plan_restore."""
    if outcome is SaveOutcome.FAILED and held is not None and held.durable:
        return Skip("restore", key, SAVE_FAILED_DURABLE)
    if found is None or found[1] < shared_now + max(min_tokens, 1):
        return Skip("restore", key, NO_MATCH)
    return RestoreFile(found[0], found[1])


@dataclass(frozen=True)
class Fetch:
    """Download this save from the shared bucket (autosessd/shared/), then restore it: it
    would give the request `shared` tokens, `gain` more than the slot or a local file would."""

    name: str
    shared: int
    gain: int


def plan_fetch_by_tokens(held: Held | None, outcome: SaveOutcome, local: tuple[str, int] | None,
                         remote: tuple[str, int] | None, shared_now: int, min_tokens: int) -> Fetch | None:
    """When the request's tokens are known: the bucket's best save (remote: (name, tokens shared),
    from the saves of this model only) is fetched when it shares at least min_tokens more
    than the slot already does and than the best local file (local: index.best) — the same
    rule that lets a restore replace what the slot holds; a download is never made for a
    handful of tokens. Whether the download then beats re-reading is the estimate's call
    (SharedStore.decide), made with `gain`. The rule of a failed save holds as for a restore."""
    if outcome is SaveOutcome.FAILED and held is not None and held.durable:
        return None
    if remote is None:
        return None
    have = max(shared_now, local[1] if local is not None else 0)
    if remote[1] < have + max(min_tokens, 1):
        return None
    return Fetch(remote[0], remote[1], remote[1] - have)


def plan_fetch_by_key(held: Held | None, key: str, outcome: SaveOutcome, local: FileInfo | None,
                      local_saved_at: float | None, remote_n_tokens: int | None, remote_saved_at: float | None,
                      model: str | None, min_tokens: int, layout: KVLayout | None = None) -> Fetch | None:
    """The key rule (DESIGN §1, requests without tokens) with a bucket: the bucket's current
    save of auto-<key>.bin (remote_*: None when it has none) is fetched when it reaches
    min_tokens and the local file is missing, of another model or KV layout, or older and at
    least min_tokens shorter (a local file about as long is restored as it is)."""
    if key is None or (held is not None and held.key == key) or remote_n_tokens is None:
        return None
    if outcome is SaveOutcome.FAILED and held is not None and held.durable:
        return None
    if remote_n_tokens < max(min_tokens, 1):
        return None
    usable = local is not None and local.model == model and not (
        local.layout is not None and layout is not None and not local.layout.compatible(layout))
    if not usable:
        return Fetch(f"auto-{key}.bin", remote_n_tokens, remote_n_tokens)
    assert local is not None
    if local_saved_at is not None and remote_saved_at is not None and local_saved_at >= remote_saved_at:
        return None  # the local save is the newer one
    if remote_n_tokens < local.n_tokens + max(min_tokens, 1):
        return None
    return Fetch(f"auto-{key}.bin", remote_n_tokens, remote_n_tokens - local.n_tokens)


def restore_reused(n_restored: int, cache_n: int, n_prompt: int | None = None) -> bool:
    """Did the engine reuse a restored state? A conversation grows by appending, so its
    next prompt starts with the restored tokens (or, when the client cut the conversation
    short, the prompt is a prefix of them); an engine that reused the state reports most
    of the shared part in `timings.cache_n`. A sliding-window model run without
    --swa-full reports 0."""
    shared = min(n_restored, n_prompt) if n_prompt else n_restored
    return cache_n * 2 >= shared


# auto_sessions_min_tokens = "auto" (savings.py measures, this decides).
AUTO_FLOOR = 256  # never fewer: a title call or a two-line chat is not worth a file
AUTO_CEILING = 1 << 20  # re-reading is cheaper at every size a context can have: in effect, no saves


def auto_min_tokens(prefill: Any, save: tuple[float, float] | None, restore: tuple[float, float] | None,
                    bytes_per_token: float | None, floor: int = AUTO_FLOOR,
                    ceiling: int = AUTO_CEILING) -> tuple[int, str]:
    """The smallest conversation worth saving: re-reading n tokens (prefill: ms = a·n + b·n² from
    an empty slot, savings.Prefill) costs more than saving and restoring them (save, restore:
    (fixed ms, ms per byte); bytes_per_token of the engine's state files); never below `floor`.
    → (n, why, worded for the log and status). Until the engine has shown its rates (no read,
    no save or restore yet), `floor`: save what may be worth it and learn from the first ones."""
    if prefill is None or save is None or restore is None or not bytes_per_token:
        missing = [w for w, v in (("a prompt read", prefill), ("a save", save), ("a restore", restore),
                                  ("a save's size", bytes_per_token)) if not v]
        return floor, f"the floor, until the engine has shown {', '.join(missing)} to measure"
    a, b = prefill.a, prefill.b
    fixed = save[0] + restore[0]
    per_token = (save[1] + restore[1]) * bytes_per_token
    # b·n² + (a − per_token)·n − fixed > 0
    lin = a - per_token
    if b > 0:
        root = (-lin + math.sqrt(lin * lin + 4 * b * fixed)) / (2 * b)
    elif lin > 0:
        root = fixed / lin
    else:
        root = math.inf
    n = floor if root < floor else ceiling if root >= ceiling else int(root) + 1
    read_ms = a * n + b * n * n
    keep_ms = fixed + per_token * n
    if n == ceiling and root >= ceiling:
        why = (f"re-reading is cheaper than saving and restoring at every size up to {ceiling:,} tokens "
               f"(per token: read {a:.3f} ms, save + restore {per_token:.3f} ms)")
    else:
        why = (f"re-reading {n:,} tokens takes ~{_ms(read_ms)} at the engine's measured prompt rate, saving and "
               f"restoring them ~{_ms(keep_ms)} ({bytes_per_token / 1e3:,.1f} kB a token)"
               + (f"; the floor is {floor:,}" if n == floor else ""))
    return n, why


def _ms(ms: float) -> str:
    return f"{ms / 1000:,.2f} s" if ms >= 1000 else f"{ms:,.0f} ms"
