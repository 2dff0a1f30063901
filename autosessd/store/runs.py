"""Token lists compared: the tokens two lists share from the start (a memcmp binary search),
TokenRun, one model's token lists in sorted order that finds the files sharing most with a
query without comparing every one, and the sliding-window rule that says whether a file
sharing a prefix can be restored for a request. Pure; the token index (index.py) and the
shared bucket's catalog (sessions/remote.py) search with it."""

from __future__ import annotations

import bisect
import struct
from typing import Iterator


def decode(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}i", data))


def common_prefix(a: bytes, b: bytes) -> int:
    """Tokens two encoded token lists share from the start.

    Binary search on prefix equality: each comparison is a memcmp in C, so 32k tokens cost
    ~17 comparisons instead of a Python loop over every token; through a memoryview, with no
    copy of either list (the common case, one a prefix of the other, is one memcmp)."""
    if len(a) > len(b):
        a, b = b, a
    n = len(a) >> 2
    va = memoryview(a)
    if b.startswith(va[:4 * n]):
        return n
    lo, hi = 0, n  # a[:4lo] == b[:4lo], a[:4hi] != b[:4hi]
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if b.startswith(va[4 * lo:4 * mid], 4 * lo):
            lo = mid
        else:
            hi = mid
    return lo


class TokenRun:
    """One model's files in sorted order of their tokens, and the prefix each shares with
    the next (adj[k] = lcp(items[k], items[k+1])). For sorted a ≤ b ≤ c, lcp(a, c) =
    min(lcp(a, b), lcp(b, c)): from a query's insertion point outwards, the prefix each
    file shares with the query follows from the previous one and adj, without comparing
    tokens again — 1,000 files under one system prompt cost one comparison, not 1,000.
    The shared bucket's catalog (remote.py) keeps one of its own, of token lists that are not
    files in the directory."""

    def __init__(self, items: list[tuple[bytes, str]] | None = None):
        self.items = sorted(items or [])
        self.adj = [common_prefix(a[0], b[0]) for a, b in zip(self.items, self.items[1:])]

    def insert(self, data: bytes, name: str) -> None:
        n = len(self.items)
        p = bisect.bisect_left(self.items, (data, name))
        self.items.insert(p, (data, name))
        if 0 < p < n:
            self.adj[p - 1:p] = [common_prefix(self.items[p - 1][0], data), common_prefix(data, self.items[p + 1][0])]
        elif p == 0 and n:
            self.adj.insert(0, common_prefix(data, self.items[1][0]))
        elif p == n and n:
            self.adj.append(common_prefix(self.items[p - 1][0], data))

    def delete(self, data: bytes, name: str) -> None:
        n = len(self.items)
        p = bisect.bisect_left(self.items, (data, name))
        assert self.items[p][1] == name, (name, self.items[p][1])
        del self.items[p]
        if 0 < p < n - 1:
            self.adj[p - 1:p + 1] = [min(self.adj[p - 1], self.adj[p])]
        elif p == 0 and n > 1:
            del self.adj[0]
        elif p == n - 1 and n > 1:
            del self.adj[p - 1]

    def side(self, q: bytes, floor: int, step: int) -> Iterator[tuple[int, str]]:
        """(shared tokens, name) of the files sharing at least `floor` with q on one side of
        its insertion point (step -1: before it, +1: after it), nearest first. Stops at the
        first file below `floor`: nothing further out shares more."""
        i = bisect.bisect_left(self.items, (q, ""))
        j = i - 1 if step < 0 else i
        if not 0 <= j < len(self.items):
            return
        n = common_prefix(self.items[j][0], q)
        while n >= floor:
            yield n, self.items[j][1]
            j += step
            if not 0 <= j < len(self.items):
                return
            n = min(n, self.adj[j] if step < 0 else self.adj[j - 1])

    def around(self, q: bytes, floor: int) -> Iterator[tuple[int, str]]:
        yield from self.side(q, floor, -1)
        yield from self.side(q, floor, +1)


def swa_usable(n_tokens: int, lcp: int, window: int | None) -> bool:
    """Can a file of n_tokens, sharing lcp with a request, be restored for it on a model with
    sliding-window layers of `window` tokens? llama-server saves only the last window of
    those layers' cells (llama_kv_cache::state_write skips SWA-masked cells, with or without
    --swa-full). After a restore the engine recomputes the request from position lcp, and
    the sliding-window layers there attend to the `window` positions before it: all present
    only when the file is no longer than the window or the request goes on from (nearly) its
    end. Otherwise an engine without --swa-full reads the whole prompt again, and one with it
    reuses the prefix with cells missing: measured on b11434, a top log-probability of -1.398
    after the restore against -1.112 from the engine's own cache for the same prompt (an
    extension gave the same -0.880 both ways). So such files are passed over.

    window 0 stands for a model with recurrent layers (Context.reuse_window): its state is for
    the file's last token only, and the engine reuses it only for a request that goes on from
    the file's very end (server-context.cpp: anything else needs a context checkpoint, and
    those are not in the file)."""
    if window == 0:
        return lcp >= n_tokens
    return window is None or n_tokens <= window or n_tokens - lcp <= 1
