"""bench/gpu.py (issue 42): the real-size bench on a GPU, kept from rotting between GPU runs.

The GPU run itself needs an NVIDIA machine; here its decisions are checked as functions (the
CUDA build's flags, where cuBLAS is found, where a return stops paying, the GGUF it writes), its
refusals as a subprocess (exit 2, one line why), and the whole measurement with --cpu: the same
model writer, loop and table on the real CPU engine at toy sizes.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT, engine_paths

sys.path.insert(0, str(ROOT / "bench"))
import gpu  # noqa: E402
import gpu_build as gb  # noqa: E402
import gpu_models as gm  # noqa: E402
import gpu_table as gt  # noqa: E402


# -- the CUDA build ------------------------------------------------------------------------------

@pytest.mark.parametrize("smi, arch", [("9.0\n", "90"), ("8.9\n8.9\n", "89"), ("12.0", "120")])
def test_the_arch_is_the_gpu_found(smi, arch):
    assert gb.arch_of(smi) == arch


@pytest.mark.parametrize("smi, why", [("", "no GPU"), ("9.0\n8.0\n", "several"), ("n/a", "unreadable")])
def test_no_single_arch_is_unfit(smi, why):
    with pytest.raises(gb.Unfit, match=why):
        gb.arch_of(smi)


def test_the_toolkit_root_comes_from_nvcc_not_from_a_wrapper_on_path():
    out = "#$ _NVVM_BRANCH_=nvvm\n#$ TOP=/usr/local/cuda-13.0/bin/..\n#$ PATH=/x\n"
    assert gb.toolkit_top(out) == Path("/usr/local/cuda-13.0")
    assert gb.toolkit_top("nvcc fatal: no input") is None


def _cuda(tmp_path: Path, libcuda: Path | None) -> gb.Cuda:
    return gb.Cuda(Path("/cuda/bin/nvcc"), Path("/cuda"), tmp_path / "inc", tmp_path / "libcublas.so.13",
                   tmp_path / "libcublasLt.so.13", libcuda)


def test_the_cuda_build_is_trimmed_to_one_arch_and_the_f16_kernels(tmp_path):
    args = gb.cmake_args(Path("/src"), Path("/b"), "90", _cuda(tmp_path, None))
    for flag in ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90-real", "-DGGML_CUDA_FA_ALL_QUANTS=OFF",
                 "-DGGML_CUDA_FA_QUANTS=f16-f16", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DGGML_NATIVE=OFF",
                 "-DGGML_CUDA_NCCL=OFF", "-DGGML_CUDA_NO_VMM=ON", "-DCMAKE_CUDA_COMPILER=/cuda/bin/nvcc",
                 f"-DCUDA_cublas_LIBRARY={tmp_path / 'libcublas.so.13'}", f"-DCMAKE_CUDA_FLAGS=-I{tmp_path / 'inc'} -allow-unsupported-compiler"):
        assert flag in args
    with_driver = gb.cmake_args(Path("/src"), Path("/b"), "90", _cuda(tmp_path, Path("/usr/lib/libcuda.so.1")))
    assert "-DGGML_CUDA_NO_VMM=ON" not in with_driver
    assert "-DCUDA_cuda_driver_LIBRARY=/usr/lib/libcuda.so.1" in with_driver
    assert not any("CUDA" in a for a in gb.cmake_args(Path("/src"), Path("/b"), "90", None))


def test_cublas_is_found_where_pytorchs_wheels_put_it(tmp_path, monkeypatch):
    cu = tmp_path / "nvidia" / "cu13"
    (cu / "include").mkdir(parents=True)
    (cu / "lib").mkdir()
    for f in ("include/cublas_v2.h", "lib/libcublas.so.13", "lib/libcublasLt.so.13"):
        (cu / f).touch()
    monkeypatch.setenv("BENCH_GPU_CUBLAS", str(cu))
    assert gb.find_cublas(tmp_path / "no-toolkit") == (cu / "include", cu / "lib" / "libcublas.so.13",
                                                       cu / "lib" / "libcublasLt.so.13")
    (cu / "lib" / "libcublasLt.so.13").unlink()
    monkeypatch.setattr(gb, "_python_nvidia_dirs", lambda: [])
    with pytest.raises(gb.Unfit, match="no cuBLAS"):
        gb.find_cublas(tmp_path / "no-toolkit")


# -- the models ----------------------------------------------------------------------------------

def _vocab(tokens: list[str]) -> dict[str, tuple[int, bytes]]:
    strs = b"".join(gm._str(t) for t in tokens)
    return {"tokenizer.ggml.model": (gm.STR, gm._str("gpt2")),
            "tokenizer.ggml.tokens": (gm.ARR, struct.pack("<IQ", gm.STR, len(tokens)) + strs),
            "tokenizer.ggml.bos_token_id": (gm.U32, struct.pack("<I", 1)),
            "tokenizer.ggml.eos_token_id": (gm.U32, struct.pack("<I", 2)),
            "general.name": (gm.STR, gm._str("not copied"))}


def test_the_model_file_is_gguf_with_the_vocab_copied_byte_for_byte(tmp_path):
    vocab = _vocab([f"t{i}" for i in range(300)])
    spec = gm.SPECS["cpu-8b"]
    size = gm.write_model(spec, vocab, tmp_path / "m.gguf")
    b = (tmp_path / "m.gguf").read_bytes()
    assert len(b) == size
    magic, version, n_tensors, _ = struct.unpack_from("<IIQQ", b, 0)
    assert (magic, version, n_tensors) == (0x46554747, 3, 2 + 9 * spec.n_layer)
    kv = gm.read_kv(b)
    assert kv["tokenizer.ggml.tokens"] == vocab["tokenizer.ggml.tokens"]
    assert kv["tokenizer.ggml.eos_token_id"][1] == struct.pack("<I", gm.EOT_ID)  # Llama 3's <|eot_id|>, not the vocab's
    assert kv["general.name"][1] != vocab["general.name"][1]
    assert struct.unpack("<I", kv["llama.block_count"][1]) == (spec.n_layer,)
    assert struct.unpack("<I", kv["llama.vocab_size"][1]) == (300,)
    # the weights: 300 token rows + per layer q, k, v, o, gate, up, down, in Q8_0 (34 bytes per 32)
    q, kvd = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    weights = 300 * spec.n_embd + spec.n_layer * (spec.n_embd * (2 * q + 2 * kvd) + 3 * spec.n_embd * spec.n_ff)
    assert weights * 34 // 32 < size < weights * 34 // 32 + 64 * 1024


def test_the_specs_have_the_shapes_the_issue_asks_for():
    assert gm.SPECS["8b"].kv_bytes_per_token == 128 * 1024
    assert gm.SPECS["70b-kv"].kv_bytes_per_token == 320 * 1024
    assert 7.4e9 < gm.SPECS["8b"].n_params() < 7.6e9  # Llama 3 8B without its untied output head
    assert 8.5 < gm.LLAMA3_70B.prefill_flops_per_token() / gm.SPECS["8b"].prefill_flops_per_token() < 10.5


# -- reading the results -------------------------------------------------------------------------

def test_where_a_return_stops_beating_a_re_read():
    assert gt.crossing([(4096, 0.4, 0.2), (16384, 1.6, 0.6)]) == {"verdict": "always", "tokens": None}
    assert gt.crossing([(4096, 0.1, 0.3), (16384, 0.4, 0.9)]) == {"verdict": "never", "tokens": None}
    # wins by 0.1 s at 4k, loses by 0.3 s at 16k: even at 4096 + 12288 / 4
    assert gt.crossing([(16384, 1.0, 1.3), (4096, 0.3, 0.2)]) == {"verdict": "from", "tokens": 7168}
    assert gt.crossing([(4096, None, 0.2)]) == {"verdict": "unmeasured"}


def test_the_plan_keeps_its_order():
    assert gpu.parse_plan("8b:16384,4096;70b-kv:4096") == [("8b", 16384), ("8b", 4096), ("70b-kv", 4096)]
    with pytest.raises(SystemExit, match="MODEL:N"):
        gpu.parse_plan("13b:4096")


# -- the machine -------------------------------------------------------------------------------

def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--out", str(tmp_path / "out"),
                           "--work", str(tmp_path), *args], capture_output=True, text=True, timeout=240,
                          env={**os.environ, **(env or {})})


def test_no_gpu_exits_2_saying_why(tmp_path):
    r = _run(tmp_path, env={"BENCH_GPU_SMI": str(tmp_path / "none")})
    assert r.returncode == 2
    assert "cannot run it: no nvidia-smi" in r.stderr
    assert "nvidia-smi" in json.loads((tmp_path / "out" / "gpu.json").read_text())["unfit"]


def test_a_gpu_without_what_the_build_needs_exits_2_before_building(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '9.0, NVIDIA H200'\n")
    smi.chmod(0o755)
    r = _run(tmp_path, "--sdist", str(tmp_path / "none.tar.gz"), env={"BENCH_GPU_SMI": str(smi)})
    assert r.returncode == 2, r.stderr
    res = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert res["machine"].startswith("NVIDIA H200 (sm_90)")
    assert any(w in res["unfit"] for w in ("nvcc", "cuBLAS", "cmake", "sdist"))
    assert "build" not in res["timeline"]


# -- the whole run, on the CPU -------------------------------------------------------------------

@pytest.mark.engine
def test_cpu_run_measures_every_size_and_writes_the_table(tmp_path):
    r = _run(tmp_path, "--cpu", "--engine", engine_paths()["LLAMA_SERVER"])
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert res["mode"] == "cpu" and not res["skipped"] and "error" not in res
    plan = gpu.parse_plan(gpu.CPU_PLAN)
    for name, n in plan:
        s = res["models"][name]["sizes"][str(n)]
        assert abs(s["alone"]["prompt_tokens"] - n) < 0.15 * n  # the facts make about n tokens
        reread = s["alone"]["reread"]["samples"][0]
        assert reread["cache_n"] < 32 and reread["prompt_ms"] > 0  # the engine alone read A again
        a = s["autosessd"]
        for mode in ("warm", "cold"):
            assert a[mode]["reused"] and a[mode]["engine_restore_ms"] is not None and a[mode]["ttft_s"] > 0
        assert a["switch_save"]["save_ms"] > 0
        per_token = gm.SPECS[name].kv_bytes_per_token
        assert 1.0 <= a["file_bytes"] / (s["alone"]["prompt_tokens"] * per_token) < 1.5
        assert s["ram_hit"]["reused"] and s["ram_hit"]["ttft_s"] > 0
    summary = res["summary"]
    assert set(summary) == {"cpu-8b", "cpu-70b-kv", "70b (estimated)"}
    assert summary["cpu-8b"]["auto"]["min_tokens"] >= 256
    table = (tmp_path / "out" / "gpu.md").read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| cpu-")]
    assert len(rows) == len(plan)
    assert table.strip().splitlines()[-1] in r.stdout  # printed too
    assert not list(tmp_path.glob("autosessd-gpu-*"))  # the scratch folder is gone


def test_the_deadline_cuts_sizes_and_still_writes_what_it_has(tmp_path):
    """Too little time left for a size: it and the rest are listed as cut, the run still ends well
    (no engine is started: the one named here would fail at once)."""
    r = _run(tmp_path, "--cpu", "--engine", "/bin/false", "--deadline-s", "20")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "out" / "gpu.json").read_text())
    plan = gpu.parse_plan(gpu.CPU_PLAN)
    assert len(res["skipped"]) == len(plan) and "cut:" in res["skipped"][0]
    assert set(res["models"]) == {"cpu-8b", "cpu-70b-kv"}  # the models were written before the cut
    assert "Not measured: cpu-8b at 400 tokens (cut:" in (tmp_path / "out" / "gpu.md").read_text()


@pytest.fixture(scope="module")
def pinned_cuda_sources(tmp_path_factory) -> Path:
    """ggml-cuda's folder out of the pinned sdist (only those members), once."""
    import tarfile

    d = tmp_path_factory.mktemp("sdist")
    with tarfile.open(gpu.find_sdist(None, may_download=True)) as tar:
        tar.extractall(d, members=[m for m in tar if "/ggml/src/ggml-cuda/" in m.name], filter="data")
    return next(d.glob("*/llama.cpp/ggml/src/ggml-cuda"))


