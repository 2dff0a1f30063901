"""What the tests of Sessions knowing files by their tokens share: Sessions on the stub engine,
chat bodies of the toy template, a chat run the way the gate runs one, and looks at the files."""

from autosessd.base.config import parse
from autosessd.base.keys import conversation_key
from autosessd.sessions.facade import Sessions
from autosessd.store import slotfile
from autosessd.store.directory import Store
from stub_engine import StubEngine, template, tokenize


MIN = 60
LONG_1 = "Arr, the sea is wide and the ships are many. " * 6
LONG_2 = "Objection sustained; the contract is void for vagueness. " * 6


async def make(tmp_path, min_tokens=MIN, swa=0, engine=None):
    d = tmp_path / "sessions"
    d.mkdir(parents=True, exist_ok=True)
    cfg = parse(f'slot_save_path = "{d}"\nauto_sessions_min_tokens = {min_tokens}\nstate_dir = "{tmp_path / "state"}"\n'
                f'[engine]\nswa_window = {swa}\n'.encode())
    engine = engine or StubEngine(d)
    s = Sessions(cfg, engine, Store(d), "stub-model", n_slots=len(engine.held), empties_idle_slots=engine.clears_idle)
    await s.prepare()
    return s


def body(*messages, tools=None):
    b = {"messages": [{"role": r, "content": c} for r, c in messages], "temperature": 0}
    if tools:
        b["tools"] = tools
    return b


async def chat(s, b, reply="Aye.", drain=True):
    """What the gate does with a chat body: FIFO, turn with the body, the request, ended (then,
    unless drain=False, every finalize and prune in the background)."""
    key = conversation_key(b)
    async with await s.admit() as t:
        turn = await s.turn(t, key, body=b)
        cache_n, n_prompt = s.engine.chat(b, reply)
        await s.ended(t, key, "ok", cache_n=cache_n, n_prompt=n_prompt)
    if drain:
        await s.drain()
    return turn, cache_n, n_prompt


def header(s, name):
    return list(slotfile.read_header(s.store.path / name).tokens)


def prompt(b):
    return tokenize(template(b))


def conversation_files(s):
    return sorted(r["name"] for r in s.ls() if r["kind"] == "auto")


X = body(("system", "You are a pirate."), ("user", "Hello"), ("assistant", LONG_1), ("user", "And the ships?"))
Y = body(("system", "You are a lawyer."), ("user", "Hello"), ("assistant", LONG_2), ("user", "And the contract?"))
K = conversation_key(X)
