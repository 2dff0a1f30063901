"""The bucket by block, against the real S3 server (Ceph RGW): a save kept as token blocks goes up
as the blocks the bucket lacks and then its manifest; another host fetches only the blocks it
lacks; a damaged block object is refused before anything is installed; the bucket prune and
forget take blocks only when no manifest names them. Blocks of 4 tokens (the real 128 on the
Llama-3-8B shape are bench/shared.py's), files in llama-server's own layout (kv_common)."""

from __future__ import annotations

import time

import pytest

from autosessd.base.files import digest_file
from autosessd.shared import BadObject
from autosessd.shared.blockobjects import refs_of
from autosessd.store import blocks
from autosessd.store.directory import Meta, Store
from autosessd.store.names import QUARANTINE
from autosessd.store.runs import decode
from kv_common import slot_file
from shared_common import MODEL, objects

pytestmark = pytest.mark.s3

A = "a0a0a0a0a0a0a0a0"
B = "b0b0b0b0b0b0b0b0"
PROMPT = list(range(500, 540))  # ten blocks both conversations share


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(blocks, "BLOCK_TOKENS", 4)


def save(store: Store, key: str, tokens: list[int], saved_at: float | None = None, **kw) -> Meta:
    data = slot_file(tokens, **kw)
    store.temp_path(key).write_bytes(data)
    meta = store.finalize(key, Meta(key, len(tokens), len(data), saved_at or time.time(), MODEL, 1.0))
    assert meta.in_blocks
    return meta


def bucket_state(gw, bucket) -> tuple[dict[str, int], dict[str, int]]:
    """(manifests, blocks) in the bucket: object key → bytes."""
    objs = objects(gw, bucket)
    return ({k: v for k, v in objs.items() if k.endswith(".manifest")},
            {k: v for k, v in objs.items() if k.startswith("team/blocks/")})


def no_manifest_names_a_missing_block(gw, bucket) -> None:
    import json

    manifests, there = bucket_state(gw, bucket)
    c = gw.client()
    for k in manifests:
        meta = Meta.from_json(c.get_object(Bucket=bucket, Key=k)["Body"].read())
        for r in refs_of(meta):
            assert f"team/blocks/{r.key}.blk" in there, (k, r.key, json.dumps(sorted(there))[:200])


def up(sh, store, key):
    return sh.upload_now(store.bin_path(key), store.read_meta(key))


def test_each_turn_sends_only_the_blocks_the_bucket_lacks_then_its_manifest(hosts, s3_gateway, s3_bucket):
    (h1, s1), = hosts(1)
    h1.start(s1)
    toks = PROMPT + list(range(1, 11))  # 50 tokens: 12 whole blocks and a partial one
    save(s1, A, toks)
    assert up(h1, s1, A) == "done"
    manifests, there = bucket_state(s3_gateway, s3_bucket)
    assert len(manifests) == 1 and len(there) == 13
    assert not [k for k in objects(s3_gateway, s3_bucket) if k.endswith(".bin")]  # no whole file went up
    st = h1.status()
    assert st["manifests_up"] == 1 and st["blocks_up"] == 13 and st["blocks_skipped"] == 0

    # The next turn: 6 tokens more. Only its new blocks go (the old partial one stays for the prune).
    sent0 = st["bytes_up_blocks"]
    save(s1, A, toks + [11, 12, 13, 14, 15, 16])
    assert up(h1, s1, A) == "done"
    st = h1.status()
    assert st["blocks_up"] == 13 + 2 and st["blocks_skipped"] == 12
    block = 64 + 4 * 3 * 2 * 16 + 4 * 12  # header, K and V of 3 layers, the cells' meta: a whole block's object
    turn = st["bytes_up_blocks"] - sent0
    manifest_bytes = len(s1.read_meta(A).to_json()) + 200
    assert turn <= 2 * block + manifest_bytes, (turn, block)
    assert turn < s1.read_meta(A).bytes  # less than the whole file would have been
    assert st["bytes_whole_files"] > st["bytes_up_blocks"]
    no_manifest_names_a_missing_block(s3_gateway, s3_bucket)


