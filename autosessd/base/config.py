"""Configuration: one frozen Config, parsed from TOML bytes and overridden by flags.

Defaults live in one place (the dataclass fields). `parse()` takes bytes, so tests feed
strings, not files; `load()` finds the file (DESIGN §6 search order) and reads it. Every
error names the file, the key and the reason, and is raised as ConfigError (exit 2).
A reload builds and validates a whole new Config before anything swaps it in.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

from .files import read_small
from .shared_config import SharedConfig, validate_shared

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

ENGINE_KINDS = ("llama-server", "control-stream")
AUTO = "auto"
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(Exception):
    """A config that cannot be used: says which file, which key and why."""

    def __init__(self, source: str, key: str | None, reason: str):
        self.source, self.key, self.reason = source, key, reason
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class EngineConfig:
    kind: str = "llama-server"
    url: str = "http://127.0.0.1:8080"
    slot: int = 0
    api_key: str | None = None
    timeout_s: float = 120.0
    control: str | None = None  # control-stream address: unix:/path or tcp:host:port
    # The model's sliding attention window in tokens (n_swa; Gemma 3 27B: 1,024): after a restore the
    # engine reuses a file only if it holds fewer tokens than this past the prefix it shares
    # with the prompt. None: read it from the model file the engine names (/props model_path,
    # GGUF `<arch>.attention.sliding_window`), none when that cannot be read; 0: no window.
    swa_window: int | None = None
    # llama-server's own log (its --log-file, text or --log-jsonl), followed to save behind
    # each request and restore after an engine restart with no proxy in front (enginetail.py).
    log: str | None = None
    # llama-server's --sleep-idle-seconds: its conversations are saved before it sleeps
    # (sleep.py). None: read from its command line where autosessd sees it (a router's
    # models, the --exec child, a local engine's process); 0: the engine does not sleep.
    sleep_idle_s: float | None = None


@dataclass(frozen=True)
class GateConfig:
    # HOST:PORT, or a list of them (a TOML string or array; llama-server likewise takes
    # --host 127.0.0.1,::1), e.g. ["127.0.0.1:8081", "[::1]:8081"]; None = no gate.
    listen: tuple[str, ...] | None = None
    request_log: str | None = None
    # A request is read whole before the FIFO (its conversation key is in the body). 64 MB
    # covers a chat with images: OpenAI caps a request's images at 50 MB in all, and a
    # base64 image is 4/3 of its file.
    max_body_mb: float = 64.0
    # While the gate listens on loopback only, a request whose Host is not a loopback name
    # or address, nor one of these, is refused (403): a web page reaching it through DNS
    # rebinding. A reverse proxy in front of the gate with its own name lists that name.
    allowed_hosts: tuple[str, ...] | None = None
    # Open client connections at most (more are answered 503 and closed); None: what the
    # process's descriptor limit allows (each request through the gate holds two).
    max_connections: int | None = None
    # Seconds a connection may take to send a request's headers, and stay idle between two.
    header_timeout_s: float = 30.0
    # A streaming request that waits this long (its slot's FIFO, a restore, the engine's first
    # byte) gets the gate's own 200 and an SSE comment `: ping` this often (keepalive.py), so
    # clients and proxies with idle timeouts keep it; 0: never.
    keepalive_s: float = 3.0
    # Request headers that name a conversation (the client's own id), tried in order before its
    # first user message: X-Conversation-Id, which llama-server's web UI sends. Behind SMG add
    # X-SMG-Routing-Key, the one such header SMG passes on (docs/several-hosts.md). A header
    # listed here must carry one value per conversation: one that names a user (several
    # conversations) would make them one conversation for autosessd.
    conversation_id_headers: tuple[str, ...] = ("X-Conversation-Id",)


@dataclass(frozen=True)
class TailConfig:
    request_log: str | None = None


@dataclass(frozen=True)
class ControlConfig:
    socket: str | None = None  # None = the default path (see default_socket_path)
    group: str | None = None


@dataclass(frozen=True)
class Config:
    slot_save_path: str = ""
    # The store (issue 39): where saves are kept durable, as token blocks with a manifest each
    # (store_blocks) or as whole files. None: slot_save_path itself. Set it to a directory on
    # disk when slot_save_path, the engine's, is on tmpfs (staging): the engine's whole-file
    # writes then never reach the disk, only the blocks a save adds do.
    store_path: str | None = None
    # Keep each save as blocks of token KV (shared prompts held once, a save writing about
    # its new tokens) where the engine's file allows it; false: whole files, as before.
    store_blocks: bool = True
    # Copies kept in staging for a quick return (the engine's own file of a conversation kept
    # as blocks), the least recently used going first: "auto" = 10% of the machine's memory.
    staging_max_gb: float | str = AUTO
    auto_sessions: bool = True
    # "auto": save a conversation when re-reading it would cost more than saving and restoring
    # it, by the engine's measured rates (savings.py, policy.auto_min_tokens); a number overrides.
    auto_sessions_min_tokens: int | str = AUTO
    auto_sessions_keep: int = 12
    auto_sessions_max_gb: float = 100.0
    state_dir: str | None = None  # where the daemon remembers the held key and tail offsets
    # A stop (SIGTERM) ends within this, whatever hangs: requests in flight, the stop save,
    # the last writes. Below systemd's TimeoutStopSec (15 min in the shipped unit), so the
    # daemon says what it gave up on instead of being killed.
    stop_timeout_s: float = 300.0
    # Save while idle (idle.py): after a reply through the gate, once the slot stays idle this
    # many seconds, its conversation is saved behind if its file lacks idle_save_min_new_tokens
    # of it, so that a switch finds the file up to date and only restores. 0: off. Idle saves
    # write at most idle_save_mb_per_min in any minute.
    idle_save_s: float = 3.0
    idle_save_min_new_tokens: int = 1
    idle_save_mb_per_min: float = 4096.0
    # ... and only on a slot that switched conversations within this many seconds: one
    # conversation going on alone is never switched away, and saving it after every reply
    # would write its whole state each turn for nothing (2 GB a turn at 16k tokens of an 8B
    # model; README "Write volume"). 0: after every reply, switched or not.
    idle_save_switched_s: float = 1800.0
    # At a start without the gate (the tails, the hook), when the engine's slots are empty:
    # each slot's last conversation restored while the engine is idle (comeback.py).
    restore_at_start: bool = True
    engine: EngineConfig = field(default_factory=EngineConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    tail: TailConfig = field(default_factory=TailConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    shared: SharedConfig | None = None  # None: no [shared] table, no remote tier
    source: str = "<defaults>"  # the file it came from, for messages

    def masked(self) -> dict[str, Any]:
        """The effective config as a dict, for printing: the api key never shown."""
        d = dataclasses.asdict(self)
        if d["engine"]["api_key"]:
            d["engine"]["api_key"] = "***"
        return d

    def effective_store(self) -> Path:
        """Where saves are kept durable: store_path, else slot_save_path itself."""
        return Path(self.store_path or self.slot_save_path)

    def hot_budget(self) -> int:
        """Bytes of copies kept in staging (staging_max_gb; "auto": 10% of the memory)."""
        if self.staging_max_gb == AUTO:
            import psutil

            return psutil.virtual_memory().total // 10
        return int(float(self.staging_max_gb) * 1e9)

    def effective_state_dir(self) -> Path:
        if self.state_dir:
            return Path(self.state_dir)
        if os.geteuid() == 0:
            return Path("/var/lib/autosessd")
        base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local/state")
        return Path(base) / "autosessd"

    def effective_socket(self) -> Path:
        return Path(self.control.socket) if self.control.socket else default_socket_path()


def tmpfs_staging(cfg: Config, shm: str = "/dev/shm") -> Config:
    """--exec (issue 39): the engine autosessd starts writes its saves to a staging directory on
    tmpfs, and slot_save_path becomes the store on disk, where only the blocks a save adds are
    written. Only where store_path is not set (then the user chose) and `shm` is a tmpfs; the
    directory is the user's own (0700), one per store."""
    if cfg.store_path is not None or not _is_tmpfs(shm):
        return cfg
    import hashlib

    tag = hashlib.sha1(os.path.realpath(cfg.slot_save_path).encode()).hexdigest()[:12]
    staging = os.path.join(shm, f"autosessd-{os.getuid()}", tag)
    return dataclasses.replace(cfg, store_path=cfg.slot_save_path, slot_save_path=staging)


