"""Whether a save fits on the session directory's disk, before the engine writes it: its size
estimated from the densest file saved so far (bytes a token), plus headroom. A save that does
not fit is skipped (`skipped_disk_full`) and the next prune makes room. Store (directory.py)
is this class and the directory; the attributes declared below are Store's own."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from .names import Meta

if TYPE_CHECKING:
    from .staging import Staging

# Headroom kept free on the disk beyond the estimated size of a save.
FREE_MARGIN = 64 * 1024 * 1024


class Space:
    """Store's disk-space half (see the module's docstring)."""

    path: Path
    staging: Path
    hot: Staging
    _per_token: float | None  # bytes a token of the densest file seen; None: not looked yet

    if TYPE_CHECKING:  # Store's own: a stub here would come before it in Store's MRO
        def scan(self, with_meta: bool = True) -> list: ...  # sets _per_token
        def copies_on_store_disk(self) -> int: ...

    def free_bytes(self) -> int:
        return psutil.disk_usage(str(self.path)).free

    def estimate_bytes(self, n_tokens: int) -> int | None:
        """Bytes a save of n_tokens will take, from the densest file saved so far. Scans the
        directory only the first time (when no scan has yet)."""
        if self._per_token is None:
            self.scan()
        return int(self._per_token * n_tokens) if self._per_token else None

    def _saw(self, meta: Meta) -> None:
        if meta.n_tokens > 0:
            # One float written whole: safe to read from the loop while a thread writes it.
            self._per_token = max(self._per_token or 0.0, meta.bytes / meta.n_tokens)

    def space_needed(self, n_tokens: int) -> int:
        """Free bytes a save of n_tokens needs: its estimated size plus headroom (64 MiB,
        or 5% of a smaller filesystem)."""
        total = psutil.disk_usage(str(self.path)).total
        return (self.estimate_bytes(n_tokens) or 0) + min(FREE_MARGIN, total // 20)

    def check_space(self, n_tokens: int) -> str | None:
        """None when a save of n_tokens fits; otherwise why not (the save is skipped). The
        copies in staging are disposable: they are let go first, on the store's disk as on a
        staging directory apart (tmpfs: the engine writes the whole save there first, so its
        free space counts too), before a save is refused and prune removes a conversation."""
        free, need = self.free_bytes(), self.space_needed(n_tokens)
        if free < need and self.copies_on_store_disk():
            self.hot.make_room(need - free)
            free = self.free_bytes()
        if free < need:
            return f"disk full: {free / 1e6:,.1f} MB free in {self.path}, a save needs about {need / 1e6:,.1f} MB"
        if self.staging != self.path:
            est = self.estimate_bytes(n_tokens) or 0
            room = psutil.disk_usage(str(self.staging)).free
            if room < est:
                self.hot.make_room(est - room)
                room = psutil.disk_usage(str(self.staging)).free
            if room < est:
                return (f"staging full: {room / 1e6:,.1f} MB free in {self.staging}, a save needs about "
                        f"{est / 1e6:,.1f} MB")
        return None
