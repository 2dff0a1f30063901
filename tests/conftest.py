import pytest

from harness import Engine, engine_paths


@pytest.fixture(scope="session")
def engine_bin():
    return engine_paths()


@pytest.fixture
def engines(tmp_path, engine_bin):
    """Factory: engines(save_dir=..., swa_full=..., ...) starts a real llama-server; all are
    stopped at the end of the test."""
    started: list[Engine] = []

    def make(save_dir=None, **kw) -> Engine:
        e = Engine(save_dir, log_path=tmp_path / f"engine-{len(started)}.log", **kw)
        started.append(e)
        return e.start()

    yield make
    for e in started:
        e.stop()


@pytest.fixture
def session_dir(tmp_path):
    d = tmp_path / "sessions"
    d.mkdir()
    return d


# -- the shared tier's real S3 server (tests/s3_gateway.py) ---------------------------------
@pytest.fixture(scope="session")
def s3_gateway():
    """One Ceph RADOS Gateway for the whole session, started on first use (~16 s)."""
    from s3_gateway import Gateway

    gw = Gateway.start()
    yield gw
    gw.stop()


@pytest.fixture
def s3_bucket(s3_gateway):
    """A fresh bucket for one test, emptied and removed after it."""
    name = s3_gateway.new_bucket()
    yield name
    s3_gateway.empty(name)


def pytest_terminal_summary(terminalreporter):
    """`make test` says how many shared-tier tests did not run, why, and (in the reason) the
    one command that runs them."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "s3" in getattr(r, "keywords", {})]
    if skipped:
        rep = skipped[0].longrepr
        reason = (rep[2] if isinstance(rep, tuple) else str(rep)).removeprefix("Skipped: ")
        terminalreporter.write_line(f"{len(skipped)} shared-tier (S3) tests skipped: {reason}", yellow=True)
