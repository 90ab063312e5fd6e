"""Tensor-core dense-tile schedule for the PIT row-gather matmul (CUDA, sm_80 / sm_90).

Kept as one module: it is the mma.sync kernel's code -- the workload PrimFuncs, their schedules
(full K, split K, early exit) and the ldmatrix / mma intrinsics share :class:`TensorCoreConfig`'s
tile geometry and private helpers (``_tensorize_mma``, ``_stage_shared``, ...); not split for size.

Workload (:func:`row_gather_matmul_func`), the layout the index kernels produce for the
micro-tile (1, K) = whole rows of A::

    row_gather_matmul(A[M, K], B[K, N], offsets: int32[2], ids: int32[M], [bias: N,] C[M, N])
    count = offsets[1]                      # read on the device only
    ids[0:count] the non-zero rows of A, ids[count:M] the other rows (in any order)
    C[ids[p], :] = epilogue(A[ids[p], :] @ B)   for p < count    (fp32 accumulation)
    C[ids[p], :] = 0                             for p >= count

``epilogue`` is the optional ``+ bias[n]`` and ``relu``.  Rows that are not listed are
zeroed by a *complement scatter* inside the same PrimFunc: ``zero_fill`` stores zeros to
the rows ``ids[count:M]``, which the rows index lists there.  On CUDA that is a separate,
cheap kernel (one launch, ``(M - count) * N`` stores); it writes rows disjoint from the
matmul kernel's rows, so their order does not matter.

The PIT part (:func:`schedule_row_gather_matmul`):

* ``A_gather`` (SRead): the thread block tile covers ``BM`` *compacted* row positions
  ``p``; each row of the A tile is gathered global->shared from row ``ids[p]`` with 16-byte
  vector copies (predicated zero-fill cp.async when ``stages > 1``; rows past ``M`` of the
  last tile are zero-filled) into a padded shared buffer (``pad_einsum`` pads p to BM).
* ``matmul``: dense BM x BN x BK tiles, ldmatrix + mma.sync m16n8k16 (fp16 or bf16 in,
  fp32 accumulators in registers), B also cp.async'ed to padded shared memory, multi-stage
  software pipeline over the K tiles (``software_pipeline_stage/order/async_stages``).
* ``scatter`` (SWrite): accumulators -> shared C tile (fp32) -> epilogue -> vectorised
  stores to rows ``ids[p]`` of C, guarded by ``p < count``.
* Grid: ``ceil(M / BM) x N / BN`` CTAs sized for the worst case (every row non-zero);
  CTAs whose p-tile starts at or past ``count`` exit at once (:func:`add_early_exit`, an
  IR post-process applied by :func:`schedule_row_gather_matmul`), so the host never reads
  ``count``.

* Split-K path for few rows (workload built with ``split_k > 1``; :func:`split_plan` picks
  ``split_k`` and ``split_rows``): with ``count <= split_rows`` the full-K grid would hold at
  most one CTA per SM, each running K / block_k dependent mma steps with one warp per
  scheduler (latency bound: few rows take as long as ten times as many).  Then a second
  matmul kernel over (K slice -> blockIdx.z, p tile, N tile) with :func:`split_config`'s
  64-deep, 4-stage tiles writes fp32 partials to a device workspace, and a small kernel sums
  them, applies the epilogue and scatters.  Which path runs is decided per CTA on the device
  (``count > split_rows`` / ``<=``, see :func:`add_early_exit`); the other path's CTAs exit
  at once (measured: docs/design/measurements.md#tensor-core-kernels).

The same tiles also serve a plain dense matmul (:func:`dense_matmul_func`,
:func:`schedule_dense_matmul`): a model's dense fp16/bf16 layers on CUDA use it
(:class:`pit_tvm.passes.DenseMatmulToPITKernels`) instead of dlight's SIMT kernel.

Requirements of the tensor-core path: ``K % block_k == 0`` and ``N % block_n == 0``
(otherwise :class:`ValueError`); ``M`` is free (rows past ``M`` in the last tile are
zero-filled, rows ``count <= p < M`` read row 0 through the clamped id; neither is stored).
Zeroing of unlisted rows: complement scatter (see above), not a full zero-fill of C.

cp.async is emitted by TVM's ``InjectPTXAsyncCopy`` pass, which only runs under the pass
config ``tirx.use_async_copy``, which :func:`pit_tvm.target.build` sets for every CUDA build.
Without it the pipelined kernel is still correct, but the global->shared copies are synchronous.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

import tvm.s_tir.tensor_intrin.cuda as _cuda_intrin  # noqa: F401  (registers fill/store)
from pit_tvm.schedules.limits import (  # noqa: F401  (re-exported: tensorcore_tiles, tuning)
    IN_DTYPES, MAX_SMEM_BYTES, OUT_DTYPES, dtype_bytes, max_smem_bytes, sm_count)
from pit_tvm.schedules.signature import without_params
from tvm.s_tir.tensor_intrin.cuda import (
    MMA_fill_16x16_f32_INTRIN,
    MMA_store_16x16_f32_shared_dyn_INTRIN_SIMPLE,
    shared_16x16_to_ldmatrix_32x8_layout,
)

__all__ = [
    "TensorCoreConfig",
    "row_gather_matmul_func",
    "schedule_row_gather_matmul",
    "dense_matmul_func",
    "schedule_dense_matmul",
    "split_plan",
    "split_config",
    "valid_configs",
    "add_early_exit",
    "apply_row_gather_schedule",
    "build",
    "smem_bytes",
    "max_smem_bytes",
    "IN_DTYPES",
    "OUT_DTYPES",
]

SMEM_SCOPE = "shared.dyn"
EARLY_EXIT_ATTR = "pit.early_exit_block_m"
#: CTA-level regime guards (value: split_rows R): the full-K kernel runs when count > R, the
#: split-K kernels when count <= R (see :func:`add_early_exit`)
COUNT_GT_ATTR = "pit.run_if_count_gt"
COUNT_LE_ATTR = "pit.run_if_count_le"
#: (split_k, split_rows) of a row-gather workload built with the split-K path
SPLIT_ATTR = "pit.split_k_rows"
#: shallowest K slice the split-K path cuts: a shallower slice saves less latency than the fp32
#: partials' round trip and the sum kernel cost (BERT-base's 768-deep layers ran slower split)
SPLIT_MIN_SLICE_K = 1024
#: rows per CTA of the split-K sum kernel (split_rows is a multiple of every block_m >= 16)
_SPLIT_SUM_ROWS = 8


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


def smem_bytes(config: TensorCoreConfig, in_dtype: str = "float16") -> int:
    """Peak dynamic shared memory of the matmul kernel (pipeline buffers and the fp32 C
    tile live at different times; MergeSharedMemoryAllocations overlaps them)."""
    return _tile_smem_bytes(config, config.block_m, in_dtype)


def _tile_smem_bytes(c, rows: int, in_dtype: str) -> int:
    """Peak shared memory of a ``rows`` x block_n CTA tile: the pipelined A/B tiles or the
    fp32 C tile, whichever is larger."""
    e = dtype_bytes(in_dtype)
    pipe = c.stages * (rows * (c.block_k + c.smem_pad) + c.block_k * (c.block_n + c.smem_pad)) * e
    ctile = rows * (c.block_n + 4) * 4
    return max(pipe, ctile)


def _check_dtypes(in_dtype: str, out_dtype: str) -> None:
    if in_dtype not in IN_DTYPES:
        raise ValueError(f"in_dtype must be one of {IN_DTYPES}, got {in_dtype!r}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")


def _check_mult16(c, names) -> None:
    for name in names:
        v = getattr(c, name)
        if v <= 0 or v % 16:
            raise ValueError(f"{name}={v} must be a positive multiple of 16")


def _fitting(candidates, check) -> list:
    """The candidates for which ``check(candidate)`` raises no ValueError, in order."""
    out = []
    for cfg in candidates:
        try:
            check(cfg)
        except ValueError:
            continue
        out.append(cfg)
    return out


def check_config(k: int, n: int, in_dtype: str, config: TensorCoreConfig,
                 max_smem: int = MAX_SMEM_BYTES["sm_90"], out_dtype: str = "float32") -> None:
    """Raise ValueError when ``config`` cannot be used for a (K, N) problem."""
    c = config
    if in_dtype not in IN_DTYPES:
        raise ValueError(f"in_dtype must be one of {IN_DTYPES}, got {in_dtype!r}")
    _check_mult16(c, ("block_m", "block_n", "block_k", "warp_m", "warp_n"))
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
    vec = 16 // dtype_bytes(in_dtype)
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


def _fp32_matmul_macro(k: int, n: int):
    """The ``matmul`` block of the full-K workloads (row gather, dense):
    ``Acc[p, j] = sum_kk X[p, kk] * B[kk, j]`` in fp32 over the int32 rows ``p`` of ``X``."""

    @T.macro
    def fp32_matmul(M, X, B, Acc):
        for p, j, kk in T.grid(T.Cast("int32", M), n, k):
            with T.sblock("matmul"):
                vp, vj, vk = T.axis.remap("SSR", [p, j, kk])
                with T.init():
                    Acc[vp, vj] = T.float32(0)
                Acc[vp, vj] = Acc[vp, vj] + T.Cast("float32", X[vp, vk]) * T.Cast("float32", B[vk, vj])

    return fp32_matmul


def row_gather_matmul_func(k: int, n: int, in_dtype: str = "float16", out_dtype: str = "float32",
                           bias: bool = False, relu: bool = False, split_k: int = 1,
                           split_rows: int = 0) -> tirx.PrimFunc:
    """The unscheduled PIT row-gather matmul (see the module docstring).

    Parameters ``(a, b, offsets, ids, [bias,] c)``; ``M`` is a symbolic ``int64``; ``K=k`` and
    ``N=n`` are compile-time.  Blocks: ``zero_fill`` (zero the rows ``ids[count:M]``, which
    are not listed), ``A_gather`` (SRead; a position p >= count reads a row never stored),
    ``matmul`` (fp32 accumulation), ``scatter`` (epilogue + SWrite, guarded by p < count).
    Builds and runs as is on llvm.

    ``split_k > 1`` adds the *split-K path* for few rows (``count <= split_rows``): ``A_split``
    / ``B_split`` (SRead of rows ``p < split_rows`` and of B, per K slice ``s``),
    ``split_matmul`` into per-slice fp32 partials (``split_store`` -> ``Part[s, p, j]``, a
    device workspace), ``split_sum`` over the slices and ``split_scatter`` (epilogue +
    SWrite).  Exactly one path stores each row: the full-K scatter runs when
    ``count > split_rows``, the split one when ``count <= split_rows`` (decided on the
    device, per element here; per CTA once scheduled, see :func:`add_early_exit`).
    """
    _check_dtypes(in_dtype, out_dtype)
    K, N = int(k), int(n)
    S, R = int(split_k), int(split_rows)
    split = S > 1
    if split and (R <= 0 or K % S):
        raise ValueError(f"split_k={S} needs split_rows > 0 (got {R}) and K={K} divisible by it")
    KS = K // S
    zero = tirx.const(0, out_dtype)
    zero_in = tirx.const(0, in_dtype)
    # the full-K path stores when there are more rows than the split path takes
    full_path = (lambda cnt: cnt > R) if split else (lambda cnt: True)
    fp32_matmul = _fp32_matmul_macro(K, N)

    @T.macro
    def body(M, A, B, OFF, IDS, BIAS, C):
        for p, j in T.grid(M, N):
            with T.sblock("zero_fill"):
                # the rows that are not listed: ids[count:M] (the index lists them there)
                vp, vj = T.axis.remap("SS", [p, j])
                T.reads(OFF[1], IDS[vp])
                T.writes(C[0:M, vj])
                if T.Cast("int64", OFF[1]) <= vp:
                    C[IDS[vp], vj] = zero
        with T.sblock("gather_matmul"):
            if bias:
                T.reads(OFF[1], IDS[0:M], A[0:M, 0:K], B[0:K, 0:N], BIAS[0:N])
            else:
                T.reads(OFF[1], IDS[0:M], A[0:M, 0:K], B[0:K, 0:N])
            T.writes(C[0:M, 0:N])
            Ag = T.sblock_alloc_buffer((T.Cast("int32", M), K), in_dtype)
            Acc = T.sblock_alloc_buffer((T.Cast("int32", M), N), "float32")
            for p, kk in T.grid(T.Cast("int32", M), K):
                with T.sblock("A_gather"):
                    vp, vk = T.axis.remap("SS", [p, kk])
                    # row ids[p]: ids[0:M] is a permutation of the rows, so positions read
                    # distinct rows; a position p >= count reads an unlisted row, whose product
                    # is never stored.  (Reading one clamped row there put every unlisted row
                    # of every CTA on one L2 sector: the kernel serialised on it.)
                    Ag[vp, vk] = A[IDS[T.min(vp, T.Cast("int32", M) - 1)], vk]
            fp32_matmul(M, Ag, B, Acc)
            for p, j in T.grid(T.Cast("int32", M), N):
                with T.sblock("scatter"):
                    vp, vj = T.axis.remap("SS", [p, j])
                    if bias:
                        T.reads(OFF[1], IDS[T.min(vp, T.Cast("int32", M) - 1)], Acc[vp, vj],
                                BIAS[vj])
                    else:
                        T.reads(OFF[1], IDS[T.min(vp, T.Cast("int32", M) - 1)], Acc[vp, vj])
                    T.writes(C[0:M, vj])
                    if OFF[1] > vp and full_path(OFF[1]):
                        if bias:
                            C[IDS[T.min(vp, T.Cast("int32", M) - 1)], vj] = _epilogue(
                                Acc[vp, vj], BIAS[vj], relu, out_dtype)
                        else:
                            C[IDS[T.min(vp, T.Cast("int32", M) - 1)], vj] = _epilogue(
                                Acc[vp, vj], None, relu, out_dtype)
        if split:
            with T.sblock("split_gather_matmul"):
                if bias:
                    T.reads(OFF[1], IDS[0:M], A[0:M, 0:K], B[0:K, 0:N], BIAS[0:N])
                else:
                    T.reads(OFF[1], IDS[0:M], A[0:M, 0:K], B[0:K, 0:N])
                T.writes(C[0:M, 0:N])
                As = T.sblock_alloc_buffer((S, R, KS), in_dtype)
                Bs = T.sblock_alloc_buffer((S, KS, N), in_dtype)
                Acc_s = T.sblock_alloc_buffer((S, R, N), "float32")
                Part = T.sblock_alloc_buffer((S, R, N), "float32")
                Sum = T.sblock_alloc_buffer((R, N), "float32")
                for s_, p, q in T.grid(S, R, KS):
                    with T.sblock("A_split"):
                        vs, vp, vq = T.axis.remap("SSS", [s_, p, q])
                        T.reads(IDS[0:M], A[0:M, 0:K])
                        T.writes(As[vs, vp, vq])
                        # rows past M read nothing (M may be below split_rows); row ids[p]
                        # as in A_gather
                        As[vs, vp, vq] = T.if_then_else(
                            vp < T.Cast("int32", M),
                            A[IDS[T.min(vp, T.Cast("int32", M) - 1)], vs * KS + vq], zero_in)
                for s_, q, j in T.grid(S, KS, N):
                    with T.sblock("B_split"):
                        vs, vq, vj = T.axis.remap("SSS", [s_, q, j])
                        Bs[vs, vq, vj] = B[vs * KS + vq, vj]
                for s_, p, j, q in T.grid(S, R, N, KS):
                    with T.sblock("split_matmul"):
                        vs, vp, vj, vq = T.axis.remap("SSSR", [s_, p, j, q])
                        with T.init():
                            Acc_s[vs, vp, vj] = T.float32(0)
                        Acc_s[vs, vp, vj] = Acc_s[vs, vp, vj] + T.Cast(
                            "float32", As[vs, vp, vq]) * T.Cast("float32", Bs[vs, vq, vj])
                for s_, p, j in T.grid(S, R, N):
                    with T.sblock("split_store"):
                        vs, vp, vj = T.axis.remap("SSS", [s_, p, j])
                        Part[vs, vp, vj] = Acc_s[vs, vp, vj]
                for p, j, s_ in T.grid(R, N, S):
                    with T.sblock("split_sum"):
                        vp, vj, vs = T.axis.remap("SSR", [p, j, s_])
                        with T.init():
                            Sum[vp, vj] = T.float32(0)
                        Sum[vp, vj] = Sum[vp, vj] + Part[vs, vp, vj]
                for p, j in T.grid(R, N):
                    with T.sblock("split_scatter"):
                        vp, vj = T.axis.remap("SS", [p, j])
                        if bias:
                            T.reads(OFF[1], IDS[0:M], Sum[vp, vj], BIAS[vj])
                        else:
                            T.reads(OFF[1], IDS[0:M], Sum[vp, vj])
                        T.writes(C[0:M, vj])
                        if OFF[1] > vp and OFF[1] <= R:
                            if bias:
                                C[IDS[T.min(T.Cast("int64", vp), M - 1)], vj] = _epilogue(
                                    Sum[vp, vj], BIAS[vj], relu, out_dtype)
                            else:
                                C[IDS[T.min(T.Cast("int64", vp), M - 1)], vj] = _epilogue(
                                    Sum[vp, vj], None, relu, out_dtype)

    @T.prim_func(s_tir=True)
    def func(a: T.handle, b: T.handle, offsets: T.handle, ids: T.handle, bias_h: T.handle, c: T.handle):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        M = T.int64()
        A = T.match_buffer(a, (M, K), in_dtype)
        B = T.match_buffer(b, (K, N), in_dtype)
        OFF = T.match_buffer(offsets, (2,), "int32")
        IDS = T.match_buffer(ids, (M,), "int32")
        BIAS = T.match_buffer(bias_h, (N,), in_dtype)
        C = T.match_buffer(c, (M, N), out_dtype)
        body(M, A, B, OFF, IDS, BIAS, C)

    func = without_params(func, ("a", "b", "offsets", "ids", "bias", "c"), () if bias else ("bias",))
    func = func.with_attr("pit.workload", f"row_gather_matmul_k{K}_n{N}_{in_dtype}_{out_dtype}"
                          f"{'_bias' if bias else ''}{'_relu' if relu else ''}"
                          f"{f'_split{S}x{R}' if split else ''}")
    return func.with_attr(SPLIT_ATTR, [S, R]) if split else func


# --------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------
def _workload_params(func: tirx.PrimFunc):
    """(K, N, in_dtype, out_dtype, has_bias) read back from the workload's buffers."""
    params = list(func.params)
    if len(params) not in (5, 6):
        raise ValueError("not a row_gather_matmul workload (expected 5 or 6 parameters)")
    a, b, c = params[0].ty, params[1].ty, params[-1].ty
    return (int(b.shape[0]), int(b.shape[1]), str(a.dtype), str(c.dtype),
            len(params) == 6)


