"""What prune removes (DESIGN §4): the auto files as a scan sees them, and the plan that keeps
the newest `keep` within `max_bytes` (and frees what a refused save needed), never a file in use.
Pure: Store.prune (directory.py) runs it on a scan."""

from __future__ import annotations

from dataclasses import dataclass

from .names import Meta, auto_name


@dataclass(frozen=True)
class Entry:
    """An auto file as the scan found it."""

    key: str
    bytes: int
    mtime: float
    meta: Meta | None
    ident: tuple[int, int, int] | None = None  # (inode, mtime_ns, size) as scanned: prune removes that
    #                                            file only, never one saved since (an inode is reused)

    @property
    def saved_at(self) -> float:
        return self.meta.saved_at if self.meta else self.mtime

    @property
    def name(self) -> str:
        return auto_name(self.key)


@dataclass(frozen=True)
class PrunePlan:
    remove: list[Entry]
    keep: list[Entry]

    @property
    def freed(self) -> int:
        return sum(e.bytes for e in self.remove)


def plan_prune(entries: list[Entry], keep: int, max_bytes: int, in_use: set[str] = frozenset(),
               must_free: int = 0) -> PrunePlan:
    """Keep the newest `keep` auto files and at most `max_bytes` of them; never one in use.
    With must_free > 0 (a save was refused for space), also remove the oldest of the rest
    until that many bytes are freed.

    Pure: the caller scans and deletes. Files in use are kept and count toward the
    budget (they are on the disk either way)."""
    newest_first = sorted(entries, key=lambda e: (e.saved_at, e.key), reverse=True)
    kept: list[Entry] = []
    removed: list[Entry] = []
    total = 0
    for e in newest_first:
        if e.name in in_use or (len(kept) < keep and total + e.bytes <= max_bytes):
            kept.append(e)
            total += e.bytes
        else:
            removed.append(e)
    freed = sum(e.bytes for e in removed)
    for e in reversed(list(kept)):  # oldest first
        if freed >= must_free:
            break
        if e.name not in in_use:
            kept.remove(e)
            removed.append(e)
            freed += e.bytes
    return PrunePlan(remove=removed, keep=kept)
