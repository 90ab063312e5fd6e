"""``DenseMatmulToTensorCores``: on CUDA, put the dense fp16/bf16 matmuls of a model on the
tensor-core kernel that the PIT kernels use (:func:`pit_tvm.ops.matmul.emit_dense_matmul`).

Why: TVM 0.27's default CUDA path schedules ``R.matmul`` with dlight's SIMT kernel (~80 TF/s
on the H100, the PIT tensor-core kernels ~300).  Without this pass a PIT build would be
faster than the PIT-off build partly because of a better GEMM, not because of sparsity; with
it both builds share the dense kernel.  Run after :class:`~pit_tvm.passes.LowerToPIT`.

Rewritten: ``R.matmul(a[..., K], b[K, N])`` with ``a`` fp16/bf16, ``b`` a 2-D tensor of static
shape, and a tensor-core tile config that fits (K, N).  Everything else (batched matmuls such
as attention's, fp32, odd shapes) keeps the normal path.  A matmul whose only use is
``R.add(mm, bias[N] constant)``, optionally followed by ``R.nn.relu`` (the add's only use), runs
the bias and ReLU in the kernel's epilogue: the OPT FFN's separate bias + ReLU kernel over the
[tokens, 4d] activation took 127 us of 0.88 ms on the H100.
"""
from __future__ import annotations

import tvm
from tvm import relax

from pit_tvm.target import is_gpu, make_target


def _epilogue_chains(func: relax.Function) -> tuple[dict, set]:
    """``({chain's last call: (matmul call, bias constant, relu)}, {matmul calls in a chain})``
    for ``relu?(add(matmul(a, b), bias))`` where each inner value has exactly one use."""
    bound, uses = {}, {}

    def use(expr):
        if isinstance(expr, relax.Var):
            uses[expr] = uses.get(expr, 0) + 1
        elif isinstance(expr, relax.Tuple):
            for f in expr.fields:
                use(f)

    body = func.body
    for block in body.blocks:
        for b in block.bindings:
            bound[b.var] = b.value
            if isinstance(b.value, relax.Call):
                for arg in b.value.args:
                    use(arg)
            else:
                use(b.value)
    use(body.body)

    def op_is(expr, name):
        return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name

    ends, heads = {}, set()
    relu_of = {b_val.args[0]: b_val for b_val in bound.values() if op_is(b_val, "relax.nn.relu")}
    for add_var, value in bound.items():
        if not op_is(value, "relax.add"):
            continue
        for mm_var, bias in (value.args, value.args[::-1]):
            mm = bound.get(mm_var) if isinstance(mm_var, relax.Var) else None
            if (op_is(mm, "relax.matmul") and uses.get(mm_var) == 1 and isinstance(bias, tvm.ir.GenericConst)
                    and len(bias.ty.shape) == 1):
                relu = relu_of.get(add_var) if uses.get(add_var) == 1 else None
                ends[relu if relu is not None else value] = (mm, bias, relu is not None)
                heads.add(mm)
                break
    return ends, heads


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

        chains = {}

        @relax.expr_functor.mutator
        class _Rewrite(relax.PyExprMutator):
            def visit_call_(self, op):
                chain = chains["ends"].get(op)
                if chain is not None:
                    mm, bias, relu = chain
                    out_dtype = str(mm.attrs.out_dtype) if mm.attrs.out_dtype else None
                    a, b = (self.visit_expr(x) for x in mm.args)
                    new = emit(self.builder_, a, b, target=target, out_dtype=out_dtype, bias=bias, relu=relu)
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
                chains["ends"], chains["heads"] = _epilogue_chains(func)
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        # the matmuls folded into an epilogue chain are dead now
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())
