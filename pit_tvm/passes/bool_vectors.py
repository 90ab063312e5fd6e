"""``ScalarBoolAccesses``: no vectorised loop reads or writes a ``bool`` buffer (a CUDA build
pipeline stage, after the dlight schedules).

Why: TVM's CUDA codegen types a ``bool`` x4 access ``ushort4``, 8 bytes for 4 one-byte elements:
at a 4-byte offset the load is misaligned (``cudaErrorMisalignedAddress``: the dense build of
the Longformer export at 12 layers, a ``where(mask, ...)`` fused into dlight's matmul epilogue),
and where it is aligned each lane reads two elements OR-ed.  pit_tvm's own elementwise rule
declines such kernels (:mod:`pit_tvm.schedules.elementwise`); the other dlight rules vectorise
their epilogues whatever the dtype, so this pass makes every vectorised loop whose body touches a
``bool`` buffer an unrolled one (lane by lane; the loop's other accesses become scalar too).
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from .tir_buffers import touches_dtype


def _unroll_bool_vectors(loop: tirx.For):
    if loop.kind != tirx.ForKind.VECTORIZED or not touches_dtype(loop.body, "bool"):
        return loop
    return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.UNROLLED, loop.body,
                    loop.thread_binding, loop.annotations)


@tvm.transform.module_pass(opt_level=0, name="ScalarBoolAccesses")
def ScalarBoolAccesses(mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:  # noqa: N802 - a pass, named like TVM's
    """Unroll every vectorised loop of the module's PrimFuncs that loads or stores a ``bool``
    buffer (see the module docstring); other loops are left as they are."""
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc) and touches_dtype(func.body, "bool"):
            body = tvm_ffi.structural_map(func.body, [(tirx.For, _unroll_bool_vectors)])
            if not body.same_as(func.body):
                mod[gv] = func.with_body(body)
    return mod
