"""The plan of a PIT matmul: its TensorIR workload, the index layout of a micro-tile, and the
row counts a kernel is planned for.

Nothing here builds a kernel: :mod:`.backends` chooses one for a plan and a target.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from pit_tvm._args import micro_tile_pair, positive_int

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


def matmul_workload(k: int, n: int, dtype: str, out_dtype: str, wide_extents: bool = False) -> tirx.PrimFunc:
    """The dense TensorIR matmul PIT is derived from (M symbolic).

    ``wide_extents``: K and N as int64 extents, like M.  The CUDA SIMT schedule needs them
    where its ``pad_einsum`` pads K (or some N, :func:`_with_extents_that_lower`): with int32
    K, N the padding predicate meets M's int64 loop and TVM's lowering fails ("mismatched
    types. int32 vs. int64").  Other shapes keep int32 (their CUDA unchanged)."""
    if wide_extents:
        k, n = T.int64(k), T.int64(n)

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

    def index_sizes(self, m):
        """(groups, capacity) of the index for ``m`` rows; ``m`` an int or a TIR expression."""
        mr, mc = self.index_micro_tile
        tile_rows = (m + mr - 1) // mr
        tile_cols = (self.k + mc - 1) // mc
        groups = tile_cols if self.index_group == "col" else tile_rows
        return groups, tile_rows * tile_cols


def validate(k, n, dtype, micro_tile):
    """Check the op's shape arguments, each error naming the argument: K and N positive ints
    (numpy ints too; floats and bools refused, never truncated), ``dtype`` one of
    :data:`SUPPORTED_DTYPES`, ``micro_tile`` a pair of positive ints (or ``"RxC"``) no wider
    than K.  Returns ``(mr, mk)``."""
    positive_int(k, "K")
    positive_int(n, "N")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: PIT matmul supports {', '.join(SUPPORTED_DTYPES)}")
    mr, mk = micro_tile_pair(micro_tile)
    if mk > k:
        raise ValueError(f"micro-tile {mr}x{mk} does not fit the PIT axis K={k}: its width {mk} exceeds K "
                         f"(whole rows are ({mr}, {k}))")
    return mr, mk


#: rows of the thinnest strip the tensor-core tiles kernel takes (one m16n8k16 tile)
TC_MIN_STRIP = 16


def tensor_core_plan(plan: MatmulPlan) -> MatmulPlan | None:
    """The plan a tensor-core kernel runs for ``plan``: itself, or for a tiles micro-tile
    thinner than an mma tile (e.g. 1x64) the ``16 x mk`` cover of it (a 16-row strip's
    k-tile is listed when any of its rows' micro-tiles is non-zero: more zeros computed,
    same result); None for whole rows of more than one row."""
    mr, mk = plan.micro_tile
    if plan.kind == "rows":
        return plan if mr == 1 else None
    if mr < TC_MIN_STRIP and TC_MIN_STRIP % mr == 0:
        return MatmulPlan(plan.k, plan.n, (TC_MIN_STRIP, mk))
    return plan


#: the fraction of a PIT matmul's rows a tile-width choice plans for by default (the count is
#: only known on the device; a rows index is there because rows are expected to be missing);
#: ``expected_density`` of emit_pit_matmul / compile_onnx replaces it
PIT_EXPECTED_DENSITY = 0.5


def planned_density(value) -> float:
    """``value`` (a fraction of rows in (0, 1]) or the default; ValueError naming it otherwise"""
    if value is None:
        return PIT_EXPECTED_DENSITY
    density = float(value)
    if not 0.0 < density <= 1.0:
        raise ValueError(f"expected_density is a fraction of rows in (0, 1], got {value!r}")
    return density


def expected_rows(m, fraction: float):
    """``fraction`` of a static row count, or None for a symbolic one."""
    return max(1, int(int(m) * fraction)) if isinstance(m, (int, tirx.IntImm)) else None


def effective_density_threshold(density_threshold, dense_kernel_takes_full_index: bool):
    """The density threshold the index applies: ``density_threshold`` only where a dense kernel
    runs a full index (the wgmma tiles kernels on sm_90a: TMA loads, or a dense kernel in
    place), else None.  Elsewhere (whole rows on every target, the CPU, the mma.sync and SIMT
    tiles kernels) the kernel gathers through the index whatever it lists, so listing every
    micro-tile would only compute the zero ones, and would make a NaN / Inf in B reach C through
    them (0 * NaN) above the threshold only: off, a skipped micro-tile contributes exactly 0 at
    every density (docs/guide/semantics.md)."""
    return density_threshold if dense_kernel_takes_full_index else None

