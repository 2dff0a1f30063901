"""A file a turn downloaded whole (a manifest's blocks written into the engine's file, or another
host's whole file: shared/downloads.py) is kept as blocks after its restore read it
(Upkeep.keep_as_blocks, issue 48): later, off the turn's path, and one held meanwhile by a
restore is left whole rather than cut under it."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from autosessd.sessions.upkeep import Upkeep
from autosessd.store import blocks
from autosessd.store.directory import Meta, Store
from kv_common import slot_file

A = "a" * 16
TOKS = list(range(100, 120))


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(blocks, "BLOCK_TOKENS", 4)


def whole_file(tmp_path) -> Store:
    """auto-A.bin whole, as a download installs it (another host's)."""
    off = Store(tmp_path, blocks=False)
    data = slot_file(TOKS)
    off.temp_path(A).write_bytes(data)
    assert not off.finalize(A, Meta(A, len(TOKS), len(data), time.time(), "m", 1.0, host="host1")).in_blocks
    return Store(tmp_path)


async def until(what, ok, bound_s=20.0):
    t0 = time.monotonic()
    while not ok():
        assert time.monotonic() - t0 < bound_s, what
        await asyncio.sleep(0.02)


def test_a_downloaded_whole_file_is_kept_as_blocks_after_its_restore(tmp_path):
    store = whole_file(tmp_path)
    up = Upkeep(SimpleNamespace(store=store, index=None))

    async def go():
        up.keep_as_blocks(A, after_s=0.2)
        await asyncio.sleep(0.05)
        assert not store.read_meta(A).in_blocks  # not at once: the turn goes on first
        await until("auto-A.bin kept as blocks", lambda: store.read_meta(A).in_blocks)

    asyncio.run(go())
    meta = store.read_meta(A)
    assert meta.host == "host1" and len(meta.blocks) == 5 and len(store.blocks.scan()) == 5


def test_one_held_when_its_time_comes_is_kept_as_blocks_later_and_stop_cancels_those_waiting(tmp_path,
                                                                                              monkeypatch):
    import autosessd.sessions.upkeep as upkeep

    monkeypatch.setattr(upkeep, "KEEP_AS_BLOCKS_AFTER_S", 0.3)
    store = whole_file(tmp_path)
    up = Upkeep(SimpleNamespace(store=store, index=None))

    async def go():
        with store.using(f"auto-{A}.bin"):  # a restore reads it
            up.keep_as_blocks(A, after_s=0.01)
            await asyncio.sleep(0.1)
            await until("the import to end", lambda: up._import_task is not None and up._import_task.done())
            assert not store.read_meta(A).in_blocks and not store.blocks.scan()  # nothing cut under it
        await until("auto-A.bin kept as blocks once let go", lambda: store.read_meta(A).in_blocks)

    asyncio.run(go())
    (tmp_path / "other").mkdir()
    other = whole_file(tmp_path / "other")

    async def stopped():
        up2 = Upkeep(SimpleNamespace(store=other, index=None))
        up2.keep_as_blocks(A, after_s=0.1)
        up2.stop_import()
        await asyncio.sleep(0.4)

    asyncio.run(stopped())
    assert not other.read_meta(A).in_blocks and not other.blocks.scan()

