"""``SparseAttentionToPIT``: attention whose mask is computed at run time becomes block-sparse
attention (:func:`pit_tvm.ops.sparse_attention.emit_sparse_attention`): the block index built
from the mask on the device every call, the kernel visiting only the listed key blocks.

Matched in ``main`` (each inner value used once, ``k`` transposed by ``permute_dims(axes=[0, 1,
3, 2])``, softmax over the last axis)::

    matmul(softmax(add(scores, M)), v)                 additive mask M (either operand order)
    matmul(softmax(where(C, scores, fill)), v)         boolean C, fill a constant <= -1e4
    matmul(softmax(where(C, fill, scores)), v)         (not C) allowed
    matmul(softmax(add(where(C, scores, fill), M)), v) the additive mask where(C, M, fill)
    scores = matmul(q [* c1], kᵀ [* c2]) [* c | / c]   scalar constants (the scale: their product)
    kᵀ = permute_dims(k, [0, 1, 3, 2]) or permute_dims(x[B, S, H, d], [0, 2, 3, 1]), or that
         transpose through [B*H, S, d] (reshape, permute_dims [0, 2, 1], reshape: the dynamo export)

and the softmax may be followed by ``where(isnan(p), 0, p)`` (PyTorch's SDPA export: its rows
with no allowed key are 0, as the op's are).

where ``M`` / ``C`` is computed from graph inputs (a constant mask is a static pattern: left as
it is).  By default only masks that change along the queries (a per-call pattern such as
window + global tokens, or causal) are taken; a key-padding mask (``[B, 1, 1, S]``, or that
expanded to ``[B, 1, S, S]`` as transformers does: :func:`_varies_along_queries`) stays with the
dense attention (:class:`~pit_tvm.passes.FuseAttention` on the H100).  ``mask_input`` (the
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

from ..errors import UserError
from .annotate import ANNOTATIONS_ATTR
from .frontend import ONNX_NAMES_ATTR, sanitize
from .attention_match import axes_of as _axes
from .attention_match import probabilities as _probabilities
from .attention_match import same_dim as _same
from .attention_match import scores as _scores
from .attention_match import shape_of as _shape
from .graph import FuncGraph, op_name, scalar_constant

__all__ = ["SparseAttentionToPIT", "attention_chains"]


def _fill(expr):
    """the value of a scalar constant at or below the mask threshold (a masked score), else None"""
    from pit_tvm.ops.sparse_attention import MASK_THRESHOLD

    value = scalar_constant(expr)
    return value if value is not None and value <= MASK_THRESHOLD else None


def _where_scores(g: FuncGraph, x):
    """``(scores, cond, negated, fill)`` when ``x = where(C, scores, fill)`` (or ``where(C, fill,
    scores)``: negated), ``fill`` a masked-score constant, else None."""
    value = g.bound.get(x) if isinstance(x, relax.Var) else None
    if op_name(value) != "relax.where" or g.uses.get(x) != 1:
        return None
    cond, a, b = value.args
    if _fill(b) is not None and _scores(g, a) is not None:
        return _scores(g, a), cond, False, _fill(b)
    if _fill(a) is not None and _scores(g, b) is not None:
        return _scores(g, b), cond, True, _fill(a)
    return None


def _logits(g: FuncGraph, logits):
    """``(scores, mask parts)`` of the softmax input, else None.  ``scores`` as :func:`_scores`;
    the mask parts ``(kind, mask, cond, fill)``: ``additive`` (``mask`` added), ``bool`` /
    ``bool_not`` (``cond`` True = allowed / disallowed), ``where_add`` (``where(cond, scores,
    fill) + mask``: the additive mask ``where(cond, mask, fill)``)."""
    value = g.bound.get(logits) if isinstance(logits, relax.Var) else None
    if g.uses.get(logits) != 1:
        return None
    if op_name(value) == "relax.add":
        for s, m in (value.args, value.args[::-1]):
            found = _scores(g, s)
            if found is not None:
                return found, ("additive", m, None, None)
            masked = _where_scores(g, s)
            if masked is not None and not masked[2]:
                return masked[0], ("where_add", m, masked[1], masked[3])
    masked = _where_scores(g, logits)
    if masked is not None:
        return masked[0], ("bool_not" if masked[2] else "bool", None, masked[1], masked[3])
    return None


def attention_chains(func: relax.Function, g: FuncGraph | None = None) -> dict:
    """{the final ``matmul(p, v)`` call: (its var, q, k, k_axes, v, scale, mask parts, the mask's
    graph inputs)} of ``func``'s softmax attention chains whose mask is computed from graph
    inputs (see :func:`_logits`); ``g``: ``func``'s graph where the caller has it."""
    g = FuncGraph(func) if g is None else g
    chains = {}
    for var, value in g.bound.items():
        if op_name(value) != "relax.matmul":
            continue
        probs, v = value.args
        soft = _probabilities(g, probs)
        found = _logits(g, soft.args[0]) if soft is not None else None
        if found is None:
            continue
        (q, k, k_axes, scale), parts = found
        kind, mask, cond, _ = parts
        inputs = frozenset().union(*(g.param_ancestors(x) for x in (mask, cond) if x is not None))
        if inputs:
            chains[value] = (var, q, k, k_axes, v, scale, parts, inputs)
    return chains


