"""``PropagatePadding``: the token-wise matmuls of a padded batch run on its real tokens only.

Kept as one module: it is one dataflow analysis -- ``_Propagation`` holds a transfer rule per
Relax op over the ``Layout`` / ``MaskValue`` lattice defined beside it, and the pass class only
drives it; the rules read each other's state.

In a real transformer export the hidden states of padded tokens are not multiplied by the
attention mask: the mask only enters as an additive bias (``(1 - mask) * min``, or a ``where``)
on the attention scores.  The rows at padded positions are then "don't care" for the real
tokens: every token-wise op (a matmul on weights, bias add, layer norm over the hidden axis,
GELU, residual add, reshapes and transposes that keep the batch and sequence axes) maps padded
rows to padded rows, and attention mixes tokens only through scores whose padded keys the mask
sends to ``-inf``.  So every matmul ``x[batch, seq, K] @ W[K, N]`` whose padded rows reach only
such ops can run as a rows-kind PIT matmul listing the real tokens, all of them from one rows
index built from the mask (:func:`pit_tvm.ops.matmul.emit_pit_matmul`'s ``row_mask``).

The pass proves it by a forward dataflow over ``main`` (after
:class:`~pit_tvm.passes.AnnotateDynamicSparsity`):

* each tensor aligned with the mask carries *layouts* ``(batch axis, sequence axis)`` and, per
  layout, what its padded positions hold: ``clean`` (the model's own values), ``dirty`` (not
  computed: the candidate matmuls write anything there), ``masked`` (``<= -1e4``: a mask bias
  was added) or ``zero`` (exactly 0, e.g. a softmax over masked keys, or ``x * mask``);
* tensors computed from the mask alone are evaluated exactly (numpy, static shapes): for each
  element, which mask entry it reads and its value when that entry is 0 and when it is 1.
  That is how a bias is recognised as masking the padded keys, whatever ops build it;
* an op that reads a dirty position into a real one (a softmax or reduction over the sequence
  axis without a mask, a matmul contracting it, a slice or gather along it, a cumsum, a
  convolution, an op the pass does not know) is a *stop*: the candidate matmuls whose dirt
  reaches it stay dense, the reason is recorded, and the analysis runs again without them.

What is lowered, what stops and which outputs are not computed at padded positions is recorded
in ``main``'s ``pit.annotations`` (source ``padding:<mask>``; statuses ``pit``, ``dense``,
``stop``, ``output``).  The model's outputs at padded positions are **not computed**: compare
them on the real tokens only.  Opt-in (``compile_onnx(..., padding="attention_mask")``): see
docs/design/padding_propagation.md.

Assumptions: the mask holds 0 (padded) and 1 (real); values computed at padded rows stay
finite (they are the model's function of a matmul's epilogue of a zero row).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import tvm
from tvm import relax, tirx

from .annotate import (ANNOTATIONS_ATTR, PADDING_RE, PIT_RULE_ATTR, ROW_MASK_ATTR, _wrap_matmuls, rule_for_tile,
                       unsupported_reason)
from .frontend import ONNX_NAMES_ATTR, sanitize
from .graph import FuncGraph, op_name

#: a bias at most this at a padded key masks it (HF adds ``finfo.min``, older exports -10000)
MASKED_BELOW = -1e4
#: mask-derived tensors larger than this are not evaluated (the analysis gives up on them)
MAX_MASK_ELEMENTS = 1 << 24

_UNARY = {"relax.astype", "relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu", "relax.tanh",
          "relax.erf", "relax.exp", "relax.sigmoid", "relax.sqrt", "relax.rsqrt", "relax.negative", "relax.abs",
          "relax.log", "relax.square", "relax.sin", "relax.cos", "relax.clip", "relax.nn.leakyrelu",
          "relax.floor", "relax.ceil", "relax.round", "relax.sign", "relax.logical_not", "relax.isnan",
          "relax.isinf"}
#: unary ops that keep an exact zero a zero
_ZERO_KEEPING = {"relax.astype", "relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu",
                 "relax.tanh", "relax.erf", "relax.negative", "relax.abs", "relax.sqrt", "relax.square",
                 "relax.sin", "relax.sign", "relax.nn.leakyrelu"}
_BINARY = {"relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
           "relax.divide": np.divide, "relax.maximum": np.maximum, "relax.minimum": np.minimum,
           "relax.power": np.power, "relax.floor_divide": np.floor_divide, "relax.equal": np.equal,
           "relax.not_equal": np.not_equal, "relax.less": np.less, "relax.greater": np.greater,
           "relax.less_equal": np.less_equal, "relax.greater_equal": np.greater_equal,
           "relax.logical_and": np.logical_and, "relax.logical_or": np.logical_or,
           "relax.bitwise_and": np.bitwise_and, "relax.bitwise_or": np.bitwise_or}
_NUMPY_UNARY = {"relax.negative": np.negative, "relax.abs": np.abs, "relax.logical_not": np.logical_not,
                "relax.exp": np.exp, "relax.sqrt": np.sqrt, "relax.tanh": np.tanh, "relax.sign": np.sign}
_REDUCE = {"relax.sum", "relax.mean", "relax.max", "relax.min", "relax.prod", "relax.variance", "relax.std",
           "relax.argmax", "relax.argmin"}
_NOT_COMPUTED = ("dirty", "masked")
#: ops whose result does not depend on their operand's values
_SHAPE_ONLY = {"relax.shape_of"}


def _dims(expr):
    """static int dims of a tensor expr, or None"""
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = [int(d.value) if isinstance(d, tirx.IntImm) else None for d in ty.shape.values]
    return None if None in dims else dims


def _ints(values):
    """python ints of an attr array, a relax Tuple of PrimValues or a ShapeExpr"""
    if isinstance(values, relax.Tuple):
        values = values.fields
    elif isinstance(values, relax.ShapeExpr):
        values = values.values
    return [int(getattr(x, "value", x)) for x in values]


class Layout(NamedTuple):
    """Where a tensor's axes meet the mask: its batch index is ``index[b] // div`` (``div`` > 1:
    the batch axis is merged with the ``div`` heads after it), its sequence index ``index[t]``
    (``t`` None: one sequence position was taken; ``t == b``: one axis of batch x sequence)."""

    b: int
    t: int | None
    div: int = 1

    def shifted(self, offset: int) -> "Layout":
        return Layout(self.b + offset, None if self.t is None else self.t + offset, self.div)

    def axes(self) -> tuple:
        return (self.b,) if self.t is None else (self.b, self.t)


# ------------------------------------------------------------------------ mask-derived values
@dataclass
class MaskValue:
    """A tensor computed from the mask alone: for each element, the flat mask entry it reads
    (``src``, -1 for none) and its value where that entry is 0 (``v0``) and 1 (``v1``); arrays
    broadcastable to the tensor's shape."""

    src: np.ndarray
    v0: np.ndarray
    v1: np.ndarray
    #: padded_where's answers (one bias serves every layer)
    checked: dict = field(default_factory=dict, compare=False, repr=False)

    def full(self, shape):
        return MaskValue(*(np.broadcast_to(a, shape) for a in (self.src, self.v0, self.v1)))

    def map(self, fn):
        return MaskValue(*(fn(a) for a in (self.src, self.v0, self.v1)))

    def padded_where(self, layout, shape, batch, seq, pred) -> bool:
        """whether ``pred`` holds, for every mask, at each element whose ``layout`` position is
        padded: the element reads that very mask entry (and ``pred(v0)``), or ``pred`` holds
        whatever it reads"""
        key = (layout, tuple(shape), pred.__name__)
        if key not in self.checked:
            self.checked[key] = self._padded_where(layout, shape, batch, seq, pred)
        return self.checked[key]

    def _padded_where(self, layout, shape, batch, seq, pred) -> bool:
        b_axis, t_axis, div = layout
        rank = len(shape)

        def along(axis, n):
            return np.arange(n).reshape([-1 if i == axis else 1 for i in range(rank)])

        if b_axis == t_axis:        # one axis enumerates batch x sequence
            expected = along(b_axis, batch * seq)
        else:
            expected = along(b_axis, batch * div) // div * seq + along(t_axis, seq)
        with np.errstate(all="ignore"):
            p0, p1 = pred(self.v0), pred(self.v1)
        return bool(np.all(((self.src == expected) & p0) | (p0 & p1)))


