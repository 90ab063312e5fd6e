"""Tensor-core dense-tile schedule for the PIT row-gather matmul (CUDA, sm_80 / sm_90).

Workload (:func:`row_gather_matmul_func`), the layout the index kernels produce for the
micro-tile (1, K) = whole rows of A::

    row_gather_matmul(A[M, K], B[K, N], offsets: int32[2], ids: int32[M], [bias: N,] C[M, N])
    count = offsets[1]                      # read on the device only
    ids[0:count] ascending ids of the non-zero rows of A, ids[count:] == -1
    C[ids[p], :] = epilogue(A[ids[p], :] @ B)   for p < count    (fp32 accumulation)
    C[r, :]      = 0                             for every r not in ids[0:count]

``epilogue`` is the optional ``+ bias[n]`` and ``relu``.  Rows that are not listed are
zeroed by a *complement scatter* inside the same PrimFunc: a ``row_listed`` block finds
out, by a binary search in ``ids[0:count]``, whether a row is listed, and ``zero_fill``
writes zeros only to the rows that are not.  On CUDA that is a separate, cheap kernel
(one launch, ``(M - count) * N`` stores plus ``M`` binary searches over ``ids``); it
writes rows disjoint from the matmul kernel's rows, so their order does not matter.

The PIT part (:func:`schedule_row_gather_matmul`):

* ``row_index`` / ``A_gather`` (SRead): the thread block tile covers ``BM`` *compacted*
  row positions ``p``; the tile's row ids are staged once in shared memory and each row of
  the A tile is gathered global->shared with 16-byte vector copies (cp.async when
  ``stages > 1``) into a padded shared buffer.
* ``matmul``: dense BM x BN x BK tiles, ldmatrix + mma.sync m16n8k16 (fp16 or bf16 in,
  fp32 accumulators in registers), B also cp.async'ed to padded shared memory, multi-stage
  software pipeline over the K tiles (``software_pipeline_stage/order/async_stages``).
* ``scatter`` (SWrite): accumulators -> shared C tile (fp32) -> epilogue -> vectorised
  stores to rows ``ids[p]`` of C, guarded by ``p < count``.
* Grid: ``ceil(M / BM) x N / BN`` CTAs sized for the worst case (every row non-zero);
  CTAs whose p-tile starts at or past ``count`` exit at once (:func:`add_early_exit`, an
  IR post-process applied by :func:`schedule_row_gather_matmul`), so the host never reads
  ``count``.

Requirements of the tensor-core path: ``K % block_k == 0`` and ``N % block_n == 0``
(otherwise :class:`ValueError`); ``M`` is free (rows past ``M`` in the last tile are read
from clamped, valid addresses and never stored).

cp.async is emitted by TVM's ``InjectPTXAsyncCopy`` pass, which only runs under the pass
config ``tirx.use_async_copy``: build with :func:`build` here (``pit_tvm.target.build``
inside that PassContext).  Without it the pipelined kernel is still correct, but the
global->shared copies are synchronous.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

import tvm.s_tir.tensor_intrin.cuda as _cuda_intrin  # noqa: F401  (registers fill/store)
from tvm.s_tir.tensor_intrin.cuda import (
    MMA_fill_16x16_f32_INTRIN,
    MMA_store_16x16_f32_shared_dyn_INTRIN_SIMPLE,
    shared_16x16_to_ldmatrix_32x8_layout,
)

__all__ = [
    "TensorCoreConfig",
    "row_gather_matmul_func",
    "schedule_row_gather_matmul",
    "valid_configs",
    "add_early_exit",
    "build",
    "smem_bytes",
    "IN_DTYPES",
    "OUT_DTYPES",
]

IN_DTYPES = ("float16", "bfloat16")
OUT_DTYPES = ("float16", "bfloat16", "float32")
SMEM_SCOPE = "shared.dyn"
#: dynamic shared memory per block: H100 allows 227 KiB, A100 163 KiB.
MAX_SMEM_BYTES = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}
EARLY_EXIT_ATTR = "pit.early_exit_block_m"


# --------------------------------------------------------------------------------------
# Tensor intrinsics: ldmatrix / mma.sync for fp16 and bf16 (TVM only ships fp16 ones)
# --------------------------------------------------------------------------------------
_WARP = 32
_DTYPE_ABBRV = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_DTYPE_SHORT = {"float16": "f16", "bfloat16": "bf16"}


def _ldmatrix_intrin(dtype: str, matrix: str, scope: str):
    """ldmatrix.x4 of a 16x16 tile (A: row-major MxK, B: row-major KxN, loaded transposed)."""
    local_size = 8
    index_map = shared_16x16_to_ldmatrix_32x8_layout
    transpose_in_ldmatrix = matrix == "B"
    half = tirx.const(16, "int32")

    @T.prim_func(s_tir=True)
    def desc(warp_handle: T.handle, shared_handle: T.handle) -> None:
        shared = T.match_buffer(shared_handle, (16, 16), dtype, align=64, offset_factor=16,
                                scope=scope)
        warp = T.match_buffer(warp_handle, (_WARP, local_size), dtype, align=64,
                              offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:16, 0:16])
            T.writes(warp[0:_WARP, 0:local_size])
            for ax0, ax1 in T.grid(16, 16):
                with T.sblock("shared_warp"):
                    v0, v1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(shared[v0, v1])
                    thread_id, local_id = T.meta_var(index_map(v0, v1))
                    T.writes(warp[thread_id, local_id])
                    warp[thread_id, local_id] = shared[v0, v1]

    @T.prim_func(s_tir=True)
    def impl(warp_handle: T.handle, shared_handle: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        shared = T.match_buffer(shared_handle, (16, 16), dtype, align=64, offset_factor=16,
                                scope=scope, strides=[s0, s1])
        warp = T.match_buffer(warp_handle, (_WARP, local_size), dtype, align=64,
                              offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:16, 0:16])
            T.writes(warp[0:_WARP, 0:local_size])
            for tx in T.thread_binding(0, _WARP, "threadIdx.x"):
                T.evaluate(
                    T.ptx_legacy.ldmatrix(
                        transpose_in_ldmatrix, 4, ".b16", warp.data,
                        warp.elem_offset + local_size * tx, shared.access_ptr("r"),
                        s0 * (tx % half) + 8 * (tx // half), dtype=dtype,
                    )
                )

    return desc, impl


def _mma_intrin(in_dtype: str):
    """mma.sync m16n8k16 x2 = one 16x16x16 tile, fp32 accumulators, A row / B col."""
    index_map = shared_16x16_to_ldmatrix_32x8_layout
    ab = _DTYPE_ABBRV[in_dtype]

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (_WARP, 8), in_dtype, align=64, offset_factor=16, scope="warp")
        B = T.match_buffer(b, (_WARP, 8), in_dtype, align=64, offset_factor=16, scope="warp")
        C = T.match_buffer(c, (_WARP, 8), "float32", align=64, offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:_WARP, 0:8], A[0:_WARP, 0:8], B[0:_WARP, 0:8])
            T.writes(C[0:_WARP, 0:8])
            for i, j, k in T.grid(16, 16, 16):
                with T.sblock("C"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    tc, lc = T.meta_var(index_map(vi, vj))
                    ta, la = T.meta_var(index_map(vi, vk))
                    tb, lb = T.meta_var(index_map(vk, vj))
                    T.reads(C[tc, lc], A[ta, la], B[tb, lb])
                    T.writes(C[tc, lc])
                    C[tc, lc] = C[tc, lc] + T.Cast("float32", A[ta, la]) * T.Cast(
                        "float32", B[tb, lb])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (_WARP, 8), in_dtype, align=64, offset_factor=16, scope="warp")
        B = T.match_buffer(b, (_WARP, 8), in_dtype, align=64, offset_factor=16, scope="warp")
        C = T.match_buffer(c, (_WARP, 8), "float32", align=64, offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:_WARP, 0:8], A[0:_WARP, 0:8], B[0:_WARP, 0:8])
            T.writes(C[0:_WARP, 0:8])
            for tx in T.thread_binding(0, _WARP, "threadIdx.x"):
                T.evaluate(T.ptx_legacy.mma(
                    "m16n8k16", "row", "col", ab, ab, "fp32",
                    A.data, A.elem_offset + tx * 8, B.data, B.elem_offset + tx * 8,
                    C.data, C.elem_offset + tx * 8, False, dtype="float32"))
                T.evaluate(T.ptx_legacy.mma(
                    "m16n8k16", "row", "col", ab, ab, "fp32",
                    A.data, A.elem_offset + tx * 8, B.data, B.elem_offset + tx * 8 + 4,
                    C.data, C.elem_offset + tx * 8 + 4, False, dtype="float32"))

    return desc, impl


def _intrin_names(in_dtype: str) -> dict[str, str]:
    s = _DTYPE_SHORT[in_dtype]
    sc = SMEM_SCOPE.replace(".", "_")
    return {
        "load_a": f"pit_ldmatrix_{s}_a_{sc}",
        "load_b": f"pit_ldmatrix_{s}_b_{sc}",
        "compute": f"pit_mma_{s}{s}f32",
        "init": MMA_fill_16x16_f32_INTRIN,
        "store": MMA_store_16x16_f32_shared_dyn_INTRIN_SIMPLE,
    }


def _register_intrinsics() -> None:
    for dt in IN_DTYPES:
        names = _intrin_names(dt)
        for key, args in (("load_a", (dt, "A", SMEM_SCOPE)), ("load_b", (dt, "B", SMEM_SCOPE))):
            try:
                TensorIntrin.get(names[key])
            except Exception:  # noqa: BLE001 - not registered yet
                TensorIntrin.register(names[key], *_ldmatrix_intrin(*args))
        try:
            TensorIntrin.get(names["compute"])
        except Exception:  # noqa: BLE001
            TensorIntrin.register(names["compute"], *_mma_intrin(dt))


_register_intrinsics()


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorCoreConfig:
    """Knobs of the tensor-core schedule (the MetaSchedule design space samples these).

    block_m/n/k: thread block tile (rows are compacted positions p); warp_m/n: warp tile
    (multiples of 16); stages: software pipeline depth over K tiles (1 = no pipelining,
    >1 = multi-buffered shared memory filled by cp.async); smem_pad: elements appended to
    every shared row against bank conflicts (8 x 2 bytes = 16 bytes keeps rows 16-byte
    aligned); epilogue_vec: elements per vector store of the SWrite; zero_rows: rows per
    CTA of the complement zero-fill kernel.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 32
    warp_m: int = 64
    warp_n: int = 64
    stages: int = 3
    smem_pad: int = 8
    epilogue_vec: int = 4
    zero_rows: int = 4

    @property
    def warps(self) -> int:
        return (self.block_m // self.warp_m) * (self.block_n // self.warp_n)

    @property
    def threads(self) -> int:
        return self.warps * 32

    def as_dict(self) -> dict:
        return asdict(self)


def _dtype_bytes(dtype: str) -> int:
    return tvm.DataType(dtype).bits // 8


def smem_bytes(config: TensorCoreConfig, in_dtype: str = "float16") -> int:
    """Peak dynamic shared memory of the matmul kernel (pipeline buffers and the fp32 C
    tile live at different times; MergeSharedMemoryAllocations overlaps them)."""
    c = config
    e = _dtype_bytes(in_dtype)
    pipe = c.stages * (c.block_m * (c.block_k + c.smem_pad) + c.block_k * (c.block_n + c.smem_pad)) * e
    ctile = c.block_m * (c.block_n + 4) * 4
    ids = c.block_m * 4
    return max(pipe, ctile) + ids


def check_config(k: int, n: int, in_dtype: str, config: TensorCoreConfig,
                 max_smem: int = MAX_SMEM_BYTES["sm_90"], out_dtype: str = "float32") -> None:
    """Raise ValueError when ``config`` cannot be used for a (K, N) problem."""
    c = config
    if in_dtype not in IN_DTYPES:
        raise ValueError(f"in_dtype must be one of {IN_DTYPES}, got {in_dtype!r}")
    for name in ("block_m", "block_n", "block_k", "warp_m", "warp_n"):
        v = getattr(c, name)
        if v <= 0 or v % 16:
            raise ValueError(f"{name}={v} must be a positive multiple of 16")
    if c.block_m % c.warp_m or c.block_n % c.warp_n:
        raise ValueError(f"block tile {c.block_m}x{c.block_n} is not a multiple of the warp "
                         f"tile {c.warp_m}x{c.warp_n}")
    if k % c.block_k:
        raise ValueError(f"K={k} must be a multiple of block_k={c.block_k} (tensor-core path)")
    if n % c.block_n:
        raise ValueError(f"N={n} must be a multiple of block_n={c.block_n} (tensor-core path)")
    if c.stages < 1:
        raise ValueError("stages must be >= 1")
    if c.stages > 1 and k // c.block_k < c.stages:
        raise ValueError(f"K={k} has {k // c.block_k} K tiles, fewer than stages={c.stages}")
    if not 1 <= c.threads <= 1024:
        raise ValueError(f"{c.threads} threads per block")
    vec = 16 // _dtype_bytes(in_dtype)
    if c.smem_pad % vec:
        raise ValueError(f"smem_pad={c.smem_pad} must keep rows 16-byte aligned (multiple of {vec})")
    for what, elems in (("A tile", c.block_m * c.block_k), ("B tile", c.block_k * c.block_n)):
        if elems % (c.threads * vec):
            raise ValueError(f"{what} ({elems} elements) is not a multiple of threads x {vec}")
    if (c.block_m * c.block_n) % (c.threads * c.epilogue_vec):
        raise ValueError("C tile is not a multiple of threads x epilogue_vec")
    if c.block_n % c.epilogue_vec or c.epilogue_vec not in (1, 2, 4, 8):
        raise ValueError(f"epilogue_vec={c.epilogue_vec}")
    if c.block_m > 1024:
        raise ValueError("block_m > 1024")
    if c.zero_rows < 1 or (n % c.epilogue_vec):
        raise ValueError("zero_rows must be >= 1 and N a multiple of epilogue_vec")
    need = smem_bytes(c, in_dtype)
    if need > max_smem:
        raise ValueError(f"needs {need} bytes of shared memory > {max_smem}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")


# --------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------
def _epilogue(acc, bias_val, relu: bool, out_dtype: str):
    v = acc
    if bias_val is not None:
        v = v + T.Cast("float32", bias_val)
    if relu:
        v = T.max(v, T.float32(0))
    return T.Cast(out_dtype, v) if out_dtype != "float32" else v


def row_gather_matmul_func(k: int, n: int, in_dtype: str = "float16", out_dtype: str = "float32",
                           bias: bool = False, relu: bool = False) -> tirx.PrimFunc:
    """The unscheduled PIT row-gather matmul (see the module docstring).

    Parameters ``(a, b, offsets, ids, [bias,] c)``; ``M`` is a symbolic ``int64``; ``K=k`` and
    ``N=n`` are compile-time.  Blocks: ``row_listed`` + ``zero_fill`` (zero the rows that
    are not listed), ``row_index`` (clamped row id per position p), ``A_gather`` (SRead),
    ``matmul`` (fp32 accumulation), ``scatter`` (epilogue + SWrite, guarded by p < count).
    Builds and runs as is on llvm.
    """
    if in_dtype not in IN_DTYPES:
        raise ValueError(f"in_dtype must be one of {IN_DTYPES}, got {in_dtype!r}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
    K, N = int(k), int(n)
    zero = tirx.const(0, out_dtype)

    if bias:
        @T.prim_func(s_tir=True)
        def func(a: T.handle, b: T.handle, offsets: T.handle, ids: T.handle, bias_h: T.handle,
                 c: T.handle):
            T.func_attr({"global_symbol": "main", "tirx.noalias": True})
            M = T.int64()
            A = T.match_buffer(a, (M, K), in_dtype)
            B = T.match_buffer(b, (K, N), in_dtype)
            OFF = T.match_buffer(offsets, (2,), "int32")
            IDS = T.match_buffer(ids, (M,), "int32")
            BIAS = T.match_buffer(bias_h, (N,), in_dtype)
            C = T.match_buffer(c, (M, N), out_dtype)
            Listed = T.sblock_alloc_buffer((M,), "int32")
            RowIdx = T.sblock_alloc_buffer((M,), "int32")
            Ag = T.sblock_alloc_buffer((M, K), in_dtype)
            Acc = T.sblock_alloc_buffer((M, N), "float32")
            for r in range(M):
                with T.sblock("row_listed"):
                    vr = T.axis.spatial(M, r)
                    T.reads(OFF[1], IDS[0:M])
                    T.writes(Listed[vr])
                    Listed[vr] = _listed_expr(OFF, IDS, vr, M)
            for r, j in T.grid(M, N):
                with T.sblock("zero_fill"):
                    vr, vj = T.axis.remap("SS", [r, j])
                    T.reads(Listed[vr])
                    T.writes(C[vr, vj])
                    if Listed[vr] == 0:
                        C[vr, vj] = zero
            for p in range(M):
                with T.sblock("row_index"):
                    vp = T.axis.spatial(M, p)
                    RowIdx[vp] = T.max(IDS[T.min(vp, M - T.int64(1))], 0)
            for p, kk in T.grid(M, K):
                with T.sblock("A_gather"):
                    vp, vk = T.axis.remap("SS", [p, kk])
                    Ag[vp, vk] = A[RowIdx[vp], vk]
            for p, j, kk in T.grid(M, N, K):
                with T.sblock("matmul"):
                    vp, vj, vk = T.axis.remap("SSR", [p, j, kk])
                    with T.init():
                        Acc[vp, vj] = T.float32(0)
                    Acc[vp, vj] = Acc[vp, vj] + T.Cast("float32", Ag[vp, vk]) * T.Cast(
                        "float32", B[vk, vj])
            for p, j in T.grid(M, N):
                with T.sblock("scatter"):
                    vp, vj = T.axis.remap("SS", [p, j])
                    T.reads(OFF[1], IDS[T.min(vp, M - T.int64(1))], Acc[vp, vj], BIAS[vj])
                    T.writes(C[0:M, vj])
                    if T.Cast("int64", OFF[1]) > vp:
                        C[IDS[T.min(vp, M - T.int64(1))], vj] = _epilogue(
                            Acc[vp, vj], BIAS[vj], relu, out_dtype)
    else:
        @T.prim_func(s_tir=True)
        def func(a: T.handle, b: T.handle, offsets: T.handle, ids: T.handle, c: T.handle):
            T.func_attr({"global_symbol": "main", "tirx.noalias": True})
            M = T.int64()
            A = T.match_buffer(a, (M, K), in_dtype)
            B = T.match_buffer(b, (K, N), in_dtype)
            OFF = T.match_buffer(offsets, (2,), "int32")
            IDS = T.match_buffer(ids, (M,), "int32")
            C = T.match_buffer(c, (M, N), out_dtype)
            Listed = T.sblock_alloc_buffer((M,), "int32")
            RowIdx = T.sblock_alloc_buffer((M,), "int32")
            Ag = T.sblock_alloc_buffer((M, K), in_dtype)
            Acc = T.sblock_alloc_buffer((M, N), "float32")
            for r in range(M):
                with T.sblock("row_listed"):
                    vr = T.axis.spatial(M, r)
                    T.reads(OFF[1], IDS[0:M])
                    T.writes(Listed[vr])
                    Listed[vr] = _listed_expr(OFF, IDS, vr, M)
            for r, j in T.grid(M, N):
                with T.sblock("zero_fill"):
                    vr, vj = T.axis.remap("SS", [r, j])
                    T.reads(Listed[vr])
                    T.writes(C[vr, vj])
                    if Listed[vr] == 0:
                        C[vr, vj] = zero
            for p in range(M):
                with T.sblock("row_index"):
                    vp = T.axis.spatial(M, p)
                    RowIdx[vp] = T.max(IDS[T.min(vp, M - T.int64(1))], 0)
            for p, kk in T.grid(M, K):
                with T.sblock("A_gather"):
                    vp, vk = T.axis.remap("SS", [p, kk])
                    Ag[vp, vk] = A[RowIdx[vp], vk]
            for p, j, kk in T.grid(M, N, K):
                with T.sblock("matmul"):
                    vp, vj, vk = T.axis.remap("SSR", [p, j, kk])
                    with T.init():
                        Acc[vp, vj] = T.float32(0)
                    Acc[vp, vj] = Acc[vp, vj] + T.Cast("float32", Ag[vp, vk]) * T.Cast(
                        "float32", B[vk, vj])
            for p, j in T.grid(M, N):
                with T.sblock("scatter"):
                    vp, vj = T.axis.remap("SS", [p, j])
                    T.reads(OFF[1], IDS[T.min(vp, M - T.int64(1))], Acc[vp, vj])
                    T.writes(C[0:M, vj])
                    if T.Cast("int64", OFF[1]) > vp:
                        C[IDS[T.min(vp, M - T.int64(1))], vj] = _epilogue(
                            Acc[vp, vj], None, relu, out_dtype)

    return func.with_attr("pit.workload", f"row_gather_matmul_k{K}_n{N}_{in_dtype}_{out_dtype}"
                          f"{'_bias' if bias else ''}{'_relu' if relu else ''}")


_SEARCH_STEPS = 32  # enough for any int32 count


def _listed_expr(OFF, IDS, vr, M):
    """1 if row ``vr`` is in ids[0:count] (ascending), else 0: a branch-free lower_bound of
    fixed length, written as nested Let expressions (each step halves [lo, lo + len))."""
    count = OFF[1]
    row = T.Cast("int32", vr)
    last = T.Cast("int32", M) - 1
    one, zero = tirx.const(1, "int32"), tirx.const(0, "int32")

    def step(i, lo_val, len_val):
        if i == _SEARCH_STEPS:
            hit = tirx.all(lo_val < count, IDS[T.max(T.min(lo_val, last), 0)] == row)
            return T.Select(hit, one, zero)
        lo = tirx.Var(f"lo{i}", "int32")
        ln = tirx.Var(f"len{i}", "int32")
        half = ln >> 1
        right = tirx.all(ln > 0, IDS[T.max(T.min(lo + half, last), 0)] < row)
        nxt_lo = T.Select(right, lo + half + 1, lo)
        nxt_len = T.Select(right, ln - half - 1, half)
        return tirx.Let(lo, lo_val, tirx.Let(ln, len_val, step(i + 1, nxt_lo, nxt_len)))

    return step(0, zero, count)
