"""Schedules of the PIT matmul and of its dense twin (the same schedule without SRead/SWrite).

One code path serves both: the dense schedule is the PIT schedule with no gather/scatter
stages, so "PIT vs dense" compares equal schedule quality. The stages SRead/SWrite inserted
(``A_sread``, ``B_sread``, ``C_zero``, ``C_swrite``) are placed with ordinary primitives:

CPU (llvm): rows kind (and the dense twin, without the index) -- one parallel region over the
N panels; each task packs its panel of B, then walks the compact positions (guarded), the
gathered rows staged in a local buffer per position tile::

    parallel jo in N/BN:
      B_panel[K, BN] <- B[:, jo]                     # packed contiguously (zero past N)
      for io in M/BM (guarded: skip past count)     # BM compact rows
        A_sread[BM, K] <- A[ids[io*BM:...], :]       # gather (SRead), local
        acc[BM, BN] = A_sread @ B_panel              # registers, vectorised over BN
        C[ids[...], jo] = cast(acc)                  # scatter (SWrite)

tiles kind -- strips of ``mr`` rows run in parallel; each strip walks only its non-zero k-tiles::

    parallel io in M/mr:                             # one strip = one index group
      for jo in N/BN:
        for ko in K/BK (guarded: skip past the strip's count):
          A_sread[mr, BK], B_sread[BK, BN] <- gathered through ids[offsets[io] + ...]
          acc[mr, BN] += A_sread @ B_sread

CUDA (dlight's SIMT matmul structure): M is padded to the CTA tile (``pad_einsum``) so tiles
are constant-sized; position tiles on blockIdx.x, N tiles on blockIdx.y, 16x16 threads with
4x4 outputs each, accumulators in registers. The SRead gather is inlined into the cooperative
global->shared load; SWrite stores straight from registers; CTAs past the count return at once.
"""
from __future__ import annotations

import math

from tvm.s_tir.dlight.gpu.matmul import auto_inline_consumers, auto_inline_producers

from pit_tvm.schedules.sparse_access import guard_compact_loop, lower_pit
from pit_tvm.target import is_gpu

CPU_BN = 64           # columns per parallel task
CPU_BM = 4            # compact rows per tile (rows kind): 4 x 64 fp32 accumulators fit AVX-512 registers
CPU_BK = 16           # compact k positions per step (tiles kind, per micro-tile column)
CPU_GATHER_LANES = 64  # widest vector of the rows kind's K-wide gather (four AVX-512 fp32 vectors)

GPU_BM, GPU_BN, GPU_BK = 64, 64, 16
INDEX_OFFSETS = "pit_offsets"   # the index buffers ops/matmul/derived.py declares: PitIndex.create("pit", ...)
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


def schedule_pit_matmul(sch, plan, target):
    """Schedule the SRead/SWrite-rewritten matmul of ``plan`` for ``target``."""
    if plan.kind == "rows":
        return (_gpu_rows if is_gpu(target) else _cpu_rows)(sch, plan)
    return (_gpu_tiles if is_gpu(target) else _cpu_tiles)(sch, plan)


def schedule_dense_matmul(sch, target):
    """The same schedule without the PIT stages (``plan=None``)."""
    return (_gpu_rows if is_gpu(target) else _cpu_rows)(sch, None)


