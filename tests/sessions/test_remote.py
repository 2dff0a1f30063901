"""What a turn asks of the shared bucket's catalog (autosessd/sessions/remote.py), without the bucket:
the catalog is one reading of it, built here by hand."""

import pytest

from autosessd.base.config import parse
from autosessd.store.runs import TokenRun
from autosessd.store.slotfile import encode
from autosessd.sessions.remote import PREFILL_MIN, Catalog, Remote
from autosessd.shared import RemoteSession

CFG = parse(b'slot_save_path = "/x"\n[shared]\nendpoint_url = "http://s3"\nbucket = "b01"\n', "t.toml").shared
BASE = list(range(1000, 1100))


def save(name, tokens, saved_at=1.0, host="h1"):
    return RemoteSession(key=f"p/sessions/m/{name}/{round(saved_at * 1e6):020d}-{len(tokens):010d}-{host}.bin",
                         model="m", name=name + ".bin", saved_at=saved_at, n_tokens=len(tokens), host=host,
                         bytes=100 * len(tokens), modified=saved_at), encode(tokens)


@pytest.fixture
def remote():
    r = Remote(shared=None, cfg=CFG, model="m")
    yield r
    r.pool.shutdown()
    r.downloads.shutdown()


def with_saves(r: Remote, *saves) -> None:
    r.catalog = Catalog({s.name: s for s, _ in saves}, {s.key: t for s, t in saves},
                        TokenRun([(t, s.name) for s, t in saves]), 1.0)


def test_the_save_sharing_the_longest_prefix_wins(remote):
    a, b = save("auto-a", BASE + [1] * 50), save("auto-b", BASE[:60] + [2] * 100)
    with_saves(remote, a, b)
    q = encode(BASE + [1] * 50 + [9] * 10)
    assert remote.best(q, 1) == (a[0], 150)
    assert remote.best(encode(BASE[:70] + [5]), 1) == (a[0], 70)  # a shares 70, b only 60
    assert remote.best(q, 151) is None  # none shares that much
    assert remote.best(encode([7] * 20), 1) is None


def test_skipped_saves_and_the_sliding_window_are_passed_over(remote):
    a, b = save("auto-a", BASE + [1] * 50), save("auto-b", BASE[:60] + [2] * 20)
    with_saves(remote, a, b)
    q = encode(BASE + [1] * 50)
    assert remote.best(q, 1) == (a[0], 150)
    # A local copy as new as `a`: the next best is offered.
    assert remote.best(q, 1, skip=lambda s: s.name == "auto-a.bin") == (b[0], 60)
    # Both share 60 with this one and go on past it (a 90 tokens, b 20). With a sliding window
    # of 50 neither may be restored for it (runs.swa_usable); with one of 100, b (80 tokens)
    # lies inside it. A request that goes on from b's end may restore b.
    assert remote.best(encode(BASE[:60]), 1, skip=lambda s: s.name == "auto-b.bin") == (a[0], 60)
    assert remote.best(encode(BASE[:60]), 1, window=50) is None
    assert remote.best(encode(BASE[:60]), 1, window=100) == (b[0], 60)
    assert remote.best(encode(BASE[:60] + [2] * 20 + [5]), 1, window=50) == (b[0], 80)


def test_among_equals_the_request_s_own_name_then_the_smaller_save(remote):
    short, long_, other = (save("auto-short", BASE + [1]), save("auto-long", BASE + [2] * 40),
                           save("auto-own", BASE + [3] * 90))
    with_saves(remote, short, long_, other)
    q = encode(BASE + [4])
    assert remote.best(q, 1) == (short[0], 100)
    assert remote.best(q, 1, prefer="auto-own.bin") == (other[0], 100)


def test_the_key_rule_reads_the_catalog_by_name(remote):
    a = save("auto-a", BASE)
    with_saves(remote, a)
    assert remote.newest("auto-a.bin") == a[0] and remote.newest("auto-b.bin") is None


