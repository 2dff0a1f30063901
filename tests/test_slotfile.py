"""The slot-file header reader against the layout llama-server b11434 writes (and the
older plain token list). The real engine's files are checked in test_engine_real.py."""

import struct

import pytest

from autosessd.slotfile import BadSlotFile, build, parse_header, read_header


def test_reads_the_servers_payload(tmp_path):
    p = tmp_path / "a.bin"
    p.write_bytes(build([2, 105, 2364, 107], state=b"\x01" * 1000))
    h = read_header(p)
    assert h.tokens == (2, 105, 2364, 107) and h.n_tokens == 4


def test_reads_an_older_plain_token_list(tmp_path):
    p = tmp_path / "old.bin"
    p.write_bytes(struct.pack("<III3i", 0x67677371, 4, 3, 2, 9, 8) + b"\0" * 64)
    assert read_header(p).tokens == (2, 9, 8)


def test_empty_slot_file_has_no_tokens():
    assert parse_header(build([])).n_tokens == 0


@pytest.mark.parametrize("data, why", [
    (b"GGUF" + b"\0" * 20, "magic"),
    (struct.pack("<III", 0x67677371, 3, 0), "version 3"),
    (struct.pack("<III", 0x67677371, 4, 1000) + b"\0" * 16, "more than the file"),
    (struct.pack("<III5i", 0x67677371, 4, 5, -1, 1, 99, 1, 2), "claims 99 tokens"),
    (struct.pack("<III3i", 0x67677371, 4, 3, -1, 7, 0), "payload version 7"),
    (b"qsg", "too short"),
])
def test_refuses_what_it_cannot_read(tmp_path, data, why):
    p = tmp_path / "bad.bin"
    p.write_bytes(data)
    with pytest.raises(BadSlotFile, match=why):
        read_header(p)