def test_another_host_fetches_only_the_blocks_it_lacks_and_restores_the_same_bytes(hosts, s3_gateway, s3_bucket):
    (h1, s1), (h2, s2) = hosts(2)
    h1.start(s1)
    save(s1, A, PROMPT + list(range(1, 31)))
    assert up(h1, s1, A) == "done"
    save(s2, B, PROMPT + [9, 9, 9, 9])  # host2 holds the shared prompt already
    [found] = h2.find(MODEL)
    assert found.manifest and found.host == "host1"
    h2.download(found, s2)
    st = h2.status()
    assert st["blocks_held"] == 10 and st["blocks_fetched"] == 8  # 30 tokens: 7 whole blocks and a partial one
    assert st["bytes_fetched"] < s1.read_meta(A).bytes
    # The blocks were written into the engine's file as they came (held ones read here): it is
    # installed whole, host1's file byte for byte, and what the engine reads at once.
    a1 = s1.stage(f"auto-{A}.bin")
    got = s2.read_meta(A)
    assert not got.in_blocks and got.host == "host1" and got.digest == digest_file(s2.bin_path(A))[0]
    assert s2.bin_path(A).read_bytes() == (s1.staging / a1.name).read_bytes()
    assert s2.stage(f"auto-{A}.bin").name == f"auto-{A}.bin"
    # Kept as blocks after its restore (the daemon: Upkeep.keep_as_blocks): only those it lacked are written.
    before = s2.blocks.bytes_written
    assert "kept as" in s2.import_whole(A)
    got = s2.read_meta(A)
    assert got.in_blocks and got.host == "host1" and decode(got.tokens) == PROMPT + list(range(1, 31))
    assert s2.blocks.bytes_written - before == st["bytes_fetched"]
    a2 = s2.stage(f"auto-{A}.bin")
    assert (s1.staging / a1.name).read_bytes() == (s2.staging / a2.name).read_bytes()


def test_a_file_whose_engine_kept_its_cells_out_of_order_comes_down_under_its_own_digest(hosts, s3_gateway,
                                                                                        s3_bucket):
    """The engine's file holds its cells in cache order (a unified cache); the file made from
    the blocks holds them by position: other bytes than the saving host's (its manifest's
    digest), the same tokens and KV. Installed under its own digest, it is kept as blocks after,
    not taken for damaged."""
    (h1, s1), (h2, s2) = hosts(2)
    h1.start(s1)
    tokens = PROMPT + list(range(1, 11))
    save(s1, A, tokens, order=list(range(30, 50)) + list(range(30)))
    assert up(h1, s1, A) == "done"
    [found] = h2.find(MODEL)
    h2.download(found, s2)
    got = s2.read_meta(A)
    assert got.digest == digest_file(s2.bin_path(A))[0] != s1.read_meta(A).digest
    assert "kept as" in s2.import_whole(A) and s2.read_meta(A).in_blocks
    assert not (s2.path / QUARANTINE).exists() or not any((s2.path / QUARANTINE).iterdir())


def test_a_damaged_block_held_here_is_fetched_from_the_bucket_instead(hosts, s3_gateway, s3_bucket):
    (h1, s1), (h2, s2) = hosts(2)
    h1.start(s1)
    save(s1, A, PROMPT + list(range(1, 31)))
    assert up(h1, s1, A) == "done"
    held = save(s2, B, PROMPT + [9, 9, 9, 9])
    victim = s2.blocks.path(held.blocks[2][0])
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF  # a byte of host2's own copy of a prompt block changed on its disk
    victim.write_bytes(bytes(raw))
    [found] = h2.find(MODEL)
    h2.download(found, s2)
    st = h2.status()
    assert st["blocks_held"] == 9 and st["blocks_fetched"] == 9 and st["download_failures"] == 0
    a1 = s1.stage(f"auto-{A}.bin")
    assert s2.bin_path(A).read_bytes() == (s1.staging / a1.name).read_bytes()


