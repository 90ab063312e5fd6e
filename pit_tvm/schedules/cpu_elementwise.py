"""dlight rule for the CPU: elementwise (injective) kernels with static shapes.

Why: LegalizeOps leaves a fused elementwise kernel as serial scalar loops, and TVM 0.27 has no
CPU rule for it.  BERT's FFN activation (bias add, GELU's erf form, the padding mask) fused
into one such kernel was a sixth of a 4-layer CPU encoder's time, a few percent with this rule
and :class:`~pit_tvm.passes.fast_erf.ErfToFastErf` (docs/design/measurements.md#cpu).  The rule takes a function whose
blocks reduce to one spatial block (after dlight's inlining) and maps its whole iteration
space, row-major::

    parallel  chunks of VEC x UNROLL elements      (TVM's thread pool splits them among cores)
      unrolled UNROLL
        vectorised VEC                              (one SIMD register of fp32)

Anything else returns None (the next rule, or TVM's default loops).
"""
from __future__ import annotations

import math

from tvm import s_tir
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

from pit_tvm.schedules._dlight import dlight_blocks, is_static

#: lanes of the vectorised inner loop (16 fp32 = one AVX-512 register; LLVM splits it on
#: narrower vector units)
VEC = 16
#: vectors per parallel chunk
UNROLL = 4
#: below this many elements the kernel stays serial (a parallel launch costs more)
MIN_ELEMENTS = 4096


class CPUElementwise(CPUScheduleRule):
    """Parallel, vectorised schedule for static single-block elementwise kernels on the CPU."""

    def apply(self, func, target, _tunable):  # noqa: D102 - see the module docstring
        found = dlight_blocks(func, target, "llvm")
        if found is None:
            return None
        sch, infos = found
        if len(infos) != 1 or not infos[0].is_injective() or not is_static(infos[0].dom()):
            return None
        block = infos[0].block_rv
        total = math.prod(int(e) for e in infos[0].dom())
        vec = next((v for v in (VEC, VEC // 2, VEC // 4) if total % v == 0), None)
        if vec is None or total < MIN_ELEMENTS:
            return None
        try:
            fused = sch.fuse(*sch.get_loops(block))
            unrolled = UNROLL if total % (vec * UNROLL) == 0 else 1
            outer, unroll, lanes = sch.split(fused, [None, unrolled, vec])
            sch.parallel(outer)
            sch.unroll(unroll)
            sch.vectorize(lanes)
        except s_tir.ScheduleError:
            return None
        return sch
