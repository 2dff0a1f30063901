"""One slot's state machine (autosessd/sessions/slot.py): every event from every phase is either a
transition the table allows or refused, and the fields that belong to one phase do not leak
into another. The table below is written out by hand: it is what DESIGN §9 and slot.py's
docstring promise, so a change to slot.TRANSITIONS that breaks it fails here."""

import pytest

from autosessd.engines.base import SlotState
from autosessd.sessions.slot import Event, InvalidTransition, Phase, Slot, View, allowed

E, S, H, R, U = Phase.EMPTY, Phase.SWITCHED, Phase.HELD, Phase.RESTORED, Phase.UNKNOWN
K = "aaaaaaaaaaaaaaaa"

# event → the phases it may start from (every other phase refuses it)
FROM = {
    Event.START: {E, S, H, R, U},
    Event.NOTE: {S},
    Event.END: {S},
    Event.RESTORED: {E, H, R, U},
    Event.RESTORE_FAILED: {E, H, R, U},
    Event.ERASED: {E, H, R, U},
    Event.SAVED: {H, R},
    Event.PREFIX_READ: {E, H, R, U},
    Event.REWOUND: {H},
    Event.LOST: {E, S, H, R, U},
}

VIEWS = {
    E: View(E),
    S: View(S, K, n_tokens=None, restored=40, prior=View(R, K, n_tokens=40, restored=40)),
    H: View(H, K, n_tokens=50),
    R: View(R, K, n_tokens=40, restored=40, file=f"auto-{K}.bin"),
    U: View(U, n_tokens=None, why="test"),
}


def slot_in(phase: Phase) -> Slot:
    s = Slot(0)
    s._view = VIEWS[phase]  # the test's setup only: the code under test goes through the events
    return s


def fire(s: Slot, event: Event) -> None:
    {
        Event.START: lambda: s.start(K),
        Event.NOTE: lambda: s.note(tokens=b"\0\0\0\1"),
        Event.END: lambda: s.settle("ok", SlotState(0, False, 60, None, 7), None, None, True),
        Event.RESTORED: lambda: s.restored(K, 40, f"auto-{K}.bin"),
        Event.RESTORE_FAILED: s.restore_failed,
        Event.ERASED: s.erased,
        Event.SAVED: lambda: s.saved(n_tokens=60, file=f"auto-{K}.bin"),
        Event.PREFIX_READ: lambda: s.prefix_read(K, 20, b"\0" * 80),
        Event.REWOUND: lambda: s.rewound(49, b"\0" * 196),
        Event.LOST: lambda: s.lost("test"),
    }[event]()


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.value)
@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.value)
def test_every_event_from_every_phase_is_allowed_or_refused(event, phase):
    s = slot_in(phase)
    before = s.view
    if phase in FROM[event]:
        fire(s, event)
        assert allowed(event, phase, s.view.phase)
    else:
        with pytest.raises(InvalidTransition):
            fire(s, event)
        assert s.view is before  # a refused event changes nothing


@pytest.mark.parametrize("event, to", [
    (Event.START, S), (Event.NOTE, S), (Event.END, H), (Event.RESTORED, R), (Event.RESTORE_FAILED, E),
    (Event.ERASED, E), (Event.PREFIX_READ, H), (Event.REWOUND, H), (Event.LOST, U)])
def test_each_event_leads_where_the_table_says(event, to):
    s = slot_in(next(iter(FROM[event] - {E})))
    fire(s, event)
    assert s.view.phase is to


@pytest.mark.parametrize("phase", [H, R])
def test_a_save_keeps_the_phase_it_finds(phase):
    s = slot_in(phase)
    s.saved(n_tokens=60, tokens=b"\1\0\0\0", file="auto-bbbbbbbbbbbbbbbb.bin")
    assert s.view.phase is phase and s.view.n_tokens == 60 and s.view.file == "auto-bbbbbbbbbbbbbbbb.bin"


def test_prior_lives_only_in_switched_and_restored_only_in_switched_and_restored():
    s = slot_in(R)
    s.start(K)
    assert s.view.prior is VIEWS[R] and s.view.restored == 40  # the request starts from the restore
    verify = s.settle("ok", SlotState(0, False, 60, None, 7), None, None, True)
    assert s.view.phase is H and s.view.prior is None and s.view.restored is None
    assert verify is not None and (verify.key, verify.restored) == (K, 40)
    s.start("bbbbbbbbbbbbbbbb")  # another conversation: nothing of A's restore to verify
    assert s.view.restored is None


def test_a_request_that_never_ran_leaves_what_the_slot_held():
    s = slot_in(H)
    s.start("bbbbbbbbbbbbbbbb")
    s.settle("not_run", None, None, None, True)
    assert s.view == VIEWS[H]


def test_lost_names_the_conversation_it_dropped():
    for phase, named in ((H, K), (R, K), (S, K), (E, None), (U, None)):
        assert slot_in(phase).lost("test") == named