def _truthy(v):
    return v.astype(bool)


def _constant(expr):
    if isinstance(expr, tvm.ir.GenericConst):
        try:
            value = expr.value.numpy()
        except Exception:  # noqa: BLE001 - bfloat16 and friends: not evaluated
            return None
        return MaskValue(np.full(value.shape, -1, "int64"), value, value)
    return None


def _dtype(expr):
    return str(expr.ty.dtype) if isinstance(getattr(expr, "ty", None), relax.TensorType) else None


def _eval_mask_op(call, args, out_shape):
    """``call`` evaluated on the mask values ``args`` (None where an arg is not one): a MaskValue,
    or None when the op is unknown or an element would read two mask entries."""
    op = op_name(call)
    tensors = [v for a, v in zip(call.args, args) if isinstance(getattr(a, "ty", None), relax.TensorType)]
    if any(v is None for v in tensors) or out_shape is None or int(np.prod(out_shape)) > MAX_MASK_ELEMENTS:
        return None
    dtype = _dtype(call)
    try:
        if op == "relax.astype":
            x = args[0]
            return MaskValue(x.src, x.v0.astype(dtype), x.v1.astype(dtype))
        if op in _NUMPY_UNARY:
            x = args[0]
            with np.errstate(all="ignore"):
                return MaskValue(x.src, _NUMPY_UNARY[op](x.v0), _NUMPY_UNARY[op](x.v1))
        if op in ("relax.reshape", "relax.flatten"):
            return args[0].full(_dims(call.args[0])).map(lambda a: a.reshape(out_shape))
        if op == "relax.permute_dims":
            axes = None if call.attrs.axes is None else _ints(call.attrs.axes)
            return args[0].full(_dims(call.args[0])).map(lambda a: np.transpose(a, axes))
        if op in ("relax.expand_dims", "relax.squeeze", "relax.broadcast_to"):
            x = args[0].full(_dims(call.args[0]))
            if op == "relax.broadcast_to":
                return x.full(out_shape)
            return x.map(lambda a: a.reshape(out_shape))
        if op == "relax.take":
            x, idx = args[0].full(_dims(call.args[0])), args[1]
            if np.any(idx.src >= 0):
                return None
            index = np.asarray(idx.v0).astype("int64")
            return x.map(lambda a: np.take(a, index, axis=int(call.attrs.axis)))
        if op == "relax.gather_nd" and int(call.attrs.batch_dims) == 0:
            x, idx = args[0].full(_dims(call.args[0])), args[1]
            if np.any(idx.src >= 0):
                return None
            index = np.asarray(idx.v0).astype("int64")
            where = tuple(index[..., i] for i in range(index.shape[-1]))
            return x.map(lambda a: a[where])
        if op in _BINARY or op == "relax.where":
            srcs = [np.broadcast_to(a.src, out_shape) for a in args]
            src = np.full(out_shape, -1, "int64")
            for s in srcs:
                if np.any((src >= 0) & (s >= 0) & (src != s)):
                    return None        # an element reads two mask entries
                src = np.where(s >= 0, s, src)
            with np.errstate(all="ignore"):
                if op == "relax.where":
                    v0 = np.where(args[0].v0, args[1].v0, args[2].v0)
                    v1 = np.where(args[0].v1, args[1].v1, args[2].v1)
                else:
                    fn = _BINARY[op]
                    v0, v1 = fn(args[0].v0, args[1].v0), fn(args[0].v1, args[1].v1)
            return MaskValue(src, np.asarray(v0).astype(dtype), np.asarray(v1).astype(dtype))
    except Exception:  # noqa: BLE001 - shapes numpy disagrees with: not evaluated
        return None
    return None


