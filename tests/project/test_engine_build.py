"""scripts/fetch-engine never hands out a llama-server that cannot answer (issue 9).

The real failure (SIGILL from ggml's AMX kernels at the first model load) needs an AMX host, so
these tests stand fake binaries where the build's output goes (tests/fake_llama_server.py): one
that dies with SIGILL, one that hangs, one that answers. No compiler is involved: the build step
is a function (or, for the script, AUTOSESSD_ENGINE_BUILD_CMD) that drops a fake in place.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import fake_llama_server
from harness import ROOT, wait_until

_spec = importlib.util.spec_from_file_location("engine_build", ROOT / "scripts" / "engine_build.py")
eb = importlib.util.module_from_spec(_spec)
sys.modules["engine_build"] = eb  # dataclasses resolves annotations through sys.modules
_spec.loader.exec_module(eb)

VERSION = "11434.0.0"
CPU = "cpu0"
_MODELS_CACHE = (Path(os.environ.get("AUTOSESSD_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                      / "autosessd") / "models")


def _cached_test_model(script: str) -> Path:
    """Where `make test`'s fetch-engine keeps the random-weight model scripts/<script>.py builds."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))  # the builders import scripts/model_build.py
    spec = importlib.util.spec_from_file_location(script, ROOT / "scripts" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return _MODELS_CACHE / module.FILE_NAME


# fetch-engine's lines for them, in its order.
TEST_MODELS_CACHED = {"MODEL_KV8B": _cached_test_model("kv8b_model"),
                      "MODEL_QWEN35": _cached_test_model("qwen35_model"),
                      "MODEL_GPTOSS": _cached_test_model("gptoss_model")}
Outcome, Action, Check = eb.Outcome, eb.Action, eb.Check


# -- decisions ------------------------------------------------------------------------------------

@pytest.mark.parametrize("outcome, action", [
    (Outcome.OK, Action.USE),
    (Outcome.SIGNAL, Action.REBUILD),         # a cache from another machine, or an older build
    (Outcome.EXITED, Action.REBUILD),
    (Outcome.NOT_RUNNABLE, Action.REBUILD),   # another architecture, truncated copy
    (Outcome.BAD_ANSWER, Action.REBUILD),
    (Outcome.TIMEOUT, Action.STOP),           # a rebuild cannot make a loaded machine faster
])
def test_cached_binary_decision(outcome, action):
    assert eb.after_cached_check(Check(outcome, "x")) is action


@pytest.mark.parametrize("outcome, safer_left, action", [
    (Outcome.OK, True, Action.CACHE),
    (Outcome.OK, False, Action.CACHE),
    (Outcome.SIGNAL, True, Action.FALLBACK),
    (Outcome.SIGNAL, False, Action.STOP),
    (Outcome.BUILD_FAILED, True, Action.FALLBACK),  # e.g. a gcc without -mno-amx-tile
    (Outcome.BUILD_FAILED, False, Action.STOP),
    (Outcome.TIMEOUT, True, Action.STOP),           # not the instruction set: another build would hang too
    (Outcome.EXITED, True, Action.STOP),
    (Outcome.NOT_RUNNABLE, True, Action.STOP),
    (Outcome.BAD_ANSWER, True, Action.STOP),
])
def test_fresh_build_decision(outcome, safer_left, action):
    assert eb.after_build(Check(outcome, "x"), safer_left) is action


def test_native_flags_turn_amx_off_on_x86_only():
    x86 = eb.cmake_flags("native", "x86_64")
    assert "-DGGML_NATIVE=ON" in x86
    for lang in ("C", "CXX"):
        assert f"-DCMAKE_{lang}_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in x86
    assert eb.cmake_flags("native", "aarch64") == ["-DGGML_NATIVE=ON"]
    assert eb.cmake_flags("portable", "x86_64") == ["-DGGML_NATIVE=OFF"]


def test_cache_path_names_version_recipe_variant_and_cpu(tmp_path):
    native = eb.variant_dir(tmp_path, VERSION, "native", "abc")
    portable = eb.variant_dir(tmp_path, VERSION, "portable", "abc")
    assert native.name == f"llama-server-{VERSION}-r{eb.RECIPE}-native-abc"
    assert portable.name == f"llama-server-{VERSION}-r{eb.RECIPE}-portable"
    # The layout before recipe 2 (what other checkouts still use) is a different path.
    assert tmp_path / f"llama-server-{VERSION}" not in (native.parent, portable.parent)


def test_cpu_id_changes_with_the_flags_native_sees():
    info = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon\nflags\t\t: avx512f amx_tile\n\nprocessor\t: 1\n"
    other = info.replace(" amx_tile", "")
    assert eb.cpu_id(info, "x86_64") == eb.cpu_id(info + "flags : ignored\n", "x86_64")
    assert eb.cpu_id(info, "x86_64") != eb.cpu_id(other, "x86_64")


def test_unknown_variant_names_the_choices():
    with pytest.raises(eb.Stop, match="AUTOSESSD_ENGINE_VARIANT='fast'.*native, portable"):
        eb.variant_order("fast")
    assert eb.variant_order("portable") == ("portable",)
    assert eb.variant_order(None) == eb.DEFAULT_ORDER


# -- the smoke check against fake binaries ---------------------------------------------------------

@pytest.fixture
def model(tmp_path):
    m = tmp_path / "model.gguf"
    m.write_bytes(b"GGUF fake")
    return m


def check(tmp_path, model, mode, **kw):
    return eb.smoke_check(fake_llama_server.executable(tmp_path, mode), model, tmp_path / "smoke.log", **kw)


def test_smoke_check_passes_a_binary_that_answers(tmp_path, model):
    assert check(tmp_path, model, "answer").outcome is Outcome.OK


def test_smoke_check_names_sigill_at_model_load(tmp_path, model):
    c = check(tmp_path, model, "sigill-load")
    assert c.outcome is Outcome.SIGNAL
    assert "SIGILL" in c.detail and "loading the model" in c.detail


@pytest.mark.parametrize("mode", ["sigill-completion", "sigill-mid-answer"])
def test_smoke_check_names_sigill_at_the_first_completion(tmp_path, model, mode):
    # `llama-server --version` and a model load can both pass; the first matrix multiply is what dies.
    c = check(tmp_path, model, mode)
    assert c.outcome is Outcome.SIGNAL
    assert "SIGILL" in c.detail and "first completion" in c.detail


def test_smoke_check_gives_up_on_a_hang_and_stops_the_process(tmp_path, model, monkeypatch):
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("FAKE_LLAMA_PID_FILE", str(pid_file))
    c = check(tmp_path, model, "hang", load_timeout=2)
    assert c.outcome is Outcome.TIMEOUT and "within 2 s" in c.detail
    with pytest.raises(ProcessLookupError):  # stopped and reaped, not left running
        os.kill(int(pid_file.read_text()), 0)


def test_smoke_check_reports_an_exit_and_keeps_the_output(tmp_path, model):
    c = check(tmp_path, model, "exit")
    assert c.outcome is Outcome.EXITED and "status 1" in c.detail
    assert "failed to load model" in (tmp_path / "smoke.log").read_text()


def test_smoke_check_reports_a_file_that_cannot_run(tmp_path, model):
    junk = tmp_path / "llama-server"
    junk.write_bytes(b"\x7fELF truncated")
    junk.chmod(0o755)
    assert eb.smoke_check(junk, model, tmp_path / "smoke.log").outcome is Outcome.NOT_RUNNABLE


# -- ensure(): build, check, fall back, cache -----------------------------------------------------

class FakeBuilds:
    """build_fn for ensure(): drops a fake binary of the mode given for each variant, or fails."""

    def __init__(self, **modes: str):
        self.modes = modes
        self.calls: list[str] = []

    def __call__(self, variant, version, work, log):
        self.calls.append(variant)
        log.write_text(f"fake build of {variant}\n")
        if self.modes[variant] == "build-fails":
            raise eb.BuildFailed("the compile failed (exit status 2)")
        return fake_llama_server.executable(work, self.modes[variant])


def ensure(cache, model, builds, **kw):
    kw.setdefault("check_fn", functools.partial(eb.smoke_check, load_timeout=10))
    return eb.ensure(cache, VERSION, model, ("native", "portable"), cpu=CPU, build_fn=builds, **kw)


def dirs(cache):
    return (eb.variant_dir(cache, VERSION, "native", CPU), eb.variant_dir(cache, VERSION, "portable", CPU))


def answers(binary, tmp_path, model):
    return eb.smoke_check(binary, model, tmp_path / "again.log").ok


def test_a_build_that_answers_is_cached_and_reused(tmp_path, model, capsys):
    cache = tmp_path / "cache"
    builds = FakeBuilds(native="answer", portable="answer")
    path = ensure(cache, model, builds)
    native, _ = dirs(cache)
    assert path == native / "llama-server" and answers(path, tmp_path, model)
    assert (native / "build.log").exists() and (native / "build.json").exists()
    assert ensure(cache, model, builds) == path
    assert builds.calls == ["native"]  # the second run checked the cache and built nothing


def test_sigill_at_the_first_completion_falls_back_to_portable_once(tmp_path, model, capsys):
    cache = tmp_path / "cache"
    builds = FakeBuilds(native="sigill-completion", portable="answer")
    path = ensure(cache, model, builds)
    native, portable = dirs(cache)
    assert path == portable / "llama-server" and answers(path, tmp_path, model)
    assert not (native / "llama-server").exists()  # the dead build never entered the cache
    said = [line for line in capsys.readouterr().err.splitlines() if "rebuilding" in line]
    assert len(said) == 1 and "SIGILL" in said[0] and "portable" in said[0]
    # Later runs remember that native dies here instead of spending another build on it.
    assert ensure(cache, model, builds) == path
    assert builds.calls == ["native", "portable"]


def test_a_native_build_that_does_not_compile_falls_back(tmp_path, model):
    builds = FakeBuilds(native="build-fails", portable="answer")
    assert ensure(tmp_path / "cache", model, builds) == dirs(tmp_path / "cache")[1] / "llama-server"


def test_when_the_safer_build_dies_too_it_stops_with_the_reason_and_the_log(tmp_path, model):
    cache = tmp_path / "cache"
    builds = FakeBuilds(native="sigill-load", portable="sigill-load")
    with pytest.raises(eb.Stop) as e:
        ensure(cache, model, builds)
    _, portable = dirs(cache)
    assert "SIGILL" in str(e.value) and str(portable / "build.log") in str(e.value)
    assert (portable / "build.log").exists()
    assert not any(d.joinpath("llama-server").exists() for d in dirs(cache))


def test_a_build_that_hangs_stops_without_caching_or_another_build(tmp_path, model):
    cache = tmp_path / "cache"
    builds = FakeBuilds(native="hang", portable="answer")
    with pytest.raises(eb.Stop, match="did not finish loading"):
        ensure(cache, model, builds, check_fn=functools.partial(eb.smoke_check, load_timeout=2))
    assert builds.calls == ["native"]
    assert not dirs(cache)[0].joinpath("llama-server").exists()


def test_a_cached_binary_that_dies_with_sigill_is_rebuilt(tmp_path, model, capsys):
    # The acceptance case: someone's cache holds a binary that cannot run here.
    cache = tmp_path / "cache"
    native, _ = dirs(cache)
    native.mkdir(parents=True)
    fake_llama_server.executable(native, "sigill-load")
    builds = FakeBuilds(native="answer", portable="answer")
    path = ensure(cache, model, builds)
    assert path == native / "llama-server" and answers(path, tmp_path, model)
    assert builds.calls == ["native"]
    assert "cached llama-server native" in capsys.readouterr().err


def test_a_cached_binary_that_hangs_is_kept_and_reported(tmp_path, model):
    cache = tmp_path / "cache"
    native, _ = dirs(cache)
    native.mkdir(parents=True)
    fake_llama_server.executable(native, "hang")
    builds = FakeBuilds(native="answer", portable="answer")
    with pytest.raises(eb.Stop, match="overloaded") as e:
        ensure(cache, model, builds, check_fn=functools.partial(eb.smoke_check, load_timeout=2))
    assert str(native / "smoke.log") in str(e.value)
    assert builds.calls == [] and (native / "llama-server").exists()


def test_caches_of_older_recipes_and_other_cpus_are_not_trusted_or_touched(tmp_path, model):
    cache = tmp_path / "cache"
    old = cache / f"llama-server-{VERSION}"  # the layout before recipe 2, still used by other checkouts
    old.mkdir(parents=True)
    old_bin = fake_llama_server.executable(old, "answer")
    before = old_bin.read_bytes()
    other_cpu = eb.variant_dir(cache, VERSION, "native", "othercpu")
    other_cpu.mkdir(parents=True)
    fake_llama_server.executable(other_cpu, "answer")
    builds = FakeBuilds(native="answer", portable="answer")
    assert ensure(cache, model, builds) == dirs(cache)[0] / "llama-server"
    assert builds.calls == ["native"]
    assert old_bin.read_bytes() == before


def test_concurrent_runs_build_once(tmp_path, model, capsys):
    # Several test sessions on one machine call fetch-engine at once: one builds, the others wait.
    cache = tmp_path / "cache"
    release = threading.Event()
    builds = FakeBuilds(native="answer", portable="answer")

    def slow_build(*a):
        release.wait(60)
        return builds(*a)

    results = []
    first = threading.Thread(target=lambda: results.append(ensure(cache, model, slow_build)))
    first.start()
    wait_until(lambda: dirs(cache)[0].exists(), what="the first run to take the lock and start building")
    second = threading.Thread(target=lambda: results.append(ensure(cache, model, slow_build)))
    second.start()
    seen = []
    wait_until(lambda: seen.append(capsys.readouterr().err) or "waiting for it" in "".join(seen),
               what="the second run to wait for the lock")
    release.set()
    first.join(60)
    second.join(60)
    assert results == [dirs(cache)[0] / "llama-server"] * 2
    assert builds.calls == ["native"]


# -- the script itself ------------------------------------------------------------------------------

def fetch_engine(cache: Path, build_cmd: str):
    env = {**os.environ, "AUTOSESSD_CACHE": str(cache), "AUTOSESSD_ENGINE_BUILD_CMD": build_cmd,
           "PYTHON": sys.executable}
    env.pop("AUTOSESSD_ENGINE_VARIANT", None)
    return subprocess.run([str(ROOT / "scripts" / "fetch-engine")], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture
def script_cache(tmp_path):
    """A cache with a (fake) model, whose native slot for this machine holds a binary dying by SIGILL."""
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "gemma-3-270m-q4_k_m.gguf").write_bytes(b"GGUF fake")
    # The random-weight models are checked by their sha256 (a fake would be built again: ~45 s and
    # the sdist): the real ones, where `make test`'s fetch-engine has built them.
    for cached in TEST_MODELS_CACHED.values():
        if cached.is_file():
            (cache / "models" / cached.name).symlink_to(cached)
    cpu = eb.cpu_id(eb._read("/proc/cpuinfo"), platform.machine())
    native = eb.variant_dir(cache, VERSION, "native", cpu)
    native.mkdir(parents=True)
    fake_llama_server.executable(native, "sigill-load")
    return cache, native


def builds_dir(tmp_path, **modes) -> str:
    """A build command that copies the fake prepared for $VARIANT to $OUT."""
    d = tmp_path / "builds"
    d.mkdir()
    for variant, mode in modes.items():
        fake_llama_server.executable(d, mode, name=variant)
    return f'cp "{d}/$VARIANT" "$OUT"'


def test_fetch_engine_rebuilds_a_cached_binary_that_dies_with_sigill(tmp_path, script_cache):
    cache, native = script_cache
    r = fetch_engine(cache, builds_dir(tmp_path, native="answer", portable="answer"))
    assert r.returncode == 0, r.stderr
    pairs = [line.split("=", 1) for line in r.stdout.splitlines()]
    # The first three lines as they always were (scripts parse them so), the new models after.
    assert pairs == [["LLAMA_SERVER", str(native / "llama-server")],
                     ["MODEL", str(cache / "models" / "gemma-3-270m-q4_k_m.gguf")],
                     *([key, str(cache / "models" / cached.name)] for key, cached in TEST_MODELS_CACHED.items())]
    lines = dict(pairs)
    assert "SIGILL" in r.stderr and "rebuilding it" in r.stderr
    assert answers(Path(lines["LLAMA_SERVER"]), tmp_path, Path(lines["MODEL"]))


def test_fetch_engine_stops_with_the_reason_and_the_log_when_nothing_runs(tmp_path, script_cache):
    cache, native = script_cache
    r = fetch_engine(cache, builds_dir(tmp_path, native="sigill-load", portable="sigill-completion"))
    assert r.returncode == 1 and r.stdout == ""
    portable_log = eb.variant_dir(cache, VERSION, "portable", "-") / "build.log"
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("fetch-engine: ") and "SIGILL" in last and str(portable_log) in last
    assert "Traceback" not in r.stderr
