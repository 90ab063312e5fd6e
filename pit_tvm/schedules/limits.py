"""Tensor-core facts shared by the mma.sync (:mod:`.tensorcore`) and wgmma (:mod:`.wgmma`)
kernels: the dtypes they take, element sizes, and the device facts by arch (shared memory per
block, SM count).

A module of its own so that the wgmma path does not import :mod:`.tensorcore`, whose
``tvm.s_tir.tensor_intrin`` import parses every TVM tensor intrinsic (about 14 s on a CPU
core) and which only the mma.sync schedules need.
"""
from __future__ import annotations

import tvm

from pit_tvm.target import arch_number

IN_DTYPES = ("float16", "bfloat16")
OUT_DTYPES = ("float16", "bfloat16", "float32")
#: dynamic shared memory per block: H100 allows 227 KiB, A100 163 KiB.
MAX_SMEM_BYTES = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}


#: SMs of the arch's data-center part (H100 SXM and H200: 132, A100: 108): a grid's CTAs past a
#: multiple of it start a new wave; the few-rows tiers launch this many persistent CTAs
SM_COUNT = {"sm_90": 132, "sm_80": 108}


def sm_count(target) -> int:
    """SMs of the data-center part of ``target``'s arch (a CUDA Target, or an arch such as
    ``"sm_90a"``, an sm_90): TVM's CUDA target carries no SM count (its attributes are the arch,
    thread and shared-memory limits), and the kernels are built ahead of the device, so the wave
    size follows the target's arch, not a queried device."""
    arch = target if isinstance(target, str) else str(target.attrs.get("arch", ""))
    return SM_COUNT["sm_90" if arch_number(arch) >= 90 else "sm_80"]


def max_smem_bytes(arch: str) -> int:
    """Dynamic shared memory per block for ``arch`` (``sm_90a`` is an sm_90)."""
    return MAX_SMEM_BYTES["sm_90" if arch_number(arch) >= 90 else "sm_80"]


def dtype_bytes(dtype: str) -> int:
    return tvm.DataType(dtype).bits // 8
