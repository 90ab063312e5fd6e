"""``SplitWholeTensorReductions``: a sum / max / min / mean / any over every element of a large
tensor computed in two steps, its rows first (a build pipeline stage, CPU and CUDA).

Why: TVM's default schedules give a reduction to one value one thread block (CUDA), which then
walks millions of elements alone.  Float16 exports of T5-family models (T5, Switch) clamp each
layer's output by ``isinf(x).any()`` over the whole activation; on the H200 those reductions
were most of the Switch encoder's time.  Reduced as rows first, each step is an ordinary row
reduction the schedules spread over the device.

Rewritten: ``op(x)`` over every axis of ``x`` (static shape, at least :data:`MIN_ELEMENTS`
elements) becomes ``op(op(x, trailing axes), the other axes)``, the trailing axes' elements
at least :data:`ROW_ELEMENTS` (:func:`row_split`), or where no trailing axes make such rows
``op(op(reshape(x, [R, C]), axis=1), axis=0)`` (``keepdims``: then reshaped to ``x``'s rank).
The producer of ``x`` (e.g. ``isinf`` and a cast) fuses into the first step.  A mean of equal
rows' means is the mean.
"""
from __future__ import annotations

import math

import tvm
from tvm import relax

from .graph import rewrite_functions

#: the reductions split (each is its own combiner, or the mean of equal parts)
SPLIT_OPS = ("relax.sum", "relax.max", "relax.min", "relax.mean")
#: smaller tensors stay one reduction
MIN_ELEMENTS = 1 << 16
#: the first step's row length: trailing dims multiplied up to at least this (at most
#: MAX_ROW_ELEMENTS, else 1024, 512 or 256 elements of the flattened tensor)
ROW_ELEMENTS = 256
MAX_ROW_ELEMENTS = 8192


def row_split(shape) -> tuple[int, int] | None:
    """``(rows, row length)`` a whole-tensor reduction over ``shape`` is split into, None where
    it stays one reduction (too small, symbolic, or no row length that divides it)"""
    if not all(isinstance(d, int) for d in shape) or math.prod(shape) < MIN_ELEMENTS:
        return None
    total, cols = math.prod(shape), 1
    for d in reversed(shape):
        if cols >= ROW_ELEMENTS:
            break
        cols *= d
    if cols > MAX_ROW_ELEMENTS or total // cols < 2:    # (the trailing dims: one long row)
        cols = next((c for c in (1024, 512, ROW_ELEMENTS) if total % c == 0), total)
    return (total // cols, cols) if total // cols > 1 else None


def _whole_tensor_shape(call: relax.Call):
    """the static shape of ``call``'s input where ``call`` reduces every axis of it, else None"""
    if not (isinstance(call.op, tvm.ir.Op) and call.op.name in SPLIT_OPS and call.args):
        return None
    ty = call.args[0].ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    shape = [int(d) if isinstance(d, tvm.tirx.IntImm) else d for d in ty.shape.values]
    axes = call.attrs.axis
    if axes is not None and sorted(int(a) % len(shape) for a in axes) != list(range(len(shape))):
        return None
    return shape


@relax.expr_functor.mutator
class _WholeTensorReductionRewriter(relax.PyExprMutator):
    def visit_call_(self, op: relax.Call) -> relax.Expr:
        call = super().visit_call_(op)
        shape = _whole_tensor_shape(call)
        split = row_split(shape) if shape is not None else None
        if split is None:
            return call
        reduce = {"relax.sum": relax.op.sum, "relax.max": relax.op.max, "relax.min": relax.op.min,
                  "relax.mean": relax.op.mean}[call.op.name]
        trailing = next((k for k in range(1, len(shape)) if math.prod(shape[-k:]) == split[1]), None)
        if trailing is not None:        # the trailing axes first: no reshape between x's producer and it
            per_row = self.builder_.emit(reduce(call.args[0], axis=list(range(len(shape) - trailing, len(shape)))))
            rest = list(range(len(shape) - trailing))
        else:
            table = self.builder_.emit(relax.op.reshape(call.args[0], list(split)))
            per_row = self.builder_.emit(reduce(table, axis=[1]))
            rest = [0]
        if not call.attrs.keepdims:
            return reduce(per_row, axis=rest)
        whole = self.builder_.emit(reduce(per_row, axis=rest))
        return relax.op.reshape(whole, [1] * len(shape))


@tvm.transform.module_pass(opt_level=0, name="SplitWholeTensorReductions")
def SplitWholeTensorReductions(mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:  # noqa: N802 - a pass, named like TVM's
    """Split the module's large whole-tensor reductions into a row step and a final step (see the
    module docstring)."""
    return rewrite_functions(mod, _WholeTensorReductionRewriter(mod))
