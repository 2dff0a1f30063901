"""An in-process engine for tests that need sessions but not a process: writes real files."""

from autosessd.engines.base import EngineInfo, EngineRefused, RestoreResult, SaveResult, SlotState


class StubEngine:
    kind = "llama-server"
    address = "http://stub"
    magic = b"qsgg"

    def __init__(self, directory, model="stub-model"):
        self.dir = directory
        self.model = model
        self.tokens = 0
        self.processing = False
        self.saves: list[str] = []

    async def save(self, slot, name):
        data = b"qsgg" + self.tokens.to_bytes(8, "little") + b"\0" * (self.tokens * 10)
        (self.dir / name).write_bytes(data)
        self.saves.append(name)
        return SaveResult(self.tokens, len(data), 1.0)

    async def restore(self, slot, name):
        try:
            data = (self.dir / name).read_bytes()
        except FileNotFoundError:
            raise EngineRefused("failed to open file") from None
        self.tokens = int.from_bytes(data[4:12], "little")
        return RestoreResult(self.tokens, len(data), 1.0)

    async def slots(self):
        return [SlotState(0, self.processing, self.tokens, None)]

    async def health(self):
        return True

    async def info(self):
        return EngineInfo(self.model, self.model, 1)

    async def close(self):
        pass
