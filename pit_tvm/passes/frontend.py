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

import contextlib
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


def sanitize(name: str) -> str:
    """The identifier a Relax variable gets for an ONNX tensor name."""
    new = re.sub(r"\W", "_", name)
    if not new or not (new[0].isalpha() or new[0] == "_"):
        new = "t_" + new
    return new


def load_model(model) -> onnx.ModelProto:
    """``model`` (an ``onnx.ModelProto`` or a path) as a ModelProto; a missing file is a
    ``FileNotFoundError`` and a file that is not an ONNX model a ``ValueError``, each naming it."""
    if isinstance(model, onnx.ModelProto):
        return model
    path = str(model)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"ONNX model {path!r} not found")
    try:
        proto = onnx.load(path)
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and friends: not a model
        raise ValueError(f"{path!r} is not an ONNX model (protobuf could not parse it: {err})") from err
    if not proto.graph.node and not proto.graph.output:
        raise ValueError(f"{path!r} is not an ONNX model (it parses to an empty graph)")
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