def _is_tmpfs(path: str) -> bool:
    try:
        with open("/proc/mounts") as f:
            return any(len(p) > 2 and p[1] == path and p[2] == "tmpfs" for p in (line.split() for line in f))
    except OSError:
        return False


def default_socket_path() -> Path:
    if os.geteuid() == 0:
        return Path("/run/autosessd/autosessd.sock")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "autosessd" / "autosessd.sock"
    return Path(f"/tmp/autosessd-{os.getuid()}") / "autosessd.sock"


_SECTIONS = {"engine": EngineConfig, "gate": GateConfig, "tail": TailConfig, "control": ControlConfig,
             "shared": SharedConfig}
_SECRET_KEYS = {"access_key", "access_key_id", "aws_access_key_id", "secret_key", "secret_access_key",
                "aws_secret_access_key", "session_token", "aws_session_token", "password", "secret"}
_HOSTPORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]+):(\d{1,5})$")


def search_paths(explicit: str | None = None) -> list[Path]:
    """DESIGN §6 order: --config, $AUTOSESSD_CONFIG, $XDG_CONFIG_HOME, /etc."""
    if explicit:
        return [Path(explicit)]
    if os.environ.get("AUTOSESSD_CONFIG"):
        return [Path(os.environ["AUTOSESSD_CONFIG"])]
    xdg = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return [Path(xdg) / "autosessd" / "autosessd.toml", Path("/etc/autosessd/autosessd.toml")]


