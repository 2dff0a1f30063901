"""The bucket's layout, and what is decided over it without I/O (no boto3 here).

Layout in the bucket. autosessd owns exactly these names under `prefix`; nothing else, under
the prefix or outside it, is ever read as a session, listed for prune, or deleted:

    <prefix>sessions/<model>/<stem>/<saved_at µs, 20 digits>-<n_tokens, 10 digits>-<host>.bin
    <prefix>sessions/<model>/<stem>/<saved_at µs, 20 digits>-<n_tokens, 10 digits>-<host>.manifest
    <prefix>blocks/<block key, 32 hex>.blk
    <prefix>leases/prune.json

  <model>  the engine's model fingerprint (16 hex, engines/llama_server.py); one that is not a
           plain name is replaced by a hash of it
  <stem>   the local file name without ".bin" (auto-<key>, or a parked name)
  <host>   the saving host ([shared] host, default the hostname)

A save is one object: a whole slot file (.bin), or, for a save the local store keeps as token
blocks (store/blocks.py), its manifest (.manifest: the local manifest's JSON, store.names.Meta,
with the saving host) whose blocks, the tail among them, are objects of their own under
blocks/, each the local block file as it is (its 64-byte header with key, cells and payload
digest, then the payload). A block's key names its bytes' meaning (the chained hash: model,
shape, every token up to its end), so hosts agree on names without talking and a block is sent
once whoever sends it first; an object there is never sent again. A manifest goes up after
every block it names is there (blockobjects.py: no manifest in the bucket names a missing
block), and a block goes only when no manifest names it and it has not been written or
refreshed for grace_s (lease.py). Hosts of the version before manifests list only .bin names:
they neither see nor touch .manifest and blocks/ ([shared] whole_files sends both forms for
them during an upgrade).

One object per save, written once and never overwritten. That is what makes two hosts saving
the same conversation safe:
  * no torn or mixed object: S3 makes an object visible only when its PUT (or the whole
    multipart upload) has completed, and no object is ever written twice, so a reader gets
    exactly one save's bytes;
  * the newer save wins, whatever order the uploads arrive in: the current save of a
    conversation is the one whose name sorts last (saved_at, then host) — a slow upload of an
    older save that lands later is simply not the newest. No read-compare-write race exists
    because nothing is compared before a write. Saves superseded for longer than `grace_s` are
    removed by the bucket prune (a download that chose one just before has that long to finish);
  * a LIST tells everything find() needs (name, saved_at, n_tokens, host, size), so looking
    for a session costs one request per 1,000 objects, no HEAD per object.
"Newer" is the saving host's wall clock: hosts whose clocks disagree by more than the time
between two saves of one conversation may pick the other's save; NTP keeps that far below a turn.

Object metadata (x-amz-meta-*) repeats the local store.Meta (key, model, n_tokens, saved_at,
save_ms, bytes, host). The token list is not copied anywhere: it is the slot file's own header
(autosessd/store/slotfile.py), read with one ranged GET by tokens().

Here too: the tier's errors (SharedError and its kinds), the download estimate, the bucket
prune's plan, and the credentials file. Pure: tested alone (tests/shared/test_shared.py).
"""

from __future__ import annotations

import configparser
import email.utils
import hashlib
import os
import re
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..store.names import AUTO_BIN, MANUAL_NAME

FORMAT = "1"  # x-amz-meta-autosessd-format: the layout above
FORMAT_BLOCKS = "2"  # a manifest and its blocks
SESSIONS = "sessions/"
BLOCKS = "blocks/"
LEASE = "leases/prune.json"
MANIFEST = ".manifest"
_OBJ = re.compile(r"^sessions/(?P<model>[A-Za-z0-9._-]{1,64})/(?P<stem>[A-Za-z0-9_-][A-Za-z0-9._-]{0,127})/"
                  r"(?P<us>\d{20})-(?P<n>\d{10})-(?P<host>[A-Za-z0-9][A-Za-z0-9.-]{0,62}?)(?P<kind>\.bin|\.manifest)$")
