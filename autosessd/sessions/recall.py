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

Reply marks. A conversation's next request sends back the file's reply as an assistant message,
and on a sliding-window model only a request going on from the file's end may restore it. So
after a save (saves.after_final), when the file runs past the window beyond its prompt, the
reply as the client got it (the gate reads it from the response) is checked once, off the
request's path: the engine's tokens for the messages with that reply and one more question
must hold all of the file but its last token. Then the file gets a mark there (exact False: a
request going on from those messages starts with those tokens), kept by the index (and its
cache), not in the metadata: it is checked here, for this engine. A request that goes on from
it is restored without its tokens; one whose reply was edited, or came back as other tokens,
matches only the prompt's mark and is tokenized.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..base.keys import chain, chat_signature
from ..engines.base import EngineError
from ..store.names import Mark, Meta
from ..store.runs import common_prefix
from ..store.slotfile import encode

if TYPE_CHECKING:
    from .context import Context
    from .fetcher import Fetcher
    from .slot import View

log = logging.getLogger("autosessd")

# The question after the reply in a check's probe: any text; what matters is what comes before.
PROBE = "."


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
        self._checking: set[asyncio.Task] = set()
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
        window = ctx.swa_window
        if window is not None and e.n_tokens > window and e.n_tokens - n > 1:
            return None  # usable only if the request goes on from (nearly) its end: unknown here
        others = [m.name for m in index.matches(known.tokens, ctx.model, min_lcp=n, exclude=exclude)
                  if m.name != known.file]
        if others or (ctx.remote is not None and self.fetcher.holds(known.tokens, n)):
            return None
        return known.file, n

    # -- reply marks -----------------------------------------------------------------------
    def saved(self, name: str, meta: Meta, tokens: bytes, v: View) -> None:
        """saves.after_final: a conversation's file is final. On a sliding-window model whose
        file runs past the window beyond its prompt, check its reply off the request's path."""
        ctx = self.ctx
        window, index = ctx.swa_window, ctx.index
        if window is None or ctx.chat is None or index is None or not meta.marks:
            return
        if v.body is None or v.reply is None or v.messages is None:
            return
        n, prompt = len(tokens) // 4, meta.marks[-1]
        if n <= window or n - prompt.n_tokens <= 1:
            return  # the prompt's mark serves: a request with those messages may restore it anyway
        e = index.get(name)
        if e is None or e.tokens != tokens:
            return
        task = asyncio.get_running_loop().create_task(self._check_reply(name, e.ident, tokens, v))
        self._checking.add(task)
        task.add_done_callback(self._checking.discard)

    async def _check_reply(self, name: str, ident: object, tokens: bytes, v: View) -> None:
        ctx = self.ctx
        assert v.body is not None and ctx.chat is not None and ctx.index is not None
        probe = {**v.body, "messages": [*v.body["messages"], {"role": "assistant", "content": v.reply},
                                        {"role": "user", "content": PROBE}]}
        sig = chat_signature(probe)
        if sig is None or sig[:-2] != v.messages:
            return  # the body is not the one the view's messages are of
        try:
            got = encode(await ctx.chat.prompt_tokens(probe))
        except (EngineError, ValueError) as e:
            log.debug("auto sessions: checking the reply of %s: %s", name, e)
            return
        ctx.counters.replies_checked += 1
        n, shared = len(tokens) // 4, common_prefix(got, tokens)
        if shared < n - 1:
            log.info("auto sessions: the reply saved in %s comes back as other tokens (%s of its %s shared): a "
                     "request going on from it is tokenized", name, f"{shared:,}", f"{n:,}")
            return
        mark = Mark(len(sig) - 2, shared, chain(sig[:-1], ctx.template)[-1], exact=False)
        if ctx.index.add_marks(name, ident, (mark,)):
            ctx.counters.replies_marked += 1

    def close(self) -> None:
        for task in list(self._checking):
            task.cancel()

    async def checked(self) -> None:
        """Until the reply checks under way are done (tests, the bench)."""
        while self._checking:
            await asyncio.gather(*list(self._checking), return_exceptions=True)