def load(explicit: str | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Find and read the config file, apply flag overrides, validate.

    An explicitly named file (flag or environment) must exist; the default locations
    may be absent, in which case defaults plus flags are used.
    """
    paths = search_paths(explicit)
    must_exist = bool(explicit or os.environ.get("AUTOSESSD_CONFIG"))
    for path in paths:
        try:
            data = read_small(path)
        except FileNotFoundError:
            if must_exist:
                raise ConfigError(str(path), None, "no such file") from None
            continue
        except OSError as e:
            raise ConfigError(str(path), None, f"cannot read: {e.strerror or e}") from None
        return parse(data, str(path), overrides)
    return parse(b"", "<no config file>", overrides)


def parse(data: bytes, source: str = "<string>", overrides: Mapping[str, Any] | None = None) -> Config:
    """Parse TOML bytes, then apply overrides ({"engine.url": ..., "auto_sessions_keep": ...})."""
    try:
        raw = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(source, None, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(source, None, f"not valid TOML: {e}") from None
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, key = dotted.rpartition(".")
        target = raw.setdefault(section, {}) if section else raw
        target[key] = value
    return _build(raw, source)


def _build(raw: dict[str, Any], source: str) -> Config:
    top: dict[str, Any] = {}
    top_fields = {f.name: f for f in dataclasses.fields(Config) if f.name not in _SECTIONS and f.name != "source"}
    for key, value in raw.items():
        if key in _SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(source, key, f"must be a table ([{key}]), got {_typename(value)}")
            top[key] = _build_section(_SECTIONS[key], key, value, source)
        elif key == "auto_sessions_min_tokens":
            top[key] = min_tokens_value(value, source)
        elif key == "staging_max_gb":
            top[key] = staging_value(value, source)
        elif key in top_fields:
            top[key] = _coerce(top_fields[key], key, value, source)
        else:
            raise ConfigError(source, key, f"unknown key (known: {', '.join(sorted([*top_fields, *_SECTIONS]))})")
    cfg = Config(source=source, **top)
    _validate(cfg, source)
    return cfg


def _build_section(cls: type, name: str, raw: dict[str, Any], source: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in raw.items():
        if name == "shared" and key in _SECRET_KEYS:
            raise ConfigError(source, f"{name}.{key}", "credentials never go in the config file: set AWS_ACCESS_KEY_ID "
                                                       "and AWS_SECRET_ACCESS_KEY in the environment, or name a file "
                                                       "with credentials_file")
        if key not in fields:
            raise ConfigError(source, f"{name}.{key}", f"unknown key (known in [{name}]: {', '.join(fields)})")
        values[key] = _coerce(fields[key], f"{name}.{key}", value, source)
    return cls(**values)


def _coerce(f: dataclasses.Field, key: str, value: Any, source: str) -> Any:
    """Check a value against its field's type. Ints are accepted for floats, never bools for numbers."""
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    optional = "None" in t
    base = t.replace("| None", "").strip()
    if value is None and optional:
        return None
    if base == "bool":
        if isinstance(value, bool):
            return value
        raise ConfigError(source, key, f"must be true or false, got {_typename(value)} {value!r}")
    if base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(source, key, f"must be a whole number, got {_typename(value)} {value!r}")
    if base == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(source, key, f"must be a number, got {_typename(value)} {value!r}")
    if base == "str":
        if isinstance(value, str):
            return value
        raise ConfigError(source, key, f"must be a string, got {_typename(value)} {value!r}")
    if base == "tuple[str, ...]":  # one string or a list of strings
        if isinstance(value, str):
            return (value,)
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(source, key, f"must be a string or a non-empty list of strings, got "
                                       f"{_typename(value)} {value!r}")
    raise AssertionError(f"unhandled field type {t}")  # a programming error, not a user one


def min_tokens_value(value: Any, source: str = "--min-tokens") -> int | str:
    """auto_sessions_min_tokens: "auto" or a whole number of 0 or more (a flag's text too)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if value == AUTO:
        return AUTO
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ConfigError(source, "auto_sessions_min_tokens", f'must be "auto" or a whole number of 0 or more, got '
                                                         f"{_typename(value)} {value!r}")


def staging_value(value: Any, source: str = "--staging-max-gb") -> float | str:
    """staging_max_gb: "auto" or a number of GB, 0 or more."""
    if isinstance(value, str):
        try:
            value = AUTO if value.strip() == AUTO else float(value)
        except ValueError:
            pass
    if value == AUTO:
        return AUTO
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    raise ConfigError(source, "staging_max_gb", f'must be "auto" or a number of GB, 0 or more, got '
                                                f"{_typename(value)} {value!r}")


def _typename(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "table"}.get(
        type(v), type(v).__name__
    )


def _validate(c: Config, source: str) -> None:
    def bad(key: str, reason: str) -> None:
        raise ConfigError(source, key, reason)

    if not c.slot_save_path:
        bad("slot_save_path", "missing: set it to the directory the engine saves into (its --slot-save-path)")
    if not os.path.isabs(c.slot_save_path):
        bad("slot_save_path", f"must be an absolute path, got {c.slot_save_path!r}")
    if c.auto_sessions_keep < 1:
        bad("auto_sessions_keep", f"must be 1 or more, got {c.auto_sessions_keep}")
    if not c.auto_sessions_max_gb > 0:
        bad("auto_sessions_max_gb", f"must be more than 0, got {c.auto_sessions_max_gb}")
    if not c.stop_timeout_s > 0:
        bad("stop_timeout_s", f"must be more than 0, got {c.stop_timeout_s}")
    if c.idle_save_s < 0:
        bad("idle_save_s", f"must be 0 (off) or more (seconds), got {c.idle_save_s}")
    if c.idle_save_min_new_tokens < 1:
        bad("idle_save_min_new_tokens", f"must be 1 or more, got {c.idle_save_min_new_tokens}")
    if not c.idle_save_mb_per_min > 0:
        bad("idle_save_mb_per_min", f"must be more than 0, got {c.idle_save_mb_per_min}")
    if c.idle_save_switched_s < 0:
        bad("idle_save_switched_s", f"must be 0 (always) or more (seconds), got {c.idle_save_switched_s}")
    if c.state_dir is not None and not os.path.isabs(c.state_dir):
        bad("state_dir", f"must be an absolute path, got {c.state_dir!r}")
    if c.store_path is not None and not os.path.isabs(c.store_path):
        bad("store_path", f"must be an absolute path, got {c.store_path!r}")

    e = c.engine
    if e.kind not in ENGINE_KINDS:
        bad("engine.kind", f"must be one of {', '.join(ENGINE_KINDS)}, got {e.kind!r}")
    parts = urlsplit(e.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        bad("engine.url", f"must be an http:// or https:// URL with a host, got {e.url!r}")
    try:
        _ = parts.port  # urlsplit checks the port only when asked
    except ValueError:
        bad("engine.url", f"has an invalid port: {e.url!r}")
    if e.slot < 0:
        bad("engine.slot", f"must be 0 or more, got {e.slot}")
    if e.sleep_idle_s is not None and e.sleep_idle_s < 0:
        bad("engine.sleep_idle_s", f"must be 0 (the engine does not sleep) or more seconds, got {e.sleep_idle_s}")
    if e.swa_window is not None and e.swa_window < 0:
        bad("engine.swa_window", f"must be 0 (no sliding window) or more, got {e.swa_window}")
    if not e.timeout_s > 0:
        bad("engine.timeout_s", f"must be more than 0, got {e.timeout_s}")
    if e.kind == "control-stream" and not e.control:
        bad("engine.control", "required when engine.kind is control-stream (unix:/path or tcp:host:port)")
    if e.control is not None:
        try:
            parse_address(e.control)
        except ValueError as err:
            bad("engine.control", str(err))

    if c.gate.keepalive_s < 0:
        bad("gate.keepalive_s", f"must be 0 (no keepalives) or more, got {c.gate.keepalive_s}")
    if not c.gate.max_body_mb > 0:
        bad("gate.max_body_mb", f"must be more than 0, got {c.gate.max_body_mb}")
    if c.gate.max_connections is not None and c.gate.max_connections < 1:
        bad("gate.max_connections", f"must be 1 or more, got {c.gate.max_connections}")
    if not c.gate.header_timeout_s > 0:
        bad("gate.header_timeout_s", f"must be more than 0, got {c.gate.header_timeout_s}")
    for name in c.gate.conversation_id_headers:
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name):
            bad("gate.conversation_id_headers", f"{name!r} is not a header name")
    for host in c.gate.allowed_hosts or ():
        if not host or "/" in host or " " in host:
            bad("gate.allowed_hosts", f"{host!r} is not a host name")
    if c.gate.listen is not None:
        seen = set()
        for address in c.gate.listen:
            try:
                hostport = parse_hostport(address)
            except ValueError as err:
                bad("gate.listen", str(err))
            if hostport in seen:
                bad("gate.listen", f"lists {address} twice")
            seen.add(hostport)
    for key, path in (("gate.request_log", c.gate.request_log), ("tail.request_log", c.tail.request_log),
                      ("control.socket", c.control.socket)):
        if path is not None and not os.path.isabs(path):
            bad(key, f"must be an absolute path, got {path!r}")
    if e.log is not None:
        if not os.path.isabs(e.log):
            bad("engine.log", f"must be an absolute path (llama-server's --log-file), got {e.log!r}")
        if e.kind != "llama-server":
            bad("engine.log", f"is llama-server's own log: engine.kind must be llama-server, got {e.kind!r}")
        if c.gate.listen:
            bad("engine.log", "cannot be followed with the gate on (gate.listen): the gate already runs every "
                              "request's turn, and the engine's log would show them again; use one of the two")
        if c.tail.request_log:
            bad("engine.log", "cannot be followed with a request log (tail.request_log): both would report the "
                              "same requests; use one of the two")
    if c.gate.request_log and c.tail.request_log and c.gate.request_log == c.tail.request_log:
        bad("tail.request_log", "is the gate's own request log; the gate already runs every turn itself")
    if c.control.group is not None:
        import grp

        try:
            grp.getgrnam(c.control.group)
        except KeyError:
            bad("control.group", f"no such group {c.control.group!r}")
    if c.shared is not None:
        validate_shared(c.shared, bad)


def parse_hostport(s: str) -> tuple[str, int]:
    m = _HOSTPORT.match(s)
    if not m:
        raise ValueError(f"must be HOST:PORT, got {s!r}")
    port = int(m.group(2))
    if not 0 < port < 65536:
        raise ValueError(f"port must be 1-65535, got {port}")
    return m.group(1).strip("[]"), port


def parse_address(s: str) -> tuple[str, Any]:
    """`unix:/abs/path` → ("unix", path); `tcp:host:port` → ("tcp", (host, port))."""
    if s.startswith("unix:"):
        path = s[5:]
        if not os.path.isabs(path):
            raise ValueError(f"unix: address needs an absolute path, got {s!r}")
        return "unix", path
    if s.startswith("tcp:"):
        return "tcp", parse_hostport(s[4:])
    raise ValueError(f"must be unix:/path or tcp:host:port, got {s!r}")
