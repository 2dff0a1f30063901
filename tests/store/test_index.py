"""The token index (index.py): longest common prefix against a brute force, the scan of a
session directory, the cache between starts, and the naming rule for diverging conversations."""

import json
import os
import stat

import pytest
from hypothesis import given, settings, strategies as st

from autosessd.store import index as index_mod
from autosessd.store.branches import SavedFile, SaveTarget, branch_key, save_key
from autosessd.store.index import Match, TokenIndex
from autosessd.store.runs import common_prefix
from autosessd.store.slotfile import build, encode
from stub_engine import lcp as brute_lcp  # the naive reference the index must agree with

M, OTHER = "model-a", "model-b"
KEY = "f7ff9e8b7bb2e09b"




def write_bin(d, name, tokens, state=b"\x01" * 64):
    p = d / name
    p.write_bytes(build(tokens, state))
    return p


def write_auto(d, key, tokens, model=M, bytes_ok=True):
    p = write_bin(d, f"auto-{key}.bin", tokens)
    size = p.stat().st_size
    (d / f"auto-{key}.json").write_text(json.dumps({"key": key, "n_tokens": len(tokens), "bytes": size if bytes_ok
                                                    else size + 1, "saved_at": 1.0, "model": model, "save_ms": 1.0}))
    return p


