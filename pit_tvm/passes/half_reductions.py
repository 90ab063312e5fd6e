"""``HalfReductionsInFloat32``: mean / sum / variance / softmax of a float16 or bfloat16 tensor
computed in float32, and matmuls of half tensors accumulated in float32 (a build pipeline stage,
CPU and CUDA).

Why: TVM legalizes ``R.mean`` (``R.sum``, ``R.variance``, ``R.nn.softmax``) into TIR that
accumulates in the tensor's own dtype, so a float16 model's reductions sum hundreds of values in
float16.  Exports decompose norms into such reductions (T5's RMS norm: ``mean(x * x)``), and
frameworks compute them in float32 (PyTorch accumulates half reductions in float; HF's T5 norm
upcasts its variance); in float16 the norm's error, amplified by MoE routers and the layers
after it, moved the Switch encoder's outputs well away from PyTorch's.

Rewritten: ``op(x, ...)`` with ``x`` float16 / bfloat16 and ``op`` one of :data:`REDUCTIONS`
becomes ``astype(op(astype(x, "float32"), ...), x's dtype)``: the reduction's kernel accumulates
in float and writes half (the widening cast fuses into it, or into the kernel producing ``x``,
whose output is then float).  ``matmul(a, b)`` of half tensors with no other output dtype becomes
``astype(matmul(a, b, out_dtype="float32"), half)``: the same half operands (tensor cores), a float
accumulator (TVM's tensor-core matmul schedule accumulates in the output dtype: an attention's
Q K^T and P V that no fused kernel took summed in float16, where cuBLAS sums in float).
Softmax attention fused earlier (``FuseAttention``), the GEMMs lowered to the PIT / dense kernels
and those kernels are not Relax reductions or matmuls any more and stay as they are.
"""
from __future__ import annotations

import tvm
from tvm import relax

from .graph import rewrite_functions

#: the Relax reductions computed in float32 for half inputs
REDUCTIONS = ("relax.mean", "relax.sum", "relax.variance", "relax.nn.softmax", "relax.nn.log_softmax")
HALF_DTYPES = ("float16", "bfloat16")


def half_reduction_dtype(call: relax.Call) -> str | None:
    """The half dtype of ``call``'s input when :class:`HalfReductionsInFloat32` rewrites it, else None."""
    if not (isinstance(call.op, tvm.ir.Op) and call.op.name in (*REDUCTIONS, "relax.matmul") and call.args):
        return None
    dtype = str(getattr(call.args[0].ty, "dtype", ""))
    if call.op.name == "relax.matmul":
        out = call.attrs.out_dtype
        if str(getattr(call.args[1].ty, "dtype", "")) != dtype or (out is not None and str(out) != dtype):
            return None
    return dtype if dtype in HALF_DTYPES else None


@relax.expr_functor.mutator
class _HalfReductionRewriter(relax.PyExprMutator):
    def visit_call_(self, op: relax.Call) -> relax.Expr:
        call = super().visit_call_(op)
        dtype = half_reduction_dtype(call)
        if dtype is None:
            return call
        if call.op.name == "relax.matmul":
            product = self.builder_.emit(relax.op.matmul(call.args[0], call.args[1], out_dtype="float32"))
            return relax.op.astype(product, dtype)
        wide = self.builder_.emit(relax.op.astype(call.args[0], "float32"))
        reduced = self.builder_.emit(relax.Call(call.op, [wide, *call.args[1:]], call.attrs))
        return relax.op.astype(reduced, dtype)


@tvm.transform.module_pass(opt_level=0, name="HalfReductionsInFloat32")
def HalfReductionsInFloat32(mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:  # noqa: N802 - a pass, named like TVM's
    """Compute the half-precision reductions of the module's Relax functions in float32 (see the
    module docstring)."""
    return rewrite_functions(mod, _HalfReductionRewriter(mod))
