"""A mixed fleet on one bucket: a host of this version beside a host of an earlier one (issue 48).

    python bench/mixed_fleet.py OLD_CHECKOUT      e.g. a worktree: git worktree add /tmp/old 4061a60

The new host (this checkout, `[shared] whole_files = true`) and the old host (OLD_CHECKOUT's code,
by PYTHONPATH) each save a conversation in llama-server's file layout and upload it; each then
finds the other's in the bucket, downloads it and checks that the file its store hands the
engine holds the saving host's tokens and KV bytes. Against the real Ceph RGW (scripts/s3-gateway).
Each host runs in a process of its own with its own code; the table says what each found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "mixedfleet0000001"


def step(role: str, bucket: str, work: str, endpoint: str) -> None:
    """In a host's own process: upload its save, then wait for the other's and restore it."""
    sys.path.insert(0, str(ROOT / "tests"))
    from autosessd.base.config import parse
    from autosessd.shared import SharedStore
    from autosessd.store.directory import Meta, Store
    from kv_common import slot_file

    extra = "whole_files = true\n" if role == "new" else ""
    cfg = parse((f'slot_save_path = "/srv/x"\n[shared]\nendpoint_url = "{endpoint}"\nbucket = "{bucket}"\n'
                 f'prefix = "fleet/"\nhost = "{role}"\n{extra}').encode(), "fleet.toml").shared
    d = Path(work) / role
    d.mkdir()
    sh, store = SharedStore(cfg), Store(d)
    sh.start(store)
    a, b = "a1a1a1a1a1a1a1a1", "b2b2b2b2b2b2b2b2"
    mine, theirs = (a, b) if role == "new" else (b, a)
    tokens = list(range(700 if role == "new" else 900, 1000 if role == "new" else 1250))
    data = slot_file(tokens)
    store.temp_path(mine).write_bytes(data)
    meta = store.finalize(mine, Meta(mine, len(tokens), len(data), time.time(), MODEL, 1.0))
    outcome = sh.upload_now(store.bin_path(mine), meta)
    staged = store.stage(f"auto-{mine}.bin")
    (Path(work) / f"{role}.file").write_bytes((store.staging / staged.name).read_bytes())
    (Path(work) / f"{role}.up").write_text(outcome)
    deadline = time.monotonic() + 120
    while not (Path(work) / f"{'old' if role == 'new' else 'new'}.up").exists():
        if time.monotonic() > deadline:
            raise SystemExit("the other host never uploaded")
        time.sleep(0.2)
    found = [s for s in sh.find(MODEL) if s.name == f"auto-{theirs}.bin"]
    kinds = sorted({"manifest" if getattr(s, "manifest", False) else "whole file" for s in sh.versions(MODEL)
                    if s.name == f"auto-{theirs}.bin"})
    sh.download(found[0], store)
    staged = store.stage(f"auto-{theirs}.bin")
    got = (store.staging / staged.name).read_bytes()
    print(json.dumps({"role": role, "uploaded": outcome, "found": found[0].key.rsplit("/", 1)[-1],
                      "objects_of_it": kinds, "bytes": len(got)}))
    (Path(work) / f"{role}.got").write_bytes(got)
    sh.stop()


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "step":
        return step(*sys.argv[2:])
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    old = Path(sys.argv[1]).resolve()
    r = subprocess.run([str(ROOT / "scripts" / "s3-gateway"), "start"], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"scripts/s3-gateway start: {r.stderr[-2000:]}")
    env = dict(line.split("=", 1) for line in r.stdout.split())
    try:
        import boto3
        from botocore.config import Config

        c = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                         aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                         config=Config(s3={"addressing_style": "path"}))
        bucket = f"fleet-{os.getpid()}"
        c.create_bucket(Bucket=bucket)
        with tempfile.TemporaryDirectory(prefix="autosessd-fleet-") as work:
            procs = []
            for role, code in (("new", ROOT), ("old", old)):
                penv = {**os.environ, **env, "PYTHONPATH": str(code)}
                procs.append(subprocess.Popen([sys.executable, __file__, "step", role, bucket, work,
                                               env["AWS_ENDPOINT_URL"]], env=penv, stdout=subprocess.PIPE, text=True))
            outs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
            w = Path(work)
            same_a = (w / "new.file").read_bytes() == (w / "old.got").read_bytes()
            same_b = (w / "old.file").read_bytes() == (w / "new.got").read_bytes()
            print("| host | its save went up | it found the other's as | objects of it there | restored the same "
                  "bytes |\n|---|---|---|---|---|")
            for o, same in zip(outs, (same_b, same_a)):
                print(f"| {o['role']} | {o['uploaded']} | {o['found']} | {', '.join(o['objects_of_it'])} | "
                      f"{'yes' if same else 'NO'} ({o['bytes']:,} bytes) |")
            names = sorted(o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", []))
            print("\nThe bucket:\n" + "\n".join(f"    {n}" for n in names))
            if not (same_a and same_b):
                raise SystemExit(1)
    finally:
        subprocess.run([str(ROOT / "scripts" / "s3-gateway"), "stop", env["S3_GATEWAY_DIR"]], capture_output=True,
                       timeout=120)


if __name__ == "__main__":
    main()
