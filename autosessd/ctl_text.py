"""What autosessctl prints for people: status, ls, events, prune and doctor as tables and lines
(`--json` prints the daemon's answer instead). Pure: a reply's dict in, text out."""

from __future__ import annotations

import datetime as dt
from typing import Any, Callable


def gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def tokens(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def when(ts: float | None) -> str:
    return "-" if not ts else dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(out)


def slot_line(s: dict[str, Any]) -> str:
    """One slot's state as status shows it (sessions/facade.py's states)."""
    state = s.get("state") or "unknown"
    busy = "  (a request runs)" if s.get("busy") else ""
    if state == "held":
        # Nothing said of a whole turn ("durable" read as "on disk"): only of a cancelled one's part.
        kind = "" if s.get("durable") else "  partial (its request was cancelled)"
        return f"holds {s['held']}  {tokens(s.get('n_tokens'))} tokens{kind}{busy}"
    if state == "restored":
        return f"restored {s['held']}  {tokens(s.get('n_tokens'))} tokens, not yet verified{busy}"
    if state == "switched":
        return f"running {s['held'] or 'a request without a conversation'}{busy}"
    if state == "empty":
        return f"empty{busy}"
    return "holds nothing autosessd can name" + (f" ({s['why']})" if s.get("why") else "") + busy


def seconds(s: float | None) -> str:
    """A duration for people: 850 ms, 12.3 s, 4 min 10 s, 2 h 5 min."""
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:,.0f} ms"
    if s < 60:
        return f"{s:,.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600):,} h {int(s % 3600 // 60)} min"


def headline(st: dict[str, Any]) -> list[str]:
    """What autosessd did for the user, since it started and in total (issue 22), then the disk."""
    sp, store = st.get("spared") or {}, st["store"]
    out = []
    for label, f in (("since start", sp.get("since_start")), ("in total", sp.get("total"))):
        if not f:
            continue
        restores = f"{f['restores_reused']:,} restore{'s' if f['restores_reused'] != 1 else ''} reused"
        if f["restores_not_reused"]:
            restores += f", {f['restores_not_reused']:,} NOT reused (autosessctl doctor says why)"
        if f["restores_unverified"]:
            restores += f", {f['restores_unverified']:,} unverified"
        since = f"  (since {when(f['since'])})" if label == "in total" else ""
        out.append(f"{label + ':':<13}{tokens(f['prompt_tokens'])} prompt tokens not read again, "
                   f"~{seconds(f['seconds'])} of prefill spared; {restores}{since}")
    rates = sp.get("rates") or {}
    tps = rates.get("prompt_tokens_per_s")
    if sp:
        if tps:
            rate = (f"{tps['1000']:,.0f} tokens/s reading 1k tokens, {tps['8000']:,.0f} reading 8k "
                    f"({rates['prompt_reads']:,} prompt reads measured)")
        else:
            rate = "not measured yet (no prompt read seen)"
        out.append(f"{'':13}(tokens: the engine's own timings.cache_n after each restore, less what the slot "
                   f"held; seconds: at its measured prompt rate: {rate})")
        if sp.get("unpriced_tokens"):
            out.append(f"{'':13}{tokens(sp['unpriced_tokens'])} tokens reused before any prompt read was "
                       f"measured are priced at the first")
    budget = store.get("budget_bytes") or int(store["max_gb"] * 1e9)
    share = f" ({store['auto_bytes'] / budget:.0%})" if budget else ""
    out.append(f"{'on disk:':<13}{store['auto_files']:,} files, {gb(store['auto_bytes'])} of the "
               f"{gb(budget)} budget{share}, newest {store['keep']:,} kept; {gb(store['free_bytes'])} free")
    auto = store.get("min_tokens_auto")
    out.append(f"{'saves from:':<13}{tokens(store['min_tokens'])} tokens"
               + (f" (auto: {store.get('min_tokens_why')})" if auto else " (auto_sessions_min_tokens)"))
    return out


