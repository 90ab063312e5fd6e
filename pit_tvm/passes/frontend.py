"""ONNX -> Relax import that keeps ONNX tensor names as Relax variable names.

Kept as one module: the named import, the converter fixes it installs and the shape-value
folding all wrap one importer run (``_importer_classes`` / ``_run_importer``) and mean nothing
outside it.

``tvm.relax.frontend.onnx.from_onnx`` names every binding ``lv<N>``, so an ONNX tensor such as
``hidden`` cannot be found again after the import. :func:`import_onnx` runs the same importer but
binds each converted node to a variable named after its first ONNX output (sanitised to an
identifier), and stores the map ``{onnx name: relax var name}`` as the module attribute
``"pit.onnx_names"`` (which :class:`~pit_tvm.passes.AnnotateDynamicSparsity` reads to resolve
explicit annotations). If the named import fails for any reason it falls back to the import
without names, with a warning (names are then ``lv<N>``, graph inputs keep theirs).  A node the
importer cannot convert raises :class:`UnsupportedOnnxError` (node name, op type, reason); the
converters that give wrong answers are fixed up here (:data:`PIT_CONVERTER_FIXES`). A ``Range``
bounded by the inputs' dims keeps a symbolic length (:func:`shape_values`): real exports then
import over symbolic batch / sequence dims.
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import sys
import tempfile
import warnings

import numpy as np
import onnx
import tvm
from tvm import relax

ONNX_NAMES_ATTR = "pit.onnx_names"
#: module attribute: the records of the contrib ops converted at import (``com.microsoft.LongformerAttention``)
IMPORT_ANNOTATIONS_ATTR = "pit.import_annotations"


def sanitize(name: str) -> str:
    """The identifier a Relax variable gets for an ONNX tensor name."""
    new = re.sub(r"\W", "_", name)
    if not new or not (new[0].isalpha() or new[0] == "_"):
        new = "t_" + new
    return new


def load_model(model) -> onnx.ModelProto:
    """``model`` (an ``onnx.ModelProto`` or a path) as a ModelProto with outputs; what is not one
    (a missing file, a directory, an empty file, bytes that are not an ONNX protobuf, a graph
    without outputs) is a :class:`~pit_tvm.errors.UserError` naming it."""
    from pit_tvm.errors import UserError  # noqa: PLC0415

    if isinstance(model, onnx.ModelProto):
        name, proto = "the model", model
    else:
        name = os.fspath(model)
        if not os.path.exists(name):
            raise UserError(f"{name}: no such file")
        if not os.path.isfile(name):
            raise UserError(f"{name}: not a file (expected an ONNX model)")
        if os.path.getsize(name) == 0:
            raise UserError(f"{name}: an empty file, not an ONNX model")
        try:
            proto = onnx.load(name)
        except OSError as err:
            raise UserError(f"{name}: cannot read: {err}") from err
        except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and friends: not a model
            raise UserError(f"{name}: not an ONNX model ({type(err).__name__}: {err})") from err
    if not proto.graph.output:
        raise UserError(f"{name}: the ONNX graph has no outputs (nothing to compile); is it an ONNX model?")
    return proto


def onnx_value_names(model: onnx.ModelProto) -> list[str]:
    """Every tensor name of the graph: inputs, initializers, node outputs (in graph order)."""
    g = model.graph
    names = [i.name for i in g.input] + [t.name for t in g.initializer]
    for node in g.node:
        names.extend(o for o in node.output if o)
    seen, out = set(), []
    for n in names:
        if n not in seen:
            seen.add(n)
            out.append(n)
    return out


class UnsupportedOnnxError(NotImplementedError, ValueError):
    """An ONNX node that TVM's ONNX importer cannot convert: names the node, its op type and what
    is unsupported (the importer's own exception is the ``__cause__``).  Both a
    ``NotImplementedError`` and a ``ValueError`` (a model pit-tvm cannot take)."""

    def __init__(self, message: str, node_name: str | None = None, op_type: str | None = None):
        super().__init__(message)
        self.node_name, self.op_type = node_name, op_type


def _layer_norm_with_stats(bb, inputs, attrs, converted):
    """LayerNormalization with its ``Mean`` / ``InvStdDev`` outputs computed (TVM's converter
    returns 0-d zeros for them): both over the normalised axes, kept as size-1 dims, in
    ``stash_type`` (float32 by default); ``Y`` stays TVM's fused ``layer_norm``."""
    if attrs.get("tvm_custom", {}).get("num_outputs", 1) < 2:
        return converted
    data = inputs[0]
    if data.ty.shape is None:
        raise NotImplementedError("Mean / InvStdDev outputs of an input of unknown rank are not supported")
    ndim = len(data.ty.shape)
    axis = attrs.get("axis", -1)
    axis = axis + ndim if axis < 0 else axis
    axes = list(range(axis, ndim))
    stash = {1: "float32", 10: "float16", 11: "float64", 16: "bfloat16"}.get(attrs.get("stash_type", 1), "float32")
    x = data if str(data.ty.dtype) == stash else bb.normalize(relax.op.astype(data, stash))
    mean = bb.normalize(relax.op.mean(x, axis=axes, keepdims=True))
    centred = bb.normalize(relax.op.subtract(x, mean))
    var = bb.normalize(relax.op.mean(relax.op.multiply(centred, centred), axis=axes, keepdims=True))
    eps = relax.const(attrs.get("epsilon", 1e-5), stash)
    inv_std = bb.normalize(relax.op.rsqrt(relax.op.add(var, eps)))
    return relax.Tuple([converted.fields[0], mean, inv_std])


def _is_inf(bb, inputs, attrs, converted):
    """IsInf honouring ``detect_positive`` / ``detect_negative`` (TVM's converter ignores them)."""
    x = inputs[0]
    result = converted
    zero = relax.const(0, x.ty.dtype)
    if not attrs.get("detect_positive", 1):
        result = relax.op.logical_and(result, relax.op.less(x, zero))
    if not attrs.get("detect_negative", 1):
        result = relax.op.logical_and(result, relax.op.greater(x, zero))
    return result


def _expand(bb, inputs, attrs, converted):
    """Expand to a shape known only at run time, with ONNX's two-way broadcast (a 1 in the shape
    keeps the input's dim; TVM's converter broadcasts to the shape as given, so ``[3, 1]`` expanded
    by ``[2, 1, 6]`` came out ``[2, 1, 6]``).  Static shapes keep TVM's conversion.  The output
    dims are expressions of the shape's values (a shape tensor computed in the graph would need
    a match_cast mid-block, which the fused CPU pipeline's memory planning rejects)."""
    data, shape = inputs
    if isinstance(shape, (relax.ShapeExpr, tvm.ir.GenericConst)) or not isinstance(shape.ty, relax.TensorType):
        return converted
    shape_ndim, data_ndim = int(shape.ty.shape[0]), len(data.ty.shape)
    ndim = max(shape_ndim, data_ndim)
    one = tvm.tirx.IntImm("int64", 1)
    values = bb.emit(relax.Call(relax.ExternFunc("vm.builtin.tensor_to_shape"), [shape],
                                ty_args=[relax.ShapeType(ndim=shape_ndim)]))
    dims = [tvm.tirx.Var(f"expand_{i}", "int64") for i in range(shape_ndim)]
    bb.match_cast(values, relax.ShapeType(dims))
    dims = [one] * (ndim - shape_ndim) + dims
    data_dims = [one] * (ndim - data_ndim) + list(data.ty.shape)
    target = [d if isinstance(x, tvm.tirx.IntImm) and x.value == 1 else tvm.tirx.Select(d == 1, x, d)
              for x, d in zip(data_dims, dims)]
    padded = data
    if ndim > data_ndim:
        padded = bb.normalize(relax.op.reshape(data, relax.ShapeExpr(data_dims)))
    return bb.normalize(relax.op.broadcast_to(padded, relax.ShapeExpr(target)))


def _dropout(bb, inputs, attrs, converted):
    """Dropout at inference: ``output`` is the input and the optional ``mask`` all true (bool;
    TVM's converter returned a float mask).  Training mode is refused."""
    training = inputs[2] if len(inputs) > 2 else None
    if training is not None:
        if not isinstance(training, tvm.ir.GenericConst):
            raise NotImplementedError("Dropout's training_mode must be a constant (inference only)")
        if bool(training.value.numpy()):
            raise NotImplementedError("Dropout in training mode (random masks) is not supported")
    if attrs.get("tvm_custom", {}).get("num_outputs", 1) < 2:
        return converted
    x = inputs[0]
    return relax.Tuple([x, relax.op.ones(relax.op.shape_of(x) if x.ty.shape is None else x.ty.shape, "bool")])


def _constant_of_shape(bb, inputs, attrs, converted):
    """ConstantOfShape: refused where its shape is a tensor computed at run time (the build
    fails on the data-dependent shape)."""
    shape = inputs[0]
    if not isinstance(shape, (relax.ShapeExpr, tvm.ir.GenericConst)) and isinstance(shape.ty, relax.TensorType):
        raise NotImplementedError("a shape computed at run time (a tensor, not a constant or the Shape of "
                                  "a tensor of static shape) is not supported")
    return converted


def _one_hot_depth_as_int(bb, inputs, attrs):
    """OneHot's ``depth`` and ``indices`` may be of any numeric type; TVM's converter passes float
    ones on, which ``relax.op.one_hot`` rejects: a constant depth becomes an int64 constant and
    float indices are cast to int64.  A negative ``axis`` other than -1 is made positive (TOPI
    took it as an index of the input's dims)."""
    depth = inputs[1]
    if isinstance(depth, tvm.ir.GenericConst) and "int" not in str(depth.ty.dtype):
        inputs[1] = relax.const(depth.value.numpy().astype("int64"))
    if "int" not in str(inputs[0].ty.dtype):  # ONNX allows float indices; Relax's one_hot does not
        inputs[0] = bb.normalize(relax.op.astype(inputs[0], "int64"))
    if attrs.get("axis", -1) < -1 and inputs[0].ty.shape is not None:  # TOPI's one_hot reads -1 only
        attrs["axis"] += len(inputs[0].ty.shape) + 1
    return inputs


def _pow_exponent_as_base_dtype(bb, inputs, attrs):
    """Pow of a float base by an exponent of another type (ONNX allows it; Relax's power wants
    one dtype): the exponent is cast to the base's dtype."""
    base, exponent = inputs[0], inputs[1]
    if "float" in str(base.ty.dtype) and str(exponent.ty.dtype) != str(base.ty.dtype):
        inputs[1] = bb.normalize(relax.op.astype(exponent, base.ty.dtype))
    return inputs


#: dtypes TVM's CPU sort kernel (TopK's) has no case for: the model built and failed at run time
SORT_UNSUPPORTED_DTYPES = {"int16", "uint16", "uint32", "uint64"}


def _top_k_dtype(bb, inputs, attrs):
    """TopK of a dtype the sort kernel lacks is refused at import, not at run time."""
    if str(inputs[0].ty.dtype) in SORT_UNSUPPORTED_DTYPES:
        raise NotImplementedError(f"TopK of {inputs[0].ty.dtype} is not supported (TVM's sort kernel has no "
                                  f"{inputs[0].ty.dtype} case)")
    return inputs


def _reduce_checks(bb, inputs, attrs, op="Reduce"):
    """Reductions TVM builds wrong or not at all are refused: over an axis of size 0 (the result
    was garbage, not the reduction's identity) and ReduceMax / ReduceMin of bool (the build
    failed)."""
    data = inputs[0]
    if op in ("ReduceMax", "ReduceMin") and str(data.ty.dtype) == "bool":
        raise NotImplementedError(f"{op} of bool tensors is not supported")
    if data.ty.shape is None:
        return inputs
    axes = inputs[1] if len(inputs) > 1 and inputs[1] is not None else None
    if isinstance(axes, tvm.ir.GenericConst):
        axes = [int(a) for a in axes.value.numpy().reshape(-1)]
    elif axes is None:
        axes = list(attrs.get("axes", []))
    else:
        return inputs  # computed at run time: TVM's converter refuses it
    if not axes and attrs.get("noop_with_empty_axes", 0):
        return inputs
    dims = list(data.ty.shape)
    reduced = [dims[a] for a in axes] if axes else dims
    if any(isinstance(d, tvm.tirx.IntImm) and d.value == 0 for d in reduced):
        raise NotImplementedError(f"{op} over an axis of size 0 is not supported")
    return inputs


def _split_checks(bb, inputs, attrs):
    """Split with a part of size 0 is refused (the build rejected its split indices)."""
    split = inputs[1] if len(inputs) > 1 else None
    sizes = ([int(v) for v in split.value.numpy().reshape(-1)] if isinstance(split, tvm.ir.GenericConst)
             else list(attrs.get("split", [])))
    if 0 in sizes:
        raise NotImplementedError("Split into a part of size 0 is not supported")
    return inputs


def _one_hot_fix(bb, inputs, attrs, converted):
    """OneHot's output in the dtype of its ``values`` (TVM's took the dtype of the Python
    numbers it made of them: float64 / int64)."""
    dtype = str(inputs[2].ty.dtype)
    return converted if str(converted.ty.dtype) == dtype else relax.op.astype(converted, dtype)


#: ``{op type: fix(bb, inputs, attrs) -> inputs}`` applied before TVM's converter runs (it may
#: set ``attrs``)
PIT_INPUT_FIXES = {"OneHot": _one_hot_depth_as_int, "Pow": _pow_exponent_as_base_dtype, "TopK": _top_k_dtype,
                   "Split": _split_checks,
                   **{op: functools.partial(_reduce_checks, op=op)
                      for op in ("ReduceMax", "ReduceMin", "ReduceSum", "ReduceMean", "ReduceProd", "ReduceL1",
                                 "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")}}


def _pow(bb, inputs, attrs, converted):
    """Pow of integer tensors is refused (Relax's power takes floats only; the build failed)."""
    if "float" not in str(inputs[0].ty.dtype):
        raise NotImplementedError(f"Pow of {inputs[0].ty.dtype} tensors is not supported (floats only)")
    return converted


#: ``{op type: fix(bb, inputs, attrs, tvm's conversion) -> conversion}``: where TVM's converter
#: gives a wrong answer, pit-tvm rewrites its result (checked by tests/api/test_onnx_node_cases.py)
PIT_CONVERTER_FIXES = {"LayerNormalization": _layer_norm_with_stats, "IsInf": _is_inf, "Expand": _expand,
                       "Dropout": _dropout, "ConstantOfShape": _constant_of_shape,
                       "Pow": _pow, "OneHot": _one_hot_fix}


def _pit_moe(bb, inputs, attrs, target):
    from .moe_import import convert_pit_moe  # noqa: PLC0415

    return convert_pit_moe(bb, inputs, attrs, target)


#: ``{op type: convert(bb, inputs, attrs, target)}``: ops that pit-tvm's own ONNX rewrites insert
#: (:func:`pit_tvm.passes.moe_import.lower_moe_layers`) and converts itself
PIT_OPS = {"PitMoE": _pit_moe}


def _has_zero_dim(value) -> bool:
    shape = getattr(value.ty, "shape", None)
    return shape is not None and any(isinstance(d, tvm.tirx.IntImm) and d.value == 0 for d in shape)


#: ops a shape value passes through unchanged (its elements, flattened)
_SHAPE_VALUE_PASSTHROUGH = {"relax.reshape", "relax.astype", "relax.squeeze", "relax.expand_dims",
                            "relax.flatten", "relax.broadcast_to"}
_SHAPE_VALUE_ARITH = {"relax.add": lambda a, b: a + b, "relax.subtract": lambda a, b: a - b,
                      "relax.multiply": lambda a, b: a * b, "relax.floor_divide": tvm.tirx.floordiv,
                      "relax.maximum": tvm.tirx.max, "relax.minimum": tvm.tirx.min}


def _int64(value):
    """a PrimExpr as int64 (a tirx Var's dtype is its ``ty``)"""
    dtype = str(getattr(value, "dtype", None) or value.ty)
    return value if dtype == "int64" else tvm.tirx.Cast("int64", value)


def shape_values(bb, expr, depth: int = 0):
    """The elements of the small integer tensor ``expr`` as ``int64`` PrimExprs of the inputs'
    dims (``Shape -> Gather -> Cast / Unsqueeze / Concat / +-*//`` chains), or None where one is
    not a function of shapes and constants"""
    from tvm import tirx  # noqa: PLC0415

    if depth > 32:
        return None
    if tvm.ir.is_prim_expr(expr):
        return [_int64(expr)]
    if isinstance(expr, relax.Var):
        bound = bb.lookup_binding(expr)
        return None if bound is None else shape_values(bb, bound, depth + 1)
    if isinstance(expr, tvm.ir.GenericConst):
        value = expr.value.numpy()
        if value.dtype.kind not in "iu" or value.size > 16:
            return None
        return [tirx.IntImm("int64", int(v)) for v in value.reshape(-1)]
    if isinstance(expr, relax.ShapeExpr):
        return [_int64(v) for v in expr.values]
    if not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
        return None
    op, args = expr.op.name, expr.args
    if op == "relax.shape_to_tensor":
        return shape_values(bb, args[0], depth + 1)
    if op == "relax.shape_of":
        shape = getattr(args[0].ty, "shape", None)
        return shape_values(bb, shape, depth + 1) if isinstance(shape, relax.ShapeExpr) else None
    if op in _SHAPE_VALUE_PASSTHROUGH:
        return shape_values(bb, args[0], depth + 1)
    if op == "relax.take" and int(expr.attrs.axis if expr.attrs.axis is not None else 0) == 0:
        data, index = shape_values(bb, args[0], depth + 1), shape_values(bb, args[1], depth + 1)
        if data is None or index is None or not all(isinstance(i, tirx.IntImm) for i in index):
            return None
        picked = [int(i.value) + (len(data) if int(i.value) < 0 else 0) for i in index]
        return [data[i] for i in picked] if all(0 <= i < len(data) for i in picked) else None
    if op == "relax.concat" and isinstance(args[0], relax.Tuple):
        parts = [shape_values(bb, f, depth + 1) for f in args[0].fields]
        return None if any(p is None for p in parts) else [v for p in parts for v in p]
    if op in _SHAPE_VALUE_ARITH:
        a, b = shape_values(bb, args[0], depth + 1), shape_values(bb, args[1], depth + 1)
        if a is None or b is None or not (len(a) == len(b) or 1 in (len(a), len(b))):
            return None
        n = max(len(a), len(b))
        a, b = (a * n if len(a) == 1 else a), (b * n if len(b) == 1 else b)
        return [_SHAPE_VALUE_ARITH[op](x, y) for x, y in zip(a, b)]
    return None


def _symbolic_range(bb, inputs):
    """ONNX ``Range(start, limit, delta)`` over integers whose bounds are functions of the inputs'
    dims (``Range(0, Shape(x)[1])``, position ids) as ``arange`` of those PrimExprs, so its length
    is the symbolic dim itself; None where they are not (TVM's converter then gives it a length
    computed from data, which the build cannot size)"""
    if len(inputs) != 3 or any(x is None for x in inputs):
        return None
    dtype = getattr(inputs[0].ty, "dtype", None)
    if dtype is None or not str(dtype).startswith(("int", "uint")):
        return None
    bounds = [shape_values(bb, x) for x in inputs]
    if any(b is None or len(b) != 1 for b in bounds):
        return None
    start, limit, delta = (b[0] for b in bounds)
    if all(isinstance(b, tvm.tirx.IntImm) for b in (start, limit)):
        return None     # (constants: TVM's converter makes the constant)
    if not isinstance(delta, tvm.tirx.IntImm) or int(delta.value) <= 0:
        return None
    return relax.op.arange(start, limit, delta, dtype=str(dtype))


def _importer_classes():
    """``(_PitImporter, _NamedImporter)``: TVM's ONNX importer with :data:`PIT_CONVERTER_FIXES`
    applied, and that importer binding each converted node to a var named after its first ONNX
    output."""
    from tvm.relax.frontend.onnx import onnx_frontend as of  # noqa: PLC0415 - compiler-only

    from .contrib_attention import CONTRIB_CONVERTERS  # noqa: PLC0415

    class _PitImporter(of.ONNXGraphImporter):
        #: the build target, for the ops pit-tvm converts itself (``PitMoE``)
        pit_target = None
        #: ``compile_onnx``'s ``sparse_attention=`` for the contrib attention converters
        pit_sparse_attention = None
        #: {pit node name: its first ONNX output}; the converters' decision records
        pit_outputs: dict = {}
        pit_notes: list = []
        #: {pit node name: [(input name, the graph inputs it is computed from)]} of the contrib nodes
        pit_sources: dict = {}

        def _check_for_unsupported_ops(self, graph):
            # (pit-tvm's own ops and the ONNX Runtime contrib ops that TVM lacks are converted here)
            supported = set(of._get_convert_map()) | {"If", "Constant"} | set(CONTRIB_CONVERTERS) | set(PIT_OPS)
            unsupported = {node.op_type for node in graph.node if node.op_type not in supported}
            if unsupported:
                raise tvm.error.OpNotImplemented(
                    "The following operators are not supported for frontend ONNX: " + ", ".join(sorted(unsupported)))

        def _convert_operator(self, op_name, inputs, attrs, opset):
            if op_name in PIT_OPS:
                return self.bb.normalize(PIT_OPS[op_name](self.bb, list(inputs), attrs, self.pit_target))
            if op_name in CONTRIB_CONVERTERS:
                node = attrs.get("tvm_custom", {}).get("name")
                return CONTRIB_CONVERTERS[op_name](self.bb, inputs, attrs, target=self.pit_target,
                                                   sparse=self.pit_sparse_attention, notes=self.pit_notes,
                                                   node_output=self.pit_outputs.get(node),
                                                   input_sources=self.pit_sources.get(node))
            if op_name in PIT_INPUT_FIXES:
                inputs = PIT_INPUT_FIXES[op_name](self.bb, inputs, attrs)
            if op_name == "Trilu" and _has_zero_dim(inputs[0]):  # empty: TVM's converter fails on it
                return inputs[0]
            if op_name == "Range":   # bounds from the inputs' dims: a symbolic length, not a data-dependent one
                ranged = _symbolic_range(self.bb, list(inputs))
                if ranged is not None:
                    return self.bb.normalize(ranged)
            sym = super()._convert_operator(op_name, inputs, attrs, opset)
            fix = PIT_CONVERTER_FIXES.get(op_name)
            if fix is not None:
                sym = fix(self.bb, inputs, attrs, sym)
                if isinstance(sym, relax.Expr):
                    sym = self.bb.normalize(sym)
            return sym

    class _NamedImporter(_PitImporter):
        """Binds each converted node to a var named after its first ONNX output."""

        pit_outputs: dict = {}
        pit_bound: dict = {}

        def _convert_operator(self, op_name, inputs, attrs, opset):
            sym = super()._convert_operator(op_name, inputs, attrs, opset)
            out = self.pit_outputs.get(attrs.get("tvm_custom", {}).get("name"))
            if not out:
                return sym
            # a multi-output op (e.g. LayerNormalization) is named by its first output
            first = sym.fields[0] if isinstance(sym, relax.Tuple) and len(sym.fields) > 0 else None
            if isinstance(sym, relax.Call) and isinstance(sym.ty, relax.TensorType):
                sym = self.bb.emit(sym, name_hint=sanitize(out))
                self.pit_bound[out] = sym.name
            elif isinstance(first, relax.Call) and isinstance(first.ty, relax.TensorType):
                first = self.bb.emit(first, name_hint=sanitize(out))
                self.pit_bound[out] = first.name
                sym = self.bb.normalize(relax.Tuple([first, *list(sym.fields)[1:]]))
            elif isinstance(first, relax.Var) and isinstance(first.ty, relax.TensorType):
                self.pit_bound[out] = first.name
            elif isinstance(sym, relax.Var) and isinstance(sym.ty, relax.TensorType):
                self.pit_bound[out] = sym.name  # the converter bound it already (e.g. lv3)
            return sym

    return _PitImporter, _NamedImporter


#: ONNX element types the llvm build gets wrong or rejects (float8 casts give wrong values,
#: sub-byte types fail in the runtime's copies): refused by :func:`check_tensor_types`
UNSUPPORTED_ELEM_TYPE_PREFIXES = ("FLOAT8", "FLOAT4", "INT4", "UINT4", "INT2", "UINT2", "STRING", "COMPLEX")


def _unsupported_elem_type(elem_type: int) -> str | None:
    name = onnx.TensorProto.DataType.Name(elem_type) if elem_type in onnx.TensorProto.DataType.values() else "?"
    return name if name.startswith(UNSUPPORTED_ELEM_TYPE_PREFIXES) else None


def check_tensor_types(graph) -> None:
    """Raise :class:`UnsupportedOnnxError` for a graph input / output that is not a tensor
    (sequence, optional, map) or a tensor, initializer or ``Cast`` / ``CastLike`` target of an
    element type in :data:`UNSUPPORTED_ELEM_TYPE_PREFIXES`."""
    for kind, values in (("input", graph.input), ("output", graph.output), ("value", graph.value_info)):
        for value in values:
            if not value.type.HasField("tensor_type"):
                raise UnsupportedOnnxError(f"graph {kind} {value.name!r} is a {value.type.WhichOneof('value')}: "
                                           "only tensor inputs and outputs are supported")
            bad = _unsupported_elem_type(value.type.tensor_type.elem_type)
            if bad:
                raise UnsupportedOnnxError(f"graph {kind} {value.name!r} has element type {bad}, which pit-tvm "
                                           "does not support")
    for init in graph.initializer:
        bad = _unsupported_elem_type(init.data_type)
        if bad:
            raise UnsupportedOnnxError(f"initializer {init.name!r} has element type {bad}, which pit-tvm does not "
                                       "support")
    for i, node in enumerate(graph.node):
        to = next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None
        bad = _unsupported_elem_type(to) if to is not None else None
        if bad:
            raise UnsupportedOnnxError(f"ONNX node {node.name or f'#{i}'!r} (Cast): a cast to element type {bad} is "
                                       "not supported", node.name or f"#{i}", node.op_type)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    if isinstance(err, KeyError) and text:
        text = f"no value for {text}"
    return text.splitlines()[0][:300] if text else "(the importer's check gave no message)"


def _import_error(err: Exception, graph, converted: dict, original_names: list) -> UnsupportedOnnxError:
    """``err`` (raised inside TVM's importer) as an :class:`UnsupportedOnnxError` naming the node
    it failed on: the importer converts the nodes in graph order and records each one's outputs,
    so the failing node is the first whose outputs it has not recorded."""
    import tvm.error  # noqa: PLC0415

    inits = {t.name for t in graph.initializer}
    graph_inputs = {i.name for i in graph.input} - inits
    if isinstance(err, tvm.error.OpNotImplemented):  # checked before any node converts
        listed = {op.strip() for op in str(err).rpartition(":")[2].split(",")}
        unsupported = [(i, n) for i, n in enumerate(graph.node) if n.op_type in listed]
        ops = sorted({n.op_type for _, n in unsupported}) or [_first_line(err)]
        first_i, first = unsupported[0] if unsupported else (None, None)
        where = f"ONNX node {original_names[first_i]!r} ({first.op_type}): " if first is not None else ""
        return UnsupportedOnnxError(f"{where}TVM's ONNX importer has no converter for {', '.join(ops)}",
                                    original_names[first_i] if first is not None else None,
                                    first.op_type if first is not None else None)
    unread = [value.name for value in [*graph.initializer, *graph.input] if value.name not in converted]
    if unread:  # failed reading the initializers / graph inputs, before any node
        return UnsupportedOnnxError(f"TVM's ONNX importer cannot read the graph input or initializer {unread[0]!r}: "
                                    f"{type(err).__name__}: {_first_line(err)}")
    for i, node in enumerate(graph.node):
        if all(o in converted for o in node.output if o):
            continue
        runtime = [n for n in node.input[1:] if n in graph_inputs]
        about_constants = re.search(r"constant|dynamic|static|\bShape\b|'Var' object has no attribute", str(err),
                                    re.IGNORECASE)
        hint = (f"; its input(s) {runtime} are graph inputs, known only at run time (the importer needs "
                "them constant: make them initializers)" if runtime and about_constants else "")
        return UnsupportedOnnxError(f"ONNX node {original_names[i]!r} ({node.op_type}, output "
                                    f"{node.output[0] if node.output else None!r}) is not supported by TVM's ONNX "
                                    f"importer: {type(err).__name__}: {_first_line(err)}{hint}",
                                    original_names[i], node.op_type)
    return UnsupportedOnnxError(f"TVM's ONNX importer failed after converting every node: "
                                f"{type(err).__name__}: {_first_line(err)}")


def _run_importer(importer, graph, opset, original_names):
    """``importer.from_onnx(graph, opset)``; an error inside becomes :func:`_import_error`'s (the
    importer's own progress prints go nowhere: the error says it)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(Renaming|Input .* has unknown)")
            return importer.from_onnx(graph, opset)
    except Exception as err:  # noqa: BLE001 - any importer failure: one clear error naming the node
        raise _import_error(err, graph, importer._nodes, original_names) from err


#: a folded tensor holds at most this many (4-byte) elements: shape arithmetic and small
#: constants, not weights (a transposed weight stays for TVM's own constant folding) nor a large
#: mask expanded to the full sequence
FOLD_MAX_ELEMENTS = 1 << 16


@contextlib.contextmanager
def _native_output_captured():
    """Collect what native code writes to stdout / stderr (onnxsim's C++ core prints a line per
    node it leaves unfolded) into the yielded list of lines, instead of the user's terminal."""
    lines: list[str] = []
    saved = []
    with tempfile.TemporaryFile(mode="w+b") as sink:
        try:
            for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
                stream.flush()
                saved.append((fd, os.dup(fd)))
                os.dup2(sink.fileno(), fd)
        except (OSError, ValueError):  # no real file descriptors (embedded interpreters): leave them
            pass
        try:
            yield lines
        finally:
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)
            sink.seek(0)
            lines.extend(sink.read().decode(errors="replace").splitlines())


