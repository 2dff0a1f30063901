"""The shared tier: an S3-compatible bucket below the session directory (DESIGN §9).

Several engine hosts behind a load balancer point their autosessd at one bucket. A save,
once finalized locally, is uploaded off the request's path; a turn whose conversation has no
local file can find a save another host made and download it into the session directory.

Each part owns its section of what it guarantees, in its docstring:

  bucket.py     the layout in the bucket (one object per save, never overwritten: the newer
                save wins by name; a save kept as blocks is a manifest naming block objects),
                the tier's errors, the download estimate and the bucket prune's plans; pure,
                no boto3
  uploads.py    the upload queue and its one worker thread, retries, the re-queue at start
  blockobjects.py  a manifest's blocks the bucket lacks sent before it; a manifest read and
                checked, its blocks fetched and checked
  downloads.py  decide (download or re-read), the download's backoff and rate, download()
                into the session directory through Store.install (a manifest's: the engine's
                file written from the blocks as they come)
  lease.py      the bucket prune under a lease taken with conditional PUTs
  tier.py       SharedStore: the client, its configuration, counters, listing, status,
                composed with the three above

Threads: boto3 is synchronous. The upload worker is one thread of its own (it sends a save's
blocks four at a time); find(), tokens(),
download() and prune_bucket() block, and the daemon calls them with asyncio.to_thread (the
client is thread-safe). Nothing here raises into a request for a tier failure except as
SharedError, which the caller logs and answers by running the turn as if there were no bucket.

May import: base and store (it installs downloads through the store; the sessions call it).
"""

from .bucket import (FORMAT, LEASE, SESSIONS, AlreadyHere, BadObject, BucketPrunePlan, Estimate, Incompatible,
                     RemoteSession, SharedError, Unavailable, default_host, estimate, model_id, parse_key,
                     plan_bucket_prune, read_credentials, stem_of)
from .downloads import CHUNK, DOWN_BACKOFF_S, DOWN_RATE_MIN_S
from .lease import STALE_MULTIPART_S, Lease
from .tier import Counters, SharedStore

__all__ = ["AlreadyHere", "BadObject", "BucketPrunePlan", "CHUNK", "Counters", "DOWN_BACKOFF_S", "DOWN_RATE_MIN_S", "Estimate",
           "FORMAT", "Incompatible", "LEASE", "Lease", "RemoteSession", "SESSIONS", "STALE_MULTIPART_S",
           "SharedError", "SharedStore", "Unavailable", "default_host", "estimate", "model_id", "parse_key",
           "plan_bucket_prune", "read_credentials", "stem_of"]