@pytest.fixture
def cuda_sources(pinned_cuda_sources, tmp_path) -> Path:
    import shutil

    return Path(shutil.copytree(pinned_cuda_sources, tmp_path / "llama.cpp" / "ggml" / "src" / "ggml-cuda"))


def test_the_trim_keeps_q8_0_and_head_size_128_and_aborts_the_rest(cuda_sources):
    cuda = cuda_sources
    counts = gb.trim(cuda.parent.parent.parent)
    assert counts["removed files"] == 21 + 11  # mmq but q8_0, fattn-tile but 128
    inst = sorted(p.name for p in (cuda / "template-instances").glob("*.cu")
                  if not p.name.startswith(("mmf", "fattn-vec", "fattn-mma")))
    assert inst == ["fattn-tile-instance-dkq128-dv128.cu", "mmq-instance-q8_0.cu"]
    mma = (cuda / "template-instances" / "fattn-mma-f16-instance-ncols1_8-ncols2_4.cu").read_text()
    assert "DECL_FATTN_MMA_F16_CASE(128, 128, 8, 4);" in mma and "(64, 64" not in mma
    mmq = (cuda / "mmq.cu").read_text()
    assert "mul_mat_q_case<GGML_TYPE_Q8_0>(ctx, args, stream);" in mmq
    assert "mul_mat_q_case<GGML_TYPE_Q4_K>" not in mmq and "if (type != GGML_TYPE_Q8_0)" in mmq
    fattn = (cuda / "fattn.cu").read_text()
    assert "switch_ncols2<128, 128>(ctx, dst);" in fattn and "switch_ncols2< 64,  64>" not in fattn


