"""Fixtures of the shared tier's tests: the test gateway's credentials in the environment, and
hosts(n) — n SharedStore instances on one bucket, each with its own session directory."""

import pytest

from autosessd.shared import SharedStore
from autosessd.store.directory import Store
from shared_common import shared_cfg


@pytest.fixture
def aws_env(s3_gateway, monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(k, s3_gateway.env[k])


@pytest.fixture
def hosts(s3_gateway, s3_bucket, aws_env, tmp_path):
    """hosts(n, **cfg) → [(SharedStore, Store)]: n hosts on one bucket, each with its own directory."""
    made = []

    def make(n=2, **kw):
        out = []
        for i in range(n):
            d = tmp_path / f"host{len(made) + 1}"
            d.mkdir()
            sh = SharedStore(shared_cfg(s3_gateway, s3_bucket, host=f"host{len(made) + 1}", **kw))
            made.append(sh)
            out.append((sh, Store(d)))
        return out

    yield make
    for sh in made:
        sh.stop(timeout=5)
