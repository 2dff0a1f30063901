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
              window or ends at most one token after those n (index.swa_usable). Otherwise the
              engine is asked for the tokens, as before.

Either way the engine reuses the shared prefix itself, and the next response's cache_n verifies
the restore as always. A mark is trusted only under the template that made it (the chain's
seed, Context.template) and for the model its file was saved for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .keys import chain

if TYPE_CHECKING:
    from .context import Context
    from .remote import Fetcher


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

    def known(self, sig: tuple[str, ...]) -> Known | None:
        """The request's tokens as far as a file's mark tells them (no engine call); None when
        no file of this model has a mark its messages begin with, or marks that disagree."""
        index = self.ctx.index
        if index is None or len(sig) < 2:
            return None
        n_messages, found = index.by_messages(chain(sig, self.ctx.template), self.ctx.model)
        if not found:
            return None
        exact = n_messages == len(sig) - 1
        heads = {e.tokens[:4 * m.n_tokens] for e, m in found}
        if len(heads) != 1:
            return None  # two files say different things of the same messages: ask the engine
        e, m = found[0]
        return Known(e.name, heads.pop(), exact)

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
        window = ctx.swa_window
        if window is not None and e.n_tokens > window and e.n_tokens - n > 1:
            return None  # usable only if the request goes on from (nearly) its end: unknown here
        others = [m.name for m in index.matches(known.tokens, ctx.model, min_lcp=n, exclude=exclude)
                  if m.name != known.file]
        if others or (ctx.remote is not None and self.fetcher.holds(known.tokens, n)):
            return None
        return known.file, n