# ------------------------------------------------------------------------ data tensors
@dataclass
class Rows:
    """What a tensor aligned with the mask holds at its padded positions: ``{(batch axis,
    sequence axis): kind}`` (sequence axis None: the tensor took one sequence position), and the
    candidate matmuls whose not-computed rows it carries."""

    kinds: dict = field(default_factory=dict)
    sources: frozenset = frozenset()

    def carries_dirt(self) -> bool:
        return bool(self.sources) and any(k in _NOT_COMPUTED for k in self.kinds.values())


@dataclass
class Stop:
    var: relax.Var
    reason: str
    sources: frozenset


def _combine(kinds):
    """the kind of an elementwise result whose operands hold ``kinds`` at a position"""
    kinds = [k for k in kinds if k is not None]
    if any(k in _NOT_COMPUTED for k in kinds):
        return "dirty"
    return "clean"


class _Propagation:
    """One forward pass over ``g`` with ``candidates`` (matmul binding vars) writing anything at
    padded rows; fills ``rows`` / ``masks`` / ``stops``."""

    def __init__(self, g: FuncGraph, mask: relax.Var, candidates):
        self.g, self.mask, self.candidates = g, mask, candidates
        self.batch, self.seq = _dims(mask)
        self.rows, self.masks, self.stops = {}, {}, []
        aligned = [p for p in g.params if (_dims(p) or [])[:2] == [self.batch, self.seq]]
        for p in aligned:
            self.rows[p] = Rows({Layout(0, 1): "clean"})
        src = np.arange(self.batch * self.seq, dtype="int64").reshape(self.batch, self.seq)
        dtype = _dtype(mask)
        self.masks[mask] = MaskValue(src, np.zeros((), dtype), np.ones((), dtype))
        for b in g.bindings:
            self.visit(b.var, b.value)

    # -- helpers
    def state(self, expr):
        """the Rows of a tensor var; of a tuple var (its fields') or an inline tuple, their union
        (so an op reading a tuple of rows that are not computed is a stop)"""
        if isinstance(expr, relax.Tuple):
            parts = [self.state(f) for f in expr.fields]
        elif isinstance(expr, relax.Var) and ("tuple", expr) in self.rows:
            parts = self.rows[("tuple", expr)]
        else:
            return self.rows.get(expr) if isinstance(expr, relax.Var) else None
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        return Rows({lay: k for p in parts for lay, k in p.kinds.items()},
                    frozenset().union(*[p.sources for p in parts]))

    def mask_value(self, expr):
        if isinstance(expr, relax.Var):
            return self.masks.get(expr)
        return _constant(expr)

    def stop(self, var, reason, states):
        sources = frozenset().union(*[s.sources for s in states if s is not None and s.carries_dirt()])
        if sources:
            self.stops.append(Stop(var, reason, sources))

    def valid(self, layout, shape) -> bool:
        b_axis, t_axis, div = layout
        if b_axis == t_axis:        # merged: one axis of batch x sequence rows
            return shape is not None and b_axis < len(shape) and shape[b_axis] == self.batch * self.seq
        return (shape is not None and b_axis < len(shape) and shape[b_axis] == self.batch * div
                and (t_axis is None or (t_axis < len(shape) and shape[t_axis] == self.seq)))

    def finish(self, var, kinds: dict, states, shape):
        """bind ``var`` to the layouts ``kinds`` that are valid in ``shape`` (a not-computed one
        that is not is a stop)"""
        out = {}
        for layout, kind in kinds.items():
            if self.valid(layout, shape):
                out[layout] = kind
            elif kind in _NOT_COMPUTED:
                self.stop(var, "the batch or sequence axis is broadcast or resized", states)
                return
        if out:
            sources = frozenset().union(*[s.sources for s in states if s is not None])
            dirty = any(k in _NOT_COMPUTED for k in out.values())
            self.rows[var] = Rows(out, sources if dirty else frozenset())

    # -- the transfer functions
    def visit(self, var, value):
        call = value
        if isinstance(value, relax.TupleGetItem):
            parts = self.rows.get(("tuple", value.tuple_value))
            if parts is not None and value.index < len(parts) and parts[value.index] is not None:
                self.rows[var] = parts[value.index]
            return
        if isinstance(value, relax.Var):
            for table in (self.rows, self.masks):
                if value in table:
                    table[var] = table[value]
            return
        if isinstance(value, relax.Tuple):     # (a tuple of tensors: its fields, for TupleGetItem)
            self.rows[("tuple", var)] = [self.state(f) for f in value.fields]
            return
        if not isinstance(value, relax.Call):
            return
        args = list(value.args)
        op = op_name(call)
        if isinstance(call.op, tvm.ir.GlobalVar) and call.op.name_hint.startswith("pit_matmul_"):
            op, args = "relax.matmul", args[:2]     # an annotated matmul (exact: clean rows)
        shape = _dims(var)
        # computed from the mask alone: evaluated
        operands = [a for a in args if isinstance(a, (relax.Var, tvm.ir.GenericConst))]
        if operands and all(isinstance(a, tvm.ir.GenericConst) or a in self.masks for a in operands) and any(
                isinstance(a, relax.Var) for a in operands):
            mv = _eval_mask_op(call, [self.mask_value(a) for a in args], shape)
            if mv is not None:
                self.masks[var] = mv
        states = [self.state(a) for a in args]
        if op is None and any(s is not None and s.carries_dirt() for s in states):
            return self.stop(var, f"a call to {call.op} is not known to keep tokens apart", states)
        if op is None or all(s is None for s in states) or op in _SHAPE_ONLY:
            return
        if op not in _BINARY and op not in ("relax.where", "relax.take", "relax.matmul") and any(
                s is not None and s.carries_dirt() for s in states[1:]):
            return self.stop(var, f"{op} reads rows that are not computed as a parameter", states)
        in_shape = _dims(args[0])
        if in_shape is None and op not in _BINARY and op not in ("relax.where", "relax.concat"):
            return self.stop(var, f"{op} of an operand whose shape is not static", states)
        if states[0] is None and op not in _BINARY and op not in ("relax.where", "relax.take", "relax.matmul"):
            if any(s is not None and s.carries_dirt() for s in states):
                self.stop(var, f"{op} with a token-aligned operand it does not follow", states)
            return
        if op in _UNARY:
            s = states[0]
            kinds = {lay: (k if k == "dirty" or (k == "zero" and op in _ZERO_KEEPING)
                           or (k == "masked" and op == "relax.astype") else _combine([k]))
                     for lay, k in s.kinds.items()}
            return self.finish(var, kinds, states, shape)
        if op in _BINARY or op == "relax.where":
            return self.elementwise(var, op, args, states, shape)
        if op in ("relax.reshape", "relax.permute_dims", "relax.expand_dims", "relax.squeeze",
                  "relax.broadcast_to", "relax.flatten"):
            return self.relayout(var, op, call, states, in_shape, shape)
        if op == "relax.strided_slice":
            return self.slice(var, call, states, in_shape, shape)
        if op == "relax.take":
            return self.take(var, call, states, in_shape, shape)
        if op == "relax.split":
            return self.split(var, call, states)
        if op == "relax.concat":
            axis = int(call.attrs.axis) % len(shape) if shape is not None else None
            s = states[0]
            if axis is None or any(axis in lay.axes() and k in _NOT_COMPUTED for lay, k in s.kinds.items()):
                return self.stop(var, "concat along the batch or sequence axis", states)
            return self.finish(var, {lay: ("dirty" if k in _NOT_COMPUTED else "clean")
                                     for lay, k in s.kinds.items() if axis not in lay.axes()}, states, shape)
        if op in ("relax.nn.layer_norm", "relax.nn.rms_norm", "relax.nn.group_norm"):
            axes = _ints(call.attrs.axes) if hasattr(call.attrs, "axes") else [-1]
            return self.along(var, "normalisation", axes, states, in_shape, shape, keep=True)
        if op in ("relax.nn.softmax", "relax.nn.log_softmax"):
            return self.softmax(var, call, states, in_shape, shape)
        if op in _REDUCE or op == "relax.cumsum":
            axis = call.attrs.axis
            axes = list(range(len(in_shape))) if axis is None else (
                _ints(axis) if not isinstance(axis, (int, tirx.IntImm)) else [int(axis)])
            keep = op == "relax.cumsum" or bool(getattr(call.attrs, "keepdims", False))
            return self.along(var, op.split(".")[-1], axes, states, in_shape, shape, keep=keep)
        if op == "relax.matmul":
            return self.matmul(var, args, states, shape)
        if any(s is not None and s.carries_dirt() for s in states):
            self.stop(var, f"{op} is not known to keep tokens apart", states)

    def elementwise(self, var, op, args, states, shape):
        rank = len(shape) if shape is not None else None
        if rank is None:
            return self.stop(var, "result shape is not static", states)
        masks = [self.mask_value(a) for a in args]
        layouts = set()
        for a, s in zip(args, states):
            if s is not None:
                off = rank - len(_dims(a) or [])
                layouts |= {lay.shifted(off) for lay in s.kinds}

        def kind_of(i, layout):
            s, a = states[i], args[i]
            if s is not None:
                off = rank - len(_dims(a) or [])
                k = s.kinds.get(layout.shifted(-off))
                if k is not None:
                    return k
            return None

        def padded(i, layout, pred):
            return (masks[i] is not None and layout[1] is not None
                    and masks[i].padded_where(layout, shape, self.batch, self.seq, pred))

        def masked(v):
            return v <= MASKED_BELOW

        def zero(v):
            return v == 0

        # candidate layouts a mask operand brings (a bias over keys, a row mask)
        for i, mv in enumerate(masks):
            if mv is not None and states[i] is None:
                for b_axis in range(rank):
                    for t_axis in range(rank):
                        if (b_axis != t_axis or self.seq > 1) and self.valid(Layout(b_axis, t_axis), shape):
                            layouts.add(Layout(b_axis, t_axis))
        kinds = {}
        for layout in layouts:
            if not self.valid(layout, shape):
                ks = [kind_of(i, layout) for i in range(len(args))]
                kinds[layout] = _combine(ks)
                continue
            ks = [kind_of(i, layout) for i in range(len(args))]
            kind = None
            if op == "relax.where":
                def branch(i):
                    return ks[i] or ("masked" if padded(i, layout, masked) else
                                     "zero" if padded(i, layout, zero) else None)
                if padded(0, layout, np.logical_not):        # padded positions take the false branch
                    kind = branch(2) or "clean"
                elif padded(0, layout, _truthy):
                    kind = branch(1) or "clean"
                elif ks[0] not in _NOT_COMPUTED and branch(1) == branch(2) and branch(1) in ("zero", "masked"):
                    kind = branch(1)     # both branches agree there (e.g. a NaN guard after softmax)
            elif op == "relax.add" and any(padded(i, layout, masked) for i in range(2)):
                kind = "masked"
            elif op == "relax.multiply" and any(
                    padded(i, layout, zero) and ks[1 - i] != "masked" for i in range(2)):
                kind = "zero"
            elif op == "relax.multiply" and all(k in ("zero", None) for k in ks) and "zero" in ks:
                kind = "zero"
            if kind is None:
                if all(k is None for k in ks):
                    continue
                kind = _combine(ks)
            kinds[layout] = kind
        self.finish(var, {lay: k for lay, k in kinds.items() if k != "clean" or any(
            kind_of(i, lay) is not None for i in range(len(args)))}, states, shape)

    def relayout(self, var, op, call, states, in_shape, shape):
        s = states[0]
        if in_shape is None or shape is None:
            return self.stop(var, f"{op}: shapes are not static", states)

        def mapped(axis):
            if axis is None:
                return None
            if op == "relax.permute_dims":
                axes = list(range(len(in_shape)))[::-1] if call.attrs.axes is None else _ints(call.attrs.axes)
                return axes.index(axis)
            if op == "relax.broadcast_to":
                return axis + len(shape) - len(in_shape)
            # reshape-like: the axis whose prefix product and size are the same
            return next((o for o in starts(axis) if shape[o] == in_shape[axis]), -1)

        def starts(axis):
            """the output axes that start where input ``axis`` starts"""
            prefix = int(np.prod(in_shape[:axis]))
            return [o for o in range(len(shape)) if int(np.prod(shape[:o])) == prefix]

        rows = self.batch * self.seq

        def moved(layout):
            b_axis, t_axis, div = layout
            reshape = op in ("relax.reshape", "relax.flatten")
            if reshape and t_axis is not None and div == 1 and (b_axis == t_axis or t_axis == b_axis + 1):
                for o in starts(b_axis):     # batch and sequence merged into one axis, or split again
                    if shape[o] == rows and (b_axis != t_axis or in_shape[b_axis] == rows):
                        return Layout(o, o)
                    if b_axis == t_axis and shape[o] == self.batch and o + 1 < len(shape) and shape[o + 1] == self.seq:
                        return Layout(o, o + 1)
                if b_axis == t_axis:
                    return None
            t_new = mapped(t_axis)
            if reshape and b_axis != t_axis and mapped(b_axis) == -1 and t_new != -1:
                # the batch axis merged with the (head) axes after it, or split from them again
                for o in starts(b_axis):
                    size, was = shape[o], in_shape[b_axis]
                    if size % self.batch:
                        continue
                    if size >= was and size % was == 0:        # merged with the next k axes
                        merged = [int(np.prod(in_shape[b_axis + 1:b_axis + 1 + k])) for k in range(len(in_shape))]
                        k = merged.index(size // was) if size // was in merged else None
                        if k is not None and not (t_axis is not None and b_axis < t_axis <= b_axis + k):
                            return Layout(o, t_new, div * (size // was))
                    elif was % size == 0 and div % (was // size) == 0:   # split off the heads
                        return Layout(o, t_new, div // (was // size))
                return None
            if -1 in (mapped(b_axis), t_new):
                return None
            return Layout(mapped(b_axis), t_new, div)

        kinds = {}
        for layout, kind in s.kinds.items():
            layout = moved(layout)
            if layout is None:
                if kind in _NOT_COMPUTED:
                    return self.stop(var, f"{op} splits or mixes the batch or sequence axis", states)
                continue
            kinds[layout] = kind
        self.finish(var, kinds, states, shape)

    def slice(self, var, call, states, in_shape, shape):
        s = states[0]
        if in_shape is None or shape is None:
            return self.stop(var, "slice of shapes that are not static", states)
        strides = ({a % len(in_shape): st for a, st in zip(_ints(call.args[1]), _ints(call.args[4]))}
                   if len(call.args) > 4 else {})
        kinds = {}
        for layout, kind in s.kinds.items():
            cut = any(in_shape[ax] != shape[ax] or strides.get(ax, 1) != 1 for ax in layout.axes())
            if cut and kind in _NOT_COMPUTED:
                return self.stop(var, "slice along the batch or sequence axis", states)
            if not cut:
                kinds[layout] = kind
        self.finish(var, kinds, states, shape)

    def take(self, var, call, states, in_shape, shape):
        data, index = states[0], states[1]
        if index is not None and index.carries_dirt():
            return self.stop(var, "gather by indices that are not computed", states)
        axis = int(call.attrs.axis) % len(in_shape)
        idx_rank = len(_dims(call.args[1]) or [])
        kinds = {}
        if index is not None:       # an embedding lookup by tokens: the index's layouts
            kinds.update({lay.shifted(axis): k for lay, k in index.kinds.items()})
        const = _constant(call.args[1])
        for (b_axis, t_axis, div), kind in (data.kinds.items() if data is not None else []):
            def moved(ax):
                return ax if ax is None or ax < axis else ax + idx_rank - 1
            if b_axis == axis or (t_axis == axis and not (const is not None and idx_rank == 0)):
                if kind in _NOT_COMPUTED:
                    return self.stop(var, "gather along the batch or sequence axis", states)
                continue
            if t_axis == axis:      # one sequence position (a CLS pooler): its batch rows
                kinds[Layout(moved(b_axis), None, div)] = kind
                continue
            kinds[Layout(moved(b_axis), moved(t_axis), div)] = kind
        self.finish(var, kinds, states, shape)

    def split(self, var, call, states):
        s = states[0]
        axis = int(call.attrs.axis)
        rank = len(_dims(call.args[0]) or [])
        if any(axis % rank in lay.axes() and k in _NOT_COMPUTED for lay, k in s.kinds.items()):
            return self.stop(var, "split along the batch or sequence axis", states)
        parts = var.ty.fields if isinstance(var.ty, relax.TupleType) else []
        self.rows[("tuple", var)] = [Rows(dict(s.kinds), s.sources) for _ in parts]

    def along(self, var, what, axes, states, in_shape, shape, keep):
        """an op over ``axes`` (a normalisation, reduction, cumsum): layouts across them stop"""
        s = states[0]
        rank = len(in_shape)
        axes = sorted(a % rank for a in axes)
        kinds = {}
        for layout, kind in s.kinds.items():
            across = [ax for ax in layout.axes() if ax in axes]
            if across:
                if kind in _NOT_COMPUTED:
                    return self.stop(var, f"{what} over the {'sequence' if layout[1] in axes else 'batch'} axis "
                                          "reads padded positions", states)
                continue          # a zero or clean position: the reference's value
            def moved(ax):
                return ax if ax is None or keep else ax - sum(1 for a in axes if a < ax)
            kinds[Layout(moved(layout.b), moved(layout.t), layout.div)] = (
                kind if kind == "dirty" else "dirty" if kind == "masked" else "clean")
        self.finish(var, kinds, states, shape)

    def softmax(self, var, call, states, in_shape, shape):
        s = states[0]
        axis = int(call.attrs.axis) % len(in_shape)
        kinds = {}
        for (b_axis, t_axis, div), kind in s.kinds.items():
            if t_axis == axis:       # over the keys: masked ones get exactly 0
                if kind == "dirty":
                    return self.stop(var, "softmax over the sequence axis without a mask recognised on the "
                                          "padded keys (a bias <= -1e4 there computed from the mask alone, or a "
                                          "where on it)", states)
                kinds[Layout(b_axis, t_axis, div)] = "zero" if kind == "masked" else "clean"
            elif b_axis == axis:
                if kind in _NOT_COMPUTED:
                    return self.stop(var, "softmax over the batch axis", states)
            else:
                kinds[Layout(b_axis, t_axis, div)] = "dirty" if kind in _NOT_COMPUTED else "clean"
        self.finish(var, kinds, states, shape)

    def matmul(self, var, args, states, shape):
        a_shape, b_shape = _dims(args[0]), _dims(args[1])
        if a_shape is None or b_shape is None or shape is None or min(len(a_shape), len(b_shape)) < 2:
            return self.stop(var, "matmul of shapes that are not static matrices", states)
        rank = len(shape)
        ra, rb = len(a_shape), len(b_shape)
        contract = "k"

        def out_axis(ax, r, is_a):
            if ax is None:
                return None
            if is_a:
                return contract if ax == r - 1 else rank - 2 if ax == r - 2 else ax + rank - r
            return contract if ax == r - 2 else rank - 1 if ax == r - 1 else ax + rank - r

        sides = []
        for s, r, is_a in ((states[0], ra, True), (states[1], rb, False)):
            sides.append({} if s is None else {Layout(out_axis(b, r, is_a), out_axis(t, r, is_a), div): k
                                                for (b, t, div), k in s.kinds.items()})
        kinds = {}
        for i, side in enumerate(sides):
            other = sides[1 - i]
            for layout, kind in side.items():
                if layout[0] == contract:
                    if kind in _NOT_COMPUTED:
                        return self.stop(var, "matmul contracts the batch axis", states)
                    continue
                if layout[1] == contract:     # sum over tokens: needs the other side zero there
                    if kind in _NOT_COMPUTED and other.get(layout) != "zero":
                        return self.stop(var, "matmul sums over the sequence axis of rows that are "
                                              "not computed (no zero weight at the padded keys)", states)
                    continue
                prev = kinds.get(layout)
                new = "dirty" if kind in _NOT_COMPUTED else kind if kind == "zero" and i == 0 else "clean"
                kinds[layout] = new if prev is None else _combine([prev, new]) if "dirty" in (prev, new) else prev
        if var in self.candidates:   # its padded rows are not computed
            rows = Layout(0, 1) if rank == 3 else Layout(0, 0)
            kinds = {lay: ("dirty" if lay == rows else k) for lay, k in kinds.items()}
            kinds[rows] = "dirty"
            self.finish(var, kinds, states, shape)
            if var in self.rows:
                self.rows[var] = Rows(self.rows[var].kinds, self.rows[var].sources | {var})
            return
        self.finish(var, kinds, states, shape)


def _candidates(g: FuncGraph, rows_of):
    """matmul binding vars whose left operand is ``[batch, seq, K]`` (or ``[batch * seq, K]``)
    aligned with the mask and whose right operand PIT takes (static 2-D weight, supported dtype)"""
    out = []
    for b in g.bindings:
        if op_name(b.value) != "relax.matmul":
            continue
        lhs = b.value.args[0]
        s, rank = rows_of(lhs), len(_dims(lhs) or [])
        if s is None or s.kinds.get({3: Layout(0, 1), 2: Layout(0, 0)}.get(rank)) is None:
            continue
        if unsupported_reason(b.value) is None:
            out.append(b.var)
    return out


def find_mask_input(mod: tvm.IRModule, mask=True) -> str:
    """The ONNX name of the padding mask input: ``mask`` itself when it is a name, else the one
    rank-2 graph input named like a padding mask (``PADDING_RE``). ValueError naming the inputs
    otherwise."""
    params = {p.name: p for p in mod["main"].params}
    onnx_names = {str(v): str(k) for k, v in dict((mod.attrs or {}).get(ONNX_NAMES_ATTR, {})).items()}
    names = {onnx_names.get(n, n): p for n, p in params.items()}
    if isinstance(mask, str):
        if mask not in names:
            raise ValueError(f"padding={mask!r}: no such graph input; the inputs are {sorted(names)}")
        return mask
    found = [n for n, p in names.items() if PADDING_RE.match(n) and getattr(p.ty, "ndim", -1) == 2
             and "len" not in n.lower()]
    if len(found) != 1:
        raise ValueError(f"padding=True: {'no' if not found else 'more than one'} rank-2 graph input named "
                         f"like an attention mask ({found or sorted(names)}); name it: padding='attention_mask'")
    return found[0]


@tvm.transform.module_pass(opt_level=0, name="PropagatePadding")
class PropagatePadding:
    """Module pass: the token-wise matmuls whose padded rows only reach token-wise ops and
    masked attention become rows-kind PIT matmuls of the real tokens (see the module doc).

    Parameters
    ----------
    mask : str | bool
        The ONNX name of the ``[batch, sequence]`` padding mask input (1 real, 0 padded), or
        True for the one input named like it.
    """

    def __init__(self, mask="attention_mask"):
        self.mask = mask

    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        name = find_mask_input(mod, self.mask)
        source = f"padding:{name}"
        gv_main = mod.get_global_var("main")
        func = mod[gv_main]
        g = FuncGraph(func)
        onnx_names = dict((mod.attrs or {}).get(ONNX_NAMES_ATTR, {}))
        rev = {str(v): str(k) for k, v in onnx_names.items()}
        mask = g.var_by_name(str(onnx_names.get(name, sanitize(name))))
        records = [dict(r) for r in (func.attrs or {}).get(ANNOTATIONS_ATTR, [])]

        def onnx_name(var):
            return rev.get(var.name, var.name)

        def done(extra, new_mod=mod):
            main = new_mod[gv_main].with_attr(ANNOTATIONS_ATTR, records + extra)
            new_mod[gv_main] = main
            return new_mod

        shape = _dims(mask)
        dtype = _dtype(mask)
        if shape is None or len(shape) != 2:
            why = (f"{name!r} must be a [batch, sequence] mask of static shape (compile with shapes=), "
                   f"it is {mask.ty}")
            warnings.warn(f"padding is not propagated: {why}")
            return done([{"tensor": name, "source": source, "status": "stop", "reason": why}])
        if dtype == "bfloat16":
            return done([{"tensor": name, "source": source, "status": "stop",
                          "reason": "a bfloat16 mask is not evaluated"}])
        try:
            candidates = set(_candidates(g, _Propagation(g, mask, set()).rows.get))
            dropped = {}
            while True:
                flow = _Propagation(g, mask, candidates)
                if not flow.stops:
                    break
                for stop in flow.stops:
                    for var in stop.sources & candidates:
                        dropped[var] = stop
                    candidates -= stop.sources
        except Exception as err:  # noqa: BLE001 - an IR the analysis does not expect: stay dense
            warnings.warn(f"padding is not propagated: the analysis failed ({err!r})")
            return done([{"tensor": name, "source": source, "status": "stop",
                          "reason": f"the analysis failed ({err!r})"}])
        extra, targets = [], []
        n_pit = sum(1 for _, f in mod.functions_items()
                    if isinstance(f, relax.Function) and f.attrs is not None and PIT_RULE_ATTR in f.attrs)
        stops_seen = set()
        for b in g.bindings:
            var, call = b.var, b.value
            tensor = onnx_name(call.args[0]) if isinstance(call, relax.Call) and call.args and isinstance(
                call.args[0], relax.Var) else onnx_name(var)
            if var in candidates:
                k = _dims(call.args[0])[-1]
                tile = (1, k)
                fid = n_pit + len(targets)
                reason = (f"padding propagated from graph input {name!r}: the rows of padded tokens reach only "
                          "token-wise ops and masked attention; rows index built from the mask, shared by the "
                          "matmuls it masks")
                attrs = {"pit.sparse_operand": "lhs", "pit.micro_tile": list(tile),
                         PIT_RULE_ATTR: rule_for_tile(tile, k),
                         "pit.source": source, "pit.tensor": tensor, "pit.reason": reason, "pit.id": fid,
                         ROW_MASK_ATTR: 1}
                targets.append((call, f"pit_matmul_{fid}", attrs, mask))
                extra.append({"tensor": tensor, "source": source, "status": "pit", "function": f"pit_matmul_{fid}",
                              "micro_tile": list(tile), "rule": attrs[PIT_RULE_ATTR], "reason": reason})
            elif var in dropped:
                stop = dropped[var]
                extra.append({"tensor": tensor, "source": source, "status": "dense",
                              "reason": f"padding: its padded rows would reach {onnx_name(stop.var)!r}: "
                                        f"{stop.reason}"})
                if stop.var not in stops_seen:
                    stops_seen.add(stop.var)
                    extra.append({"tensor": onnx_name(stop.var), "source": source, "status": "stop",
                                  "reason": stop.reason})
        outputs = func.body.body
        outs = list(outputs.fields) if isinstance(outputs, relax.Tuple) else [outputs]
        if isinstance(outputs, relax.Var) and outputs in g.bound and isinstance(g.bound[outputs], relax.Tuple):
            outs = list(g.bound[outputs].fields)
        for out in outs:
            while out.name not in rev and isinstance(g.bound.get(out), relax.Var):
                out = g.bound[out]       # (the dataflow block's output var: the tensor it names)
            s = flow.state(out)
            if s is not None and s.carries_dirt():
                axes = sorted({lay[:2] for lay, k in s.kinds.items() if k in _NOT_COMPUTED},
                              key=lambda lay: (lay[0], -1 if lay[1] is None else lay[1]))
                where = "; ".join(f"batch x sequence axis {b}" if b == t else
                                  f"batch axis {b}" + ("" if t is None else f", sequence axis {t}") for b, t in axes)
                extra.append({"tensor": onnx_name(out), "source": source, "status": "output",
                              "reason": "outputs at padded positions are not computed (" + where + ")"
                              + ("; this one took a sequence position: its batch rows where that position "
                                 "is padded" if any(t is None for _, t in axes) else "")})
        return done(extra, _wrap_matmuls(mod, gv_main, targets))
