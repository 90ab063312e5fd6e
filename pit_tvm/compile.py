"""``compile_onnx``: ONNX model -> Relax (names kept) -> PIT passes -> build -> ``CompiledModel``.

Pipeline: :func:`~pit_tvm.passes.import_onnx` -> ``FoldConstant`` (so Gemm's transposed weights
become ``[K, N]`` constants) -> :class:`~pit_tvm.passes.AnnotateDynamicSparsity` ->
:class:`~pit_tvm.passes.LowerToPIT` -> :class:`~pit_tvm.passes.DenseMatmulToPITKernels` (the
remaining matmuls on the PIT kernels' dense twin: tensor-core tiles on CUDA, the CPU schedule) ->
:class:`~pit_tvm.passes.ListStripsInProducer` (a strips index in its producer's epilogue) ->
:class:`~pit_tvm.passes.FuseAttention` (sm_90a: softmax attention in one kernel) -> ``DeadCodeElimination``
-> :func:`pit_tvm.target.build` (``tvm.compile``; on CUDA it applies the dlight default schedules
to the other operators).

``CompiledModel.export(path)`` writes the library ``path`` plus ``path + ".json"`` (input names,
dtypes, shapes, output names, target, annotations), which :func:`pit_tvm.runtime.load` reads.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from .passes.annotate import AnnotateDynamicSparsity, annotations_of
from .passes.attention import FuseAttention
from .passes.combine import CombineParallelMatmuls
from .passes.dense import DenseMatmulToPITKernels
from .passes.frontend import ONNX_NAMES_ATTR, fold_shape_computations, import_onnx, load_model
from .passes.lower import DropUnusedPrimFuncs, LowerToPIT
from .passes.strips import ListStripsInProducer
from .runtime.loader import check_input_shapes, flatten_outputs, host_input
from .target import build, device_for, make_target

META_SUFFIX = ".json"


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

    def run(self, inputs: dict) -> list[np.ndarray]:
        """Run on ``{onnx input name: array}``; returns the outputs as numpy arrays."""
        missing = [i["name"] for i in self.inputs if i["name"] not in inputs]
        if missing:
            raise KeyError(f"missing inputs {missing}; expected {[i['name'] for i in self.inputs]}")
        dev = self.device
        args = [tvm.runtime.tensor(host_input(i["name"], inputs[i["name"]], i["dtype"]), dev) for i in self.inputs]
        check_input_shapes(self.inputs, args)
        return flatten_outputs(self._machine()["main"](*args))

    def metadata(self) -> dict:
        return {
            "format": "pit-tvm/1",
            "target": self.target.kind.name,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "annotations": self.annotations,
        }

    def export(self, path) -> str:
        """Write the shared library ``path`` and its metadata ``path + '.json'``."""
        path = str(path)
        with self.target:
            self.executable.export_library(path)
        with open(path + META_SUFFIX, "w") as f:
            json.dump(self.metadata(), f, indent=1)
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


def static_shapes(proto, shapes) -> dict:
    """Check ``{input name: shape}`` against the graph inputs; return it as ``{name: [int]}``.

    A shape must name a graph input, have its rank, and agree with its static dims; its symbolic
    (``dim_param``) dims are what it fixes."""
    if not shapes:
        return {}
    init = {t.name for t in proto.graph.initializer}
    graph_inputs = {i.name: _dims(i) for i in proto.graph.input if i.name not in init}
    out = {}
    for name, shape in shapes.items():
        if name not in graph_inputs:
            raise ValueError(f"shapes: unknown input {name!r}; the model's inputs are {sorted(graph_inputs)}")
        dims = graph_inputs[name]
        shape = [int(d) for d in shape]
        if len(shape) != len(dims) or any(isinstance(d, int) and d > 0 and d != s for d, s in zip(dims, shape)):
            raise ValueError(f"shapes: {name!r} is {dims} in the model, cannot be {shape}")
        out[name] = shape
    return out


def compile_onnx(model, target="llvm", sparse=None, tuning_log=None, auto=True, shapes=None,
                 cuda_graph=False, expected_density=None) -> CompiledModel:
    """Compile an ONNX model (path or ``onnx.ModelProto``) with PIT for its dynamic sparsity.

    ``sparse``: explicit annotations by ONNX tensor name, ``{"hidden": (1, 64)}`` or ``["hidden"]``;
    ``auto``: also detect relu / mask / padding sources; ``tuning_log``: passed to the op layer.
    ``shapes``: ``{input name: shape}`` fixes the symbolic (``dim_param``) dims of those inputs, e.g.
    the padded batch of a variable-length workload: static shapes let the generic kernels
    (elementwise, softmax, layer norm) drop run-time index arithmetic. Without it symbolic dims
    stay symbolic.  ``cuda_graph`` (CUDA): run the model's static regions as CUDA graphs
    (:func:`pit_tvm.target.build`).  ``expected_density``: the fraction of rows the PIT matmuls
    of row sparsity (padding, masks) are expected to list, e.g. the mean of a sample batch's
    attention mask; the CUDA kernels' tile widths are planned for it (default
    :data:`pit_tvm.ops.matmul.PIT_EXPECTED_DENSITY`).
    """
    proto = load_model(model)
    tgt = make_target(target)
    fixed = static_shapes(proto, shapes)
    proto = fold_shape_computations(proto, fixed)
    mod = import_onnx(proto, shape_dict=fixed or None)
    try:
        mod = fold_constants(mod)
    except Exception as err:
        unknown = tensors_of_unknown_shape(mod)
        if not unknown:
            raise
        raise ValueError(f"the shapes of {unknown} are only known at run time (computed from data, e.g. a "
                         "Range over a symbolic dim), and the build needs them: fix the inputs' symbolic dims "
                         "with shapes= (pit-tvm compile --shape NAME=DxD..)") from err
    mod = CombineParallelMatmuls()(mod)   # Q, K, V: one GEMM (both builds)
    annotated = AnnotateDynamicSparsity(sparse=sparse, auto=auto)(mod)
    notes = annotations_of(annotated)
    try:
        lowered = LowerToPIT(target=tgt, tuning_log=tuning_log, expected_density=expected_density)(annotated)
    except Exception as err:  # the op layer (pit_tvm.ops.matmul) is not importable
        if "pit_tvm.ops" not in repr(err) and "emit_pit_matmul" not in repr(err):
            raise
        warnings.warn(f"PIT op layer unavailable ({err}); annotated matmuls stay dense")
        lowered = annotated
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
    ex = build(lowered, tgt, cuda_graph=cuda_graph)
    init = {t.name for t in proto.graph.initializer}
    inputs = [{"name": i.name, "dtype": _onnx_dtype(i), "shape": fixed.get(i.name, _dims(i))}
              for i in proto.graph.input if i.name not in init]
    outputs = [o.name for o in proto.graph.output]
    return CompiledModel(ex, tgt, inputs, outputs, notes, annotated, lowered)
