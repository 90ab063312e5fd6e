"""Tensor-core PIT kernel for the "tiles" kind: the reduction axis K permuted per strip of rows.

Micro-tile ``(mr, mk)`` with ``mk < K`` (e.g. ``(32, 64)`` blocks, ``(32, 1)`` along K). Index
layout (:func:`pit_tvm.index.tile_index_func`, ``group="row"``): ``G = ceil(M / mr)`` strips;
strip ``g``'s non-zero k-tiles are ``ids[offsets[g]:offsets[g+1]]`` (ascending tile-column ids,
unused tail ``-1``).  Workload (:func:`tiles_gather_matmul_func`)::

    tiles_gather_matmul(A[M, K], B[K, N], offsets: int32[G+1], ids: int32[G*K/mk], C[M, N])
    cnt_g   = offsets[g+1] - offsets[g]                         # read on the device only
    col(q)  = ids[offsets[g] + q // mk] * mk + q % mk           # compact position q -> column
    C[g*mr + i, :] = sum_{q < cnt_g*mk} A[g*mr + i, col(q)] * B[col(q), :]   (fp32 accumulation)

Every row of C is written (a strip with no tile writes zeros); nothing is scattered.  As a
TensorIR workload the strip is a batch axis: ``Ag[g, i, q]`` (SRead of A: row ``g*mr+i``,
gathered columns), ``Bg[g, q, j]`` (SRead of B: gathered rows), a batched matmul into
``Acc[g, i, j]`` and a ``store`` epilogue guarded by ``g*mr + i < M``.  Gathers past the
strip's count read zero (``if_then_else``; index reads clamped), so the unscheduled
workload is exact on llvm with its worst-case loop.

The schedule (:func:`schedule_tiles_gather_matmul`): one CTA per (strip, BN columns) with
``BM = mr`` (mr in 16/32/64/128: one k list per CTA), warps tiling mr x BN, k loop over the
strip's compact positions in steps of BK:

* ``A_gather`` (SRead): for ``mk >= 8`` (fp16/bf16: 16 bytes) the gathered A columns are
  contiguous 16-byte runs -> vectorised, predicated zero-fill cp.async. For smaller ``mk``
  (e.g. ``mk = 1``: BK different columns per step) the workload built with ``a_compact``
  (what ``sparse_matmul`` uses, see :func:`needs_compact_a`) first gathers A into a
  workspace in a kernel of its own (``A_compact``), then reads it like the 16-byte case;
  without it, a 2-byte element gather inside the GEMM (synchronous loads).
* ``B_gather`` (SRead): gathered rows of B, contiguous -> 16-byte cp.async.
* ldmatrix + mma.sync m16n8k16 (the fp16/bf16 intrinsics of :mod:`.tensorcore`), fp32
  accumulators in registers, multi-stage software pipeline over the k steps.
* epilogue: accumulators -> fp32 shared C tile -> cast -> vectorised stores (rows >= M skipped).
* The k loop's bound is **read on the device**: the scheduled loop has the worst-case extent
  ``K / BK``; :func:`set_dynamic_k_extent` (an IR post-process applied by the scheduler)
  replaces it by ``ceil(cnt_g * mk / BK)``, so a strip does work in proportion to its
  non-zero tiles and the host never reads the index.

Requirements (``ValueError`` otherwise, see :func:`check_tiles_config`): fp16/bf16 in,
``mr in (16, 32, 64, 128)``, ``K % mk == 0``, ``K % BK == 0``, ``mk % BK == 0`` or ``BK % mk
== 0``, ``N % BN == 0``.  M is free (rows past M of the last strip read row M-1, never stored).
Build with :func:`pit_tvm.target.build` (it turns on ``tirx.use_async_copy``, which cp.async needs).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import tvm
from tvm import s_tir, tirx
from tvm.script import tirx as T

from pit_tvm.index.tiles import strip_column, strip_positions
from pit_tvm.schedules.tensorcore import (
    MAX_SMEM_BYTES,
    SMEM_SCOPE,
    _bind_cta,
    _check_dtypes,
    _check_mult16,
    _fitting,
    _intrin_names,
    _rewrite_loops,
    _split_cta_n_k,
    _split_mma_tiles,
    _stage_epilogue,
    _stage_shared,
    _tensorize_mma,
    _tile_smem_bytes,
    build,
    dtype_bytes,
    max_smem_bytes,
)

__all__ = [
    "TilesConfig",
    "COMPACT_PAD",
    "needs_compact_a",
    "SUPPORTED_MR",
    "tiles_gather_matmul_func",
    "schedule_tiles_gather_matmul",
    "apply_tiles_schedule",
    "tiles_workload_params",
    "check_tiles_config",
    "valid_tiles_configs",
    "tiles_smem_bytes",
    "set_dynamic_k_extent",
    "build",
]

SUPPORTED_MR = (16, 32, 64, 128)
#: compact positions the ``A_compact`` block zero-fills past a strip's count: a multiple of
#: every candidate block_k, so the tiles kernel's last k step reads zeros (no per-element guard)
COMPACT_PAD = 64
DYN_K_ATTR = "pit.tiles_dynamic_k"
STRIP_ATTR = "pit.tiles_strip"


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TilesConfig:
    """Knobs of the tiles tensor-core schedule (block_m is the micro-tile's mr).

    block_n/block_k: CTA tile along N / compact-K step (multiples of 16); warp_m/warp_n:
    warp tile (multiples of 16, warp_m divides mr); stages: software pipeline depth over the
    k steps (1 = none, >1 = multi-buffered, cp.async); smem_pad: elements appended to every
    shared row; epilogue_vec: elements per vector store of C.
    """

    block_n: int = 128
    block_k: int = 32
    warp_m: int = 32
    warp_n: int = 32
    stages: int = 3
    smem_pad: int = 8
    epilogue_vec: int = 4

    def warps(self, mr: int) -> int:
        return (mr // self.warp_m) * (self.block_n // self.warp_n)

    def threads(self, mr: int) -> int:
        return self.warps(mr) * 32

    def name(self) -> str:
        return (f"n{self.block_n}k{self.block_k} w{self.warp_m}x{self.warp_n} "
                f"s{self.stages}")

    def as_dict(self) -> dict:
        return asdict(self)


def tiles_smem_bytes(config: TilesConfig, mr: int, in_dtype: str = "float16") -> int:
    return _tile_smem_bytes(config, mr, in_dtype)


def needs_compact_a(micro_tile, in_dtype: str) -> bool:
    """True when the micro-tile's A runs are narrower than 16 bytes (e.g. ``mk = 1``): the
    CUDA path builds the tiles workload with ``a_compact`` (A gathered by a kernel of its own)."""
    return _a_vec(int(micro_tile[1]), in_dtype) == 1


def _a_vec(mk: int, in_dtype: str) -> int:
    """Elements per A-gather copy: 16 bytes when a micro-tile holds whole 16-byte runs."""
    vec = 16 // dtype_bytes(in_dtype)
    return vec if mk % vec == 0 else 1


def check_tiles_config(k: int, n: int, micro_tile, in_dtype: str, config: TilesConfig,
                       max_smem: int = MAX_SMEM_BYTES["sm_90"],
                       out_dtype: str = "float32", a_compact: bool = False) -> None:
    """Raise ValueError when ``config`` cannot serve a (K, N, micro_tile) problem
    (``a_compact``: A gathered by the workload's ``A_compact`` kernel first)."""
    c = config
    mr, mk = (int(x) for x in micro_tile)
    _check_dtypes(in_dtype, out_dtype)
    if mr not in SUPPORTED_MR:
        raise ValueError(f"micro-tile rows mr={mr} must be one of {SUPPORTED_MR} "
                         f"(one strip = one CTA row tile)")
    if mk <= 0 or mk >= k or k % mk:
        raise ValueError(f"micro-tile width mk={mk} must divide K={k} and be < K")
    _check_mult16(c, ("block_n", "block_k", "warp_m", "warp_n"))
    if mr % c.warp_m or c.block_n % c.warp_n:
        raise ValueError(f"CTA tile {mr}x{c.block_n} is not a multiple of the warp tile "
                         f"{c.warp_m}x{c.warp_n}")
    if k % c.block_k:
        raise ValueError(f"K={k} must be a multiple of block_k={c.block_k}")
    if mk % c.block_k and c.block_k % mk:
        raise ValueError(f"mk={mk} and block_k={c.block_k}: one must divide the other")
    if n % c.block_n:
        raise ValueError(f"N={n} must be a multiple of block_n={c.block_n}")
    if c.stages < 1:
        raise ValueError("stages must be >= 1")
    threads = c.threads(mr)
    if not 32 <= threads <= 1024:
        raise ValueError(f"{threads} threads per block")
    vec = 16 // dtype_bytes(in_dtype)
    if c.smem_pad % vec:
        raise ValueError(f"smem_pad={c.smem_pad} must keep rows 16-byte aligned (multiple of {vec})")
    avec = vec if a_compact else _a_vec(mk, in_dtype)
    if a_compact and c.block_k > COMPACT_PAD:
        raise ValueError(f"block_k={c.block_k} > COMPACT_PAD={COMPACT_PAD}")
    if (mr * c.block_k) % (threads * avec):
        raise ValueError(f"A tile ({mr * c.block_k} elements) is not a multiple of threads x {avec}")
    if (c.block_k * c.block_n) % (threads * vec):
        raise ValueError(f"B tile ({c.block_k * c.block_n} elements) is not a multiple of "
                         f"threads x {vec}")
    if c.epilogue_vec not in (1, 2, 4, 8) or c.block_n % c.epilogue_vec:
        raise ValueError(f"epilogue_vec={c.epilogue_vec}")
    if (mr * c.block_n) % (threads * c.epilogue_vec):
        raise ValueError("C tile is not a multiple of threads x epilogue_vec")
    need = tiles_smem_bytes(c, mr, in_dtype)
    if need > max_smem:
        raise ValueError(f"needs {need} bytes of shared memory > {max_smem}")


# --------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------
def tiles_gather_matmul_func(k: int, n: int, micro_tile, in_dtype: str = "float16",
                             out_dtype: str = "float32", a_compact: bool = False) -> tirx.PrimFunc:
    """The unscheduled PIT tiles matmul (module docstring); ``M`` symbolic int64.

    Parameters ``(a, b, offsets, ids, c)`` with ``offsets: int32[ceil(M/mr)+1]`` and
    ``ids: int32[ceil(M/mr) * K/mk]``.  Builds and runs as is on llvm.

    ``a_compact`` (for ``mk`` narrower than 16 bytes, see :func:`needs_compact_a`): SRead of A
    as a kernel of its own. Block ``A_compact`` writes ``Ac[g*mr + i, q] = A[g*mr + i, col(q)]``
    for ``q < cnt_g * mk`` and zeros up to ``roundup(cnt_g * mk, COMPACT_PAD)`` into a global
    workspace; the GEMM's ``A_gather`` then reads contiguous runs of ``Ac`` (16-byte cp.async).
    Why: inside the GEMM an ``mk = 1`` gather is a 2-byte synchronous load per element on the
    critical path (docs/design/measurements.md#tensor-core-kernels); as its own kernel every load
    is independent.
    """
    _check_dtypes(in_dtype, out_dtype)
    mr, mk = (int(x) for x in micro_tile)
    K, N = int(k), int(n)
    if mr <= 0 or mk <= 0 or K % mk:
        raise ValueError(f"micro-tile {mr}x{mk} must be positive with K={K} a multiple of mk")
    KT = K // mk
    zero = tirx.const(0, in_dtype)

    def n_valid(OFF, vg):
        return strip_positions(OFF, vg, mk)

    def n_padded(OFF, vg):
        """n_valid rounded up to COMPACT_PAD: A_compact writes zeros up to there"""
        return (n_valid(OFF, vg) + (COMPACT_PAD - 1)) // COMPACT_PAD * COMPACT_PAD

    def column(OFF, IDS, M, vg, vq):
        return strip_column(OFF, IDS, vg, vq, mk, T.Cast("int32", (M + mr - 1) // mr * KT - 1))

    @T.prim_func(s_tir=True)
    def func(a: T.handle, b: T.handle, offsets: T.handle, ids: T.handle, c: T.handle):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        M = T.int64()
        A = T.match_buffer(a, (M, K), in_dtype)
        B = T.match_buffer(b, (K, N), in_dtype)
        OFF = T.match_buffer(offsets, ((M + mr - 1) // mr + 1,), "int32")
        IDS = T.match_buffer(ids, ((M + mr - 1) // mr * KT,), "int32")
        C = T.match_buffer(c, (M, N), out_dtype)
        Ag = T.sblock_alloc_buffer((T.Cast("int32", (M + mr - 1) // mr), mr, K), in_dtype)
        Ac = T.sblock_alloc_buffer((M, K) if a_compact else (1, 1), in_dtype)
        if a_compact:
            for g, i, q in T.grid(T.Cast("int32", (M + mr - 1) // mr), mr, K):
                with T.sblock("A_compact"):
                    vg, vi, vq = T.axis.remap("SSS", [g, i, q])
                    T.reads(OFF[vg:vg + 2], IDS[0:(M + mr - 1) // mr * KT], A[0:M, 0:K])
                    T.writes(Ac[T.Cast("int64", vg * mr + vi), vq])
                    if vq < n_padded(OFF, vg) and T.Cast("int64", vg * mr + vi) < M:
                        Ac[T.Cast("int64", vg * mr + vi), vq] = T.if_then_else(
                            n_valid(OFF, vg) > vq,
                            A[T.Cast("int64", vg * mr + vi), column(OFF, IDS, M, vg, vq)], zero)
        Bg = T.sblock_alloc_buffer((T.Cast("int32", (M + mr - 1) // mr), K, N), in_dtype)
        Acc = T.sblock_alloc_buffer((T.Cast("int32", (M + mr - 1) // mr), mr, N), "float32")
        for g, i, q in T.grid(T.Cast("int32", (M + mr - 1) // mr), mr, K):
            with T.sblock("A_gather"):
                vg, vi, vq = T.axis.remap("SSS", [g, i, q])
                T.reads(OFF[vg:vg + 2], IDS[0:(M + mr - 1) // mr * KT], A[0:M, 0:K])
                T.writes(Ag[vg, vi, vq])
                if a_compact:
                    # gathered by A_compact; its padded tail holds zeros, past it read zero
                    Ag[vg, vi, vq] = T.if_then_else(
                        n_padded(OFF, vg) > vq, Ac[T.min(T.Cast("int64", vg * mr + vi), M - 1), vq], zero)
                else:
                    Ag[vg, vi, vq] = T.if_then_else(
                        n_valid(OFF, vg) > vq,
                        A[T.min(T.Cast("int64", vg * mr + vi), M - 1), column(OFF, IDS, M, vg, vq)], zero)
        for g, q, j in T.grid(T.Cast("int32", (M + mr - 1) // mr), K, N):
            with T.sblock("B_gather"):
                vg, vq, vj = T.axis.remap("SSS", [g, q, j])
                T.reads(OFF[vg:vg + 2], IDS[0:(M + mr - 1) // mr * KT], B[0:K, vj])
                T.writes(Bg[vg, vq, vj])
                Bg[vg, vq, vj] = T.if_then_else(n_valid(OFF, vg) > vq, B[column(OFF, IDS, M, vg, vq), vj], zero)
        for g, i, j, q in T.grid(T.Cast("int32", (M + mr - 1) // mr), mr, N, K):
            with T.sblock("matmul"):
                vg, vi, vj, vq = T.axis.remap("SSSR", [g, i, j, q])
                with T.init():
                    Acc[vg, vi, vj] = T.float32(0)
                Acc[vg, vi, vj] = Acc[vg, vi, vj] + T.Cast("float32", Ag[vg, vi, vq]) * T.Cast(
                    "float32", Bg[vg, vq, vj])
        for g, i, j in T.grid(T.Cast("int32", (M + mr - 1) // mr), mr, N):
            with T.sblock("store"):
                vg, vi, vj = T.axis.remap("SSS", [g, i, j])
                T.reads(Acc[vg, vi, vj])
                T.writes(C[T.Cast("int64", vg * mr + vi), vj])
                if T.Cast("int64", vg * mr + vi) < M:
                    C[T.Cast("int64", vg * mr + vi), vj] = T.Cast(out_dtype, Acc[vg, vi, vj])

    return func.with_attr("pit.workload",
                          f"tiles_gather_matmul_{mr}x{mk}_k{K}_n{N}_{in_dtype}_{out_dtype}"
                          f"{'_acompact' if a_compact else ''}")



# --------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------
def _workload_params(func: tirx.PrimFunc):
    params = list(func.params)
    if len(params) != 5:
        raise ValueError("not a tiles_gather_matmul workload (expected 5 parameters)")
    a, b, c = (params[i].ty for i in (0, 1, 4))
    return int(b.shape[0]), int(b.shape[1]), str(a.dtype), str(c.dtype)


def _micro_tile_of(func: tirx.PrimFunc):
    tag = str(func.attrs["pit.workload"]) if func.attrs and "pit.workload" in func.attrs else ""
    if not tag.startswith("tiles_gather_matmul_"):
        raise ValueError("not a tiles_gather_matmul workload (missing pit.workload)")
    mr, mk = tag.split("_")[3].split("x")
    return int(mr), int(mk)


def schedule_tiles_gather_matmul(func: tirx.PrimFunc, config: TilesConfig,
                                 arch: str = "sm_90") -> tirx.PrimFunc:
    """Schedule :func:`tiles_gather_matmul_func` for CUDA tensor cores (module docstring).

    Raises ValueError when ``config`` does not fit (see :func:`check_tiles_config`).
    """
    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    apply_tiles_schedule(sch, config, arch)
    out = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    return set_dynamic_k_extent(out)


def tiles_workload_params(func: tirx.PrimFunc):
    """(K, N, in_dtype, out_dtype, (mr, mk), a_compact) of a :func:`tiles_gather_matmul_func`
    workload"""
    k, n, in_dtype, out_dtype = _workload_params(func)
    return k, n, in_dtype, out_dtype, _micro_tile_of(func), str(func.attrs["pit.workload"]).endswith("_acompact")


def apply_tiles_schedule(sch: s_tir.Schedule, config: TilesConfig, arch: str = "sm_90") -> None:
    """The schedule primitives of :func:`schedule_tiles_gather_matmul`, applied in place to
    ``sch`` (its ``"main"``, the unscheduled workload): usable on a MetaSchedule traced
    schedule.  Does *not* apply :func:`set_dynamic_k_extent` (an IR post-process) nor set
    ``tirx.is_scheduled``.  Raises ValueError for a config that does not fit (before touching
    ``sch``)."""
    sch.work_on("main")
    k, n, in_dtype, out_dtype, (mr, mk), a_compact = tiles_workload_params(sch.mod["main"])
    c = config
    check_tiles_config(k, n, (mr, mk), in_dtype, c,
                       max_smem_bytes(arch), out_dtype, a_compact)
    names = _intrin_names(in_dtype)
    vec = 16 // dtype_bytes(in_dtype)
    avec = vec if a_compact else _a_vec(mk, in_dtype)
    warps = c.warps(mr)

    mm = sch.get_sblock("matmul")
    store = sch.get_sblock("store")
    a_g = sch.get_sblock("A_gather")
    b_g = sch.get_sblock("B_gather")

    # ---- 16x16x16 mma tiles; strip g -> blockIdx.x, N tiles -> blockIdx.y
    (g, i, j, q), outer = _split_mma_tiles(sch, mm)
    i1, i2 = sch.split(i, [mr // c.warp_m, c.warp_m // 16])
    j0, j1, j2, k0, k1 = _split_cta_n_k(sch, j, q, n, k, c)
    sch.reorder(g, j0, i1, j1, k0, k1, i2, j2)
    sch.annotate(g, STRIP_ATTR, 1)
    sch.annotate(k0, DYN_K_ATTR, tirx.IntImm("int64", mk))
    sch.annotate(k0, DYN_K_ATTR + ".bk", tirx.IntImm("int64", c.block_k))
    ty = _bind_cta(sch, g, j0, i1, j1)

    # ---- accumulators: warp registers -> shared C tile (fp32) -> cast + guarded stores
    c_w = _stage_epilogue(sch, outer, store, ty, j0, warps, c.epilogue_vec)

    # ---- A_compact (mk narrower than 16 bytes): its own kernel, one CTA per (strip, 256
    # compact positions), a thread per position over the strip's rows
    if a_compact:
        blk = sch.get_sblock("A_compact")
        cg, ci, cq = sch.get_loops(blk)
        cq0, cq1 = sch.split(cq, [None, 256])
        sch.reorder(cg, cq0, cq1, ci)
        sch.bind(sch.fuse(cg, cq0), "blockIdx.x")
        sch.bind(cq1, "threadIdx.x")
        sch.unroll(ci)

    # ---- SRead: gathered A columns / B rows -> shared, per k step
    for blk, v in ((a_g, avec), (b_g, vec)):
        sch.set_scope(blk, 0, SMEM_SCOPE)
        _stage_shared(sch, blk, k0, warps, v if v > 1 else None, c.smem_pad)

    # ---- shared -> warp fragments (ldmatrix), mma.sync, fill, store; software pipeline
    _tensorize_mma(sch, mm, outer, c_w, a_g, b_g, k0, k1, names, c.stages, batched=True)


def set_dynamic_k_extent(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Replace the extent of the k loop annotated ``pit.tiles_dynamic_k`` (worst case K/BK)
    by ``ceil(cnt_g * mk / BK)``, ``cnt_g = offsets[g+1] - offsets[g]`` read on the device,
    ``g`` the loop annotated ``pit.tiles_strip`` (blockIdx.x)."""
    offsets = func.params[2]
    strip = []
    done = []

    def on_for(stmt, visit):
        ann = stmt.annotations
        if STRIP_ATTR in ann:
            strip.append(stmt.loop_var)
            ann = {k_: v for k_, v in ann.items() if k_ != STRIP_ATTR}
            return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, visit(stmt.body),
                            stmt.thread_binding, ann, stmt.step, stmt.span)
        if DYN_K_ATTR not in ann:
            return None
        if not strip:
            raise ValueError("dynamic k loop outside the strip loop")
        mk = int(ann[DYN_K_ATTR])
        bk = int(ann[DYN_K_ATTR + ".bk"])
        ann = {k_: v for k_, v in ann.items() if not k_.startswith(DYN_K_ATTR)}
        gv = strip[-1]
        g32 = gv if str(gv.ty.dtype) == "int32" else tirx.Cast("int32", gv)
        cnt = (tirx.BufferLoad(offsets, [g32 + 1]) - tirx.BufferLoad(offsets, [g32]))
        dt = str(stmt.loop_var.ty.dtype)
        steps = tirx.floordiv(cnt * mk + (bk - 1), bk)
        # a variable bound outside the loop (not the loads themselves): the software
        # pipeline's analyzer can then prove its in-loop predicates, so the cp.async
        # wait counts stay compile-time constants
        nsteps = tirx.Var("pit_k_steps", dt)
        done.append(bk)
        loop = tirx.For(stmt.loop_var, stmt.min, nsteps, stmt.kind, visit(stmt.body),
                        stmt.thread_binding, ann, stmt.step, stmt.span)
        return tirx.SeqStmt([
            tirx.Bind(nsteps, steps if dt == "int32" else tirx.Cast(dt, steps)), loop])

    body = _rewrite_loops(func.body, on_for)
    if not done:
        raise ValueError("no loop annotated pit.tiles_dynamic_k")
    return func.with_body(body)


# --------------------------------------------------------------------------------------
# Design space
# --------------------------------------------------------------------------------------
_CANDIDATES = (
    # first = the default of sparse_matmul (a guess until the H100 probe ranks them): the
    # widest N tile keeps a thin (mr = 32) strip's tensor cores fed per byte of gathered A
    TilesConfig(block_n=256, warp_n=64, stages=3),                       # 32x64 warps
    TilesConfig(),                                                       # n128 k32, 32x32 warps
    TilesConfig(stages=4),
    TilesConfig(stages=2),
    TilesConfig(stages=1),
    TilesConfig(block_k=64, stages=3),
    TilesConfig(block_n=256, warp_n=64, stages=4),
    TilesConfig(block_n=128, warp_n=64, stages=4),
    TilesConfig(block_n=64, stages=4),
    TilesConfig(block_n=256, block_k=64, warp_n=64, stages=3),
    TilesConfig(block_n=128, warp_m=16, warp_n=64, stages=3),
    TilesConfig(block_n=256, warp_m=64, warp_n=64, stages=3),
    TilesConfig(block_n=128, warp_m=64, warp_n=64, stages=4),
    TilesConfig(block_n=128, block_k=16, stages=4),
    # mr = 16 strips: fewer warps or a deeper k step keep the A tile >= one copy per thread
    TilesConfig(block_n=128, block_k=64, warp_m=16, warp_n=32, stages=3),
    TilesConfig(block_n=128, block_k=32, warp_m=16, warp_n=64, stages=4),
    TilesConfig(block_n=256, block_k=64, warp_m=16, warp_n=64, stages=3),
    TilesConfig(block_n=64, block_k=64, warp_m=16, warp_n=32, stages=4),
)


def valid_tiles_configs(k: int, n: int, micro_tile, dtype: str = "float16",
                        arch: str = "sm_90", a_compact: bool = False) -> list[TilesConfig]:
    """The candidate configs that fit a (K, N, micro_tile) problem, best guess first."""
    max_smem = max_smem_bytes(arch)
    return _fitting(_CANDIDATES,
                    lambda cfg: check_tiles_config(k, n, micro_tile, dtype, cfg, max_smem,
                                                   a_compact=a_compact))
