"""A save the engine can reuse on a model whose memory cannot be rolled back (issue 47).

On a model with recurrent layers (Qwen3.5, Qwen3-Next, Granite 4.0-H: a state for the last token
only) or with sliding-window layers (Gemma 3, gpt-oss: the file keeps the window's last cells),
llama-server reuses a restored state only for a request that goes on from it. Anything else
needs one of the context checkpoints it keeps in RAM, which are not in the file
(tools/server/server-context.cpp, b11434 ~3520–3610). After a turn the slot holds the prompt
and the reply, and the next request usually departs inside the reply (a template that drops
earlier reasoning, a reply that comes back as other tokens), or is the same prompt again (a
retry): a file of that state is then not reused at all (DESIGN §9: 0 of 1,868 tokens on a
hybrid). The state one token before the prompt's end is reused by both.

So before the save of such a slot (at a switch, a stop, an unload, when idle, at a request's end
on an engine that empties idle slots; not a tail's save behind, which knows no prompt tokens),
the slot is taken back there: a request for
the prompt less its last token, n_predict 0. The engine finds the checkpoint it made 4 tokens
before that prompt's end (it makes them there for exactly these models) and reads 3 tokens; the
file then holds a state every next request of the conversation goes on from. A conversation
that goes on live loses nothing but the reply's reuse (the engine reads the reply again). Where
no checkpoint is near (the last request read fewer than 4 tokens, `--ctx-checkpoints 0`) the
engine reads the whole prompt again: counted (rewinds_reread) and said once.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..engines.base import EngineError
from ..store.runs import decode
from ..store.slotfile import encode
from .policy import Occasion
from .report import TurnResult, fmt_tokens
from .slot import TASK_UNSEEN, Phase, Slot

if TYPE_CHECKING:
    from .context import Context
    from .launch import Launch
    from .saves import Saver

log = logging.getLogger("autosessd")



class Rewinder:
    def __init__(self, ctx: Context, launch: Launch, saver: Saver):
        self.ctx = ctx
        self.launch = launch
        self.saver = saver
        self._said_reread = False

    def wanted(self) -> bool:
        ctx = self.ctx
        return ctx.rewinds and ctx.chat is not None

    async def rewind(self, s: Slot, occasion: Occasion, result: TurnResult | None, gate_held: bool = False) -> bool:
        """Take slot s (its ticket held) back to one token before its last prompt's end, when
        its model needs that. gate_held: the caller holds the launch gate's no-starts already
        (an end save, a make-room inside a restore). → True when its file holds that state
        already (a retry after a restore of it): nothing to save, and the longer state must not
        replace it."""
        if not self.wanted():
            return False
        ctx, v = self.ctx, s.view
        if v.phase is not Phase.HELD or v.key is None or not v.durable or v.n_tokens is None:
            return False
        if v.n_prompt is None:  # a tail's end without a count, a hook's end never seen
            if v.n_tokens >= max(ctx.min_tokens, 1):
                ctx.counters.rewinds_not_done += 1
            return False
        n = v.n_prompt - 1
        if n < max(ctx.min_tokens, 1) or v.n_tokens <= n:
            return False  # not worth a file, or the slot holds no more than that
        saved = self.saver.held_info(v)
        if saved is not None and saved.n_tokens == n and saved.model == ctx.model:
            return True
        prompt = await self._prompt(s)
        if prompt is None:
            ctx.counters.rewinds_not_done += 1
            return False
        t0 = time.monotonic()
        if not gate_held:
            await self.launch.no_starts(s)  # a start empties idle slots: none while this one is read
        try:
            pre = await self.launch.prefill(s.id, decode(prompt[:4 * n]))
        except EngineError as e:
            ctx.counters.rewinds_not_done += 1
            log.warning("auto sessions: taking slot %d back to %s tokens before its save: %s", s.id, fmt_tokens(n), e)
            if result is not None:
                result.errors.append(f"rewind to {fmt_tokens(n)} tokens: {e}")
            s.lost("taking the slot back before its save failed")
            return False
        if s.view.phase is not Phase.HELD or s.view.key != v.key:
            return False  # another input saw a request start on the slot meanwhile
        ctx.savings.saw_read(pre.cache_n, pre.prompt_n, pre.ms)
        s.rewound(n, prompt[:4 * n])
        # The prefill ran a task of its own: its id is the slot's now, so that the next look
        # counts neither it as a request that bypassed autosessd nor the next request as it.
        st = await self.saver.observer.look(s)
        s.task_id = st.task_id if st is not None and not st.is_processing else TASK_UNSEEN
        ctx.counters.rewinds += 1
        ms = (time.monotonic() - t0) * 1000
        ctx.counters.ms_rewound += ms
        if pre.cache_n == 0 and n > 8:  # no checkpoint: the engine read the prompt from its start
            ctx.counters.rewinds_reread += 1
            level = logging.DEBUG if self._said_reread else logging.WARNING
            self._said_reread = True
            log.log(level, "auto sessions: taking slot %d back to %s tokens, the engine read %s of them again (no "
                    "context checkpoint near the prompt's end: is llama-server run with --ctx-checkpoints 0?)",
                    s.id, fmt_tokens(n), fmt_tokens(pre.prompt_n))
        log.debug("auto sessions: slot %d taken back to %s tokens (one before its prompt's end) in %.0f ms: %s "
                  "read, %s reused", s.id, fmt_tokens(n), ms, fmt_tokens(pre.prompt_n), fmt_tokens(pre.cache_n))
        if result is not None:
            result.rewound = {"key": v.key, "n_tokens": n, "prompt_n": pre.prompt_n, "cache_n": pre.cache_n,
                              "ms": round(ms, 2)}
        ctx.events.emit("rewound", slot=s.id, key=v.key, n_tokens=n, prompt_n=pre.prompt_n, ms=round(ms, 2))
        return False

    async def _prompt(self, s: Slot) -> bytes | None:
        """The last request's prompt tokens (encoded): what the turn learned of them, else the
        engine's tokens for its body, when they agree with the engine's count."""
        v = s.view
        assert v.n_prompt is not None
        if v.tokens is not None and len(v.tokens) // 4 == v.n_prompt:
            return v.tokens  # the request's own, as the turn learned them
        chat = self.ctx.chat
        if v.body is None or chat is None:
            log.debug("auto sessions: slot %d not taken back before its save: its prompt's tokens are not known", s.id)
            return None
        try:
            tokens = await chat.prompt_tokens(v.body)
        except (EngineError, ValueError) as e:
            log.debug("auto sessions: slot %d not taken back before its save: %s", s.id, e)
            return None
        if len(tokens) != v.n_prompt:
            log.debug("auto sessions: slot %d not taken back before its save: its body gives %s tokens, the engine "
                      "read %s", s.id, fmt_tokens(len(tokens)), fmt_tokens(v.n_prompt))
            return None
        return encode(tokens)
