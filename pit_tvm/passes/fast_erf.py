"""``ErfToFastErf``: ``R.erf`` as TOPI's ``fast_erf`` on the CPU (a build pipeline stage).

Why: LegalizeOps turns ``R.erf`` into a call of libm's ``erff`` per element, which LLVM can
neither vectorise nor inline.  BERT's FFN activation (bias, GELU's erf form, the padding mask)
was a sixth of a 4-layer CPU encoder's time (docs/design/measurements.md#cpu); ``fast_erf`` is
a polynomial (within 4.2e-7 of erf in fp32, as close as ``erff`` gets) that vectorises with
the rest of the fused kernel.  TVM's ``FastMathTransform`` does this too, along with ``exp`` and ``softmax``, whose
fast forms are 3.6e-6 off in relative terms, and TOPI's fp16 ``fast_erf`` is 0.04 off: only
fp32 erf is rewritten here.  (The CUDA GEMM epilogue has its own fast GELU:
:func:`pit_tvm.schedules.wgmma.gelu_erf`.)
"""
from __future__ import annotations

import tvm
from tvm import relax, topi

from .graph import rewrite_functions


@relax.expr_functor.mutator
class _ErfRewriter(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.erf"
                and getattr(call.args[0].ty, "dtype", None) == "float32"):
            return self.builder_.call_te(topi.fast_erf, call.args[0], primfunc_name_hint="fast_erf")
        return call


@tvm.transform.module_pass(opt_level=0, name="ErfToFastErf")
def ErfToFastErf(mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:  # noqa: N802 - a pass, named like TVM's
    """Rewrite every fp32 ``R.erf`` of the module's Relax functions into a ``call_tir`` of TOPI's
    ``fast_erf`` (its fp16 form is 0.04 off: fp16 erf stays as it is)."""
    return rewrite_functions(mod, _ErfRewriter(mod))
