"""The engine's process, when it runs on this host and is ours to read: who listens on its
port (a restart is another process there: watch.py) and with what command line (its
--sleep-idle-seconds, --cache-ram, -np and the like: sleep.py, checks.py, doctor.py), and
which of its settings change the KV bytes of the same tokens (kv_flags: part of the model's
fingerprint, so that no file or block computed under one is read under another)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import psutil


def engine_identity(kind: str, url: str) -> tuple[int, float] | None:
    """(pid, start time) of the process listening on the engine's port, when it runs on this
    host and is visible to us; None otherwise. Blocking (psutil)."""
    u = urlsplit(url)
    if kind != "llama-server" or u.hostname not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        return None
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid, psutil.Process(c.pid).create_time()
    except (psutil.Error, OSError):
        return None
    return None


def engine_command(kind: str, url: str) -> tuple[list[str], dict[str, str]] | None:
    """(argv, environment) of the process listening on the engine's port, when it runs on this
    host and is ours to read; None otherwise (the environment {} when only it is hidden).
    Blocking (psutil)."""
    ident = engine_identity(kind, url)
    if ident is None:
        return None
    try:
        p = psutil.Process(ident[0])
        args = p.cmdline()
    except (psutil.Error, OSError):
        return None
    try:
        env = p.environ()
    except (psutil.Error, OSError):
        env = {}
    return args, env


# Options of llama-server b11434 (common/arg.cpp) that change the K/V the engine computes for the
# same tokens of the same model: K is stored after RoPE (src/models/llama.cpp: ggml_rope_ext before
# build_attn), so every RoPE/YaRN parameter changes it; LoRA adapters change the projections that
# make K and V; a control vector changes the residual stream every later layer reads; a metadata
# override can change any of those. → the number of values each takes.
KV_FLAGS = {"--lora": 1, "--lora-scaled": 1, "--lora-init-without-apply": 0, "--control-vector": 1,
            "--control-vector-scaled": 1, "--control-vector-layer-range": 2, "--rope-scaling": 1, "--rope-scale": 1,
            "--rope-freq-base": 1, "--rope-freq-scale": 1, "--yarn-orig-ctx": 1, "--yarn-ext-factor": 1,
            "--yarn-attn-factor": 1, "--yarn-beta-slow": 1, "--yarn-beta-fast": 1, "--override-kv": 1}
KV_ENV = ("ROPE", "YARN", "LORA", "CONTROL_VECTOR", "OVERRIDE_KV")  # in LLAMA_ARG_* names
_FILE_VALUED = ("--lora", "--lora-scaled", "--control-vector", "--control-vector-scaled")


def kv_flags(argv: list[str], env: dict[str, str] | None = None) -> tuple[str, ...]:
    """The settings of an engine's command line and LLAMA_ARG_* environment that change the KV
    bytes (KV_FLAGS), as "flag=value" strings in a stable order; a file they name (an adapter,
    a control vector) by its base name and size, so that the same file anywhere is the same
    setting and another file under the same name is not."""
    out = []
    i = 1 if argv and not argv[0].startswith("-") else 0  # the program's path (a router's args may lack it)
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if name.startswith("--"):
            name = name.replace("_", "-")
        n = KV_FLAGS.get(name)
        if n is None:
            i += 1
            continue
        values = [value] if eq else argv[i + 1:i + 1 + n]
        i += 1 + (0 if eq else n)
        if name in _FILE_VALUED:
            values = [_file_id(v) for v in values]
        if name in ("--lora-scaled", "--control-vector-scaled") and not eq and values and ":" not in values[0] \
                and i < len(argv):
            values.append(argv[i])  # the older form: FNAME SCALE
            i += 1
        out.append(f"{name}={' '.join(values)}" if values else name)
    for k, v in sorted((env or {}).items()):
        if k.startswith("LLAMA_ARG_") and any(w in k for w in KV_ENV):
            out.append(f"{k}={v}")
    return tuple(sorted(out))


def _file_id(value: str) -> str:
    """A file-valued option's value (FNAME, or FNAME:SCALE,… lists) with each file named by its
    base name and size."""
    parts = []
    for item in value.split(","):
        path, colon, scale = item.partition(":")
        try:
            size = os.stat(path).st_size
        except OSError:
            size = None
        parts.append(f"{os.path.basename(path)}[{size if size is not None else '?'}]{colon}{scale}")
    return ",".join(parts)