def test_a_damaged_block_object_is_refused_before_anything_is_installed(hosts, s3_gateway, s3_bucket):
    (h1, s1), (h2, s2) = hosts(2)
    h1.start(s1)
    meta = save(s1, A, PROMPT)
    assert up(h1, s1, A) == "done"
    c = s3_gateway.client()
    victim = f"team/blocks/{meta.blocks[3][0]}.blk"
    data = bytearray(c.get_object(Bucket=s3_bucket, Key=victim)["Body"].read())
    data[-1] ^= 0xFF  # a flipped byte: the payload no longer matches the header's digest
    c.put_object(Bucket=s3_bucket, Key=victim, Body=bytes(data))
    [found] = h2.find(MODEL)
    with pytest.raises(BadObject, match="damaged"):
        h2.download(found, s2)
    assert s2.read_meta(A) is None  # nothing installed: the turn re-reads
    assert h2.is_bad(found.key) and h2.is_bad(victim) and h2.status()["downloads_refused_bad"] == 1
    # A torn one (cut short) too.
    c.put_object(Bucket=s3_bucket, Key=victim, Body=bytes(data[:100]))
    h3 = hosts(1)[0]
    with pytest.raises(BadObject):
        h3[0].download(found, h3[1])


def test_a_full_disk_during_a_download_fails_it_without_blaming_the_bucket(hosts, s3_gateway, s3_bucket,
                                                                          monkeypatch):
    """The disk's error is not the object's nor the link's: the download fails saying so,
    nothing is installed or left behind, nothing in the bucket is taken for damaged, and no
    backoff starts nor is a link rate learned from it (the next turn tries again)."""
    import errno

    from autosessd.shared import SharedError
    from autosessd.store import placing

    (h1, s1), (h2, s2) = hosts(2)
    h1.start(s1)
    save(s1, A, PROMPT)
    assert up(h1, s1, A) == "done"
    write, calls = placing.Placer.write, []

    def full(self, i, at, data):
        calls.append(i)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, i, at, data)

    monkeypatch.setattr(placing.Placer, "write", full)
    [found] = h2.find(MODEL)
    with pytest.raises(SharedError, match="writing it here: No space left on device"):
        h2.download(found, s2)
    assert s2.read_meta(A) is None and not list(s2.path.glob("*partial*"))
    assert not h2.is_bad(found.key) and h2.status()["downloads_refused_bad"] == 0
    assert h2.download_blocked() is None and h2.download_bytes_per_s is None
    monkeypatch.setattr(placing.Placer, "write", write)
    h2.download(found, s2)  # the disk has room again
    assert s2.bin_path(A).read_bytes() == (s1.staging / s1.stage(f"auto-{A}.bin").name).read_bytes()


def test_a_manifest_whose_blocks_are_not_its_tokens_is_refused(hosts, s3_gateway, s3_bucket):
    """A peer's manifest naming blocks of other tokens (a bug, or a forged object) is refused: the
    keys are checked against the chain of its own tokens before any block is fetched."""
    import dataclasses

    from autosessd.store.slotfile import encode

    (h1, s1), (h2, s2) = hosts(2)
    h1.start(s1)
    meta = save(s1, A, PROMPT)
    assert up(h1, s1, A) == "done"
    c = s3_gateway.client()
    [key] = bucket_state(s3_gateway, s3_bucket)[0]
    other = list(PROMPT)
    other[5] = 7  # the same blocks named for other tokens: every key from the second block on is wrong
    forged = dataclasses.replace(meta, tokens=encode(other), saved_at=meta.saved_at + 5, host="host9")
    fkey = key.replace(f"{round(meta.saved_at * 1e6):020d}", f"{round(forged.saved_at * 1e6):020d}")
    fkey = fkey.replace("-host1.manifest", "-host9.manifest")
    c.put_object(Bucket=s3_bucket, Key=fkey, Body=forged.to_json())
    [found] = h2.find(MODEL)
    assert found.key == fkey
    with pytest.raises(BadObject, match="not those of its tokens"):
        h2.download(found, s2)
    assert s2.read_meta(A) is None and h2.status()["blocks_fetched"] == 0


