"""``compile_onnx``: ONNX model -> Relax (names kept) -> PIT passes -> build -> ``CompiledModel``.

Pipeline: the ONNX graph's shape arithmetic folded (``fold_shape_computations``) ->
:func:`~pit_tvm.passes.moe_import.lower_moe_layers` (MoE layers as one routed-expert op each,
docs/guide/moe_import.md) -> :func:`~pit_tvm.passes.import_onnx` -> ``FoldConstant`` (so Gemm's
transposed weights become ``[K, N]`` constants) -> :class:`~pit_tvm.passes.AnnotateDynamicSparsity` -> (``padding=``)
:class:`~pit_tvm.passes.PropagatePadding` -> :class:`~pit_tvm.passes.SparseAttentionToPIT`
(attention with a run-time mask: block index + sparse kernel) -> :class:`~pit_tvm.passes.LowerToPIT` ->
:class:`~pit_tvm.passes.DenseMatmulToPITKernels` (the
remaining matmuls on the PIT kernels' dense twin: tensor-core tiles on CUDA, the CPU schedule) ->
:class:`~pit_tvm.passes.ListStripsInProducer` (a strips index in its producer's epilogue) ->
:class:`~pit_tvm.passes.FuseAttention` (sm_90a: softmax attention in one kernel) -> ``DeadCodeElimination``
-> :func:`pit_tvm.target.build` (``tvm.compile``; on CUDA it applies the dlight default schedules
to the other operators).

``CompiledModel.export(path)`` writes the library ``path`` (``.so`` appended when the name does not
end in it) plus ``path + ".json"`` (input names, dtypes, shapes, output names, target, annotations,
the library's SHA-256), which :func:`pit_tvm.runtime.load` checks and reads.
"""
from __future__ import annotations

import copy
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from .passes.annotate import AnnotateDynamicSparsity, annotations_of
from .passes.attention import FuseAttention
from .passes.combine import CombineParallelMatmuls
from .passes.dense import DenseMatmulToPITKernels
from .passes.frontend import (ONNX_NAMES_ATTR, fold_shape_computations, import_annotations, import_onnx,
                              load_model)
from .passes.lower import DropUnusedPrimFuncs, LowerToPIT
from .passes.moe_import import lower_moe_layers
from .passes.propagate_padding import PropagatePadding, find_mask_input
from .passes.sparse_attention import SparseAttentionToPIT
from .passes.strips import ListStripsInProducer
from .errors import UserError
from .runtime.library import LIBRARY_SUFFIX, METADATA_FORMAT, library_digest
from .runtime.loader import check_input_shapes, flatten_outputs, host_input, inputs_by_name
from .target import build, device_for, make_target

META_SUFFIX = ".json"


def export_path(path) -> str:
    """Where ``CompiledModel.export(path)`` writes the library: ``path``, with ``.so`` appended
    unless it already ends in ``.so`` (as ``np.save`` appends ``.npy``: TVM picks the loader by
    the suffix). A ``UserError`` when its directory does not exist or ``path`` is a directory,
    so that ``pit-tvm compile -o`` can check it before compiling."""
    path = os.fspath(path)
    if not path.endswith(LIBRARY_SUFFIX):
        path += LIBRARY_SUFFIX
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise UserError(f"output {path}: the directory {parent} does not exist")
    if os.path.isdir(path):
        raise UserError(f"output {path}: is a directory; give a library file name, e.g. {path}/model.so")
    return path


def _dims(value_info) -> list:
    dims = []
    for d in value_info.type.tensor_type.shape.dim:
        dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?"))
    return dims


def _onnx_dtype(value_info) -> str:
    import onnx  # noqa: PLC0415

    return str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(value_info.type.tensor_type.elem_type)))


