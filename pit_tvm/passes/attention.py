"""``FuseAttention``: on CUDA (sm_90a), ``softmax(q @ permute(k) * scale + mask) @ v`` becomes
one fused-attention kernel (:func:`pit_tvm.ops.attention.emit_fused_attention`).

Why: imported from ONNX, a BERT layer's attention is five TVM kernels (batched QK^T, scale and
mask, softmax, PV, and a copy for K's transpose), ~60 us a layer on the H100 at 32 x 128
tokens; the fused kernel keeps the scores on chip.  Both builds (PIT and PIT-off) run it.

Matched (each inner value used once, ``k`` transposed by ``permute_dims(axes=[0, 1, 3, 2])``,
``scale`` a scalar constant, softmax over the last axis)::

    matmul(softmax(add(multiply(matmul(q, permute_dims(k)), scale), mask)), v)

with ``multiply`` and ``add`` in either operand order.  Anything the kernel does not take
(symbolic or unsupported sizes, CPU targets) keeps the unfused graph.
"""
from __future__ import annotations

import tvm
from tvm import relax

from pit_tvm.target import is_gpu, make_target


def _op_is(expr, name):
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def _attention_chains(func: relax.Function) -> dict:
    """{the final ``matmul(p, v)`` call: (q, k, v, mask, scale)} of ``func``'s attention chains."""
    bound, uses = {}, {}
    for block in func.body.blocks:
        for b in block.bindings:
            bound[b.var] = b.value
            for arg in (b.value.args if isinstance(b.value, relax.Call) else [b.value]):
                if isinstance(arg, relax.Var):
                    uses[arg] = uses.get(arg, 0) + 1
    if isinstance(func.body.body, relax.Var):
        uses[func.body.body] = uses.get(func.body.body, 0) + 1

    def single(var, name):
        """the call bound to ``var`` if it is ``name`` and ``var`` has one use"""
        value = bound.get(var) if isinstance(var, relax.Var) else None
        return value if _op_is(value, name) and uses.get(var) == 1 else None

    def scalar(expr):
        if isinstance(expr, tvm.ir.GenericConst) and expr.value.numpy().size == 1:
            return float(expr.value.numpy().reshape(()))
        return None

    chains = {}
    for value in bound.values():
        if not _op_is(value, "relax.matmul"):
            continue
        probs, v = value.args
        soft = single(probs, "relax.nn.softmax")
        if soft is None or int(soft.attrs.axis) not in (-1, len(soft.ty.shape) - 1):
            continue
        added = single(soft.args[0], "relax.add")
        if added is None:
            continue
        for scaled_var, mask in (added.args, added.args[::-1]):
            scaled = single(scaled_var, "relax.multiply")
            if scaled is None:
                continue
            for scores_var, factor in (scaled.args, scaled.args[::-1]):
                scores, scale = single(scores_var, "relax.matmul"), scalar(factor)
                if scores is None or scale is None:
                    continue
                q, kt = scores.args
                perm = single(kt, "relax.permute_dims")
                if perm is None or perm.attrs.axes is None or [int(a) for a in perm.attrs.axes] != [0, 1, 3, 2]:
                    continue
                chains[value] = (q, perm.args[0], v, mask, scale)
                break
            if value in chains:
                break
    return chains


def _default_emit():
    from pit_tvm.ops.attention import emit_fused_attention  # noqa: PLC0415 - the op layer

    return emit_fused_attention


@tvm.transform.module_pass(opt_level=0, name="FuseAttention")
class FuseAttention:
    """Module pass (a no-op on CPU targets); ``emit``: replacement for
    ``emit_fused_attention`` (same signature), for tests."""

    def __init__(self, target="cuda", emit=None):
        self.target = make_target(target)
        self.emit = emit

    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        if not is_gpu(self.target):
            return mod
        emit = self.emit or _default_emit()
        target = self.target
        chains = {}

        @relax.expr_functor.mutator
        class _Rewrite(relax.PyExprMutator):
            def visit_call_(self, op):
                chain = chains.get(op)
                if chain is not None:
                    q, k, v, mask, scale = chain
                    new = emit(self.builder_, *(self.visit_expr(x) for x in (q, k, v, mask)), scale,
                               target=target)
                    if new is not None:
                        return new
                return self.visit_expr_post_order(op)

        rewriter = _Rewrite(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                chains.clear()
                chains.update(_attention_chains(func))
                if chains:
                    rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        # the unfused chain (QK^T, scale, mask, softmax) is dead now
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())
