"""The grouped GEMM's expert tiles (:mod:`.grouped`): which (expert, 128-row tile of the
expert's rows) pair a CTA computes, and the rows of C that no tile stores.

The grid enumerates the pairs flat: CTA ``bt`` (of :func:`pair_grid` per N tile, enough for
any routing) takes the ``bt``-th pair in expert order, found by a prefix sum of the
experts' tile counts ``ceil(count_e / 128)`` in the CTA (a warp-shuffle scan over one expert a
thread, two CTA barriers).  A hot expert's rows spread over as many CTAs as a balanced
routing's, so skewed routing keeps the SMs as busy.  The CTAs past the last pair (at least
``ceil((P - offsets[E]) / 128)`` of them, see docs/design/moe.md) store the rows no tile does.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.schedules.hopper.config import BLOCK_M, THREADS
from pit_tvm.schedules.limits import dtype_bytes

#: the registers ``expert_tile`` fills: the expert (-1: a CTA past the last pair), the tile's
#: first compacted row, the end of the expert's rows (0 past the last pair), the pairs in all
EXPERT, FIRST_ROW, END, PAIRS = range(4)


def pair_grid(rows, num_experts: int):
    """The CTAs of an N tile for ``rows`` (P, int64) compacted rows: ``ceil(P / 128) + min(E,
    P)``, at least 1.  The pairs are at most ``floor(offsets[E] / 128)`` plus the experts that
    receive a row (at most ``min(E, P)``), so the CTAs past them are at least
    ``ceil((P - offsets[E]) / 128)``: enough for gather's zero rows.  (``min(E, P)``, not E:
    at decode size most of E CTAs an N tile would only scan and exit, each holding an SM's
    shared memory while it does.)"""
    p = T.Cast("int32", rows)
    return T.max((p + BLOCK_M - 1) // BLOCK_M + T.min(p, num_experts), 1)


class ExpertRow:
    """Row ``expert`` of a ``[E, N]`` buffer, indexed by column (the epilogue's bias)."""

    def __init__(self, buf, expert):
        self.buf = buf
        self.expert = expert

    def __getitem__(self, col):
        return self.buf[self.expert, col]


class ExpertTiles:
    """The expert-tile macros of a grouped GEMM over ``num_experts`` (<= 256) experts, mode
    "gather" (C's rows are the compacted rows) or "scatter" (C's rows are the flat assignment
    ids), C ``[P, n]`` of ``out_dtype`` in ``block_n``-column tiles; ``smem_words``: the int32
    words of the kernel's dynamic shared memory (scatter's flags of listed ids)."""

    def __init__(self, num_experts: int, mode: str, n: int, block_n: int, out_dtype: str, smem_words: int):
        if not 0 < num_experts <= THREADS:
            raise ValueError(f"the expert tiles scan one expert a thread: 1..{THREADS} experts, got {num_experts}")
        self.expert_tile = _expert_tile(num_experts)
        self.store_unlisted = _store_unlisted(num_experts, mode, n, block_n, out_dtype,
                                              smem_words // THREADS * THREADS)


def _expert_tile(E):
    WARPS = THREADS // 32

    @T.macro
    def expert_tile(bt, tid, OFF, grp):
        """(every thread of the CTA) ``grp`` <- pair ``bt``'s expert, first row and end (see
        :data:`EXPERT`).  Thread t < E counts expert t's tiles; a shuffle scan within each warp,
        the warps' totals added after one barrier; the thread whose expert's tile range holds
        ``bt`` writes the pair to shared memory, read by all after a second barrier.  (Two
        shared buffers: the sync planner cannot tell the totals' reads from the pair's writes;
        ``tvm_storage_sync``, not ``cta_sync``: the barriers it knows, so it adds none.)"""
        v = T.alloc_local([2], "int32")     # the inclusive prefix of tile counts, this expert's count
        warp_total = T.alloc_buffer([WARPS], "int32", scope="shared", align=16)
        grp_s = T.alloc_buffer([4], "int32", scope="shared", align=16)
        lane = tid % 32
        if tid < THREADS:
            v[1] = 0
            if tid < E:
                v[1] = (OFF[tid + 1] - OFF[tid] + BLOCK_M - 1) // BLOCK_M
            v[0] = v[1]
            for d in T.unroll(5):
                up = T.call_extern("int32", "__shfl_up_sync", T.uint32(0xFFFFFFFF), v[0], T.shift_left(1, d), 32)
                if lane >= T.shift_left(1, d):
                    v[0] = v[0] + up
            if lane == 31:
                warp_total[tid // 32] = v[0]
        if tid == 0:
            grp_s[EXPERT] = -1
            grp_s[FIRST_ROW] = 0
            grp_s[END] = 0
        T.tvm_storage_sync("shared")
        if tid < THREADS:
            for w in T.unroll(WARPS):
                if w < tid // 32:
                    v[0] = v[0] + warp_total[w]
            if tid < E:
                if T.And(v[0] - v[1] <= bt, bt < v[0]):
                    grp_s[EXPERT] = tid
                    grp_s[FIRST_ROW] = OFF[tid] + (bt - (v[0] - v[1])) * BLOCK_M
                    grp_s[END] = OFF[tid + 1]
            if tid == THREADS - 1:
                grp_s[PAIRS] = v[0]
        T.tvm_storage_sync("shared")
        for i in T.unroll(4):
            grp[i] = grp_s[i]

    return expert_tile


def _store_unlisted(E, mode, N, BN, out_dtype, CAP):
    C_VEC = 16 // dtype_bytes(out_dtype)
    C_ROW_CHUNKS = BN // C_VEC
    C_CHUNKS = BLOCK_M * BN // C_VEC // THREADS
    NB = N // BN
    zero = tirx.const(0, out_dtype)

    @T.macro
    def store_unlisted(bn, s, spares, tid, P, OFF, IDS, C, smem):
        """(the 256 consumer threads of) CTA ``s`` of the ``spares`` past the last pair in N
        tile ``bn``: zeros where no tile stores.  Gather: compacted rows from ``offsets[E]``,
        128 a CTA, its N tile's columns.  Scatter (only when assignments were dropped): the
        flat ids none of ``ids[:offsets[E]]`` lists, whole rows, the ids split evenly over the
        ``spares * N / block_n`` CTAs; each marks its range's listed ids in shared-memory flags
        (``CAP`` ids at a time) from one coalesced pass over the listed ids, then zeros the
        rows left unmarked."""
        listed = OFF[E]
        if mode == "gather":
            for j in T.unroll(C_CHUNKS):
                if listed + s * BLOCK_M + (tid + THREADS * j) // C_ROW_CHUNKS < P:
                    for e in T.vectorized(C_VEC):
                        C[listed + s * BLOCK_M + (tid + THREADS * j) // C_ROW_CHUNKS,
                          bn * BN + (tid + THREADS * j) % C_ROW_CHUNKS * C_VEC + e] = zero
        else:
            if listed < P:
                # (the flags reuse the ring's shared memory: after the tile's last reads of it)
                T.tvm_storage_sync("shared.dyn")
                flags = T.meta_var(smem.view("int32"))
                per = (P + spares * NB - 1) // (spares * NB)      # ids a CTA
                lo = (s * NB + bn) * per
                hi = T.min(lo + per, P)
                for sub in T.serial((per + CAP - 1) // CAP):
                    base = lo + sub * CAP
                    n = T.max(T.min(hi - base, CAP), 0)
                    for i in T.serial((n + THREADS - 1) // THREADS):
                        if i * THREADS + tid < n:
                            flags[i * THREADS + tid] = 0
                    T.tvm_storage_sync("shared.dyn")
                    for i in T.serial((listed + THREADS - 1) // THREADS):
                        if i * THREADS + tid < listed:
                            f = IDS[i * THREADS + tid]
                            if T.And(base <= f, f < base + n):
                                flags[f - base] = 1     # (stores of one value: no race)
                    T.tvm_storage_sync("shared.dyn")
                    for i in T.serial((n + THREADS - 1) // THREADS):
                        if i * THREADS + tid < n:
                            # (a shared load in a condition: the sync planner does not take it)
                            listed_here = flags[i * THREADS + tid]
                            if listed_here == 0:
                                for ch in T.serial(N // C_VEC):
                                    for e in T.vectorized(C_VEC):
                                        C[base + i * THREADS + tid, ch * C_VEC + e] = zero
                    T.tvm_storage_sync("shared.dyn")

    return store_unlisted
