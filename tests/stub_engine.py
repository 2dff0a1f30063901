"""An in-process engine for tests that need sessions but not a process: writes real files
in llama-server's layout (autosessd/slotfile.py), the token ids standing for a conversation.

Like llama-server: GET /slots shows the slot's token count and the id of the last task that
ran on it; a failed restore clears the slot. Unlike it: slot actions never wait for a request
(tests call ran() between them)."""

from autosessd import slotfile
from autosessd.engines.base import EngineInfo, EngineRefused, RestoreResult, SaveResult, SlotState, SlotsHidden


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
