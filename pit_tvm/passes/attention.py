"""``FuseAttention``: on CUDA (sm_90a), ``softmax(q @ permute(k) * scale + mask) @ v`` becomes
one fused-attention kernel (:func:`pit_tvm.ops.attention.emit_fused_attention`).

Why: imported from ONNX, a BERT layer's attention is five TVM kernels (batched QK^T, scale and
mask, softmax, PV, and a copy for K's transpose); the fused kernel keeps the scores on chip
(docs/design/measurements.md#fused-attention).  Both builds (PIT and PIT-off) run it.

Matched (each inner value used once, ``k`` transposed by ``permute_dims(axes=[0, 1, 3, 2])``,
``scale`` a scalar constant, softmax over the last axis)::

    matmul(softmax(add(multiply(matmul(q, permute_dims(k)), scale), mask)), v)

with ``multiply`` and ``add`` in either operand order.  Where q, k and v are head splits of
projections (``permute_dims(reshape(strided_slice(X, last axis)), [0, 2, 1, 3])``) the kernel
reads X in place, and where the result's only use merges the heads back (``reshape(
permute_dims(o, [0, 2, 1, 3]), [B, S, H D])``) it writes that layout: no copy is left around
the attention.  Anything the kernel does not take (symbolic or unsupported sizes, CPU targets)
keeps the unfused graph.
"""
from __future__ import annotations

import tvm
from tvm import relax

from pit_tvm.target import is_gpu, make_target

from .graph import FuncGraph, op_name, other_operand, scalar_constant


def _ints(tup) -> list[int] | None:
    try:
        return [int(x.value) if hasattr(x, "value") else int(x) for x in tup]
    except (TypeError, ValueError):
        return None


def _head_split(g: FuncGraph, x):
    """``(X, o)`` when ``x = permute_dims(reshape(strided_slice(X, last axis, [o, o + H D]),
    [B, S, H, D]), [0, 2, 1, 3])``, each step used once: head h of x is columns ``o + h D``
    of the ``[B, S, W]`` tensor X.  Else None."""
    perm = g.single(x, "relax.permute_dims")
    if perm is None or perm.attrs.axes is None or [int(a) for a in perm.attrs.axes] != [0, 2, 1, 3]:
        return None
    split = g.single(perm.args[0], "relax.reshape")
    sliced = g.single(split.args[0], "relax.strided_slice") if split is not None else None
    if sliced is None or len(sliced.args) != 4:        # (explicit strides: not matched)
        return None
    src, axes, begin, end = sliced.args[0], *(_ints(a) for a in sliced.args[1:])
    shape, heads = getattr(src.ty, "shape", None), getattr(split.ty, "shape", None)
    if (None in (axes, begin, end, shape, heads) or len(shape) != 3 or len(heads) != 4
            or axes not in ([2], [-1]) or not all(isinstance(d, tvm.tirx.IntImm) for d in heads)):
        return None
    h, d = int(heads[2]), int(heads[3])
    return (src, begin[0]) if end[0] - begin[0] == h * d and begin[0] >= 0 else None


def _head_merge(g: FuncGraph, var):
    """The var of ``reshape(permute_dims(var, [0, 2, 1, 3]), [B, S, H D])`` when that is the
    only use of ``var`` and of the permute, else None."""
    perm_var = g.sole_user(var)
    perm = g.bound.get(perm_var)
    if (op_name(perm) != "relax.permute_dims" or perm.attrs.axes is None
            or [int(a) for a in perm.attrs.axes] != [0, 2, 1, 3]):
        return None
    merged_var = g.sole_user(perm_var)
    merged = g.bound.get(merged_var)
    shape = getattr(merged, "ty", None) and getattr(merged.ty, "shape", None)
    if op_name(merged) != "relax.reshape" or shape is None or len(shape) != 3:
        return None
    return merged_var


def _row_scaled(g: FuncGraph, var):
    """``(the multiply call, s)`` when ``var``'s only use is ``multiply(var, s)`` (either order)
    with ``s`` of shape ``[B, S, 1]`` (a padding mask on the merged heads), else None."""
    user = g.sole_user(var)
    mul = g.bound.get(user)
    if op_name(mul) != "relax.multiply":
        return None
    s = other_operand(mul, var)
    shape, out = getattr(s.ty, "shape", None), getattr(var.ty, "shape", None)
    if shape is None or out is None or len(shape) != 3 or not isinstance(shape[2], tvm.tirx.IntImm) \
            or int(shape[2]) != 1 or s.same_as(var):
        return None
    return mul, s