_BLOCK = re.compile(r"^blocks/(?P<key>[0-9a-f]{32})\.blk$")
_MODEL_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_HOST_BAD = re.compile(r"[^A-Za-z0-9.-]+")


class SharedError(Exception):
    """A shared-tier operation that did not happen; says what and why. The turn goes on without it."""


class AlreadyHere(SharedError):
    """A download found the local save as new as the bucket's: nothing was downloaded (not a failure)."""


class BadObject(SharedError):
    """The object is not the save its host made: fewer or more bytes than its own metadata
    says, another digest, a header that disagrees. Remembered by its key (SharedStore.bad):
    never fetched again, and the bucket is not taken for down because of it."""


class LocalFailure(SharedError):
    """A download that failed on this host's side (writing the file here, reading it back):
    not the bucket's nor the link's, so no backoff starts and nothing is learned of the link's
    rate from it."""


class LocalWrite(Exception):
    """Writing a downloaded block's bytes here failed (an OSError of the local disk, not of the
    bucket: fetching.py keeps the two apart, since both are OSErrors)."""

    def __init__(self, e: OSError):
        super().__init__(e.strerror or str(e))
        self.error = e


class Incompatible(SharedError):
    """The bucket's save has a KV layout this engine cannot load: refused, the local file stays."""


class Unavailable(SharedError):
    """The tier cannot run here at all (boto3 missing, no credentials): a setup problem."""


@dataclass(frozen=True)
class RemoteSession:
    """One save in the bucket, as a LIST shows it."""

    key: str  # the object's key, prefix included
    model: str  # the model id in the key (the engine's fingerprint when it is a plain name)
    name: str  # the local file name it restores to: <stem>.bin
    saved_at: float  # the saving host's clock, seconds
    n_tokens: int
    host: str
    bytes: int  # the object's (a manifest's: its own few KB, until the catalog has read it)
    modified: float  # the store's Last-Modified, seconds (the server's clock)
    manifest: bool = False  # a manifest naming blocks (format 2), not a whole slot file

    @property
    def conversation_key(self) -> str | None:
        m = AUTO_BIN.match(self.name)
        return m.group(1) if m else None

    @property
    def order(self) -> tuple[int, str]:
        """Newer sorts later: saved_at in µs (as in the name), then host."""
        return (round(self.saved_at * 1e6), self.host)


@dataclass(frozen=True)
class Estimate:
    """Download-and-restore against re-reading the prompt, in seconds. None: not known yet."""

    download_s: float | None
    reread_s: float | None
    down_bytes_s: float | None
    prefill_tokens_s: float | None
    # Why no download is tried at all right now (the bucket does not answer, or a download just
    # failed and its backoff runs): a turn must not wait out a timeout it can foresee.
    blocked: str | None = None

    @property
    def worth(self) -> bool:
        """Download unless it is known to cost more, or the bucket is known not to answer.
        Unknown throughput: download, and so measure it."""
        if self.blocked is not None:
            return False
        if self.download_s is None or self.reread_s is None:
            return True
        return self.download_s < self.reread_s

    def line(self, name: str, n_bytes: int, n_tokens: int) -> str:
        if self.blocked is not None:
            return f"shared: {name} ({n_bytes / 1e9:.2f} GB): not downloaded: {self.blocked}"
        down = (f"download ~{self.download_s:.1f} s at {self.down_bytes_s / 1e6:,.0f} MB/s"
                if self.download_s is not None else "download time unknown (nothing measured yet)")
        reread = (f"re-reading {n_tokens:,} tokens ~{self.reread_s:.1f} s at {self.prefill_tokens_s:,.0f} tokens/s"
                  if self.reread_s is not None else f"re-reading {n_tokens:,} tokens: prefill rate unknown")
        return (f"shared: {name} ({n_bytes / 1e9:.2f} GB): {down} vs {reread}: "
                f"{'downloading' if self.worth else 'skipped, re-reading is faster'}")


