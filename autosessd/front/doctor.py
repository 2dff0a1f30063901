"""`autosessctl doctor`: the engine settings that cost reuse, each with the flag that fixes it,
and for the last restores the engine did not reuse, where the prompt departed from the file, in
the client's terms ("message 3 (user) differs", "system prompt differs at token 812").

What is read, from the engine itself wherever it can say:

    its flags        the command line (and LLAMA_ARG_* environment) of the process listening on
                     the engine's port, when it runs on this host and we may read it (psutil);
                     otherwise what the engine showed: the start's probes, restores reused or not
    /props           the model file (its GGUF: sliding window, recurrent layers), a slot's n_ctx
    the directory    the largest file of this model against that context

checks() is pure (a table test covers it): facts in, one Finding per setting out. The departure
of a restore the engine did not reuse is found from the request's tokens (the engine's template
and tokenizer, with each token's text) against the file's: the first token where they differ,
and the message whose text holds it. Bodies of the last few such requests are kept in memory only.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..engines import gguf
from ..engines.base import EngineError
from ..engines.process import engine_command
from ..store import places, slotfile
from ..store.runs import common_prefix
from ..store.slotfile import encode

if TYPE_CHECKING:
    from ..sessions.facade import Sessions

log = logging.getLogger("autosessd")



@dataclass(frozen=True)
class Finding:
    status: str  # "ok", "problem", "unknown"
    setting: str  # the engine setting, as its flag
    says: str  # what was seen
    fix: str = ""  # the flag (or key) that fixes it


@dataclass(frozen=True)
class Facts:
    """What doctor knows of the engine. flags: its command-line options as parsed (None: not
    readable from here)."""

    flags: dict[str, str | bool] | None
    swa_window: int | None  # the model's sliding window (None: unknown)
    empties_idle: bool  # the start's probe: a start on one slot empties the idle ones
    n_slots: int
    slots_visible: bool
    save_path: str  # the directory autosessd manages
    n_ctx: int | None  # a slot's context
    largest_file: int | None  # tokens of the largest auto file of this model
    files_over_ctx: int
    arch: str | None
    recurrent: bool
    reused: int  # restores the engine reused since the start
    not_reused: int
    not_reused_cause: str | None  # the last one's likely cause
    swa_retries: int = 0  # requests that ended inside a file on a sliding-window model (retries)
    rewinds: int = 0  # slots taken back before a save (rewind.py), of them the engine read again, not done
    rewinds_reread: int = 0
    rewinds_not_done: int = 0
    # The store (issue 39): blocks on; the engine's directory on tmpfs; conversations kept whole and why.
    blocks: bool = False
    staging_tmpfs: bool | None = None
    whole: dict[str, int] | None = None
    # The staging directory (issue 46): why it is not autosessd's own now (None: it is), its copies
    # against their budget, and tmpfs staging directories of stores that no longer exist.
    staging_unsafe: str | None = None
    hot_bytes: int = 0
    hot_budget: int | None = None
    stale_staging: tuple[str, ...] = ()
    # The shared bucket by block (issue 48): its status counters (None: no [shared]), whole_files on.
    shared: dict[str, Any] | None = None
    whole_files: bool = False


def _shared_findings(sh: dict[str, Any], whole_files: bool) -> list[Finding]:
    """The bucket by block: what went up against whole files, what came down against what was here."""
    out = []
    if sh.get("manifests_up"):
        out.append(Finding("ok", "shared", f"{sh['manifests_up']:,} save(s) up by block: {sh['bytes_up_blocks'] / 1e9:,.2f}"
                           f" GB sent where whole files would have been {sh['bytes_whole_files'] / 1e9:,.2f} GB; "
                           f"{sh['blocks_skipped']:,} block(s) the bucket held already"))
    if sh.get("blocks_fetched") or sh.get("blocks_held"):
        out.append(Finding("ok", "shared", f"downloads by block: {sh['bytes_fetched'] / 1e9:,.2f} GB fetched, "
                           f"{sh['bytes_held'] / 1e9:,.2f} GB of the blocks they named held here already"))
    if whole_files:
        out.append(Finding("unknown", "shared.whole_files", "every save kept as blocks also goes up whole (for hosts "
                           "of the version before manifests)", "set it false once every host runs this version"))
    return out


def _flag(flags: dict[str, str | bool] | None, *names: str) -> str | bool | None:
    if flags is None:
        return None
    for n in names:
        if n in flags:
            return flags[n]
    return None


def checks(f: Facts) -> list[Finding]:
    """One Finding per engine setting that costs reuse (pure)."""
    out: list[Finding] = []
    # --swa-full on a sliding-window model
    if f.swa_window is None:
        out.append(Finding("unknown", "--swa-full", "the model's sliding window is not known (its file is not "
                           "readable here)", "set engine.swa_window; run llama-server with --swa-full if it has one"))
    elif f.swa_window == 0:
        out.append(Finding("ok", "--swa-full", "the model has no sliding window: not needed"))
    else:
        full = _flag(f.flags, "--swa-full")
        if full is True:
            out.append(Finding("ok", "--swa-full", f"on (the model's sliding window is {f.swa_window:,} tokens)"))
        elif f.flags is not None:
            out.append(Finding("problem", "--swa-full", f"off, and the model has a {f.swa_window:,}-token sliding "
                               "window: the engine accepts a restore, then reads the prompt again",
                               "start llama-server with --swa-full"))
        elif f.not_reused and not f.reused:
            out.append(Finding("problem", "--swa-full", f"no restore was reused ({f.not_reused:,} not) on a model "
                               f"with a {f.swa_window:,}-token sliding window", "start llama-server with --swa-full"))
        elif f.reused:
            out.append(Finding("ok", "--swa-full", f"restores were reused ({f.reused:,}): on"))
        else:
            out.append(Finding("unknown", "--swa-full", f"the model has a {f.swa_window:,}-token sliding window; its "
                               "flags are not readable from here and no restore has been verified yet",
                               "start llama-server with --swa-full"))
    if f.swa_window and f.swa_retries:
        out.append(Finding("problem", "sliding window", f"{f.swa_retries:,} request(s) ended inside a saved file (a "
                           f"retry, a regenerate): with a {f.swa_window:,}-token sliding window, llama-server's file "
                           "keeps only the window's last cells, so such a prompt is read again (a restore made "
                           "without its tokens, after a restart through a tail, is even reused with the window's "
                           "oldest cells missing); a client's next message is restored as always",
                           "send requests through the gate or the hook: there each save holds the state one token "
                           "before its prompt's end, which a retry goes on from (a tail sees the prompt too late)"))
    # --cache-idle-slots with a unified KV cache
    if f.n_slots > 1 and f.empties_idle:
        out.append(Finding("problem", "--cache-idle-slots", "the engine empties every idle slot whenever a request "
                           "starts on another (a unified KV cache with --cache-idle-slots, the defaults of -np "
                           "auto): each conversation is saved at its end, and one can miss its save",
                           "start llama-server with --no-cache-idle-slots"))
    elif f.n_slots > 1:
        out.append(Finding("ok", "--cache-idle-slots", "idle slots keep what they hold"))
    # the slot save path
    path = _flag(f.flags, "--slot-save-path")
    if isinstance(path, str) and os.path.realpath(path) != os.path.realpath(f.save_path):
        out.append(Finding("problem", "--slot-save-path", f"the engine saves into {path}, autosessd manages "
                           f"{f.save_path}", f"start llama-server with --slot-save-path {f.save_path}"))
    else:
        out.append(Finding("ok", "--slot-save-path", f"{f.save_path}" + (
            " (checked at start by a probe save)" if path is None else "")))
    # the store: token blocks, the engine's writes on tmpfs
    if f.blocks and f.staging_tmpfs is False:
        out.append(Finding("problem", "staging", f"the engine saves into {f.save_path}, on the disk: every save "
                           "is written whole there (the store then keeps only its new blocks)",
                           "put slot_save_path on tmpfs (/dev/shm/...) and store_path on the disk, or run the "
                           "engine through `autosessd --exec`, which does so"))
    elif f.blocks and f.staging_tmpfs:
        out.append(Finding("ok", "staging", "the engine saves on tmpfs; the store writes only new blocks"))
    if f.staging_unsafe:
        out.append(Finding("problem", "staging", f.staging_unsafe,
                           "give autosessd and the engine a directory only autosessd's user owns and may write"))
    if f.hot_budget is not None and f.hot_bytes > f.hot_budget:
        out.append(Finding("problem", "staging_max_gb", f"the copies in staging take {f.hot_bytes / 1e9:,.2f} GB, over "
                           f"their budget of {f.hot_budget / 1e9:,.2f} GB (copies held by a restore or a save stay "
                           "until it ends)", "if it lasts: lower staging_max_gb, or look for a stuck restore"))
    if f.stale_staging:
        out.append(Finding("problem", "staging", "tmpfs staging of stores that no longer exist (memory until the "
                           f"next boot): {'; '.join(f.stale_staging)}",
                           "autosessd removes them at its next start; or remove them by hand"))
    if f.shared is not None:
        out.extend(_shared_findings(f.shared, f.whole_files))
    if f.whole:
        why = "; ".join(f"{n:,} {w}" for w, n in sorted(f.whole.items(), key=lambda kv: -kv[1])[:3])
        out.append(Finding("unknown", "store", f"conversation(s) kept whole, not as blocks: {why}"))
    # --no-slots
    if not f.slots_visible or _flag(f.flags, "--no-slots") is True:
        out.append(Finding("problem", "--no-slots", "GET /slots is off: autosessd cannot see requests that "
                           "bypass the gate, nor a restore verified outside it",
                           "start llama-server without --no-slots"))
    else:
        out.append(Finding("ok", "--no-slots", "GET /slots answers"))
    # the context against the saved files
    if f.n_ctx is not None and f.files_over_ctx:
        need = (f.largest_file or 0) + 1024
        total = need * f.n_slots if f.n_slots > 1 and _flag(f.flags, "--kv-unified", "-kvu") is not True else need
        out.append(Finding("problem", "-c", f"{f.files_over_ctx:,} saved file(s) hold more tokens than a slot's "
                           f"context ({f.n_ctx:,}; the largest {f.largest_file:,}): the engine refuses them",
                           f"start llama-server with -c {total:,} or more"))
    elif f.n_ctx is not None:
        out.append(Finding("ok", "-c", f"a slot holds {f.n_ctx:,} tokens" + (
            f"; the largest file {f.largest_file:,}" if f.largest_file else "")))
    # recurrent / hybrid models
    if f.recurrent:
        checkpoints = _flag(f.flags, "--ctx-checkpoints", "-ctxcp", "--swa-checkpoints")
        if checkpoints is not None and str(checkpoints).strip() == "0" or f.rewinds_reread:
            out.append(Finding("problem", "--ctx-checkpoints", f"{f.arch}: recurrent layers, and the engine keeps no "
                               "context checkpoint near a prompt's end: taking a slot back to one token before it "
                               f"before a save reads the whole prompt again ({f.rewinds_reread:,} times so far)",
                               "run llama-server without --ctx-checkpoints 0 (its default keeps 32)"))
        out.append(Finding("ok", "model", f"{f.arch}: recurrent layers (a hybrid or recurrent model): the engine "
                           "reuses a restore only for a request that goes on from its end, so each save holds the "
                           "state one token before its prompt's end, which the next turn and a retry go on from "
                           f"({f.rewinds:,} so far; {f.rewinds_not_done:,} saves could not be: their prompt was "
                           "not known, as with a tail's save behind)"))
    elif f.arch:
        out.append(Finding("ok", "model", f"{f.arch}: attention layers only (restores can be reused)"))
    return out


# -- reading the facts -------------------------------------------------------------------------
_BOOL_ENV = {"LLAMA_ARG_SWA_FULL": "--swa-full", "LLAMA_ARG_NO_SLOTS": "--no-slots",
             "LLAMA_ARG_KV_UNIFIED": "--kv-unified"}
_VALUE_ENV = {"LLAMA_ARG_SLOT_SAVE_PATH": "--slot-save-path", "LLAMA_ARG_CTX_SIZE": "-c",
              "LLAMA_ARG_N_PARALLEL": "-np", "LLAMA_ARG_CTX_CHECKPOINTS": "--ctx-checkpoints"}
_VALUED = {"--slot-save-path", "-c", "--ctx-size", "-np", "--parallel", "--cache-ram", "-cram", "-m", "--model",
           "--ctx-checkpoints", "-ctxcp", "--swa-checkpoints",
           "--port", "--host"}


def parse_flags(argv: list[str], env: dict[str, str] | None = None) -> dict[str, str | bool]:
    """llama-server's options that matter here, from its argv (and LLAMA_ARG_* environment)."""
    flags: dict[str, str | bool] = {}
    for k, flag in _BOOL_ENV.items():
        if env and env.get(k, "").lower() in ("1", "true", "on", "enabled"):
            flags[flag] = True
    for k, flag in _VALUE_ENV.items():
        if env and env.get(k):
            flags[flag] = env[k]
    i = 1
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=")
        if name in _VALUED:
            if not eq and i + 1 < len(argv):
                val, i = argv[i + 1], i + 1
            flags[{"--ctx-size": "-c", "--parallel": "-np", "-cram": "--cache-ram"}.get(name, name)] = val
        elif a.startswith("-"):
            flags[{"-kvu": "--kv-unified"}.get(a, a)] = True
        i += 1
    return flags