def test_the_prune_takes_blocks_no_manifest_names_and_never_one_a_manifest_names(hosts, s3_gateway, s3_bucket):
    (h1, s1), = hosts(1, grace_s=0)
    h1.start(s1)
    save(s1, A, PROMPT + [1, 2])
    assert up(h1, s1, A) == "done"
    save(s1, B, PROMPT + [7, 7, 7, 7])
    assert up(h1, s1, B) == "done"
    save(s1, A, PROMPT + [1, 2, 3, 4, 5, 6])  # A's next turn: its old partial block is named no more
    assert up(h1, s1, A) == "done"
    manifests, there = bucket_state(s3_gateway, s3_bucket)
    assert len(manifests) == 3 and len(there) == 10 + 1 + 1 + 2
    report = h1.prune_bucket()
    manifests, there = bucket_state(s3_gateway, s3_bucket)
    assert report["removed"] == 1 and report["blocks_removed"] == 1 and len(manifests) == 2 and len(there) == 13
    no_manifest_names_a_missing_block(s3_gateway, s3_bucket)
    # keep 1: B (older) goes, and its own block; the shared prompt stays, A names it.
    report = h1.prune_bucket(keep=1)
    manifests, there = bucket_state(s3_gateway, s3_bucket)
    assert len(manifests) == 1 and len(there) == 12 and report["blocks_removed"] == 1
    no_manifest_names_a_missing_block(s3_gateway, s3_bucket)


def test_a_block_is_kept_through_the_grace_whatever_the_manifests_say(hosts, s3_gateway, s3_bucket):
    """An upload that counted on a block (it was there) puts its manifest within grace_s / 2: a
    block no manifest names yet is kept for grace_s after it was written or refreshed."""
    (h1, s1), = hosts(1, grace_s=3600)
    h1.start(s1)
    save(s1, A, PROMPT)
    assert up(h1, s1, A) == "done"
    c = s3_gateway.client()
    [m] = bucket_state(s3_gateway, s3_bucket)[0]
    c.delete_object(Bucket=s3_bucket, Key=m)  # as a prune elsewhere or a forget would
    report = h1.prune_bucket()
    assert report["blocks_remove"] == 0 and len(bucket_state(s3_gateway, s3_bucket)[1]) == 10


def test_a_block_written_again_after_the_prune_listed_it_is_not_removed(hosts, s3_gateway, s3_bucket):
    """The prune decides from its listing; an upload may refresh a block after it (its manifest
    then lands after the prune's list of manifests): each block is looked at again just before
    its removal, and one written since stays."""
    (h1, s1), = hosts(1)
    h1.start(s1)
    meta = save(s1, A, PROMPT)
    assert up(h1, s1, A) == "done"
    listed, _ = h1.list_blocks()
    time.sleep(2.1)  # a HEAD says Last-Modified in whole seconds: a write 1 s later may not show
    c = s3_gateway.client()
    fresh = meta.blocks[2][0]
    obj = f"team/blocks/{fresh}.blk"
    c.copy_object(Bucket=s3_bucket, Key=obj, CopySource={"Bucket": s3_bucket, "Key": obj}, MetadataDirective="REPLACE",
                  Metadata={"autosessd-format": "2"})  # as an upload refreshes it
    still = h1.unchanged(sorted(listed), listed)
    assert fresh not in still and len(still) == len(listed) - 1


def test_forget_takes_its_manifests_and_the_blocks_no_other_manifest_names(hosts, s3_gateway, s3_bucket):
    (h1, s1), (h2, s2) = hosts(2, grace_s=0)
    h1.start(s1)
    h2.start(s2)
    save(s1, A, PROMPT + [1, 2, 3, 4, 5])
    assert up(h1, s1, A) == "done"
    save(s2, B, PROMPT + [8, 8, 8, 8])
    assert up(h2, s2, B) == "done"
    removed = h1.forget({f"auto-{A}.bin"})
    assert len([k for k in removed if k.startswith("blocks/")]) == 2  # A's own two; the prompt's stay, B names them
    manifests, there = bucket_state(s3_gateway, s3_bucket)
    assert len(manifests) == 1 and len(there) == 11
    no_manifest_names_a_missing_block(s3_gateway, s3_bucket)


