"""The slot-file header reader against the layout llama-server b11434 writes (and the
older plain token list). The real engine's files are checked in test_engine_real.py."""

import struct

import pytest

from autosessd.store import slotfile
from autosessd.store.slotfile import BadSlotFile, KVLayout, build, parse_header, read_header, read_layout


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


def kv_block(n_stream, with_cells_in, cells, cell_bytes=12, v_trans=0, n_layer=3, k_type=1):
    """The first KV cache block as llama_kv_cache::state_write lays it out."""
    out = struct.pack("<I", n_stream)
    for i in range(n_stream):
        if i != with_cells_in:
            out += struct.pack("<I", 0)
            continue
        out += struct.pack("<I", cells)
        for c in range(cells):  # pos, n_seq_id = 1, [ext], seq_id
            out += struct.pack("<ii", c, 1) + b"\x07" * (cell_bytes - 12) + struct.pack("<i", i)
        out += struct.pack("<IIIIiQ", v_trans, n_layer, 0, 0, k_type, 512) + b"\0" * (cells * 512)
    return out


@pytest.mark.parametrize("n_stream, slot, cell_bytes", [(1, 0, 12), (4, 1, 12), (4, 3, 12), (1, 0, 24)])
def test_reads_the_kv_layout_that_decides_loadability(tmp_path, n_stream, slot, cell_bytes):
    p = tmp_path / "a.bin"
    p.write_bytes(build([5, 6, 7]) + kv_block(n_stream, slot, 3, cell_bytes, v_trans=1, n_layer=18, k_type=8))
    layout = read_layout(p)
    assert layout == KVLayout(n_stream, 1, 18, 8) and layout.fingerprint() == f"s{n_stream}-v1-l18-k8"


def test_an_empty_slots_file_tells_only_its_stream_count(tmp_path):
    p = tmp_path / "probe.bin"
    p.write_bytes(build([]) + kv_block(4, -1, 0))
    assert read_layout(p) == KVLayout(4)
    assert KVLayout(4).compatible(KVLayout(4, 0, 3, 1)) and not KVLayout(1).compatible(KVLayout(4))
    assert not KVLayout(1, 0, 3, 1).compatible(KVLayout(1, 0, 3, 8))  # another K cache type


@pytest.mark.parametrize("tokens", [[], [5], list(range(1, 3000)), [7, 8, -1, 9], [-1], [0xFFFF, 0xFF00, 3, -1, 4],
                                    [-256, 255, 1]])
def test_a_headers_encoded_tokens_are_its_tokens_encoded_up_to_the_first_media_placeholder(tmp_path, tokens):
    """SlotHeader.encoded: the file's own bytes, as index.encode(index.comparable(tokens)) has
    them, also where a token's bytes and the next one's hold 0xFF bytes side by side."""
    from autosessd.store.slotfile import comparable, encode

    path = tmp_path / "s.bin"
    path.write_bytes(slotfile.build(tokens, b"state"))
    header = slotfile.read_header(path)
    assert header.raw is not None
    assert header.encoded() == encode(comparable(header.tokens)) == encode(comparable(tokens))
    assert slotfile.SlotHeader(tuple(tokens)).encoded() == encode(comparable(tokens))  # not read from a file
