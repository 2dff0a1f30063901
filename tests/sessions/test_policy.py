"""The turn of DESIGN §1 as a table: every branch, no I/O."""

import pytest

from autosessd.sessions.policy import (BELOW_MIN, LAYOUT_MISMATCH, MODEL_MISMATCH, NO_FILE, NO_MATCH, PROVISIONAL,
                              SAVE_FAILED_DURABLE, UP_TO_DATE, FileInfo, Held, Occasion, Restore, RestoreFile, Save,
                              SaveOutcome, Skip, plan_restore, plan_restore_by_tokens, plan_save, restore_reused,
                              Fetch, plan_fetch_by_key, plan_fetch_by_tokens)
from autosessd.store.slotfile import KVLayout

MIN = 1000
M = "model-a"
A, B = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"


SW, KL, ST, BH, BR = Occasion.SWITCH, Occasion.KEYLESS, Occasion.STOP, Occasion.BEHIND, Occasion.BRANCH


@pytest.mark.parametrize(
    "name, held, occasion, key, saved, expect",
    [
        ("nothing held: nothing to save", None, SW, B, None, None),
        ("same key: nothing", Held(A, 5000, True), SW, A, None, None),
        ("same key, tokens depart (a branch): save", Held(A, 5000, True), BR, A, None, Save(A, 5000)),
        ("same key, tokens depart, up to date", Held(A, 5000, True), BR, A, FileInfo(5000, M),
         Skip("save", A, UP_TO_DATE)),
        ("same key, tokens depart, below min", Held(A, 10, True), BR, A, None, Skip("save", A, BELOW_MIN)),
        ("held reached min: save", Held(A, 5000, True), SW, B, None, Save(A, 5000)),
        ("held exactly at min: save", Held(A, MIN, True), SW, B, None, Save(A, MIN)),
        ("held below min: no save", Held(A, 999, True), SW, B, None, Skip("save", A, BELOW_MIN)),
        ("provisional held is saved at a switch", Held(A, 5000, False), SW, B, None, Save(A, 5000)),
        ("file already has these tokens: not written again", Held(A, 5000, True), SW, B, FileInfo(5000, M),
         Skip("save", A, UP_TO_DATE)),
        ("file older than the held state: save", Held(A, 5100, True), SW, B, FileInfo(5000, M), Save(A, 5100)),
        ("file from another model: save", Held(A, 5000, True), SW, B, FileInfo(5000, "other"), Save(A, 5000)),
        ("count unknown (no GET /slots): save, checked after", Held(A, None, True), SW, B, FileInfo(5000, M),
         Save(A, None)),
        ("keyless request next: it replaces the slot, save", Held(A, 5000, True), KL, None, None, Save(A, 5000)),
        ("keyless request next, file up to date", Held(A, 5000, True), KL, None, FileInfo(5000, M),
         Skip("save", A, UP_TO_DATE)),
        ("keyless request next, below min", Held(A, 10, True), KL, None, None, Skip("save", A, BELOW_MIN)),
        ("stop: save", Held(A, 5000, True), ST, None, None, Save(A, 5000)),
        ("stop: provisional is all there is, save", Held(A, 5000, False), ST, None, None, Save(A, 5000)),
        ("stop: up to date", Held(A, 5000, True), ST, None, FileInfo(5000, M), Skip("save", A, UP_TO_DATE)),
        ("stop: below min", Held(A, 10, True), ST, None, None, Skip("save", A, BELOW_MIN)),
        ("behind: stale file, save", Held(A, 5100, True), BH, None, FileInfo(5000, M), Save(A, 5100)),
        ("behind: up to date", Held(A, 5000, True), BH, None, FileInfo(5000, M), Skip("save", A, UP_TO_DATE)),
        ("behind: a cancelled request's partial state waits", Held(A, 5000, False), BH, None, None,
         Skip("save", A, PROVISIONAL)),
    ],
)
def test_plan_save(name, held, occasion, key, saved, expect):
    assert plan_save(held, occasion, MIN, saved, M, key) == expect, name