def test_forget_leaves_blocks_written_within_the_grace_to_the_prune(hosts, s3_gateway, s3_bucket):
    """Another host's upload may count on a block written lately (its manifest not up yet):
    forget takes the manifests at once, such blocks only once the grace has passed."""
    (h1, s1), = hosts(1, grace_s=3600)
    h1.start(s1)
    save(s1, A, PROMPT)
    assert up(h1, s1, A) == "done"
    removed = h1.forget({f"auto-{A}.bin"})
    manifests, there = bucket_state(s3_gateway, s3_bucket)
    assert len(removed) == 1 and not manifests and len(there) == 10
    assert h1.prune_bucket(max_gb=1)["blocks_remove"] == 0  # still within the grace


def test_with_whole_files_a_save_goes_up_in_both_forms_for_hosts_of_the_version_before(hosts, s3_gateway,
                                                                                        s3_bucket):
    from autosessd.shared import parse_key

    (h1, s1), (h2, s2) = hosts(2, whole_files=True)
    h1.start(s1)
    save(s1, A, PROMPT + [1, 2])
    assert up(h1, s1, A) == "done"
    objs = objects(s3_gateway, s3_bucket)
    assert len([k for k in objs if k.endswith(".manifest")]) == 1
    # What a host of the version before manifests lists: one save, a whole slot file.
    [whole] = [k for k in objs if k.endswith(".bin")]
    assert parse_key("team/", whole, objs[whole], 0.0) is not None
    # A host of this version takes the manifest (its blocks) and the prune keeps both, one save.
    [found] = h2.find(MODEL)
    assert found.manifest
    assert h2.prune_bucket()["remove"] == 0


CHILD = r"""
import random, sys, time
from autosessd.store import blocks
blocks.BLOCK_TOKENS = 4
from autosessd.shared import SharedStore
from autosessd.store.directory import Meta, Store
from kv_common import slot_file
from shared_common import MODEL, shared_cfg

class Gw:
    endpoint = sys.argv[1]
sh = SharedStore(shared_cfg(Gw, sys.argv[2], host="host1", grace_s=0))
store = Store(sys.argv[3])
sh.start(store)
rng = random.Random(int(sys.argv[4]))
print("ready", flush=True)
n = 0
while True:
    n += 1
    key = rng.choice(["a1a1a1a1a1a1a1a1", "b1b1b1b1b1b1b1b1", "c1c1c1c1c1c1c1c1"])
    toks = list(range(500, 540)) + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
    data = slot_file(toks)
    store.temp_path(key).write_bytes(data)
    meta = store.finalize(key, Meta(key, len(toks), len(data), time.time(), MODEL, 1.0))
    sh.upload_now(store.bin_path(key), meta)
    if n % 3 == 0:
        sh.prune_bucket(keep=2)
"""


def test_kill_9_during_uploads_and_prunes_never_leaves_a_manifest_naming_a_missing_block(s3_gateway, s3_bucket,
                                                                                        aws_env, tmp_path):
    import os
    import random
    import signal
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests / "shared"), str(tests.parent)])}
    rng = random.Random(7)
    kills = 0
    for i in range(3):
        d = tmp_path / f"run{i}"
        d.mkdir()
        p = subprocess.Popen([sys.executable, "-c", CHILD, s3_gateway.endpoint, s3_bucket, str(d), str(i)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = p.stdout.readline()
            assert line.strip() == "ready", p.stderr.read()[-2000:]
            time.sleep(rng.uniform(0.3, 2.5))
            assert p.poll() is None, p.stderr.read()[-2000:]
            p.send_signal(signal.SIGKILL)
            kills += 1
        finally:
            p.kill()
            p.wait()
            p.stdout.close()
            p.stderr.close()
        no_manifest_names_a_missing_block(s3_gateway, s3_bucket)
    manifests, there = bucket_state(s3_gateway, s3_bucket)
    assert kills == 3 and manifests and there  # the runs got as far as uploads
