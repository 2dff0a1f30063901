"""held.json kept as the slots change (issue 33, held.Recorder): what each slot held last, for
the restore after a restart and at a start, written whole (temporary, fsync, rename) so that a
crash leaves the old record or the new one."""

import asyncio
import json
from types import SimpleNamespace

from autosessd.sessions import held
from autosessd.sessions.slot import Phase, View

A, B, C = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "cccccccccccccccc"


def slot(i, phase, key=None, file=None, n=100):
    return SimpleNamespace(id=i, view=View(phase, key=key, n_tokens=n, file=file), on_change=None)


async def settled(r):
    for _ in range(100):
        await asyncio.sleep(r.FLUSH_S)
        if not r._dirty and (r._writing is None or r._writing.done()):
            return


async def test_a_slot_holding_a_conversation_in_a_file_is_recorded_as_it_changes(tmp_path):
    path = tmp_path / "state" / "held.json"
    slots = {0: slot(0, Phase.EMPTY), 1: slot(1, Phase.EMPTY)}
    r = held.Recorder(path, "m1", slots)
    assert all(s.on_change == r.changed for s in slots.values())
    slots[0].view = View(Phase.HELD, key=A, n_tokens=100, file=f"auto-{A}.bin")
    r.changed(slots[0])
    slots[1].view = View(Phase.RESTORED, key=B, n_tokens=50, file=f"auto-{B}.bin")
    r.changed(slots[1])
    await settled(r)
    data = json.loads(path.read_text())
    assert data["model"] == "m1" and {k: v["file"] for k, v in data["slots"].items()} == {
        "0": f"auto-{A}.bin", "1": f"auto-{B}.bin"}
    assert (path.stat().st_mode & 0o777) == 0o600 and not path.with_suffix(".tmp").exists()
    # A request running, a lost state, an empty slot: what it held last stays.
    for phase in (Phase.SWITCHED, Phase.UNKNOWN, Phase.EMPTY):
        slots[0].view = View(phase, key=A if phase is Phase.SWITCHED else None)
        r.changed(slots[0])
    await settled(r)
    assert json.loads(path.read_text())["slots"]["0"]["file"] == f"auto-{A}.bin"
    # Another conversation in no file yet: the slot's entry goes (A is not its last any more).
    slots[0].view = View(Phase.HELD, key=C, n_tokens=10)
    r.changed(slots[0])
    await settled(r)
    assert set(json.loads(path.read_text())["slots"]) == {"1"}
    # A restore of another's file (or a prefix) that the conversation then goes on from: its
    # view names no file of its own, and nothing is kept for it either.
    slots[1].view = View(Phase.HELD, key=B, n_tokens=60)
    r.changed(slots[1])
    await settled(r)
    assert json.loads(path.read_text())["slots"] == {}
    slots[1].view = View(Phase.HELD, key=B, n_tokens=60, file=f"auto-{B}.bin")
    r.changed(slots[1])
    await settled(r)
    # A new start reads it back, most recent first; another model's record is none.
    again = held.Recorder(path, "m1", {})
    assert [s for s, _ in again.last()] == [1] and again.keys() == {1: B}
    assert held.Recorder(path, "m2", {}).entries == {}


async def test_the_stop_record_keeps_what_slots_that_hold_nothing_now_held_last(tmp_path):
    path = tmp_path / "held.json"
    slots = {0: slot(0, Phase.HELD, A, f"auto-{A}.bin"), 1: slot(1, Phase.HELD, B, f"auto-{B}.bin")}
    r = held.Recorder(path, "m", slots)
    for s in slots.values():
        r.changed(s)
    await settled(r)
    slots[1].view = View(Phase.UNKNOWN, why="the engine restarted")
    await r.record_stop(slots.values())
    assert {slot: e["file"] for slot, e in held.Recorder(path, "m").entries.items()} == {
        0: f"auto-{A}.bin", 1: f"auto-{B}.bin"}


def test_a_torn_or_foreign_record_is_as_good_as_none(tmp_path):
    path = tmp_path / "held.json"
    for data in (b"{not json", b"[1, 2]", json.dumps({"model": "m", "slots": {"x": {}}}).encode()):
        path.write_bytes(data)
        r = held.Recorder(path, "m", {})
        assert r.last() == [] and r.keys() == {}


async def test_the_stop_record_lands_last(tmp_path):
    """A change just before the stop (the stop save) is not written after the stop's record."""
    path = tmp_path / "held.json"
    slots = {0: slot(0, Phase.HELD, A, f"auto-{A}.bin")}
    r = held.Recorder(path, "m", slots)
    r.changed(slots[0])  # its write waits FLUSH_S
    slots[0].view = View(Phase.SWITCHED, key=A)
    await r.record_stop(slots.values())
    stop = path.read_text()
    await asyncio.sleep(r.FLUSH_S * 4)
    assert path.read_text() == stop and json.loads(stop)["slots"]["0"]["key"] == A
    assert [p.name for p in tmp_path.iterdir()] == ["held.json"]  # no temporary left


async def test_behind_a_router_each_model_keeps_its_own_record(tmp_path):
    """Two models' Sessions in one state directory: one file each, neither overwrites the other."""
    names = {held.file_name("model-a"), held.file_name("model-b")}
    assert len(names) == 2 and "held.json" not in names and held.file_name() == "held.json"
    recorders = {}
    for model, key in (("model-a", A), ("model-b", B)):
        slots = {0: slot(0, Phase.HELD, key, f"auto-{key}.bin")}
        recorders[model] = r = held.Recorder(tmp_path / held.file_name(model), model, slots)
        r.changed(slots[0])
        await settled(r)
    for model, key in (("model-a", A), ("model-b", B)):
        assert held.Recorder(tmp_path / held.file_name(model), model, {}).keys() == {0: key}


async def test_nothing_written_after_the_stop_record_replaces_it(tmp_path):
    """Issue 38: a change after the stop's record (a slot closed down, a save landing) used to
    schedule a flush of the Recorder's own entries, which lack what the stop recorded of slots
    holding a conversation in no file: the stop's record stays as written."""
    path = tmp_path / "held.json"
    slots = {0: slot(0, Phase.HELD, A), 1: slot(1, Phase.EMPTY)}  # A in no file yet
    r = held.Recorder(path, "m", slots)
    await r.record_stop(slots.values())
    stop = path.read_text()
    assert json.loads(stop)["slots"]["0"]["key"] == A
    slots[1].view = View(Phase.HELD, key=B, n_tokens=10, file=f"auto-{B}.bin")
    r.changed(slots[1])
    await asyncio.sleep(r.FLUSH_S * 4)
    assert path.read_text() == stop


def test_a_write_a_crash_cut_short_is_removed_at_the_next_start(tmp_path):
    """Issue 38: _write's temporary (held.json.<random>.tmp), left by a crash, goes when the
    record is next opened; nothing else in the state directory is touched."""
    (tmp_path / "held.json.abc123.tmp").write_text("{")
    (tmp_path / "other.json.tmp").write_text("mine")
    held.Recorder(tmp_path / "held.json", "m", {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.json.tmp"]
