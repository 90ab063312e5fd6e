"""``FuseAttention``: on CUDA (sm_90a), ``softmax(q @ permute(k) * scale + mask) @ v`` becomes
one fused-attention kernel (:func:`pit_tvm.ops.attention.emit_fused_attention`).

Why: imported from ONNX, a BERT layer's attention is five TVM kernels (batched QK^T, scale and
mask, softmax, PV, and a copy for K's transpose); the fused kernel keeps the scores on chip
(docs/design/measurements.md#fused-attention).  Both builds (PIT and PIT-off) run it.

Matched (each inner value used once, ``k`` transposed by ``permute_dims(axes=[0, 1, 3, 2])``,
``scale`` a scalar constant, softmax over the last axis)::

    matmul(softmax(add(multiply(matmul(q, permute_dims(k)), scale), mask)), v)

with ``multiply`` and ``add`` in either operand order.  ``torch.onnx``'s export of SDPA (the
``transformers`` encoders) is matched too: the scale's square root on q and on K's transpose
(``permute_dims(k_rows, [0, 2, 3, 1])`` of K's ``[B, S, H, D]`` rows), a ``[B, 1, S, S]``
``where(mask, 0, min)`` broadcast from the ``[B, 1, 1, S]`` padding mask (the kernel gets that
mask's ``[B, 1, 1, S]`` where), and ``where(isnan(p), 0, p)`` after the softmax (kept out:
with finite mask values it never fires).  Where q, k and v are head splits of
projections (``permute_dims(reshape(strided_slice(X, last axis)), [0, 2, 1, 3])``) the kernel
reads X in place, and where the result's only use merges the heads back (``reshape(
permute_dims(o, [0, 2, 1, 3]), [B, S, H D])``) it writes that layout: no copy is left around
the attention.  Anything the kernel does not take (symbolic or unsupported sizes, CPU targets)
keeps the unfused graph.
"""
from __future__ import annotations

from typing import NamedTuple

import tvm
from tvm import relax

from pit_tvm.target import is_gpu, make_target

from .attention_match import axes_of, probabilities, same_dim, scores, shape_of
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
    if perm is None or axes_of(perm) != [0, 2, 1, 3]:
        return None
    return _head_split_rows(g, perm.args[0])


def _head_split_rows(g: FuncGraph, rows):
    """``(X, o)`` when ``rows = reshape(strided_slice(X, last axis, [o, o + H D]), [B, S, H,
    D])``, each step used once, else None."""
    split = g.single(rows, "relax.reshape")
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
    if op_name(perm) == "relax.reshape" and _same_dims(shape_of(perm), shape_of(var)):   # (the export's no-op reshape)
        perm_var = g.sole_user(perm_var)
        perm = g.bound.get(perm_var)
    if op_name(perm) != "relax.permute_dims" or axes_of(perm) != [0, 2, 1, 3]:
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


