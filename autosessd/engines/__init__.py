"""Engine adapters behind one protocol (base.Engine)."""

from __future__ import annotations

from ..config import Config
from ..upstream import Upstream
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
