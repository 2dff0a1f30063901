"""A real S3 server for tests: scripts/s3-gateway (Ceph RADOS Gateway on loopback).

Started once per test session by the `s3_gateway` fixture (tests/conftest.py), only when a
test asks for it. Exit 77 from the script (not root and the packages missing) skips those
tests with its message; AUTOSESSD_REQUIRE_S3=1 (CI) turns that skip into a failure.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "s3-gateway"
UNAVAILABLE = 77
RUN_THEM = "AUTOSESSD_REQUIRE_S3=1 .venv/bin/python -m pytest -q -m s3   (as root: installs radosgw, ceph-mon, ceph-osd)"


class Gateway:
    def __init__(self, env: dict[str, str]):
        self.env = env
        self.dir = env["S3_GATEWAY_DIR"]
        self.endpoint = env["AWS_ENDPOINT_URL"]

    @classmethod
    def start(cls) -> "Gateway":
        try:
            r = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise AssertionError(f"scripts/s3-gateway start: {e}") from None
        if r.returncode == UNAVAILABLE:
            why = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "scripts/s3-gateway: unavailable"
            if os.environ.get("AUTOSESSD_REQUIRE_S3"):
                pytest.fail(f"AUTOSESSD_REQUIRE_S3 is set and the S3 gateway cannot run here: {why}")
            # The command is in the reason: every summary of skips that prints reasons shows it.
            pytest.skip(reason=f"no S3 gateway: {why}; run these tests with: {RUN_THEM}")
        if r.returncode != 0:
            raise AssertionError(f"scripts/s3-gateway start failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
        return cls(dict(line.split("=", 1) for line in r.stdout.split()))

    def stop(self) -> None:
        subprocess.run([str(SCRIPT), "stop", self.dir], capture_output=True, timeout=120)

    def down(self) -> None:
        """Kill the gateway process (an outage): connections drop, the cluster keeps its objects."""
        subprocess.run([str(SCRIPT), "down", self.dir], check=True, capture_output=True, timeout=60)

    def up(self) -> None:
        subprocess.run([str(SCRIPT), "up", self.dir], check=True, capture_output=True, timeout=180)

    def client(self):
        """A plain boto3 client, to look into the bucket the way a person would."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 10},
                                          request_checksum_calculation="when_required",
                                          response_checksum_validation="when_required"))

    def new_bucket(self) -> str:
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def empty(self, bucket: str) -> None:
        """Remove every object and unfinished upload (the OSD keeps them in memory)."""
        c = self.client()
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                c.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        for u in c.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
            c.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
        c.delete_bucket(Bucket=bucket)
