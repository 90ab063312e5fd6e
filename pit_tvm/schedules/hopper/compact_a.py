"""SRead of A for thin micro-tiles (under 16 bytes wide) as a kernel of its own: the strips'
listed columns of A gathered into a compacted copy that the tiles GEMM reads with 16-byte
copies (a 2-byte gather inside the GEMM would be a load per element on its critical path)."""
from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.index.tiles import strip_column, strip_positions
from pit_tvm.schedules.hopper.config import BLOCK_K, BLOCK_M, TARGET, THREADS
from pit_tvm.schedules.hopper.gemm_body import index_is_full
from pit_tvm.schedules.hopper.lowering import lower_tirx

__all__ = ["wgmma_compact_a_func"]


@functools.lru_cache(maxsize=64)
def wgmma_compact_a_func(k: int, mk: int, in_dtype: str = "float16") -> tirx.PrimFunc:
    """SRead of A for thin micro-tiles, as a kernel of its own: ``Ac[128g + i, q] =
    A[128g + i, column(q)]`` for the strip's compact positions ``q < cnt_g * mk``, zeros up to
    the next multiple of 64 (the tiles kernel's K tile); columns past that are not written.
    Parameters ``(a, offsets, ids, ac)``, index as for :func:`.tiles.wgmma_tiles_gather_func`."""
    K, MK = int(k), int(mk)
    MKT = K // MK
    ROWS = 8                              # rows per CTA: a thread reads one column for 8 rows
    zero = tirx.const(0, in_dtype)

    def n_valid(off_buf, g):
        return strip_positions(off_buf, g, MK)

    def column(off_buf, ids_buf, m, g, q):
        return strip_column(off_buf, ids_buf, g, q, MK, (m + BLOCK_M - 1) // BLOCK_M * MKT - 1)

    @T.prim_func(s_tir=False)
    def kernel(a: T.handle, offsets: T.handle, ids: T.handle, ac: T.handle):
        M = T.int64()
        A = T.match_buffer(a, (M, K), in_dtype)
        OFF = T.match_buffer(offsets, ((M + BLOCK_M - 1) // BLOCK_M + 1,), "int32")
        IDS = T.match_buffer(ids, ((M + BLOCK_M - 1) // BLOCK_M * MKT,), "int32")
        AC = T.match_buffer(ac, (M, K), in_dtype)
        T.device_entry()
        rb, g = T.cta_id([BLOCK_M // ROWS, T.Cast("int32", (M + BLOCK_M - 1) // BLOCK_M)])
        tid = T.thread_id([THREADS])
        m = T.Cast("int32", M)
        if T.Not(index_is_full(OFF, m, MKT)):      # (a full index runs the dense fallback on A)
            for q0 in T.serial(((n_valid(OFF, g) + BLOCK_K - 1) // BLOCK_K * BLOCK_K + THREADS - 1) // THREADS):
                if q0 * THREADS + tid < (n_valid(OFF, g) + BLOCK_K - 1) // BLOCK_K * BLOCK_K:
                    for i in T.unroll(ROWS):
                        if g * BLOCK_M + rb * ROWS + i < m:
                            AC[g * BLOCK_M + rb * ROWS + i, q0 * THREADS + tid] = T.if_then_else(
                                q0 * THREADS + tid < n_valid(OFF, g),
                                A[g * BLOCK_M + rb * ROWS + i, column(OFF, IDS, m, g, q0 * THREADS + tid)],
                                zero)

    return lower_tirx(kernel, TARGET)
