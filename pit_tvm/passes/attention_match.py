"""Matching the parts of a softmax attention chain in a Relax function (ANF), shared by
:class:`~pit_tvm.passes.FuseAttention` and :class:`~pit_tvm.passes.SparseAttentionToPIT`: the
scores ``q @ kᵀ`` with their scalar scales, in the layouts the ONNX exporters write kᵀ, and the
softmax, behind the NaN guard ``torch.onnx`` puts after SDPA's."""
from __future__ import annotations

from tvm import relax
from tvm.sym.analyzer import Analyzer

from .graph import FuncGraph, op_name, scalar_constant

__all__ = ["axes_of", "probabilities", "same_dim", "scaled", "scores", "shape_of"]


def axes_of(call):
    """The axes of a ``permute_dims`` call as ints (None: reversed)."""
    return [int(a) for a in call.attrs.axes] if call.attrs.axes is not None else None


def scaled(g: FuncGraph, x):
    """``(x', c)`` when ``x = multiply(x', c)`` / ``multiply(c, x')`` / ``divide(x', c)`` with a
    scalar constant ``c`` (used once; c inverted for a divide), else ``(x, 1.0)``."""
    value = g.bound.get(x) if isinstance(x, relax.Var) else None
    if op_name(value) not in ("relax.multiply", "relax.divide") or g.uses.get(x) != 1:
        return x, 1.0
    a, b = value.args
    c = scalar_constant(b)
    if c is None and op_name(value) == "relax.multiply":
        a, c = b, scalar_constant(a)
    if c is None or (op_name(value) == "relax.divide" and c == 0):
        return x, 1.0
    return a, (c if op_name(value) == "relax.multiply" else 1.0 / c)


def scores(g: FuncGraph, x):
    """``(q, k, k_axes, scale)`` when ``x`` is ``matmul(q, kᵀ)`` with scalar-constant factors on
    q, on kᵀ or on the product (each step used once; the scale is their product), kᵀ
    ``permute_dims(k, [0, 1, 3, 2])`` or ``permute_dims(x, [0, 2, 3, 1])`` of the heads-last
    ``x[B, S, H, d]`` (then ``k_axes`` = [0, 2, 1, 3]: k is ``permute_dims(x, k_axes)``), else None."""
    x, scale = scaled(g, x)
    mm = g.single(x, "relax.matmul")
    if mm is None:
        return None
    q, qc = scaled(g, mm.args[0])
    kt, kc = scaled(g, mm.args[1])
    k = transposed_through_3d(g, kt)
    if k is not None:
        return q, k, None, scale * qc * kc
    perm = g.single(kt, "relax.permute_dims")
    if perm is None:
        return None
    if axes_of(perm) == [0, 1, 3, 2]:
        return q, perm.args[0], None, scale * qc * kc
    if axes_of(perm) == [0, 2, 3, 1]:
        return q, perm.args[0], [0, 2, 1, 3], scale * qc * kc
    return None


def transposed_through_3d(g: FuncGraph, kt):
    """``k`` when ``kt = reshape(permute_dims(reshape(k[B, H, S, d], [B*H, S, d]), [0, 2, 1]),
    [B, H, d, S])`` (the dynamo exporter's ``kᵀ``: ``permute_dims(k, [0, 1, 3, 2])``), else None."""
    outer = g.single(kt, "relax.reshape")
    perm = g.single(outer.args[0], "relax.permute_dims") if outer is not None else None
    if perm is None or axes_of(perm) != [0, 2, 1]:
        return None
    inner = g.single(perm.args[0], "relax.reshape")
    if inner is None:
        return None
    k = inner.args[0]
    k_shape, flat, out = shape_of(k), shape_of(perm.args[0]), shape_of(kt)
    if k_shape is None or flat is None or out is None or len(k_shape) != 4 or len(flat) != 3 or len(out) != 4:
        return None
    B, H, S, d = k_shape
    if not (same_dim(flat[0], B * H) and same_dim(flat[1], S) and same_dim(flat[2], d)
            and all(same_dim(a, b) for a, b in zip(out, (B, H, d, S)))):
        return None
    return k


def probabilities(g: FuncGraph, p):
    """The softmax call behind ``p``: ``p = softmax(x, last axis)`` used once, or the SDPA
    export's ``where(isnan(s), 0, s)`` of such a softmax ``s`` (its rows with no allowed key
    are 0, as the op's are), else None."""
    value = g.bound.get(p) if isinstance(p, relax.Var) else None
    if op_name(value) == "relax.where" and g.uses.get(p) == 1:
        cond, zero, s = value.args
        isnan = g.single(cond, "relax.isnan")
        soft = g.bound.get(s) if isinstance(s, relax.Var) else None
        if (isnan is not None and isnan.args[0].same_as(s) and scalar_constant(zero) == 0.0
                and op_name(soft) == "relax.nn.softmax" and g.uses.get(s) == 2):
            value = soft
        else:
            return None
    elif op_name(value) != "relax.nn.softmax" or g.uses.get(p) != 1:
        return None
    if int(value.attrs.axis) not in (-1, len(value.ty.shape) - 1):
        return None
    return value


def same_dim(a, b) -> bool:
    """Whether two dims (ints or symbolic expressions) are provably equal."""
    return bool(Analyzer().can_prove_equal(a, b)) if not (isinstance(a, int) or isinstance(b, int)) else a == b


def shape_of(x):
    """The dims of a tensor-typed expression as a list, else None."""
    shape = getattr(x.ty, "shape", None) if isinstance(getattr(x, "ty", None), relax.TensorType) else None
    return None if shape is None else list(shape)
