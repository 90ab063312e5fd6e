"""The PIT kernels derived from the TensorIR workload by SRead / SWrite (:mod:`pit_tvm.schedules.sparse_access`)
and scheduled for the CPU or as CUDA SIMT kernels (no tensor cores), and their dense twins.

These are the paths where SRead / SWrite are *derived* by the rule primitives on the workload;
the tensor-core kernels (:mod:`.backends`) implement the same gathers and scatters by hand.
"""
from __future__ import annotations

import tvm
from tvm import tirx

from pit_tvm.schedules.sparse_access import PitIndex, sread, swrite
from pit_tvm.target import is_gpu, make_target

from .plan import MatmulPlan, matmul_workload


def simt_matmul_func(plan: MatmulPlan, dtype: str, out_dtype: str, target) -> tirx.PrimFunc:
    """The PIT kernel derived from :func:`matmul_workload` by ``sread``/``swrite``, scheduled
    for the CPU or as a CUDA SIMT kernel (no tensor cores)."""
    if not (is_gpu(target) and plan.kind == "rows"):
        return _simt_matmul_func(plan, dtype, out_dtype, target, wide_extents=False)
    return _with_extents_that_lower(
        lambda wide: _simt_matmul_func(plan, dtype, out_dtype, target, wide_extents=wide), plan.k, plan.n, target)


def _simt_matmul_func(plan: MatmulPlan, dtype: str, out_dtype: str, target, wide_extents: bool):
    k, n = plan.k, plan.n
    mr, mk = plan.micro_tile
    func = matmul_workload(k, n, dtype, out_dtype, wide_extents=wide_extents)
    sch = tvm.s_tir.Schedule(tvm.IRModule({"matmul": func}))
    sch.work_on("matmul")
    m = func.params[0].shape[0]
    groups, capacity = plan.index_sizes(m)
    if plan.kind == "rows":
        index = PitIndex.create("pit", capacity, groups, micro=mr)
        sch = sread(sch, "matmul", "A", "vi", index)
        sch = swrite(sch, "cast", "C", "vi", index)
    else:
        index = PitIndex.create("pit", capacity, groups, micro=mk, group_axis="vi", group_micro=mr)
        a_name, b_name = "A", "B"
        if is_gpu(target) or mr > 1:
            # Pad rows to whole strips first (dlight's pad_einsum), so the kernel has
            # constant-size tiles and no predicate in its main loop (on the CPU: tile-sized
            # buffers, see pit_tvm.schedules.matmul._pad_rows_to_tile)
            from pit_tvm.schedules.matmul import tiles_padding

            mm = sch.get_sblock("matmul")
            sch.pad_einsum(mm, tiles_padding(plan))
            a_name, b_name = (sch.get(mm).reads[n].source.name for n in (0, 1))   # "A"/"A_pad", ...
        sch = sread(sch, "matmul", a_name, "vk", index)
        sch = sread(sch, "matmul", b_name, "vk", index)
    from pit_tvm.schedules.matmul import schedule_pit_matmul

    return schedule_pit_matmul(sch, plan, target)


def dense_matmul_func(k: int, n: int, dtype: str, out_dtype: str, target) -> tirx.PrimFunc:
    """The dense kernel with the same schedule (the fair baseline and the fallback)."""
    from pit_tvm.schedules.matmul import schedule_dense_matmul

    def make(wide):
        func = matmul_workload(k, n, dtype, out_dtype, wide_extents=wide)
        sch = tvm.s_tir.Schedule(tvm.IRModule({"matmul": func}))
        sch.work_on("matmul")
        return schedule_dense_matmul(sch, target)

    return _with_extents_that_lower(make, k, n, target) if is_gpu(target) else make(False)


def _with_extents_that_lower(make, k: int, n: int, target) -> tirx.PrimFunc:
    """``make(wide_extents)`` (the CUDA SIMT rows / dense kernel): int32 K, N where they lower,
    else int64 ones (:func:`matmul_workload`).  Padding K always needs int64; padding N alone
    only for some N (N = 1, 30, 63, 65 need it; 100, 130, 160 do not), so there the int32
    kernel is lowered first, and the kernels that built before keep their code."""
    from pit_tvm.schedules.matmul import GPU_BK, gpu_pads_k_or_n

    if not gpu_pads_k_or_n(k, n):
        return make(False)
    if k % GPU_BK == 0:
        func = make(False)
        if _lowers(func, target):
            return func
    return make(True)


def _lowers(func: tirx.PrimFunc, target) -> bool:
    """Whether TVM's TIR pipeline for ``target`` lowers ``func`` (what :func:`build` runs
    before code generation); False on the int32 / int64 mismatch of a padded extent."""
    target = make_target(target)
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    mod = tvm.tirx.transform.BindTarget(target.with_host(tvm.target.Target("llvm")))(mod)
    try:
        tvm.tirx.get_default_tir_pipeline(target)[0](mod)
    except TypeError:
        return False
    return True