def show_status(st: dict[str, Any]) -> str:
    e, store, c = st["engine"], st["store"], st["counters"]
    out = [f"autosessd {st['version']}, up {seconds(st['uptime_s'])}, auto sessions "
           f"{'on' if st['auto_sessions'] else 'off'}",
           *headline(st),
           f"engine    {e['kind']} {e['url']}  {'healthy' if e['healthy'] else 'NOT healthy'}  {e['model']}"]
    mem = e.get("memory")
    if mem and mem["saved_at"] != "the slot as it is":
        kind = "recurrent layers" if mem["recurrent"] else f"a {tokens(mem['swa_window'])}-token sliding window"
        out.append(f"model     {kind}: each save holds {mem['saved_at']} (the state its next turn and a retry reuse)")
    router = st.get("router")
    if router:
        out.append(f"router    at most {router['max_loaded'] or 'any number of'} model(s) loaded")
        for m in router["models"]:
            kept = "" if m["managed"] else "  (its slots are not saved into autosessd's directory: not kept)"
            out.append(f"model {m['id']}  {m['status']}, loaded {m['loads']} time(s) through autosessd"
                       + (f", {m['in_flight']} request(s) now" if m["in_flight"] else "") + kept)
    for s in st["slots"] or ([] if router else [{"id": 0, "state": "unknown"}]):
        where = f"{s['model']} slot {s['id']}" if "model" in s else f"slot {s['id']}   "
        out.append(f"{where} {slot_line(s)}" + (f"  ({s['file']})" if s.get("file") else ""))
        r = s.get("last_restore")
        if r:
            shared = f", sharing {tokens(r['shared'])} tokens with the request" if r.get("shared") is not None else ""
            reused = (f", the engine reused {tokens(r['cache_n'])}" if r.get("cache_n") is not None
                      else ", not verified yet")
            if r.get("spared_ms") is not None:
                reused += f", spared ~{seconds(r['spared_ms'] / 1000)}"
            out.append(f"          last restore {r['file']} (by {r.get('chosen_by', 'key')}){shared}{reused}")
    out.append(f"sessions  {store['path']}" + (f"  (the engine's: {store['staging']})"
                                               if store.get("staging") and store["staging"] != store["path"] else ""))
    out += store_lines(store)
    out.append("inputs    " + (", ".join(st["inputs"]) or "none"))
    if st.get("shared"):
        out += shared_lines(st["shared"], c.get("arrivals"))
    out.append("counters  " + "  ".join(f"{k} {tokens(v) if isinstance(v, int) else f'{v:,.0f}'}"
                                        for k, v in c.items() if v))
    q = store.get("quarantined") or {}
    if q.get("files"):
        latest = q["latest"][0]
        out.append(f"warning   {q['files']:,} session file(s) moved aside ({gb(q['bytes'])}, "
                   f"{store['path']}/.autosessd-quarantine): the latest, {latest['name']}: {latest['why']}")
    if e.get("saving_off"):
        out.append(f"warning   no saves or restores: {e['saving_off']} (until the engine restarts again)")
    if e.get("suspect"):
        out.append(f"warning   the engine refused the restore of {e['suspect']['file']} "
                   f"{when(e['suspect']['at'])}: it may hold spoiled state until it restarts (llama.cpp #27068)")
    if st.get("last_not_reused"):
        n = st["last_not_reused"]
        out.append(f"warning   restored {tokens(n['n_restored'])} tokens of {n['key']} but the engine reused "
                   f"{tokens(n['cache_n'])}: {n['likely_cause']}")
    return "\n".join(out)


def stored(r: dict[str, Any]) -> str:
    """How `ls` says a file is kept: blocks (with its tail; its own bytes / shared), whole (why), or -."""
    if r.get("stored") == "blocks":
        tail = f" + a {r['tail']} tail of {gb(r['tail_bytes'])}" if r.get("tail") else ""
        return f"blocks{tail}: {gb(r['own_bytes'])} own, {gb(r['shared_bytes'])} shared"
    if r.get("stored") == "whole":
        return f"whole ({r['whole_why']})" if r.get("whole_why") else "whole"
    return "-"


def store_lines(store: dict[str, Any]) -> list[str]:
    """The block store and the copies in staging (issue 39), in one or two lines."""
    b, hot = store.get("blocks") or {}, store.get("hot") or {}
    if not b.get("on"):
        return ["store     whole files (store_blocks = false)"]
    out = [f"store     {b['manifests']:,} conversation(s) as {b['blocks']:,} token blocks ({gb(b['bytes'])}, "
           f"{gb(b['shared_bytes'])} of them shared); written since start: the engine {gb(b['engine_bytes_written'])}, "
           f"the store {gb(b['store_bytes_written'])}"]
    if hot:
        out.append(f"staging   {hot['files']:,} copy(ies) for a quick return ({gb(hot['bytes'])} of "
                   f"{gb(hot['budget'])}); assembled from blocks: {b['assembled']:,} ({gb(b['assembled_bytes'])} read)")
    return out


