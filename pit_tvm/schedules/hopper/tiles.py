"""The tiles kind on the H100 (sm_90a): micro-tiles ``(128, mk)`` along K, each 128-row strip
of A listing its non-zero micro-tile columns; the CTA of strip g computes a 128 x block_n tile
of C from the strip's listed K positions (A's columns, or the compacted A of
:mod:`.compact_a` for micro-tiles under 16 bytes, and B's matching rows), and stores every row
of it.  Its dense fallback (a full index) is the same kernel warp-specialized, or a dense
kernel of its own run in place after it."""
from __future__ import annotations

import functools

from tvm import tirx

from pit_tvm.schedules.hopper.config import BLOCK_K, BLOCK_M, TARGET, WGMMA_ARCH, WgmmaConfig
from pit_tvm.schedules.hopper.gemm_body import gemm_kernel, index_is_full  # noqa: F401 (index_is_full: docs)
from pit_tvm.schedules.hopper.lowering import lower_tirx
from pit_tvm.schedules.hopper.planner import (needs_compaction, wgmma_config, wgmma_tiles_applies,
                                              wgmma_tiles_config)

__all__ = ["wgmma_tiles_gather_func", "wgmma_dense_fallback_func", "index_is_full"]


@functools.lru_cache(maxsize=64)
def wgmma_tiles_gather_func(k: int, n: int, mk: int, in_dtype: str = "float16",
                            out_dtype: str = "float16", config: WgmmaConfig | None = None,
                            bias: bool = False, residual: bool = False) -> tirx.PrimFunc:
    """The lowered wgmma PIT matmul for micro-tiles ``(128, mk)`` along K (the "tiles" kind).

    Parameters ``(a, b, offsets, ids, c)`` with the index of
    :func:`pit_tvm.index.tile_index_func` for ``(128, mk)``, ``group="row"``: strip ``g``
    (rows ``128g .. 128g+127``) lists its non-zero micro-tile columns in
    ``ids[offsets[g]:offsets[g+1]]``.  CTA ``(n tile, g)`` runs ``ceil(cnt_g * mk / 64)`` K
    tiles (read on the device): A's rows ``128g..`` at the strip's compact K positions and
    B's rows at the same K columns (16-byte cp.async, zero-filled past the count), wgmma as
    in the rows kernel, and stores every row of C (a strip with nothing listed stores zeros).
    When :func:`needs_compaction`, ``a`` must be the output of :func:`.compact_a.wgmma_compact_a_func`
    (K position q of strip g in column q), otherwise A itself.  Epilogue (:func:`_tiles_epilogue`):
    ``bias`` (a ``[N]`` parameter after ``ids``), then ``residual`` (a ``[M, N]`` parameter of
    the output dtype, added last): ``c = a @ b + bias + residual``, every row.

    A full index (:func:`index_is_full`): with ``config.tiles_ws`` the kernel computes the
    dense product itself; otherwise it stores nothing and :func:`wgmma_dense_fallback_func`
    runs after it."""
    _tiles_epilogue(bias, residual)
    config = config or wgmma_tiles_config(n, mk, out_dtype=out_dtype, residual=residual)
    if (not wgmma_tiles_applies(k, n, (BLOCK_M, mk), in_dtype, out_dtype, WGMMA_ARCH) or n % config.block_n
            or config.block_k != BLOCK_K):
        raise ValueError(f"wgmma tiles need K % {BLOCK_K} == 0, K % mk == 0 (mk < K), N % block_n == 0, "
                         f"block_k {BLOCK_K} and fp16/bf16 in, got K={k}, mk={mk}, N={n}, {config}, "
                         f"{in_dtype} -> {out_dtype}")
    func = gemm_kernel(int(k), int(n), in_dtype, out_dtype, bool(bias), None, "tiles", config, mk=int(mk),
                        a_compact=needs_compaction(mk, in_dtype), residual=bool(residual))
    return lower_tirx(func, TARGET)


def _tiles_epilogue(bias: bool, residual: bool) -> None:
    """The tiles kind's epilogues: none, a bias, or a bias then a residual (an FFN's second
    matmul and its skip connection); ValueError otherwise."""
    if residual and not bias:
        raise ValueError("residual comes with a bias (the kernel variants that take it)")


@functools.lru_cache(maxsize=64)
def wgmma_dense_fallback_func(k: int, n: int, mk: int, in_dtype: str = "float16",
                              out_dtype: str = "float16", config: WgmmaConfig | None = None,
                              bias: bool = False, residual: bool = False) -> tirx.PrimFunc:
    """The dense kernel of the tiles kind's dense fallback, ``(a, b, offsets[, bias[, residual]],
    c)``: ``c = a @ b (+ bias + residual)`` when the ``(128, mk)`` tiles index lists every
    micro-tile (:func:`index_is_full`), else it loads and stores nothing.  Called in place on
    the tiles kernel's output, which skips its work exactly when this one runs: a full index
    through the tiles kernel (and, for thin micro-tiles, the A compaction) cost up to twice the
    dense kernel on the H100."""
    _tiles_epilogue(bias, residual)
    config = config or wgmma_config(n)
    if not wgmma_tiles_applies(k, n, (BLOCK_M, mk), in_dtype, out_dtype, WGMMA_ARCH) or n % config.block_n:
        raise ValueError(f"no wgmma tiles kind for K={k}, mk={mk}, N={n}, {config}, {in_dtype} -> {out_dtype}")
    func = gemm_kernel(int(k), int(n), in_dtype, out_dtype, bool(bias), None, "dense", config, full_mk=int(mk),
                        residual=bool(residual))
    return lower_tirx(func, TARGET)

