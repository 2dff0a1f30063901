"""What restores spared, priced with the engine's own prompt rate (savings.py): the fit, the
pricing of a verified reuse, the totals across runs, and the threshold "auto" chooses."""

import json

import pytest

from autosessd.sessions.report import Counters
from autosessd.sessions.savings import MIN_READ, Savings, fit2


def test_fit_recovers_a_rate_that_grows_with_the_context():
    """Reads of a model that costs 1 ms a token plus 2e-4·x at position x (ms = p + 1e-4·((c+p)² − c²))."""
    s = Savings("m")
    for c, p in ((0, 3000), (0, 700), (2000, 500), (0, 8000), (15, 683)):
        s.saw_read(c, p, p * 1.0 + 1e-4 * ((c + p) ** 2 - c * c))
    model = s.rates.prefill()
    assert model.a == pytest.approx(1.0, rel=1e-6) and model.b == pytest.approx(1e-4, rel=1e-6)
    assert s.price(15, 2719) == pytest.approx(2704 + 1e-4 * (2719 ** 2 - 15 ** 2))


def test_one_read_gives_the_plain_rate_and_small_reads_are_not_rates():
    s = Savings("m")
    s.saw_read(0, MIN_READ - 1, 500.0)  # a request's overhead, not a prompt rate
    s.saw_read(None, None, None)
    s.saw_read(0, 100, 0.0)
    assert s.rates.prefill() is None and s.price(0, 1000) is None
    s.saw_read(0, 2000, 4000.0)
    assert s.price(0, 1000) == pytest.approx(2000.0, rel=0.01)  # 2 ms a token, whichever term carries it


def test_fit_never_goes_negative():
    # Noisy reads that a free fit would explain with a negative quadratic term.
    a, b = fit2([(1000, 1000 ** 2, 2000.0), (4000, 4000 ** 2, 7000.0)])
    assert a > 0 and b >= 0


def test_spared_counts_tokens_and_prices_them_once_a_read_is_known():
    s, c = Savings("m"), Counters()
    assert s.spared(c, 15, 2015) is None  # verified before any read: counted, priced later
    assert c.prefill_tokens_avoided == 2000 and c.ms_avoided == 0 and s.unpriced_tokens() == 2000
    s.saw_read(0, 1000, 1000.0)  # 1 ms a token
    assert s.spared(c, 0, 500) == pytest.approx(500.0)
    assert c.prefill_tokens_avoided == 2500 and c.ms_avoided == pytest.approx(2500.0)
    assert s.unpriced_tokens() == 0


def test_totals_and_rates_survive_a_restart(tmp_path):
    path = tmp_path / "savings.json"
    s, c = Savings("m", path), Counters()
    s.saw_read(0, 1000, 1000.0)
    s.saw_save(1000, 8_000_000, 20.0)
    s.saw_restore(1000, 8_000_000, 4.0)
    s.spared(c, 0, 1000)
    c.restores_reused = 1
    s.flush(c)
    again, c2 = Savings("m", path), Counters()
    assert again.totals(c2)["prefill_tokens_avoided"] == 1000 and again.totals(c2)["restores_reused"] == 1
    assert again.price(0, 1000) == pytest.approx(1000.0)  # the model's rates came back too
    assert again.rates.bytes_per_token() == 8000
    other = Savings("another-model", path)
    assert other.price(0, 1000) is None  # rates are per model; totals are not
    assert other.totals(Counters())["ms_avoided"] == pytest.approx(1000.0)
    json.loads(path.read_text())  # whole JSON, written through a rename


def test_a_damaged_file_starts_again(tmp_path, caplog):
    path = tmp_path / "savings.json"
    path.write_text("{not json")
    s = Savings("m", path)
    assert s.totals(Counters())["prefill_tokens_avoided"] == 0
    assert "start again" in caplog.text


def test_auto_threshold_follows_the_measured_rates(caplog):
    caplog.set_level("INFO", "autosessd")
    s = Savings("m")
    assert s.min_tokens()[0] == 256  # nothing measured: the floor
    # A fast engine (0.05 ms a token) with a slow disk (10 ms a call, 100 MB/s, 100 kB a token).
    s.saw_read(0, 4000, 200.0)
    s.saw_save(1000, 100_000_000, 1010.0)
    s.saw_restore(1000, 100_000_000, 1010.0)
    n, why = s.min_tokens()
    # 0.05 ms a token to read against 2 ms a token to keep: re-reading is always cheaper here.
    assert n == 1 << 20 and "cheaper than saving and restoring" in why
    assert "min tokens" in caplog.text and "(auto)" in caplog.text
