"""One Engine protocol for every engine autosessd drives, and the errors it raises.

Save and restore take a bare file name inside the session directory; the engine
adapter turns it into whatever its engine wants (llama-server: the name, relative to
its --slot-save-path; the control stream: an absolute path). Every failure is an
EngineError whose message says what went wrong in words a user can act on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SaveResult:
    n_tokens: int
    n_bytes: int
    ms: float


@dataclass(frozen=True)
class RestoreResult:
    n_tokens: int
    n_bytes: int
    ms: float


@dataclass(frozen=True)
class PrefillResult:
    cache_n: int  # tokens the slot already held
    prompt_n: int  # tokens read
    ms: float


@dataclass(frozen=True)
class SlotState:
    id: int
    is_processing: bool
    n_tokens: int  # tokens the slot holds now (0 when it never ran a task)
    n_cached: int | None = None  # of the running request's prompt, tokens reused (llama-server resets it at the end)
    task_id: int | None = None  # the engine's id of the slot's running or last task: a new one means a request ran
    # Of the running request's prompt, tokens read so far: 0 with n_cached 0 while it has not
    # begun (llama-server resets both when it takes the task, and sets them as its prompt starts).
    n_processed: int | None = None


@dataclass(frozen=True)
class EngineInfo:
    model: str  # fingerprint: equal for the same model file, different otherwise
    model_name: str
    total_slots: int
    model_path: str = ""  # where the engine loaded its model from (llama-server /props), when it says
    n_ctx: int | None = None  # tokens one slot can hold (llama-server /props default_generation_settings.n_ctx)
    router: bool = False  # llama-server in router mode: models behind it, none of its own (models.py)
    max_loaded: int | None = None  # a router's --models-max (None: no limit)
    # The chat template's identity (a digest of /props chat_template): the same messages give
    # the same tokens only under the same template (keys.chain's seed). "": not known.
    template: str = ""
    # What changes the KV bytes of the same tokens beside the weights (RoPE/YaRN, LoRA, control
    # vectors: process.kv_flags), in the fingerprint when there is any. None: the engine's command
    # line could not be read (a remote engine, another user's, a container): not known.
    kv_settings: tuple[str, ...] | None = ()


class EngineError(Exception):
    """Any failure talking to the engine."""


class EngineUnreachable(EngineError):
    pass


class EngineTimeout(EngineError):
    pass


class SlotSavingOff(EngineError):
    pass


class SlotsHidden(EngineError):
    """The engine does not show its slots (llama-server --no-slots): what they hold cannot be read."""


class EngineRefused(EngineError):
    """The engine answered with an error (400, 500, ERR ...)."""


class EngineLacks(EngineRefused):
    """The engine has no such endpoint (a 404 "Not Found"): asking again will not help."""


class EngineBadAnswer(EngineError):
    """The engine answered something that is not what its protocol promises."""


@runtime_checkable
class Engine(Protocol):
    kind: str
    address: str  # for messages: the URL or control address
    magic: bytes | None  # the first bytes of every state file it writes, when known

    async def save(self, slot: int, name: str) -> SaveResult: ...

    async def restore(self, slot: int, name: str) -> RestoreResult: ...

    async def erase(self, slot: int) -> int:
        """Empty a slot (its state is not saved); the tokens it held. EngineRefused when the
        engine cannot."""
        ...

    async def slots(self) -> list[SlotState]: ...

    async def health(self) -> bool:
        """True when the engine is up and has its model loaded."""
        ...

    async def info(self) -> EngineInfo: ...

    async def close(self) -> None: ...


@runtime_checkable
class ChatEngine(Engine, Protocol):
    """An engine that can also say what a chat request's tokens are and read a prompt into a
    slot (llama-server). What autosessd does with it: tokens choose the file to restore
    (turn.py), a shared prefix is read and saved on its own (prefix.py), the primer fills an
    emptied slot (launch.py), `ls` shows a file's first words (report.py), the start's probe
    of idle-slot clearing (daemon.py). An engine without it (the control stream) follows the
    key rule: sessions/facade.py asks `isinstance(engine, ChatEngine)` once."""

    async def apply_template(self, body: dict, timeout_s: float | None = None) -> str:
        """The text a chat request is prompted with, from the engine's own template."""
        ...

    async def tokenize(self, text: str, timeout_s: float | None = None) -> list[int]:
        """`text` as the chat path tokenizes a prompt (special tokens added and parsed)."""
        ...

    async def tokenize_pieces(self, text: str, timeout_s: float | None = None) -> list[tuple[int, bytes]]:
        """tokenize(), each token with its text (autosessctl doctor maps a token to a message)."""
        ...

    async def prompt_tokens(self, body: dict, timeout_s: float | None = None) -> list[int]:
        """The exact tokens a chat request would be prompted with, without running it."""
        ...

    async def detokenize(self, tokens: list[int], timeout_s: float | None = None) -> str: ...

    async def prefill(self, slot: int, tokens: list[int]) -> PrefillResult:
        """Read `tokens` into the slot and stop there (a start like any request)."""
        ...

