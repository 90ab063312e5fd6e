"""The Hopper wgmma GEMMs under their first import path: everything here is re-exported from
:mod:`pit_tvm.schedules.hopper` (config, planner, the kernels), where the pieces live."""
from __future__ import annotations

from pit_tvm.schedules.hopper.barriers import exit_thread as _exit_thread  # noqa: F401
from pit_tvm.schedules.hopper.compact_a import wgmma_compact_a_func
from pit_tvm.schedules.hopper.config import (BLOCK_K, BLOCK_M, DENSE_ATTR, LOADER_THREADS, MAX_SMEM_BYTES,  # noqa: F401
                                             RASTER_M, ROWS_ATTR, STORE_BATCH, STORER_THREADS, THREADS,
                                             WGMMA_ARCH, BCopyLayout, WgmmaConfig)
from pit_tvm.schedules.hopper.config import TARGET as _TARGET  # noqa: F401
from pit_tvm.schedules.hopper.epilogue import gelu_erf  # noqa: F401
from pit_tvm.schedules.hopper.rows import dense_kernel_args, wgmma_row_gather_func
from pit_tvm.schedules.hopper.tiles import index_is_full, wgmma_dense_fallback_func, wgmma_tiles_gather_func
from pit_tvm.schedules.hopper.lowering import lower_tirx
from pit_tvm.schedules.hopper.planner import (FEW_ROWS_STAGES, MAX_STAGES, SMS, TILE_SPEED,  # noqa: F401
                                              needs_compaction, residual_spills_ws, tiles_ws_applies, wgmma_applies,
                                              wgmma_config, wgmma_few_rows_tiers, wgmma_tiles_applies,
                                              wgmma_tiles_config)
from pit_tvm.schedules.hopper.smem import PTX_TYPE as _PTX_TYPE  # noqa: F401
from pit_tvm.schedules.hopper.smem import SWIZZLE_64B as _SWIZZLE_64B  # noqa: F401
from pit_tvm.schedules.hopper.smem import SWIZZLE_128B as _SWIZZLE_128B  # noqa: F401
from pit_tvm.schedules.hopper.strips import strip_closer, strip_state_words

__all__ = ["WgmmaConfig", "BCopyLayout", "WGMMA_ARCH", "wgmma_applies", "wgmma_config", "wgmma_tiles_config",
           "tiles_ws_applies", "residual_spills_ws", "wgmma_row_gather_func",
           "wgmma_few_rows_tiers",
           "wgmma_tiles_applies", "needs_compaction", "wgmma_tiles_gather_func",
           "wgmma_compact_a_func", "wgmma_dense_fallback_func", "index_is_full", "lower_tirx", "DENSE_ATTR", "ROWS_ATTR",
           "dense_kernel_args", "strip_state_words", "strip_closer"]