def _model_facts(path: str) -> tuple[str | None, bool]:
    if not path:
        return None, False
    try:
        return gguf.architecture(path), gguf.recurrent(path)
    except (gguf.BadGGUF, OSError) as e:
        log.debug("doctor: %s: %s", path, e)
        return None, False


async def facts(s: Sessions) -> Facts:
    ctx, loop = s.ctx, asyncio.get_running_loop()
    try:
        info = await s.engine.info()
    except EngineError:
        info = None
    proc = await loop.run_in_executor(None, engine_command, s.engine.kind, getattr(s.engine, "url", ""))
    flags = parse_flags(*proc) if proc is not None else None
    arch, recurrent = await loop.run_in_executor(None, _model_facts, info.model_path if info else "")
    entries = await loop.run_in_executor(None, lambda: s.store.scan())
    whole: dict[str, int] = {}
    for e in entries:
        if e.meta is not None and not e.blocks and e.meta.whole:
            whole[e.meta.whole] = whole.get(e.meta.whole, 0) + 1
    tmpfs = await loop.run_in_executor(None, on_tmpfs, str(s.store.staging))
    unsafe, stale = await loop.run_in_executor(None, _staging_facts, s)
    hot = s.store.hot_copies()
    sizes = [e.meta.n_tokens for e in entries if e.meta is not None and e.meta.model == s.model]
    n_ctx = info.n_ctx if info is not None else None
    c, nr = s.counters, s.restore_log.not_reused
    return Facts(flags=flags, swa_window=ctx.swa_window if ctx.swa_window is not None else (
                     0 if ctx.cfg.engine.swa_window == 0 else None),
                 empties_idle=s.launch.empties_idle, n_slots=len(s.slots), slots_visible=ctx.slots_visible,
                 save_path=str(s.store.staging), n_ctx=n_ctx, largest_file=max(sizes) if sizes else None,
                 files_over_ctx=sum(1 for n in sizes if n_ctx is not None and n >= n_ctx), arch=arch,
                 recurrent=recurrent, reused=c.restores_reused, not_reused=c.restores_not_reused,
                 not_reused_cause=nr["likely_cause"] if nr else None, swa_retries=c.swa_retries,
                 rewinds=c.rewinds, rewinds_reread=c.rewinds_reread, rewinds_not_done=c.rewinds_not_done,
                 blocks=s.store.cut, staging_tmpfs=tmpfs, whole=whole or None, staging_unsafe=unsafe,
                 hot_bytes=hot["bytes"], hot_budget=hot["budget"], stale_staging=stale,
                 shared=ctx.remote.status() if ctx.remote is not None else None,
                 whole_files=bool(ctx.cfg.shared and ctx.cfg.shared.whole_files))