# ---------------------------------------------------------------- CPU
def _pad_rows_to_tile(sch, mm, rows: int, gather=None):
    """Pad the matmul's M (symbolic) to whole ``rows``-row tiles; the padded accumulator is
    consumed directly.  The padded A (with a ``gather`` block (SRead): that gather, inlined into
    the padding) is returned to be staged per row tile.
    Why: a row split of a symbolic M guards each row (``i < m``), and that guard keeps TVM
    from compacting a tile's buffers: the accumulator stayed an ``[m, BN]`` buffer per
    parallel task, the gathered rows ``[m, K]`` (docs/design/measurements.md#cpu).  For the
    same reason N is padded to whole :data:`CPU_BN` tiles where they do not divide it (zero past
    N): a guarded last column tile kept the accumulator ``[m, N]``, several times slower.  Returns ``(padded A block, padded B block or None)``: the padded B is left to be
    packed per column panel (:func:`_cpu_rows`)."""
    n = int(sch.get(mm).iter_vars[1].dom.extent)
    sch.pad_einsum(mm, [rows, CPU_BN if n % CPU_BN else 1, 1])
    for consumer in sch.get_consumers(mm):
        if sch.get(consumer).name_hint.endswith("_pad"):
            sch.compute_inline(consumer)
    padded = [p for p in sch.get_producers(mm) if sch.get(p).name_hint.endswith("_pad")]
    padded_b = [p for p in padded if sch.get(p).name_hint.startswith("B")]
    padded_a = [p for p in padded if not sch.get(p).name_hint.startswith("B")]
    b_pad = padded_b[0] if padded_b else None
    if gather is not None:
        sch.compute_inline(gather)
    (staged,) = padded_a
    return staged, b_pad


def _cpu_rows(sch, plan):
    """One parallel region over the :data:`CPU_BN`-column panels of B: each task packs its
    panel ``[K, BN]`` contiguously (the padded B where N is padded), then walks every
    :data:`CPU_BM`-row tile (for PIT: the listed rows, gathered per tile) with a ``[BM, BN]``
    register accumulator.  Why: a parallel loop inside the row loop started M/BM parallel
    regions per call, each ending in a barrier (2048 x 384 x 384 fp32 on 2 busy cores: 3x
    numpy's time); the packed panel is read with unit stride and stays in L2."""
    mm = sch.get_sblock("matmul")
    a_tile, b_pad = _pad_rows_to_tile(sch, mm, CPU_BM, sch.get_sblock("A_sread") if plan is not None else None)
    i, j, k = sch.get_loops(mm)
    io, ii = sch.split(i, [None, CPU_BM])
    jo, ji = sch.split(j, [None, CPU_BN])
    sch.reorder(jo, io, k, ii, ji)
    sch.parallel(jo)
    sch.vectorize(ji)
    panel = b_pad if b_pad is not None else sch.cache_read(mm, 1, "global")
    sch.compute_at(panel, jo)
    sch.vectorize(sch.get_loops(panel)[-1])
    cast = sch.get_sblock("cast")
    sch.reverse_compute_at(cast, io)
    # the row tile [BM, K] staged unguarded (rows past M: zero) -- read in place, the inner
    # loop guarded every A element on its row
    sch.compute_at(a_tile, io)
    sch.set_scope(a_tile, 0, "local")
    _vectorize_in_chunks(sch, sch.get_loops(a_tile)[-1], int(sch.get(mm).iter_vars[2].dom.extent))
    if plan is not None:
        sch.set_scope(cast, 0, "local")
        sch.reverse_compute_at(sch.get_sblock("C_swrite"), io)
        sch.vectorize(sch.get_loops(sch.get_sblock("C_swrite"))[-1])
        guard_compact_loop(sch, io, CPU_BM, INDEX_OFFSETS, plan.micro_tile[0])
    sch.vectorize(sch.get_loops(cast)[-1])
    sch.set_scope(mm, 0, "local")      # the [BM, BN] accumulator tile, in registers
    sch.unroll(ii)
    init = sch.decompose_reduction(mm, k)
    sch.vectorize(sch.get_loops(init)[-1])
    return _finish(sch, gpu=False)


def gather_lanes(k: int) -> int:
    """Vector lanes of the CPU rows kind's K-wide gather: the largest power of two dividing K,
    at most :data:`CPU_GATHER_LANES` (1 for an odd K: a scalar loop)."""
    return math.gcd(k, CPU_GATHER_LANES)


