"""``SparseAttentionToPIT``: attention whose mask is computed at run time becomes block-sparse
attention (:func:`pit_tvm.ops.sparse_attention.emit_sparse_attention`): the block index built
from the mask on the device every call, the kernel visiting only the listed key blocks.

Matched in ``main`` (each inner value used once, ``k`` transposed by ``permute_dims(axes=[0, 1,
3, 2])``, softmax over the last axis)::

    matmul(softmax(add(scores, M)), v)                 additive mask M (either operand order)
    matmul(softmax(where(C, scores, fill)), v)         boolean C, fill a constant <= -1e4
    matmul(softmax(where(C, fill, scores)), v)         (not C) allowed
    scores = matmul(q, permute_dims(k)) [* c | / c]    c a scalar constant (the scale)

where ``M`` / ``C`` is computed from graph inputs (a constant mask is a static pattern: left as
it is).  By default only masks with a query axis (``[.., Sq, Sk]``: a per-call pattern such as
window + global tokens) are taken; a key-padding mask (``[B, 1, 1, S]``) stays with the dense
attention (:class:`~pit_tvm.passes.FuseAttention` on the H100).  ``mask_input`` (the
``sparse_attention=`` argument of :func:`pit_tvm.compile_onnx`) names the graph input the mask
is computed from: every chain whose mask reads it is lowered, whatever its shape.

Each decision is recorded in ``main``'s ``pit.annotations`` (source ``attention:<inputs>``,
status ``pit``, or ``dense`` with the reason and a warning: q / k / v not ``[B, H, S, d]`` with
a static d, an unsupported dtype, a mask that does not broadcast to the scores).
"""
from __future__ import annotations

import warnings

import tvm
from tvm import relax, tirx
from tvm.sym.analyzer import Analyzer

from ..errors import UserError
from .annotate import ANNOTATIONS_ATTR
from .frontend import ONNX_NAMES_ATTR, sanitize
from .graph import FuncGraph, op_name, scalar_constant

__all__ = ["SparseAttentionToPIT", "attention_chains"]


def _scores(g: FuncGraph, x):
    """``(q, k, scale)`` when ``x = matmul(q, permute_dims(k, [0, 1, 3, 2]))``, optionally times
    or divided by a scalar constant (each step used once), else None."""
    from pit_tvm.ops.sparse_attention import MASK_THRESHOLD  # noqa: F401 - (documented bound)

    scale = 1.0
    value = g.bound.get(x) if isinstance(x, relax.Var) else None
    if op_name(value) in ("relax.multiply", "relax.divide") and g.uses.get(x) == 1:
        a, b = value.args
        c = scalar_constant(b)
        if c is None and op_name(value) == "relax.multiply":
            a, b = b, a
            c = scalar_constant(b)
        if c is None or (op_name(value) == "relax.divide" and c == 0):
            return None
        scale = c if op_name(value) == "relax.multiply" else 1.0 / c
        x = a
    mm = g.single(x, "relax.matmul")
    if mm is None:
        return None
    perm = g.single(mm.args[1], "relax.permute_dims")
    if perm is None or perm.attrs.axes is None or [int(a) for a in perm.attrs.axes] != [0, 1, 3, 2]:
        return None
    return mm.args[0], perm.args[0], scale


def _fill_is_masked(expr) -> bool:
    from pit_tvm.ops.sparse_attention import MASK_THRESHOLD

    value = scalar_constant(expr)
    return value is not None and value <= MASK_THRESHOLD


def _logits(g: FuncGraph, logits):
    """``(q, k, scale, mask, kind)`` of the softmax input, kind ``additive`` / ``bool`` /
    ``bool_not`` (the mask's True entries are the disallowed ones), else None."""
    value = g.bound.get(logits) if isinstance(logits, relax.Var) else None
    if g.uses.get(logits) != 1:
        return None
    if op_name(value) == "relax.add":
        for s, m in (value.args, value.args[::-1]):
            found = _scores(g, s)
            if found is not None:
                return (*found, m, "additive")
    if op_name(value) == "relax.where":
        cond, a, b = value.args
        if _fill_is_masked(b) and _scores(g, a) is not None:
            return (*_scores(g, a), cond, "bool")
        if _fill_is_masked(a) and _scores(g, b) is not None:
            return (*_scores(g, b), cond, "bool_not")
    return None