# -- the prefix --------------------------------------------------------------------
@pytest.mark.parametrize("a, b, n", [
    ([], [], 0), ([1], [], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([1, 2, 3], [1, 9, 3], 1),
    ([5], [6], 0), ([0, 256], [0, 1], 1),  # differs only in a byte past the first of the token
    ([-1, 7], [-1, 8], 1), ([2**31 - 1, 3], [2**31 - 1, 3, 4], 2),
])
def test_common_prefix_counts_tokens_not_bytes(a, b, n):
    assert common_prefix(encode(a), encode(b)) == common_prefix(encode(b), encode(a)) == n


# A small alphabet and short lists: files that share long prefixes with each other and the query are common.
tokens_st = st.lists(st.integers(0, 2), max_size=12)


@given(tokens_st, tokens_st)
def test_common_prefix_is_the_brute_force(a, b):
    assert common_prefix(encode(a), encode(b)) == brute_lcp(a, b)


@pytest.mark.parametrize("bad, why", [
    ([1, "2"], "'2'"), ([1, 2**31], str(2**31)), ([1.5], "1.5"), (b"\x01\x02", "bytes"), ("abc", "str"),
])
def test_bad_tokens_are_refused_with_what_was_wrong(bad, why):
    with pytest.raises(ValueError, match=why):
        encode(bad)


# -- lookups against a brute force ------------------------------------------------
files_st = st.dictionaries(st.sampled_from([f"f{i}.bin" for i in range(8)]),
                           st.tuples(st.sampled_from([M, OTHER, None]), tokens_st), max_size=8)


def index_of(tmp_path, files) -> TokenIndex:
    idx = TokenIndex(tmp_path)
    for name, (model, tokens) in files.items():
        write_bin(tmp_path, name, tokens)
        idx.add(name, tokens, model)
    return idx


@settings(max_examples=200, deadline=None)
@given(files=files_st, query=tokens_st, model=st.sampled_from([M, OTHER, None]),
       exclude=st.sets(st.sampled_from([f"f{i}.bin" for i in range(8)])), min_lcp=st.integers(0, 6),
       prefer=st.sampled_from([None, "f0.bin", "f1.bin"]), window=st.sampled_from([None, 1, 2, 4]))
def test_best_and_matches_are_the_brute_force(tmp_path_factory, files, query, model, exclude, min_lcp, prefer,
                                              window):
    idx = index_of(tmp_path_factory.mktemp("d"), files)
    allowed = {n: brute_lcp(t, query) for n, (m, t) in files.items() if m == model and n not in exclude
               and (window is None or len(t) <= window or len(t) - brute_lcp(t, query) <= 1)}
    wanted = {n: v for n, v in allowed.items() if v >= max(1, min_lcp)}
    got = idx.best(query, model, exclude=exclude, prefer=prefer, min_lcp=min_lcp, window=window)
    if not wanted:
        assert got is None
    else:
        top = max(wanted.values())
        tied = [n for n, v in wanted.items() if v == top]
        name = min(tied, key=lambda n: (n != prefer, len(files[n][1]), n))
        assert got == (name, top)
    ms = idx.matches(query, model, min_lcp=min_lcp, exclude=exclude, window=window)
    assert sorted((m.name, m.lcp) for m in ms) == sorted(wanted.items())
    assert [m.lcp for m in ms] == sorted((m.lcp for m in ms), reverse=True)
    for n, (m, t) in files.items():
        assert idx.lcp(n, query) == brute_lcp(t, query)


ops_st = st.lists(st.tuples(st.sampled_from(["add", "add", "remove", "learn"]),
                            st.sampled_from([f"{c}.bin" for c in "abcdefgh"]), st.sampled_from([M, M, OTHER, None]),
                            tokens_st), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops=ops_st, query=tokens_st)
def test_add_remove_learn_keep_lookups_right(tmp_path_factory, ops, query):
    d = tmp_path_factory.mktemp("d")
    idx = TokenIndex(d)
    truth: dict[str, tuple] = {}
    for op, name, model, tokens in ops:
        if op == "add":
            write_bin(d, name, tokens)
            idx.add(name, tokens, model)
            truth[name] = (model, tokens)
        elif op == "remove":
            assert idx.remove(name) == (name in truth)
            truth.pop(name, None)
        elif model is not None:
            assert idx.learn(name, model) == (name in truth)
            if name in truth:
                truth[name] = (model, truth[name][1])
        assert idx.names() == sorted(truth)
        for m in (M, OTHER, None):
            want = {n: brute_lcp(t, query) for n, (mm, t) in truth.items() if mm == m}
            got = idx.best(query, m)
            assert (got[1] if got else 0) == max([v for v in want.values() if v], default=0)
            assert sorted((x.name, x.lcp) for x in idx.matches(query, m)) == sorted(
                (n, v) for n, v in want.items() if v)


def test_removing_a_file_between_two_others_keeps_their_shared_prefix_right(tmp_path):
    idx = index_of(tmp_path, {"a.bin": (M, [0]), "b.bin": (M, [0, 1]), "c.bin": (M, [0, 1, 1])})
    idx.remove("b.bin")
    assert idx.matches([0, 1, 1, 0], M) == [Match("c.bin", 3, 3), Match("a.bin", 1, 1)]
    idx.add("b.bin", [0, 1], M)
    idx.remove("a.bin")
    assert idx.matches([0], M) == [Match("b.bin", 1, 2), Match("c.bin", 1, 3)]


def test_best_prefers_the_requests_own_line_then_the_smaller_file(tmp_path):
    S = [2, 105, 9, 9, 9]
    idx = index_of(tmp_path, {"auto-aaaaaaaaaaaaaaaa.bin": (M, S + [1, 1, 1]), "auto-bbbbbbbbbbbbbbbb.bin":
                              (M, S + [4]), "big.bin": (M, S + [5] * 50)})
    q = S + [7, 7]
    assert idx.best(q, M) == ("auto-bbbbbbbbbbbbbbbb.bin", 5)
    assert idx.best(q, M, prefer="big.bin") == ("big.bin", 5)
    assert idx.best(q, M, exclude={"auto-bbbbbbbbbbbbbbbb.bin"}) == ("auto-aaaaaaaaaaaaaaaa.bin", 5)
    assert idx.best(q, OTHER) is None
    assert idx.best(q, M, min_lcp=6) is None
    assert idx.matches(q, M, limit=2) == [Match("auto-bbbbbbbbbbbbbbbb.bin", 5, 6),
                                          Match("auto-aaaaaaaaaaaaaaaa.bin", 5, 8)]


def test_a_sliding_window_restores_only_what_the_engine_can_go_on_from(tmp_path):
    """A file's sliding-window layers hold only its last `window` cells: a request may restore
    it only when the file is no longer than the window, or when the request goes on from its
    end (runs.swa_usable; a departure inside the file was measured to change the answer)."""
    S = list(range(100, 130))  # a system prompt
    idx = index_of(tmp_path, {"task1.bin": (M, S + [1] * 40), "prefix.bin": (M, S + [2] * 5),
                              "short.bin": (M, S[:10] + [7] * 4)})
    q = S + [3] * 10
    assert idx.best(q, M) == ("prefix.bin", 30)  # the smaller of two equals
    assert idx.best(q, M, exclude={"prefix.bin"}) == ("task1.bin", 30)
    # Gemma 3 keeps its last 512 tokens; here a window of 16. task1 and prefix depart from q
    # inside the file: only short.bin, all inside the window, may be restored for q.
    assert idx.best(q, M, window=16) == ("short.bin", 10)
    assert idx.matches(q, M, window=16) == [Match("short.bin", 10, 14)]
    assert idx.best(q, M, window=16, exclude={"short.bin"}) is None
    assert idx.best(S + [2] * 5 + [8], M, window=16) == ("prefix.bin", 35)  # it goes on from its end
    assert idx.best(S + [2] * 4 + [8], M, window=16) == ("prefix.bin", 34)  # from its last token
    assert idx.best(S[:10] + [5], M, window=16) == ("short.bin", 10)  # 14 tokens: all in the window


def test_media_placeholders_end_what_a_prompt_can_share(tmp_path):
    idx = index_of(tmp_path, {"img.bin": (M, [2, 5, -1, -1, 6])})
    assert idx.get("img.bin").n_tokens == 5
    assert idx.lcp("img.bin", [2, 5, -1, -1, 6]) == 2


def test_add_needs_the_final_file_and_a_bare_name(tmp_path):
    idx = TokenIndex(tmp_path)
    with pytest.raises(FileNotFoundError):
        idx.add("auto-0000000000000000.bin", [1, 2], M)
    for bad in (".autosessd-0000000000000000.partial", "../x.bin", "a/b.bin", ".hidden.bin", "x.json"):
        with pytest.raises(ValueError, match="not a session file name"):
            idx.add(bad, [1], M)


# -- the directory ------------------------------------------------------------------
def test_scan_reads_headers_models_and_skips_what_it_cannot_read(tmp_path):
    k1, k2, k3 = "1" * 16, "2" * 16, "3" * 16
    write_auto(tmp_path, k1, [2, 10, 11])
    write_auto(tmp_path, k2, [2, 20], model=OTHER)
    write_auto(tmp_path, k3, [2, 30], bytes_ok=False)  # metadata of another file: model unknown
    write_bin(tmp_path, "mine.bin", [2, 10, 12])
    write_bin(tmp_path, ".autosessd-4444444444444444.partial", [2, 10, 11, 12])  # being written
    (tmp_path / "torn.bin").write_bytes(build([1, 2, 3])[:20])
    (tmp_path / "notes.bin").write_bytes(b"GGUF" + b"\0" * 60)
    os.symlink(tmp_path / "mine.bin", tmp_path / "link.bin")
    idx = TokenIndex(tmp_path)
    r = idx.scan()
    assert idx.names() == [f"auto-{k1}.bin", f"auto-{k2}.bin", f"auto-{k3}.bin", "mine.bin"]
    assert [idx.get(n).model for n in idx.names()] == [M, OTHER, None, None]
    assert idx.get(f"auto-{k1}.bin").token_list() == [2, 10, 11]
    assert set(r.skipped) == set(idx.skipped) == {"torn.bin", "notes.bin", "link.bin"}
    assert "more than the file" in r.skipped["torn.bin"] and "magic" in r.skipped["notes.bin"]
    assert r.skipped["link.bin"] == "not a regular file"
    assert (r.files, r.read, r.from_cache) == (4, 4, 0)
    assert idx.best([2, 10, 12, 13], M) == (f"auto-{k1}.bin", 2)  # mine.bin shares 3, but its model is unknown
    assert idx.best([2, 10, 12, 13], None) == ("mine.bin", 3)
    assert idx.learn("mine.bin", M)
    assert idx.best([2, 10, 12, 13], M) == ("mine.bin", 3)


def test_a_second_scan_rereads_only_what_changed(tmp_path):
    write_auto(tmp_path, "1" * 16, [2, 1])
    write_bin(tmp_path, "mine.bin", [2, 3])
    idx = TokenIndex(tmp_path)
    idx.scan()
    idx.learn("mine.bin", M)
    write_bin(tmp_path, "mine.bin", [2, 3, 4, 5], state=b"\x02" * 80)  # the person saved over it
    (tmp_path / f"auto-{'1' * 16}.bin").unlink()
    seen = idx.generation
    r = idx.scan()
    assert idx.generation != seen  # an answer drawn from the entries before is stale (turn.py)
    assert (r.read, r.from_cache, idx.names()) == (1, 0, ["mine.bin"])
    assert idx.get("mine.bin").token_list() == [2, 3, 4, 5]
    assert idx.get("mine.bin").model is None  # learned for the old file, not this one
    assert idx.best([2, 3, 4, 5], None) == ("mine.bin", 4) and idx.best([2, 1], M) is None
    seen = idx.generation
    idx.scan()
    assert idx.generation == seen  # nothing changed on disk


def test_a_change_during_a_scan_wins_over_what_the_scan_saw(tmp_path, monkeypatch):
    write_bin(tmp_path, "a.bin", [1])
    write_bin(tmp_path, "b.bin", [2])
    idx = TokenIndex(tmp_path)
    real = index_mod.read_header

    def racing(path, max_tokens=None):  # a prune removes b.bin and a save adds c.bin while the scan reads
        if str(path).endswith("a.bin") and "b.bin" in os.listdir(tmp_path):
            (tmp_path / "b.bin").unlink()
            idx.remove("b.bin")
            write_bin(tmp_path, "c.bin", [3])
            idx.add("c.bin", [3], M)
        return real(path, max_tokens)

    monkeypatch.setattr(index_mod, "read_header", racing)
    idx.scan()
    assert idx.names() == ["a.bin", "c.bin"]
    assert idx.get("c.bin").model == M


# -- the cache ------------------------------------------------------------------------
def test_cache_spares_the_headers_at_the_next_start(tmp_path, monkeypatch):
    d, cache = tmp_path / "sessions", tmp_path / "state" / "index.cache"
    d.mkdir()
    for i in range(5):
        write_auto(d, f"{i:016x}", [2, i, i])
    write_bin(d, "mine.bin", [2, 9])
    idx = TokenIndex(d, cache)
    idx.scan()
    idx.learn("mine.bin", OTHER)
    assert idx.save_cache() and not idx.save_cache()  # nothing changed since
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600  # it holds conversations' tokens

    def no_reads(path, max_tokens=None):
        raise AssertionError(f"read {path} although the cache knew it")

    monkeypatch.setattr(index_mod, "read_header", no_reads)
    again = TokenIndex(d, cache)
    r = again.scan()
    assert (r.cache, r.from_cache, r.read) == ("loaded", 6, 0)
    assert again.get("mine.bin").model == OTHER and again.get(f"auto-{3:016x}.bin").token_list() == [2, 3, 3]
    assert not again.dirty
    monkeypatch.undo()

    write_auto(d, f"{1:016x}", [2, 1, 1, 1])  # re-saved while the daemon was down
    third = TokenIndex(d, cache)
    r = third.scan()
    assert (r.cache, r.from_cache, r.read) == ("loaded", 5, 1) and third.dirty
    assert third.get(f"auto-{1:016x}.bin").token_list() == [2, 1, 1, 1]


@pytest.mark.parametrize("damage, why", [
    (lambda b: b[:-9], "damaged"),
    (lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:], "damaged (checksum)"),
    (lambda b: b"garbage", "not an index cache"),
    (lambda b: b[:16] + b"\x09" + b[17:], "version 9"),
])
def test_a_bad_cache_is_rebuilt(tmp_path, damage, why):
    d, cache = tmp_path / "sessions", tmp_path / "index.cache"
    d.mkdir()
    write_auto(d, "1" * 16, [2, 5, 6])
    idx = TokenIndex(d, cache)
    idx.scan()
    idx.save_cache()
    cache.write_bytes(damage(cache.read_bytes()))
    again = TokenIndex(d, cache)
    r = again.scan()
    assert why in r.cache and (r.read, again.names()) == (1, [f"auto-{'1' * 16}.bin"])
    assert again.dirty and again.save_cache()
    assert TokenIndex(d, cache).scan().cache == "loaded"


