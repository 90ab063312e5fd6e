"""``CombineParallelMatmuls``: one matmul for the matmuls that share an input (attention's Q,
K and V projections), on constant weights.

Why: on the H100 a 4096 x 768 x 768 fp16 GEMM is latency-bound (one wave of CTAs), so three
of them cost about three times one 768 x 2304 GEMM's latency
(docs/design/measurements.md#graph-passes). For a PIT matmul it matters more: a latency-bound
kernel gains nothing from skipping rows, and each PIT matmul also writes its zero rows.

TVM's ``relax.transform.CombineParallelMatmul`` does the rewrite (concat of the weights and of
the bias adds, one matmul, split), but only matches weights that are variables, and an ONNX
import binds them as constants. This pass lifts the constant weights and biases to function
parameters, runs TVM's pass, binds them back and folds the concatenations into new constants.
Each output of the split then becomes a ``strided_slice``: a split is a multi-output kernel
that no consumer fuses with (three extra copies of the projections per BERT layer), while a
slice fuses into the head transpose after it, or disappears into the fused attention kernel,
which reads the heads in place.
"""
from __future__ import annotations

import tvm
from tvm import relax

from .graph import rewrite_functions


def _lifted_operands(func: relax.Function) -> list:
    """The tensor constants ``func`` uses as a matmul's right operand or as an add's second
    operand (the weights and biases of linear layers), each once; none when no two matmuls
    with a constant right operand share their left one (nothing to combine)."""
    matmul, add = tvm.ir.Op.get("relax.matmul"), tvm.ir.Op.get("relax.add")
    found, lhs_uses = {}, {}

    def visit(expr):
        if (isinstance(expr, relax.Call) and (expr.op.same_as(matmul) or expr.op.same_as(add))
                and isinstance(expr.args[1], tvm.ir.GenericConst) and len(expr.args[1].ty.shape) >= 1):
            found.setdefault(expr.args[1], None)
            if expr.op.same_as(matmul):
                lhs_uses[expr.args[0]] = lhs_uses.get(expr.args[0], 0) + 1

    relax.analysis.post_order_visit(func.body, visit)
    return list(found) if any(n > 1 for n in lhs_uses.values()) else []


def _bias_second(func: relax.Function) -> relax.Function:
    """``func`` with each ``add(constant, x)`` written ``add(x, constant)``: the ONNX export of
    a ``torch.nn.Linear`` adds its bias first (``Add(bias, MatMul)``), and TVM's pass only
    matches the bias as the add's second operand."""
    add = tvm.ir.Op.get("relax.add")

    @relax.expr_functor.mutator
    class _Swap(relax.PyExprMutator):
        def visit_call_(self, op):
            new = self.visit_expr_post_order(op)
            if (isinstance(new, relax.Call) and new.op.same_as(add) and isinstance(new.args[0], tvm.ir.GenericConst)
                    and not isinstance(new.args[1], tvm.ir.GenericConst)):
                return relax.op.add(new.args[1], new.args[0])
            return new

    return _Swap().visit_expr(func)


def _with_params(func: relax.Function, constants: list) -> tuple[relax.Function, dict]:
    """``func`` with each of ``constants`` replaced by a new parameter; {parameter: value}."""
    params = {c: relax.Var(f"pit_w{i}", c.ty) for i, c in enumerate(constants)}

    @relax.expr_functor.mutator
    class _Lift(relax.PyExprMutator):
        def visit_generic_const_(self, op):
            return params.get(op, op)

    body = _Lift().visit_expr(func.body)
    lifted = relax.Function(list(func.params) + list(params.values()), body, func.ret_ty,
                            func.is_pure, func.attrs)
    return lifted, {var: c.value for c, var in params.items()}


def _split_to_slices(mod: tvm.IRModule) -> tvm.IRModule:
    """Every ``split(x)[i]`` at listed indices of a static axis becomes ``strided_slice(x)`` of
    its part (the split is dead).  A concatenated bias add stays whole before the slices: it is
    the combined matmul's epilogue on CUDA (:mod:`pit_tvm.passes.epilogue`), and attention
    reads Q, K and V from the one biased tensor (:class:`~pit_tvm.passes.FuseAttention`)."""
    split = tvm.ir.Op.get("relax.split")

    @relax.expr_functor.mutator
    class _Slices(relax.PyExprMutator):
        def bound(self, expr, op):
            call = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
            return call if isinstance(call, relax.Call) and call.op.same_as(op) else None

        def visit_tuple_getitem_(self, op):
            new = self.visit_expr_post_order(op)
            parts = self.bound(new.tuple_value, split)
            if parts is None:
                return new
            x = parts.args[0]
            rank = len(x.ty.shape)
            axis = int(parts.attrs.axis) % rank
            indices = parts.attrs.indices_or_sections
            # CombineParallelMatmul's splits: a static axis cut at listed indices (an
            # equal-sections or symbolic split stays a split)
            if not isinstance(x.ty.shape[axis], tvm.tirx.IntImm) or not hasattr(indices, "__len__"):
                return new
            cuts = [0] + [int(i) for i in indices] + [int(x.ty.shape[axis])]
            return relax.op.strided_slice(x, [axis], [cuts[new.index]], [cuts[new.index + 1]])

    return relax.transform.DeadCodeElimination()(rewrite_functions(mod, _Slices(mod)))


@tvm.transform.module_pass(opt_level=0, name="CombineParallelMatmuls")
class CombineParallelMatmuls:
    """Module pass: every Relax function's matmuls that share their left operand and have
    constant right operands of one rank become one matmul on the concatenated weights (with
    the concatenated bias add where every branch has one), followed by one slice per branch."""

    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        out, changed = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs), False
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            func = _bias_second(func)
            constants = _lifted_operands(func)
            if not constants:
                continue
            lifted, values = _with_params(func, constants)
            one = tvm.IRModule({gv: lifted})
            one = relax.transform.CombineParallelMatmul()(one)
            one = relax.transform.BindParams(gv.name_hint, values)(one)
            out.update_func(gv, one[gv.name_hint])
            changed = True
        return _split_to_slices(relax.transform.FoldConstant()(out)) if changed else mod
