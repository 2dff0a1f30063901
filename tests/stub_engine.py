"""An in-process engine for tests that need sessions but not a process: writes real files
in llama-server's layout (autosessd/store/slotfile.py), the token ids standing for a conversation.

Like llama-server: GET /slots shows each slot's token count and the id of the last task that
ran on it (ids from one counter across slots); a failed restore clears the slot; with
`clears_idle` (a unified KV cache with --cache-idle-slots) a request starting on one slot
empties every idle slot; a chat body's tokens come from a template then a tokenizer, and a
request keeps what the slot shares with its prompt (chat(), prefill()). Unlike it: slot
actions never wait for a request (tests call ran() or chat() between them); `no_room` makes
restores fail for lack of KV room until a slot is erased; the template is a toy
(`<role>text<end>` per message) and a token is one character (BOS = 2), so a test can say
how many tokens a text is; there is no sliding window."""

from autosessd.base.config import parse
from autosessd.sessions.facade import Sessions
from autosessd.store import slotfile
from autosessd.store.directory import Store
from autosessd.engines.base import (EngineInfo, EngineRefused, PrefillResult, RestoreResult, SaveResult, SlotState,
                                    SlotsHidden)

BOS = 2


def template(body: dict) -> str:
    """The toy chat template: tools first, then each message, then the turn the model writes."""
    tools = "".join(f"<tool>{t}<end>" for t in body.get("tools") or [])
    return tools + "".join(f"<{m['role']}>{m['content']}<end>" for m in body["messages"]) + "<assistant>"