@dataclass
class CompiledModel:
    """A built model. ``run`` executes it here; ``export`` writes it for :func:`pit_tvm.runtime.load`."""

    executable: object
    target: tvm.target.Target
    inputs: list = field(default_factory=list)  # [{"name", "dtype", "shape"}] in call order
    outputs: list = field(default_factory=list)  # ONNX output names
    annotations: list = field(default_factory=list)  # what was annotated and why
    ir: tvm.IRModule | None = None  # the module after annotation (before lowering)
    lowered: tvm.IRModule | None = None  # the module that was built
    _vm: object = None

    @property
    def device(self):
        return device_for(self.target)

    def _machine(self):
        if self._vm is None:
            self._vm = relax.VirtualMachine(self.executable, self.device)
        return self._vm

    def run(self, inputs) -> list[np.ndarray]:
        """Run on ``{onnx input name: array}`` or a list/tuple of arrays in input order; returns the
        outputs as numpy arrays."""
        inputs = inputs_by_name([i["name"] for i in self.inputs], inputs)
        dev = self.device
        args = [tvm.runtime.tensor(host_input(i["name"], inputs[i["name"]], i["dtype"]), dev) for i in self.inputs]
        check_input_shapes(self.inputs, args)
        return flatten_outputs(self._machine()["main"](*args))

    def metadata(self) -> dict:
        return {
            "format": METADATA_FORMAT,
            "target": self.target.kind.name,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "annotations": self.annotations,
        }

    def export(self, path) -> str:
        """Write the shared library and its metadata (``+ '.json'``, with the library's SHA-256 that
        the loader checks); returns the library's path: ``path``, ``.so`` appended unless it ends
        in ``.so`` (:func:`export_path`)."""
        path = export_path(path)
        with self.target:
            self.executable.export_library(path)
        meta = dict(self.metadata(), library_sha256=library_digest(path))
        tmp = f"{path}{META_SUFFIX}.tmp"
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, path + META_SUFFIX)   # never a half-written metadata file
        return path




def fold_constants(mod: tvm.IRModule) -> tvm.IRModule:
    """Relax ``FoldConstant``; where the folded ``main`` calls a function the module lacks, ``mod``
    unfolded.  Why: on a ``dynamic_strided_slice`` (a Slice whose bounds are graph inputs) TVM
    0.27's FoldConstant leaves the binding of the legalised shape function without the function,
    and the build fails on the missing ``shape_func``."""
    folded = relax.transform.FoldConstant()(mod)
    defined = {gv.name_hint for gv in folded.functions}
    if all(gv.name_hint in defined for gv in relax.analysis.all_global_vars(folded["main"])):
        return folded
    return mod


def tensors_of_unknown_shape(mod: tvm.IRModule) -> list[str]:
    """The ONNX names of ``main``'s tensors whose shape the import left unknown (rank only)"""
    onnx_of = {str(v): str(k) for k, v in (mod.attrs or {}).get(ONNX_NAMES_ATTR, {}).items()}
    unknown = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            ty = binding.var.ty
            if isinstance(ty, relax.TensorType) and ty.shape is None and binding.var.name in onnx_of:
                unknown.append(onnx_of[binding.var.name])
    return unknown


