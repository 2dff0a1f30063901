"""llama-server's HTTP slots API (DESIGN §3).

    POST /slots/{id}?action=save|restore  {"filename": NAME}   NAME relative to --slot-save-path
    GET  /slots   GET /props   GET /v1/models   GET /health (503 while loading)
    POST /apply-template  a chat body → {"prompt": the templated text}
    POST /tokenize        {"content", "add_special", "parse_special"} → {"tokens": [...]}
    POST /detokenize      {"tokens": [...]} → {"content": text}
    POST /completion      {"prompt": [token ids], "n_predict": 0, "id_slot", "cache_prompt"}:
                          reads a prompt into a slot without generating (a prefix, then saved)

501 on /slots means the engine runs without --slot-save-path. A slot action on a busy
slot is deferred by the engine until the slot is free, so it can take as long as the
running request: every call has engine.timeout_s.

Router mode (llama-server --models-dir / --models-preset): one adapter per model
(LlamaServer(url, model=ID)); it names the model in every call ("model" in a POST body,
?model= on a GET) and adds autoload=false, so that nothing autosessd asks of a model loads
it again behind the router's back: only Router.load does that (autosessd/modes/models.py). The
router itself answers GET /models, POST /models/load and /models/unload.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from typing import Any

from urllib.parse import urlencode

import aiohttp

from . import http1
from .process import engine_command, kv_flags
from .upstream import Upstream
from .base import (EngineBadAnswer, EngineError, EngineInfo, EngineLacks, EngineRefused, EngineTimeout, EngineUnreachable,
                   PrefillResult, RestoreResult, SaveResult, SlotSavingOff, SlotsHidden, SlotState)


class LlamaServer:
    kind = "llama-server"
    magic = b"qsgg"

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 120.0,
                 pool: Upstream | None = None, model: str | None = None):
        """pool: the engine's HTTP pool, shared with the gate (one is made when None).
        model: in router mode, the model every call is about."""
        self.url = url.rstrip("/")
        self.model_id = model
        self.address = self.url if model is None else f"{self.url} (model {model})"
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._own_pool = pool is None
        self.pool = pool if pool is not None else Upstream(self.url, timeout_s)
        # The adapter's own short JSON calls go on a lean HTTP/1.1 client (http1.py: a
        # fraction of aiohttp's cost a call, and every turn makes some); https on aiohttp.
        self.lean = http1.Client(self.url) if self.url.startswith("http://") else None
        self._own_lean = True  # for_model's adapters share it
        # The pool does not decompress (the gate passes bodies through as they are): ask
        # for none. The key is sent per call, never as the pool's default (the gate's
        # clients bring their own).
        self._headers = {"Accept-Encoding": "identity"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    async def close(self) -> None:
        if self._own_pool:
            await self.pool.close()
        if self.lean is not None and self._own_lean:
            await self.lean.close()

    def for_model(self, model: str) -> "LlamaServer":
        """The adapter of one model behind the same router, on the same pool."""
        other = LlamaServer(self.url, self.api_key, self.timeout_s, self.pool, model)
        other._own_pool = False
        other.lean, other._own_lean = self.lean, False
        return other

    def _route(self, method: str, path: str, body: Any) -> tuple[str, Any]:
        if self.model_id is None:
            return path, body
        sep = "&" if "?" in path else "?"
        if method == "GET":
            return f"{path}{sep}{urlencode({'model': self.model_id, 'autoload': 'false'})}", body
        return f"{path}{sep}autoload=false", {**(body or {}), "model": self.model_id}

    async def _call(self, method: str, path: str, body: Any = None, timeout_s: float | None = None,
                    route: bool = True) -> Any:
        """route False: the router's own call, from a model's adapter."""
        if route:
            path, body = self._route(method, path, body)
        if self.lean is not None:
            status, text = await self._lean_call(method, path, body, timeout_s or self.timeout_s)
            return self._answer(method, path, status, text)
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            # The pool sends once more on fresh connections when a kept-alive one was closed
            # under us (the engine never saw the request; slot actions are idempotent anyway).
            async with await self.pool.send(method, path, json=body, headers=self._headers, timeout=timeout) as r:
                text = await r.text(errors="replace")
                status = r.status
        except asyncio.TimeoutError:
            raise EngineTimeout(f"the engine at {self.url} did not answer {method} {path} "
                                f"within {timeout.total:g} s") from None
        except aiohttp.ClientConnectorError as e:
            raise EngineUnreachable(f"cannot reach the engine at {self.url}: {e.os_error.strerror or e}") from None
        except aiohttp.ClientError as e:
            raise EngineUnreachable(f"lost the connection to the engine at {self.url} during {path}: "
                                    f"{e or type(e).__name__}") from None
        return self._answer(method, path, status, text)

    async def _lean_call(self, method: str, path: str, body: Any, timeout_s: float) -> tuple[int, str]:
        assert self.lean is not None
        data = json.dumps(body).encode() if body is not None else None
        try:
            status, raw = await self.lean.request(method, path, data, self._headers, timeout_s)
        except asyncio.TimeoutError:
            raise EngineTimeout(f"the engine at {self.url} did not answer {method} {path} "
                                f"within {timeout_s:g} s") from None
        except http1.HTTPError as e:
            if e.connect:
                raise EngineUnreachable(f"cannot reach the engine at {self.url}: {e}") from None
            raise EngineUnreachable(f"lost the connection to the engine at {self.url} during {path}: {e}") from None
        return status, raw.decode("utf-8", errors="replace")

    def _answer(self, method: str, path: str, status: int, text: str) -> Any:
        try:
            data = json.loads(text) if text else None
        except ValueError:
            data = None
        if status == 501 and path.split("?")[0] == "/slots":
            raise SlotsHidden(f"the engine at {self.url} does not show its slots (GET /slots is off: --no-slots)")
        if status == 501 and path.startswith("/slots/"):
            raise SlotSavingOff(f"slot saving is off in the engine at {self.url}: start llama-server with "
                                f"--slot-save-path <dir> (the directory autosessd manages)")
        if status == 401:
            raise EngineRefused(f"the engine at {self.url} wants an API key: set engine.api_key")
        if status == 404 and "not found" in _error_message(data, text).lower():
            # A route the engine does not have (llama-server: "File Not Found"). Not a 501: that
            # is llama-server's "not supported" for one request's content.
            raise EngineLacks(f"{method} {path} answered {status}: {_error_message(data, text)}")
        if status >= 400:
            raise EngineRefused(f"{method} {path} answered {status}: {_error_message(data, text)}")
        if data is None:
            raise EngineBadAnswer(f"{method} {path} answered {status} with a body that is not JSON: {text[:200]!r}")
        return data

    async def save(self, slot: int, name: str) -> SaveResult:
        d = await self._call("POST", f"/slots/{slot}?action=save", {"filename": name})
        try:
            return SaveResult(n_tokens=int(d["n_saved"]), n_bytes=int(d["n_written"]),
                              ms=float(d["timings"]["save_ms"]))
        except (KeyError, TypeError, ValueError):
            raise EngineBadAnswer(f"save answered without n_saved/n_written/timings.save_ms: {d!r:.200}") from None

    async def restore(self, slot: int, name: str) -> RestoreResult:
        d = await self._call("POST", f"/slots/{slot}?action=restore", {"filename": name})
        try:
            return RestoreResult(n_tokens=int(d["n_restored"]), n_bytes=int(d["n_read"]),
                                 ms=float(d["timings"]["restore_ms"]))
        except (KeyError, TypeError, ValueError):
            raise EngineBadAnswer(f"restore answered without n_restored/n_read/timings.restore_ms: "
                                  f"{d!r:.200}") from None

    async def apply_template(self, body: dict, timeout_s: float | None = None) -> str:
        """The text a chat request (an OpenAI `messages` body, passed whole: tools and
        template options change the text) is prompted with, from the engine's own template."""
        d = await self._call("POST", "/apply-template", body, timeout_s)
        prompt = d.get("prompt") if isinstance(d, dict) else None
        if not isinstance(prompt, str):
            raise EngineBadAnswer(f"/apply-template answered without a prompt string: {d!r:.200}")
        return prompt

    async def tokenize(self, text: str, timeout_s: float | None = None) -> list[int]:
        """`text` tokenized as the chat path tokenizes a prompt: with the model's special
        tokens added (BOS) and special-token text parsed as such. /tokenize defaults to
        add_special false (parse_special true), so both are given."""
        d = await self._call("POST", "/tokenize", {"content": text, "add_special": True, "parse_special": True},
                             timeout_s)
        tokens = d.get("tokens") if isinstance(d, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise EngineBadAnswer(f"/tokenize answered without a list of token ids: {d!r:.200}")
        return tokens

    async def tokenize_pieces(self, text: str, timeout_s: float | None = None) -> list[tuple[int, bytes]]:
        """`text` tokenized as tokenize() does, each token with its text (`with_pieces`: a string,
        or a list of byte values for a piece that is not whole UTF-8)."""
        d = await self._call("POST", "/tokenize", {"content": text, "add_special": True, "parse_special": True,
                                                    "with_pieces": True}, timeout_s)
        tokens = d.get("tokens") if isinstance(d, dict) else None
        try:
            return [(int(t["id"]), t["piece"].encode("utf-8", "surrogatepass") if isinstance(t["piece"], str)
                     else bytes(t["piece"])) for t in tokens]  # type: ignore[union-attr]
        except (KeyError, TypeError, ValueError):
            raise EngineBadAnswer(f"/tokenize with_pieces answered without id/piece pairs: {d!r:.200}") from None

    async def prompt_tokens(self, body: dict, timeout_s: float | None = None) -> list[int]:
        """The exact tokens a chat request would be prompted with, without running it.
        Neither call waits for a slot: the engine answers them beside a running request."""
        return await self.tokenize(await self.apply_template(body, timeout_s), timeout_s)

    async def erase(self, slot: int) -> int:
        """Empty a slot's KV cache (it is not saved anywhere); the tokens it held."""
        d = await self._call("POST", f"/slots/{slot}?action=erase")
        try:
            return int(d["n_erased"])
        except (KeyError, TypeError, ValueError):
            raise EngineBadAnswer(f"erase answered without n_erased: {d!r:.200}") from None

    async def detokenize(self, tokens: list[int], timeout_s: float | None = None) -> str:
        """The text of token ids (special tokens as their text, e.g. `<bos>`)."""
        d = await self._call("POST", "/detokenize", {"tokens": tokens}, timeout_s)
        content = d.get("content") if isinstance(d, dict) else None
        if not isinstance(content, str):
            raise EngineBadAnswer(f"/detokenize answered without a content string: {d!r:.200}")
        return content

    async def prefill(self, slot: int, tokens: list[int]) -> PrefillResult:
        """Read `tokens` into the slot and stop there: afterwards the slot holds exactly these
        tokens (n_predict 0 samples one token but never evaluates it; measured on b11434:
        a save right after holds the prompt, token for token). cache_prompt keeps what the
        slot already shares with them. Waits for the slot like any request."""
        d = await self._call("POST", "/completion", {"prompt": tokens, "n_predict": 0, "id_slot": slot,
                                                      "cache_prompt": True, "temperature": 0})
        try:
            t = d["timings"]
            return PrefillResult(cache_n=int(t["cache_n"]), prompt_n=int(t["prompt_n"]), ms=float(t["prompt_ms"]))
        except (KeyError, TypeError, ValueError):
            raise EngineBadAnswer(f"/completion answered without timings.cache_n/prompt_n/prompt_ms: "
                                  f"{d!r:.200}") from None

    async def slots(self) -> list[SlotState]:
        d = await self._call("GET", "/slots")
        if not isinstance(d, list):
            raise EngineBadAnswer(f"/slots answered {type(d).__name__}, not a list")
        try:
            return [SlotState(id=int(s["id"]), is_processing=bool(s.get("is_processing")),
                              n_tokens=int(s.get("n_prompt_tokens") or 0),
                              n_cached=int(s["n_prompt_tokens_cache"]) if "n_prompt_tokens_cache" in s else None,
                              task_id=int(s["id_task"]) if s.get("id_task") is not None else None,
                              n_processed=int(s["n_prompt_tokens_processed"])
                              if "n_prompt_tokens_processed" in s else None)
                    for s in d]
        except (KeyError, TypeError, ValueError):
            raise EngineBadAnswer(f"/slots answered entries without id: {d!r:.200}") from None

    # -- a router's own calls (model None) ---------------------------------------------------
    async def router_models(self) -> list[dict]:
        """GET /models: [{"id", "status": "loaded" | "loading" | "unloaded" | ..., "args": [...]}]."""
        d = await self._call("GET", "/models")
        data = d.get("data") if isinstance(d, dict) else None
        if not isinstance(data, list):
            raise EngineBadAnswer(f"/models answered without a list of models: {d!r:.200}")
        out = []
        for m in data:
            st = m.get("status") if isinstance(m, dict) else None
            if not isinstance(m, dict) or not isinstance(m.get("id"), str):
                continue
            out.append({"id": m["id"], "status": str((st or {}).get("value") or "unknown"),
                        "args": [str(a) for a in (st or {}).get("args") or []]})
        return out

    async def load_model(self, model: str) -> None:
        await self._call("POST", "/models/load", {"model": model})

    async def unload_model(self, model: str) -> None:
        await self._call("POST", "/models/unload", {"model": model})

    async def is_sleeping(self) -> bool:
        """/props is_sleeping (--sleep-idle-seconds): asking neither wakes the engine nor
        moves its idle timer."""
        props = await self._call("GET", "/props")
        return isinstance(props, dict) and props.get("is_sleeping") is True

    async def health(self) -> bool:
        try:
            await self._call("GET", "/health", timeout_s=min(self.timeout_s, 5.0))
            return True
        except EngineRefused:  # 503 while the model loads
            return False

    async def info(self) -> EngineInfo:
        props = await self._call("GET", "/props")
        meta: dict = {}
        if self.model_id is None:  # a router's /v1/models lists its models, none with numbers
            try:
                models = await self._call("GET", "/v1/models")
                meta = (models.get("data") or [{}])[0].get("meta") or {}
            except (EngineRefused, EngineBadAnswer, AttributeError, IndexError):
                meta = {}
        if not isinstance(props, dict):
            raise EngineBadAnswer("/props answered something that is not an object")
        if props.get("role") == "router" and self.model_id is None:
            most = props.get("max_instances")
            return EngineInfo(model="router", model_name="router", total_slots=0, router=True,
                              max_loaded=most if type(most) is int and most > 0 else None)
        path = str(props.get("model_path") or "")
        name = os.path.basename(path) or str(props.get("model_alias") or "unknown")
        # Identity of the weights, not of where they lie: the file name plus the model's
        # own numbers (size in bytes, parameter count, vocabulary). Behind a router, the
        # model's name there too: two aliases of one file are two models to it, each with
        # its own slots and files.
        ident = {"name": name, **{k: meta.get(k) for k in ("size", "n_params", "n_vocab", "n_embd")}}
        if self.model_id is not None:
            ident["router_model"] = self.model_id
        # What changes the K/V of the same tokens besides the weights (process.kv_flags): in the
        # fingerprint, so that no file or block computed under other settings is read under these.
        # Only when there are some: an engine without them keeps the fingerprint it always had.
        kv, read = await self._kv_settings()
        if kv:
            ident["kv"] = list(kv)
        fp = hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
        dgs = props.get("default_generation_settings")
        n_ctx = dgs.get("n_ctx") if isinstance(dgs, dict) else None
        # What turns a request's messages into its tokens besides the model: the template and
        # the special tokens it is given.
        chat = {k: props.get(k) for k in ("chat_template", "bos_token", "eos_token")}
        template = hashlib.sha1(json.dumps(chat, sort_keys=True).encode()).hexdigest()[:16] \
            if isinstance(chat["chat_template"], str) else ""
        return EngineInfo(model=fp, model_name=name, total_slots=int(props.get("total_slots") or 1),
                          model_path=str(props.get("model_path") or ""),
                          n_ctx=n_ctx if type(n_ctx) is int and n_ctx > 0 else None, template=template,
                          kv_settings=kv if read else None)

    async def _kv_settings(self) -> tuple[tuple[str, ...], bool]:
        """(the settings that change the KV bytes: its command line's (process.kv_flags; behind a
        router, the model's args from GET /models) and the LoRA adapters it has loaded, with their
        scales (GET /lora-adapters); whether its command line could be read)."""
        out: list[str] = []
        try:
            adapters = await self._call("GET", "/lora-adapters")
        except EngineError:
            adapters = None
        for a in adapters if isinstance(adapters, list) else ():
            if isinstance(a, dict) and a.get("path"):
                out.append(f"lora-adapter={os.path.basename(str(a['path']))}:{a.get('scale')}")
        command: tuple[list[str], dict[str, str]] | None = None
        if self.model_id is not None:
            try:
                d = await self._call("GET", "/models", route=False)
                entry = next((m for m in (d.get("data") or []) if isinstance(m, dict) and m.get("id") == self.model_id),
                             None) if isinstance(d, dict) else None
                args = ((entry or {}).get("status") or {}).get("args")
                if isinstance(args, list):
                    command = ([str(a) for a in args], {})
            except (EngineError, AttributeError):
                command = None
        else:
            command = await asyncio.to_thread(engine_command, self.kind, self.url)
        if command is not None:
            out += kv_flags(*command)
        return tuple(sorted(out)), command is not None


def _error_message(data: Any, text: str) -> str:
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return text[:200] or "(empty body)"