def _vectorize_in_chunks(sch, loop, k: int):
    """Vectorise the K loop of a gather in chunks of :func:`gather_lanes` lanes.  Why: one
    K-lane vector makes LLVM's build time grow with K (about a minute at K = 11008) and fails
    past it (K = 32768: ``lanes < 32768``; 40000: scalable vector indices; 65537: a crash)."""
    lanes = gather_lanes(k)
    if lanes == 1:
        return
    if lanes < k:
        _, loop = sch.split(loop, [None, lanes])
    sch.vectorize(loop)


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
    for crop in sch.get_consumers(mm):     # (the crop of the row padding: the cast reads the tile)
        if sch.get(crop).name_hint != "cast":
            sch.compute_inline(crop)
    for name in ("A_sread", "A_pad_sread", "B_sread"):
        if _has(sch, name):
            blk = sch.get_sblock(name)
            sch.compute_at(blk, ko)
            sch.set_scope(blk, 0, "local")
            auto_inline_producers(sch, blk)      # the padded A, read inside the gather
    cast = sch.get_sblock("cast")
    sch.reverse_compute_at(cast, jo)
    sch.vectorize(sch.get_loops(cast)[-1])
    guard_compact_loop(sch, ko, bk, INDEX_OFFSETS, mk, group_loop=io)
    sch.set_scope(mm, 0, "local")      # the strip's [mr, BN] accumulator tile
    sch.decompose_reduction(mm, ko)
    return _finish(sch, gpu=False)


# ---------------------------------------------------------------- CUDA
def _gpu_fetch(sch, mm, index, ko, tx):
    """Cooperative load of the matmul's ``index``-th input tile into shared memory.

    The producers (dlight's padding block and, for PIT, the SRead gather) are inlined into
    the fetch, so the gather happens on the global->shared load itself.
    """
    blk = sch.cache_read(mm, index, "shared")
    n_loops = len(sch.get_loops(blk))
    sch.compute_at(blk, ko, preserve_unit_loops=True)
    loops = sch.get_loops(blk)[-n_loops:]
    _, ty_loop, tx_loop = sch.split(sch.fuse(*loops), [None, GPU_TY, tx])
    sch.bind(ty_loop, "threadIdx.y")
    sch.bind(tx_loop, "threadIdx.x")
    auto_inline_producers(sch, blk)
    return blk


