"""``DenseMatmulToPITKernels``: put the dense matmuls of a model on the dense kernel the PIT
kernels are measured against (:func:`pit_tvm.ops.matmul.emit_dense_matmul`), in PIT and
PIT-off builds alike.

Why: without it a PIT build would be faster than the PIT-off build partly because of a better
GEMM, not because of sparsity.  CUDA: TVM 0.27's default path schedules ``R.matmul`` with
dlight's SIMT kernel, a fraction of the PIT tensor-core kernels' throughput; the pass puts
fp16/bf16 matmuls on the PIT kernels' tensor-core tiles.  CPU: TVM leaves a matmul as
LegalizeOps' unscheduled loops, far slower than the PIT CPU schedule's dense twin
(docs/design/measurements.md#graph-passes); the pass puts fp32/fp16 matmuls on that twin.
Run after :class:`~pit_tvm.passes.LowerToPIT`.

Rewritten: ``R.matmul(a[..., K], b[K, N])`` with ``b`` a 2-D tensor of static shape (and on
CUDA a tensor-core tile config that fits (K, N)).  Everything else (batched matmuls such as
attention's, odd shapes) keeps the normal path.  A matmul followed by an epilogue chain
(:mod:`pit_tvm.passes.epilogue`: a bias, ReLU or GELU, a row scale, a residual) runs it in the
CUDA kernel's epilogue (a separate kernel over the [tokens, 4d] activation costs a full pass
over it), on the CPU as Relax ops after the kernel.
"""
from __future__ import annotations

import tvm
from tvm import relax

from pit_tvm.target import make_target

from .epilogue import epilogue_chains


def _default_emit():
    from pit_tvm.ops.matmul import emit_dense_matmul  # noqa: PLC0415 - written by the op layer

    return emit_dense_matmul


@tvm.transform.module_pass(opt_level=0, name="DenseMatmulToPITKernels")
class DenseMatmulToPITKernels:
    """Module pass; ``emit``: replacement for ``emit_dense_matmul`` (same signature), for tests."""

    def __init__(self, target="cuda", emit=None):
        self.target = make_target(target)
        self.emit = emit

    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        emit = self.emit or _default_emit()
        target = self.target
        matmul_op = tvm.ir.Op.get("relax.matmul")

        chains = {}

        @relax.expr_functor.mutator
        class _Rewrite(relax.PyExprMutator):
            def visit_call_(self, op):
                chain = chains["ends"].get(op)
                if chain is not None:
                    mm = chain.head
                    out_dtype = str(mm.attrs.out_dtype) if mm.attrs.out_dtype else None
                    a, b = (self.visit_expr(x) for x in mm.args)
                    row_scale = None if chain.row_scale is None else self.visit_expr(chain.row_scale)
                    residual = None if chain.residual is None else self.visit_expr(chain.residual)
                    new = emit(self.builder_, a, b, target=target, out_dtype=out_dtype, bias=chain.bias,
                               activation=chain.activation, row_scale=row_scale, residual=residual)
                    if new is not None:
                        return new
                call = self.visit_expr_post_order(op)
                if not (isinstance(call, relax.Call) and call.op.same_as(matmul_op)):
                    return call
                if op in chains["heads"]:  # emitted with its epilogue at the chain's end
                    return call
                a, b = call.args
                out_dtype = str(call.attrs.out_dtype) if call.attrs.out_dtype else None
                new = emit(self.builder_, a, b, target=target, out_dtype=out_dtype)
                return call if new is None else new

        rewriter = _Rewrite(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                chains["ends"] = epilogue_chains(func, lambda c: c.op.same_as(matmul_op))
                chains["heads"] = {c.head for c in chains["ends"].values()}
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        # the matmuls folded into an epilogue chain are dead now
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())
