"""The turn's choice of what to restore (turn.py's second step): by the messages a file's
marks hold (recall.py, no engine call), by the key (DESIGN §1), or by the request's tokens
(DESIGN §9: index.best, or the bucket's Fetcher), the sliding-window rule that keeps a file
out, and the restore recorded for status. Turn is this class and the turn's first and last
steps; the attributes declared below are Turn's own."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engines.base import EngineError, EngineLacks
from ..store.directory import Meta, auto_name
from ..store.runs import common_prefix
from ..store.slotfile import encode
from . import policy
from .phases import timed
from .policy import Held, Restore, RestoreFile, SaveOutcome, Skip
from .recall import Known
from .report import TurnResult, skipped
from .slot import Phase, Slot, View

log = logging.getLogger("autosessd")

if TYPE_CHECKING:
    from .context import Context
    from .prefix import PrefixReader
    from .recall import Recall
    from .fetcher import Fetcher
    from .restores import Restorer
    from .saves import Saver


NO_TOKENS_S = 600.0  # an engine that has no endpoint for a request's tokens is asked again after this


@dataclass(frozen=True)
class Carry:
    """What a turn learned about the request it lets through (View.tokens, messages, file)."""

    tokens: bytes | None
    messages: tuple[str, ...] | None
    file: str | None
    n_prompt: int | None = None  # the request's prompt length, when its tokens were asked for
    unknown_prompt: bool = False  # let through without all its tokens (it goes on from the held request or a file)


class Choosing:
    """Turn's restore half (see the module's docstring)."""

    ctx: Context
    saver: Saver
    restorer: Restorer
    fetcher: Fetcher
    prefix: PrefixReader
    recall: Recall
    _decided: dict[int, int]
    _no_tokens_until: float

    def _known_by_messages(self, result: TurnResult) -> None:
        self.ctx.counters.known_by_messages += 1
        result.tokens_from = "messages"

    def _sole(self, v: View, known: Known) -> tuple[str, int, int] | None:
        """recall.Recall.sole with what the slot shares with the request's known tokens, as the
        token rule would count it: (file, tokens it shares at least, the slot's share)."""
        shared = self._slot_prefix(v, known.tokens)
        pick = self.recall.sole(known, shared, self.saver.writing())
        return None if pick is None else (*pick, shared)

    def _sole_inputs(self, s: Slot) -> tuple[object, ...] | None:
        """What _sole's answer depends on, to know it unchanged after the save without asking
        again (a lookup over the index's tokens): the view (frozen: the same one, or one equal
        to it, gives the same share), the index's generation, the files being finalized. None
        where it cannot be told (a shared bucket, whose listing may change at any time)."""
        index = self.ctx.index
        if index is None or self.ctx.remote is not None:
            return None
        return s.view, index.generation, frozenset(self.saver.writing())

    async def _restore_by_messages(self, s: Slot, key: str, held: Held | None, outcome: SaveOutcome,
                                   result: TurnResult, sig: tuple[str, ...], known: Known,
                                   pick: tuple[str, int, int], body: dict[str, Any] | None = None) -> Carry:
        """A request that goes on from a file's mark, the file being the one the token rule is
        sure to pick (recall.py): restored without the request's tokens. The engine reads the
        request's new part itself; the next cache_n verifies the restore as always."""
        ctx = self.ctx
        assert ctx.index is not None
        name, n, shared = pick
        self._known_by_messages(result)
        step = policy.plan_restore_by_tokens(held, key, outcome, (name, n), shared, ctx.min_tokens)
        meta = self.saver.facts(name).meta if isinstance(step, RestoreFile) else None
        if isinstance(step, RestoreFile) and not self.saver.loadable(step.name, meta):
            step = Skip("restore", key, policy.LAYOUT_MISMATCH)
        own = None
        if isinstance(step, RestoreFile):
            if await self.restorer.restore(s, key, result, name, expect=n, tokens=self.saver.facts(name).tokens,
                                           decided=self._decided[s.id]):
                own = name if self._own(key, step, meta) else None
                ctx.counters.restores_by_tokens += 1
                self._record_restore(s, result, name, n, shared, "messages", meta)
                if body is not None:
                    ctx.restore_log.bodies[s.id] = body  # doctor's, should the engine not reuse it
        else:
            skipped(ctx.counters, step, result)
        # Its tokens begin with the file's first n; how many more, its response says.
        return Carry(known.tokens, sig, own, unknown_prompt=True)

    async def _restore_by_key(self, s: Slot, key: str, held: Held | None, outcome: SaveOutcome, result: TurnResult,
                              sig: tuple[str, ...] | None) -> Carry:
        """DESIGN §1 step 3: auto-<key>.bin, for requests whose tokens are not known; with a
        shared bucket, its save of that name first when the local one is missing or older."""
        ctx = self.ctx
        file = self.saver.file_info(key)  # one being finalized as it will be: its restore reads its temporary
        path = ctx.store.bin_path(key)
        if file is None and (path.is_symlink() or path.exists()):  # a file its metadata does not vouch for
            await self.restorer.refuse_if_damaged(s, key, auto_name(key), result)
        claim = None
        if ctx.remote:
            with timed(result, "fetch"):
                claim = await self.fetcher.by_key(key, held, outcome, file, result)
        own = None
        try:
            if claim is not None:
                file = self.saver.file_info(key)
            step = policy.plan_restore(held, key, outcome, file, ctx.model, ctx.min_tokens, ctx.engine_layout)
            if isinstance(step, Restore):
                name = auto_name(key)
                if await self.restorer.restore(s, key, result, name, decided=self._decided[s.id]):
                    meta = self.saver.facts(name).meta
                    own = name if meta is not None and not meta.prefix and meta.line in (None, key) else None
                    self._record_restore(s, result, name, None, None, "key" if claim is None else "key, downloaded")
            elif isinstance(step, Skip):
                skipped(ctx.counters, step, result)
        finally:
            if claim is not None:
                claim.release()
        return Carry(None, sig, own)

    async def _restore_by_tokens(self, s: Slot, key: str, held: Held | None, outcome: SaveOutcome,
                                 result: TurnResult, body: dict[str, Any], sig: tuple[str, ...], tokens: bytes,
                                 from_messages: bool = False) -> Carry:
        """DESIGN §9: restore the file of this model sharing the longest prefix with the
        request's tokens, when it shares at least min_tokens more than the slot already does
        (the engine keeps that much of what the slot holds). Its name plays no part: a file
        under the request's own key that shares less is not restored. Files being written
        are left out (the slot holds them live); so are files the engine could not reuse
        after their sliding-window layers (swa_window). from_messages: the tokens are a file's
        (its mark's messages are the request's, recall.py): a known conversation, whose shared
        prefix is not looked for (prefix.py reads one for a new conversation only)."""
        ctx = self.ctx
        assert ctx.index is not None
        min_tokens = ctx.min_tokens
        shared = self._slot_prefix(s.view, tokens)
        found = self._best_present(tokens, key, shared + max(min_tokens, 1))
        claim = None
        if ctx.remote is not None:
            with timed(result, "fetch"):
                found, claim = await self.fetcher.by_tokens(key, held, outcome, tokens, shared, found, result)
        step = policy.plan_restore_by_tokens(held, key, outcome, found, shared, min_tokens)
        own = None
        if isinstance(step, RestoreFile) and not self.saver.loadable(step.name):
            step = Skip("restore", key, policy.LAYOUT_MISMATCH)
        if isinstance(step, RestoreFile):
            try:
                # The engine should now reuse `step.shared` tokens of it: what the next
                # response's cache_n is checked against.
                restored = await self.restorer.restore(s, key, result, step.name, expect=step.shared,
                                                       tokens=self.saver.facts(step.name).tokens,
                                                       decided=self._decided[s.id])
            finally:
                if claim is not None:
                    claim.release()  # read by the engine (or failed): prune may have it now
            if restored:
                meta = self.saver.facts(step.name).meta
                own = step.name if self._own(key, step, meta) else None
                ctx.counters.restores_by_tokens += 1
                self._record_restore(s, result, step.name, step.shared, shared,
                                     "tokens" if claim is None else "tokens, downloaded", meta, len(tokens) // 4,
                                     "messages" if from_messages else "engine")
                ctx.restore_log.bodies[s.id] = body  # doctor's, should the engine not reuse it
                shared = step.shared
            else:
                shared = 0  # llama-server cleared the slot
        else:
            if claim is not None:
                claim.release()
            if step.reason != policy.NO_MATCH:
                skipped(ctx.counters, step, result)
            elif not self._window_kept_out(key, tokens, shared, min_tokens, result):
                msg = (f"no restore for {key}: no file of this model shares {shared + max(min_tokens, 1):,} "
                       f"tokens with the request's {len(tokens) // 4:,} (the slot shares {shared:,})")
                result.skipped.append(msg)
                ctx.counters.skipped_no_file += 1
                log.debug("auto sessions: %s", msg)
        if not from_messages and not (outcome is SaveOutcome.FAILED and held is not None and held.durable):
            with timed(result, "prefix"):
                await self.prefix.split(s, key, body, tokens, shared, result)
        return Carry(tokens, sig, own, len(tokens) // 4)

    def _window_kept_out(self, key: str, tokens: bytes, shared: int, min_tokens: int, result: TurnResult) -> bool:
        """On a sliding-window model, whether a file holds the request's prompt but the window
        rule kept it out (runs.swa_usable): the request ends before the file does (a retry, a
        regenerate, an edit of the last message). llama-server's file of such a model holds only
        the window's last cells, so the engine would read the prompt again anyway; said at INFO,
        counted, and kept for status and doctor, instead of a silent re-read."""
        ctx = self.ctx
        if not ctx.swa_window or ctx.index is None:
            return False
        found = ctx.index.best(tokens, ctx.model, exclude=self.saver.writing(), min_lcp=shared + max(min_tokens, 1))
        if found is None:
            return False
        name, n = found
        msg = (f"no restore for {key}: {name} holds {n:,} of the request's {len(tokens) // 4:,} tokens, but the "
               f"model has a {ctx.swa_window:,}-token sliding window: llama-server's file keeps only the window's "
               "last cells, so a prompt that ends or departs before the file's end (a retry, a regenerate, an "
               "edited last message) is read again")
        result.skipped.append(msg)
        ctx.counters.swa_retries += 1
        ctx.restore_log.swa_retry = {"at": round(time.time(), 3), "key": key, "file": name, "shared": n,
                                     "n_prompt": len(tokens) // 4, "swa_window": ctx.swa_window}
        log.info("auto sessions: %s", msg)
        return True

    def _best_present(self, tokens: bytes, key: str, min_lcp: int) -> tuple[str, int] | None:
        """index.best, passing over files removed from the directory behind autosessd's back
        (rm, another tool): each is forgotten by the index as it is found gone (a stat), and
        the choice made again, so that the next best file, or the bucket's save, serves. Files
        being finalized compete as they will be (Saver.pending_best): the conversation saved at
        the switch away is the one a quick switch back wants."""
        ctx = self.ctx
        assert ctx.index is not None
        prefer = auto_name(key)
        while True:
            found = ctx.index.best(tokens, ctx.model, exclude=self.saver.writing(), prefer=prefer,
                                   min_lcp=min_lcp, window=ctx.reuse_window)
            if found is None or not ctx.index.forget_if_gone(found[0]):
                return self.saver.pending_best(tokens, ctx.model, found, min_lcp, ctx.reuse_window, prefer)

    async def _request_tokens(self, body: dict[str, Any] | None, result: TurnResult) -> bytes | None:
        """The request's prompt tokens from the engine (/apply-template + /tokenize: neither
        waits for the slot), or None: the key rule decides then."""
        chat = self.ctx.chat
        if chat is None or body is None or time.monotonic() < self._no_tokens_until:
            return None
        self.ctx.counters.tokenized += 1
        result.tokens_from = "engine"
        try:
            tokens = await chat.prompt_tokens(body)
            if not tokens:
                raise ValueError("no tokens")
            return encode(tokens)
        except EngineLacks as e:
            # An engine without /apply-template or /tokenize: not asked on every turn (a round
            # trip each), only again after a while (it may have been replaced meanwhile).
            self._no_tokens_until = time.monotonic() + NO_TOKENS_S
            self.ctx.counters.tokenize_failures += 1
            log.info("auto sessions: the engine cannot give a request's tokens (%s): the key rule decides what "
                     "to restore; asked again in %.0f min", e, NO_TOKENS_S / 60)
            result.skipped.append(f"tokens: {e}")
            return None
        except (EngineError, ValueError) as e:
            self.ctx.counters.tokenize_failures += 1
            log.info("auto sessions: no tokens for the request (%s): its key decides what to restore", e)
            result.skipped.append(f"tokens: {e}")
            return None

    def _slot_prefix(self, v: View, tokens: bytes) -> int:
        """Tokens the slot already shares with the request (the engine keeps them live). What
        the slot is known to start with may be only its last prompt: then this is a floor."""
        if v.phase not in (Phase.HELD, Phase.RESTORED):
            return 0
        known = v.tokens
        index = self.ctx.index
        if known is None and v.file is not None and index is not None:
            e = index.get(v.file)
            known = e.tokens if e is not None and e.n_tokens == v.n_tokens else None
        return common_prefix(known, tokens) if known else 0

    @staticmethod
    def _own(key: str, step: RestoreFile, meta: Meta | None) -> bool:
        """Is the restored file this conversation's own (the request goes on from its prompt),
        so that it stays the conversation's file after the request (the up-to-date check)?
        Not a prefix, not another line's, not one the request departs from inside its prompt."""
        if meta is None or meta.prefix or meta.line not in (key, None):
            return False
        if meta.line is None and meta.key != key:
            return False
        return step.shared >= (meta.n_prompt if meta.n_prompt is not None else meta.n_tokens)

    def _record_restore(self, s: Slot, result: TurnResult, name: str, shared: int | None, slot_shared: int | None,
                        by: str, meta: Meta | None = None, n_prompt: int | None = None,
                        tokens_from: str | None = None) -> None:
        """What status shows of the slot's last restore; observe.verify adds the engine's cache_n.
        by: key | tokens | messages (the file the token rule is sure of, recall.py); tokens_from:
        where a tokens choice had them (the engine, or a file's messages)."""
        self.ctx.restore_log.bodies.pop(s.id, None)  # an earlier restore's request is not this one's
        info = {"file": name, "chosen_by": by, "tokens_from": tokens_from, "shared": shared, "slot_shared": slot_shared,
                "line": meta.line if meta is not None else None, "prefix": bool(meta is not None and meta.prefix)}
        if result.restored is not None:
            result.restored.update(info)
        self.ctx.restore_log.last[s.id] = {**(result.restored or {}), **info, "n_prompt": n_prompt, "cache_n": None,
                                           "reused": None, "at": round(time.time(), 3)}
