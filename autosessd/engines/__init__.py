"""The engine's side: adapters behind one protocol (base.py, Engine, and the errors it raises):
llama-server's HTTP slots API (llama_server.py, whose slot save writes the KV state a save
sends for) and the control stream for other engines (control_stream.py); the wire they use
(upstream.py, the one HTTP pool to the engine, shared with the gate; http1.py; keepalive.py);
the engine's process (process.py) or the engine as autosessd's child (child.py); and the
facts read from a model's GGUF file (gguf.py). Knows nothing of sessions or the store.
May import: base."""

from __future__ import annotations

from ..base.config import Config
from .upstream import Upstream
from .base import Engine, EngineError  # noqa: F401  (re-exported)
from .control_stream import ControlStream
from .llama_server import LlamaServer


def make_engine(cfg: Config, pool: Upstream | None = None) -> Engine:
    """pool: the engine's HTTP pool (llama-server), shared with the gate."""
    e = cfg.engine
    if e.kind == "control-stream":
        assert e.control is not None  # config validation guarantees it
        return ControlStream(e.control, cfg.slot_save_path, e.timeout_s)
    return LlamaServer(e.url, e.api_key, e.timeout_s, pool)
