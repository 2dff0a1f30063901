"""The control-stream engine adapter against the conformant fake engine, and against broken peers."""

import asyncio

import pytest

from autosessd.engines.base import EngineBadAnswer, EngineRefused, EngineTimeout, EngineUnreachable
from autosessd.engines.control_stream import ControlStream
from harness import FakeEngine


@pytest.fixture
def fake(session_dir, tmp_path):
    addr = f"unix:{tmp_path / 'engine.sock'}"
    f = FakeEngine(session_dir, control=addr, model="cs-model").start()
    yield f, addr
    f.stop()


async def test_save_restore_status(fake, session_dir):
    _, addr = fake
    e = ControlStream(addr, str(session_dir), timeout_s=5)
    assert await e.health()
    info = await e.info()
    assert info.model == "cs-model" and info.total_slots == 1
    [slot] = await e.slots()
    assert slot.id == 0 and not slot.is_processing
    saved = await e.save(0, "x.bin")
    assert (session_dir / "x.bin").stat().st_size == saved.n_bytes
    restored = await e.restore(0, "x.bin")
    assert restored.n_bytes == saved.n_bytes
    with pytest.raises(EngineRefused, match="failed to open"):
        await e.restore(0, "missing.bin")


async def test_unreachable(tmp_path):
    e = ControlStream(f"unix:{tmp_path / 'nobody.sock'}", str(tmp_path), timeout_s=2)
    with pytest.raises(EngineUnreachable, match="cannot reach the engine at unix:"):
        await e.health()
    e = ControlStream("tcp:127.0.0.1:1", str(tmp_path), timeout_s=2)
    with pytest.raises(EngineUnreachable):
        await e.slots()


@pytest.mark.parametrize("reply, error", [
    (b"", EngineBadAnswer),                  # closes without a line
    (b"HELLO\n", EngineBadAnswer),           # neither OK nor ERR
    (b"OK not json\n", EngineBadAnswer),
    (b"OK [1, 2]\n", EngineBadAnswer),
    (b"OK {\"n_tokens\": \"x\"}\n", EngineBadAnswer),
    (b"ERR disk on fire\n", EngineRefused),
    (None, EngineTimeout),                   # never answers
])
async def test_broken_peers(tmp_path, reply, error):
    path = tmp_path / "bad.sock"

    async def serve(reader, writer):
        await reader.readline()
        if reply is None:
            await asyncio.sleep(10)
        writer.write(reply)
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(serve, str(path))
    try:
        e = ControlStream(f"unix:{path}", str(tmp_path), timeout_s=0.5)
        with pytest.raises(error):
            await e.save(0, "x.bin")
    finally:
        server.close()


async def test_refuses_to_send_a_line_break(tmp_path):
    e = ControlStream(f"unix:{tmp_path / 's'}", str(tmp_path))
    with pytest.raises(EngineRefused, match="line break"):
        await e.save(0, "x\nSAVE /etc/passwd")
