"""The [shared] section (DESIGN §6, §9): its keys, their defaults, and the checks a config's
[shared] must pass, each naming the key and the reason."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class SharedConfig:
    """[shared]: an S3-compatible bucket under the session directory (autosessd/shared/).

    Credentials never live here: they come from the environment (AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN), from `credentials_file` (AWS's INI format), or
    from boto3's own chain (instance roles)."""

    endpoint_url: str = ""  # required: http(s)://host[:port] of the S3 API
    bucket: str = ""  # required; autosessd creates nothing, the bucket must exist
    prefix: str = "autosessd/"  # everything autosessd writes lies under it
    region: str = "us-east-1"
    credentials_file: str | None = None
    host: str | None = None  # this host's name in object names; default: the machine's hostname
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    part_mb: int = 16  # files larger than this go up in parts of this size
    keep: int = 1000  # bucket prune: the newest saves kept ...
    max_gb: float = 1000.0  # ... and at most this much of them
    lease_s: float = 600.0  # a bucket prune's lease: another host takes over after this long unrenewed
    grace_s: float = 600.0  # a superseded save stays this long (another host may be downloading it)
    retry_max_s: float = 300.0  # longest wait between two attempts of a failed upload
    # A download runs on the request's path (the turn waits for it): past this the turn gives
    # it up and the request re-reads its prompt. The estimate already skips downloads slower
    # than re-reading; this bounds a link that stalls.
    download_timeout_s: float = 120.0
    # How often the bucket's list (and the token lists of saves new to it) is read again, off
    # the request's path: a save another host uploaded is found by turns here after at most this.
    list_every_s: float = 5.0
    # How often this host tries the bucket prune (under the lease: one host at a time); 0: only
    # `autosessctl prune --shared`.
    prune_every_s: float = 600.0
    # A save kept as token blocks goes up as its manifest and the blocks the bucket lacks; true:
    # as a whole file too, which hosts of the version before manifests (1.x) find. For a
    # rolling upgrade; off again once every host runs this version.
    whole_files: bool = False


_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


_PREFIX = re.compile(r"^([A-Za-z0-9._-]+/)*$")


_HOST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,62}$")


_REGION = re.compile(r"^[a-z0-9-]{1,32}$")


def validate_shared(s: SharedConfig, bad) -> None:
    if not s.endpoint_url:
        bad("shared.endpoint_url", "missing: the S3 endpoint, e.g. https://s3.example.com or http://127.0.0.1:7480")
    parts = urlsplit(s.endpoint_url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        bad("shared.endpoint_url", f"must be an http:// or https:// URL with a host and no path, got {s.endpoint_url!r}")
    try:
        _ = parts.port
    except ValueError:
        bad("shared.endpoint_url", f"has an invalid port: {s.endpoint_url!r}")
    if parts.username or parts.password:
        bad("shared.endpoint_url", "must not carry credentials; use the environment or credentials_file")
    if not s.bucket:
        bad("shared.bucket", "missing: the name of an existing bucket")
    if not _BUCKET.match(s.bucket) or ".." in s.bucket:
        bad("shared.bucket", f"is not a valid bucket name (3-63 of a-z 0-9 . -, starting and ending with a letter "
                             f"or digit), got {s.bucket!r}")
    if not _PREFIX.match(s.prefix) or len(s.prefix) > 256:
        bad("shared.prefix", f"must be empty or folders ending in '/' (letters, digits, . _ -), got {s.prefix!r}")
    if not _REGION.match(s.region):
        bad("shared.region", f"must be a region name like us-east-1, got {s.region!r}")
    if s.credentials_file is not None and not os.path.isabs(s.credentials_file):
        bad("shared.credentials_file", f"must be an absolute path, got {s.credentials_file!r}")
    if s.host is not None and not _HOST_ID.match(s.host):
        bad("shared.host", f"must be 1-63 of letters, digits, . and -, got {s.host!r}")
    for key in ("connect_timeout_s", "read_timeout_s", "max_gb", "retry_max_s", "download_timeout_s"):
        if not getattr(s, key) > 0:
            bad(f"shared.{key}", f"must be more than 0, got {getattr(s, key)}")
    if not 5 <= s.part_mb <= 5120:
        bad("shared.part_mb", f"must be 5 to 5120 (S3's limits for a part), got {s.part_mb}")
    if s.keep < 1:
        bad("shared.keep", f"must be 1 or more, got {s.keep}")
    if s.lease_s < 10:
        bad("shared.lease_s", f"must be 10 or more (seconds), got {s.lease_s}")
    if s.grace_s < 0:
        bad("shared.grace_s", f"must be 0 or more, got {s.grace_s}")
    if s.list_every_s < 0.5:
        bad("shared.list_every_s", f"must be 0.5 or more (seconds), got {s.list_every_s}")
    if s.prune_every_s < 0 or 0 < s.prune_every_s < 10:
        bad("shared.prune_every_s", f"must be 0 (never by itself) or 10 or more (seconds), got {s.prune_every_s}")