def _scores(g: FuncGraph, logits):
    """``(q, k, mask, scale)`` when ``logits = add(multiply(matmul(q, permute_dims(k, [0, 1,
    3, 2])), scale), mask)`` (either operand order of the add and the multiply, each step used
    once, ``scale`` a scalar constant), else None."""
    added = g.single(logits, "relax.add")
    for scaled_var, mask in ((added.args, added.args[::-1]) if added is not None else ()):
        scaled = g.single(scaled_var, "relax.multiply")
        for scores_var, factor in ((scaled.args, scaled.args[::-1]) if scaled is not None else ()):
            scores, scale = g.single(scores_var, "relax.matmul"), scalar_constant(factor)
            perm = g.single(scores.args[1], "relax.permute_dims") if scores is not None else None
            if (scale is not None and perm is not None and perm.attrs.axes is not None
                    and [int(a) for a in perm.attrs.axes] == [0, 1, 3, 2]):
                return scores.args[0], perm.args[0], mask, scale
    return None


def _attention_chains(func: relax.Function) -> dict:
    """{the final ``matmul(p, v)`` call: (q, k, v, mask, scale, packed, merge, row_scale)} of
    ``func``'s attention chains.  ``packed``: q, k, v's head splits of projection outputs
    (:func:`_head_split`), which the kernel reads in place, or None; ``merge``: the call whose
    value the kernel's ``[B, S, H D]`` output replaces, or None: the reshape that merges the
    result's heads back (:func:`_head_merge`), or the multiply by ``row_scale`` after it
    (:func:`_row_scaled`, a padding mask, else None)."""
    g = FuncGraph(func)
    by_var = {value: var for var, value in g.bound.items()}
    chains = {}
    for value in g.bound.values():
        if op_name(value) != "relax.matmul":
            continue
        probs, v = value.args
        soft = g.single(probs, "relax.nn.softmax")
        if soft is None or int(soft.attrs.axis) not in (-1, len(soft.ty.shape) - 1):
            continue
        scores = _scores(g, soft.args[0])
        if scores is None:
            continue
        q, k, mask, scale = scores
        splits = [_head_split(g, x) for x in (q, k, v)]
        packed = tuple(splits) if None not in splits else None
        merged = _head_merge(g, by_var.get(value))
        out_scaled = _row_scaled(g, merged) if merged is not None else None
        merge, row_scale = out_scaled or (g.bound.get(merged), None)
        chains[value] = (q, k, v, mask, scale, packed, merge, row_scale)
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
        merged_by = {}   # the call a merged-heads kernel output replaces -> that output

        @relax.expr_functor.mutator
        class _Rewrite(relax.PyExprMutator):
            def visit_call_(self, op):
                if op in merged_by:
                    return merged_by[op]
                chain = chains.get(op)
                if chain is None:
                    return self.visit_expr_post_order(op)
                q, k, v, mask, scale, packed, merge, row_scale = chain
                args = [self.visit_expr(x) for x in (q, k, v, mask)]
                if packed is not None:
                    packed = tuple((self.visit_expr(x), o) for x, o in packed)
                row_scale = self.visit_expr(row_scale) if row_scale is not None else None
                # the layouts that spare copies first; the kernel on [B, H, S, D] tensors else
                # (a merge that the kernel does not take is left to the graph)
                for layout, out_packed in dict.fromkeys(((packed, merge is not None), (None, False))):
                    new = emit(self.builder_, *args, scale, target=target, packed=layout, out_packed=out_packed,
                               **({"row_scale": row_scale} if out_packed and row_scale is not None else {}))
                    if new is not None and out_packed:
                        merged_by[merge] = new     # (this matmul and its chain are dead now)
                        break
                    if new is not None:
                        return new
                return self.visit_expr_post_order(op)

        rewriter = _Rewrite(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                chains.clear()
                merged_by.clear()
                chains.update(_attention_chains(func))
                if chains:
                    rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        # the unfused chain (QK^T, scale, mask, softmax) is dead now
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())
