"""ONNX -> Relax import that keeps ONNX tensor names as Relax variable names.

``tvm.relax.frontend.onnx.from_onnx`` names every binding ``lv<N>``, so an ONNX tensor such as
``hidden`` cannot be found again after the import. :func:`import_onnx` runs the same importer but
binds each converted node to a variable named after its first ONNX output (sanitised to an
identifier), and stores the map ``{onnx name: relax var name}`` as the module attribute
``"pit.onnx_names"`` (which :class:`~pit_tvm.passes.AnnotateDynamicSparsity` reads to resolve
explicit annotations). If the named import fails for any reason it falls back to plain
``from_onnx`` with a warning (names are then ``lv<N>``, graph inputs keep theirs).
"""
from __future__ import annotations

import re
import warnings

import numpy as np
import onnx
import tvm
from tvm import relax

ONNX_NAMES_ATTR = "pit.onnx_names"


def sanitize(name: str) -> str:
    """The identifier a Relax variable gets for an ONNX tensor name."""
    new = re.sub(r"\W", "_", name)
    if not new or not (new[0].isalpha() or new[0] == "_"):
        new = "t_" + new
    return new


def load_model(model) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    return onnx.load(str(model))


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


def _named_importer_cls():
    from tvm.relax.frontend.onnx import onnx_frontend as of  # noqa: PLC0415 - compiler-only

    class _NamedImporter(of.ONNXGraphImporter):
        """Binds each converted node to a var named after its first ONNX output."""

        pit_outputs: dict = {}
        pit_bound: dict = {}

        def _convert_operator(self, op_name, inputs, attrs, opset):
            sym = super()._convert_operator(op_name, inputs, attrs, opset)
            out = self.pit_outputs.get(attrs.get("tvm_custom", {}).get("name"))
            if (
                out
                and isinstance(sym, relax.Call)
                and isinstance(sym.ty, relax.TensorType)
            ):
                sym = self.bb.emit(sym, name_hint=sanitize(out))
                self.pit_bound[out] = sym.name
            elif (
                out
                and isinstance(sym, relax.Tuple)
                and len(sym.fields) > 0
                and isinstance(sym.fields[0], relax.Call)
                and isinstance(sym.fields[0].ty, relax.TensorType)
            ):  # multi-output op (e.g. LayerNormalization): name its first output
                first = self.bb.emit(sym.fields[0], name_hint=sanitize(out))
                self.pit_bound[out] = first.name
                sym = self.bb.normalize(relax.Tuple([first, *list(sym.fields)[1:]]))
            elif (
                out
                and isinstance(sym, relax.Tuple)
                and len(sym.fields) > 0
                and isinstance(sym.fields[0], relax.Var)
                and isinstance(sym.fields[0].ty, relax.TensorType)
            ):
                self.pit_bound[out] = sym.fields[0].name
            elif out and isinstance(sym, relax.Var) and isinstance(sym.ty, relax.TensorType):
                self.pit_bound[out] = sym.name  # the converter bound it already (e.g. lv3)
            return sym

    return _NamedImporter


#: a node is folded only while its constant inputs hold at most this many elements in all: shape
#: arithmetic, not weights (a transposed weight stays for TVM's own constant folding)
FOLD_MAX_ELEMENTS = 1 << 16
#: ops whose value is not a function of their inputs
_NOT_FOLDABLE = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                 "Bernoulli", "If", "Loop", "Scan"}


def _static_dims(value_info) -> list[int] | None:
    """a tensor's dims where ONNX knows every one, else None"""
    tensor = value_info.type.tensor_type
    if not value_info.type.HasField("tensor_type") or not tensor.HasField("shape"):
        return None
    dims = tensor.shape.dim
    return [int(d.dim_value) for d in dims] if all(d.HasField("dim_value") for d in dims) else None


def _folded_values(node, consts: dict, static: dict, opset: int):
    """``node``'s output values where its inputs are known (:func:`fold_shape_computations`), else None"""
    inputs = [i for i in node.input if i]
    if node.domain not in ("", "ai.onnx") or node.op_type in _NOT_FOLDABLE:
        return None
    if node.op_type == "Shape" and static.get(node.input[0]) is not None:
        start = next((a.i for a in node.attribute if a.name == "start"), 0)
        end = next((a.i for a in node.attribute if a.name == "end"), None)
        return [np.array(static[node.input[0]], dtype=np.int64)[start:end]]
    if not all(i in consts for i in inputs) or sum(consts[i].size for i in inputs) > FOLD_MAX_ELEMENTS:
        return None
    from onnx.reference import ReferenceEvaluator  # noqa: PLC0415

    try:
        return ReferenceEvaluator(node, opsets={"": opset}).run(None, {i: consts[i] for i in inputs})
    except Exception:  # noqa: BLE001 - not evaluable here: TVM imports it as it is
        return None


