"""Property tests: parsers take arbitrary input without an unhandled exception; store + prune
keep their invariants under any sequence of operations."""

import json
import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from autosessd.front import protocol
from autosessd.base.keys import conversation_key, is_key, messages_key
from autosessd.front.protocol import ProtocolError
from autosessd.store.directory import AUTO_BIN, Meta, Store, StoreError, manual_name
from autosessd.follow.requestlog import BadLine, parse_line

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)
chat_like = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", 3, None]),
     "content": st.one_of(st.text(), st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "input_text", "image_url"]), "text": st.one_of(st.text(), st.integers())})),
         st.integers(), st.none())}), max_size=4)})


@given(st.binary(max_size=2000))
def test_protocol_parser_takes_any_bytes(data):
    try:
        req = protocol.parse_request(data)
    except ProtocolError as e:
        assert e.code and e.message
    else:
        assert req.cmd in protocol.COMMANDS


@given(json_values)
def test_protocol_parser_takes_any_json(value):
    try:
        protocol.parse_request(json.dumps(value).encode())
    except ProtocolError:
        pass


@given(st.fixed_dictionaries({"cmd": st.sampled_from(sorted(protocol.COMMANDS)),
                              "args": st.dictionaries(st.sampled_from(["name", "what", "key", "slot", "keep",
                                                                        "max_gb", "dry_run", "follow", "limit",
                                                                        "messages", "x"]), json_values)}))
def test_protocol_args_are_typed_or_refused(obj):
    try:
        req = protocol.parse_request(json.dumps(obj).encode())
    except ProtocolError as e:
        assert e.code in (protocol.Code.BAD_ARGS,)
        return
    for name, value in req.args.items():
        types, _ = protocol.COMMANDS[req.cmd][name]
        assert isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


@given(st.binary(max_size=2000))
def test_log_line_parser_takes_any_bytes(data):
    try:
        ev = parse_line(data)
    except BadLine:
        return
    assert ev.event in ("start", "end")
    assert ev.key is None or is_key(ev.key)


@given(json_values)
def test_log_line_parser_takes_any_json(value):
    try:
        ev = parse_line(json.dumps(value).encode())
    except BadLine:
        return
    assert ev.key is None or is_key(ev.key)


@given(st.one_of(json_values, chat_like))
def test_conversation_key_takes_any_json(value):
    k = conversation_key(value)
    assert k is None or is_key(k)
    m = messages_key(value.get("messages") if isinstance(value, dict) else value)
    assert m is None or is_key(m)


@given(st.text(max_size=300))
def test_manual_names_never_escape(name):
    try:
        file = manual_name(name)
    except StoreError:
        return
    assert "/" not in file and not file.startswith(".") and file.endswith(".bin")
    assert os.path.basename(file) == file and not AUTO_BIN.match(file)


class StoreMachine(RuleBasedStateMachine):
    """Auto files come and go, people's files sit beside them, some files are in use."""

    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="autosessd-prop-"))
        self.store = Store(self.dir)
        self.clock = 0.0
        self.manual = {}

    def teardown(self):
        for p in self.dir.iterdir():
            p.unlink()
        self.dir.rmdir()

    @rule(k=st.integers(0, 15), size=st.integers(1, 400))
    def save(self, k, size):
        key = f"{k:016x}"
        if self.store.bin_path(key).name in self.store.in_use:
            return
        self.clock += 1
        self.store.temp_path(key).write_bytes(b"qsgg" + b"\0" * size)
        self.store.verify_temp(key, size + 4, b"qsgg")
        self.store.finalize(key, Meta(key, size, size + 4, self.clock, "m", 0))

    @rule(name=st.sampled_from(["mine.bin", "notes.txt", "auto-XYZ.bin", "auto-0000000000000000.bin.bak",
                                ".hidden", "AUTO-0000000000000001.bin"]), data=st.binary(max_size=50))
    def person_writes(self, name, data):
        (self.dir / name).write_bytes(data)
        self.manual[name] = data

    @rule(k=st.integers(0, 15))
    def use(self, k):
        self.store.in_use[f"auto-{k:016x}.bin"] += 1

    @rule()
    def release_all(self):
        self.store.in_use.clear()

    @rule(keep=st.integers(1, 6), max_bytes=st.integers(0, 2000))
    def prune(self, keep, max_bytes):
        in_use = set(self.store.in_use)
        before = {e.key for e in self.store.scan()}
        self.store.prune(keep, max_bytes)
        after = self.store.scan()
        removed = before - {e.key for e in after}
        for key in removed:
            assert f"auto-{key}.bin" not in in_use
        free = [e for e in after if e.name not in in_use]
        assert len(free) <= keep
        assert sum(e.bytes for e in free) <= max_bytes or not free

    @invariant()
    def peoples_files_untouched(self):
        for name, data in self.manual.items():
            assert (self.dir / name).read_bytes() == data

    @invariant()
    def every_session_has_agreeing_metadata(self):
        for e in self.store.scan():
            assert e.meta is not None and e.meta.bytes == e.bytes


TestStore = StoreMachine.TestCase
TestStore.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
