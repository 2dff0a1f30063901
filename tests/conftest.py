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
