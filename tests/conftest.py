import os
import shutil
from pathlib import Path

import pytest

import harness
from harness import Engine, engine_paths


@pytest.fixture(autouse=True, scope="session")
def no_staging_left_behind():
    """Tests leave nothing in /dev/shm: the tmpfs staging directories `--exec` made for the
    tests' stores (memory until the next boot) go at the end of the session."""
    parent = Path(f"/dev/shm/autosessd-{os.getuid()}")
    before = set(os.listdir(parent)) if parent.is_dir() else None
    yield
    if not parent.is_dir():
        return
    for name in set(os.listdir(parent)) - (before or set()):
        shutil.rmtree(parent / name, ignore_errors=True)
    if before is None and not os.listdir(parent):
        parent.rmdir()


@pytest.fixture(scope="session")
def engine_bin():
    return engine_paths()


@pytest.fixture(params=harness.models())
def model(request, engine_bin) -> harness.Model:
    """The core real-engine tests run on both test models (issue 31): Gemma 3 270M, a
    sliding-window model, and the model with Llama 3 8B's KV shape, without a window, whose
    files are the size users' are. A test that takes this fixture runs once on each, and its
    `engines` load that model."""
    return harness.model(request.param)  # also as parametrize(..., indirect=["model"]) with a name


@pytest.fixture
def engines(request, tmp_path, engine_bin):
    """Factory: engines(save_dir=..., swa_full=..., ...) starts a real llama-server; all are
    stopped at the end of the test. In a test that takes the `model` fixture, that model."""
    started: list[Engine] = []
    default = request.getfixturevalue("model").path if "model" in request.fixturenames else None

    def make(save_dir=None, **kw) -> Engine:
        kw.setdefault("model", default)
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


LOG_TAIL_LINES = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the last lines of each autosessd log it started (its debug log):
    a failure seen only in CI then says what the daemon did, not just what the test waited for."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    tmp = item.funcargs.get("tmp_path")
    if tmp is None:
        return
    for log in sorted(tmp.rglob("autosessd-*.log"))[:4]:
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        report.sections.append((f"{log.name} (its last {LOG_TAIL_LINES} lines)", "\n".join(lines[-LOG_TAIL_LINES:])))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say at the end of the run which tests were skipped and why (no root, no
    systemd-analyze, no IPv6 loopback, ...): what this run did not check."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons: dict[str, int] = {}
    for report in skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    terminalreporter.write_sep("-", f"{len(skipped)} skipped: not checked on this machine")
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{n:4d} × {reason}")


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


@pytest.fixture(autouse=True)
def no_real_state_dir(monkeypatch):
    """Tests never write the real state directory (/var/lib/autosessd as root, else
    ~/.local/state/autosessd): a configuration without state_dir is a test's mistake."""
    from autosessd.base import config

    real = config.Config.effective_state_dir

    def guarded(self):
        if not self.state_dir:
            raise AssertionError("a test's configuration has no state_dir: it would write the real state directory")
        return real(self)

    monkeypatch.setattr(config.Config, "effective_state_dir", guarded)
