"""Sessions bookkeeping that needs no engine: verifying a restore and naming the likely cause."""

from autosessd.config import parse
from autosessd.policy import Held
from autosessd.sessions import Sessions
from autosessd.store import Store
from stub_engine import StubEngine

K = "0123456789abcdef"


def sessions(tmp_path):
    cfg = parse(f'slot_save_path = "{tmp_path}"\n'.encode())
    return Sessions(cfg, StubEngine(tmp_path), Store(tmp_path), "m")


def restored(s, n):
    slot = s.slot(0)
    slot.held, slot.restored = Held(K, n, True), n


def test_reused_restore_counts_prefill_avoided(tmp_path):
    s = sessions(tmp_path)
    restored(s, 3000)
    s.finish(0, K, 3050, cache_n=2999, n_prompt=3040)
    assert (s.counters.restores_reused, s.counters.restores_not_reused) == (1, 0)
    assert s.counters.prefill_tokens_avoided == 2999 and s.slot(0).restored is None


def test_not_reused_names_swa_full_when_the_prompt_contains_the_state(tmp_path):
    s = sessions(tmp_path)
    restored(s, 3000)
    s.finish(0, K, 3050, cache_n=0, n_prompt=3040)
    assert s.counters.restores_not_reused == 1
    assert "--swa-full" in s.last_not_reused["likely_cause"]


def test_not_reused_names_a_cut_conversation_when_the_prompt_is_shorter(tmp_path):
    s = sessions(tmp_path)
    restored(s, 3000)
    s.finish(0, K, 1100, cache_n=0, n_prompt=1000)
    assert s.counters.restores_not_reused == 1
    assert "shorter than the restored conversation" in s.last_not_reused["likely_cause"]
