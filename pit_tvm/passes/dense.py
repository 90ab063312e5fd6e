"""``DenseMatmulToTensorCores``: on CUDA, put the dense fp16/bf16 matmuls of a model on the
tensor-core kernel that the PIT kernels use (:func:`pit_tvm.ops.matmul.emit_dense_matmul`).

Why: TVM 0.27's default CUDA path schedules ``R.matmul`` with dlight's SIMT kernel (~80 TF/s
on the H100, the PIT tensor-core kernels ~300).  Without this pass a PIT build would be
faster than the PIT-off build partly because of a better GEMM, not because of sparsity; with
it both builds share the dense kernel.  Run after :class:`~pit_tvm.passes.LowerToPIT`.

Rewritten: ``R.matmul(a[..., K], b[K, N])`` with ``a`` fp16/bf16, ``b`` a 2-D tensor of static
shape, and a tensor-core tile config that fits (K, N).  Everything else (batched matmuls such
as attention's, fp32, odd shapes) keeps the normal path.
"""
from __future__ import annotations

import tvm
from tvm import relax

from pit_tvm.target import is_gpu, make_target


def _default_emit():
    from pit_tvm.ops.matmul import emit_dense_matmul  # noqa: PLC0415 - written by the op layer

    return emit_dense_matmul


@tvm.transform.module_pass(opt_level=0, name="DenseMatmulToTensorCores")
class DenseMatmulToTensorCores:
    """Module pass (a no-op on CPU targets); ``emit``: replacement for
    ``emit_dense_matmul`` (same signature), for tests."""

    def __init__(self, target="cuda", emit=None):
        self.target = make_target(target)
        self.emit = emit

    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        if not is_gpu(self.target):
            return mod
        emit = self.emit or _default_emit()
        target = self.target
        matmul_op = tvm.ir.Op.get("relax.matmul")

        @relax.expr_functor.mutator
        class _Rewrite(relax.PyExprMutator):
            def visit_call_(self, op):
                call = self.visit_expr_post_order(op)
                if not (isinstance(call, relax.Call) and call.op.same_as(matmul_op)):
                    return call
                a, b = call.args
                out_dtype = str(call.attrs.out_dtype) if call.attrs.out_dtype else None
                new = emit(self.builder_, a, b, target=target, out_dtype=out_dtype)
                return call if new is None else new

        rewriter = _Rewrite(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()
