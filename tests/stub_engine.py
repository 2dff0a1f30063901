"""An in-process engine for tests that need sessions but not a process: writes real files
in llama-server's layout (autosessd/slotfile.py), the token ids standing for a conversation.

Like llama-server: GET /slots shows the slot's token count and the id of the last task that
ran on it; a failed restore clears the slot; a chat body's tokens come from a template then a
tokenizer, and a request keeps what the slot shares with its prompt (chat(), prefill()).
Unlike it: slot actions never wait for a request (tests call ran() or chat() between them);
the template is a toy (`<role>text<end>` per message) and a token is one character (BOS = 2),
so a test can say how many tokens a text is; there is no sliding window."""

from autosessd import slotfile
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

    def __init__(self, directory, model="stub-model", slots_visible=True):
        self.dir = directory
        self.model = model
        self.tokens: list[int] = []
        self.processing = False
        self.task_id: int | None = None
        self.saves: list[str] = []
        self.slots_visible = slots_visible

    def ran(self, tokens) -> None:
        """A request ran on the slot and left these tokens (a count: tokens 1..n)."""
        self.tokens = list(range(1, tokens + 1)) if isinstance(tokens, int) else list(tokens)
        self.task_id = (self.task_id or 0) + 1

    async def save(self, slot, name):
        data = slotfile.build(self.tokens, b"\0" * (len(self.tokens) * 10))
        (self.dir / name).write_bytes(data)
        self.saves.append(name)
        return SaveResult(len(self.tokens), len(data), 1.0)

    async def restore(self, slot, name):
        try:
            header = slotfile.read_header(self.dir / name)
        except (FileNotFoundError, slotfile.BadSlotFile):
            self.tokens = []
            raise EngineRefused("failed to open file") from None
        self.tokens = list(header.tokens)
        return RestoreResult(len(self.tokens), (self.dir / name).stat().st_size, 1.0)

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
        cache_n = min(lcp(self.tokens, tokens), len(tokens) - 1)
        self.ran(list(tokens))
        self.prefills = [*self.prefills, list(tokens)]
        return PrefillResult(cache_n, len(tokens) - cache_n, 1.0)

    async def slots(self):
        if not self.slots_visible:
            raise SlotsHidden("GET /slots is off")
        return [SlotState(0, self.processing, len(self.tokens), None, self.task_id)]

    async def health(self):
        return True

    async def info(self):
        return EngineInfo(self.model, self.model, 1)

    async def close(self):
        pass
