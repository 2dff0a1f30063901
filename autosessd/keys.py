"""Conversation identity (DESIGN §1).

A conversation is named by its first user message: the first 16 hex digits of the
SHA-1 of that message's text. That is the boundary the engine's prompt cache sees
too, so both agree on what "a different conversation" is. A request with no user
text (tokenize, raw `prompt`, embeddings) has no key and is left alone.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

KEY_RE = re.compile(r"^[0-9a-f]{16}$")

# Part types that carry text: chat/messages use "text", the responses API "input_text".
_TEXT_PARTS = ("text", "input_text")


def key_of_text(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def is_key(s: object) -> bool:
    return isinstance(s, str) and KEY_RE.match(s) is not None


def conversation_key(body: Any) -> str | None:
    """Key of a request body: OpenAI chat (`messages`), Anthropic (`messages`; `system`
    is not a user message) or OpenAI responses (`input`: a string or a list of items).
    Never raises: anything malformed simply has no key."""
    if not isinstance(body, dict):
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
