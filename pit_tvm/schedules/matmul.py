"""Schedules of the PIT matmul and of its dense twin (the same schedule without SRead/SWrite).

One code path serves both: the dense schedule is the PIT schedule with no gather/scatter
stages, so "PIT vs dense" compares equal schedule quality. The stages SRead/SWrite inserted
(``A_sread``, ``B_sread``, ``C_zero``, ``C_swrite``) are placed with ordinary primitives:

CPU (llvm): rows kind -- the compact-position loop is serial and guarded, the N tiles run in
parallel, the gathered rows are staged in a local buffer per position tile::

    for io in M/BM (guarded: skip past count)       # BM compact rows
      A_sread[BM, K] <- A[ids[io*BM:...], :]         # gather (SRead), local
      parallel jo in N/BN:
        acc[BM, BN] = A_sread @ B[:, jo]             # vectorised over BN
        C[ids[...], jo] = cast(acc)                  # scatter (SWrite)

tiles kind -- strips of ``mr`` rows run in parallel; each strip walks only its non-zero k-tiles::

    parallel io in M/mr:                             # one strip = one index group
      for jo in N/BN:
        for ko in K/BK (guarded: skip past the strip's count):
          A_sread[mr, BK], B_sread[BK, BN] <- gathered through ids[offsets[io] + ...]
          acc[mr, BN] += A_sread @ B_sread

CUDA: the same loop nests with the position tile on blockIdx.x, N tiles on blockIdx.y, a
16x16 thread grid computing 4x4 outputs each, gathered tiles staged in shared memory and
accumulators in registers; CTAs past the count exit at once.
"""
from __future__ import annotations

import tvm
from tvm import tirx

from pit_tvm.schedules.sparse_access import guard_compact_loop, lower_pit
from pit_tvm.target import is_gpu

CPU_VEC = 16          # fp32 lanes per vector op on the host
CPU_BN = 64           # columns per parallel task
CPU_BM = 8            # compact rows per tile (rows kind)
CPU_BK = 16           # compact k positions per step (tiles kind, per micro-tile column)

GPU_BM, GPU_BN, GPU_BK = 64, 64, 16
GPU_TY, GPU_TX = 16, 16   # threads; each computes (BM/TY) x (BN/TX) outputs


def _has(sch, name):
    try:
        sch.get_sblock(name)
        return True
    except Exception:  # noqa: BLE001 - tvm raises a ScheduleError subclass
        return False


def _finish(sch, gpu):
    func = lower_pit(sch.mod[sch.func_working_on], gpu)
    return func.with_attr("tirx.is_scheduled", True)


class _Guard:
    """Arguments for guard_compact_loop without rebuilding a PitIndex from the function."""

    def __init__(self, offsets_name, micro):
        self.offsets = type("B", (), {"name": offsets_name})()
        self.micro = micro


def schedule_pit_matmul(sch, plan, target):
    mr, mk = plan.micro_tile
    if plan.kind == "rows":
        return (_gpu_rows if is_gpu(target) else _cpu_rows)(sch, plan)
    return (_gpu_tiles if is_gpu(target) else _cpu_tiles)(sch, plan)


def schedule_dense_matmul(sch, target):
    return (_gpu_rows if is_gpu(target) else _cpu_rows)(sch, None)


# ---------------------------------------------------------------- CPU
def _cpu_rows(sch, plan):
    mm = sch.get_sblock("matmul")
    i, j, k = sch.get_loops(mm)
    io, ii = sch.split(i, [None, CPU_BM])
    jo, ji = sch.split(j, [None, CPU_BN])
    sch.reorder(io, jo, k, ii, ji)
    sch.parallel(jo)
    sch.vectorize(ji)
    cast = sch.get_sblock("cast")
    sch.reverse_compute_at(cast, jo)
    if plan is not None:
        gather = sch.get_sblock("A_sread")
        sch.compute_at(gather, io)
        sch.set_scope(gather, 0, "local")
        sch.vectorize(sch.get_loops(gather)[-1])
        sch.set_scope(cast, 0, "local")
        sch.reverse_compute_at(sch.get_sblock("C_swrite"), jo)
        sch.vectorize(sch.get_loops(sch.get_sblock("C_swrite"))[-1])
        guard_compact_loop(sch, io, CPU_BM, _Guard("pit_offsets", plan.micro_tile[0]))
    sch.vectorize(sch.get_loops(cast)[-1])
    sch.decompose_reduction(mm, k)
    return _finish(sch, gpu=False)


def _cpu_tiles(sch, plan):
    mr, mk = plan.micro_tile
    bk = mk if mk > 1 else CPU_BK
    mm = sch.get_sblock("matmul")
    i, j, k = sch.get_loops(mm)
    io, ii = sch.split(i, [None, mr])
    jo, ji = sch.split(j, [None, CPU_BN])
    ko, ki = sch.split(k, [None, bk])
    sch.reorder(io, jo, ko, ki, ii, ji)
    sch.parallel(io)
    sch.vectorize(ji)
    for name in ("A_sread", "B_sread"):
        blk = sch.get_sblock(name)
        sch.compute_at(blk, ko)
        sch.set_scope(blk, 0, "local")
    cast = sch.get_sblock("cast")
    sch.reverse_compute_at(cast, jo)
    sch.vectorize(sch.get_loops(cast)[-1])
    guard_compact_loop(sch, ko, bk, _Guard("pit_offsets", mk), group_loop=io)
    sch.decompose_reduction(mm, ko)
    return _finish(sch, gpu=False)