def _staging_facts(s: Sessions) -> tuple[str | None, tuple[str, ...]]:
    """Why the staging directory is not autosessd's own now (None: it is), and the tmpfs staging
    directories beside it whose store is gone."""
    from ..sessions.checks import tmpfs_staging_of

    staging = s.store.staging
    made_here = tmpfs_staging_of(s.ctx.cfg)
    group = s.store.group
    try:
        if made_here:
            places.check_dir(staging.parent, "the tmpfs staging directory", made_here=True, group=group)
        places.check_dir(staging, "slot_save_path", made_here=made_here, group=group)
        unsafe = None
    except places.NotOurs as e:
        unsafe = str(e)
    stale = tuple(f"{d} ({size / 1e6:,.1f} MB, of {store})"
                  for d, store, size in (places.stale(staging.parent) if made_here else []))
    return unsafe, stale


def on_tmpfs(path: str, mounts_file: str = "/proc/mounts") -> bool | None:
    """Whether `path` lies on a tmpfs (the longest mount point of /proc/mounts that holds it);
    None: not known (no /proc/mounts)."""
    try:
        with open(mounts_file) as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = max((m for m in mounts if len(m) > 2 and (real == m[1] or real.startswith(m[1].rstrip("/") + "/"))),
               key=lambda m: len(m[1]), default=None)
    return None if best is None else best[2] == "tmpfs"