def test_a_cache_of_another_directory_is_not_used(tmp_path):
    a, b, cache = tmp_path / "a", tmp_path / "b", tmp_path / "index.cache"
    a.mkdir(), b.mkdir()
    write_bin(a, "x.bin", [1, 2])
    write_bin(b, "x.bin", [1, 2])
    ia = TokenIndex(a, cache)
    ia.scan()
    ia.learn("x.bin", M)
    ia.save_cache()
    r = TokenIndex(b, cache).scan()
    assert r.cache.startswith("for another directory") and r.read == 1


def test_cache_replaces_a_loose_file_with_a_private_one(tmp_path):
    d, cache = tmp_path / "s", tmp_path / "index.cache"
    d.mkdir()
    write_bin(d, "x.bin", [1])
    (tmp_path / "index.cache.tmp").write_bytes(b"left over")
    os.chmod(tmp_path / "index.cache.tmp", 0o644)
    idx = TokenIndex(d, cache)
    idx.scan()
    idx.save_cache()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600 and not (tmp_path / "index.cache.tmp").exists()


# -- naming ----------------------------------------------------------------------------
X = [2, 105, 10, 11, 12, 13]          # system "pirate" + "Hello" ...
Y = [2, 105, 20, 21, 22]              # system "lawyer" + the same "Hello": departs at 2
BX = branch_key(KEY, Y[:3])


