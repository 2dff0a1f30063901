"""Which blocks the manifests name (issue 39): what prune may remove, and what the store holds.
Store (directory.py) is this class and the directory; the attributes declared below are Store's:
_uses (a manifest's key → its blocks' keys) and _refs (a block's key → how many manifests name
it), built at start by cleanup() and kept by every finalize and remove, under Store's lock."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from .blocks import BlockStore
from .names import Meta, StoreError, auto_name


class References:
    """Store's blocks-by-manifest half (see the module's docstring)."""

    blocks: BlockStore | None
    block_bytes_written: int
    staging: Path
    path: Path
    _lock: threading.RLock
    _uses: dict[str, tuple[str, ...]]
    _refs: Counter[str]
    _hot: dict[str, int]

    if TYPE_CHECKING:  # the other rooms' own
        def remove(self, key: str, ident: tuple[int, int, int] | None = None) -> int: ...
        def hot_copies(self) -> dict[str, int]: ...

    def _meta_changed(self, key: str, meta: Meta | None) -> list[str]:
        """auto-<key>.json is now `meta` (None: gone): the blocks it names counted, and when it
        is a whole file in the store's own directory, its .bin is the store's and no copy (the
        copies' budget never removes it). Called under _lock, in the section that renamed the
        metadata. → the blocks no manifest names any more (for _remove_blocks)."""
        new = tuple(b[0] for b in meta.blocks) if meta is not None and meta.in_blocks else ()
        unused = []
        with self._lock:
            old = self._uses.pop(key, ())
            if new:
                self._uses[key] = new
            elif meta is not None and self.staging == self.path:
                self._hot.pop(auto_name(key), None)
            self._refs.update(new)
            self._refs.subtract(old)
            for k in set(old):
                if self._refs[k] <= 0:
                    del self._refs[k]
                    unused.append(k)
        return unused

    def _remove_blocks(self, keys: list[str]) -> int:
        """Of `keys`, the blocks no manifest names and nobody holds, removed: the look and the
        rename aside under _lock and the block store's lock (a save pins its blocks before it
        looks for them and until its manifest counts them, so at any moment a block it uses is
        pinned or named), the unlink outside them. → bytes freed."""
        if self.blocks is None or not keys:
            return 0
        doomed = []
        for k in keys:
            with self._lock:
                if k in self._refs:
                    continue
                got = self.blocks.set_aside(k)
            if got is not None:
                doomed.append(got)
        freed = 0
        for path, size in doomed:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                freed += size
        return freed

    def written_blocks(self, n: int) -> None:
        with self._lock:
            self.block_bytes_written += n

    def unused_blocks(self, dry_run: bool = False) -> tuple[int, int]:
        """Remove the blocks no manifest names (and no save or assembly holds): → (blocks, bytes)."""
        if self.blocks is None:
            return 0, 0
        there = self.blocks.scan()
        with self._lock:
            unused = [k for k in there if k not in self._refs]
        if dry_run:
            return len(unused), sum(there[k] for k in unused)
        return len(unused), self._remove_blocks(unused)

    def _drop_manifests_of(self, block: str) -> list[str]:
        """Every manifest naming `block` (found damaged) removed: → their names."""
        with self._lock:
            keys = [k for k, bs in self._uses.items() if block in bs]
        gone = []
        for k in keys:
            with contextlib.suppress(StoreError, OSError):
                self.remove(k)
                gone.append(auto_name(k))
        return gone

    def block_refs(self) -> dict[str, int]:
        """How many manifests name each block."""
        with self._lock:
            return dict(self._refs)

    def usage(self) -> dict[str, int]:
        """What the store holds (status): whole files, blocks (each once) and hot copies."""
        blocks = self.blocks.scan() if self.blocks is not None else {}
        with self._lock:
            manifests, refs = len(self._uses), dict(self._refs)
        shared = sum(size for k, size in blocks.items() if refs.get(k, 0) > 1)
        return {"manifests": manifests, "blocks": len(blocks), "block_bytes": sum(blocks.values()),
                "shared_block_bytes": shared, "block_bytes_written": self.block_bytes_written,
                "hot": self.hot_copies()}