def test_the_prompt_rate_is_a_moving_average_of_real_readings(remote):
    assert remote.prefill_tokens_s is None
    remote.saw_prefill(PREFILL_MIN - 1, 10.0)  # too few tokens to say anything about prefill
    remote.saw_prefill(2000, 0)
    remote.saw_prefill(None, None)
    assert remote.prefill_tokens_s is None
    remote.saw_prefill(4000, 10_000.0)  # 400 tokens/s
    assert remote.prefill_tokens_s == pytest.approx(400)
    remote.saw_prefill(1000, 1_000.0)  # one fast reading moves it, does not replace it
    assert 400 < remote.prefill_tokens_s < 1000


class _Bucket:
    """What Remote.refresh asks of SharedStore (a LIST, the header's tokens), from a list: the
    real calls are tested against a real S3 server in test_shared_s3.py."""

    def __init__(self, *saves):
        self.saves = saves

    def find(self, model):
        return [s for s, _ in self.saves]

    def tokens(self, s, max_tokens=None):
        return next(tuple(range(len(t) // 4)) for r, t in self.saves if r is s)


def test_the_catalog_offers_only_auto_files_never_a_parked_name():
    a = save("auto-00000000000000a1", BASE)
    parked = save("keepme", BASE + [1] * 50)  # someone else's parked file under the prefix
    r = Remote(shared=_Bucket(a, parked), cfg=CFG, model="m")
    try:
        cat = r.refresh()
        assert list(cat.saves) == ["auto-00000000000000a1.bin"] and r.newest("keepme.bin") is None
    finally:
        r.pool.shutdown()
        r.downloads.shutdown()


def test_a_stop_does_not_wait_for_header_reads_of_a_slow_bucket():
    """The catalog's header GETs run on threads the interpreter joins at exit: at a stop
    (closing) a reading stops waiting for them. The stub's GET blocks until released, as a
    read of a stalled bucket does up to read_timeout_s."""
    import threading

    gate = threading.Event()

    class Slow(_Bucket):
        def tokens(self, s, max_tokens=None):
            gate.wait()
            return super().tokens(s)

    r = Remote(shared=Slow(save("auto-00000000000000a1", BASE)), cfg=CFG, model="m")
    t = threading.Thread(target=r.refresh)
    try:
        t.start()
        r.closing.set()
        t.join(30)
        assert not t.is_alive(), "the reading waited for a header GET after the stop"
        assert r.catalog.saves == {}  # a reading cut short is not swapped in
    finally:
        gate.set()
        t.join(30)
        r.pool.shutdown()
        r.downloads.shutdown()


async def test_after_a_restart_with_another_model_none_of_the_old_models_saves_is_offered():
    """facts.py: the engine came back with another -m. The catalog listed the old model's saves;
    none is offered from then on, not even before the bucket is read again."""
    import asyncio

    a = save("auto-00000000000000a1", BASE)

    class ByModel(_Bucket):
        def find(self, model):
            return [s for s, _ in self.saves] if model == "m" else []

    r = Remote(shared=ByModel(a), cfg=CFG, model="m")
    q = encode(list(range(len(BASE))))  # what _Bucket's header reads give
    try:
        r.refresh()
        assert r.best(q, 1) == (a[0], len(BASE))
        r.engine_changed("m2", 8192)
        assert r.best(q, 1) is None and (r.model, r.max_tokens) == ("m2", 8192)
        for _ in range(100):
            if r.catalog.listed_at:
                break
            await asyncio.sleep(0.01)
        assert r.catalog.listed_at and r.best(q, 1) is None  # read again for m2
    finally:
        r.pool.shutdown()
        r.downloads.shutdown()


def test_a_reading_of_the_old_models_saves_is_not_swapped_in_after_a_model_change():
    """A LIST for the old model was under way when the engine came back with another."""
    import threading

    a = save("auto-00000000000000a1", BASE)
    listed, go = threading.Event(), threading.Event()

    class Slow(_Bucket):
        def find(self, model):
            listed.set()
            go.wait(10)
            return [s for s, _ in self.saves] if model == "m" else []

    r = Remote(shared=Slow(a), cfg=CFG, model="m")
    t = threading.Thread(target=r.refresh)
    try:
        t.start()
        assert listed.wait(10)
        r.model, r.catalog = "m2", Catalog()  # what engine_changed does, without its own reading
        go.set()
        t.join(10)
        assert r.catalog.saves == {}
    finally:
        go.set()
        r.pool.shutdown()
        r.downloads.shutdown()