@pytest.mark.parametrize("files, tokens, want", [
    ({}, X, SaveTarget(KEY, "new", 0)),
    ({KEY: X}, X, SaveTarget(KEY, "extends", 6)),
    ({KEY: X}, X + [14, 15], SaveTarget(KEY, "extends", 6)),
    ({KEY: X + [14, 15]}, X, SaveTarget(KEY, "covered", 6)),
    ({KEY: X}, Y, SaveTarget(BX, "branch", 0)),
    ({KEY: X, BX: Y}, Y + [23], SaveTarget(BX, "extends", 5)),
    # a third conversation departing from X at the same token as Y, then from Y
    ({KEY: X, BX: Y}, [2, 105, 20, 99], SaveTarget(branch_key(BX, [2, 105, 20, 99]), "branch", 0)),
    # an edited message 3 of X: departs at 4
    ({KEY: X}, X[:4] + [77, 78], SaveTarget(branch_key(KEY, X[:4] + [77]), "branch", 0)),
    # X's file: its prompt (6) and a reply (50, 51); the next turn sends the reply back as other tokens
    ({KEY: SavedFile(X + [50, 51], n_prompt=6)}, X + [50, 60, 61, 62], SaveTarget(KEY, "replaces", 7)),
    ({KEY: SavedFile(X + [50, 51], n_prompt=6)}, X + [52], SaveTarget(KEY, "replaces", 6)),  # regenerated
    ({KEY: SavedFile(X + [50, 51], n_prompt=6)}, X[:5] + [99], SaveTarget(branch_key(KEY, X[:5] + [99]), "branch", 0)),
    ({KEY: SavedFile(X + [50, 51], n_prompt=None)}, X + [52], SaveTarget(branch_key(KEY, X + [52]), "branch", 0)),
])
def test_save_key_table(files, tokens, want):
    assert save_key(KEY, tokens, files.get) == want


