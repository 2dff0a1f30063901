"""Names by tokens: where a conversation is saved when another one shares its first message
(DESIGN §9, docs/how-it-works/files.md), and the name of a shared prefix's file.

Pure functions of tokens and of what the files under a name hold: the index (index.py) says
which files hold what, saves.py asks save_key where a state goes, prefix.py names a prefix.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Sequence

from .runs import common_prefix

from .slotfile import encode


def branch_key(key: str, tokens: Sequence[int] | bytes) -> str:
    """The owned key for a conversation that departs from the file under `key`; `tokens`:
    the conversation's tokens up to and including the first one that departs.

    Those tokens never change as the conversation grows (it only appends), so every later
    save of the same conversation lands on the same name; a conversation that departs at
    another point, or with another token, gets another name."""
    data = tokens if isinstance(tokens, bytes) else encode(tokens)
    return hashlib.sha1(b"autosessd branch\0" + key.encode() + b"\0" + data).hexdigest()[:16]


def prefix_key(tokens: Sequence[int] | bytes, model: str) -> str:
    """The owned key of a file that holds exactly a shared prefix (a system prompt and its
    tools, read on its own before a new conversation) for `model` (its fingerprint): the same
    tokens of the same model, the same name. The model is in it because behind a router two
    models of one tokenizer each have their own save path, and nothing would keep them from
    writing one temporary and one file (issue 38); a conversation's key has it already."""
    data = tokens if isinstance(tokens, bytes) else encode(tokens)
    return hashlib.sha1(b"autosessd prefix\0" + model.encode() + b"\0" + data).hexdigest()[:16]


@dataclass(frozen=True)
class SavedFile:
    """What save_key needs of a file: its tokens and how many of them were the prompt it
    was generated from (the rest is the reply). n_prompt None: not known (a person's file,
    an older save): all of it counts as the conversation."""

    tokens: bytes | Sequence[int]
    n_prompt: int | None = None


@dataclass(frozen=True)
class SaveTarget:
    key: str  # save as auto-<key>.bin
    why: str  # "new", "extends", "replaces", "branch", "covered"
    shared: int  # tokens the conversation shares with the file now under key (0 when none)


def save_key(key: str, tokens: Sequence[int] | bytes,
             file_at: Callable[[str], SavedFile | bytes | Sequence[int] | None], max_steps: int = 64,
             own: str | None = None) -> SaveTarget:
    """Where a conversation whose first user message has key `key` and whose state holds
    `tokens` is saved. file_at(k): auto-<k>.bin's SavedFile (or bare tokens), None when
    there is none.

    Walk from `key`: no file there → save there ("new"; "branch" below the first step);
    the tokens extend (or equal) that file → replace it ("extends": the new file holds all
    the old one did); they are a strict prefix of it → "covered", no save needed (the file
    holds this state and more); they depart inside the file's reply, past its prompt →
    replace it ("replaces": the same conversation going on — a chat client sends the reply
    back as text, and text sampled as uncommon tokens comes back as other tokens: seen with
    Gemma 3 at temperature 0.8 — or its last reply regenerated); they depart inside the
    file's prompt at token d → go on to branch_key(k, tokens[:d + 1]). max_steps guards
    against a directory edited by hand. own: the key whose file this state was last saved to or
    restored from, for a state the engine reuses where a longer one is not (a rewound save on a
    model with recurrent layers or a window: sessions/rewind.py): a longer file is then no cover;
    the state replaces its own file ("replaces") and branches from another's (a conversation
    with the same opener)."""
    q = tokens if isinstance(tokens, bytes) else encode(tokens)
    n = len(q) // 4
    k = key
    for step in range(max_steps):
        f = file_at(k)
        if f is None:
            return SaveTarget(k, "new" if step == 0 else "branch", 0)
        if not isinstance(f, SavedFile):
            f = SavedFile(f)
        fb = f.tokens if isinstance(f.tokens, bytes) else encode(f.tokens)
        d = common_prefix(q, fb)
        if d == len(fb) // 4:
            return SaveTarget(k, "extends", d)
        if d == n:
            if own is None:
                return SaveTarget(k, "covered", d)
            if k == own:
                return SaveTarget(k, "replaces", d)
            k = branch_key(k, q)
            continue
        if f.n_prompt is not None and d >= f.n_prompt:
            return SaveTarget(k, "replaces", d)
        k = branch_key(k, q[:4 * (d + 1)])
    raise ValueError(f"no free name for a conversation of key {key} after {max_steps} branches")
