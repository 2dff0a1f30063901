"""Token index over the session files (DESIGN §9: a file is known by its tokens).

For every session file autosessd can see — its own `auto-<16 hex>.bin` and people's
`*.bin` — the index keeps the model the file was written for, its token count and its
token list, read from the file's header (slotfile.py). A new prompt's tokens then find
the file that shares the longest common prefix (LCP) with it: the engine, given that
file, keeps exactly that prefix and reads only the rest.

How a lookup works. Token lists are kept as the header's own bytes (little-endian
int32) in one sorted list per model, with the prefix each shares with the next. Of strings
in sorted order, the one sharing the longest prefix with a query lies next to the query's
insertion point, and walking away from it the shared prefix is the running minimum of the
neighbours' (no tokens compared again). A lookup is one bisect and two comparisons: 0.05 ms
at 1,000 files of 16k tokens once the query is encoded (0.25 ms to encode 16k tokens), and
under 1 ms when all 1,000 files tie on a shared system prompt. Measured against (bench/
index.py): comparing every file (19 ms at that size) and a hash chain per 64-token block
(0.5 ms, but 30 ms when 1,000 files tie, each read again for the exact prefix; and in
Python its dict of hashes takes as much memory as the tokens). The price is memory: 4 bytes
a token (64 MB at 1,000 × 16k), under 1/1,000 of what the files themselves take on disk
(Gemma 3 270M: 5.8 kB a token; larger models far more).

Model. Auto files carry it in their metadata (`auto-<key>.json`, from the engine's
fingerprint at save time). People's files have none: their model is unknown (None) until
learned (`learn()`: after autosessd parked it by name, or a restore of it was verified by
`cache_n`), and a lookup for a model never offers a file of another or an unknown model.

What is read. Only final names (`*.bin` not starting with a dot: the engine writes
autosessd's saves to `.autosessd-*.partial` first, so an auto file is never seen torn),
only regular files (a link could lead out of the directory), only the header. A header
that does not parse is skipped and the reason kept in `skipped`. A person's file being
written in place by the engine can show a complete header before its state: its size and
mtime then change, and the next `scan()` reads it again; a restore of it meanwhile fails
at the engine and is handled like any failed restore.

Marks (issue 23). An auto file's metadata may record where its tokens came from by messages
(names.Mark: its first n tokens are the prompt of a request whose messages keys.chain names).
The index keeps them with the entry, and `by_messages` finds the files with a mark at the
longest prefix of a request's messages: recall.py then knows the request's tokens, or the file
to restore, without asking the engine.

Between starts the index is cached in one file in the state directory, keyed per file by
(inode, mtime, size) of the .bin and of its metadata (as store/directory.py's metadata cache), so a
start with 1,000 files stats them instead of reading every header. The cache holds token
lists, i.e. conversations: it is written atomically with mode 0600. A cache that is
missing, unreadable, for another directory or damaged is ignored and rebuilt.

Thread safety: every method takes one lock (finalize and ls run in worker threads).

Naming (`save_key`): where a conversation's tokens are saved. The seed's key K (of the
first user message) names a conversation's own line. A conversation whose tokens extend
the file under K replaces it; one that departs from it (another system prompt under the
same opener, an edited message) is saved under branch_key(K, tokens up to and including
the first token that departs), and so on down the chain if that name is taken by yet
another line: never over a file whose tokens it does not contain.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from ..base.files import read_small, regular_ident
from .entries import Entry, Ident, check_name, fitting, is_manifest, manifest_entry, read_cache, write_cache
from .names import AUTO_BIN, Mark, marks_from
from .runs import common_prefix, swa_usable, TokenRun
from .slotfile import BadSlotFile, comparable, encode, read_header

log = logging.getLogger("autosessd")


@dataclass(frozen=True)
class Match:
    name: str
    lcp: int  # tokens shared with the query
    n_tokens: int


@dataclass
class ScanReport:
    files: int = 0
    from_cache: int = 0
    read: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    cache: str = "none"  # "loaded", "none", or why it was not used
    seconds: float = 0.0


def _ident(st: os.stat_result) -> Ident:
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class TokenIndex:
    def __init__(self, directory: str | Path, cache_path: str | Path | None = None, max_tokens: int | None = None):
        """max_tokens: a header claiming more is not read (the engine's context: it could not
        hold such a file anyway); the file is listed in `skipped` with why."""
        self.directory = Path(directory)
        self.cache_path = Path(cache_path) if cache_path else None
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        # Per model its files in sorted order; unknown models under None.
        self._runs: dict[str | None, TokenRun] = {}
        # keys.chain digest → the files with a mark there (by_messages).
        self._marks: dict[str, set[str]] = {}
        self.skipped: dict[str, str] = {}
        self.dirty = False  # changed since the cache was last written or loaded
        # add/remove/learn while a scan reads the disk win over what the scan saw: they
        # are newer. Each records the change's number here; a scan drops what is older.
        self._gen = 0
        self._changed: dict[str, int] = {}
        self._moves = 0  # every _insert, _drop and _resort: generation

    # -- reading the directory --------------------------------------------------
    def scan(self) -> ScanReport:
        """(Re)build from the directory: entries whose files are unchanged since the cache or
        the last scan are kept, others are read from their headers. Blocking I/O."""
        t0 = time.perf_counter()
        report = ScanReport()
        with self._lock:
            known = dict(self._entries)
            gen0 = self._gen
        if not known and self.cache_path is not None:
            known, report.cache = self._load_cache()
        bins: dict[str, os.stat_result] = {}
        metas: dict[str, os.stat_result] = {}
        skipped: dict[str, str] = {}
        try:
            it = os.scandir(self.directory)
        except FileNotFoundError:
            it = None
        if it is not None:
            with it:
                for d in it:
                    if d.name.startswith("."):
                        continue  # temporaries: being written
                    try:
                        st = d.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if d.name.endswith(".bin"):
                        if not d.is_file(follow_symlinks=False):
                            skipped[d.name] = "not a regular file"
                            continue
                        bins[d.name] = st
                    elif d.name.startswith("auto-") and d.name.endswith(".json"):
                        metas[d.name] = st
        entries: dict[str, Entry] = {}
        for jname, mst in metas.items():
            # A manifest (issue 39): its tokens are in it, and a .bin under its name is only a
            # copy. Known by the manifest's identity (ident == meta_ident).
            name = jname[:-5] + ".bin"
            meta_ident = _ident(mst)
            old = known.get(name)
            if old is not None and old.meta_ident == meta_ident:
                if old.ident == meta_ident:
                    entries[name] = old  # a manifest, unchanged
                    report.from_cache += 1
                    continue
                if name in bins:
                    continue  # a whole file's metadata, unchanged: its .bin below
            try:  # a new or changed metadata: a manifest (even with a copy beside it) or not, by its content
                e = manifest_entry(self.directory, name, meta_ident)
            except (OSError, ValueError, KeyError, TypeError) as err:
                skipped[name] = f"{jname}: {err}"
                continue
            if e is not None:
                entries[name], report.read = e, report.read + 1
        for name, st in bins.items():
            if name in entries:
                continue
            meta_st = metas.get(name[:-4] + ".json") if AUTO_BIN.match(name) else None
            ident, meta_ident = _ident(st), _ident(meta_st) if meta_st else None
            old = known.get(name)
            if old is not None and old.ident == ident and old.meta_ident == meta_ident:
                entries[name] = old
                report.from_cache += 1
                continue
            try:
                entries[name] = self._read(name, ident, meta_ident, old)
                report.read += 1
            except FileNotFoundError:
                pass  # removed since the directory was listed (a prune)
            except (BadSlotFile, OSError) as e:
                skipped[name] = str(e)
        with self._lock:
            for name, gen in self._changed.items():
                if gen > gen0:
                    if name in self._entries:
                        entries[name] = self._entries[name]
                        skipped.pop(name, None)
                    else:
                        entries.pop(name, None)
            self._changed = {n: g for n, g in self._changed.items() if g > gen0}
            if report.read or entries.keys() != known.keys():
                self.dirty = True
            if not self._entries:
                self._entries = entries
                self._resort()
            else:  # a rescan: most files are unchanged, move only what did
                for name, e in list(self._entries.items()):
                    if entries.get(name) is not e:
                        self._drop(e)
                for name, e in entries.items():
                    if name not in self._entries:
                        self._insert(e)
            self.skipped = skipped
        report.files, report.skipped = len(entries), skipped
        report.seconds = time.perf_counter() - t0
        return report

    def _read(self, name: str, ident: Ident, meta_ident: Ident | None, old: Entry | None) -> Entry:
        path = self.directory / name
        header = read_header(path, self.max_tokens)
        model, marks = None, ()
        if AUTO_BIN.match(name):
            model, marks = self._meta_facts(name, ident[2])
        elif old is not None and old.ident == ident:
            model = old.model  # learned, and the file is the same one
        tokens = header.encoded()
        return Entry(name=name, model=model, n_tokens=header.n_tokens, tokens=tokens, ident=ident,
                     meta_ident=meta_ident, marks=fitting(marks, tokens))

    def _meta_facts(self, name: str, size: int) -> tuple[str | None, tuple[Mark, ...]]:
        """The model and the marks in auto-<key>.json when that metadata belongs to this very file."""
        try:
            d = json.loads(read_small(self.directory / (name[:-4] + ".json")))
            if d["key"] != AUTO_BIN.match(name).group(1) or int(d["bytes"]) != size:
                return None, ()
            return str(d["model"]), marks_from(d.get("marks"))
        except (OSError, ValueError, KeyError, TypeError):
            return None, ()

    # -- keeping up with saves and removals ---------------------------------------
    def add(self, name: str, tokens: Sequence[int], model: str | None, marks: Sequence[Mark] = ()) -> Entry:
        """A file that was just made final under `name`, holding `tokens`, for `model` (marks:
        its metadata's). The file must exist (its identity is what keeps the cache honest)."""
        check_name(name)
        meta_ident = self._meta_ident(name)
        try:
            ident = _ident(os.stat(self.directory / name, follow_symlinks=False))
        except FileNotFoundError:
            if meta_ident is None:
                raise
            ident = meta_ident  # a manifest: its blocks are the file (issue 39)
        if meta_ident is not None and is_manifest(self.directory, name):
            ident = meta_ident
        data = encode(comparable(tokens))
        entry = Entry(name=name, model=model, n_tokens=len(tokens), tokens=data, ident=ident,
                      meta_ident=meta_ident, marks=fitting(tuple(marks), data))
        self._put(entry)
        return entry

    def _meta_ident(self, name: str) -> Ident | None:
        """The identity of an auto file's metadata, None for people's files or none yet."""
        if not AUTO_BIN.match(name):
            return None
        try:
            return _ident(os.stat(self.directory / (name[:-4] + ".json"), follow_symlinks=False))
        except FileNotFoundError:
            return None

    def add_file(self, name: str, model: str | None = None) -> Entry:
        """Index `name` from its own header (after a save: the engine's word on what it
        holds). Model: the one given, else its metadata's (auto), else what was learned."""
        check_name(name)
        path = self.directory / name
        st = os.stat(path, follow_symlinks=False)
        header = read_header(path, self.max_tokens)
        meta_ident = self._meta_ident(name)
        marks: tuple[Mark, ...] = ()
        if AUTO_BIN.match(name):
            meta_model, marks = self._meta_facts(name, st.st_size)
            model = model if model is not None else meta_model
        elif model is None:
            with self._lock:
                old = self._entries.get(name)
            model = old.model if old is not None and old.ident == _ident(st) else None
        tokens = header.encoded()
        entry = Entry(name=name, model=model, n_tokens=header.n_tokens, tokens=tokens, ident=_ident(st),
                      meta_ident=meta_ident, marks=fitting(marks, tokens))
        self._put(entry)
        return entry

    def learn(self, name: str, model: str) -> bool:
        """The model of a file is now known (a person's file autosessd parked, or restored
        and saw reused). False when the index has no such file."""
        with self._lock:
            e = self._entries.get(name)
            if e is None:
                return False
            if e.model != model:
                self._drop(e)
                self._insert(dataclasses.replace(e, model=model))
                self._touch(name)
            return True

    def forget_if_gone(self, name: str) -> bool:
        """Forget `name` when it is no longer a regular file in the directory (removed behind
        autosessd's back: rm, another tool), nor a manifest (issue 39). A stat or two. →
        whether it was forgotten now."""
        if regular_ident(self.directory / name) is not None:
            return False
        if AUTO_BIN.match(name) and regular_ident(self.directory / (name[:-4] + ".json")) is not None \
                and is_manifest(self.directory, name):
            return False
        log.info("auto sessions: %s is gone from the session directory (removed by hand?): the index forgets it",
                 name)
        return self.remove(name)

    def remove(self, name: str, ident: Ident | None = None) -> bool:
        """Forget `name`; with `ident` (inode, mtime_ns, size), only while the entry is of that
        file: a file saved again under the name since keeps its entry."""
        with self._lock:
            e = self._entries.get(name)
            if e is None or (ident is not None and e.ident != ident):
                return False
            self._drop(e)
            self._touch(name)
            return True

    def _put(self, entry: Entry) -> None:
        with self._lock:
            old = self._entries.get(entry.name)
            if old is not None:
                self._drop(old)
            self._insert(entry)
            self.skipped.pop(entry.name, None)
            self._touch(entry.name)

    @property
    def generation(self) -> int:
        """Moves on every change of the entries or their marks (an add, a remove, a rescan):
        an answer drawn from them while it stays the same still holds."""
        return self._moves

    def _touch(self, name: str) -> None:
        self._gen += 1
        self._changed[name] = self._gen
        self.dirty = True

    def _insert(self, e: Entry) -> None:
        self._moves += 1
        self._entries[e.name] = e
        self._runs.setdefault(e.model, TokenRun()).insert(e.tokens, e.name)
        for m in e.marks:
            self._marks.setdefault(m.chain, set()).add(e.name)

    def _drop(self, e: Entry) -> None:
        self._moves += 1
        del self._entries[e.name]
        for m in e.marks:
            names = self._marks.get(m.chain)
            if names is not None:
                names.discard(e.name)
                if not names:
                    del self._marks[m.chain]
        run = self._runs[e.model]
        run.delete(e.tokens, e.name)
        if not run.items:
            del self._runs[e.model]

    def _resort(self) -> None:
        self._moves += 1
        by_model: dict[str | None, list[tuple[bytes, str]]] = {}
        for e in self._entries.values():
            by_model.setdefault(e.model, []).append((e.tokens, e.name))
        self._runs = {m: TokenRun(items) for m, items in by_model.items()}
        self._marks = {}
        for e in self._entries.values():
            for m in e.marks:
                self._marks.setdefault(m.chain, set()).add(e.name)

    # -- lookups -------------------------------------------------------------------
    def get(self, name: str) -> Entry | None:
        with self._lock:
            return self._entries.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._entries

    def by_messages(self, chain: Sequence[str], model: str | None) -> tuple[int, list[tuple[Entry, Mark]]]:
        """The files of `model` with a mark at the longest prefix of a request's messages
        (chain: keys.chain of its signature): (how many of its messages that mark covers, [(the
        file, its mark)]); (0, []) when none has one. One dict lookup per message."""
        with self._lock:
            for i in range(len(chain) - 1, -1, -1):
                names = self._marks.get(chain[i])
                if not names:
                    continue
                found = []
                for name in sorted(names):
                    e = self._entries[name]
                    m = next((m for m in e.marks if m.chain == chain[i] and m.n_messages == i + 1), None)
                    if e.model == model and m is not None:
                        found.append((e, m))
                if found:
                    return i + 1, found
        return 0, []

    def lcp(self, name: str, tokens: Sequence[int] | bytes) -> int | None:
        """Tokens `name` shares with `tokens` from the start; None when not indexed."""
        q = tokens if isinstance(tokens, bytes) else encode(tokens)
        with self._lock:
            e = self._entries.get(name)
        return None if e is None else common_prefix(e.tokens, q)

    def matches(self, tokens: Sequence[int] | bytes, model: str | None, min_lcp: int = 1,
                exclude: Iterable[str] = (), window: int | None = None, limit: int | None = None) -> list[Match]:
        """Files of `model` sharing at least min_lcp tokens with `tokens`, longest prefix
        first (ties: fewer tokens to restore, then name). model=None asks among the files
        whose model is unknown. window: see best()."""
        q = tokens if isinstance(tokens, bytes) else encode(tokens)
        exclude = set(exclude)
        with self._lock:
            run = self._runs.get(model)
            found = [Match(name, n, self._entries[name].n_tokens)
                     for n, name in (run.around(q, max(1, min_lcp)) if run else ())
                     if name not in exclude and self._usable(name, n, window)]
        found.sort(key=lambda m: (-m.lcp, m.n_tokens, m.name))
        return found[:limit] if limit is not None else found

    def best(self, tokens: Sequence[int] | bytes, model: str | None, exclude: Iterable[str] = (),
             prefer: str | None = None, min_lcp: int = 1, window: int | None = None) -> tuple[str, int] | None:
        """The file of `model` that shares the longest prefix with `tokens`: (name, lcp), or
        None when none shares min_lcp. Among equals: `prefer` (the request's own line),
        then the smallest file (the quickest restore), then the name.

        window: the engine's sliding window (n_swa: 1,024 for Gemma 3 27B) for a model with
        sliding-window layers (swa_usable). None: a model without them."""
        q = tokens if isinstance(tokens, bytes) else encode(tokens)
        exclude = set(exclude)
        with self._lock:
            run = self._runs.get(model)
            if run is None:
                return None
            top = 0  # the nearest usable file on each side shares the most on its side
            for step in (-1, 1):
                top = max(top, next((n for n, name in run.side(q, max(1, min_lcp), step)
                                     if name not in exclude and self._usable(name, n, window)), 0))
            if not top:
                return None
            tied = [name for n, name in run.around(q, top) if name not in exclude and self._usable(name, n, window)]
            name = min(tied, key=lambda nm: (nm != prefer, self._entries[nm].n_tokens, nm))
        return name, top

    def _usable(self, name: str, lcp: int, window: int | None) -> bool:
        return swa_usable(self._entries[name].n_tokens, lcp, window)

    # -- the cache -----------------------------------------------------------------
    def save_cache(self) -> bool:
        """Write the cache (atomically, 0600) when something changed. Blocking I/O; run it
        off the request's path (at stop, after prune). False when there was nothing to do."""
        if self.cache_path is None:
            return False
        with self._lock:
            if not self.dirty:
                return False
            entries = sorted(self._entries.values(), key=lambda e: e.name)
            self.dirty = False
        try:
            write_cache(self.cache_path, self.directory, entries)
        except OSError:
            with self._lock:
                self.dirty = True
            raise
        return True

    def _load_cache(self) -> tuple[dict[str, Entry], str]:
        """(entries, "loaded") or ({}, why the cache was not used)."""
        return read_cache(self.cache_path, self.directory)