def _mask_layout(q_shape, k_shape, mask_shapes):
    """``(the mask's dims, broadcast over ``mask_shapes`` and padded to rank 4, head groups)``
    when it broadcasts to the scores ``[B, H, Sq, Sk]``, else a string saying why not."""
    one = tirx.const(1, "int64")
    if any(shape is None or len(shape) > 4 for shape in mask_shapes):
        return f"mask shapes {mask_shapes}: not tensors of rank <= 4"
    dims = [one] * 4
    for shape in mask_shapes:
        for axis, dim in enumerate([one] * (4 - len(shape)) + shape):
            if _same(dims[axis], one):
                dims[axis] = dim
            elif not (_same(dim, one) or _same(dim, dims[axis])):
                return f"mask shapes {mask_shapes} do not broadcast together"
    B, H, Sq, _ = q_shape
    want = (B, H, Sq, k_shape[2])
    for dim, w, axis in zip(dims, want, ("batch", "heads", "queries", "keys")):
        if not (_same(dim, one) or _same(dim, w)):
            return (f"mask of shape {[int(d) if isinstance(d, tirx.IntImm) else d for d in dims]} does not "
                    f"broadcast to the scores [B, H, Sq, Sk] = {list(want)} (its {axis} dim)")
    return dims, (H if not _same(dims[1], one) else one)


#: ops through which a mask varies along the queries only where an operand does
_ELEMENTWISE = frozenset(f"relax.{n}" for n in (
    "where", "add", "subtract", "multiply", "divide", "astype", "negative", "maximum", "minimum",
    "logical_and", "logical_or", "logical_not", "equal", "not_equal", "less", "less_equal", "greater",
    "greater_equal", "broadcast_to"))


def _varies_along_queries(g: FuncGraph, x) -> bool:
    """Whether the mask value ``x`` (aligned to the scores' trailing axes) may change along the
    query axis: its query dim is not 1, and it is neither a constant equal along that axis nor
    an elementwise op / ``broadcast_to`` of operands that do not change along it.  False for a
    key-padding mask however it was expanded (``broadcast_to(m[B, 1, 1, S], [B, 1, S, S])``, or
    and-ed with an all-True ``[S, S]`` constant, as transformers builds it)."""
    if not isinstance(getattr(x, "ty", None), relax.TensorType):
        return False                      # a target shape or a scalar value: no query axis
    shape = _shape(x)
    if shape is None:
        return True
    if len(shape) < 2 or _same(shape[-2], tirx.const(1, "int64")):
        return False
    if isinstance(x, tvm.ir.GenericConst):
        data = x.value.numpy()
        return bool((data != data[..., :1, :]).any())
    value = g.bound.get(x) if isinstance(x, relax.Var) else None
    if op_name(value) not in _ELEMENTWISE:
        return True
    return any(_varies_along_queries(g, a) for a in value.args)


