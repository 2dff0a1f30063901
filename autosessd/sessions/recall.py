"""A return to a known conversation, matched by its messages instead of its tokens (issue 23).

Asking the engine for a request's tokens (/apply-template + /tokenize) costs ~26 ms at 21k
tokens, more than a restore of them. A file records where its tokens came from (names.Mark:
its first n tokens are the prompt of a request whose messages keys.chain names), so a request
whose messages begin with a file's recorded ones needs no tokens:

    exact     its messages are the mark's (a client resending them, a retry, a regenerated
              answer): its tokens are the file's first n, exactly. The token rule (index.best,
              the bucket, the sliding-window rule) then runs on them as on the engine's.
    goes on   its messages begin with the mark's: its tokens begin with the file's first n (the
              same assumption a request that goes on from the held one is let through on:
              keys.continues). The file is restored only when the token rule could pick no
              other: no other file (nor bucket save) holds those n tokens, so every other shares
              fewer with the request than this one does; the slot shares fewer than n; n reaches
              min_tokens above that; and, on a sliding-window model, the file is within the
              window or ends at most one token after those n (runs.swa_usable). Otherwise the
              engine is asked for the tokens, as before.

Either way the engine reuses the shared prefix itself, and the next response's cache_n verifies
the restore as always. A mark is trusted only under the template that made it (the chain's
seed, Context.template) and for the model its file was saved for.

On a model with a sliding window or recurrent layers a file holds the state one token before its
prompt's end (rewind.py), not a prompt: it has no marks, and a return to it is tokenized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..base.keys import chain
from ..engines.base import EngineError
from ..store.runs import swa_usable

if TYPE_CHECKING:
    from .context import Context
    from .fetcher import Fetcher

log = logging.getLogger("autosessd")


@dataclass(frozen=True)
class Known:
    """What a request's messages tell of its tokens, from a file's mark."""

    file: str  # the file whose mark matched (one of them, for an exact match)
    tokens: bytes  # encoded: all of the request's tokens (exact), or its first ones
    exact: bool


class Recall:
    def __init__(self, ctx: Context, fetcher: Fetcher):
        self.ctx = ctx
        self.fetcher = fetcher
        # Does the engine's template render a conversation's later turns after its earlier
        # ones, unchanged (check_appends)? Only then does "goes on" hold; None: not checked.
        self.appends: bool | None = None

    async def check_appends(self) -> bool:
        """Once per engine, at start: a conversation and the same one a turn later, templated
        by the engine. Some templates rewrite earlier turns as a conversation grows (the system
        prompt moved into the last user message, a thinking block dropped from older replies):
        there a request that goes on from a mark's messages does not start with its tokens, so
        only exact marks are trusted."""
        chat = self.ctx.chat
        first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."}]
        later = first + [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye."}]
        if chat is None:
            self.appends = False
            return False
        try:
            a = await chat.apply_template({"messages": first})
            b = await chat.apply_template({"messages": later})
            self.appends = b.startswith(a)
        except EngineError as e:
            log.info("auto sessions: the template could not be checked (%s): returns are matched by their "
                     "very messages only", e)
            self.appends = False
            return False
        if not self.appends:
            log.info("auto sessions: the engine's template rewrites earlier turns as a conversation grows: a "
                     "return going on from a file's messages is tokenized (only a resent request is matched "
                     "by its messages)")
        return self.appends

    def known(self, sig: tuple[str, ...]) -> Known | None:
        """The request's tokens as far as a file's mark tells them (no engine call); None when
        no file of this model has a mark its messages begin with, or marks that disagree."""
        index = self.ctx.index
        if index is None or len(sig) < 2:
            return None
        n_messages, found = index.by_messages(chain(sig, self.ctx.template), self.ctx.model)
        if not found:
            return None
        # Exact: the request's messages are a mark's, and that mark says its tokens are exactly
        # the prompt's (a reply mark's end-of-turn token is the next request's, not this one's).
        exact = n_messages == len(sig) - 1 and all(m.exact for _, m in found)
        if not exact and self.appends is not True:
            return None  # "goes on" is not known to hold for this engine's template
        e, m = found[0]
        head = e.tokens[:4 * m.n_tokens]
        if any(o.tokens[:4 * om.n_tokens] != head for o, om in found[1:]):
            return None  # two files say different things of the same messages: ask the engine
        return Known(e.name, head, exact)

    def sole(self, known: Known, slot_shared: int, exclude: set[str]) -> tuple[str, int] | None:
        """For a request that goes on from known.file's mark: (the file, tokens it shares at
        least) when the token rule is sure to pick that file, whatever the rest of the
        request's tokens are; None when it might pick another one, or none (the module
        docstring). slot_shared: what the slot shares with known.tokens (the turn's
        _slot_prefix)."""
        ctx, index = self.ctx, self.ctx.index
        assert index is not None and not known.exact
        n = len(known.tokens) // 4
        e = index.get(known.file)
        if e is None or known.file in exclude or slot_shared >= n or n < slot_shared + max(ctx.min_tokens, 1):
            return None
        if index.forget_if_gone(known.file):
            return None  # removed by hand: the token rule decides
        if not swa_usable(e.n_tokens, n, ctx.reuse_window):
            return None  # usable only if the request goes on from (nearly) its end: unknown here
        others = [m.name for m in index.matches(known.tokens, ctx.model, min_lcp=n, exclude=exclude)
                  if m.name != known.file]
        if others or (ctx.remote is not None and self.fetcher.holds(known.tokens, n)):
            return None
        return known.file, n
