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
    blocks: tuple[str, ...] = ()  # a manifest's blocks (its bytes are theirs, each counted once)

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
    block_bytes: dict[str, int] | None = None

    @property
    def kept_bytes(self) -> int:
        """What the kept conversations take: whole files' bytes, and their blocks each once."""
        held = {k for e in self.keep for k in e.blocks}
        return sum(e.bytes for e in self.keep if not e.blocks) + sum((self.block_bytes or {}).get(k, 0)
                                                                      for k in held)

    @property
    def freed(self) -> int:
        """Whole files' bytes, and the blocks only removed conversations held (each once)."""
        held = {k for e in self.keep for k in e.blocks}
        gone = {k for e in self.remove for k in e.blocks} - held
        return sum(e.bytes for e in self.remove if not e.blocks) + sum((self.block_bytes or {}).get(k, 0)
                                                                        for k in gone)


def plan_prune(entries: list[Entry], keep: int, max_bytes: int, in_use: set[str] = frozenset(),
               must_free: int = 0, block_bytes: dict[str, int] | None = None) -> PrunePlan:
    """Keep the newest `keep` auto files and at most `max_bytes` of them; never one in use.
    With must_free > 0 (a save was refused for space), also remove the oldest of the rest
    until that many bytes are freed.

    A whole file costs its bytes; a manifest (issue 39) the bytes of its blocks that no newer
    kept conversation holds already (block_bytes: each block's size): a block shared by many
    conversations counts once, for the newest of them. Pure: the caller scans and deletes.
    Files in use are kept and count toward the budget (they are on the disk either way)."""
    sizes = block_bytes or {}
    newest_first = sorted(entries, key=lambda e: (e.saved_at, e.key), reverse=True)
    kept: list[Entry] = []
    removed: list[Entry] = []
    counted: set[str] = set()
    total = 0

    def cost(e: Entry) -> int:
        if not e.blocks:
            return e.bytes
        return sum(sizes.get(k, 0) for k in set(e.blocks) - counted)

    for e in newest_first:
        c = cost(e)
        if e.name in in_use or (len(kept) < keep and total + c <= max_bytes):
            kept.append(e)
            total += c
            counted.update(e.blocks)
        else:
            removed.append(e)
    held = {k for e in kept for k in e.blocks}
    freed = sum(e.bytes for e in removed if not e.blocks) + sum(
        sizes.get(k, 0) for k in {k for e in removed for k in e.blocks} - held)
    for e in reversed(list(kept)):  # oldest first
        if freed >= must_free:
            break
        if e.name not in in_use:
            kept.remove(e)
            removed.append(e)
            held = {k for x in kept for k in x.blocks}
            freed += e.bytes if not e.blocks else sum(sizes.get(k, 0) for k in set(e.blocks) - held)
    return PrunePlan(remove=removed, keep=kept, block_bytes=sizes)
