"""Targets, devices and the one build entry point every stage uses.

TVM 0.27 wants dict targets ("llvm" needs ``num-cores`` for MetaSchedule, CUDA needs an
``arch`` when no GPU is visible) and reads ``Target.current()`` inside the CUDA compile
callback, so every build goes through :func:`build` here.
"""
from __future__ import annotations

import os
import re

import tvm
from tvm import tirx

#: the H100's arch with its arch-specific features (``a``): wgmma needs it; code built for it
#: runs on sm_90 devices only (use "cuda:sm_80" or "cuda:sm_90" for portable mma.sync kernels)
DEFAULT_CUDA_ARCH = "sm_90a"


def make_target(target) -> tvm.target.Target:
    """Normalise ``"llvm"``/``"cpu"``/``"cuda"``/``"cuda:sm_80"``/dict/Target to a Target.
    ``"llvm"`` is this machine's CPU (``mcpu``: its vector width; a library built for it runs
    on CPUs with the same features), a dict such as ``{"kind": "llvm", "mcpu": "x86-64-v3"}``
    another."""
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, dict):
        return tvm.target.Target(target)
    if not isinstance(target, str):
        raise TypeError(f"target must be a str, dict or tvm.target.Target, got {type(target).__name__}")
    kind, _, arch = target.partition(":")
    if kind in ("llvm", "cpu"):
        # this machine's CPU (its vector width: AVX-512 / AVX2 / NEON); a dict target picks another
        return tvm.target.Target({"kind": "llvm", "num-cores": os.cpu_count() or 1,
                                  "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
    if kind == "cuda":
        return tvm.target.Target({"kind": "cuda", "arch": arch or DEFAULT_CUDA_ARCH})
    raise ValueError(f"unknown target {target!r}: use 'llvm' or 'cuda' (optionally 'cuda:sm_80')")


def arch_number(arch: str) -> int:
    """``sm_90a`` -> 90, ``sm_80`` -> 80; -1 for anything else.  (dlight's ``check_sm_version``
    reads ``sm_90a`` as -1 and so drops tensor cores.)"""
    match = re.fullmatch(r"sm_(\d+)[a-z]?", str(arch))
    return int(match.group(1)) if match else -1


def sm_version(target) -> int:
    """The CUDA target's compute capability as an int (-1 when not CUDA or no arch)."""
    tgt = make_target(target)
    return arch_number(tgt.attrs.get("arch", "")) if tgt.kind.name == "cuda" else -1


def cuda_arch(target) -> str:
    """The CUDA target's arch (``"sm_90a"``), :data:`DEFAULT_CUDA_ARCH` where it names none."""
    return str(make_target(target).attrs.get("arch", DEFAULT_CUDA_ARCH))


def is_gpu(target) -> bool:
    return make_target(target).kind.name == "cuda"


def device_for(target, index: int = 0):
    """The runtime device that runs code built for ``target``."""
    return tvm.cuda(index) if is_gpu(target) else tvm.cpu(index)


def cuda_schedule_rules() -> list:
    """The dlight rules for the operators no PIT or tensor-core kernel took, in order: TVM's
    CUDA defaults with :class:`~pit_tvm.schedules.row_reduction.RowReduction` ahead of
    ``GeneralReduction`` (softmax / layer norm over short static rows) and
    :class:`~pit_tvm.schedules.elementwise.VectorizedElementwise` ahead of ``Fallback``, and
    :class:`~pit_tvm.schedules.small_matmul.SmallMatmulTensorization` ahead of ``Matmul``
    (tensor cores for attention's small batched matmuls); ``Matmul`` itself is
    :class:`~pit_tvm.schedules.small_matmul.NumericArchMatmul` (it reads ``sm_90a``)."""
    from tvm.s_tir import dlight as dl  # noqa: PLC0415

    from pit_tvm.schedules.elementwise import VectorizedElementwise  # noqa: PLC0415
    from pit_tvm.schedules.row_reduction import RowReduction  # noqa: PLC0415
    from pit_tvm.schedules.small_matmul import NumericArchMatmul, SmallMatmulTensorization  # noqa: PLC0415

    return [SmallMatmulTensorization(), NumericArchMatmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), RowReduction(),
            dl.gpu.GeneralReduction(), VectorizedElementwise(), dl.gpu.Fallback()]


def cuda_relax_pipeline(tgt: tvm.target.Target) -> tvm.transform.Pass:
    """TVM 0.27's CUDA Relax pipeline with :func:`cuda_schedule_rules` as its dlight stage, and
    reshapes into model outputs made views (:func:`~pit_tvm.passes.output_views.ReshapeOutputsAsViews`).
    Small integer powers become multiplies first (:func:`~pit_tvm.passes.integer_power.
    IntegerPowerToMultiply`): CUDA code is compiled with ``--use_fast_math``, whose ``powf`` is
    NaN for a negative base; half-precision reductions accumulate in float32
    (:func:`~pit_tvm.passes.half_reductions.HalfReductionsInFloat32`); a large tensor's reduction to
    one value runs rows first (:func:`~pit_tvm.passes.split_reductions.SplitWholeTensorReductions`)."""
    from tvm.relax.backend.cuda import pipeline as cuda  # noqa: PLC0415

    passes = (cuda_schedule_passes(tgt) + cuda.dataflow_lower_passes(tgt) + cuda.finalize_passes(tgt))
    return tvm.transform.Sequential(passes, name="pit_cuda_pipeline")


def cuda_schedule_passes(tgt: tvm.target.Target) -> list:
    """The first stage of :func:`cuda_relax_pipeline`: legalization, fusion and the dlight
    schedules (:func:`cuda_schedule_rules`); after it every PrimFunc is GPU-scheduled TIR, with no
    vector access to a ``bool`` buffer (:func:`~pit_tvm.passes.bool_vectors.ScalarBoolAccesses`)."""
    from tvm.relax.backend.cuda import pipeline as cuda  # noqa: PLC0415
    from tvm.s_tir import dlight as dl  # noqa: PLC0415

    from pit_tvm.passes.bool_vectors import ScalarBoolAccesses  # noqa: PLC0415
    from pit_tvm.passes.half_reductions import HalfReductionsInFloat32  # noqa: PLC0415
    from pit_tvm.passes.integer_power import IntegerPowerToMultiply  # noqa: PLC0415
    from pit_tvm.passes.output_views import ReshapeOutputsAsViews  # noqa: PLC0415
    from pit_tvm.passes.split_reductions import SplitWholeTensorReductions  # noqa: PLC0415

    legalize = [p for p in cuda.legalize_passes(tgt) if p.info.name != "ApplyDefaultSchedule"]
    return ([IntegerPowerToMultiply, HalfReductionsInFloat32, SplitWholeTensorReductions]
            + cuda.library_dispatch_passes(tgt) + legalize
            + [dl.ApplyDefaultSchedule(*cuda_schedule_rules()), ScalarBoolAccesses, ReshapeOutputsAsViews])


@tvm.transform.module_pass(opt_level=0, name="MarkShapeFuncsNoAlias")
def mark_shape_funcs_noalias(mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
    """Mark the shape functions of Relax's ``VMShapeLower`` ``tirx.noalias`` (they take the VM's
    shape heap alone, so it holds).  Why: LLVM codegen drops ``noalias`` from every function of a
    module that holds one PrimFunc without it, and the CPU kernels then lose their register
    tiles (docs/design/measurements.md#cpu)."""
    for gv, func in list(mod.functions_items()):
        if (isinstance(func, tirx.PrimFunc) and gv.name_hint.startswith("shape_func")
                and func.attrs is not None and "tirx.is_host_func" in func.attrs and "tirx.noalias" not in func.attrs):
            mod[gv] = func.with_attr("tirx.noalias", True)
    return mod


def cpu_relax_pipeline(tgt: tvm.target.Target) -> tvm.transform.Pass:
    """TVM 0.27's CPU Relax pipeline, erf first rewritten to its fast form
    (:func:`~pit_tvm.passes.fast_erf.ErfToFastErf`) and half-precision reductions accumulating in
    float32 (:func:`~pit_tvm.passes.half_reductions.HalfReductionsInFloat32`), whole-tensor reductions rows first
    (:func:`~pit_tvm.passes.split_reductions.SplitWholeTensorReductions`), after legalization exp as vectorisable
    arithmetic (:func:`~pit_tvm.passes.vector_exp.ExpToVectorExp`) and :class:`~pit_tvm.schedules.
    cpu_batched_matmul.CPUBatchedMatmul`, :class:`~pit_tvm.schedules.cpu_row_reduction.
    CPURowReduction` and :class:`~pit_tvm.schedules.cpu_elementwise.CPUElementwise` applied
    (TVM's pipeline schedules nothing there), then :func:`mark_shape_funcs_noalias`."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu  # noqa: PLC0415
    from tvm.s_tir import dlight as dl  # noqa: PLC0415

    from pit_tvm.schedules.cpu_batched_matmul import CPUBatchedMatmul  # noqa: PLC0415
    from pit_tvm.passes.fast_erf import ErfToFastErf  # noqa: PLC0415
    from pit_tvm.passes.bool_vectors import ScalarBoolAccesses  # noqa: PLC0415
    from pit_tvm.passes.half_reductions import HalfReductionsInFloat32  # noqa: PLC0415
    from pit_tvm.schedules.cpu_elementwise import CPUElementwise  # noqa: PLC0415
    from pit_tvm.schedules.cpu_row_reduction import CPURowReduction  # noqa: PLC0415
    from pit_tvm.passes.output_views import ReshapeOutputsAsViews  # noqa: PLC0415
    from pit_tvm.passes.split_reductions import SplitWholeTensorReductions  # noqa: PLC0415
    from pit_tvm.passes.vector_exp import ExpToVectorExp  # noqa: PLC0415

    passes = ([ErfToFastErf, HalfReductionsInFloat32, SplitWholeTensorReductions] + cpu.library_dispatch_passes(tgt)
              + cpu.legalize_passes(tgt)
              + [ExpToVectorExp, dl.ApplyDefaultSchedule(CPUBatchedMatmul(), CPURowReduction(), CPUElementwise()),
                 ReshapeOutputsAsViews]
              + cpu.dataflow_lower_passes(tgt) + cpu.finalize_passes(tgt) + [mark_shape_funcs_noalias])
    return tvm.transform.Sequential(passes, name="pit_cpu_pipeline")


def build(mod, target, cuda_graph: bool = False):
    """``tvm.compile`` with the target current (the CUDA callback reads it).

    On CUDA ``tirx.use_async_copy`` is on, so pipelined shared-memory copies become cp.async,
    and the Relax pipeline is :func:`cuda_relax_pipeline`.  ``cuda_graph`` (CUDA): Relax's
    ``RewriteCUDAGraph`` captures the static regions of the model into CUDA graphs (one launch
    instead of a kernel launch per operator; the PIT index never goes to the host, so the
    sparse kernels are captured too).  On the CPU the Relax pipeline is
    :func:`cpu_relax_pipeline`.
    """
    tgt = make_target(target)
    if tgt.kind.name != "cuda":
        with tgt, tvm.transform.PassContext(opt_level=3):
            return tvm.compile(mod, target=tgt, relax_pipeline=cpu_relax_pipeline(tgt))
    config = {"tirx.use_async_copy": True, "relax.backend.use_cuda_graph": bool(cuda_graph)}
    with tgt, tvm.transform.PassContext(opt_level=3, config=config):
        return tvm.compile(mod, target=tgt, relax_pipeline=cuda_relax_pipeline(tgt))