def fold_shape_computations(model, shape_dict=None) -> onnx.ModelProto:
    """``model`` with its shape arithmetic evaluated: each node whose inputs are constants
    (initializers, ``Constant`` nodes, the ``Shape`` of a tensor whose shape ONNX shape inference
    finds static, with ``shape_dict`` fixing inputs' symbolic dims) becomes an initializer.

    Why: TVM's importer gives a ``Range`` whose bounds are not initializers a data-dependent
    length, so a padding mask built from a sequence-length input (``Range(0, Shape(x)[1]) <
    seq_len``) and every tensor it broadcasts with lose their shapes, which the build rejects
    even where every dim is static.  Folded here, the range is a constant."""
    from onnx import numpy_helper  # noqa: PLC0415

    model = load_model(model)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    g = copy.graph
    for inp in g.input:
        if shape_dict and inp.name in shape_dict:
            for d, v in zip(inp.type.tensor_type.shape.dim, shape_dict[inp.name]):
                d.Clear()
                d.dim_value = int(v)
    try:
        inferred = onnx.shape_inference.infer_shapes(copy).graph
    except Exception:  # noqa: BLE001 - no inference: only Constant / initializer chains fold
        inferred = g
    static = {vi.name: _static_dims(vi) for vi in [*inferred.input, *inferred.value_info, *inferred.output]}
    opset = next((op.version for op in copy.opset_import if op.domain in ("", "ai.onnx")), 1)
    # (only initializers small enough to fold are read: a model's weights stay as they are)
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer if np.prod(t.dims) <= FOLD_MAX_ELEMENTS}
    outputs = {o.name for o in g.output}
    kept, folded = [], {}
    for node in g.node:
        # (a graph output stays a node's)
        values = None if set(node.output) & outputs else _folded_values(node, consts, static, opset)
        if values is None:
            kept.append(node)
            continue
        for name, value in zip(node.output, values):
            if name:
                consts[name] = folded[name] = np.asarray(value)
    if not folded:
        return model
    used = {i for node in kept for i in node.input} | outputs
    del g.node[:]
    g.node.extend(kept)
    g.initializer.extend(numpy_helper.from_array(v, name) for name, v in folded.items() if name in used)
    # (inputs were given static dims above only for inference: the model keeps its own)
    del g.input[:]
    g.input.extend(model.graph.input)
    return copy


def import_onnx(model, *, keep_params_in_input: bool = False, shape_dict=None) -> tvm.IRModule:
    """Import an ONNX model (path or ModelProto) into Relax, keeping ONNX tensor names."""
    model = load_model(model)
    from tvm.relax.frontend.onnx import from_onnx  # noqa: PLC0415

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    outputs = {}
    for i, node in enumerate(copy.graph.node):
        node.name = f"pit_node_{i}"
        if node.output and node.output[0]:
            outputs[node.name] = node.output[0]
    opset = 1
    for op in copy.opset_import:
        if op.domain in ("", "ai.onnx"):
            opset = op.version
            break
    try:
        cls = _named_importer_cls()
        imp = cls(shape_dict, "float32", keep_params_in_input=keep_params_in_input, sanitize=True)
        imp.pit_outputs, imp.pit_bound = outputs, {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(Renaming|Input .* has unknown)")
            mod = imp.from_onnx(copy.graph, opset)
        names = dict(imp.pit_bound)
        for i_name, var in imp._inputs.items():  # graph inputs (sanitised names)
            if isinstance(var, relax.Var):
                names[i_name] = var.name
    except Exception as err:  # noqa: BLE001 - importer internals changed: plain import
        warnings.warn(f"named ONNX import failed ({err!r}); falling back to from_onnx (names lv<N>)")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(Renaming|Input .* has unknown)")
            mod = from_onnx(model, shape_dict=shape_dict, keep_params_in_input=keep_params_in_input)
        names = {p.name: p.name for p in mod["main"].params}
    return mod.with_attr(ONNX_NAMES_ATTR, names)