def _check_operands(q, k_shape, k_dtype, v) -> str | None:
    from pit_tvm.ops.sparse_attention import ATTENTION_DTYPES

    q_shape, v_shape = _shape(q), _shape(v)
    for name, shape, dtype in (("q", q_shape, q.ty.dtype), ("k", k_shape, k_dtype), ("v", v_shape, v.ty.dtype)):
        if shape is None or len(shape) != 4:
            return f"{name} of shape {shape}: not a [B, H, S, d] tensor"
        if str(dtype) not in ATTENTION_DTYPES:
            return f"{name} has dtype {dtype}; sparse attention takes {', '.join(ATTENTION_DTYPES)}"
        if not isinstance(shape[3], tirx.IntImm):
            return f"{name}'s head dim {shape[3]} is not static"
    if len({str(q.ty.dtype), str(k_dtype), str(v.ty.dtype)}) != 1:
        return "q, k, v have different dtypes"
    if not (_same(q_shape[0], k_shape[0]) and _same(q_shape[1], k_shape[1]) and _same(k_shape[2], v_shape[2])
            and _same(q_shape[3], k_shape[3]) and _same(v_shape[0], q_shape[0])
            and _same(v_shape[1], q_shape[1]) and _same(v_shape[3], q_shape[3])):
        return f"q {q_shape}, k {k_shape}, v {v_shape} do not agree"
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
        from pit_tvm.ops.sparse_attention import AttentionPattern, emit_sparse_attention, fast_kernel_applies

        gv_main = mod.get_global_var("main")
        func = mod[gv_main]
        named = self._resolve_input(mod, func)
        onnx_of = {str(v): str(k) for k, v in (mod.attrs or {}).get(ONNX_NAMES_ATTR, {}).items()}
        records = [dict(r) for r in (func.attrs or {}).get(ANNOTATIONS_ATTR, [])]
        graph = FuncGraph(func)
        taken, named_read = {}, False
        for call, (var, q, k, k_axes, v, scale, parts, inputs) in attention_chains(func, graph).items():
            if named is not None and not any(p.same_as(named) for p in inputs):
                continue
            named_read = True
            kind, mask, cond, _ = parts
            source = "attention:" + ",".join(sorted(onnx_of.get(p.name, p.name) for p in inputs))
            tensor = onnx_of.get(var.name, var.name)
            k_shape = _shape(k)
            if k_shape is not None and k_axes is not None and len(k_shape) == 4:
                k_shape = [k_shape[a] for a in k_axes]
            why = _check_operands(q, k_shape, k.ty.dtype, v)
            layout = None
            if why is None:
                layout = _mask_layout(_shape(q), k_shape, [_shape(x) for x in (mask, cond) if x is not None])
                if isinstance(layout, str):
                    why, layout = layout, None
            if why is None and mask is not None and str(mask.ty.dtype) not in ("float16", "bfloat16", "float32"):
                why = f"additive mask of dtype {mask.ty.dtype}"
            if why is None and cond is not None and str(cond.ty.dtype) != "bool":
                why = f"where() condition of dtype {cond.ty.dtype}"
            if why is None and named is None and not _same(q.ty.shape[2], tirx.const(1, "int64")) \
                    and not any(_varies_along_queries(graph, x) for x in (mask, cond) if x is not None):
                continue    # a key-padding mask: the dense attention's (name the input to take it)
            if why is None and named is None and not fast_kernel_applies(self.target, int(_shape(q)[3]), q.ty.dtype):
                why = (f"no fast sparse kernel for {self.target.kind.name} {self.target.attrs.get('arch', '')}, "
                       f"head dim {int(_shape(q)[3])}, {q.ty.dtype} (the generic CUDA kernel is slower than "
                       "the dense attention); name the mask's input with sparse_attention= to take it anyway")
            if why is not None:
                warnings.warn(f"attention {tensor!r} (mask from {source[10:]}) stays dense: {why}")
                records.append({"tensor": tensor, "source": source, "status": "dense", "reason": why})
                continue
            pattern = AttentionPattern(mask="bool" if kind in ("bool", "bool_not") else "additive")
            taken[call] = (q, k, k_axes, v, scale, parts, layout, pattern)
            records.append({"tensor": tensor, "source": source, "status": "pit",
                            "reason": f"softmax(q k^T * {scale:.6g} + mask) v with the mask computed at run time "
                                      f"from {source[10:]}: block-sparse attention ({pattern.mask} mask), block "
                                      "index built on the device every call"})
        if named is not None and not named_read:
            warnings.warn(f"sparse_attention={self.mask_input!r}: no attention of the form softmax(q k^T * s + M) v "
                          f"(or its Where forms) has a mask computed from that input; the attention stays as "
                          f"imported")
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
                q, k, k_axes, v, scale, (kind, mask, cond, fill), (dims, heads), pattern = chain
                bb = self.builder_
                q, k, v = (self.visit_expr(x) for x in (q, k, v))
                if k_axes is not None:
                    k = bb.emit(relax.op.permute_dims(k, k_axes))
                if kind == "additive":
                    m = self.visit_expr(mask)
                elif kind == "where_add":     # where(C, scores, fill) + M: the additive where(C, M, fill)
                    m = self.visit_expr(mask)
                    m = bb.emit(relax.op.where(self.visit_expr(cond), m, relax.const(fill, str(m.ty.dtype))))
                elif kind == "bool_not":
                    m = bb.emit(relax.op.logical_not(self.visit_expr(cond)))
                else:
                    m = self.visit_expr(cond)
                B, _, Sq, _ = q.ty.shape
                full = [B, heads, Sq, k.ty.shape[2]]
                if len(m.ty.shape) != 4:
                    m = bb.emit(relax.op.reshape(m, [tirx.const(1, "int64")] * (4 - len(m.ty.shape))
                                                 + list(m.ty.shape)))
                if not all(_same(a, b) for a, b in zip(m.ty.shape, full)):
                    m = bb.emit(relax.op.broadcast_to(m, full))
                return emit_sparse_attention(bb, q, k, v, pattern, mask=m, scale=scale, target=target)

        rewriter = _Rewrite(mod)
        rewriter.builder_.update_func(gv_main, rewriter.visit_expr(func))
        new = relax.transform.DeadCodeElimination()(rewriter.builder_.get())
        new[gv_main] = new[gv_main].with_attr(ANNOTATIONS_ATTR, records)
        return new