# -- where a prompt departed from the file ---------------------------------------------------------
def message_spans(rendered: bytes, messages: list[Any]) -> list[tuple[int, int, int, str]]:
    """(start byte, end byte, message number from 1, role) of each message's text in the prompt the
    template rendered, found in order; a message whose text is not found verbatim is left out."""
    from ..base.keys import _content_text

    spans, pos = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        text = _content_text(m.get("content"))
        if not text:
            continue
        b = text.encode("utf-8", "surrogatepass")
        at = rendered.find(b, pos)
        if at < 0:
            at = rendered.find(b.strip(), pos)
            b = b.strip()
        if at < 0:
            continue
        spans.append((at, at + len(b), i + 1, str(m.get("role") or "?")))
        pos = at + len(b)
    return spans


def token_offsets(rendered: bytes, pieces: list[bytes]) -> list[int]:
    """The byte offset in the rendered prompt where each token starts. A token the tokenizer added
    that is not in the text (a BOS before a template that writes none) takes no bytes."""
    out, pos = [], 0
    for p in pieces:
        out.append(pos)
        if p and rendered.startswith(p, pos):
            pos += len(p)
    return out


def departure(at: int, n_file: int, n_prompt: int, offsets: list[int], spans: list[tuple[int, int, int, str]],
              window: int | None) -> str:
    """Where a prompt of n_prompt tokens departed (at token `at`) from a restored file of n_file,
    worded in the client's terms (pure)."""
    if at >= n_file:
        return (f"the prompt continues the whole file ({n_file:,} tokens): the engine itself did not reuse it "
                "(its flags, above)")
    if at >= n_prompt:
        return (f"the prompt ({n_prompt:,} tokens) is shorter than the file ({n_file:,}): the client cut the "
                "conversation, and the engine reads a prompt again rather than cut its state back")
    where = f"at token {at:,}"
    byte = offsets[at] if at < len(offsets) else None
    msg = None
    if byte is not None:
        msg = next((sp for sp in spans if sp[0] <= byte < sp[1]), None)
        if msg is None:
            # Between two messages' texts: the template's own markers of the next one.
            msg = next((sp for sp in spans if byte < sp[0]), None)
    if msg is None:
        what = f"the prompt differs from the file {where} (in the template's own text: tools or options?)"
    elif msg[3] == "system" or msg[3] == "developer":
        what = f"system prompt differs {where}"
    else:
        what = f"message {msg[2]} ({msg[3]}) differs from the file {where}: edited, or another conversation"
    if window and n_file - at > window:
        what += (f"; {n_file - at:,} tokens before the file's end, more than the model's sliding window "
                 f"({window:,}): the engine cannot reuse the part before it")
    return what