def _same_dims(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(same_dim(x, y) for x, y in zip(a, b))


def _logits(g: FuncGraph, logits):
    """``(q, k, k_rows, mask, scale)`` when ``logits = add(scores, mask)`` (either order, used
    once) with ``scores`` as :func:`~.attention_match.scores` matches them (``k_rows``: k is
    K's heads-last ``[B, S, H, D]`` rows, to be transposed ``[0, 2, 1, 3]``), else None."""
    added = g.single(logits, "relax.add")
    for scores_var, mask in ((added.args, added.args[::-1]) if added is not None else ()):
        found = scores(g, scores_var)
        if found is not None:
            q, k, k_axes, scale = found
            return q, k, k_axes is not None, mask, scale
    return None


def _all_true(expr) -> bool:
    return (isinstance(expr, tvm.ir.GenericConst) and str(expr.ty.dtype) == "bool"
            and bool(expr.value.numpy().all()))


def _key_mask(g: FuncGraph, mask):
    """The additive key mask as the kernel takes it: ``mask`` itself when it is ``[MB, 1, 1,
    S]``; else ``(m, c0, c1)`` when ``mask = where(cond, c0, c1)`` with finite scalar constants
    and ``cond`` a ``[MB, 1, 1, S]`` bool ``m`` broadcast over the queries (``broadcast_to``,
    ``logical_and`` with an all-true constant, bool casts: the ``transformers`` export's
    ``[B, 1, S, S]`` mask of a padding mask), the kernel's mask then being ``where(m, c0, c1)``.
    None otherwise."""
    shape = _ints(getattr(mask.ty, "shape", None) or [])
    if shape and len(shape) == 4 and shape[1:3] == [1, 1]:
        return mask
    if not _finite_where(g, mask):
        return None
    cond, c0, c1 = g.bound[mask].args
    while True:
        shape = _ints(getattr(cond.ty, "shape", None) or [])
        if shape and len(shape) == 4 and shape[1:3] == [1, 1]:
            return cond, c0, c1
        value = g.bound.get(cond)
        name = op_name(value)
        if name == "relax.broadcast_to" or (name == "relax.astype" and str(value.args[0].ty.dtype) == "bool"):
            cond = value.args[0]
        elif name == "relax.logical_and" and _all_true(value.args[0]):
            cond = value.args[1]
        elif name == "relax.logical_and" and _all_true(value.args[1]):
            cond = value.args[0]
        else:
            return None


def _finite_where(g: FuncGraph, mask) -> bool:
    """Whether ``mask = where(cond, c0, c1)`` with finite scalar constants."""
    where = g.bound.get(mask)
    if op_name(where) != "relax.where":
        return False
    values = [scalar_constant(c) for c in where.args[1:]]
    return None not in values and all(abs(v) < float("inf") for v in values)


class AttentionChain(NamedTuple):
    """One matched attention (:func:`_attention_chains`)."""

    q: relax.Expr
    k: relax.Expr
    k_rows: bool
    v: relax.Expr
    key_mask: object
    scale: float
    packed: tuple | None
    merge: relax.Expr | None
    row_scale: relax.Expr | None


def _attention_chains(func: relax.Function) -> dict:
    """{the final ``matmul(p, v)`` call: its :class:`AttentionChain`} of ``func``'s attention
    chains (``k_rows``: :func:`_logits`; ``key_mask``: :func:`_key_mask`).  ``packed``: q, k,
    v's head splits of projection outputs
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
        soft = probabilities(g, probs)
        found = _logits(g, soft.args[0]) if soft is not None else None
        if found is None:
            continue
        # (behind the NaN guard: the kernel has no NaN to zero where the mask is finite)
        guarded = op_name(g.bound.get(probs)) == "relax.where"
        q, k, k_rows, mask, scale = found
        key_mask = _key_mask(g, mask)
        if key_mask is None or (guarded and not _finite_where(g, mask)):
            continue
        splits = [_head_split(g, q), (_head_split_rows if k_rows else _head_split)(g, k), _head_split(g, v)]
        packed = tuple(splits) if None not in splits else None
        merged = _head_merge(g, by_var.get(value))
        out_scaled = _row_scaled(g, merged) if merged is not None else None
        merge, row_scale = out_scaled or (g.bound.get(merged), None)
        chains[value] = AttentionChain(q, k, k_rows, v, key_mask, scale, packed, merge, row_scale)
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
                q, k, k_rows, v, key_mask, scale, packed, merge, row_scale = chain
                q, k, v = (self.visit_expr(x) for x in (q, k, v))
                if k_rows:     # (dead when the packed layout applies)
                    k = self.builder_.emit(relax.op.permute_dims(k, [0, 2, 1, 3]))
                if isinstance(key_mask, tuple):
                    cond, c0, c1 = key_mask
                    mask = self.builder_.emit(relax.op.where(self.visit_expr(cond), c0, c1))
                else:
                    mask = self.visit_expr(key_mask)
                args = [q, k, v, mask]
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
