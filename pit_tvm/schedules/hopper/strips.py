"""The strips listing's pieces shared by the one-pass strips kernel
(:mod:`pit_tvm.schedules.wgmma_strips`) and a dense GEMM that lists its C's strips in its
epilogue: the state words (one per 128-row strip), the step of the CTA completing a strip, and
the GEMM epilogue's listing of its staged C tile (:class:`TileStripLister`)."""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.index._tile_kernels import lanes_below, state_add, state_completes, state_listed, warp_ballot
from pit_tvm.schedules.hopper.config import BLOCK_M, THREADS, c_row_pitch, c_stage_elems
from pit_tvm.schedules.hopper.planner import needs_compaction
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


class TileStripLister:
    """A dense GEMM's epilogue listing the non-zero ``(128, strips_mk)`` micro-tiles of its
    128 x ``block_n`` staged C tile in C's strips index (:func:`strip_closer` closes a strip).

    Scratch (int32 words ``S_LISTED..``) after the staged C tile: a flag per micro-tile of the
    CTA's columns, the tile column of each output slot, each warp's listed count, and (base,
    last) of the CTA's atomic add.  Per thread, one int32 local array ``sloc`` of
    :data:`SLOTS` values: whether its micro-tile is listed, its rank in its warp and in the CTA,
    the CTA's listed count, the CTA's base in the strip, whether the CTA completes the strip, an
    output slot's tile column."""

    SLOTS = 7

    def __init__(self, block_n: int, n: int, out_dtype: str, strips_mk: int):
        BM, BN, N = BLOCK_M, block_n, n
        C_ROW = c_row_pitch(BN, out_dtype)
        C_VEC = 16 // dtype_bytes(out_dtype)
        C_CHUNKS = BM * BN // C_VEC // THREADS
        C_ROW_CHUNKS = BN // C_VEC
        self.S_NMT = S_NMT = BN // strips_mk             # micro-tiles per CTA
        self.S_MKT = S_MKT = N // strips_mk              # micro-tiles per strip of C
        self.S_COMPACT = S_COMPACT = needs_compaction(strips_mk, out_dtype)
        self.S_LISTED = S_LISTED = (c_stage_elems(BN, out_dtype) * dtype_bytes(out_dtype) + 3) // 4
        S_SRC = S_LISTED + S_NMT
        S_WARPS = S_SRC + BN
        S_INFO = S_WARPS + THREADS // 32
        self.smem_bytes = (S_INFO + 2) * 4
        MINE, WARP_RANK, RANK, LISTED, BASE, LAST, SLOT_COL = range(self.SLOTS)
        close_strip = strip_closer(strips_mk, S_COMPACT, out_dtype)

        @T.macro
        def list_tile(bn, bm, tid, m, smem, ST, orw, ballot, sloc, old):
            """strips, first half (before the SWrite, which then hides the atomic's latency): the
            micro-tiles of this CTA's columns that a row of C makes non-zero, each one's rank among
            them (a warp ballot, then the warps' counts), their output slots' tile columns, and the
            atomic add that places them in the strip"""
            # the staged tile's 16-byte chunks as the SWrite reads them (chunk tid % (BN / 8) of rows
            # tid / (BN / 8) + (2048 / BN) j), OR-ed over this thread's rows of C without their sign
            # bits: half h of word e is non-zero where column 8 chunk + 2 e + h is in one of them
            for e in T.unroll(4):
                orw[e] = T.uint32(0)
            for j in T.unroll(C_CHUNKS):
                for e in T.unroll(4):
                    # (rows past M masked, not skipped: the four loads stay one 16-byte load)
                    orw[e] = T.bitwise_or(orw[e], T.bitwise_and(
                        smem.view("uint32")[((tid + THREADS * j) // C_ROW_CHUNKS * C_ROW
                                             + (tid + THREADS * j) % C_ROW_CHUNKS * C_VEC) // 2 + e],
                        T.if_then_else(bm * BM + (tid + THREADS * j) // C_ROW_CHUNKS < m, T.uint32(0xFFFFFFFF),
                                       T.uint32(0))))
            for e in T.unroll(4):
                for h in T.unroll(2):
                    if T.bitwise_and(T.shift_right(orw[e], T.uint32(16 * h)), T.uint32(0x7FFF)) != T.uint32(0):
                        # (all write 1)
                        smem.view("int32")[S_LISTED + (tid % C_ROW_CHUNKS * C_VEC + 2 * e + h) // strips_mk] = 1
            T.cuda.cta_sync()
            sloc[MINE] = 0
            if tid < S_NMT:
                sloc[MINE] = smem.view("int32")[S_LISTED + tid]
            ballot[0] = warp_ballot(sloc[MINE] != 0)
            sloc[WARP_RANK] = lanes_below(ballot[0], tid % 32)
            if tid % 32 == 0:
                smem.view("int32")[S_WARPS + tid // 32] = T.Cast("int32", T.popcount(ballot[0]))
            T.cuda.cta_sync()
            sloc[RANK] = sloc[WARP_RANK]
            sloc[LISTED] = 0
            for i in T.unroll(THREADS // 32):
                sloc[LISTED] = sloc[LISTED] + smem.view("int32")[S_WARPS + i]
                if i < tid // 32:
                    sloc[RANK] = sloc[RANK] + smem.view("int32")[S_WARPS + i]
            if S_COMPACT:
                if sloc[MINE] != 0:
                    for e in T.unroll(strips_mk):
                        smem.view("int32")[S_SRC + sloc[RANK] * strips_mk + e] = tid * strips_mk + e
            if tid == 0:
                old[0] = T.cuda.atomic_add(T.address_of(ST[bm]), state_add(sloc[LISTED], 1))

        @T.macro
        def place_tile(bn, bm, tid, m, p0, smem, ST, CNT, SIDS, AC, sloc, old):
            """strips, second half: the listed micro-tiles' ids at the CTA's base in the strip's list,
            (compacting) their columns of the staged C tile into Ac at the same positions, a warp
            per row; the strip's last CTA writes its count, Ac's zeros up to the next 16-byte chunk,
            and a zero state"""
            if tid == 0:
                smem.view("int32")[S_INFO] = state_listed(old[0])
                smem.view("int32")[S_INFO + 1] = state_completes(old[0], N // BN)
            T.cuda.cta_sync()
            sloc[BASE] = smem.view("int32")[S_INFO]
            sloc[LAST] = smem.view("int32")[S_INFO + 1]
            if sloc[MINE] != 0:
                SIDS[bm * S_MKT + sloc[BASE] + sloc[RANK]] = bn * S_NMT + tid
            if S_COMPACT:
                # output slot l + 32 t of rows w + 8 rr (warp w, lane l): every row's load of a slot
                # issued together
                for t in T.serial((sloc[LISTED] * strips_mk + 31) // 32):
                    if tid % 32 + 32 * t < sloc[LISTED] * strips_mk:
                        sloc[SLOT_COL] = smem.view("int32")[S_SRC + tid % 32 + 32 * t]
                        for rr in T.unroll(BM // (THREADS // 32)):
                            if p0 + tid // 32 + 8 * rr < m:
                                AC[p0 + tid // 32 + 8 * rr, sloc[BASE] * strips_mk + tid % 32 + 32 * t] = \
                                    smem.view(out_dtype)[(tid // 32 + 8 * rr) * C_ROW + sloc[SLOT_COL]]
            if sloc[LAST] != 0:
                close_strip(tid, bm, m, sloc[BASE] + sloc[LISTED], AC, CNT, ST)

        self.list_tile, self.place_tile = list_tile, place_tile