def test_a_source_the_trim_does_not_know_is_left_whole(cuda_sources):
    cuda = cuda_sources
    (cuda / "mmq.cu").write_text((cuda / "mmq.cu").read_text().replace("    bool mmq_supported;\n", ""))
    before = {p: p.read_bytes() for p in cuda.rglob("*.cu")}
    with pytest.raises(gb.TrimMismatch, match="should_use_mmq"):
        gb.trim(cuda.parent.parent.parent)
    assert {p: p.read_bytes() for p in cuda.rglob("*.cu")} == before


@pytest.mark.engine
def test_the_gpu_path_with_the_build_faked_measures_and_a_second_call_reuses(tmp_path, monkeypatch):
    """The GPU run's own steps (the models written while the engine builds, the build kept for a
    second call on a warm machine, every layer offloaded) around the CPU engine as the 'build'."""
    server = engine_paths()["LLAMA_SERVER"]
    builds = []

    def fake_build(sdist, work, arch, cuda, jobs, log, timeout_s, trimmed=True):
        builds.append((arch, trimmed))
        log.write_text("a fake build\n")
        return {"binary": server, "arch": arch, "configure_s": 0.1, "compile_s": 0.2, "trim": {"removed files": 32}}

    monkeypatch.setattr(gb, "gpu_arch", lambda: ("90", "NVIDIA Fake"))
    monkeypatch.setattr(gb, "find_cuda", lambda: gb.Cuda(Path("/cuda/bin/nvcc"), Path("/cuda"), tmp_path,
                                                          tmp_path / "libcublas.so.13", tmp_path / "libcublasLt.so.13", None))
    monkeypatch.setattr(gb, "build", fake_build)
    monkeypatch.setattr(gpu, "BUILD", tmp_path / "gpu-engine")
    monkeypatch.setattr(gpu, "MODELS", tmp_path / "gpu-models")
    sdist = gpu.find_sdist(None, may_download=True)
    args = ["--work", str(tmp_path), "--sdist", str(sdist), "--plan", "cpu-8b:400", "--threads", "1", "--reps", "1"]
    # an engine that says it found no usable GPU (as this CPU one does) stops the run: CPU numbers
    # must never pass for a GPU's
    assert gpu.main(["--out", str(tmp_path / "cpu"), *args]) == 1
    assert "NoGPU: llama-server runs without the GPU" in json.loads((tmp_path / "cpu" / "gpu.json").read_text())["error"]
    import gpu_measure

    monkeypatch.setattr(gpu_measure, "GPU_FAILED", ())
    assert gpu.main(["--out", str(tmp_path / "one"), *args]) == 0
    assert gpu.main(["--out", str(tmp_path / "two"), *args]) == 0
    assert builds == [("90", True)]
    first, one, two = (json.loads((tmp_path / d / "gpu.json").read_text()) for d in ("cpu", "one", "two"))
    assert "build" in first["timeline"] and not first["models"]["cpu-8b"]["file"].get("reused")
    for res in (one, two):  # later calls, as on a machine still warm: nothing built or written again
        assert "build (reused)" in res["timeline"] and res["models"]["cpu-8b"]["file"].get("reused")
    assert one["machine"].startswith("NVIDIA Fake (sm_90)") and one["cuda"]["libcuda"] == "None"
    for res in (one, two):
        s = res["models"]["cpu-8b"]["sizes"]["400"]
        assert s["autosessd"]["warm"]["reused"] and s["autosessd"]["cold"]["reused"] and s["ram_hit"]["reused"]
    assert not list(tmp_path.glob("autosessd-gpu-*"))


def test_big_files_get_one_return_of_each_kind_the_rest_two():
    assert gpu.default_reps(False, 2.1e9) == 2  # 8b at 16k
    assert gpu.default_reps(False, 5.4e9) == 1  # 70b-kv at 16k
    assert gpu.default_reps(True, 1e6) == 1  # --cpu: the code, not the numbers