def fold_shape_computations(model, shape_dict=None) -> onnx.ModelProto:
    """``model`` with its constant subgraphs evaluated by ``onnxsim`` (constant folding and shape
    inference only, no graph rewrites): with ``shape_dict`` fixing inputs' symbolic dims, every
    ``Shape`` of a tensor whose shape is then static and the arithmetic on it (``Gather``,
    ``Concat``, ``Range``, the causal mask's ``Expand`` shape, T5's relative positions) become
    initializers.  Tensor names are kept; the model keeps its own (symbolic) input dims.

    Why: TVM's importer handles shape arithmetic over symbolic dims only in part: a ``Range`` whose
    bounds are not constants gets a data-dependent length (so a padding mask built from it, and
    everything it broadcasts with, loses its shape), ``Expand`` to a computed shape and ``Shape``
    of a computed shape fail in the importer (OPT / GPT-2 causal masks, T5).  Folded here, they are
    constants.  A graph onnxsim cannot process is imported as it is, with a warning."""
    model = load_model(model)
    try:
        import onnxsim  # noqa: PLC0415 - see pyproject.toml: this function is why it is a dependency
    except ImportError as err:
        warnings.warn(f"onnxsim is not installed ({err}): the graph's shape arithmetic is not folded before "
                      "the import (pip install onnxsim)")
        return model
    # weights go to onnxsim as graph inputs without their data: they stay as they are (bit for
    # bit, a transposed weight for TVM's own folding), and a large model does not go through it
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    weights = [t for t in copy.graph.initializer if np.prod(t.dims) > FOLD_MAX_ELEMENTS]
    if weights:
        kept = [t for t in copy.graph.initializer if np.prod(t.dims) <= FOLD_MAX_ELEMENTS]
        del copy.graph.initializer[:]
        copy.graph.initializer.extend(kept)
        declared = {i.name for i in copy.graph.input}
        copy.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                                for t in weights if t.name not in declared)
    fixed = {name: [int(d) for d in dims] for name, dims in (shape_dict or {}).items()}
    log: list[str] = []
    try:
        with _native_output_captured() as log:
            folded, _ = onnxsim.simplify(copy, perform_optimization=False, overwrite_input_shapes=fixed or None,
                                         tensor_size_threshold=f"{FOLD_MAX_ELEMENTS * 4}B")
    except Exception as err:  # noqa: BLE001 - onnxsim's failure is not the user's: import the graph as given
        detail = "; ".join(line for line in log if line.strip())[-500:]
        warnings.warn(f"onnxsim could not fold the graph's shape arithmetic ({type(err).__name__}: {err}"
                      f"{'; ' + detail if detail else ''}); importing it as exported")
        return model
    # (inputs were given static dims only for the folding: the model keeps its own)
    del folded.graph.input[:]
    folded.graph.input.extend(model.graph.input)
    used = {i for node in folded.graph.node for i in node.input} | {o.name for o in folded.graph.output}
    folded.graph.initializer.extend(t for t in weights if t.name in used)
    return folded


