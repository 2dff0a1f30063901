"""Slot files in llama-server's layout with a real KV section (kvfile.py's docstring), written
here for the block store's tests: each cell's bytes a function of its layer, its position and
its token alone, so that the same tokens at the same positions give the same bytes in any
file (as the engine's prompt reads do), and a file's cells in any cache order."""

import struct

import numpy as np

from autosessd.store.slotfile import MAGIC, VERSION


def cell_bytes_of(layer, pos, tok, n, salt=0):
    """n deterministic bytes for one cell's row in one layer."""
    rng = np.random.default_rng(abs(hash((layer, pos, tok, salt))) % (2**32))
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def slot_file(tokens, *, n_layer=3, k_row=16, v_row=16, v_trans=0, n_embd_v=8, el=2, cell_ext=False,
              order=None, n_cells=None, n_stream=1, stream=0, media=False, extra=b"", seq=0, salt=0,
              positions=None):
    """The bytes of a slot file holding `tokens` (the first n_cells with KV; default all), its
    cells written in `order` (a permutation of positions; default 0 … n−1). k_row, v_row and
    n_embd_v: one for every layer, or a list of one per layer."""

    def per(x, layer):
        return x[layer] if isinstance(x, (list, tuple)) else x

    n_tok = len(tokens)
    n = n_tok if n_cells is None else n_cells
    order = list(range(n)) if order is None else list(order)
    pos_of = list(range(n)) if positions is None else list(positions)
    words = [-1, 1, n_tok, *tokens, 1 if media else 0]
    out = bytearray(struct.pack(f"<III{len(words)}i", MAGIC, VERSION, len(words), *words))
    out += struct.pack("<I", n_stream)
    for s in range(n_stream):
        if s != stream:
            if s < stream:
                out += struct.pack("<I", 0)
            continue
        out += struct.pack("<I", n)
        for i in order:
            out += struct.pack("<iI", pos_of[i], 1)
            if cell_ext:
                out += struct.pack("<iii", 0, 0, tokens[i])
            out += struct.pack("<i", seq)
        out += struct.pack("<IIII", v_trans, n_layer, 0, 0)
        for layer in range(n_layer):
            out += struct.pack("<iQ", 1, per(k_row, layer))
            for i in order:
                out += cell_bytes_of(("k", layer), pos_of[i], tokens[i], per(k_row, layer), salt)
        for layer in range(n_layer):
            if v_trans:
                ne = per(n_embd_v, layer)
                out += struct.pack("<iII", 1, el, ne)
                cols = {i: cell_bytes_of(("v", layer), pos_of[i], tokens[i], ne * el, salt) for i in order}
                for j in range(ne):
                    for i in order:
                        out += cols[i][j * el:(j + 1) * el]
            else:
                out += struct.pack("<iQ", 1, per(v_row, layer))
                for i in order:
                    out += cell_bytes_of(("v", layer), pos_of[i], tokens[i], per(v_row, layer), salt)
    out += struct.pack("<I", 0) * (n_stream - stream - 1)
    return bytes(out) + extra


def window_tail(tokens, n_swa, *, n_layer=2, k_row=8, v_row=8, n_stream=1, stream=0, salt=0):
    """A sliding-window model's second cache after the first (llama_kv_cache_iswa::state_write):
    the window layers' cells of the last n_swa positions, in the same layout, its bytes a function
    of position and token alone."""
    n = len(tokens)
    first = max(0, n - n_swa)
    cells = list(range(first, n))
    out = bytearray(struct.pack("<I", n_stream))
    out += struct.pack("<I", 0) * stream
    out += struct.pack("<I", len(cells))
    for p in cells:
        out += struct.pack("<iIi", p, 1, 0)
    out += struct.pack("<IIII", 0, n_layer, 0, 0)
    for layer in range(n_layer):
        out += struct.pack("<iQ", 1, k_row)
        for p in cells:
            out += cell_bytes_of(("wk", layer), p, tokens[p], k_row, salt)
    for layer in range(n_layer):
        out += struct.pack("<iQ", 1, v_row)
        for p in cells:
            out += cell_bytes_of(("wv", layer), p, tokens[p], v_row, salt)
    out += struct.pack("<I", 0) * (n_stream - stream - 1)
    return bytes(out)


def recurrent_tail(tokens, *, n_layer=3, r_row=24, s_row=40, salt=0):
    """A hybrid model's recurrent state after its attention cache (llama_memory_recurrent::
    state_write for one sequence): one cell at the last position, then per layer its rows, the
    bytes a function of every token (a recurrent state depends on all of them)."""
    n = len(tokens)
    out = bytearray(struct.pack("<IiIII", 1, n - 1, 0, 0, n_layer))
    whole = tuple(tokens)
    for layer in range(n_layer):
        out += struct.pack("<iQ", 0, r_row) + cell_bytes_of(("r", layer), n, whole, r_row, salt)
    for layer in range(n_layer):
        out += struct.pack("<iQ", 0, s_row) + cell_bytes_of(("s", layer), n, whole, s_row, salt)
    return bytes(out)


def two_part_file(tokens, kind, *, n_swa=6, n_cells=None, **kw):
    """A slot file of a window model (kind "window") or a hybrid one ("recurrent"): the full-
    attention cache of every position, then its tail."""
    n = len(tokens) if n_cells is None else n_cells
    head = tokens[:n]
    tail = window_tail(head, n_swa, n_stream=kw.get("n_stream", 1), stream=kw.get("stream", 0)) \
        if kind == "window" else recurrent_tail(head)
    return slot_file(tokens, n_cells=n_cells, **kw) + tail, tail