def _read_index(sch: s_tir.Schedule, block, buffer_name: str) -> int:
    for i, region in enumerate(sch.get(block).reads):
        if region.source.name == buffer_name:
            return i
    raise ValueError(f"block {sch.get(block).name_hint} does not read {buffer_name}")


def _schedule_zero_fill(sch: s_tir.Schedule, n: int, out_dtype: str, c: TensorCoreConfig):
    """Zero-fill kernel: blockIdx.x over position groups, threadIdx.y = position p (the ones
    at or past count store), threadIdx.x x vector over the columns of row ``ids[p]``."""
    zf = sch.get_sblock("zero_fill")
    r, j = sch.get_loops(zf)
    vec = max(1, min(16 // dtype_bytes(out_dtype), c.epilogue_vec * 2))
    while n % vec:
        vec //= 2
    tx = max(1, min(32, n // vec))
    ro, ri = sch.split(r, [None, c.zero_rows])
    j0, j1, j2 = sch.split(j, [None, tx, vec])
    sch.reorder(ro, ri, j1, j0, j2)
    sch.bind(ro, "blockIdx.x")
    sch.bind(ri, "threadIdx.y")
    sch.bind(j1, "threadIdx.x")
    sch.vectorize(j2)


def schedule_row_gather_matmul(func: tirx.PrimFunc, config: TensorCoreConfig,
                               arch: str = "sm_90") -> tirx.PrimFunc:
    """Schedule :func:`row_gather_matmul_func` for CUDA tensor cores.

    Raises ValueError when ``config`` does not fit the workload: K % block_k, N % block_n
    must be 0 (no masking on the tensor-core path), the tiles must divide into warps and
    16x16x16 mma tiles, and the dynamic shared memory must fit ``arch``.
    """
    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    apply_row_gather_schedule(sch, config, arch)
    out = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    return add_early_exit(out)


def apply_row_gather_schedule(sch: s_tir.Schedule, config: TensorCoreConfig,
                              arch: str = "sm_90") -> None:
    """The schedule primitives of :func:`schedule_row_gather_matmul`, applied in place to
    ``sch`` (its ``"main"`` function, the unscheduled workload): usable on a MetaSchedule
    traced schedule.  Does *not* apply :func:`add_early_exit` (an IR post-process, not a
    schedule primitive) nor set ``tirx.is_scheduled``.  Raises ValueError for a config
    that does not fit the workload (before touching ``sch``)."""
    sch.work_on("main")
    k, n, in_dtype, out_dtype, _ = _workload_params(sch.mod["main"])
    c = config
    check_config(k, n, in_dtype, c, max_smem_bytes(arch), out_dtype)
    split = _split_of(sch.mod["main"])
    if split is not None:
        s_k, rows = split
        small = split_config(c, k, n, in_dtype, arch)
        if rows % small.block_m or (k // s_k) % small.block_k or (
                (k // s_k) // small.block_k < small.stages):
            raise ValueError(f"split-K path {s_k}x{rows} does not fit the config: split_rows "
                             f"must be a multiple of block_m={small.block_m} and K/split_k="
                             f"{k // s_k} a multiple of block_k={small.block_k} with at least "
                             f"stages={small.stages} K tiles")
    names = _intrin_names(in_dtype)
    vec = 16 // dtype_bytes(in_dtype)

    _schedule_zero_fill(sch, n, out_dtype, c)
    # SRead: the A rows gathered through ids (A_gather, inlined into the padded tile Ag_pad);
    # SWrite: the scatter epilogue
    p0 = _schedule_full_k_mma(sch, c, n, k, "A_gather", "Ag_pad", "scatter", names, vec)
    sch.annotate(p0, EARLY_EXIT_ATTR, c.block_m)
    if split is not None:
        sch.annotate(p0, COUNT_GT_ATTR, split[1])
        _schedule_split_k(sch, small, n, k, split, names, vec)


def _schedule_full_k_mma(sch: s_tir.Schedule, c: TensorCoreConfig, n: int, k: int,
                         a_producer: str, a_tile: str, out_block: str, names: dict,
                         vec: int):
    """The full-K tensor-core kernel of the ``matmul`` block over rows p: p padded to
    block_m (``a_producer`` inlined into the padded A tile ``a_tile``, read only for p < M),
    CTA tile block_m x block_n, A and B tiles in padded shared memory per K tile (cp.async,
    ``stages``-deep pipeline), ldmatrix + mma.sync into fp32 registers, accumulators through
    a shared C tile into ``out_block`` (vectorised).  Returns the CTA row-tile loop."""
    mm = sch.get_sblock("matmul")
    out = sch.get_sblock(out_block)
    sch.pad_einsum(mm, [c.block_m, 16, 16])
    a_s = sch.get_sblock(a_tile)
    sch.compute_inline(sch.get_sblock(a_producer))
    sch.compute_inline(sch.get_sblock("Acc_pad"))

    # ---- 16x16x16 mma tiles, CTA grid (p tile, N tile), warps
    (p, j, kk), outer = _split_mma_tiles(sch, mm)
    p0, p1, p2 = sch.split(p, [None, c.block_m // c.warp_m, c.warp_m // 16])
    j0, j1, j2, k0, k1 = _split_cta_n_k(sch, j, kk, n, k, c)
    sch.reorder(p0, j0, p1, j1, k0, k1, p2, j2)
    ty = _bind_cta(sch, p0, j0, p1, j1)

    # ---- accumulators: warp registers -> shared C tile (fp32) -> out_block
    c_w = _stage_epilogue(sch, outer, out, ty, j0, c.warps, c.epilogue_vec)

    # ---- A and B tiles in shared memory per K tile
    sch.set_scope(a_s, 0, SMEM_SCOPE)
    _stage_shared(sch, a_s, k0, c.warps, vec, c.smem_pad)
    b_s = sch.cache_read(outer, _read_index(sch, outer, "B"), SMEM_SCOPE)
    _stage_shared(sch, b_s, k0, c.warps, vec, c.smem_pad)

    # ---- shared -> warp fragments (ldmatrix), mma.sync, fill, store; software pipeline
    _tensorize_mma(sch, mm, outer, c_w, a_s, b_s, k0, k1, names, c.stages)
    return p0


# --------------------------------------------------------------------------------------
# The dense kernel with the same tiles (unannotated matmuls of a model on CUDA)
# --------------------------------------------------------------------------------------
def dense_matmul_func(k: int, n: int, in_dtype: str = "float16",
                      out_dtype: str = "float16", bias: bool = False, relu: bool = False) -> tirx.PrimFunc:
    """``C[M, n] = A[M, k] @ B[k, n] (+ bias[n]) (relu)`` (fp32 accumulation, M symbolic): the
    dense matmul that :func:`schedule_dense_matmul` puts on the same tensor-core tiles as the
    PIT kernels, so a model's dense layers do not fall back to dlight's SIMT kernel.
    Parameters ``(a, b, [bias,] c)``; the optional bias / ReLU run in the
    epilogue, in fp32, as in :func:`row_gather_matmul_func`."""
    _check_dtypes(in_dtype, out_dtype)
    K, N = int(k), int(n)
    fp32_matmul = _fp32_matmul_macro(K, N)

    @T.macro
    def body(M, A, B, BIAS, C):
        # A through an int32-indexed copy (inlined by the schedule), as the PIT kernels'
        # gather: then the padded tile load becomes a predicated 16-byte cp.async (read
        # straight from the int64-shaped A, TVM scalarised it into synchronous loads)
        Ac = T.sblock_alloc_buffer((T.Cast("int32", M), K), in_dtype)
        Acc = T.sblock_alloc_buffer((T.Cast("int32", M), N), "float32")
        for p, kk in T.grid(T.Cast("int32", M), K):
            with T.sblock("A_load"):
                vp, vk = T.axis.remap("SS", [p, kk])
                Ac[vp, vk] = A[vp, vk]
        fp32_matmul(M, Ac, B, Acc)
        for p, j in T.grid(T.Cast("int32", M), N):
            with T.sblock("store"):
                vp, vj = T.axis.remap("SS", [p, j])
                if bias:
                    C[vp, vj] = _epilogue(Acc[vp, vj], BIAS[vj], relu, out_dtype)
                else:
                    C[vp, vj] = _epilogue(Acc[vp, vj], None, relu, out_dtype)

    @T.prim_func(s_tir=True)
    def func(a: T.handle, b: T.handle, bias_h: T.handle, c: T.handle):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        M = T.int64()
        A = T.match_buffer(a, (M, K), in_dtype)
        B = T.match_buffer(b, (K, N), in_dtype)
        BIAS = T.match_buffer(bias_h, (N,), in_dtype)
        C = T.match_buffer(c, (M, N), out_dtype)
        with T.sblock("root"):
            body(M, A, B, BIAS, C)

    func = without_params(func, ("a", "b", "bias", "c"), () if bias else ("bias",))
    return func.with_attr("pit.workload", f"dense_matmul_k{K}_n{N}_{in_dtype}_{out_dtype}"
                          f"{'_bias' if bias else ''}{'_relu' if relu else ''}")


def schedule_dense_matmul(func: tirx.PrimFunc, config: TensorCoreConfig,
                          arch: str = "sm_90") -> tirx.PrimFunc:
    """:func:`dense_matmul_func` on tensor cores: the full-K kernel of
    :func:`schedule_row_gather_matmul` without the gather and the scatter (rows past M
    of the last tile are zero-filled by the predicated copy and never stored)."""
    a_t, b_t, c_t = (func.params[i].ty for i in (0, 1, -1))
    k, n, in_dtype, out_dtype = int(b_t.shape[0]), int(b_t.shape[1]), str(a_t.dtype), str(c_t.dtype)
    c = config
    check_config(k, n, in_dtype, c, max_smem_bytes(arch), out_dtype)
    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    _schedule_full_k_mma(sch, c, n, k, "A_load", "Ac_pad", "store", _intrin_names(in_dtype),
                         16 // dtype_bytes(in_dtype))
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def split_config(config: TensorCoreConfig, k: int, n: int, in_dtype: str = "float16",
                 arch: str = "sm_90") -> TensorCoreConfig:
    """The tile config of the split-K path: ``config`` with a 64-deep, 4-stage K pipeline
    when that fits (it halves a CTA's K loop at high sparsity, where the split path runs:
    docs/design/measurements.md#tensor-core-kernels), else ``config``."""
    deep = TensorCoreConfig(**{**config.as_dict(), "block_k": 64, "stages": 4})
    try:
        check_config(k, n, in_dtype, deep, max_smem_bytes(arch))
    except ValueError:
        return config
    return deep


def split_plan(k: int, n: int, config: TensorCoreConfig, in_dtype: str = "float16",
               arch: str = "sm_90", sms: int | None = None) -> tuple[int, int]:
    """``(split_k, split_rows)`` of the split-K path for a (K, N) problem and ``config``, or
    ``(1, 0)`` when splitting does not fit.

    Why: a CTA of the full-K kernel runs K / block_k dependent mma steps with one warp per
    scheduler, so with few non-zero rows (``ceil(count / block_m) * N / block_n`` CTAs, below
    one per SM) the kernel is latency bound: on the H100 at 4096^3, 41 rows took as long as
    410.  Below ``split_rows`` rows (the full-K grid fills at most one CTA per SM) the K axis
    is cut into ``split_k`` slices, so the grid has up to ~4 CTAs per SM, and a small kernel
    sums the fp32 partials.  The split kernel's tiles are :func:`split_config`'s.  ``sms``: the
    SMs the grid fills, by default the target arch's (:func:`pit_tvm.schedules.limits.sm_count`:
    132 for sm_90, 108 for sm_80).
    """
    c = split_config(config, k, n, in_dtype, arch)
    sms = sm_count(arch) if sms is None else sms
    n_tiles = n // c.block_n
    if n_tiles <= 0:
        return 1, 0
    m_tiles = max(1, sms // n_tiles)
    steps = k // c.block_k
    for s in (8, 4, 2):
        if (s * m_tiles * n_tiles <= 4 * sms and steps % s == 0 and steps // s >= max(c.stages, 2)
                and k // s >= SPLIT_MIN_SLICE_K):
            return s, m_tiles * c.block_m
    return 1, 0


def _split_of(func: tirx.PrimFunc):
    """(split_k, split_rows) of a workload with the split-K path, else None."""
    if not func.attrs or SPLIT_ATTR not in func.attrs:
        return None
    s_k, rows = (int(x) for x in func.attrs[SPLIT_ATTR])
    return s_k, rows


def _schedule_split_k(sch: s_tir.Schedule, c: TensorCoreConfig, n: int, k: int, split,
                      names: dict, vec: int) -> None:
    """The split-K path of the workload: the same CTA tile as the full-K kernel over
    (slice s -> blockIdx.z, p tile, N tile), K/split_k per CTA, fp32 partial tile stored to
    the ``Part`` workspace; then a sum + epilogue + SWrite kernel over (p, N)."""
    s_k, rows = split
    warps = c.warps
    mm = sch.get_sblock("split_matmul")
    store = sch.get_sblock("split_store")
    a_g, b_g = sch.get_sblock("A_split"), sch.get_sblock("B_split")
    (s_, p, j, q), outer = _split_mma_tiles(sch, mm)
    p0, p1, p2 = sch.split(p, [None, c.block_m // c.warp_m, c.warp_m // 16])
    j0, j1, j2, k0, k1 = _split_cta_n_k(sch, j, q, n, k // s_k, c)
    sch.reorder(s_, p0, j0, p1, j1, k0, k1, p2, j2)
    sch.annotate(p0, EARLY_EXIT_ATTR, c.block_m)
    sch.annotate(p0, COUNT_LE_ATTR, rows)
    sch.bind(s_, "blockIdx.z")
    ty = _bind_cta(sch, p0, j0, p1, j1)
    c_w = _stage_epilogue(sch, outer, store, ty, j0, warps, 4)
    for blk in (a_g, b_g):
        sch.set_scope(blk, 0, SMEM_SCOPE)
        _stage_shared(sch, blk, k0, warps, vec, c.smem_pad)
    _tensorize_mma(sch, mm, outer, c_w, a_g, b_g, k0, k1, names, c.stages, batched=True)

    # ---- sum of the slices + epilogue + SWrite: rows of threads over (p, N)
    # CTA = 8 rows (threadIdx.y) x (32 lanes x up to 4 column steps); a warp's loads of one
    # step are 32 consecutive floats of a partial.  Few CTAs: the grid is sized for
    # split_rows rows, and even CTAs that exit at once cost dispatch time.
    sc = sch.get_sblock("split_scatter")
    r, j = sch.get_loops(sc)
    tx = max(1, min(32, n))
    while n % tx:
        tx //= 2
    steps = 4
    while (n // tx) % steps:
        steps //= 2
    ro, ri = sch.split(r, [None, _SPLIT_SUM_ROWS])
    jo, jv, ji = sch.split(j, [None, steps, tx])
    sch.reorder(ro, jo, ri, ji, jv)
    sch.bind(ro, "blockIdx.x")
    sch.bind(jo, "blockIdx.y")
    sch.bind(ri, "threadIdx.y")
    sch.bind(ji, "threadIdx.x")
    sch.annotate(ro, EARLY_EXIT_ATTR, _SPLIT_SUM_ROWS)
    sch.annotate(ro, COUNT_LE_ATTR, rows)
    sm = sch.get_sblock("split_sum")
    sch.set_scope(sm, 0, "local")
    sch.compute_at(sm, jv)


# --------------------------------------------------------------------------------------
# Schedule steps shared with the tiles kernel (pit_tvm.schedules.tensorcore_tiles)
# --------------------------------------------------------------------------------------
def _split_mma_tiles(sch: s_tir.Schedule, mm):
    """Split the last three loops (i, j, k) of ``mm`` into 16x16x16 mma tiles and blockize
    the tile: returns the outer loops (leading batch loops, i, j, k) and the outer block."""
    *batch, i, j, kk = sch.get_loops(mm)
    i, i_tc = sch.split(i, [None, 16])
    j, j_tc = sch.split(j, [None, 16])
    kk, k_tc = sch.split(kk, [None, 16])
    sch.reorder(*batch, i, j, kk, i_tc, j_tc, k_tc)
    return (*batch, i, j, kk), sch.blockize(i_tc)


def _split_cta_n_k(sch: s_tir.Schedule, j, kk, n: int, k: int, c):
    """N tiles (CTA, warp, mma) and K tiles (block_k steps, mma steps) of the mma loops."""
    j0, j1, j2 = sch.split(j, [n // c.block_n, c.block_n // c.warp_n, c.warp_n // 16])
    k0, k1 = sch.split(kk, [k // c.block_k, c.block_k // 16])
    return j0, j1, j2, k0, k1


def _bind_cta(sch: s_tir.Schedule, bx, by, wy, wx):
    """CTA grid (bx, by) and the fused warp loop (wy, wx) -> threadIdx.y, returned."""
    sch.bind(bx, "blockIdx.x")
    sch.bind(by, "blockIdx.y")
    ty = sch.fuse(wy, wx)
    sch.bind(ty, "threadIdx.y")
    return ty


def _distribute(sch: s_tir.Schedule, blk, warps: int, vec: int | None) -> None:
    """Spread the last two loops of ``blk`` over warps x 32 threads (x ``vec`` vector lanes;
    ``vec=None``: one element per thread and step)."""
    f = sch.fuse(*sch.get_loops(blk)[-2:])
    if vec is None:
        _, fy, fx = sch.split(f, [None, warps, 32])
    else:
        _, fy, fx, fv = sch.split(f, [None, warps, 32, vec])
    sch.bind(fy, "threadIdx.y")
    sch.bind(fx, "threadIdx.x")
    if vec is not None:
        sch.vectorize(fv)


def _stage_epilogue(sch: s_tir.Schedule, outer, out_block, ty, j0, warps: int,
                    epilogue_vec: int):
    """Accumulators: warp registers -> shared C tile (fp32) -> ``out_block`` (epilogue,
    vectorised stores) at the CTA's N tile ``j0``.  Returns the warp -> shared C block."""
    sch.set_scope(outer, 0, SMEM_SCOPE)
    c_w = sch.cache_write(outer, 0, "warp")
    sch.reverse_compute_at(c_w, ty)
    sch.reverse_compute_at(out_block, j0)
    _distribute(sch, out_block, warps, epilogue_vec)
    return c_w


def _stage_shared(sch: s_tir.Schedule, blk, k0, warps: int, vec: int | None,
                  smem_pad: int) -> None:
    """A shared-memory tile (already in SMEM_SCOPE) filled per K step ``k0`` by all threads,
    rows padded by ``smem_pad`` elements."""
    sch.compute_at(blk, k0)
    _distribute(sch, blk, warps, vec)
    if smem_pad:
        sch.storage_align(blk, 0, axis=-2, factor=2 * smem_pad, offset=smem_pad)


def _frag_layout(i, j):
    return (i // 16, j // 16, *shared_16x16_to_ldmatrix_32x8_layout(i % 16, j % 16))


def _frag_layout_batched(b_, i_, j_):
    return (b_, i_ // 16, j_ // 16, *shared_16x16_to_ldmatrix_32x8_layout(i_ % 16, j_ % 16))


def _tensorize_mma(sch: s_tir.Schedule, mm, outer, c_w, a_smem, b_smem, k0, k1,
                   names: dict, stages: int, batched: bool = False) -> None:
    """shared -> warp fragments (ldmatrix) at the mma step ``k1``, mma.sync, accumulator
    fill and store tensorized; the C tile rows padded; software pipeline over ``k0`` (copies
    staged ``stages - 1`` K tiles ahead).  ``batched``: the tiles carry a leading batch axis."""
    mm_name = sch.get(mm).name_hint
    a_w = sch.cache_read(outer, _read_index(sch, outer, sch.get(a_smem).writes[0].source.name),
                         "warp")
    sch.compute_at(a_w, k1)
    b_w = sch.cache_read(outer, _read_index(sch, outer, sch.get(b_smem).writes[0].source.name),
                         "warp")
    sch.compute_at(b_w, k1)

    ii, jj = sch.get_loops(c_w)[-2:]
    io, ii = sch.split(ii, [None, 16])
    jo, ji = sch.split(jj, [None, 16])
    sch.reorder(io, jo, ii, ji)
    sch.decompose_reduction(outer, k0)

    def frag(b):
        a, cc = sch.get_loops(b)[-2:]
        a0, a1 = sch.split(a, [None, 16])
        c0, c1 = sch.split(cc, [None, 16])
        sch.reorder(a0, c0, a1, c1)
        return a1

    la, lb = frag(a_w), frag(b_w)

    imap = _frag_layout_batched if batched else _frag_layout
    sch.transform_layout(a_w, ("write", 0), imap)
    sch.transform_layout(b_w, ("write", 0), imap)
    sch.transform_layout(c_w, ("read", 0), imap)
    sch.tensorize(la, names["load_a"])
    sch.tensorize(lb, names["load_b"])
    sch.tensorize(sch.get_loops(mm)[-3], names["compute"])
    init = sch.get_sblock(mm_name + "_init")
    sch.tensorize(sch.get_loops(init)[-2], names["init"])
    store_parent = sch.get_loops(c_w)[-3]
    sch.tensorize(sch.get_loops(c_w)[-2], names["store"])
    # pad the C tile rows (tensorize replaced the store block, so align the new one)
    (store,) = sch.get_child_blocks(store_parent)
    sch.storage_align(store, 0, axis=-2, factor=32, offset=4)

    if stages > 1:
        sch.annotate(k0, "software_pipeline_stage", [0, 0, stages - 1])
        sch.annotate(k0, "software_pipeline_order", [0, 1, 2])
        sch.annotate(k0, "software_pipeline_async_stages", [0])


def add_early_exit(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Wrap the body of the p-tile (blockIdx.x) loop annotated ``pit.early_exit_block_m``
    in ``if p_tile * block_m < offsets[1]``: CTAs past the non-zero rows exit at once.
    With the split-K path, ``pit.run_if_count_gt`` / ``pit.run_if_count_le`` add
    ``offsets[1] > R`` / ``offsets[1] <= R``: only one of the two paths' kernels does work.

    A post-process of the scheduled IR (a MetaSchedule design space must apply it too,
    e.g. as a postproc, or call it on the best schedule)."""
    offsets = func.params[2]
    found = []

    def guard(stmt, cond):
        # Guard each statement of the CTA body separately (not the body as a whole), so
        # that MergeSharedMemoryAllocations still sees the pipeline buffers die before the
        # C tile is written and overlaps them.
        if isinstance(stmt, tirx.For) and stmt.kind == tirx.ForKind.THREAD_BINDING:
            return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind,
                            guard(stmt.body, cond), stmt.thread_binding, stmt.annotations,
                            stmt.step, stmt.span)
        if isinstance(stmt, tirx.SeqStmt):
            return tirx.SeqStmt([guard(x, cond) for x in stmt.seq], stmt.span)
        return tirx.IfThenElse(cond, stmt, None)

    def on_for(stmt, visit):
        if EARLY_EXIT_ATTR not in stmt.annotations:
            return None
        bm = int(stmt.annotations[EARLY_EXIT_ATTR])
        ann = {k: v for k, v in stmt.annotations.items()
               if k not in (EARLY_EXIT_ATTR, COUNT_GT_ATTR, COUNT_LE_ATTR)}
        count = tirx.BufferLoad(offsets, [tirx.const(1, "int32")])
        cond = tirx.Cast("int64", stmt.loop_var) * bm < tirx.Cast("int64", count)
        if COUNT_GT_ATTR in stmt.annotations:
            cond = tirx.And(cond, count > int(stmt.annotations[COUNT_GT_ATTR]))
        if COUNT_LE_ATTR in stmt.annotations:
            cond = tirx.And(cond, count <= int(stmt.annotations[COUNT_LE_ATTR]))
        # uniform across the CTA: lets ThreadSync place __syncthreads inside
        cond = tirx.op.tvm_thread_invariant(cond)
        found.append(bm)
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind,
                        guard(stmt.body, cond), stmt.thread_binding,
                        ann, stmt.step, stmt.span)

    body = _rewrite_loops(func.body, on_for)
    if not found:
        return func
    return func.with_body(body)


def _rewrite_loops(stmt, on_for):
    """Rebuild ``stmt`` through For / SeqStmt / SBlockRealize (body and init) / IfThenElse,
    keeping every unchanged node.  ``on_for(loop, visit)`` returns the replacement of a
    ``For`` (``visit`` rewrites a sub-statement) or None to go on into its body."""
    from tvm.s_tir.stmt import SBlock, SBlockRealize

    def visit(stmt):
        if isinstance(stmt, tirx.For):
            new = on_for(stmt, visit)
            if new is not None:
                return new
            body = visit(stmt.body)
            if body.same_as(stmt.body):
                return stmt
            return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body,
                            stmt.thread_binding, stmt.annotations, stmt.step, stmt.span)
        if isinstance(stmt, tirx.SeqStmt):
            seq = [visit(x) for x in stmt.seq]
            if all(x.same_as(y) for x, y in zip(seq, stmt.seq)):
                return stmt
            return tirx.SeqStmt(seq, stmt.span)
        if isinstance(stmt, SBlockRealize):
            blk = stmt.block
            body = visit(blk.body)
            init = visit(blk.init) if blk.init is not None else None
            if body.same_as(blk.body) and (init is None or init.same_as(blk.init)):
                return stmt
            new_blk = SBlock(blk.iter_vars, blk.reads, blk.writes, blk.name_hint, body,
                             init, blk.alloc_buffers, blk.match_buffers, blk.annotations,
                             blk.span)
            return SBlockRealize(stmt.iter_values, stmt.predicate, new_blk, stmt.span)
        if isinstance(stmt, tirx.IfThenElse):
            then = visit(stmt.then_case)
            els = visit(stmt.else_case) if stmt.else_case is not None else None
            if then.same_as(stmt.then_case) and (els is None or els.same_as(stmt.else_case)):
                return stmt
            return tirx.IfThenElse(stmt.condition, then, els, stmt.span)
        return stmt

    return visit(stmt)


def build(mod, target="cuda"):
    """Build a PrimFunc (as ``main``) or a module with :func:`pit_tvm.target.build`, which turns
    ``tirx.use_async_copy`` on for CUDA (cp.async for the pipelined copies)."""
    from pit_tvm.target import build as _build  # local: avoid import cycles

    if isinstance(mod, tirx.PrimFunc):
        mod = tvm.IRModule({"main": mod})
    return _build(mod, target)


_CANDIDATES = (
    TensorCoreConfig(),                                                   # 128x128x32, 4 warps
    TensorCoreConfig(stages=4),
    TensorCoreConfig(stages=2),
    TensorCoreConfig(stages=1),
    TensorCoreConfig(block_k=64, stages=3),
    TensorCoreConfig(block_n=256, stages=3),                              # 8 warps
    TensorCoreConfig(block_m=256, stages=3),                              # 8 warps
    TensorCoreConfig(block_m=64, block_n=128, warp_m=32, warp_n=64, stages=4),
    TensorCoreConfig(block_m=64, block_n=64, warp_m=32, warp_n=32, stages=4),
    TensorCoreConfig(block_m=32, block_n=128, warp_m=32, warp_n=32, stages=4),
)


def valid_configs(k: int, n: int, in_dtype: str = "float16",
                  arch: str = "sm_90") -> list[TensorCoreConfig]:
    """The candidate configs (the design space's support) that fit a (K, N) problem."""
    max_smem = max_smem_bytes(arch)
    return _fitting(_CANDIDATES, lambda cfg: check_config(k, n, in_dtype, cfg, max_smem))
