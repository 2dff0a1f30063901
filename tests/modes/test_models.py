"""A router's model switches (autosessd/modes/models.py) on a stub router: the switch is taken in
hand (saves first, then an explicit unload), a model's files are its own, and every way the
router can fail leaves the request to go on as it would without autosessd.

The stub stands for llama-server --models-dir --models-max N: each loaded model is a child
StubEngine (tests/stub_engine.py) that starts empty, as a freshly loaded model does; loading a
model over the limit evicts the least recently loaded one, as the router does, with nothing
saved. Unlike the router it answers at once (no child process, no 10 s stop-timeout), and
GET /models, a load and an unload can be told to fail or hang. tests/modes/test_models_real.py runs
the same switches on the real router.
"""

import asyncio
import json

import pytest

from autosessd.store import slotfile
from autosessd.base.config import parse
from autosessd.engines.base import EngineBadAnswer, EngineRefused
from autosessd.base.keys import conversation_key
from autosessd.modes.models import Router, model_key
from autosessd.sessions.observe import SLEPT
from autosessd.sessions.facade import Sessions
from autosessd.modes.sleep import SleepWatch, sleep_seconds
from autosessd.store.directory import Store
from stub_engine import StubEngine, template, tokenize


class StubRouter:
    kind = "llama-server"
    magic = b"qsgg"
    address = "http://stub-router"

    def __init__(self, directory, models=("ga", "gb"), max_loaded=1, save_path=None):
        self.dir = directory
        self.max_loaded = max_loaded
        self.status = {m: "unloaded" for m in models}
        self.children: dict[str, StubEngine] = {}
        self.order: list[str] = []  # loaded models, least recently loaded first
        self.save_path = str(save_path or directory)
        self.models_fail = False
        self.load_fails: set[str] = set()
        self.unload_hangs = False
        self.calls: list[tuple[str, str]] = []

    async def router_models(self):
        if self.models_fail:
            raise EngineBadAnswer("GET /models answered 500: stub told to fail")
        return [{"id": m, "status": st, "args": ["--slot-save-path", self.save_path]} for m, st in self.status.items()]

    async def load_model(self, m):
        self.calls.append(("load", m))
        if m in self.load_fails:
            self.status[m] = "unloaded"
            raise EngineRefused(f"POST /models/load answered 500: failed to load model {m}")
        while len(self.order) >= self.max_loaded:  # the router's own eviction: nothing saved
            self._drop(self.order[0])
        self.children[m] = StubEngine(self.dir, model=f"fp-{m}")
        self.status[m] = "loaded"
        self.order.append(m)

    async def unload_model(self, m):
        self.calls.append(("unload", m))
        if not self.unload_hangs:
            self._drop(m)

    def _drop(self, m):
        self.status[m] = "unloaded"
        self.children.pop(m, None)
        self.order.remove(m)

    def for_model(self, m):
        return ModelAdapter(self, m)

    async def health(self):
        return True

    async def close(self):
        pass


class ModelAdapter:
    """One model's calls, to whichever child runs it now (a reload is a fresh child)."""

    kind, magic = "llama-server", b"qsgg"

    def __init__(self, router, m):
        self.router, self.model_id, self.address = router, m, f"http://stub-router (model {m})"

    def __getattr__(self, name):
        child = self.router.children.get(self.model_id)
        if child is None:
            async def refused(*a, **k):
                raise EngineRefused("answered 400: model is not loaded")
            return refused
        return getattr(child, name)


async def make(tmp_path, **kw):
    d = tmp_path / "sessions"
    d.mkdir(parents=True, exist_ok=True)
    cfg = parse(f'slot_save_path = "{d}"\nauto_sessions_min_tokens = 20\nstate_dir = "{tmp_path / "state"}"\n'
                f'[engine]\nswa_window = 0\ntimeout_s = 1\n'.encode())
    stub = StubRouter(d, **kw)
    router: Router | None = None

    async def make_sessions(adapter, model):
        info = await adapter.info()
        return Sessions(cfg, adapter, store, info.model, info.model_name, n_slots=1,
                        house=router.house, upkeep=router.upkeep)

    store = Store(d)
    router = Router(cfg, stub, store, await stub.router_models(), stub.max_loaded, make_sessions)
    await router.upkeep.prepare(swa=False)
    return stub, router


def body(model, text):
    return {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0}