@pytest.mark.parametrize(
    "name, held, key, outcome, file, expect",
    [
        ("no user text: nothing", Held(A, 5000, True), None, SaveOutcome.NOT_TRIED, FileInfo(5000, M), None),
        ("same key: nothing", Held(A, 5000, True), A, SaveOutcome.NOT_TRIED, FileInfo(5000, M), None),
        ("saved, file fits: restore", Held(A, 5000, True), B, SaveOutcome.SAVED, FileInfo(3000, M),
         Restore(B, 3000)),
        ("nothing held, file fits: restore", None, B, SaveOutcome.NOT_TRIED, FileInfo(3000, M), Restore(B, 3000)),
        ("held below min (not saved), file fits: restore", Held(A, 10, True), B, SaveOutcome.NOT_TRIED,
         FileInfo(3000, M), Restore(B, 3000)),
        ("save failed, durable held: no restore", Held(A, 5000, True), B, SaveOutcome.FAILED, FileInfo(3000, M),
         Skip("restore", B, SAVE_FAILED_DURABLE)),
        ("save failed, provisional held: restore goes on", Held(A, 5000, False), B, SaveOutcome.FAILED,
         FileInfo(3000, M), Restore(B, 3000)),
        ("no file", Held(A, 5000, True), B, SaveOutcome.SAVED, None, Skip("restore", B, NO_FILE)),
        ("file below min: skipped", Held(A, 5000, True), B, SaveOutcome.SAVED, FileInfo(999, M),
         Skip("restore", B, BELOW_MIN)),
        ("file from another model: skipped", Held(A, 5000, True), B, SaveOutcome.SAVED, FileInfo(3000, "other"),
         Skip("restore", B, MODEL_MISMATCH)),
    ],
)
def test_plan_restore(name, held, key, outcome, file, expect):
    assert plan_restore(held, key, outcome, file, M, MIN) == expect, name


S1, S4 = KVLayout(1, 0, 3, 1), KVLayout(4, 0, 3, 1)


@pytest.mark.parametrize("name, file_layout, engine_layout, expect", [
    ("same layout: restore", S1, S1, Restore(B, 3000)),
    ("one-stream file, engine without a unified cache (-np 4): skipped", S1, S4,
     Skip("restore", B, LAYOUT_MISMATCH)),
    ("another K cache type: skipped", KVLayout(1, 0, 3, 8), S1, Skip("restore", B, LAYOUT_MISMATCH)),
    ("engine layout known only by its streams (empty probe): restore", S1, KVLayout(1), Restore(B, 3000)),
    ("file without a recorded layout (older metadata): restore", None, S4, Restore(B, 3000)),
    ("engine layout unknown: restore", S4, None, Restore(B, 3000)),
])
def test_plan_restore_never_restores_a_file_the_engine_cannot_load(name, file_layout, engine_layout, expect):
    file = FileInfo(3000, M, file_layout)
    assert plan_restore(None, B, SaveOutcome.NOT_TRIED, file, M, MIN, engine_layout) == expect, name


def test_empty_file_is_never_restored_even_with_min_zero():
    assert plan_restore(None, B, SaveOutcome.NOT_TRIED, FileInfo(0, M), M, 0) == Skip("restore", B, BELOW_MIN)


def test_empty_held_is_never_saved_even_with_min_zero():
    assert plan_save(Held(A, 0, True), Occasion.SWITCH, 0, key=B) == Skip("save", A, BELOW_MIN)


@pytest.mark.parametrize("n_restored, cache_n, n_prompt, reused", [
    (3520, 3519, 3600, True), (3520, 1760, None, True), (3520, 0, 3600, False), (3520, 100, 3600, False),
    (3520, 1000, 1001, True),  # the client cut the conversation short: its prompt is a prefix
    (3520, 0, 1001, False),
])
def test_restore_reused(n_restored, cache_n, n_prompt, reused):
    assert restore_reused(n_restored, cache_n, n_prompt) is reused


