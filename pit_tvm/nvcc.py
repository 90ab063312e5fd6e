"""Compile the CUDA source TVM generated with nvcc, so codegen breakage fails on a GPU-less box.

Without a CUDA driver TVM keeps only CUDA *source* in a built module; ``check_cuda_compiles``
pulls that source out and runs nvcc on it for the requested architectures.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile


def find_nvcc() -> str | None:
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.exists(cand):
            return cand
    return None


def cuda_sources(module) -> list[str]:
    """All CUDA source strings in a built module (tirx executable or Relax VM executable)."""
    root = getattr(module, "mod", module)
    found, stack, seen = [], [root], set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        try:
            src = m.inspect_source("cuda")
        except Exception:  # noqa: BLE001 - not a CUDA module
            src = ""
        if src and "__global__" in src:
            found.append(src)
        stack.extend(getattr(m, "imports", []))
    return found


def cuda_kernels(source: str) -> dict[str, tuple[str, str]]:
    """``{kernel name: (signature, body)}`` of each kernel ``source`` defines (not its forward
    declarations), e.g. to check what one kernel of a model's CUDA source does."""
    chunks = [c for c in source.split('extern "C" __global__')[1:] if "{" in c.split(";", 1)[0]]
    found = {}
    for chunk in chunks:
        signature, body = chunk.split("{", 1)
        name = re.sub(r"__launch_bounds__\([^)]*\)", "", signature).split("(", 1)[0].split()[-1]
        found[name] = (signature, body)
    return found


def _run_nvcc(source: str, arch: str, out_format: str, extra=()) -> tuple[bytes, str]:
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found on PATH or in /usr/local/cuda/bin")
    with tempfile.TemporaryDirectory() as tmp:
        src_path = os.path.join(tmp, "kernel.cu")
        out_path = os.path.join(tmp, f"kernel.{out_format}")
        with open(src_path, "w") as f:
            f.write(source)
        cmd = [nvcc, f"--{out_format}", "-O3", f"-arch={arch}", *extra, "-o", out_path, src_path]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {arch}:\n{proc.stderr[-4000:]}")
        with open(out_path, "rb") as f:
            return f.read(), proc.stderr


def nvcc_compile(source: str, arch: str = "sm_90", out_format: str = "cubin") -> bytes:
    """Compile CUDA source to ``cubin``/``ptx``/``fatbin`` for ``arch``; raise with nvcc's log."""
    return _run_nvcc(source, arch, out_format)[0]


def ptxas_log(source: str, arch: str = "sm_90a") -> str:
    """ptxas's verbose log for ``source`` (registers, spills, and performance notes such as
    C7515, wgmma serialised): kernel-quality checks that need no GPU."""
    return _run_nvcc(source, arch, "cubin", ("-Xptxas", "-v"))[1]


def check_cuda_compiles(module, archs=("sm_80", "sm_90")) -> int:
    """nvcc-compile every CUDA source in ``module`` for each arch; return the number compiled."""
    sources = cuda_sources(module)
    if not sources:
        raise RuntimeError("the module holds no CUDA source (was it built for a CUDA target?)")
    for src in sources:
        for arch in archs:
            nvcc_compile(src, arch)
    return len(sources) * len(archs)