def estimate(n_bytes: int, n_tokens: int, down_bytes_s: float | None, prefill_tokens_s: float | None,
             restore_bytes_s: float | None = None, latency_s: float = 0.05,
             restore_n_bytes: int | None = None) -> Estimate:
    """Pure: time to download n_bytes and restore restore_n_bytes (default: n_bytes; a manifest's
    download fetches only the blocks the host lacks, its restore reads them all) vs time to
    prefill n_tokens.

    down_bytes_s: measured download throughput (SharedStore keeps it); prefill_tokens_s: the
    engine's prompt rate (llama-server reports timings.prompt_per_second); restore_bytes_s: the
    local restore's rate when known (a restore reads the file back from the page cache)."""
    download_s = None
    if down_bytes_s and down_bytes_s > 0:
        download_s = latency_s + n_bytes / down_bytes_s
        if restore_bytes_s and restore_bytes_s > 0:
            download_s += (n_bytes if restore_n_bytes is None else restore_n_bytes) / restore_bytes_s
    reread_s = n_tokens / prefill_tokens_s if prefill_tokens_s and prefill_tokens_s > 0 else None
    return Estimate(download_s, reread_s, down_bytes_s, prefill_tokens_s)


@dataclass(frozen=True)
class BucketPrunePlan:
    remove: list[RemoteSession]
    keep: list[RemoteSession]
    superseded: int  # of `remove`, older saves of a conversation that has a newer one
    freed: int = 0  # bytes the removed saves alone held (a block another kept save names is not counted)


def plan_bucket_prune(saves: Iterable[RemoteSession], keep: int, max_bytes: int, now: float,
                      grace_s: float, blocks: dict[str, tuple[str, ...]] | None = None,
                      block_bytes: dict[str, int] | None = None) -> BucketPrunePlan:
    """Pure. The newest save of each (model, name) is current (a whole file and a manifest of
    the same save, [shared] whole_files, are one save); older ones go once they have been
    superseded for grace_s (server clock: `now` and `modified` both come from the store). Of
    the current saves the newest `keep` and at most max_bytes stay.

    blocks: a manifest's key → the blocks it names, block_bytes: a block's bytes. A save's cost
    is its object plus the blocks no newer kept save named before it: a block is counted once,
    whatever shares it (a manifest whose blocks are not known costs its object only)."""
    blocks, block_bytes = blocks or {}, block_bytes or {}
    groups: dict[tuple[str, str], list[RemoteSession]] = {}
    for s in saves:
        groups.setdefault((s.model, s.name), []).append(s)
    current: list[list[RemoteSession]] = []
    remove, kept = [], []
    superseded = 0
    for versions in groups.values():
        versions.sort(key=lambda s: s.order, reverse=True)
        top = versions[0].order
        current.append([s for s in versions if s.order == top])
        newest_seen = min(s.modified for s in current[-1])
        for old in versions[len(current[-1]):]:
            # Superseded since the newer one appeared; its own age does not matter. (`now`
            # comes from an HTTP Date, whole seconds: an age is under-, never overestimated.)
            if grace_s <= 0 or now - newest_seen >= grace_s:
                remove.append(old)
                superseded += 1
            else:
                kept.append(old)
    counted: set[str] = set()  # the blocks of current saves kept so far (superseded ones in their grace are
    # kept beside the budget, as before blocks: they do not make a current save cheaper)

    def cost(s: RemoteSession) -> int:
        return s.bytes + sum(block_bytes.get(b, 0) for b in set(blocks.get(s.key, ())) - counted)

    total = 0
    n = 0
    for same in sorted(current, key=lambda v: v[0].order, reverse=True):
        c = sum(cost(s) for s in same)
        if n < keep and total + c <= max_bytes:
            kept.extend(same)
            total += c
            n += 1
            for s in same:
                counted.update(blocks.get(s.key, ()))
        else:
            remove.extend(same)
    still = {b for s in kept for b in blocks.get(s.key, ())}
    freed = sum(s.bytes for s in remove)
    freed += sum(block_bytes.get(b, 0) for b in {b for s in remove for b in blocks.get(s.key, ())} - still)
    return BucketPrunePlan(remove=remove, keep=kept, superseded=superseded, freed=freed)