def _gpu_rows_tile_n(n: int) -> tuple[int, int]:
    """(threads along N, CTA tile width) of the SIMT rows schedule: narrow N gets a narrower
    CTA tile (padding N far past itself trips buffer compaction)."""
    tx = min(GPU_TX, -(-n // 4))
    return tx, tx * (GPU_BN // GPU_TX)


def gpu_pads_k_or_n(k: int, n: int) -> bool:
    """Whether the CUDA SIMT rows schedule pads K or N to its tiles (where the workload may
    need int64 K, N: :func:`pit_tvm.ops.matmul.matmul_workload`'s ``wide_extents``)."""
    return k % GPU_BK != 0 or n % _gpu_rows_tile_n(n)[1] != 0


def _bind_thread_tiles(sch, mm, ty, rows, tx, cols, bk):
    """Tile the matmul block ``mm``'s (i, j, k): CTAs of ``ty * rows`` x ``tx * cols`` outputs
    (blockIdx.x / y), a thread (threadIdx.y / x) computing ``rows`` x ``cols`` of them over
    K steps of ``bk``; return the loops ``(io, jx, ko)`` (CTA rows, thread columns, K steps)."""
    i, j, k = sch.get_loops(mm)
    io, iy, ii = sch.split(i, [None, ty, rows])
    jo, jx, ji = sch.split(j, [None, tx, cols])
    ko, ki = sch.split(k, [None, bk])
    sch.reorder(io, jo, iy, jx, ko, ki, ii, ji)
    sch.bind(io, "blockIdx.x")
    sch.bind(jo, "blockIdx.y")
    sch.bind(iy, "threadIdx.y")
    sch.bind(jx, "threadIdx.x")
    return io, jx, ko


def _gpu_rows(sch, plan):
    """dlight-style SIMT matmul over padded compact positions; SRead in the shared fetch,
    SWrite from registers."""
    mm = sch.get_sblock("matmul")
    n = int(sch.get(mm).iter_vars[1].dom.extent)
    tx, bn = _gpu_rows_tile_n(n)
    # Pad M (symbolic) to the tile: no predicate in the main loop, constant-size tiles.
    sch.pad_einsum(mm, [GPU_BM, bn, GPU_BK])
    io, jx, ko = _bind_thread_tiles(sch, mm, GPU_TY, GPU_BM // GPU_TY, tx, GPU_BN // GPU_TX, GPU_BK)
    acc = sch.cache_write(mm, 0, "local")
    sch.reverse_compute_at(acc, jx, preserve_unit_loops=True)
    _gpu_fetch(sch, mm, 0, ko, tx)
    _gpu_fetch(sch, mm, 1, ko, tx)
    # Epilogue: crop and cast inlined into the register write-back; the SWrite scatter (an
    # indirect store cannot be inlined into it) reads the registers directly instead.
    auto_inline_consumers(sch, acc)
    if plan is not None:
        scatter = sch.get_sblock("C_swrite")
        sch.compute_inline(acc)
        sch.reverse_compute_at(scatter, jx, preserve_unit_loops=True)
        guard_compact_loop(sch, io, GPU_BM, INDEX_OFFSETS, plan.micro_tile[0])
    sch.decompose_reduction(mm, ko)
    return _finish(sch, gpu=True)


def _gpu_tiles_shape(plan):
    """(threads_y, threads_x, rows per thread, cols per thread, BK) for a strip of mr rows."""
    mr, mk = plan.micro_tile
    if mr % GPU_TY == 0:
        ty, tx = GPU_TY, GPU_TX        # 256 threads, each rows x 4 outputs
    else:
        ty, tx = 1, 32                 # thin strips: one warp per 128-column tile
    return ty, tx, mr // ty, 4, (mk if mk > 1 else GPU_BK)


def tiles_padding(plan):
    """pad_einsum factors (i, j, k) of the matmul block for the tiles schedules (CPU, GPU).

    Only M (symbolic) is padded, to whole strips. Padding N would add a padded copy of B that
    cannot be inlined into the B gather (its rows are read through the index) and would
    run on the host.
    """
    return [plan.micro_tile[0], 1, 1]


def _gpu_tiles(sch, plan):
    """One CTA per (strip of mr rows, N tile); the strip's non-zero k-tiles are gathered into
    shared memory (A_sread: mr x BK, B_sread: BK x BN) and the k loop stops at the strip's count."""
    mr, mk = plan.micro_tile
    ty, tx, rows, cols, bk = _gpu_tiles_shape(plan)
    mm = sch.get_sblock("matmul")
    io, jx, ko = _bind_thread_tiles(sch, mm, ty, rows, tx, cols, bk)
    # Accumulators in registers; the crop of the row padding is inlined into the cast, which
    # stores from registers (inlining the cast into a cache_write stage loses its N bound).
    sch.set_scope(mm, 0, "local")
    for crop in sch.get_consumers(mm):
        if sch.get(crop).name_hint != "cast":
            sch.compute_inline(crop)
    gathers = [n for n in ("A_sread", "A_pad_sread", "B_sread", "B_pad_sread") if _has(sch, n)]
    for name in gathers:
        blk = sch.get_sblock(name)
        sch.set_scope(blk, 0, "shared")   # before compute_at: the region then spans all threads
        sch.compute_at(blk, ko, preserve_unit_loops=True)
        loops = sch.get_loops(blk)
        depth = [n for n, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(ko))][0]
        _, t_y, t_x = sch.split(sch.fuse(*loops[depth + 1:]), [None, ty, tx])
        sch.bind(t_y, "threadIdx.y")
        sch.bind(t_x, "threadIdx.x")
        auto_inline_producers(sch, blk)      # the padding blocks read inside the gather
    sch.reverse_compute_at(sch.get_sblock("cast"), jx, preserve_unit_loops=True)
    guard_compact_loop(sch, ko, bk, INDEX_OFFSETS, mk, group_loop=io)
    sch.decompose_reduction(mm, ko)
    return _finish(sch, gpu=True)
