"""PIT matmul: ``C = A @ B`` with A dynamically sparse, built from rules, index and SRead/SWrite.

The workload is an ordinary TensorIR matmul (fp32 accumulate into ``acc``, then a ``cast``
epilogue into C). PIT is applied to it by the primitives in :mod:`pit_tvm.schedules`:

* **rows** (micro-tile ``(mr, K)``: whole rows, ``mr`` rows each): the spatial axis ``i`` is
  permuted: SRead gathers the non-zero rows of A, SWrite scatters the result rows of C
  (zero rows of A give zero rows of C, filled first).
* **tiles** (micro-tile ``(mr, mk)`` with ``mk < K``: ``32x1`` along K, ``32x64`` blocks, ``1x64``):
  the reduction axis ``k`` is permuted per strip of ``mr`` rows: SRead gathers the non-zero
  micro-tiles of the strip from A and the matching rows of B; no scatter is needed.

The index is built on the device every call (:mod:`pit_tvm.index`); its count never leaves
the device: grids and loops are worst-case sized and the iterations past the count exit at
once (:func:`pit_tvm.schedules.sparse_access.lower_pit`). A device-side density check
(``density_threshold``) selects between the PIT kernel and the dense kernel: both are launched,
and the one not selected returns immediately.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import tvm
from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.schedules.sparse_access import PitIndex, sread, swrite
from pit_tvm.target import build, device_for, is_gpu, make_target

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


def matmul_workload(k: int, n: int, dtype: str, out_dtype: str) -> tirx.PrimFunc:
    """The dense TensorIR matmul PIT is derived from (M symbolic)."""

    @T.prim_func(s_tir=True)
    def matmul(a: T.handle, b: T.handle, c: T.handle):
        T.func_attr({"global_symbol": "matmul", "tirx.noalias": True})
        m = T.int64()
        A = T.match_buffer(a, (m, k), dtype)
        B = T.match_buffer(b, (k, n), dtype)
        C = T.match_buffer(c, (m, n), out_dtype)
        acc = T.sblock_alloc_buffer((m, n), "float32")
        for i, j, kk in T.grid(m, n, k):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                with T.init():
                    acc[vi, vj] = T.float32(0)
                acc[vi, vj] = acc[vi, vj] + T.Cast("float32", A[vi, vk]) * T.Cast("float32", B[vk, vj])
        for i, j in T.grid(m, n):
            with T.sblock("cast"):
                vi, vj = T.axis.remap("SS", [i, j])
                C[vi, vj] = T.Cast(out_dtype, acc[vi, vj])

    return matmul


@dataclass(frozen=True)
class MatmulPlan:
    """What PIT does for one (K, N, micro-tile): the index layout and the permuted axis."""

    k: int
    n: int
    micro_tile: tuple[int, int]

    @property
    def kind(self) -> str:
        return "rows" if self.micro_tile[1] >= self.k else "tiles"

    @property
    def index_group(self) -> str:
        # rows: one group listing tile-rows; tiles: per strip of mr rows, its non-zero k-tiles
        return "col" if self.kind == "rows" else "row"

    @property
    def index_micro_tile(self) -> tuple[int, int]:
        mr, mk = self.micro_tile
        return (mr, self.k) if self.kind == "rows" else (mr, mk)


def _validate(k, n, dtype, micro_tile):
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: PIT matmul supports {SUPPORTED_DTYPES}")
    if not (isinstance(k, (int, np.integer)) and isinstance(n, (int, np.integer)) and k > 0 and n > 0):
        raise ValueError(f"K and N must be positive ints, got K={k!r}, N={n!r}")
    if len(micro_tile) != 2 or any(int(x) <= 0 for x in micro_tile):
        raise ValueError(f"micro_tile must be two positive ints (rows, cols), got {micro_tile!r}")
    mr, mk = (int(x) for x in micro_tile)
    if mk > k:
        raise ValueError(f"micro-tile {mr}x{mk} does not fit the PIT axis K={k}: its width {mk} exceeds K")
    return mr, mk


def pit_matmul_func(k: int, n: int, dtype: str, out_dtype: str, micro_tile, target) -> tirx.PrimFunc:
    """The PIT kernel for ``micro_tile``, scheduled for ``target``.

    Signature: ``(A[M,K], B[K,N], offsets, ids, C[M,N])`` with the index layout of
    :func:`pit_tvm.index.tile_index_func` for :class:`MatmulPlan` ``.index_group``/``.index_micro_tile``.
    """
    plan = MatmulPlan(k, n, tuple(int(x) for x in micro_tile))
    mr, mk = plan.micro_tile
    func = matmul_workload(k, n, dtype, out_dtype)
    sch = tvm.s_tir.Schedule(tvm.IRModule({"matmul": func}))
    sch.work_on("matmul")
    m = func.params[0].shape[0]
    if plan.kind == "rows":
        groups, capacity = tirx.const(1, "int64"), tirx.floordiv(m + mr - 1, mr)
        index = PitIndex.create("pit", capacity, groups, micro=mr)
        sch = sread(sch, "matmul", "A", "vi", index)
        sch = swrite(sch, "cast", "C", "vi", index)
    else:
        groups = tirx.floordiv(m + mr - 1, mr)
        capacity = groups * ((k + mk - 1) // mk)
        index = PitIndex.create("pit", capacity, groups, micro=mk, group_axis="vi", group_micro=mr)
        sch = sread(sch, "matmul", "A", "vk", index)
        sch = sread(sch, "matmul", "B", "vk", index)
    from pit_tvm.schedules.matmul import schedule_pit_matmul

    return schedule_pit_matmul(sch, plan, target)


def dense_matmul_func(k: int, n: int, dtype: str, out_dtype: str, target) -> tirx.PrimFunc:
    """The dense kernel with the same schedule (the fair baseline and the fallback)."""
    from pit_tvm.schedules.matmul import schedule_dense_matmul

    func = matmul_workload(k, n, dtype, out_dtype)
    sch = tvm.s_tir.Schedule(tvm.IRModule({"matmul": func}))
    sch.work_on("matmul")
    return schedule_dense_matmul(sch, target)