async def request(router, stub, b, reply="ok"):
    """What the gate does with a router's chat request: the model's Sessions (loaded), the
    turn under the model's key, the request on the model's child, its end."""
    s = await router.acquire(b["model"])
    assert s is not None
    key = router.key(b["model"], conversation_key(b))
    try:
        async with await s.place(key) as t:
            turn = await s.turn(t, key, body=b)
            cache_n, n_prompt = stub.children[b["model"]].chat(b, reply)
            await s.ended(t, key, "ok", cache_n=cache_n, n_prompt=n_prompt)
    finally:
        router.release(b["model"])
    await s.drain()
    return turn, cache_n, n_prompt


A1 = body("ga", "A story of the sea, told by a pirate who has seen many ships. " * 2)
A2 = body("ga", "A lawyer explains the contract, clause by clause, to the court. " * 2)
B1 = body("gb", "The gardener plants tulips and roses along the northern wall. " * 2)


async def test_switch_saves_before_its_own_unload_and_the_return_restores(tmp_path):
    stub, router = await make(tmp_path)
    _, cache_n, _ = await request(router, stub, A1)
    assert cache_n == 0
    await request(router, stub, B1)
    # autosessd unloaded ga itself, after saving: the router did not choose (nor save).
    assert stub.calls[:3] == [("load", "ga"), ("unload", "ga"), ("load", "gb")]
    turn, cache_n, n_prompt = await request(router, stub, A1)
    assert turn.restored is not None and cache_n >= 0.9 * n_prompt
    c = router.counters
    assert c.model_unloads == 2 and c.saves_at_model_switch >= 1 and c.restores_after_model_switch == 1
    st = router.status()  # what autosessctl status and /autosessd/status show behind a router
    assert [sl["model"] for sl in st["slots"]] == ["ga"] and st["idle_save"]["after_s"] == 3.0
    assert json.dumps(st)


async def test_each_file_holds_its_own_models_conversation(tmp_path):
    stub, router = await make(tmp_path)
    for b in (A1, A2, B1, A1, B1, A2):
        await request(router, stub, b)
    for b in (A1, A2, B1):
        name = f"auto-{model_key(b['model'], conversation_key(b))}.bin"
        held = list(slotfile.read_header(stub.dir / name).tokens)
        prompt = tokenize(template(b))
        assert held[:len(prompt)] == prompt, name  # the file starts with this conversation's prompt
        meta = json.loads((stub.dir / name.replace(".bin", ".json")).read_text())
        assert meta["model"] == f"fp-{b['model']}"
    # The same words sent to the other model are another conversation, with no file yet.
    same_words_b = {**A1, "model": "gb"}
    turn, cache_n, _ = await request(router, stub, same_words_b)
    assert turn.restored is None and cache_n == 0


async def test_a_model_that_does_not_load_is_left_to_the_router(tmp_path, caplog):
    stub, router = await make(tmp_path)
    stub.load_fails.add("gb")
    assert await router.acquire("gb") is None  # the gate forwards the request untouched
    assert "router: loading gb" in caplog.text and "failed to load model gb" in caplog.text
    assert router.models["gb"].in_flight == 0
    await request(router, stub, A1)  # the other model is unharmed


async def test_get_models_failing_leaves_unknown_models_to_the_router(tmp_path, caplog):
    stub, router = await make(tmp_path)
    stub.models_fail = True
    assert await router.acquire("gc") is None
    assert "router: GET /models" in caplog.text and "stub told to fail" in caplog.text
    assert await router.acquire(None) is None and await router.acquire(3) is None  # no model, or not a name


async def test_an_unload_that_never_happens_is_said_and_the_request_goes_on(tmp_path, caplog):
    stub, router = await make(tmp_path)
    await request(router, stub, A1)
    stub.unload_hangs = True
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    s = await router.acquire("gb")  # the wait for ga to go is bounded by engine.timeout_s (1 s)
    assert loop.time() - t0 < 5
    router.release("gb")
    assert s is not None  # the stub router then loads gb over the limit (its own eviction)
    assert "router: ga is still loaded 1 s (engine.timeout_s) after autosessd asked to unload it" in caplog.text


async def test_requests_for_a_model_being_put_away_wait_and_load_it_again(tmp_path):
    stub, router = await make(tmp_path)
    await request(router, stub, A1)
    gb, ga = asyncio.ensure_future(request(router, stub, B1)), None
    await asyncio.sleep(0)
    ga = asyncio.ensure_future(request(router, stub, A1))
    await asyncio.gather(gb, ga)
    assert ga.result()[1] >= 0.9 * ga.result()[2]  # ga came back, restored
    assert [c for c in stub.calls if c[0] == "load"] == [("load", "ga"), ("load", "gb"), ("load", "ga")]
    assert all(m.in_flight == 0 for m in router.models.values())


