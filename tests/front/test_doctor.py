"""autosessctl doctor (doctor.py): each engine setting that costs reuse with its fix (a table of
facts), llama-server's flags read from its command line, and where a prompt departed from a
restored file, in the client's terms."""

import dataclasses
import time

import pytest

from autosessd.front import doctor
from autosessd.store import slotfile
from autosessd.base.config import parse
from autosessd.front.doctor import Facts, checks, departure, parse_flags
from autosessd.sessions.facade import Sessions
from autosessd.store.directory import Store
from stub_engine import StubEngine, template, tokenize

GOOD = Facts(flags={"--swa-full": True, "--slot-save-path": "/srv/s"}, swa_window=512, empties_idle=False,
             n_slots=1, slots_visible=True, save_path="/srv/s", n_ctx=8192, largest_file=3000, files_over_ctx=0,
             arch="gemma3", recurrent=False, reused=3, not_reused=0, not_reused_cause=None)


def statuses(f):
    return {x.setting: (x.status, x.fix) for x in checks(f)}


@pytest.mark.parametrize("change, setting, status, fix", [
    ({}, "--swa-full", "ok", ""),
    ({"flags": {"--slot-save-path": "/srv/s"}}, "--swa-full", "problem", "start llama-server with --swa-full"),
    ({"flags": None, "reused": 0, "not_reused": 2}, "--swa-full", "problem", "start llama-server with --swa-full"),
    ({"flags": None}, "--swa-full", "ok", ""),  # restores were reused: it is on
    ({"flags": None, "reused": 0}, "--swa-full", "unknown", "start llama-server with --swa-full"),
    ({"swa_window": 0, "flags": {}}, "--swa-full", "ok", ""),
    ({"n_slots": 4, "empties_idle": True}, "--cache-idle-slots", "problem",
     "start llama-server with --no-cache-idle-slots"),
    ({"n_slots": 4}, "--cache-idle-slots", "ok", ""),
    ({"flags": {"--swa-full": True, "--slot-save-path": "/elsewhere"}}, "--slot-save-path", "problem",
     "start llama-server with --slot-save-path /srv/s"),
    ({"slots_visible": False}, "--no-slots", "problem", "start llama-server without --no-slots"),
    ({"files_over_ctx": 2, "largest_file": 12000}, "-c", "problem", "start llama-server with -c 13,024 or more"),
    ({"files_over_ctx": 2, "largest_file": 12000, "n_slots": 4}, "-c", "problem",
     "start llama-server with -c 52,096 or more"),
    ({"swa_retries": 2}, "sliding window", "problem",
     "send requests through the gate or the hook: there each save holds the state one token before its prompt's "
     "end, which a retry goes on from (a tail sees the prompt too late)"),
    ({"arch": "qwen35", "recurrent": True}, "model", "ok", None),
    ({"arch": "qwen35", "recurrent": True, "flags": {"--ctx-checkpoints": "0"}}, "--ctx-checkpoints", "problem",
     "run llama-server without --ctx-checkpoints 0 (its default keeps 32)"),
    ({"arch": "qwen35", "recurrent": True, "rewinds_reread": 3}, "--ctx-checkpoints", "problem",
     "run llama-server without --ctx-checkpoints 0 (its default keeps 32)"),
])
def test_checks(change, setting, status, fix):
    got = statuses(dataclasses.replace(GOOD, **change))[setting]
    assert got[0] == status and (got[1] == fix or status == "ok")


def test_all_good_has_no_problem():
    assert all(x.status == "ok" for x in checks(GOOD))


def test_flags_from_the_command_line_and_environment():
    argv = ["/usr/bin/llama-server", "-m", "m.gguf", "--swa-full", "-np", "4", "--ctx-size=32768", "--no-slots",
            "-kvu", "--slot-save-path", "/srv/s"]
    f = parse_flags(argv)
    assert f["--swa-full"] is True and f["-np"] == "4" and f["-c"] == "32768" and f["--no-slots"] is True
    assert f["--kv-unified"] is True and f["--slot-save-path"] == "/srv/s" and f["-m"] == "m.gguf"
    f = parse_flags(["llama-server"], {"LLAMA_ARG_SWA_FULL": "1", "LLAMA_ARG_SLOT_SAVE_PATH": "/x"})
    assert f == {"--swa-full": True, "--slot-save-path": "/x"}