def shared_lines(sh: dict[str, Any], arrivals: int | None = None) -> list[str]:
    """The shared bucket in status: where, what waits to go up, what came down, and what moved
    here from other hosts (arrivals: the sessions' counter, when known)."""
    cat = sh.get("catalog") or {}
    listed = (f"{cat.get('saves', 0):,} saves of this model, read {when(cat.get('listed_at'))}"
              if cat.get("listed_at") else "not read yet")
    rate = f", {sh['download_mb_s']:,.0f} MB/s" if sh.get("download_mb_s") else ""
    out = [f"shared    s3 {sh['bucket']}/{sh['prefix']} at {sh['endpoint']} as {sh['host']}: {listed}",
           f"          uploads {sh['uploads_pending']:,} pending ({sh['uploads_retrying']:,} retrying), "
           f"{sh['uploads_done']:,} done, {sh['upload_failures']:,} failed attempts"
           + (f", {sh['uploads_dropped']:,} dropped (the local save could not be read)" if sh.get("uploads_dropped")
              else "") + f", {gb(sh['bytes_up'])} up",
           f"          downloads {sh['downloads']:,} hits, {sh['download_failures']:,} failed, "
           f"{sh['downloads_skipped_slower']:,} skipped as slower than re-reading, "
           f"{sh['downloads_skipped_unreachable']:,} while the bucket failed, "
           f"{sh['downloads_refused_layout']:,} refused (another KV layout), {gb(sh['bytes_down'])} down "
           f"in {sh['download_ms_total'] / 1000:,.1f} s{rate}"]
    if sh.get("manifests_up") or sh.get("blocks_fetched") or sh.get("blocks_held"):
        out.append(f"          by block: {sh['manifests_up']:,} save(s) up as manifests, {sh['blocks_up']:,} block(s) "
                   f"sent, {sh['blocks_skipped']:,} already in the bucket: {gb(sh['bytes_up_blocks'])} up of "
                   f"{gb(sh['bytes_whole_files'])} as whole files; {sh['blocks_fetched']:,} block(s) fetched "
                   f"({gb(sh['bytes_fetched'])}), {sh['blocks_held']:,} held here ({gb(sh['bytes_held'])})")
    if arrivals is not None:
        out.append(f"          moved here from other hosts: {arrivals:,} conversation(s), "
                   f"{sh.get('downloads_moved', 0):,} download(s) of their saves ({gb(sh.get('bytes_down_moved', 0))})")
    if sh.get("uploads_retrying") and sh.get("last_upload_error"):
        out.append(f"warning   uploads are failing: {sh['last_upload_error']}")
    if sh.get("last_download_error"):
        out.append(f"          last failed download: {sh['last_download_error']}")
    if cat.get("last_list_error") and cat.get("list_failures"):
        out.append(f"warning   reading the bucket: {cat['last_list_error']}")
    return out


def size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _ms(v: float | None) -> str:
    return "-" if v is None else seconds(v / 1000)


def _turn(ev: dict[str, Any]) -> str:
    did = []
    if ev.get("saved"):
        did.append(f"saved {tokens(ev['saved'].get('n_tokens'))} tokens to {ev['saved'].get('file')}")
    if ev.get("restored"):
        did.append(f"restored {tokens(ev['restored'].get('n_tokens'))} tokens from {ev['restored'].get('file')}")
    if ev.get("prefix"):
        did.append(f"prefix {tokens(ev['prefix'].get('n_tokens'))} tokens")
    did += [f"error: {e}" for e in ev.get("errors") or []]
    return (ev.get("key") or "(no conversation)") + ": " + ("; ".join(did) or "nothing to do") + \
        f", {_ms(ev.get('ms'))}"


# One formatter per event type: what happened, in units; anything else falls back to key=value.
_EVENTS: dict[str, Callable[[dict[str, Any]], str]] = {
    "turn": _turn,
    "saving": lambda e: f"{tokens(e.get('n_tokens'))} tokens of {e.get('key')}" + (
        f" to {e['file']}" if e.get("file") else ""),
    "saved": lambda e: f"{tokens(e.get('n_tokens'))} tokens  {size(e.get('bytes'))}  {e.get('file')}  in "
                       f"{_ms(e.get('ms'))} (engine {_ms(e.get('engine_ms'))})",
    "restored": lambda e: f"{tokens(e.get('n_tokens'))} tokens  {size(e.get('bytes'))}  {e.get('file')}  in "
                          f"{_ms(e.get('ms'))} (engine {_ms(e.get('engine_ms'))})",
    "restore_reused": lambda e: f"{e.get('file')}: the engine reused {tokens(e.get('cache_n'))} of "
                                f"{tokens(e.get('n_restored'))} tokens" + (
        f", spared {tokens(e['spared_tokens'])} tokens ~{_ms(e.get('spared_ms'))}"
        if e.get("spared_tokens") is not None else ""),
    "restore_not_reused": lambda e: f"{e.get('file')}: the engine reused only {tokens(e.get('cache_n'))} of "
                                    f"{tokens(e.get('n_restored'))} tokens (autosessctl doctor says why)",
    "finalized": lambda e: f"{e.get('file')}: durable (fsynced, renamed, its metadata written)",
    "save_failed": lambda e: f"{e.get('file') or e.get('key')}: {e.get('error')}",
    "restore_failed": lambda e: f"{e.get('file')}: {e.get('error')}",
    "engine_reset": lambda e: f"{e.get('key')} lost: {e.get('why')}",
    "save_discarded": lambda e: f"{e.get('key')}: {e.get('why')}",
    "save_covered": lambda e: f"{tokens(e.get('n_tokens'))} tokens of {e.get('key')}: {e.get('file')} holds them",
    "slot_emptied": lambda e: str(e.get("why")),
    "pruned": lambda e: f"{len(e.get('files') or []):,} files, {size(e.get('bytes'))} freed",
    "forgot": lambda e: f"auto-{e.get('key')}.bin, {size(e.get('bytes'))} freed",
    "downloaded": lambda e: f"{e.get('file')} from {e.get('host')}: {tokens(e.get('n_tokens'))} tokens  "
                            f"{size(e.get('bytes'))}",
    "download_failed": lambda e: f"{e.get('file')} from {e.get('host')}: {e.get('error')}",
}