@pytest.mark.parametrize(
    "name, held, outcome, found, shared_now, expect",
    [
        ("nothing shares enough: no restore", None, SaveOutcome.NOT_TRIED, None, 0, Skip("restore", B, NO_MATCH)),
        ("a file shares min more than the slot: restore", None, SaveOutcome.NOT_TRIED, ("f.bin", MIN), 0,
         RestoreFile("f.bin", MIN)),
        ("a file shares less than min more than the slot: no restore", Held(A, 5000, True), SaveOutcome.SAVED,
         ("f.bin", 3000), 2500, Skip("restore", B, NO_MATCH)),
        ("a file shares min more than the slot does live: restore", Held(A, 5000, True), SaveOutcome.SAVED,
         ("f.bin", 3500), 2500, RestoreFile("f.bin", 3500)),
        ("save failed, durable held: no restore", Held(A, 5000, True), SaveOutcome.FAILED, ("f.bin", 3000), 0,
         Skip("restore", B, SAVE_FAILED_DURABLE)),
        ("save failed, provisional held: restore", Held(A, 5000, False), SaveOutcome.FAILED, ("f.bin", 3000), 0,
         RestoreFile("f.bin", 3000)),
    ],
)
def test_plan_restore_by_tokens(name, held, outcome, found, shared_now, expect):
    assert plan_restore_by_tokens(held, B, outcome, found, shared_now, MIN) == expect, name


def test_restore_by_tokens_with_min_tokens_zero_still_needs_one_more_token():
    assert plan_restore_by_tokens(None, B, SaveOutcome.NOT_TRIED, ("f.bin", 7), 7, 0) == Skip("restore", B, NO_MATCH)
    assert plan_restore_by_tokens(None, B, SaveOutcome.NOT_TRIED, ("f.bin", 8), 7, 0) == RestoreFile("f.bin", 8)


# -- the shared bucket: when a turn downloads first (plan_fetch_*) ---------------------------------
FAILED, SAVED, NOT = SaveOutcome.FAILED, SaveOutcome.SAVED, SaveOutcome.NOT_TRIED


@pytest.mark.parametrize(
    "name, held, outcome, local, remote, shared_now, expect",
    [
        ("nothing local, the bucket shares enough: fetch", None, NOT, None, ("auto-r.bin", 3000), 0,
         Fetch("auto-r.bin", 3000, 3000)),
        ("nothing in the bucket", None, NOT, ("auto-l.bin", 3000), None, 0, None),
        ("the bucket shares less than min_tokens", None, NOT, None, ("auto-r.bin", 999), 0, None),
        ("the bucket shares exactly min_tokens", None, NOT, None, ("auto-r.bin", MIN), 0, Fetch("auto-r.bin", MIN, MIN)),
        ("a local file as good: restore it, no download", None, NOT, ("auto-l.bin", 3000), ("auto-r.bin", 3000), 0,
         None),
        ("a local file almost as good: no download for a few tokens", None, NOT, ("auto-l.bin", 3000),
         ("auto-r.bin", 3999), 0, None),
        ("the bucket's save shares min_tokens more than the local file", None, NOT, ("auto-l.bin", 3000),
         ("auto-r.bin", 4000), 0, Fetch("auto-r.bin", 4000, 1000)),
        ("the slot already shares most of it", Held(A, 5000, True), SAVED, None, ("auto-r.bin", 5500), 5000, None),
        ("the slot shares some, the bucket much more", Held(A, 5000, True), SAVED, None, ("auto-r.bin", 9000), 5000,
         Fetch("auto-r.bin", 9000, 4000)),
        ("the held conversation's save failed while durable: nothing replaces it", Held(A, 5000, True), FAILED, None,
         ("auto-r.bin", 9000), 0, None),
        ("a failed save of a provisional state does not block it", Held(A, 5000, False), FAILED, None,
         ("auto-r.bin", 9000), 0, Fetch("auto-r.bin", 9000, 9000)),
    ],
)
def test_plan_fetch_by_tokens(name, held, outcome, local, remote, shared_now, expect):
    assert plan_fetch_by_tokens(held, outcome, local, remote, shared_now, MIN) == expect, name


L2 = KVLayout(2)