def attention_chains(func: relax.Function) -> dict:
    """{the final ``matmul(p, v)`` call: (q, k, v, scale, mask, kind, the mask's graph inputs)}
    of ``func``'s softmax attention chains whose mask is computed from graph inputs."""
    g = FuncGraph(func)
    chains = {}
    for var, value in g.bound.items():
        if op_name(value) != "relax.matmul":
            continue
        probs, v = value.args
        soft = g.single(probs, "relax.nn.softmax")
        if soft is None or int(soft.attrs.axis) not in (-1, len(soft.ty.shape) - 1):
            continue
        found = _logits(g, soft.args[0])
        if found is None:
            continue
        q, k, scale, mask, kind = found
        inputs = g.param_ancestors(mask)
        if inputs:
            chains[value] = (var, q, k, v, scale, mask, kind, inputs)
    return chains


def _same(a, b) -> bool:
    return bool(Analyzer().can_prove_equal(a, b)) if not (isinstance(a, int) or isinstance(b, int)) else a == b


def _mask_layout(q, k, mask):
    """``(mask dims padded to rank 4, head groups)`` when ``mask`` broadcasts to q's scores
    ``[B, H, Sq, Sk]``, else a string saying why not."""
    shape = getattr(mask.ty, "shape", None)
    if shape is None or len(shape) > 4:
        return f"mask {mask.ty} is not a tensor of rank <= 4"
    one = tirx.const(1, "int64")
    dims = [one] * (4 - len(shape)) + list(shape)
    B, H, Sq, _ = q.ty.shape
    Sk = k.ty.shape[2]
    for dim, want, axis in zip(dims, (B, H, Sq, Sk), ("batch", "heads", "queries", "keys")):
        if not (_same(dim, one) or _same(dim, want)):
            return (f"mask of shape {list(shape)} does not broadcast to the scores [B, H, Sq, Sk] = "
                    f"{[B, H, Sq, Sk]} (its {axis} dim)")
    heads = H if not _same(dims[1], one) else one
    return dims, heads


def _check_operands(q, k, v) -> str | None:
    from pit_tvm.ops.sparse_attention import ATTENTION_DTYPES

    for name, x in (("q", q), ("k", k), ("v", v)):
        ty = x.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None or len(ty.shape) != 4:
            return f"{name} is {ty}, not a [B, H, S, d] tensor"
        if str(ty.dtype) not in ATTENTION_DTYPES:
            return f"{name} has dtype {ty.dtype}; sparse attention takes {', '.join(ATTENTION_DTYPES)}"
        if not isinstance(ty.shape[3], tirx.IntImm):
            return f"{name}'s head dim {ty.shape[3]} is not static"
    if len({str(x.ty.dtype) for x in (q, k, v)}) != 1:
        return "q, k, v have different dtypes"
    if not (_same(q.ty.shape[0], k.ty.shape[0]) and _same(q.ty.shape[1], k.ty.shape[1])
            and _same(k.ty.shape[2], v.ty.shape[2]) and _same(q.ty.shape[3], k.ty.shape[3])):
        return f"q {list(q.ty.shape)}, k {list(k.ty.shape)}, v {list(v.ty.shape)} do not agree"
    return None