def _static_dims(value_info) -> list[int] | None:
    """a tensor's dims where ONNX knows every one, else None"""
    tensor = value_info.type.tensor_type
    if not value_info.type.HasField("tensor_type") or not tensor.HasField("shape"):
        return None
    dims = tensor.shape.dim
    return [int(d.dim_value) for d in dims] if all(d.HasField("dim_value") for d in dims) else None


def _contrib_input_sources(graph) -> dict:
    """``{node name: [(input name, sorted graph inputs it is computed from), ...]}`` for the
    contrib attention nodes (their records name the graph inputs a pattern comes from)."""
    from .contrib_attention import CONTRIB_CONVERTERS  # noqa: PLC0415

    producer = {o: node for node in graph.node for o in node.output if o}
    graph_inputs = {i.name for i in graph.input} - {t.name for t in graph.initializer}
    memo = {}

    def ancestors(name):
        if name not in memo:
            memo[name] = set()       # (a graph is acyclic; this guards the recursion anyway)
            if name in graph_inputs:
                memo[name] = {name}
            elif name in producer:
                memo[name] = set().union(*(ancestors(i) for i in producer[name].input if i))
        return memo[name]

    import sys  # noqa: PLC0415

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * len(graph.node) + 100))
    try:
        return {node.name: [(i, sorted(ancestors(i)) if i else []) for i in node.input]
                for node in graph.node if node.op_type in CONTRIB_CONVERTERS}
    finally:
        sys.setrecursionlimit(limit)