async def test_router_forget_removes_a_conversation_under_every_model(tmp_path):
    stub, router = await make(tmp_path, models=("ga", "gb", "gc"))  # gc never loaded
    await request(router, stub, A1)
    await request(router, stub, {**A1, "model": "gb"})
    key = conversation_key(A1)
    # A model not loaded now kept a branch of the line, and its held record names it (issue 38).
    from autosessd.sessions.held import _write
    from autosessd.modes.models import model_key

    line = model_key("gc", key)
    branch = "0123456789abcdef"
    (stub.dir / f"auto-{branch}.bin").write_bytes(b"qsgg")
    router.store.write_meta(__import__("autosessd.store.names", fromlist=["Meta"]).Meta(
        key=branch, n_tokens=1, bytes=4, saved_at=1.0, model="gc", save_ms=1.0, line=line))
    state = router.cfg.effective_state_dir()
    _write(state / "held-ffffffffffffffff.json", {"model": "gc", "slots": {"0": {"key": line, "file": f"auto-{branch}.bin",
                                                                                "at": 1.0}}})
    assert (await router.forget(key))["freed"] > 0
    assert not list(stub.dir.glob("auto-*.bin"))
    assert __import__("json").loads((state / "held-ffffffffffffffff.json").read_text())["slots"] == {}


def test_sleep_seconds_from_an_engine_command_line():
    assert sleep_seconds(["llama-server", "-m", "x", "--sleep-idle-seconds", "5"]) == 5
    assert sleep_seconds(["--sleep-idle-seconds=30"]) == 30
    assert sleep_seconds(["--sleep-idle-seconds", "-1"]) is None  # llama-server's "off"
    assert sleep_seconds(["--sleep-idle-seconds", "soon"]) is None
    assert sleep_seconds(["-m", "x"]) is None


class SleepyStub(StubEngine):
    """A StubEngine that goes to sleep on cue: its slots empty, /props says is_sleeping."""

    asleep = False

    async def is_sleeping(self):
        return self.asleep

    def sleep(self):
        self.asleep = True
        for i in self.held:
            self.held[i] = []
            self.task_ids[i] = None


async def test_sleep_saves_first_and_marks_the_slots_empty_once_asleep(tmp_path):
    d = tmp_path / "sessions"
    d.mkdir()
    cfg = parse(f'slot_save_path = "{d}"\nauto_sessions_min_tokens = 20\nstate_dir = "{tmp_path}/state"\n'
                '[engine]\nswa_window = 0\n'.encode())
    eng = SleepyStub(d)
    s = Sessions(cfg, eng, Store(d), "stub-model")
    await s.prepare()
    watch = s.sleep = SleepWatch(s, 2.0)
    b = body("x", "A story of the sea, told by a pirate who has seen many ships. " * 2)
    key = conversation_key(b)
    async with await s.admit() as t:
        await s.turn(t, key, body=b)
        eng.chat(b, "ok")
        await s.ended(t, key, "ok")
    assert not list(d.glob("auto-*.bin"))  # one slot, no switch: nothing saved yet
    watch._last -= watch.save_after  # the idle stretch has lasted long enough
    await watch.step()
    assert [p.name for p in d.glob("auto-*.bin")] == [f"auto-{key}.bin"]
    assert s.counters.saves_before_sleep == 1
    await watch.step()
    assert s.view().key == key  # awake still: the slot keeps it
    eng.sleep()
    await watch.step()
    assert s.view().key is None and s.view().why == SLEPT
    async with await s.admit() as t:
        turn = await s.turn(t, key, body=b)
        cache_n, n_prompt = eng.chat(b, "ok")
        await s.ended(t, key, "ok", cache_n=cache_n, n_prompt=n_prompt)
    assert turn.restored is not None and cache_n >= 0.9 * n_prompt
    assert s.counters.restores_after_sleep == 1 and s.counters.engine_sleeps == 1


@pytest.mark.parametrize("labels", [{"model": 'a"b\\c\nd'}])
def test_metrics_label_values_are_escaped(labels):
    from autosessd.sessions.views import _escape
    assert _escape(labels["model"]) == 'a\\"b\\\\c\\nd'