@tvm.transform.module_pass(opt_level=0, name="SparseAttentionToPIT")
class SparseAttentionToPIT:
    """Module pass; ``target`` the build target, ``mask_input`` None (masks with a query axis)
    or the name of the graph input the masks are computed from."""

    def __init__(self, target="llvm", mask_input: str | None = None):
        from pit_tvm.target import make_target

        self.target = make_target(target)
        self.mask_input = mask_input

    def _resolve_input(self, mod, func):
        if self.mask_input is None:
            return None
        onnx_names = {str(k): str(v) for k, v in (mod.attrs or {}).get(ONNX_NAMES_ATTR, {}).items()}
        want = onnx_names.get(self.mask_input, sanitize(self.mask_input))
        for p in func.params:
            if p.name in (want, self.mask_input):
                return p
        inputs = sorted({rev for rev, var in onnx_names.items() if var in {p.name for p in func.params}}
                        or {p.name for p in func.params})
        raise UserError(f"sparse_attention: unknown input {self.mask_input!r}; the model's inputs are {inputs}")

    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        from pit_tvm.ops.sparse_attention import AttentionPattern, emit_sparse_attention

        gv_main = mod.get_global_var("main")
        func = mod[gv_main]
        named = self._resolve_input(mod, func)
        onnx_of = {str(v): str(k) for k, v in (mod.attrs or {}).get(ONNX_NAMES_ATTR, {}).items()}
        records = [dict(r) for r in (func.attrs or {}).get(ANNOTATIONS_ATTR, [])]
        chains, taken = attention_chains(func), {}
        for call, (var, q, k, v, scale, mask, kind, inputs) in chains.items():
            if named is not None and not any(p.same_as(named) for p in inputs):
                continue
            source = "attention:" + ",".join(sorted(onnx_of.get(p.name, p.name) for p in inputs))
            tensor = onnx_of.get(var.name, var.name)
            why = _check_operands(q, k, v)
            layout = None
            if why is None:
                layout = _mask_layout(q, k, mask)
                if isinstance(layout, str):
                    why, layout = layout, None
            if why is None and kind == "additive" and str(mask.ty.dtype) not in ("float16", "bfloat16", "float32"):
                why = f"additive mask of dtype {mask.ty.dtype}"
            if why is None and kind != "additive" and str(mask.ty.dtype) != "bool":
                why = f"where() condition of dtype {mask.ty.dtype}"
            if why is None and named is None and _same(layout[0][2], tirx.const(1, "int64")) \
                    and not _same(q.ty.shape[2], tirx.const(1, "int64")):
                continue    # a key-padding mask: the dense attention's (name the input to take it)
            if why is not None:
                warnings.warn(f"attention {tensor!r} (mask from {source[10:]}) stays dense: {why}")
                records.append({"tensor": tensor, "source": source, "status": "dense", "reason": why})
                continue
            pattern = AttentionPattern(mask="additive" if kind == "additive" else "bool")
            taken[call] = (q, k, v, scale, mask, kind, layout, pattern)
            records.append({"tensor": tensor, "source": source, "status": "pit",
                            "reason": f"softmax(q k^T * {scale:.6g} + mask) v with the mask computed at run time "
                                      f"from {source[10:]}: block-sparse attention ({pattern.mask} mask), block "
                                      "index built on the device every call"})
        if not taken:
            if records != [dict(r) for r in (func.attrs or {}).get(ANNOTATIONS_ATTR, [])]:
                mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
                mod[gv_main] = func.with_attr(ANNOTATIONS_ATTR, records)
            return mod
        target = self.target

        @relax.expr_functor.mutator
        class _Rewrite(relax.PyExprMutator):
            def visit_call_(self, op):
                chain = taken.get(op)
                if chain is None:
                    return self.visit_expr_post_order(op)
                q, k, v, scale, mask, kind, (dims, heads), pattern = chain
                q, k, v, m = (self.visit_expr(x) for x in (q, k, v, mask))
                bb = self.builder_
                if kind == "bool_not":
                    m = bb.emit(relax.op.logical_not(m))
                if len(m.ty.shape) != 4:
                    m = bb.emit(relax.op.reshape(m, dims))
                B, _, Sq, _ = q.ty.shape
                full = [B, heads, Sq, k.ty.shape[2]]
                if not all(_same(a, b) for a, b in zip(m.ty.shape, full)):
                    m = bb.emit(relax.op.broadcast_to(m, full))
                return emit_sparse_attention(bb, q, k, v, pattern, mask=m, scale=scale, target=target)

        rewriter = _Rewrite(mod)
        rewriter.builder_.update_func(gv_main, rewriter.visit_expr(func))
        new = relax.transform.DeadCodeElimination()(rewriter.builder_.get())
        new[gv_main] = new[gv_main].with_attr(ANNOTATIONS_ATTR, records)
        return new