def test_branch_name_is_stable_as_both_conversations_grow():
    files = {KEY: X}
    first = save_key(KEY, Y, files.get)
    files[first.key] = Y
    files[KEY] = X + [14, 15, 16]  # X went on and was saved again
    for more in ([], [23], [23, 24, 25]):
        assert save_key(KEY, Y + more, files.get).key == first.key
    assert save_key(KEY, X + [14, 15, 16, 17], files.get) == SaveTarget(KEY, "extends", 9)


def test_branch_names_differ_by_where_and_how_they_depart():
    names = {branch_key(KEY, X[:3] + [t]) for t in (1, 2)} | {branch_key(KEY, X[:4] + [1])} \
        | {branch_key("0" * 16, X[:3] + [1])}
    assert len(names) == 4 and all(len(n) == 16 and int(n, 16) >= 0 for n in names)
    # sha1(b"autosessd branch\0" + key + b"\0" + the tokens as little-endian int32)[:16]
    assert branch_key(KEY, [2, 105, 20]) == branch_key(KEY, encode([2, 105, 20])) == "5f0725ce242e3f74"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=12))
def test_saving_by_save_key_never_loses_a_conversation(convs):
    """Whatever order conversations of one opener are saved in, each stays whole in some
    file: a save only lands on a free name or on a file its tokens contain."""
    files: dict[str, list[int]] = {}
    for conv in convs:
        t = save_key(KEY, conv, files.get)
        if t.why in ("new", "branch"):
            assert t.key not in files
        elif t.why == "extends":
            assert conv[:len(files[t.key])] == files[t.key]
        else:
            assert files[t.key][:len(conv)] == conv
        if t.why != "covered":
            files[t.key] = conv
        for seen in convs[:convs.index(conv) + 1]:
            assert any(f[:len(seen)] == seen for f in files.values())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=12), st.integers(0, 4)),
                min_size=1, max_size=12))
def test_a_save_only_replaces_a_file_whose_prompt_it_holds(convs):
    """With prompt lengths known, a save lands on a free name, or on a file whose prompt the
    conversation holds whole (only a reply is given up)."""
    files: dict[str, SavedFile] = {}
    for tokens, reply in convs:
        n_prompt = max(0, len(tokens) - reply)
        t = save_key(KEY, tokens, files.get)
        old = files.get(t.key)
        if old is None:
            assert t.why in ("new", "branch")
        elif t.why == "covered":
            assert old.tokens[:len(tokens)] == tokens
            continue
        else:
            assert t.why in ("extends", "replaces") and tokens[:old.n_prompt] == old.tokens[:old.n_prompt]
        files[t.key] = SavedFile(tokens, n_prompt)


def test_save_key_gives_up_on_a_hand_made_loop():
    def lookup(k):  # every name holds a file that departs at once: no honest directory does this
        return [99]

    with pytest.raises(ValueError, match="no free name"):
        save_key(KEY, [1, 2], lookup, max_steps=5)