# ---------------------------------------------------------------- CUDA
def _gpu_elementwise(sch, name):
    blk = sch.get_sblock(name)
    fused = sch.fuse(*sch.get_loops(blk))
    bx, tx = sch.split(fused, [None, 256])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


def _gpu_tile(sch, mm, i, j, k, bm, bn, bk):
    """Thread-block tile bm x bn over (i, j), 16x16 threads, k split by bk."""
    io, iy, ii = sch.split(i, [None, GPU_TY, bm // GPU_TY])
    jo, jx, ji = sch.split(j, [None, GPU_TX, bn // GPU_TX])
    ko, ki = sch.split(k, [None, bk])
    sch.reorder(io, jo, iy, jx, ko, ki, ii, ji)
    sch.bind(io, "blockIdx.x")
    sch.bind(jo, "blockIdx.y")
    sch.bind(iy, "threadIdx.y")
    sch.bind(jx, "threadIdx.x")
    return io, jo, iy, jx, ko


def _gpu_stage_shared(sch, name, at):
    blk = sch.get_sblock(name)
    sch.compute_at(blk, at)
    sch.set_scope(blk, 0, "shared")
    loops = sch.get_loops(blk)
    fused = sch.fuse(*loops[-2:])
    _, ty, tx = sch.split(fused, [None, GPU_TY, GPU_TX])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")


def _gpu_epilogue(sch, cast, jx, scatter):
    sch.reverse_compute_at(cast, jx)
    if scatter:
        sch.set_scope(cast, 0, "local")
        sch.reverse_compute_at(sch.get_sblock("C_swrite"), jx)


def _gpu_rows(sch, plan):
    mm = sch.get_sblock("matmul")
    i, j, k = sch.get_loops(mm)
    io, jo, iy, jx, ko = _gpu_tile(sch, mm, i, j, k, GPU_BM, GPU_BN, GPU_BK)
    sch.set_scope(mm, 0, "local")
    if plan is not None:
        _gpu_stage_shared(sch, "A_sread", ko)
    else:
        a_shared = sch.cache_read(mm, 0, "shared")
        sch.compute_at(a_shared, ko)
        loops = sch.get_loops(a_shared)
        _, ty, tx = sch.split(sch.fuse(*loops[-2:]), [None, GPU_TY, GPU_TX])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
    b_shared = sch.cache_read(mm, 1, "shared")
    sch.compute_at(b_shared, ko)
    loops = sch.get_loops(b_shared)
    _, ty, tx = sch.split(sch.fuse(*loops[-2:]), [None, GPU_TY, GPU_TX])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    _gpu_epilogue(sch, sch.get_sblock("cast"), jx, scatter=plan is not None)
    if plan is not None:
        guard_compact_loop(sch, io, GPU_BM, _Guard("pit_offsets", plan.micro_tile[0]))
    sch.decompose_reduction(mm, ko)
    return _finish(sch, gpu=True)


def _gpu_tiles(sch, plan):
    mr, mk = plan.micro_tile
    bm = mr if mr >= GPU_TY else mr
    bk = mk if mk > 1 else GPU_BK
    mm = sch.get_sblock("matmul")
    i, j, k = sch.get_loops(mm)
    ty = min(GPU_TY, mr)
    io, iy, ii = sch.split(i, [None, ty, mr // ty if mr % ty == 0 else 1])
    jo, jx, ji = sch.split(j, [None, GPU_TX * (GPU_TY // ty), 4])
    ko, ki = sch.split(k, [None, bk])
    sch.reorder(io, jo, iy, jx, ko, ki, ii, ji)
    sch.bind(io, "blockIdx.x")
    sch.bind(jo, "blockIdx.y")
    sch.bind(iy, "threadIdx.y")
    sch.bind(jx, "threadIdx.x")
    sch.set_scope(mm, 0, "local")
    threads_y, threads_x = ty, GPU_TX * (GPU_TY // ty)
    for name in ("A_sread", "B_sread"):
        blk = sch.get_sblock(name)
        sch.compute_at(blk, ko)
        sch.set_scope(blk, 0, "shared")
        loops = sch.get_loops(blk)
        depth = [i for i, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(ko))][0]
        fused = sch.fuse(*loops[depth + 1:])
        _, t_y, t_x = sch.split(fused, [None, threads_y, threads_x])
        sch.bind(t_y, "threadIdx.y")
        sch.bind(t_x, "threadIdx.x")
    sch.reverse_compute_at(sch.get_sblock("cast"), jx)
    guard_compact_loop(sch, ko, bk, _Guard("pit_offsets", mk), group_loop=io)
    sch.decompose_reduction(mm, ko)
    return _finish(sch, gpu=True)