def _positive_dims(name, shape) -> list[int]:
    """``shape`` (a list / tuple of positive integers) as ``[int]``, else an error naming the input
    and the bad dim (``-1``, ``None``, ``5.7``, a string: a static shape has none of these)."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"shapes[{name!r}] must be a list of positive ints, got {type(shape).__name__} {shape!r}")
    shape = list(shape)
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
            raise UserError(f"shapes[{name!r}] = {shape}: every dim must be a positive int (a static "
                            f"shape), got {d!r}")
    return [int(d) for d in shape]


def static_shapes(proto, shapes) -> dict:
    """Check ``{input name: shape}`` against the graph inputs; return it as ``{name: [int]}``.

    A shape must name a graph input, be a list of positive integers of its rank, and agree with
    its static dims; its symbolic (``dim_param``) dims are what it fixes."""
    if shapes is None:
        return {}
    if not isinstance(shapes, Mapping):
        raise TypeError(f"shapes= must be a dict {{input name: [dim, ...]}}, got {type(shapes).__name__} "
                        f"{shapes!r}")
    init = {t.name for t in proto.graph.initializer}
    graph_inputs = {i.name: _dims(i) for i in proto.graph.input if i.name not in init}
    out = {}
    for name, shape in shapes.items():
        if name not in graph_inputs:
            raise UserError(f"shapes: unknown input {name!r}; the model's inputs are {sorted(graph_inputs)}")
        dims = graph_inputs[name]
        shape = _positive_dims(name, shape)
        if len(shape) != len(dims) or any(isinstance(d, int) and d > 0 and d != s for d, s in zip(dims, shape)):
            raise UserError(f"shapes: {name!r} is {dims} in the model, cannot be {shape}")
        out[name] = shape
    return out


def symbolic_inputs(proto, fixed: dict) -> dict:
    """``{input name: dims}`` of the graph inputs with a symbolic (``dim_param`` or unnamed) dim
    that ``fixed`` (the checked ``shapes=``) does not fix"""
    init = {t.name for t in proto.graph.initializer}
    out = {}
    for value in proto.graph.input:
        dims = _dims(value)
        if value.name not in init and value.name not in fixed and any(not isinstance(d, int) or d <= 0 for d in dims):
            out[value.name] = dims
    return out


def tensors_of_data_dependent_shape(mod: tvm.IRModule, limit: int = 5) -> list[str]:
    """The ONNX names of (up to ``limit``) ``main`` tensors whose shape has a dim the import took
    from data (a ``Range`` over a computed bound, a reshape to a computed shape), not from the
    inputs' dims: over symbolic input dims TVM's build may not be able to compute it"""
    onnx_of = {str(v): str(k) for k, v in (mod.attrs or {}).get(ONNX_NAMES_ATTR, {}).items()}
    func = mod["main"]

    def dim_vars(ty) -> set[str]:
        shape = getattr(ty, "shape", None)
        if not isinstance(shape, relax.ShapeExpr):
            return set()
        return {v.name for d in shape.values for v in tvm.tirx.analysis.undefined_vars(d)}

    from_inputs = set().union(*(dim_vars(p.ty) for p in func.params))   # (compared by name)
    found = []
    for block in func.body.blocks:
        for binding in block.bindings:
            ty = binding.var.ty
            if not isinstance(ty, relax.TensorType) or binding.var.name not in onnx_of:
                continue
            if ty.shape is None:
                found.append(onnx_of[binding.var.name])
            elif dim_vars(ty) - from_inputs:
                found.append(onnx_of[binding.var.name])
            if len(found) >= limit:
                return found
    return found


def inputs_read_by_value(proto, tensor: str) -> list[str]:
    """The graph inputs whose values (not only their shapes: the walk stops at ``Shape`` /
    ``Size`` nodes) ``tensor`` is computed from: where its shape is data-dependent, fixing the
    inputs' shapes does not make it static"""
    producer = {out: node for node in proto.graph.node for out in node.output}
    inputs = {i.name for i in proto.graph.input} - {t.name for t in proto.graph.initializer}
    seen, stack, found = set(), [tensor], []
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in inputs:
            found.append(name)
            continue
        node = producer.get(name)
        if node is not None and node.op_type not in ("Shape", "Size"):
            stack.extend(i for i in node.input if i)
    return sorted(found)


def symbolic_dims_error(err: Exception, symbolic: dict, tensors=(), proto=None) -> Exception:
    """``err`` (the import or build failing over symbolic input dims) with what to do about it:
    the inputs' symbolic dims, the tensors whose shapes are computed from data, and the fix
    (``shapes=``).  A ``ValueError`` keeps its type (e.g. the importer's error naming the node)."""
    text = str(err).strip()
    first = text.splitlines()[0][:400] if text else type(err).__name__
    dims = ", ".join(f"{name} {dims}" for name, dims in symbolic.items())
    example = ", ".join(f"{name!r}: [{', '.join(str(d) if isinstance(d, int) and d > 0 else str(d or '?') for d in dims)}]"
                        for name, dims in symbolic.items())
    cli = " ".join(f"--shape {name}={'x'.join(str(d) if isinstance(d, int) and d > 0 else f'<{d or chr(63)}>' for d in dims)}"
                   for name, dims in symbolic.items())
    where = f"; the shapes of {list(tensors)} are computed from data" if tensors else ""
    by_value = inputs_read_by_value(proto, tensors[0]) if tensors and proto is not None else []
    if by_value:
        return ValueError(f"{first}\n(the shape of {tensors[0]!r} depends on the values of input(s) {by_value}, not "
                          "only on the inputs' shapes: pit-tvm needs every tensor's shape to follow from the "
                          "inputs' shapes, and shapes= cannot fix this one: size it by a dim instead (e.g. a "
                          "Range up to the sequence dim, the lengths applied as a mask))")
    message = (f"{first}\n(compiling over the symbolic dims of {dims}{where}: TVM cannot type this export's "
               f"shape arithmetic over symbolic dims. Fix them with shapes={{{example}}} (each name a size, e.g. "
               f"the padded batch and sequence length you run), or {cli} on the command line; the graph's shape "
               "arithmetic is then folded before the import)")
    if isinstance(err, ValueError):
        try:
            new = copy.copy(err)   # (its type and attributes, e.g. the node an import error names)
            new.args = (message,)
            return new
        except Exception:  # noqa: BLE001 - an exception type that does not copy: a plain ValueError
            pass
    return ValueError(message)


