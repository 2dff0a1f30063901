"""A shared prefix, read on its own: a new conversation's system prompt and tools, saved as a
file every conversation that starts with them can restore.

A request that starts with a part before its first user message's text (a system prompt,
tools) of at least min_tokens, which no file holds for the engine to reuse: that part is read
on its own first (POST /completion, n_predict 0) and saved as a prefix file, then the request
goes on (it reuses the part live: nothing is read twice). A later conversation starting with
it restores that file, also after an engine restart. Why not the conversation's own file:
after a restore, a sliding-window model (Gemma 3) reuses a file only within its window of
the file's end (index.best), and a conversation soon runs past that; a file ending where the
prefix ends is reusable by every request that starts with it.

One prefix is read and saved once at a time: four agents starting with one system prompt on
four slots read it once; the others' requests read it live.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..engines.base import EngineError
from ..store.branches import prefix_key
from ..store.runs import common_prefix, decode
from ..store.slotfile import encode
from .policy import Held, SaveOutcome
from .report import TurnResult, fmt_tokens
from .slot import Phase, Slot

if TYPE_CHECKING:
    from .context import Context
    from .launch import Launch
    from .observe import Observer
    from .saves import Saver

log = logging.getLogger("autosessd")

# Stands for the first user message's text when the template renders the part before it
# (_prefix_len): letters only, so that no template trims or escapes it.
SPLIT_MARK = "AutosessdPrefixEndsHere"


class PrefixReader:
    def __init__(self, ctx: Context, launch: Launch, observer: Observer, saver: Saver):
        self.ctx = ctx
        self.launch = launch
        self.observer = observer
        self.saver = saver
        self._reading: set[str] = set()  # prefix keys being read or saved now

    async def split(self, s: Slot, key: str, body: dict[str, Any], tokens: bytes, shared: int,
                    result: TurnResult) -> None:
        """Read and save the request's shared prefix first, when it is worth a file of its
        own. Not when the slot already shares more than the prefix with the request: reading
        the prefix alone would cut that back."""
        ctx = self.ctx
        min_tokens = max(ctx.min_tokens, 1)
        if ctx.chat is None or ctx.index is None or len(tokens) // 4 <= min_tokens:
            return
        if result.restored is not None and result.restored.get("prefix"):
            return  # a prefix file was just restored: it is the part
        n = await self._prefix_len(body, tokens)
        if n < min_tokens or shared > n:
            return
        head = tokens[:4 * n]
        if ctx.index.best(head, ctx.model, min_lcp=n, window=ctx.reuse_window) is not None:
            return  # a file holds it
        pkey = prefix_key(head, ctx.model)
        if pkey in self._reading or self.saver.saving(pkey):
            return  # another slot reads or saves it now: this request reads it live
        self._reading.add(pkey)
        try:
            await self._read_and_save(s, key, n, head, pkey, result)
        finally:
            self._reading.discard(pkey)

    async def _read_and_save(self, s: Slot, key: str, n: int, head: bytes, pkey: str, result: TurnResult) -> None:
        t0 = time.monotonic()
        # A start like any request: it empties the idle slots (one restored or primed and waiting
        # for its request among them), and another start would empty this one before its request
        # reuses the prefix.
        await self.launch.no_starts(s)
        try:
            pre = await self.launch.prefill(s.id, decode(head))
        except EngineError as e:
            log.warning("auto sessions: reading the shared prefix (%s tokens) on its own: %s", fmt_tokens(n), e)
            result.errors.append(f"prefix of {fmt_tokens(n)} tokens: {e}")
            s.lost("reading a shared prefix on its own failed")
            return
        self.ctx.savings.saw_read(pre.cache_n, pre.prompt_n, pre.ms)
        if self.ctx.remote is not None:
            self.ctx.remote.saw_prefill(pre.prompt_n, pre.ms)
        v = s.view
        if not s.at_rest():
            return  # another input saw a request start on the slot meanwhile: the state is not ours to save
        if v.phase is Phase.RESTORED and v.restored is not None and v.key is not None:
            self.observer.verify(s, v.key, v.restored, pre.cache_n, n, "ok")  # the prefill's timings show the reuse
        s.prefix_read(key, n, head)
        sub = TurnResult(key=pkey)
        outcome = await self.saver.save(s, Held(pkey, n, True), sub, prefix=head)
        result.errors += sub.errors
        ms = (time.monotonic() - t0) * 1000
        if outcome is not SaveOutcome.SAVED or sub.saved is None:
            return
        if s.view.phase is Phase.HELD and s.view.key == key:  # still the prefix we read (not lost meanwhile)
            s.saved(file=sub.saved["file"])
        self.ctx.counters.prefixes_saved += 1
        result.prefix = {"file": sub.saved["file"], "n_tokens": n, "cache_n": pre.cache_n, "prompt_n": pre.prompt_n,
                         "prefill_ms": round(pre.ms, 2), "save_ms": sub.saved["ms"], "ms": round(ms, 2)}
        log.info("auto sessions: read the first %s tokens of %s (its system prompt and tools) on their own and "
                 "saved them to %s: %.0f ms (%s tokens read in %.0f ms, %s reused; save %.0f ms)", fmt_tokens(n), key,
                 sub.saved["file"], ms, fmt_tokens(pre.prompt_n), pre.ms, fmt_tokens(pre.cache_n), sub.saved["ms"])
        self.ctx.events.emit("prefix_saved", slot=s.id, key=key, **result.prefix)

    async def _prefix_len(self, body: dict[str, Any], tokens: bytes) -> int:
        """How many of the request's tokens come before its first user message's text (0
        when nothing but the template's own few tokens does). The template renders the
        messages up to that one with a marker for its text; the tokens of what precedes the
        marker, as far as they agree with the request's, are the prefix."""
        chat = self.ctx.chat
        msgs = body.get("messages")
        if chat is None or not isinstance(msgs, list):
            return 0
        i = next((k for k, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "user"), None)
        if i is None or (i == 0 and not body.get("tools")):
            return 0
        probe = {k: v for k, v in body.items() if k not in ("messages", "stream")}
        probe["messages"] = [*msgs[:i], {**msgs[i], "content": SPLIT_MARK}]
        try:
            text = await chat.apply_template(probe)
            at = text.find(SPLIT_MARK)
            if at <= 0:
                return 0
            head = encode(await chat.tokenize(text[:at]))
        except (EngineError, ValueError) as e:
            log.debug("auto sessions: cannot find where the request's system prompt ends: %s", e)
            return 0
        return common_prefix(head, tokens)