def tokenize(text: str) -> list[int]:
    return [BOS] + [ord(c) for c in text]


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class StubEngine:
    kind = "llama-server"
    address = "http://stub"
    magic = b"qsgg"

    def __init__(self, directory, model="stub-model", slots_visible=True, n_slots=1, clears_idle=False, kv=False):
        """kv: its files carry a KV section in llama-server's layout (kv_common.slot_file: two
        layers, 64-byte rows), so that the block store cuts them; otherwise zeros, kept whole."""
        self.kv = kv
        self.dir = directory
        self.model = model
        self.held: dict[int, list[int]] = {i: [] for i in range(n_slots)}
        self.task_ids: dict[int, int | None] = {i: None for i in range(n_slots)}
        self.processing = False
        self.saves: list[str] = []
        self.slots_visible = slots_visible
        self.clears_idle = clears_idle
        self.no_room = False
        self.erased: list[int] = []
        self._tasks = 0
        self.n_cached: int | None = None  # slot 0's running request: prompt tokens reused (shown while processing)

    # slot 0, for the single-slot tests
    @property
    def tokens(self) -> list[int]:
        return self.held[0]

    @property
    def task_id(self) -> int | None:
        return self.task_ids[0]

    @task_id.setter
    def task_id(self, value: int | None) -> None:
        self.task_ids[0] = value

    def restart(self) -> None:
        """A new engine process: every slot empty, and task ids start over (b11434: the last
        task before a restart was 16, the first after it 5; GET /slots takes ids too)."""
        self.held = {i: [] for i in self.held}
        self.task_ids = {i: None for i in self.held}
        self.processing, self.n_cached, self._tasks = False, None, 0

    def ran(self, tokens, slot: int = 0) -> None:
        """A request ran on the slot and left these tokens (a count: tokens 1..n)."""
        self._tasks += 1
        self.task_ids[slot] = self._tasks
        if self.clears_idle:
            for other in self.held:
                if other != slot:
                    self.held[other] = []
        self.held[slot] = list(range(1, tokens + 1)) if isinstance(tokens, int) else list(tokens)

    async def save(self, slot, name):
        if self.kv and self.held[slot]:
            from kv_common import slot_file

            data = slot_file(self.held[slot], n_layer=2, k_row=64, v_row=64)
        else:
            data = slotfile.build(self.held[slot], b"\0" * (len(self.held[slot]) * 10))
        (self.dir / name).write_bytes(data)
        self.saves.append(name)
        return SaveResult(len(self.held[slot]), len(data), 1.0)

    async def restore(self, slot, name):
        try:
            header = slotfile.read_header(self.dir / name)
        except (FileNotFoundError, slotfile.BadSlotFile):
            self.held[slot] = []
            raise EngineRefused("failed to open file") from None
        if self.no_room:
            self.held[slot] = []
            raise EngineRefused("POST /slots answered 400: Unable to restore slot: No available space in KV cache "
                                "or invalid slot save file")
        self.held[slot] = list(header.tokens)
        return RestoreResult(len(self.held[slot]), (self.dir / name).stat().st_size, 1.0)

    async def erase(self, slot):
        n, self.held[slot] = len(self.held[slot]), []
        self.erased.append(slot)
        self.no_room = False
        return n

    # -- the chat side (issue 11) --------------------------------------------------------
    tokenize_calls = 0
    tokenize_fails = False

    async def apply_template(self, body, timeout_s=None):
        if not isinstance(body.get("messages"), list):
            raise EngineRefused("POST /apply-template answered 400: messages must be a list")
        return template(body)

    async def tokenize(self, text, timeout_s=None):
        self.tokenize_calls += 1
        if self.tokenize_fails:
            raise EngineRefused("POST /tokenize answered 500: stub told to fail")
        return tokenize(text)

    async def tokenize_pieces(self, text, timeout_s=None):
        return [(BOS, b"")] + [(ord(c), c.encode()) for c in text]

    async def prompt_tokens(self, body, timeout_s=None):
        return await self.tokenize(await self.apply_template(body))

    async def detokenize(self, tokens, timeout_s=None):
        return ("<bos>" if tokens and tokens[0] == BOS else "") + "".join(chr(t) for t in tokens if t > BOS)

    def chat(self, body: dict, reply: str) -> tuple[int, int]:
        """A chat request runs: the slot keeps what it shares with the prompt, reads the rest,
        then holds the prompt and the reply. Returns (cache_n, n_prompt) as the response says."""
        prompt = tokenize(template(body))
        cache_n = min(lcp(self.tokens, prompt), len(prompt) - 1)
        self.ran(prompt + [ord(c) for c in reply])
        return cache_n, len(prompt)

    prefills: list = []

    async def prefill(self, slot, tokens):
        cache_n = min(lcp(self.held[slot], tokens), len(tokens) - 1)
        self.ran(list(tokens), slot)
        self.prefills = [*self.prefills, list(tokens)]
        return PrefillResult(cache_n, len(tokens) - cache_n, 1.0)

    async def slots(self):
        if not self.slots_visible:
            raise SlotsHidden("GET /slots is off")
        return [SlotState(i, self.processing and i == 0, len(self.held[i]),
                          self.n_cached if self.processing and i == 0 else None, self.task_ids[i])
                for i in sorted(self.held)]

    async def health(self):
        return True

    async def info(self):
        return EngineInfo(self.model, self.model, len(self.held))

    async def close(self):
        pass


def stub_sessions(tmp_path, *, n_slots=1, min_tokens=10, clears_idle=False, config=""):
    """Sessions on a StubEngine saving to tmp_path/s, as the tails' state tests build them:
    (sessions, its config, the session directory). `config` is more TOML after the top keys."""
    d = tmp_path / "s"
    d.mkdir(parents=True, exist_ok=True)
    cfg = parse(f'slot_save_path = "{d}"\nauto_sessions_min_tokens = {min_tokens}\n'
                f'state_dir = "{tmp_path / "state"}"\n{config}'.encode())
    s = Sessions(cfg, StubEngine(d, n_slots=n_slots, clears_idle=clears_idle), Store(d), "stub-model",
                 n_slots=n_slots, empties_idle_slots=clears_idle)
    return s, cfg, d
