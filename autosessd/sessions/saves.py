"""One save path: what a slot holds, written to a session file, and the files' facts.

Every save goes through `save()`; every occasion that may or may not save (a switch, a
keyless request, a request's end on an engine that empties idle slots, the stop, the tail's
save behind, make-room, a command's restore) asks `save_if_worth()`, which decides with
policy.plan_save on the files as they will be once the finalizes in flight have landed (a
save of the same conversation may still be finalizing: deciding on the file as it was would
save the same state twice, at a stop a second multi-GB save inside stop_timeout_s).

    engine writes   .autosessd-<key>.partial        (one save per temporary name at a time:
                                                     two slots saving one prefix, or one key)
    checked         size against the engine's answer (Store.verify_temp), header tokens against
                    its count (_check_header), the KV layout learned from the file
    named           by its header's tokens (branches.save_key): the conversation's own file, a
                    branch, or none when a file holds it all already ("covered")
    finalize        fsync → rename → metadata, in a worker thread off the request's path;
                    the name is held in Store.in_use until then, and the slot's view says
                    which file holds its conversation now (Slot.saved)

A save returns to its caller as soon as the temporary checked out, and nothing on a
request's path waits for a finalize's fsync (issue 31: at 128 KiB a token, the fsync of a
2 GB save takes seconds, and a switch back used to wait for it). What a finalize in flight
will make is known already (finalizing.py: a Pending, its metadata less the digest, its header's tokens), so

    decisions       the up-to-date check (held_info), the naming by tokens (saved_file) and the
                    restore choice (pending_best) read a pending file's facts as they will be
    a restore       of a pending file reads its temporary, held for it (Restorer,
                    Store.read_temp): the bytes are whole (verified), only not yet durable, and
                    the finalize renames it only once the engine has read it
    waits           only where bytes are at stake: a save whose temporary name is still a
                    pending finalize's (the engine would write into the file being fsynced), and a
                    finalize of a file another finalize of it still runs (in order, newest last)

A crash before a finalize ends loses that save, never a file (no auto-* name until the fsync);
a finalize that fails is tried again from its bytes, and one that fails for good drops its
Pending, and decisions read the directory again (finalizing.py). Commands
and the stop wait for every finalize (settled, wait_file). Lock order: the slot's ticket, the
launch gate, then the temporary's lock here, then finalize futures; Store and TokenIndex
locks are taken only inside their own calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

from ..base import logs
from ..base.keys import chain
from ..engines.base import EngineError
from ..store import slotfile
from ..store.branches import save_key
from ..store.directory import AUTO_BIN, Meta, StoreError, auto_name, temp_name
from ..store.names import Mark
from . import policy
from .finalizing import Finalizing, Pending
from .phases import timed
from .policy import Held, Occasion, Save, SaveOutcome, Skip
from .report import TurnResult, fmt_bytes, fmt_tokens, skipped
from .slot import Phase, Slot, View

if TYPE_CHECKING:
    from .context import Context
    from .observe import Observer

log = logging.getLogger("autosessd")


class Saver(Finalizing):
    def __init__(self, ctx: Context, observer: Observer):
        super().__init__(ctx)
        self.observer = observer
        self._said_format = False  # an engine's slot file format unknown here, said
        # Takes a slot back before its save, on a model that needs it (rewind.Rewinder.rewind).
        self.rewind: Callable[[Slot, Occasion, TurnResult | None, bool], Awaitable[bool]] | None = None

    # -- deciding ----------------------------------------------------------------------------
    async def save_if_worth(self, s: Slot, occasion: Occasion, key: str | None = None,
                            result: TurnResult | None = None,
                            check: Callable[[], Awaitable[str | None]] | None = None,
                            gate_held: bool = False) -> tuple[Save | Skip | None, SaveOutcome]:
        """Save the slot's conversation if policy.plan_save says so for this occasion (key:
        the conversation that runs next, at a switch), deciding on its file as it will be once
        the finalizes in flight have landed (held_info reads a pending one's metadata: no wait).
        → (the plan's step, what came of it); None: the slot holds no conversation we can name."""
        if not await self._facts_ok(s, result):
            return None, SaveOutcome.NOT_TRIED
        if self.rewind is not None and not (occasion is Occasion.SWITCH and s.view.key == key):
            with timed(result, "save"):
                if await self.rewind(s, occasion, result, gate_held):
                    # Its file holds the state one token before its prompt's end already.
                    return Skip("save", s.view.key or "", policy.UP_TO_DATE), SaveOutcome.NOT_TRIED
        held = s.view.conversation()
        step = policy.plan_save(held, occasion, self.ctx.min_tokens, self.held_info(s.view), self.ctx.model, key)
        if isinstance(step, Save) and held is not None and self.ctx.remote is not None:
            # The conversation went on on another host since this slot held it: the bucket's
            # save holds all of this and more, and this one, newer by the clock, would pass
            # for the current save there (bucket.py: the newer save wins) with less in it.
            other = self.ctx.remote.went_on(held.key, s.view.tokens, held.n_tokens, 0)
            if other is not None:
                self.ctx.counters.saves_covered_remote += 1
                step = Skip("save", held.key, f"{other}'s newer save in the shared bucket holds all of it and more")
        if isinstance(step, Save) and held is not None:
            return step, await self.save(s, held, result, check=check)
        return step, SaveOutcome.NOT_TRIED

    async def _facts_ok(self, s: Slot, result: TurnResult | None) -> bool:
        """Nothing is decided or saved under the facts of an engine that has restarted since
        (facts.py; said where found). No probe save: this save teaches the layout."""
        if self.ctx.facts.usable or await self.ctx.facts.fresh(s.id, probe=False):
            return True
        if result is not None:
            result.skipped.append(f"save: {self.ctx.facts.off or 'the engine is not known since its restart'}")
        return False

    @contextlib.asynccontextmanager
    async def _temporary(self, key: str) -> AsyncIterator[None]:
        """One save per temporary name at a time (two slots reading one system prompt save
        one prefix file; a client may pin one conversation to two slots): the engine would
        write both into the same .partial, and one finalize would find it gone."""
        entry = self._temps.setdefault(key, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._temps[key]

    # -- saving --------------------------------------------------------------------------------
    async def save(self, s: Slot, held: Held, result: TurnResult | None, target: str | None = None,
                   check: Callable[[], Awaitable[str | None]] | None = None,
                   prefix: bytes | None = None) -> SaveOutcome:
        """Save what slot s holds: the conversation of first-message key held.key (or the
        manual file `target`, or with `prefix` the shared prefix of key held.key, which must
        hold exactly those tokens). Blocks on the temporary's lock, the finalizes in flight and
        the engine (which waits for a busy slot).

        `check`, when given, runs after the engine wrote the temporary: a reason it returns
        means the state may not be the held conversation's, and the temporary is dropped."""
        if not await self._facts_ok(s, result):
            return SaveOutcome.NOT_TRIED
        async with self._temporary(held.key):
            with timed(result, "wait"):
                await self.temp_free(held.key)
            with timed(result, "save"):
                return await self._save(s, held, result, target, check, prefix)

    async def _save(self, s: Slot, held: Held, result: TurnResult | None, target: str | None,
                    check: Callable[[], Awaitable[str | None]] | None, prefix: bytes | None) -> SaveOutcome:
        ctx, store, c = self.ctx, self.ctx.store, self.ctx.counters
        key = held.key
        what = f"save to {target or auto_name(key)}"  # a conversation may then go to a branch name
        short = store.check_space(held.n_tokens or 0)
        if short:
            # The prune after this turn evicts the oldest auto files until the next save fits.
            self.need_room(store.space_needed(held.n_tokens or 0))
            c.skipped_disk_full += 1
            c.save_failures += 1
            return self._failed(what, short, key, result)
        t0 = time.monotonic()
        # The engine's as the save starts: a restart's new facts may come meanwhile (facts.py).
        model, generation = ctx.model, ctx.facts.generation
        ctx.events.emit("saving", slot=s.id, key=key, file=target, n_tokens=held.n_tokens)
        try:
            res = await ctx.engine.save(s.id, temp_name(key))
        except EngineError as e:
            store.discard_temp(key)
            c.save_failures += 1
            return self._failed(what, str(e), key, result)
        try:
            ino = store.verify_temp(key, res.n_bytes, ctx.engine.magic)
            header = self._check_header(key, res.n_tokens)
        except StoreError as e:
            if not store.temp_path(key).exists():  # the first save since a restart is the probe too
                ctx.facts.saves_elsewhere(f"the engine saves its sessions somewhere other than {store.staging}",
                                          generation)
            store.discard_temp(key)
            c.save_failures += 1
            return self._failed(what, str(e), key, result)
        if res.n_tokens == 0:
            # The slot holds nothing: not a failed save but a state that is gone (an engine that
            # empties idle slots, a restart). Nothing held blocks the next restore.
            store.discard_temp(key)
            if result is not None:
                result.skipped.append(f"{what}: the engine's slot was empty (0 tokens saved)")
            log.info("auto sessions: %s: the engine's slot was empty (0 tokens saved)", what)
            if target is None:
                self.observer.lost(s, "the engine's slot was empty when it was saved")
            return SaveOutcome.NOT_TRIED
        if held.n_tokens is None and target is None and res.n_tokens < ctx.min_tokens:
            # The count could not be read before (no GET /slots): the engine's answer decides.
            store.discard_temp(key)
            skipped(c, Skip("save", key, policy.BELOW_MIN), result)
            return SaveOutcome.NOT_TRIED
        why = await check() if check is not None else None
        if why:
            store.discard_temp(key)
            c.saves_discarded += 1
            log.warning("auto sessions: %s discarded: %s", what, why)
            ctx.events.emit("save_discarded", slot=s.id, key=key, why=why)
            return SaveOutcome.FAILED
        tokens = header.encoded() if header is not None else None
        # Where it goes: the header's tokens against the files of its line.
        line: str | None = key
        how = "key"  # an engine whose files do not show their tokens: by the key, as before
        file_key = key
        if prefix is not None:
            if tokens != prefix:
                store.discard_temp(key)
                c.save_failures += 1
                return self._failed(what, f"the engine saved {res.n_tokens:,} tokens, not the prefix's "
                                          f"{len(prefix) // 4:,}", key, result)
            line, how = None, "prefix"
        elif target is None and tokens is not None:
            # A rewound state is not covered by a longer file: the engine reuses it where it does
            # not reuse the longer one (rewind.py). It replaces only its own conversation's file.
            own = None
            if s.view.rewound and s.view.key == key:
                m = AUTO_BIN.match(s.view.file or "")
                own = m.group(1) if m else ""
            to = save_key(key, tokens, self.saved_file, own=own)
            file_key, how = to.key, to.why
            if to.why == "covered":
                store.discard_temp(key)
                c.saves_covered += 1
                msg = f"{what} not kept: {auto_name(to.key)} holds its {res.n_tokens:,} tokens and more"
                log.info("auto sessions: %s", msg)
                ctx.events.emit("save_covered", slot=s.id, key=key, file=auto_name(to.key), n_tokens=res.n_tokens)
                if result is not None:
                    result.skipped.append(msg)
                return SaveOutcome.SAVED  # the conversation is in a file: as good as saved
        final = target or auto_name(file_key)
        ms = (time.monotonic() - t0) * 1000
        v = s.view
        mine = target is None and prefix is None and v.key == key and v.phase in (Phase.HELD, Phase.RESTORED)
        n_prompt = v.n_prompt if mine and v.n_prompt is not None and v.n_prompt <= res.n_tokens else None
        layout = self._learn_layout(key, generation)
        meta = Meta(key=file_key, n_tokens=res.n_tokens, bytes=res.n_bytes, saved_at=time.time(), model=model,
                    save_ms=round(res.ms, 2), line=line, n_prompt=len(prefix) // 4 if prefix is not None else n_prompt,
                    prefix=prefix is not None, layout=layout.fingerprint() if layout else None,
                    marks=self._marks(v, n_prompt, tokens) if mine and target is None else ())
        # One finalize per final file at a time: a file's name comes from its line's key, and
        # one save per temporary (that key) runs at a time, after that temporary's finalize
        # (temp_free); a person's name is kept under the temporary's key.
        assert file_key not in self._finalizing, f"two finalizes of {final}"
        store.acquire(final)
        self.finalize_later(Pending(key, final, file_key, meta if target is None else None, tokens, ino,
                                    asyncio.get_running_loop().create_future(), write=meta, header=header))
        if mine:
            # The engine's count is the truth (a client's usage may differ by one), and the
            # header says token for token what the slot holds.
            s.saved(n_tokens=res.n_tokens, tokens=tokens, file=final)
        c.saves += 1
        if how == "branch":
            c.saves_branched += 1
        c.bytes_saved += res.n_bytes
        c.ms_saved += res.ms
        ctx.savings.saw_save(res.n_tokens, res.n_bytes, res.ms)
        ctx.histograms.save.observe(res.ms / 1000)
        logs.soon(log, logging.INFO, "auto sessions: saved %s tokens (%s) to %s in %.0f ms%s",
                  fmt_tokens(res.n_tokens), fmt_bytes(res.n_bytes), final, ms,
                  f" (conversation {key}: {how})" if how not in ("key", "new", "extends") else "")
        info = {"key": key, "file": final, "n_tokens": res.n_tokens, "bytes": res.n_bytes,
                "engine_ms": round(res.ms, 2), "ms": round(ms, 2), "named": how}
        ctx.events.emit("saved", slot=s.id, **info)
        if result is not None:
            result.saved = info
        return SaveOutcome.SAVED

    def _marks(self, v: View, n_prompt: int | None, tokens: bytes | None) -> tuple[Mark, ...]:
        """Where the saved state's tokens came from, by messages (names.Mark): its first n_prompt
        tokens are the prompt of the request that made it, whose chat signature the view holds.
        None of it for a state a cancelled request left (how much of its prompt it holds is not
        known), nor when what the turn learned of that prompt disagrees with the file."""
        if v.messages is None or n_prompt is None or not v.durable or tokens is None or n_prompt > len(tokens) // 4:
            return ()
        if v.tokens is not None and len(v.tokens) // 4 == n_prompt and tokens[:4 * n_prompt] != v.tokens:
            return ()  # the prompt's tokens as the turn asked for them are not the file's first ones
        return (Mark(len(v.messages) - 1, n_prompt, chain(v.messages, self.ctx.template)[-1]),)

    def _check_header(self, key: str, n_saved: int) -> slotfile.SlotHeader | None:
        """The file's own header must agree with the engine's answer (llama-server files).
        Returns it: the tokens the file holds (None for engines whose files we cannot read)."""
        if self.ctx.engine.magic != slotfile.MAGIC_BYTES:
            return None
        path = self.ctx.store.temp_path(key)
        try:
            header = slotfile.read_header(path)
        except slotfile.UnknownFormat as e:
            # A newer engine's format: the file is kept whole under the key, never cut, and
            # restored by the key only (said once per engine).
            if not self._said_format:
                log.warning("auto sessions: %s: %s: kept whole under its conversation's key (not cut into blocks "
                            "nor matched by its tokens) until autosessd reads this format", path.name, e)
                self._said_format = True
            return None
        except (slotfile.BadSlotFile, OSError) as e:
            raise StoreError(f"{path.name}: {e}") from None
        if header.n_tokens != n_saved:
            raise StoreError(f"{path.name} holds {header.n_tokens:,} tokens by its header, the engine reported "
                             f"{n_saved:,}")
        return header

    def _learn_layout(self, key: str, generation: int) -> slotfile.KVLayout | None:
        """The KV layout of a state file this engine just wrote: it is the engine's layout, the
        first full one the engine's current process shows (facts.py resets it at a restart).
        The save landed here with state in it: since a restart, the probe's answer too."""
        if generation == self.ctx.facts.generation:
            self.ctx.facts.saved_here(generation)
        if self.ctx.engine.magic != slotfile.MAGIC_BYTES:
            return None
        try:
            layout = slotfile.read_layout(self.ctx.store.temp_path(key))
        except (slotfile.BadSlotFile, OSError) as e:
            log.debug("auto sessions: KV layout of %s: %s", key, e)
            return None
        known = self.ctx.engine_layout
        if generation == self.ctx.facts.generation and (known is None or known.v_trans is None):
            self.ctx.engine_layout = layout
        return layout

    def _failed(self, what: str, why: str, key: str, result: TurnResult | None) -> SaveOutcome:
        log.warning("auto sessions: %s: %s", what, why)
        self.ctx.events.emit("save_failed", key=key, error=why)
        if result is not None:
            result.errors.append(f"{what}: {why}")
        return SaveOutcome.FAILED
