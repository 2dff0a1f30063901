"""Conversation identity (DESIGN §1).

A conversation is named by its first user message: the first 16 hex digits of the
SHA-1 of that message's text. That is the boundary the engine's prompt cache sees
too, so both agree on what "a different conversation" is. A request with no user
text (tokenize, raw `prompt`, embeddings) has no key and is left alone.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import threading
from typing import Any

import xxhash

KEY_RE = re.compile(r"^[0-9a-f]{16}$")

# Part types that carry text: chat/messages use "text", the responses API "input_text".
_TEXT_PARTS = ("text", "input_text")


def key_of_text(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def conversation_id_key(value: str | None) -> str | None:
    """Key of a client's own conversation id (the X-Conversation-Id header llama-server's web UI
    sends; gate.conversation_id_headers): taken before the first-user-message rule, so two chats
    that open alike stay two, and one whose first message is edited stays one. Empty or absent →
    None; a namespace keeps it from ever equalling a first message's key (the same for every
    header: one id under either is one conversation)."""
    if not isinstance(value, str) or not value.strip():
        return None
    return key_of_text("X-Conversation-Id\0" + value.strip())


def is_key(s: object) -> bool:
    return isinstance(s, str) and KEY_RE.match(s) is not None


def names_own_adapters(body: Any) -> bool:
    """A body with llama-server's per-request `"lora"` (adapters and scales for this request
    alone): the KV the engine computes for it is theirs, so it is no conversation of autosessd's
    (nothing of it is saved, nothing restored into it; the slot's conversation is saved before it
    runs, as before any request without one)."""
    return isinstance(body, dict) and bool(body.get("lora"))


def conversation_key(body: Any) -> str | None:
    """Key of a request body: OpenAI chat (`messages`), Anthropic (`messages`; `system`
    is not a user message) or OpenAI responses (`input`: a string or a list of items).
    Never raises: anything malformed simply has no key, and neither has a body naming its own
    LoRA adapters (names_own_adapters)."""
    if not isinstance(body, dict) or names_own_adapters(body):
        return None
    text = None
    if isinstance(body.get("messages"), list):
        text = _first_user_text(body["messages"])
    elif "input" in body:
        inp = body["input"]
        if isinstance(inp, str):
            text = inp  # the responses API's shorthand for one user message
        elif isinstance(inp, list):
            text = _first_user_text(inp)
    return key_of_text(text) if text else None


def messages_key(messages: Any) -> str | None:
    """Key of a bare message list (request-log lines and the turn hook carry one)."""
    if not isinstance(messages, list):
        return None
    text = _first_user_text(messages)
    return key_of_text(text) if text else None


def _first_user_text(items: list) -> str | None:
    for item in items:
        if isinstance(item, dict) and item.get("role") == "user":
            return _content_text(item.get("content"))
    return None


def _content_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            p["text"]
            for p in content
            if isinstance(p, dict) and p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str)
        ]
        return "\n".join(texts)
    return None


# Fields of an OpenAI chat body that never change its prompt's text (sampling, output,
# transport). Any other field (tools, template options, fields added later) may, so it is
# part of the signature: an unknown field costs a tokenization, never a wrong match.
_NOT_PROMPT = frozenset({"model", "temperature", "top_p", "top_k", "min_p", "typical_p", "max_tokens",
                         "max_completion_tokens", "n_predict", "n", "seed", "stream", "stream_options", "stop",
                         "presence_penalty", "frequency_penalty", "repeat_penalty", "repeat_last_n", "logprobs",
                         "top_logprobs", "logit_bias", "user", "id_slot", "cache_prompt", "timings_per_token",
                         "return_progress", "samplers", "dry_multiplier", "mirostat", "grammar",
                         "response_format", "metadata", "store", "service_tier"})


def _digest(value: Any) -> str:
    return hashlib.sha1(json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass")
                        ).hexdigest()[:16]


# Digests of recent messages made only of strings, by their fields: a conversation sends its
# earlier messages again with every request, and at tens of thousands of tokens their JSON
# and SHA-1 cost ~0.4 ms a turn. A lookup's key is the message itself when it is short (its
# str hash is cheap), else the fields' names and an XXH3-128 of their values (~10 GB/s: a
# tenth of Python's own str hash, which a key of the long text would cost). The usual
# message, {"role", "content"} of two strings, is keyed without sorting its fields: a turn
# signs every message of the conversation. A collision of XXH3-128 would make two messages
# look alike, as the 64-bit digests themselves could: a switch taken for the same
# conversation going on, a mark that matches wrongly. Never a wrong answer: the engine
# compares tokens before it reuses any.
_SEEN: collections.OrderedDict[tuple, str] = collections.OrderedDict()
SEEN_KEPT = 256
_SEEN_LOCK = threading.Lock()  # the tail and the hook may sign from worker threads
SEEN_MAX_CHARS = 1 << 20  # a message longer than this is digested each time (memory bound)
SHORT_CHARS = 2048  # a message whose fields are each (or, beyond role/content, together) this short is its own key


def _text_hash(text: str) -> bytes:
    return xxhash.xxh3_128_digest(text.encode("utf-8", "surrogatepass"))


def _seen_key(m: dict) -> tuple | None:
    """The lookup key of message m, or None: not remembered (a value that is not a string,
    a text over SEEN_MAX_CHARS)."""
    if len(m) == 2:
        role, text = m.get("role"), m.get("content")
        if type(role) is str and type(text) is str:
            if len(text) <= SHORT_CHARS and len(role) <= SHORT_CHARS:
                return ("rc", role, text)
            if len(text) + len(role) <= SEEN_MAX_CHARS:
                return ("rc#", _text_hash(role), _text_hash(text))
            return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in m.items()):
        return None
    items = sorted(m.items())
    size = sum(len(v) for _, v in items)
    if size > SEEN_MAX_CHARS:
        return None
    if size <= SHORT_CHARS:
        return ("f", *items)
    return ("f#", tuple(k for k, _ in items), *(_text_hash(v) for _, v in items))


def _message_digest(m: dict) -> str:
    """_digest(m), remembered for messages whose fields are all strings."""
    key = _seen_key(m)
    if key is None:
        return _digest(m)
    with _SEEN_LOCK:
        d = _SEEN.get(key)
        if d is not None:
            _SEEN.move_to_end(key)
            return d
    d = _digest(m)
    with _SEEN_LOCK:
        _SEEN[key] = d
        if len(_SEEN) > SEEN_KEPT:
            _SEEN.popitem(last=False)
    return d


def chat_signature(body: Any) -> tuple[str, ...] | None:
    """(digest of the fields that shape the prompt, digest of each message) of an OpenAI chat
    body whose messages carry only text; None for anything else (images, audio, a malformed
    body): those are matched by key, not by tokens. A request whose signature starts with
    the held request's goes on from it: its prompt extends the held one's, no need to ask
    the engine for its tokens."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
        return None
    for m in body["messages"]:
        if not isinstance(m, dict):
            return None
        c = m.get("content")
        if isinstance(c, list) and any(not isinstance(p, dict) or p.get("type") not in _TEXT_PARTS for p in c):
            return None  # media: the engine's tokens for it are not text tokens
    try:
        options = {k: v for k, v in body.items() if k != "messages" and k not in _NOT_PROMPT}
        return (_digest(options) if options else _NO_OPTIONS, *(_message_digest(m) for m in body["messages"]))
    except (TypeError, ValueError, RecursionError):
        return None


_NO_OPTIONS = _digest({})  # the signature's first part for a body of messages and sampling fields only


def continues(held: tuple[str, ...] | None, new: tuple[str, ...] | None) -> bool:
    """Does a request of signature `new` go on from the held request's (same options, its
    messages first)?"""
    return held is not None and new is not None and len(new) >= len(held) and new[:len(held)] == held


# -- a file known by its messages (issue 23) ------------------------------------------------
def chain(sig: tuple[str, ...], seed: str = "") -> list[str]:
    """Cumulative digests of a chat signature: chain(sig)[i] stands for the options and the
    first i + 1 messages together, so one string per message boundary says "this request's
    messages begin with those". `seed` is the engine's template identity: a file's messages
    mean its tokens only under the template that rendered them. A file records the digest at
    the boundaries whose token offsets it knows (names.Mark); a request compares its own
    chain with them, one dict lookup per message, no tokens asked for."""
    h = hashlib.sha1(b"autosessd chain\0" + seed.encode("utf-8", "surrogatepass") + b"\0" + sig[0].encode())
    out = []
    for d in sig[1:]:
        h = hashlib.sha1(h.digest() + d.encode())
        out.append(h.hexdigest()[:16])
    return out
