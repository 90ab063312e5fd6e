"""The strips listing's pieces shared by the one-pass strips kernel
(:mod:`pit_tvm.schedules.wgmma_strips`) and a dense GEMM that lists its C's strips in its
epilogue: the state words (one per 128-row strip) and the step of the CTA completing a strip."""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.schedules.hopper.config import BLOCK_M
from pit_tvm.schedules.limits import dtype_bytes


def strip_state_words(m):
    """the strips listing's state words for ``m`` rows (an int or a TIR expression): one per
    128-row strip"""
    return (m + BLOCK_M - 1) // BLOCK_M


def strip_closer(mk: int, compact: bool, dtype: str):
    """The ``T.macro`` ``close_strip(tid, g, m, end, AC, CNT, ST)`` that the CTA completing strip
    ``g`` of a strips listing runs (the one-pass strips kernel and a dense kernel listing its
    C's strips): with ``compact``, zeros in the compacted ``AC`` from column ``end * mk`` up to
    the next 16-byte chunk (the tiles kernel reads whole chunks); the strip's count ``end``; its
    state word zeroed for the next call."""
    vec = 16 // dtype_bytes(dtype)
    zero = tirx.const(0, dtype)

    @T.macro
    def close_strip(tid, g, m, end, AC, CNT, ST):
        if compact:
            if tid < vec:
                if end * mk + tid < (end * mk + vec - 1) // vec * vec:
                    for i in T.serial(BLOCK_M):
                        if g * BLOCK_M + i < m:
                            AC[g * BLOCK_M + i, end * mk + tid] = zero
        if tid == 0:
            CNT[g] = end
            ST[g] = T.float64(0)

    return close_strip
