"""dlight rule for the CPU: batched matmuls with static shapes (attention's ``q @ k^T`` and
``p @ v``), which no TVM 0.27 CPU rule schedules.

Why: LegalizeOps leaves them as serial scalar loops, and the innermost loop is the reduction,
which LLVM does not vectorise for floats (that would reassociate the sum).  On a 2-core EPYC
they were most of a 4-layer BERT's time on the CPU (both builds: the weight matmuls run on the
PIT kernels' dense twin, :class:`pit_tvm.passes.DenseMatmulToPITKernels`).  The rule takes a
function whose single reduction block is ``C[b.., i, j] += A[b.., i, k] * B[b.., k, j]``
(its elementwise producers and consumers are inlined where they can be) and maps::

    parallel (b.., i)            one output row per task
      C[b.., i, :] = 0           vectorised over j
      for k:
        C[b.., i, :] += A[b.., i, k] * B[b.., k, :]    j innermost: LLVM vectorises it, no
                                                        reassociation of the sum needed

Anything else returns None (the next rule, or TVM's default loops).
"""
from __future__ import annotations

from tvm import s_tir
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

from pit_tvm.schedules._dlight import dlight_blocks, is_static

#: batched only: a plain 2-D matmul with a weight is the PIT dense twin's, not this rule's
MIN_SPATIAL = 3
#: outputs whose zero-init stays scalar: TVM's bf16 legalisation on llvm (storage as uint16)
#: rejects a vector store of a broadcast bf16 zero (``dtype mismatch on BufferStore``)
UNVECTORIZED_DTYPES = {"bfloat16"}


class CPUBatchedMatmul(CPUScheduleRule):
    """Row-parallel, j-vectorised schedule for static batched matmuls on the CPU."""

    def apply(self, func, target, _tunable):  # noqa: D102 - see the module docstring
        found = dlight_blocks(func, target, "llvm")
        if found is None:
            return None
        sch, infos = found
        reductions = [info for info in infos if "R" in info.dom_kind()]
        if len(reductions) != 1:
            return None
        main = reductions[0]
        kind = main.dom_kind()
        if (len(kind) < MIN_SPATIAL + 1 or kind != "S" * (len(kind) - 1) + "R"
                or not is_static(main.dom()) or len(sch.get(main.block_rv).reads) != 2):
            return None
        try:
            *outer, j, k = sch.get_loops(main.block_rv)
            sch.reorder(*outer, k, j)
            sch.parallel(sch.fuse(*outer))
            init = sch.decompose_reduction(main.block_rv, k)
            if str(sch.get(main.block_rv).writes[0].source.dtype) not in UNVECTORIZED_DTYPES:
                sch.vectorize(sch.get_loops(init)[-1])
            # (j under the reduction loop cannot take TIR's vectorize; its iterations are
            # independent, so LLVM's loop vectoriser takes it)
        except s_tir.ScheduleError:
            return None
        return sch
