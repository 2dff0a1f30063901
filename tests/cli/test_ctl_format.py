"""autosessctl's output for people (ctl_text.py), from the daemon's own answers: the status headline
(what autosessd did for the user) and `events` one line per event, aligned, with units."""

from autosessd import ctl_text as ctl
from autosessd.base.config import parse
from autosessd.sessions.report import Counters
from autosessd.sessions.facade import Sessions
from autosessd.store.directory import Store
from stub_engine import StubEngine


def status_of(tmp_path, **counters):
    cfg = parse(f'slot_save_path = "{tmp_path}"\nstate_dir = "{tmp_path / "state"}"\n'.encode())
    s = Sessions(cfg, StubEngine(tmp_path), Store(tmp_path), "m")
    for k, v in counters.items():
        setattr(s.counters, k, v)
    s.ctx.savings.saw_read(0, 2696, 4940.0)
    return s.status()


def test_status_opens_with_what_was_spared(tmp_path):
    st = status_of(tmp_path, prefill_tokens_avoided=2704, ms_avoided=4950.0, restores_reused=1,
                   restores_not_reused=1)
    text = ctl.show_status(st).splitlines()
    assert text[1].startswith("since start: 2,704 prompt tokens not read again, ~5.0 s of prefill spared; "
                              "1 restore reused, 1 NOT reused (autosessctl doctor says why)")
    assert text[2].startswith("in total:    2,704 prompt tokens")  # no earlier run: the same
    assert "timings.cache_n" in text[3] and "546 tokens/s reading 1k tokens" in text[3]
    assert any(ln.startswith("on disk:     0 files, 0.00 GB of the 100.00 GB budget (0%), newest 12 kept")
               for ln in text)
    assert any(ln.startswith("saves from:  256 tokens (auto: the floor, until the engine has shown a save")
               for ln in text)
    # The same figures in the JSON (GET /autosessd/status, status --json).
    assert st["spared"]["since_start"]["prompt_tokens"] == 2704 and st["spared"]["since_start"]["seconds"] == 4.95
    assert st["store"]["min_tokens"] == 256 and st["store"]["min_tokens_auto"] is True


def test_events_for_people_one_aligned_line_each_with_units():
    evs = [{"seq": 1, "ts": 1764460000.0, "type": "saved", "slot": 0, "key": "k", "file": "auto-k.bin",
            "n_tokens": 2719, "bytes": 16_300_000, "engine_ms": 6.5, "ms": 7.2, "named": "key"},
           {"seq": 2, "ts": 1764460001.0, "type": "restore_reused", "slot": 0, "key": "k", "file": "auto-k.bin",
            "cache_n": 2719, "n_restored": 2755, "spared_tokens": 2704, "spared_ms": 4930.0},
           {"seq": 3, "ts": 1764460002.0, "type": "turn", "key": "k", "slot": 0, "saved": None,
            "restored": {"n_tokens": 2755, "file": "auto-k.bin"}, "prefix": None, "skipped": [], "errors": [],
            "ms": 12.0},
           {"seq": 4, "ts": 1764460003.0, "type": "something_new", "x": 1}]
    lines = [ctl.show_event(e) for e in evs]
    assert "2,719 tokens  16.3 MB  auto-k.bin  in 7 ms (engine 6 ms)" in lines[0]
    assert "reused 2,719 of 2,755 tokens, spared 2,704 tokens ~4.9 s" in lines[1]
    assert "k: restored 2,755 tokens from auto-k.bin, 12 ms" in lines[2]
    assert lines[3].endswith("x=1")
    # Aligned: the type and slot columns start at the same place on every line.
    starts = {ln.index(e["type"]) for ln, e in zip(lines, evs)}
    assert len(starts) == 1
    assert len({ln.index(e["type"]) + 20 for ln, e in zip(lines, evs)}) == 1
    assert Counters  # the counters status shows are report.Counters' fields


def test_a_slot_line_says_partial_only_of_a_cancelled_requests_state_and_never_durable():
    """"durable" read as "on disk" (a new user, issue 41's walk-through): a whole turn's state is
    said with nothing after its tokens; a cancelled request's part says so."""
    whole = ctl.slot_line({"state": "held", "held": "1c42", "n_tokens": 596, "durable": True})
    part = ctl.slot_line({"state": "held", "held": "1c42", "n_tokens": 596, "durable": False, "busy": True})
    assert whole == "holds 1c42  596 tokens"
    assert part == "holds 1c42  596 tokens  partial (its request was cancelled)  (a request runs)"


def test_status_says_how_a_hybrid_or_window_model_is_saved(tmp_path):
    cfg = parse(f'slot_save_path = "{tmp_path}"\nstate_dir = "{tmp_path / "state"}"\n'.encode())
    s = Sessions(cfg, StubEngine(tmp_path), Store(tmp_path), "m")
    assert not [ln for ln in ctl.show_status(s.status()).splitlines() if ln.startswith("model ")]
    s.ctx.recurrent = True
    [line] = [ln for ln in ctl.show_status(s.status()).splitlines() if ln.startswith("model ")]
    assert "recurrent layers: each save holds one token before the prompt's end" in line
