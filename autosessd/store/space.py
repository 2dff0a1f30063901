"""Whether a save fits on the session directory's disk, before the engine writes it: its size
estimated from the densest file saved so far (bytes a token), plus headroom. A save that does
not fit is skipped (`skipped_disk_full`) and the next prune makes room. Store (directory.py)
is this class and the directory; the attributes declared below are Store's own."""

from __future__ import annotations

from pathlib import Path

import psutil

from .names import Meta

# Headroom kept free on the disk beyond the estimated size of a save.
FREE_MARGIN = 64 * 1024 * 1024


class Space:
    """Store's disk-space half (see the module's docstring)."""

    path: Path
    _per_token: float | None  # bytes a token of the densest file seen; None: not looked yet

    def scan(self, with_meta: bool = True) -> list: ...  # Store's: sets _per_token

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
        """None when a save of n_tokens fits; otherwise why not (the save is skipped). With a
        staging directory apart (tmpfs), the engine writes the whole save there first: its free
        space counts too, after the copies kept there beyond what the save needs are let go."""
        free, need = self.free_bytes(), self.space_needed(n_tokens)
        if free < need:
            return f"disk full: {free / 1e6:,.1f} MB free in {self.path}, a save needs about {need / 1e6:,.1f} MB"
        staging = getattr(self, "staging", self.path)
        if staging != self.path:
            est = self.estimate_bytes(n_tokens) or 0
            room = psutil.disk_usage(str(staging)).free
            if room < est:
                self.make_room_in_staging(est - room)
                room = psutil.disk_usage(str(staging)).free
            if room < est:
                return f"staging full: {room / 1e6:,.1f} MB free in {staging}, a save needs about {est / 1e6:,.1f} MB"
        return None

    def make_room_in_staging(self, n_bytes: int) -> int: ...  # Staging's (Store's MRO: it comes first)