@pytest.mark.parametrize(
    "name, held, outcome, local, local_at, remote_n, remote_at, expect",
    [
        ("no local file, the bucket has one: fetch", None, NOT, None, None, 3000, 20.0, Fetch(f"auto-{B}.bin", 3000,
                                                                                              3000)),
        ("the bucket has none", None, NOT, None, None, None, None, None),
        ("the bucket's is below min", None, NOT, None, None, 999, 20.0, None),
        ("the local file is newer", None, NOT, FileInfo(3000, M), 30.0, 9000, 20.0, None),
        ("the local file is older but as long", None, NOT, FileInfo(3000, M), 10.0, 3500, 20.0, None),
        ("the local file is older and shorter by min_tokens", None, NOT, FileInfo(3000, M), 10.0, 4000, 20.0,
         Fetch(f"auto-{B}.bin", 4000, 1000)),
        ("the local file is another model's", None, NOT, FileInfo(3000, "other"), 30.0, 2000, 20.0,
         Fetch(f"auto-{B}.bin", 2000, 2000)),
        ("the local file has a layout this engine cannot load", None, NOT, FileInfo(3000, M, KVLayout(1)), 30.0, 2000,
         20.0, Fetch(f"auto-{B}.bin", 2000, 2000)),
        ("the slot holds the conversation already", Held(B, 100, True), NOT, None, None, 3000, 20.0, None),
        ("the held conversation's save failed while durable", Held(A, 5000, True), FAILED, None, None, 3000, 20.0,
         None),
    ],
)
def test_plan_fetch_by_key(name, held, outcome, local, local_at, remote_n, remote_at, expect):
    assert plan_fetch_by_key(held, B, outcome, local, local_at, remote_n, remote_at, M, MIN, L2) == expect, name


# -- auto_sessions_min_tokens = "auto" (issue 22) ------------------------------------------
from autosessd.sessions.policy import AUTO_CEILING, AUTO_FLOOR, auto_min_tokens  # noqa: E402
from autosessd.sessions.savings import Prefill  # noqa: E402

NFAST = 14_072
CPU = Prefill(a=1.8, b=0.0, reads=5)  # this machine: ~550 tokens/s
GPU = Prefill(a=0.1, b=2e-6, reads=5)  # 10,000 tokens/s, attention showing at long contexts
DISK = (4.0, 1 / 400e3)  # 4 ms a call, 400 MB/s
FAST_DISK = (1.0, 1 / 2e6)  # 2 GB/s


@pytest.mark.parametrize("prefill, save, restore, bpt, want, why", [
    # Nothing measured yet: the floor, and what is missing said.
    (None, None, None, None, AUTO_FLOOR, "until the engine has shown a prompt read, a save, a restore"),
    (CPU, DISK, None, 8000, AUTO_FLOOR, "a restore"),
    # A CPU re-reads slowly: everything over the floor is worth a file.
    (CPU, DISK, DISK, 8000, AUTO_FLOOR, "the floor is 256"),
    # A fast GPU, 128 kB a token on a 400 MB/s disk: saving costs 0.64 ms a token against 0.1 to read,
    # and only the attention term (b·n²) makes a long conversation worth it.
    (GPU, DISK, DISK, 128e3, 270_015, "re-reading 270,015 tokens"),
    # The same GPU on a fast disk: worth it from some fourteen thousand tokens on (DESIGN §6's 16,000
    # was this case), and on a faster one from the floor.
    (GPU, FAST_DISK, FAST_DISK, 128e3, NFAST, f"re-reading {NFAST:,} tokens"),
    (GPU, (1.0, 1 / 8e6), (1.0, 1 / 8e6), 128e3, AUTO_FLOOR, "the floor is 256"),
    # Re-reading linear and cheaper than the disk at every size: no saves, and it says so.
    (Prefill(0.1, 0.0, 1), DISK, DISK, 128e3, AUTO_CEILING, "cheaper than saving and restoring at every size"),
])
def test_auto_min_tokens(prefill, save, restore, bpt, want, why):
    n, said = auto_min_tokens(prefill, save, restore, bpt)
    assert n == want and why in said
    if AUTO_FLOOR < n < AUTO_CEILING:  # the smallest n where re-reading costs more than keeping
        def gain(m):
            return prefill.ms(0, m) - (save[0] + restore[0] + (save[1] + restore[1]) * bpt * m)
        assert gain(n) > 0 >= gain(n - 1)
