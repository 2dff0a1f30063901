"""Which of the engine's routes the gate treats how (llama-server b11434): conversation
requests that run the turn, requests a client may pin to a slot, the POSTs that never touch a
slot, a batch that runs as several tasks, and what a body or a path names."""

from __future__ import annotations

import json


CONVERSATION_PATHS = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/messages", "/v1/responses",
                                "/responses"})


# Requests llama-server lets a client pin to a slot with "id_slot" (b11434): with several slots
# autosessd pins them where it placed them. Embeddings and rerank cannot be pinned.
PINNABLE_PATHS = CONVERSATION_PATHS | {"/completion", "/completions", "/v1/completions", "/infill"}


CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})  # OpenAI chat: matched by tokens


# POSTs that never run on a slot (llama-server b11434's routes). Every other POST may touch a
# slot's KV cache — completions, infill, embeddings, rerank, and routes added later — so it
# passes the slot's FIFO: unknown routes err on the safe side.
SLOTLESS_POSTS = frozenset({"/tokenize", "/detokenize", "/apply-template", "/props", "/lora-adapters",
                            "/models", "/models/load", "/models/unload", "/tools", "/cors-proxy",
                            # resumable streams: steer or find a running generation, never start one
                            "/v1/chat/completions/control", "/v1/streams/lookup",
                            "/chat/completions/input_tokens", "/v1/chat/completions/input_tokens",
                            "/responses/input_tokens", "/v1/responses/input_tokens", "/v1/messages/count_tokens"})


def several_tasks(body: dict) -> bool:
    """Does the request run as several tasks, each on a slot of the engine's choosing? A
    batch of prompts ("prompt": a list of prompts, not of token ids: llama-server's
    tokenize_input_prompts) or several completions of one (n_cmpl, alias n, > 1: child tasks on
    other slots). Pinned to one slot, the engine would run them one after another there, each
    reusing the one before it, and answer otherwise than it does alone."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not any(
            isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return True
    for name in ("n_cmpl", "n"):
        n = body.get(name)
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            return True
    return False


def model_of(body: bytes) -> str | None:
    """A router request's model ("model" in its JSON body), when it names one."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


def slot_in_path(path: str) -> int | None:
    """/slots/3 → 3; anything else → None (the configured slot)."""
    tail = path[len("/slots/"):]
    return int(tail) if tail.isdigit() and len(tail) < 6 else None
