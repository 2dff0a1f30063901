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
from typing import TYPE_CHECKING, Any

from ..base import logs
from ..base.keys import chat_signature, continues
from ..engines.base import EngineError
from ..store.runs import common_prefix
from ..store.slotfile import encode
from . import policy
from .choosing import Carry, Choosing
from .phases import timed
from .policy import Occasion, Skip
from .recall import Recall
from .report import TurnResult, skipped
from .slot import Phase, Slot

if TYPE_CHECKING:
    from .context import Context
    from .observe import Observer
    from .prefix import PrefixReader
    from .fetcher import Fetcher
    from .restores import Restorer
    from .saves import Saver
    from .warm import Warmer

log = logging.getLogger("autosessd")

class Turn(Choosing):
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
                # The body is kept where a save may take the slot back to one token before
                # its prompt's end (rewind.py): a model with a sliding window or recurrent layers.
                keep = body if carry.messages is not None and ctx.rewinds else None
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
        if key is not None and self.ctx.remote is not None:
            # Only where the request's tokens decide its restore (the index; not the key rule,
            # whose plan keeps a slot that holds the key): there the bucket's save is weighed.
            by_tokens = same and sig is not None and self.ctx.index is not None
            other = self.ctx.remote.went_on(key, v.tokens, v.n_tokens, max(self.ctx.min_tokens, 1)) \
                if by_tokens else None
            if other is not None:
                # It came back after going on on another host (docs/several-hosts.md): the slot
                # holds an older copy. A switch, then: the bucket's save is weighed against it
                # for the restore, and the slot's state is not saved (plan_save: a switch to its
                # own conversation), which would pass for newer than the save it lags.
                log.info("auto sessions: %s went on on %s since slot %d held it: its save there is weighed for "
                         "a restore", key, other, s.id)
                result.moved_from = other
                self.ctx.counters.arrivals += 1
                same = False
            elif not same:
                self.fetcher.arrival(key, result)
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
                               window=ctx.reuse_window) if tokens else None
        if found is not None:
            self.warmer.warm(found[0])