def compile_onnx(model, target="llvm", sparse=None, tuning_log=None, auto=True, shapes=None,
                 cuda_graph=False, expected_density=None, padding=None, sparse_attention=None,
                 sample_inputs=None) -> CompiledModel:
    """Compile an ONNX model (path or ``onnx.ModelProto``) with PIT for its dynamic sparsity.

    What is not an ONNX model with outputs (an empty file, other bytes, a directory), and a
    ``shapes`` / ``sparse`` value that is not of the documented form, is a
    :class:`~pit_tvm.errors.UserError` (``TypeError`` for the wrong container type) naming it.

    ``sparse``: explicit annotations by ONNX tensor name, ``{"hidden": (1, 64)}`` or ``["hidden"]``;
    ``auto``: also detect relu / mask / padding sources; ``tuning_log``: passed to the op layer.
    ``shapes``: ``{input name: shape}`` fixes the symbolic (``dim_param``) dims of those inputs, e.g.
    the padded batch of a variable-length workload: static shapes let the generic kernels
    (elementwise, softmax, layer norm) drop run-time index arithmetic. Without it symbolic dims
    stay symbolic.  ``cuda_graph`` (CUDA): run the model's static regions as CUDA graphs
    (:func:`pit_tvm.target.build`).  ``expected_density``: the fraction of rows the PIT matmuls
    of row sparsity (padding, masks) are expected to list, e.g. the mean of a sample batch's
    attention mask; the CUDA kernels' tile widths are planned for it (default: with ``padding=``
    and ``sample_inputs=``, the samples' real-token fraction, else
    :data:`pit_tvm.ops.matmul.PIT_EXPECTED_DENSITY`); ``annotations`` records it on those
    matmuls.  ``padding``: the name of the ``[batch, sequence]`` attention mask input (1 real
    token, 0 padding), or True for the one input named like it: the token-wise matmuls then run
    on the real tokens only
    (:class:`~pit_tvm.passes.PropagatePadding`), and **the outputs at padded positions are not
    computed** (compare on the real tokens only).  Needs the mask's shape static (``shapes=``).
    ``sample_inputs``: ``{input name: array}`` (or a list of them, or an ``.npz`` path) of typical
    inputs: onnxruntime computes on them the left operand of each matmul annotated for its
    activation sparsity (relu, ``sparse=`` without a micro-tile), and
    :func:`~pit_tvm.tuning.choose.choose_micro_tile` picks its micro-tile, or ``"dense"``, from that
    pattern with the target's measured latency model; ``annotations`` records the choice and why
    (:mod:`pit_tvm.tuning.sample_tiles`).
    """
    proto = load_model(model)
    original = proto     # (the samples run through the model as exported)
    tgt = make_target(target)
    fixed = static_shapes(proto, shapes)
    symbolic = symbolic_inputs(proto, fixed)   # what an import / build failure may be about
    # the export's shape arithmetic (Shape -> Gather -> Range / Expand / Reshape chains) as
    # constants where shapes= makes it static: TVM's importer fails on much of it otherwise
    proto = fold_shape_computations(proto, fixed)
    # MoE layers (HF Switch's expert chains, the dense-masked form, com.microsoft.MoE) as one
    # routed-expert op each (after the folding: a layer's shape arithmetic on other inputs is
    # then constant, and its subgraph can be checked on its own)
    proto, moe_notes = lower_moe_layers(proto, tgt, shapes=fixed, tuning_log=tuning_log)
    try:
        mod = import_onnx(proto, shape_dict=fixed or None, target=tgt, sparse_attention=sparse_attention)
    except Exception as err:
        if not symbolic:
            raise
        raise symbolic_dims_error(err, symbolic) from err
    # the records of the MoE layers and of the contrib ops converted at import (LongformerAttention)
    import_notes = moe_notes + import_annotations(mod)
    try:
        mod = fold_constants(mod)
    except Exception as err:
        unknown = tensors_of_unknown_shape(mod)
        if not unknown:
            if symbolic:
                raise symbolic_dims_error(err, symbolic, tensors_of_data_dependent_shape(mod), proto) from err
            raise
        raise ValueError(f"the shapes of {unknown} are only known at run time (computed from data, e.g. a "
                         "Range over a symbolic dim), and the build needs them: fix the inputs' symbolic dims "
                         "with shapes= (pit-tvm compile --shape NAME=DxD..)") from err
    imported = mod
    mod = CombineParallelMatmuls()(mod)   # Q, K, V: one GEMM (both builds)
    annotated = AnnotateDynamicSparsity(sparse=sparse, auto=auto)(mod)
    feeds = None      # (the sample inputs, read once)
    if sample_inputs is not None:
        from .passes.annotate import sparse_annotations  # noqa: PLC0415
        from .tuning.sample_tiles import choose_tiles_from_samples, sample_feeds  # noqa: PLC0415

        init = {t.name for t in original.graph.initializer}
        names = [i.name for i in original.graph.input if i.name not in init]
        feeds = sample_feeds(sample_inputs, names)
        given = {name for name, tile in sparse_annotations(sparse).items() if tile is not None}
        annotated = choose_tiles_from_samples(annotated, original, feeds, tgt, names, given)
    # the attention mask's padding propagated to the token-wise matmuls whose padded rows are not
    # needed; after the other sources: a matmul they annotate keeps its kernel
    if padding:
        annotated = PropagatePadding(padding)(annotated)
        if expected_density is None and feeds is not None:
            # (the samples' real-token fraction: what those matmuls plan their tiles for)
            mask = find_mask_input(annotated, padding)
            expected_density = round(float(np.mean([(f[mask] != 0).mean() for f in feeds])), 3)
    attention = annotated
    if sparse_attention is not False:
        if sparse_attention is not None and not isinstance(sparse_attention, str):
            raise TypeError(f"sparse_attention= must be None, False or a graph input name, got "
                            f"{type(sparse_attention).__name__} {sparse_attention!r}")
        # attention with a run-time mask: block index + sparse kernel (before the matmul passes)
        attention = SparseAttentionToPIT(tgt, mask_input=sparse_attention)(annotated)
    notes = annotations_of(attention) + import_notes
    try:
        lowered = LowerToPIT(target=tgt, tuning_log=tuning_log, expected_density=expected_density)(attention)
        notes = annotations_of(lowered) + import_notes   # (a matmul whose PIT lowering fell back: status dense)
    except Exception as err:  # the op layer (pit_tvm.ops.matmul) is not importable
        if "pit_tvm.ops" not in repr(err) and "emit_pit_matmul" not in repr(err):
            raise
        warnings.warn(f"PIT op layer unavailable ({err}); annotated matmuls stay dense")
        lowered = attention
        for n in notes:
            if n.get("status") == "pit":
                n["status"] = "dense"
                n["reason"] += "; op layer unavailable"
    # dense matmuls on the PIT kernels' dense twin (PIT-off builds too)
    lowered = DenseMatmulToPITKernels(tgt)(lowered)
    # a PIT matmul's strips index in the epilogue of the dense kernel producing its operand
    lowered = ListStripsInProducer()(lowered)
    lowered = FuseAttention(tgt)(lowered)   # (both builds)
    # one rows index per row mask (LowerToPIT emits the same call for each matmul it masks)
    lowered = relax.transform.EliminateCommonSubexpr()(lowered)
    lowered = DropUnusedPrimFuncs(relax.transform.DeadCodeElimination()(lowered))
    try:
        ex = build(lowered, tgt, cuda_graph=cuda_graph)
    except Exception as err:
        if not symbolic:
            raise
        raise symbolic_dims_error(err, symbolic, tensors_of_data_dependent_shape(imported), proto) from err
    if expected_density is not None:
        for n in notes:
            if n.get("status") == "pit" and str(n.get("source", "")).startswith(("padding:", "mask:")):
                n["expected_density"] = float(expected_density)
    init = {t.name for t in proto.graph.initializer}
    inputs = [{"name": i.name, "dtype": _onnx_dtype(i), "shape": fixed.get(i.name, _dims(i))}
              for i in proto.graph.input if i.name not in init]
    outputs = [o.name for o in proto.graph.output]
    return CompiledModel(ex, tgt, inputs, outputs, notes, annotated, lowered)
