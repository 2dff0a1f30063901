"""What test_slots.py and test_primer.py share: Sessions of two slots on the stub engine, and a
request run the way the gate runs one."""

from autosessd.base.config import parse
from autosessd.sessions.facade import Sessions
from autosessd.store import slotfile
from autosessd.store.directory import Store
from stub_engine import StubEngine

KEYS = [f"{c}" * 16 for c in "abcdef"]
A, B, C, D, E, F = KEYS


def conv(key, n):
    base = 1000 * (KEYS.index(key) + 1) if key else 90000
    return list(range(base, base + n))


def make(tmp_path, n_slots=2, min_tokens=10, probed=False, **kw):
    """probed: the start's probe saw the engine empty idle slots (otherwise it is noticed)."""
    cfg = parse(f'slot_save_path = "{tmp_path}"\nauto_sessions_min_tokens = {min_tokens}\n'
                f'state_dir = "{tmp_path}-state"\n'.encode())
    engine = StubEngine(tmp_path, n_slots=n_slots, **kw)
    s = Sessions(cfg, engine, Store(tmp_path), "stub-model", n_slots=n_slots, empties_idle_slots=probed)
    return s


async def request(s, key, n, ticket=None):
    """What the gate does: place, turn, the request runs on the ticket's slot, ended."""
    t = ticket or await s.place(key)
    async with t:
        turn = await s.turn(t, key)
        await s.before_send(t)
        s.engine.ran(conv(key, n), slot=t.slot_id)
        await s.sent(t, bound_s=0)
        await s.ended(t, key, "ok")
    await s.drain()
    return t.slot_id, turn


def file_tokens(tmp_path, key):
    return list(slotfile.read_header(tmp_path / f"auto-{key}.bin").tokens)