def import_onnx(model, *, keep_params_in_input: bool = False, shape_dict=None, target=None,
                sparse_attention=None) -> tvm.IRModule:
    """Import an ONNX model (path or ModelProto) into Relax, keeping ONNX tensor names.

    A node TVM's importer cannot convert raises :class:`UnsupportedOnnxError` naming it.
    ``target``: the build target, for the nodes pit-tvm converts itself (:data:`PIT_OPS`) and
    the contrib attention ops; ``sparse_attention``: ``compile_onnx``'s (False converts
    ``com.microsoft.LongformerAttention`` with dense masks; see its converter).  The contrib
    converters' decision records are the module attribute :data:`IMPORT_ANNOTATIONS_ATTR`."""
    model = load_model(model)
    check_tensor_types(model.graph)

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    outputs, original_names = {}, []
    for i, node in enumerate(copy.graph.node):
        original_names.append(node.name or f"#{i}")
        node.name = f"pit_node_{i}"
        if node.output and node.output[0]:
            outputs[node.name] = node.output[0]
    sources = _contrib_input_sources(copy.graph)
    opset = 1
    for op in copy.opset_import:
        if op.domain in ("", "ai.onnx"):
            opset = op.version
            break
    # (TVM's importer reads a dim of size 0 as unknown: such inputs get their static shape, so
    # the converters see the 0)
    zero_sized = {i.name: dims for i in copy.graph.input if (dims := _static_dims(i)) is not None and 0 in dims}
    if zero_sized:
        shape_dict = {**zero_sized, **(shape_dict or {})}
    pit_importer, named_importer = _importer_classes()
    try:
        imp = named_importer(shape_dict, "float32", keep_params_in_input=keep_params_in_input, sanitize=True)
        imp.pit_outputs, imp.pit_bound, imp.pit_target = outputs, {}, target
        imp.pit_sparse_attention, imp.pit_notes, imp.pit_sources = sparse_attention, [], sources
        mod = _run_importer(imp, copy.graph, opset, original_names)
        names = dict(imp.pit_bound)
        for i_name, var in imp._inputs.items():  # graph inputs (sanitised names)
            if isinstance(var, relax.Var):
                names[i_name] = var.name
    except Exception as err:  # noqa: BLE001 - maybe the naming hooks (importer internals changed)
        # the same import without them: it raises UnsupportedOnnxError where the model is the cause
        plain = pit_importer(shape_dict, "float32", keep_params_in_input=keep_params_in_input, sanitize=True)
        plain.pit_target, plain.pit_outputs = target, outputs
        plain.pit_sparse_attention, plain.pit_notes, plain.pit_sources = sparse_attention, [], sources
        imp = plain
        mod = _run_importer(plain, copy.graph, opset, original_names)
        warnings.warn(f"named ONNX import failed ({err!r}); imported without ONNX names (names lv<N>)")
        names = {p.name: p.name for p in mod["main"].params}
    mod = mod.with_attr(ONNX_NAMES_ATTR, names)
    if imp.pit_notes:
        mod = mod.with_attr(IMPORT_ANNOTATIONS_ATTR, imp.pit_notes)
    return mod


def import_annotations(mod: tvm.IRModule) -> list[dict]:
    """The decision records the contrib converters left on ``mod`` (plain dicts)."""
    notes = (mod.attrs or {}).get(IMPORT_ANNOTATIONS_ATTR, [])
    return [{str(k): str(v) for k, v in dict(n).items()} for n in notes]