def show_event(ev: dict[str, Any]) -> str:
    """One line per event, for people: time, type, slot, then what happened with its units."""
    kind = ev.get("type", "?")
    fmt = _EVENTS.get(kind)
    if fmt is not None:
        try:
            what = fmt(ev)
        except (KeyError, TypeError, ValueError, AttributeError):
            fmt = None
    if fmt is None:
        what = " ".join(f"{k}={v}" for k, v in ev.items()
                        if k not in ("seq", "ts", "type", "slot") and v not in (None, [], {}))
    slot = f"slot {ev['slot']}" if isinstance(ev.get("slot"), int) else ""
    return f"{when(ev.get('ts'))}  {kind:<18}  {slot:<7}  {what}"


def show_bucket_prune(r: dict[str, Any]) -> str:
    if not r.get("done"):
        return f"bucket prune not done: {r.get('why', '?')}"
    if r.get("dry_run"):
        return (f"would remove {r['remove']:,} of {r['saves']:,} saves in the bucket ({r['superseded']:,} of them "
                f"superseded by a newer save), {gb(r['freed_bytes'])}")
    return (f"removed {r.get('removed', 0):,} of {r['saves']:,} saves in the bucket ({r['superseded']:,} planned as "
            f"superseded), freed {gb(r['freed_bytes'])}; {r.get('aborted_uploads', 0):,} abandoned uploads aborted")


def forgot(r: dict[str, Any]) -> str:
    """autosessctl forget's answer, in words."""
    def slots(v: list) -> str:
        return ", ".join(str(x) if not isinstance(x, dict) else f"{x['model']}:{x['slot']}" for x in v)

    lines = [f"forgot {r['key']}: {len(r['files'])} file(s) removed ({gb(r['freed'])})"
             + (f": {', '.join(r['files'])}" if r["files"] else "")]
    if r.get("emptied_slots"):
        lines.append(f"  slot(s) emptied, the engine's too: {slots(r['emptied_slots'])}")
    if r.get("running_slots"):
        lines.append(f"  slot(s) running a request of it now, left alone (a new request brings it back): "
                     f"{slots(r['running_slots'])}")
    if r.get("erase_failed"):
        lines.append(f"  slot(s) whose engine slot could not be emptied (autosessd no longer names them): "
                     f"{slots(r['erase_failed'])}")
    if r.get("bucket"):
        blocks = sum(1 for k in r["bucket"] if k.startswith("blocks/"))
        lines.append(f"  removed from the shared bucket: {len(r['bucket']) - blocks} save(s), every host's"
                     + (f", and {blocks} block(s) no other save names" if blocks else ""))
    for k in r.get("kept") or []:
        lines.append(f"  kept: {k}")
    return "\n".join(lines)


def show_doctor(r: dict[str, Any]) -> str:
    """One line per engine setting (ok / PROBLEM / unknown, the flag, what was seen, the fix)."""
    out = [f"engine {r['engine']}" + ("" if r["flags_read"] else
                                      " (its command line is not readable from here: judged by what it showed)")]
    for f in r["findings"]:
        mark = {"ok": "ok", "problem": "PROBLEM", "unknown": "?"}.get(f["status"], f["status"])
        out.append(f"{mark:<8} {f['setting']:<20} {f['says']}" + (f"  -> fix: {f['fix']}" if f["fix"] and
                                                                   f["status"] != "ok" else ""))
    if r["not_reused"]:
        out.append("restores the engine did not reuse, newest first:")
    for d in r["not_reused"]:
        out.append(f"  {when(d['at'])}  {d['file']}: reused {tokens(d['cache_n'])} of {tokens(d['n_restored'])} "
                   f"tokens; {d['where']}")
    problems = sum(f["status"] == "problem" for f in r["findings"])
    out.append(f"{problems} problem{'s' if problems != 1 else ''}" if problems else "no problem found")
    return "\n".join(out)