def plan_block_prune(listed: dict[str, tuple[int, float]], named: set[str], listed_at: float,
                     grace_s: float) -> list[str]:
    """Pure. The blocks (key → (bytes, Last-Modified)) to remove: named by no manifest the
    prune listed at `listed_at` (server clock) and not written or refreshed since grace_s
    before that. An upload refreshes a block it counts on when it is older than grace_s / 2
    and puts its manifest within grace_s / 2 (blockobjects.py): a block it counts on is either
    named by a manifest listed, or younger than grace_s, so never removed under it."""
    return sorted(k for k, (_, modified) in listed.items()
                  if k not in named and (grace_s <= 0 or listed_at - modified >= grace_s))


def model_id(model: str) -> str:
    """The model's folder in the bucket: the fingerprint itself when it is a plain name."""
    return model if _MODEL_ID.match(model) else "h-" + hashlib.sha1(model.encode()).hexdigest()[:16]


def default_host() -> str:
    h = _HOST_BAD.sub("-", socket.gethostname()).strip("-.")[:63]
    return h or "host"


def stem_of(name: str) -> str:
    """A local session file name → its stem in the bucket; SharedError when it is not one."""
    if not name.endswith(".bin") or not (AUTO_BIN.match(name) or MANUAL_NAME.match(name)) or "/" in name:
        raise SharedError(f"{name[:64]!r} is not a session file name")
    return name[:-4]


def parse_key(prefix: str, key: str, size: int, modified: float) -> RemoteSession | None:
    """A listed object → RemoteSession, or None when the name is not one autosessd owns."""
    if not key.startswith(prefix):
        return None
    m = _OBJ.match(key[len(prefix):])
    if not m:
        return None
    return RemoteSession(key=key, model=m["model"], name=m["stem"] + ".bin", saved_at=int(m["us"]) / 1e6,
                         n_tokens=int(m["n"]), host=m["host"], bytes=size, modified=modified,
                         manifest=m["kind"] == MANIFEST)


def block_object(prefix: str, key: str) -> str:
    """The object holding block `key` (store/blocks.py's key: 32 hex digits)."""
    return f"{prefix}{BLOCKS}{key}.blk"


def parse_block_key(prefix: str, key: str) -> str | None:
    """A listed object → the block key it holds, or None when it is not a block autosessd owns."""
    if not key.startswith(prefix):
        return None
    m = _BLOCK.match(key[len(prefix):])
    return m["key"] if m else None


def read_credentials(path: str) -> dict[str, str]:
    """AWS's credentials INI ([default] or the file's only section): aws_access_key_id,
    aws_secret_access_key, optionally aws_session_token. Refused when others can read it."""
    try:
        st = os.stat(path)
        text = Path(path).read_text()
    except OSError as e:
        raise Unavailable(f"credentials_file {path}: {e.strerror or e}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise Unavailable(f"credentials_file {path} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                          f"chmod 600 it")
    cp = configparser.ConfigParser()
    try:
        cp.read_string(text, source=path)
    except configparser.Error as e:
        raise Unavailable(f"credentials_file {path}: not an INI file ({e.message.splitlines()[0]})") from None
    sections = cp.sections()
    section = "default" if "default" in sections else (sections[0] if len(sections) == 1 else None)
    if section is None:
        raise Unavailable(f"credentials_file {path}: needs a [default] section (found {', '.join(sections) or 'none'})")
    sec = cp[section]
    missing = [k for k in ("aws_access_key_id", "aws_secret_access_key") if not sec.get(k)]
    if missing:
        raise Unavailable(f"credentials_file {path}: [{section}] lacks {' and '.join(missing)}")
    out = {"aws_access_key_id": sec["aws_access_key_id"], "aws_secret_access_key": sec["aws_secret_access_key"]}
    if sec.get("aws_session_token"):
        out["aws_session_token"] = sec["aws_session_token"]
    return out


def _http_date(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None


def _why(e: BaseException) -> str:
    """A boto error in one line: the S3 error code and message, or the connection problem."""
    resp = getattr(e, "response", None)
    if isinstance(resp, dict) and resp.get("Error"):
        err = resp["Error"]
        code = err.get("Code") or resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        msg = err.get("Message") or ""
        return f"{code}{': ' + msg if msg and msg != 'None' else ''}"
    return str(e) or type(e).__name__
