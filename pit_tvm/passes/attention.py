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

from .graph import FuncGraph, op_name, scalar_constant


def _attention_chains(func: relax.Function) -> dict:
    """{the final ``matmul(p, v)`` call: (q, k, v, mask, scale)} of ``func``'s attention chains."""
    g = FuncGraph(func)
    chains = {}
    for value in g.bound.values():
        if op_name(value) != "relax.matmul":
            continue
        probs, v = value.args
        soft = g.single(probs, "relax.nn.softmax")
        if soft is None or int(soft.attrs.axis) not in (-1, len(soft.ty.shape) - 1):
            continue
        added = g.single(soft.args[0], "relax.add")
        for scaled_var, mask in ((added.args, added.args[::-1]) if added is not None else ()):
            scaled = g.single(scaled_var, "relax.multiply")
            for scores_var, factor in ((scaled.args, scaled.args[::-1]) if scaled is not None else ()):
                scores, scale = g.single(scores_var, "relax.matmul"), scalar_constant(factor)
                perm = g.single(scores.args[1], "relax.permute_dims") if scores is not None else None
                if (scale is not None and perm is not None and perm.attrs.axes is not None
                        and [int(a) for a in perm.attrs.axes] == [0, 1, 3, 2]):
                    chains[value] = (scores.args[0], perm.args[0], v, mask, scale)
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