def test_departure_in_the_clients_terms():
    text = b"<bos><system>You are terse.<end><user>first<end><assistant>ok<end><user>second<end><assistant>"
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}]
    spans = doctor.message_spans(text, msgs)
    assert [(n, role) for _, _, n, role in spans] == [(1, "system"), (2, "user"), (3, "assistant"), (4, "user")]
    offsets = list(range(len(text)))  # one byte a token
    at = text.index(b"terse")
    assert departure(at, 200, 300, offsets, spans, None) == f"system prompt differs at token {at:,}"
    at = text.index(b"ok<end>")
    assert departure(at, 200, 300, offsets, spans, None).startswith(
        f"message 3 (assistant) differs from the file at token {at:,}")
    assert "sliding window (512)" in departure(10, 2000, 3000, offsets, spans, 512)
    assert departure(200, 200, 300, offsets, spans, 512).startswith("the prompt continues the whole file")
    assert departure(150, 200, 150, offsets, spans, 512).startswith("the prompt (150 tokens) is shorter")


def test_token_offsets_skip_an_added_bos():
    assert doctor.token_offsets(b"ab", [b"<bos>", b"a", b"b"]) == [0, 0, 1]


async def test_doctor_names_the_edited_message_of_an_unreused_restore(tmp_path):
    cfg = parse(f'slot_save_path = "{tmp_path}"\nstate_dir = "{tmp_path / "st"}"\n'
                f'auto_sessions_min_tokens = 10\n'.encode())
    s = Sessions(cfg, StubEngine(tmp_path), Store(tmp_path), "stub-model")
    old = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "tell me " * 20},
                        {"role": "assistant", "content": "sure " * 10}, {"role": "user", "content": "more"}]}
    new = {"messages": [*old["messages"][:2], {"role": "assistant", "content": "SURE " * 10},
                        {"role": "user", "content": "more"}]}
    (tmp_path / "auto-0123456789abcdef.bin").write_bytes(slotfile.build(tokenize(template(old))))
    s.restore_log.departed.append({"file": "auto-0123456789abcdef.bin", "key": "0123456789abcdef",
                                   "n_restored": 300, "cache_n": 0, "at": time.time(), "body": new,
                                   "likely_cause": "x"})
    r = await doctor.run(s)
    where = r["not_reused"][0]["where"]
    at = len(tokenize(template(new)[:template(new).index("SURE")]))
    assert where.startswith(f"message 3 (assistant) differs from the file at token {at:,}")
    assert {f["setting"] for f in r["findings"]} >= {"--swa-full", "--slot-save-path", "--no-slots"}
    # Printed for people: one line per setting, then the restore.
    from autosessd.ctl_text import show_doctor

    text = show_doctor(r)
    assert "message 3 (assistant) differs" in text and text.splitlines()[0].startswith("engine http://stub")


def test_the_store_findings_say_where_the_engine_writes_and_what_stays_whole():
    """Issue 39: with token blocks on, an engine saving onto the disk writes each save whole there
    (a problem, with the fix); on tmpfs it is fine; conversations kept whole are counted by why."""
    on_disk = dataclasses.replace(GOOD, blocks=True, staging_tmpfs=False,
                                  whole={"it holds more than one KV cache (a sliding-window or hybrid model)": 3})
    by = {x.setting: x for x in checks(on_disk)}
    assert by["staging"].status == "problem" and "tmpfs" in by["staging"].fix and "--exec" in by["staging"].fix
    assert by["store"].status == "unknown" and "3 it holds more than one KV cache" in by["store"].says
    assert {x.setting: x.status for x in checks(dataclasses.replace(on_disk, staging_tmpfs=True))}["staging"] == "ok"
    assert "staging" not in {x.setting for x in checks(GOOD)}  # blocks off: nothing said


def test_a_path_is_on_tmpfs_by_its_longest_mount(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n/dev/vdb /dev/shm/disk ext4 rw 0 0\n")
    assert doctor.on_tmpfs("/dev/shm/autosessd-0/x", str(mounts)) is True
    assert doctor.on_tmpfs("/dev/shm/disk/x", str(mounts)) is False  # the longest mount point wins
    assert doctor.on_tmpfs("/srv/sessions", str(mounts)) is False
    assert doctor.on_tmpfs("/srv", str(tmp_path / "none")) is None