async def departures(s: Sessions) -> list[dict[str, Any]]:
    """For the last restores the engine did not reuse whose request autosessd kept (OpenAI chat
    bodies), where the prompt departed from the file."""
    chat, out = s.ctx.chat, []
    for d in list(s.restore_log.departed)[::-1]:
        row = {k: d[k] for k in ("file", "key", "n_restored", "cache_n", "at")}
        body = d.get("body")
        try:
            if chat is None or body is None:
                raise EngineError("no request body kept for it (another API, or the turn hook)")
            header = await asyncio.get_running_loop().run_in_executor(
                None, slotfile.read_header, s.store.path / d["file"])
            rendered = await chat.apply_template(body)
            toks = await chat.tokenize_pieces(rendered)
            ids = [t for t, _ in toks]
            at = common_prefix(encode(ids), header.encoded())
            text = rendered.encode("utf-8", "surrogatepass")
            row["where"] = departure(at, header.n_tokens, len(ids), token_offsets(text, [p for _, p in toks]),
                                     message_spans(text, body.get("messages") or []), s.ctx.swa_window)
            row["token"] = at
        except (EngineError, OSError, slotfile.BadSlotFile, AttributeError) as e:
            row["where"] = f"not known: {e}"
        out.append(row)
    return out


async def run(s: Sessions) -> dict[str, Any]:
    f = await facts(s)
    return {"engine": s.engine.address, "flags_read": f.flags is not None,
            "findings": [asdict(x) for x in checks(f)], "not_reused": await departures(s)}
