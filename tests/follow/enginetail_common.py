"""What the engine-log tail's state tests share (test_enginetail_state.py, test_enginetail_restart.py):
the stub engine behind a tail, llama-server b11434's own lines, one request as it runs and logs it."""

import json

from autosessd.follow.enginetail import EngineTail
from autosessd.store import slotfile
from stub_engine import stub_sessions

# Two conversations, as token ids: a shared template opener, then their own text.
OPENER = list(range(2, 12))
A = OPENER + list(range(100, 160))
A2 = A + list(range(160, 200))  # A goes on
B = OPENER + list(range(500, 570))


def make(tmp_path, n_slots=1, min_tokens=10, clears_idle=False):
    s, cfg, d = stub_sessions(tmp_path, n_slots=n_slots, min_tokens=min_tokens, clears_idle=clears_idle,
                              config=f'[engine]\nlog = "{tmp_path / "engine.log"}"\n')
    tail = EngineTail(cfg, s, cfg.engine.log)
    s.on_engine_restart.append(tail._engine_restarted)
    return s, tail, d


def text(msg: str, ts: str = "0.03.276.238") -> bytes:
    return f"{ts} I {msg}".encode()


def jsonl(msg: str) -> bytes:
    return json.dumps({"type": "log", "time": 3276238, "level": "info", "msg": msg + "\n"}).encode()


def launch(slot, task):
    return f"slot launch_slot_: id  {slot} | task {task} | processing task, is_child = 0"


def timings(slot, task, prompt_n, eval_n):
    return [f"slot print_timing: id  {slot} | task {task} | prompt eval time =     294.19 ms /    {prompt_n} tokens "
            f"(    9.49 ms per token,   105.37 tokens per second)",
            f"slot print_timing: id  {slot} | task {task} |        eval time =     248.07 ms /     {eval_n} tokens "
            f"(   35.44 ms per token,    28.22 tokens per second)",
            f"slot print_timing: id  {slot} | task {task} |       total time =     542.27 ms /    {prompt_n + eval_n} "
            f"tokens"]


def release(slot, task, n):
    return f"slot      release: id  {slot} | task {task} | stop processing: n_tokens = {n}, truncated = 0"


STARTED = ["srv  llama_server: initializing ...",
           "srv    load_model: initializing, n_slots = 1, n_ctx_slot = 8192, kv_unified = 'false'",
           "srv  llama_server: model loaded", "srv  llama_server: listening on http://127.0.0.1:8080"]


async def served(s, tail, tokens, slot=0, fmt=text, cache_n=0, generated=8):
    """One request as llama-server runs and logs it: launch, the slot's new tokens, timings, release."""
    task = s.engine._tasks + 1
    await tail.handle(fmt(launch(slot, task)))
    s.engine.ran(list(tokens), slot)
    for line in timings(slot, task, len(tokens) - generated + 1 - cache_n, generated):
        await tail.handle(fmt(line))
    await tail.handle(fmt(release(slot, task, len(tokens))))
    return task


async def settle(s, tail):
    for _ in range(3):
        for task in list(tail._save_tasks.values()):
            await task
        if tail._restore_task is not None:
            await tail._restore_task
        await s.drain()


def auto_files(d):
    """name → the tokens its header holds."""
    return {p.name: list(slotfile.read_header(p).tokens) for p in sorted(d.glob("auto-*.bin"))}


async def restart(s, tail, fmt=text):
    """The engine restarts: its slots are empty, its task ids start over, its log starts again."""
    s.engine.restart()
    for line in STARTED:
        await tail.handle(fmt(line))
    await tail.after_batch()
    await settle(s, tail)
