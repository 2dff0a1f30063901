"""The turn (DESIGN §1): before a request of conversation K runs on a slot, save what the
slot holds if worth it, restore the file that serves K best, maybe read K's shared prefix on
its own; then the slot is SWITCHED to K. In that order, all on the ticket's slot, and it
never raises (cancellation aside): any failure is logged, counted and turned into "do
nothing", and the request runs exactly as it would without autosessd.

Files by their tokens (DESIGN §9, issue 11). A turn with an OpenAI chat body asks the engine
for the request's tokens unless the request goes on from the held one (same key, the held
request's messages first: View.messages), and then

    save      the held conversation, named by its header's tokens (saves.py): its line's file
              when it extends or replaces it, a branch name when another conversation of the
              same opener holds that file, nothing when a file holds it all already. Same key
              but tokens that depart (Occasion.BRANCH) is a switch too.
    restore   index.best: the file sharing the longest prefix with the request, if it shares
              min_tokens more than the slot already does (View.tokens); never by name
    prefix    a new conversation whose system prompt and tools reach min_tokens and which no
              file holds: read them on their own and save them as a prefix file (prefix.py)

Without tokens (other APIs, images, the tail, a hook sending a key, an engine that cannot
tokenize) the key rule of DESIGN §1 decides. With a shared bucket, remote.py's Fetcher is
asked when nothing local is good enough.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..base import logs
from . import policy
from ..engines.base import EngineError, EngineLacks
from ..store.index import common_prefix, encode
from ..base.keys import chat_signature, continues
from .phases import timed
from .policy import Held, Occasion, Restore, RestoreFile, SaveOutcome, Skip
from .recall import Known, Recall
from .report import TurnResult, skipped
from .slot import Phase, Slot, View
from ..store.directory import Meta, auto_name

if TYPE_CHECKING:
    from .context import Context
    from .observe import Observer
    from .prefix import PrefixReader
    from .remote import Fetcher
    from .restores import Restorer
    from .saves import Saver
    from .warm import Warmer

log = logging.getLogger("autosessd")

NO_TOKENS_S = 600.0  # an engine that has no endpoint for a request's tokens is asked again after this


@dataclass(frozen=True)
class Carry:
    """What a turn learned about the request it lets through (View.tokens, messages, file)."""

    tokens: bytes | None
    messages: tuple[str, ...] | None
    file: str | None
    n_prompt: int | None = None  # the request's prompt length, when its tokens were asked for
    unknown_prompt: bool = False  # let through without all its tokens (it goes on from the held request or a file)


class Turn:
    def __init__(self, ctx: Context, observer: Observer, saver: Saver, restorer: Restorer, prefix: PrefixReader,
                 fetcher: Fetcher, warmer: Warmer):
        self.ctx = ctx
        self.warmer = warmer
        self.observer = observer
        self.saver = saver
        self.restorer = restorer
        self.prefix = prefix
        self.fetcher = fetcher
        self.recall = Recall(ctx, fetcher)
        self._learning: set[asyncio.Task] = set()  # _learn_prompt's, held until done
        self._no_tokens_until = 0.0  # the engine lacks /apply-template or /tokenize: not asked until then
        # Per slot (one turn at a time holds its ticket): the engine's generation this turn
        # decides under (facts.py). A restore decided in an earlier one is refused.
        self._decided: dict[int, int] = {}

    async def run(self, s: Slot, key: str | None, sees_end: bool, body: dict[str, Any] | None) -> TurnResult:
        """The turn on slot s (its ticket held). sees_end=False (turn hook): its end will not
        be reported, so a restore is verified by watching the engine's slot instead. body:
        the request's OpenAI chat body, whose tokens choose what to restore; None: the key rule."""
        ctx = self.ctx
        result = TurnResult(key=key, slot=s.id)
        t0 = time.monotonic()
        carry: Carry | None = None
        try:
            self.observer.launch.forget_look(s)  # this turn's own look, or none
            if key is not None and ctx.cfg.auto_sessions:
                ctx.counters.turns += 1
            sig = chat_signature(body) if key is not None and body is not None else None
            if ctx.cfg.auto_sessions and (self._look_needless(s, key, sig, body) or
                                          await self._look(s, result)) and \
                    (ctx.facts.usable or await self._facts_read(s, result)):
                self._decided[s.id] = ctx.facts.generation
                carry = await self._turn(s, key, result, body, sig)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug must not fail the request either
            log.exception("auto sessions: turn for %s: %s", key, e)
            result.errors.append(f"internal error: {e}")
        finally:
            if carry is None:
                s.start(key)
            else:
                # The body is kept for the check of its reply's mark (recall.py), which only a
                # model with a sliding window needs.
                keep = body if carry.messages is not None and ctx.swa_window is not None else None
                s.start(key, tokens=carry.tokens, messages=carry.messages, file=carry.file, n_prompt=carry.n_prompt,
                        body=keep)
            result.ms = round((time.monotonic() - t0) * 1000, 2)
            if ctx.cfg.auto_sessions and (key is not None or result.saved or result.errors):
                ctx.events.emit_soon("turn", **result.to_dict())
            if ctx.cfg.auto_sessions:
                ctx.turn_times.add(result)
                if result.saved or result.restored:
                    logs.soon(log, logging.INFO, "auto sessions: turn for %s on slot %d took %.0f ms: %s", key, s.id,
                              result.ms, result.phases_line())
        if not sees_end:
            self.observer.watch_request(s)
            if carry is not None and carry.unknown_prompt and body is not None and self.ctx.index is not None:
                self._learn_prompt(s, key, body)
        return result

    def _look_needless(self, s: Slot, key: str | None, sig: tuple[str, ...] | None,
                       body: dict[str, Any] | None) -> bool:
        """A switch that saves nothing needs no look at the engine's slot first (a GET /slots
        on every return, a millisecond or more). The look can only show that the slot holds
        other than its view says — a request that bypassed autosessd, the engine having
        emptied it — and the switch keeps nothing of it either way: a restore replaces it
        (llama-server runs it after a request running there), and the next cache_n verifies
        the restore as always. Not where the view itself may be out of date (a request the
        hook let through, whose end nobody reports), nor on an engine that empties idle
        slots (the launch gate works from the look), nor where what the slot shares with the
        request counts (the token rule restores a file only for what it adds to the slot's
        share): when the two may share a long prefix (the same tools, the same first message),
        the slot is looked at. Known only for chat bodies: other requests look."""
        v = s.view
        if key is None or v.phase not in (Phase.HELD, Phase.RESTORED) or self.observer.launch.active or \
                not self.ctx.facts.usable:  # after a restart the look comes first (_facts_read)
            return False
        held_sig = v.messages
        if sig is None or not held_sig or body is None:
            return False
        if held_sig[0] == sig[0] and (body.get("tools") or (len(held_sig) > 1 and len(sig) > 1 and
                                                            held_sig[1] == sig[1])):
            return False
        held = v.conversation()
        if held is None or held.key == key:
            return False  # the same conversation's turn looks: an emptied slot is restored then
        step = policy.plan_save(held, Occasion.SWITCH, self.ctx.min_tokens, self.saver.held_info(v), self.ctx.model,
                                key)
        return isinstance(step, Skip)

    async def _look(self, s: Slot, result: TurnResult) -> bool:
        with timed(result, "look"):
            return await self.observer.observe(s, result)

    async def _facts_read(self, s: Slot, result: TurnResult) -> bool:
        """After an engine restart, its facts read again before anything is decided (facts.py;
        after the look: a probe save on a slot running someone's request would wait for it).
        Until they can be read, the turn does nothing and its request runs as without us."""
        with timed(result, "facts"):
            fresh = await self.ctx.facts.fresh(s.id)
        if fresh:
            return True
        result.skipped.append(f"no save or restore: {self.ctx.facts.off or 'the engine is not known since its restart'}")
        return False

    def close(self) -> None:
        for task in list(self._learning):
            task.cancel()
        self.recall.close()
        self.ctx.events.flush()  # the last turn's events (Events.soon), before the loop ends

    def _learn_prompt(self, s: Slot, key: str | None, body: dict[str, Any]) -> None:
        """A hook request that went on from the held one was let through without its tokens,
        and its end is never reported: ask for them beside it (/tokenize does not wait for the
        slot), so that the state it leaves is known token for token and how much of it is
        prompt (branches.save_key tells a regenerated reply from an edited message by that).
        Holds no ticket: a compare-and-swap, noted only while the slot runs that request (a
        SWITCHED view is never anyone's prior again, so `s.view is v` cannot come back)."""
        v = s.view
        chat = self.ctx.chat

        async def learn() -> None:
            try:
                tokens = await chat.prompt_tokens(body) if chat is not None else None
            except EngineError as e:
                log.debug("auto sessions: the hook request's tokens: %s", e)
                return
            if tokens and s.view is v:  # still that request, nothing learned since
                s.note(tokens=encode(tokens), n_prompt=len(tokens))

        task = asyncio.get_running_loop().create_task(learn())
        self._learning.add(task)
        task.add_done_callback(self._learning.discard)

    async def _turn(self, s: Slot, key: str | None, result: TurnResult, body: dict[str, Any] | None,
                    sig: tuple[str, ...] | None) -> Carry | None:
        v = s.view
        held = v.conversation()
        same = key is not None and held is not None and held.key == key
        if same and (sig is None or continues(v.messages, sig)):
            # The same conversation going on: its count is updated when the request ends. No
            # tokens asked for: the request extends what the slot holds.
            return Carry(v.tokens, sig, v.file, unknown_prompt=sig is not None)
        want = sig is not None and self.ctx.index is not None
        # A file's mark may tell the request's tokens (its very messages) or the file to restore
        # (messages that go on from the mark's) without asking the engine (recall.py).
        known = self.recall.known(sig) if want and sig is not None else None
        exact = known is not None and known.exact
        tokens = known.tokens if known is not None and known.exact else None
        if same and want and tokens is None and known is not None and v.tokens:
            # Its tokens begin with known.tokens: they go on from what the slot holds when that
            # lies inside them, and depart from it when the two differ before either ends.
            n = common_prefix(v.tokens, known.tokens)
            if n == len(v.tokens) // 4:
                self._known_by_messages(result)
                return Carry(v.tokens, sig, v.file, unknown_prompt=True)
            if n == len(known.tokens) // 4:
                known = None  # the slot holds all that is known of them, and more: ask
        if same and want and tokens is None and known is None:
            with timed(result, "tokens"):
                tokens = await self._request_tokens(body, result)
        if same and tokens is None and known is None:
            return Carry(v.tokens, sig, v.file)  # the key rule: the same conversation
        if same and tokens is not None and v.tokens and common_prefix(v.tokens, tokens) == len(v.tokens) // 4:
            # Other messages (a client that rewrites what it sent before), the same tokens:
            # the request still goes on from what the slot holds.
            if exact:
                self._known_by_messages(result)
            return Carry(v.tokens, sig, v.file, len(tokens) // 4)
        # Same first message, but its tokens depart from the held ones (another system prompt,
        # an edited message): the engine keeps only what they share, so it is a switch too.
        occasion = Occasion.BRANCH if same else Occasion.SWITCH if key is not None else Occasion.KEYLESS
        # Unless a mark decides, the engine tokenizes the request while it saves the held
        # conversation (/tokenize does not wait for the slot): the save hides the tokens' cost.
        pick = self._sole(s.view, known) if tokens is None and known is not None else None
        sure = tokens is not None or pick is not None
        before = self._sole_inputs(s) if tokens is None and known is not None else None
        asking = asyncio.get_running_loop().create_task(self._request_tokens(body, result)) \
            if want and not sure else None
        # The file to restore starts coming into the page cache while the outgoing conversation
        # is saved (warm.py): the one the messages name now, or the one the tokens choose.
        if pick is not None:
            self.warmer.warm(pick[0])
        elif asking is not None:
            asking.add_done_callback(self._warm_best)
        try:
            step, outcome = await self.saver.save_if_worth(s, occasion, key, result)
            if isinstance(step, Skip):
                skipped(self.ctx.counters, step, result)
            if asking is not None:
                with timed(result, "tokens"):  # what the save did not hide
                    tokens = await asking
        finally:
            if asking is not None and not asking.done():
                asking.cancel()
        if key is None:
            return None
        if tokens is None and known is not None:
            # Asked again when the save changed what the slot holds, or the index. A pick that
            # stands is looked for on disk again (removed meanwhile?) only after a save that ran:
            # a skip decided at once adds no time since the lookup's own look, and one that first
            # waited for finalizes (Saver.settled) changed the files being written, so the
            # inputs differ and the lookup runs again.
            if before is None or self._sole_inputs(s) != before or \
                    (pick is not None and not isinstance(step, Skip) and self.ctx.index.forget_if_gone(pick[0])):
                pick = self._sole(s.view, known)
            if pick is not None:
                assert sig is not None
                return await self._restore_by_messages(s, key, held, outcome, result, sig, known, pick, body)
            with timed(result, "tokens"):
                tokens = await self._request_tokens(body, result)  # the save made it unsure (rare)
        if tokens is None:
            return await self._restore_by_key(s, key, held, outcome, result, sig)
        assert body is not None and sig is not None
        if exact:
            self._known_by_messages(result)
        return await self._restore_by_tokens(s, key, held, outcome, result, body, sig, tokens, exact)

    def _warm_best(self, asking: asyncio.Task) -> None:
        """The request's tokens came (beside the save): warm the file they would restore."""
        ctx = self.ctx
        if asking.cancelled() or asking.exception() is not None or ctx.index is None:
            return
        tokens = asking.result()
        found = ctx.index.best(tokens, ctx.model, exclude=self.saver.writing(), min_lcp=max(ctx.min_tokens, 1),
                               window=ctx.swa_window) if tokens else None
        if found is not None:
            self.warmer.warm(found[0])

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
        meta = self.saver.meta_of(name) if isinstance(step, RestoreFile) else None
        if isinstance(step, RestoreFile) and not self.saver.loadable(step.name, meta):
            step = Skip("restore", key, policy.LAYOUT_MISMATCH)
        own = None
        if isinstance(step, RestoreFile):
            if await self.restorer.restore(s, key, result, name, expect=n, tokens=self.saver.tokens_of(name),
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
        file = self.saver.file_info(key)  # one being finalized as it will be: its restore reads a link
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
                    meta = self.saver.read_meta(key)
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
                                                       tokens=self.saver.tokens_of(step.name),
                                                       decided=self._decided[s.id])
            finally:
                if claim is not None:
                    claim.release()  # read by the engine (or failed): prune may have it now
            if restored:
                meta = self.saver.meta_of(step.name)
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
        rule kept it out (index.swa_usable): the request ends before the file does (a retry, a
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
                                   min_lcp=min_lcp, window=ctx.swa_window)
            if found is None or not ctx.index.forget_if_gone(found[0]):
                return self.saver.pending_best(tokens, ctx.model, found, min_lcp, ctx.swa_window, prefer)

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
