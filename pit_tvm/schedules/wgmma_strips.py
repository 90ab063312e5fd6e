"""The tiles kind's index in one pass over A, on CUDA, for ``(128, mk)`` micro-tiles with
``mk`` dividing 64 (PIT's ``(32, 1)`` and ``(32, 64)`` covered by 128-row strips, an FFN's ReLU
activations); for micro-tiles under 16 bytes wide (``mk`` < 8) the same pass writes the
compacted A that the wgmma tiles kernel reads.

Why: the index kernels of :mod:`pit_tvm.index` take a flag kernel, a list kernel and their
launch gap, and thin micro-tiles then need
:func:`pit_tvm.schedules.hopper.compact_a.wgmma_compact_a_func`, which reads A a second time
(docs/design/measurements.md#strips-index).  Here the CTA that
flags a block of A also places its listed micro-tiles, and writes their columns while the block
is in shared memory:

``strip_list`` (CTA ``(c, g)``: strip ``g`` = rows ``128g .. 128g+127``, A's columns
``64c .. 64c+63``, 256 threads)::

    A_s[128, 64] <- A[128g:, 64c:]            16-byte loads, rows past M read as zeros (mk = 64,
                                              not compacted: rows 32.. only if rows 0..31 are zero)
    listed[j]    =  any(A_s[:, j*mk:(j+1)*mk] != 0)          for the 64/mk micro-tiles j
    base         =  atomicAdd(state[g], n_listed + 2^26)     (float64: listed + CTAs * 2^26)
    strip_ids[g * MKT + base + rank(j)] = 64c/mk + j         for each listed j
    (mk < 8) Ac[128g:, (base + rank(j)) * mk + e] = A_s[:, j*mk + e]   a warp per row run

The CTA whose add completes the strip (its ``K / 64`` CTAs) writes the strip's count, zeroes
``Ac``'s columns up to the next 16-byte chunk (the tiles kernel reads whole chunks and zero-fills
the rest) and zeroes ``state[g]``.  A strip's listed micro-tiles come in the order its CTAs add
(the tiles kernel is permutation invariant along K: ``Ac``'s column q and B's row ``ids[q]`` are
the same position).

``strip_pack`` (one CTA per strip) writes the CSR index of :mod:`pit_tvm.index.tiles` from the
counts: ``offsets[g]`` = the strips before it, the strip's ids, the ``-1`` tail, and the dense
fallback (every micro-tile listed, ``density_threshold`` exceeded) as the index kernels do.

The state (one float64 word per strip) must be zero before a call: a model with a static row
count passes a zero constant, which the kernel leaves zero (so runs of one compiled model must
not overlap on two streams); a symbolic row count zeroes one per call (``R.zeros``).  CUDA only
(the CPU build has neither the wgmma tiles kernel nor the compaction).

What it costs against one read of A, and the variants that measured no faster:
``docs/design/hopper_kernels.md`` ("The strips index: measured").

Where A is the output of a dense wgmma kernel (an FFN's fc2 reading fc1's ReLU output), that
kernel builds the same outputs in its epilogue instead (``wgmma_row_gather_func(strips_mk=)``,
put there by :class:`pit_tvm.passes.ListStripsInProducer`), and this kernel does not run.
"""
from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.index._tile_kernels import (STATE_DTYPE, lanes_below, nz_bits, state_add, state_completes,
                                         state_listed, warp_ballot)
from pit_tvm.schedules.hopper.config import BLOCK_M, TARGET
from pit_tvm.schedules.hopper.lowering import lower_tirx
from pit_tvm.schedules.hopper.strips import strip_closer, strip_state_words

__all__ = ["LIST_ATTR", "STATE_DTYPE", "strips_apply", "compacts", "strip_list_func", "strip_pack_func", "strip_state_words"]

#: A's columns per CTA: 128 rows x 64 = 16 KiB of fp16.  (256 columns per CTA measured slower:
#: docs/design/measurements.md#strips-index)
COLS = 64
THREADS = 256
VEC = 8                   # elements per 16-byte load
CHUNKS = COLS // VEC      # 16-byte chunks per tile row
LOADS = BLOCK_M * CHUNKS // THREADS      # 16-byte loads per thread (4)
SLOT_ROWS = THREADS // COLS              # rows one pass of the column stores covers (4)
#: the attr of :func:`strip_list_func`'s kernels: its K, mk and dtype (a pass that lists the
#: strips in the producer's epilogue instead looks for it)
LIST_ATTR = "pit.strip_list"


def strips_apply(k: int, mk: int, in_dtype: str) -> bool:
    """Whether the one-pass index (+ compaction) takes ``(128, mk)`` micro-tiles: ``mk``
    dividing 64, K a multiple of 64 (as the wgmma tiles kernel needs), a 2-byte input dtype."""
    return in_dtype in ("float16", "bfloat16") and k % COLS == 0 and 0 < mk <= COLS and COLS % mk == 0


def compacts(mk: int) -> bool:
    """whether the one pass also writes the compacted A: micro-tiles under one 16-byte chunk
    (wider ones the tiles kernel reads in place)"""
    return mk < VEC


@functools.lru_cache(maxsize=32)
def strip_list_func(k: int, mk: int, in_dtype: str = "float16") -> tirx.PrimFunc:
    """``(a, state) -> (counts[G], strip_ids[G * K/mk][, ac[M, K]])`` (``ac`` when
    :func:`compacts`; see the module docstring); ``state``: float64 ``[G]``, zero before the
    call, left zero by it.  ``M`` is a symbolic int64."""
    K, MK = int(k), int(mk)
    if not strips_apply(K, MK, in_dtype):
        raise ValueError(f"the one-pass strip index needs K % {COLS} == 0, mk dividing {COLS}, fp16/bf16; "
                         f"got K={k}, mk={mk}, {in_dtype}")
    MKT = K // MK
    NMT = COLS // MK              # micro-tiles per CTA
    CTAS = K // COLS              # CTAs per strip
    compact = compacts(MK)
    nz = nz_bits(in_dtype)
    zero = tirx.const(0, in_dtype)
    close_strip = strip_closer(MK, compact, in_dtype)

    # one micro-tile a CTA, A read in place (mk = 64, e.g. (32, 64) and (1, 64) covered by 128-row
    # strips): a non-zero in the block's first 32 rows (every thread's first load) lists it, so
    # the other 96 rows are read only for a block whose first 32 rows are zero
    FIRST_LOADS = 1 if NMT == 1 else LOADS

    @T.macro
    def read_rows(g, c, tid, m, A, vals, bits, tile, j0, j1):
        """a thread's loads j0 <= j < j1 of the block (zeros past M); bit e of ``bits``: column
        8 (t % 8) + e non-zero in them (compact: the block into shared memory too)"""
        for j in T.unroll(j0, j1):
            if g * BLOCK_M + tid // CHUNKS + (THREADS // CHUNKS) * j < m:
                for e in T.vectorized(VEC):
                    vals[j * VEC + e] = A[g * BLOCK_M + tid // CHUNKS + (THREADS // CHUNKS) * j,
                                          c * COLS + tid % CHUNKS * VEC + e]
            else:
                for e in T.vectorized(VEC):
                    vals[j * VEC + e] = zero
        for j in T.unroll(j0, j1):
            if compact:
                for e in T.vectorized(VEC):
                    tile[(tid // CHUNKS + (THREADS // CHUNKS) * j) * COLS + tid % CHUNKS * VEC + e] = vals[j * VEC + e]
            for e in T.unroll(VEC):
                bits[0] = T.bitwise_or(bits[0], T.if_then_else(nz(vals[j * VEC + e]) != 0, T.shift_left(1, e), 0))

    @T.macro
    def body(M, A, ST, CNT, SIDS, AC):
        T.device_entry()
        c, g = T.cta_id([CTAS, T.max(T.Cast("int32", strip_state_words(M)), 1)])
        tid = T.thread_id([THREADS])
        m = T.Cast("int32", M)
        G = T.Cast("int32", strip_state_words(M))
        tile = T.alloc_buffer([BLOCK_M * COLS if compact else VEC], in_dtype, scope="shared", align=16)
        listed = T.alloc_buffer([NMT], "int32", scope="shared")
        src = T.alloc_buffer([COLS], "int32", scope="shared")             # output slot -> tile column
        # (three buffers: the sync planner sees a read and a write of one buffer as a hazard)
        n_listed = T.alloc_buffer([1], "int32", scope="shared")
        base = T.alloc_buffer([1], "int32", scope="shared")               # listed before this CTA
        last = T.alloc_buffer([1], "int32", scope="shared")               # whether it completes the strip
        vals = T.alloc_local([LOADS * VEC], in_dtype)
        bits = T.alloc_local([1], "int32")
        r = T.alloc_local([1], "int32")        # rank of this thread's micro-tile among the listed
        col = T.alloc_local([1], "int32")      # the tile column of this thread's output slot
        mine = T.alloc_local([1], "int32")     # (shared values are read into registers before a branch)
        ballot = T.alloc_local([2], "uint32")  # listed flags of micro-tiles 0..31, 32..63
        inf = T.alloc_local([3], "int32")      # listed, base, last
        old = T.alloc_local([1], STATE_DTYPE)
        if tid < NMT:
            listed[tid] = 0
        bits[0] = 0                            # bit e: column 8 (t % 8) + e non-zero in this thread's rows
        # SRead of the tile: thread t loads chunk t % 8 of rows t / 8 + 32 j (every load issued
        # before the first use); one micro-tile a CTA, not compacted: rows 0..31 first, the rest
        # only when no thread saw a non-zero there
        read_rows(g, c, tid, m, A, vals, bits, tile, 0, FIRST_LOADS)
        if FIRST_LOADS < LOADS:
            if T.cuda.syncthreads_or(T.Cast("int32", bits[0] != 0)) == 0:
                read_rows(g, c, tid, m, A, vals, bits, tile, FIRST_LOADS, LOADS)
        T.cuda.cta_sync()
        # micro-tile j is listed when any thread saw a non-zero in its columns (all write 1)
        for e in T.unroll(VEC):
            if T.bitwise_and(T.shift_right(bits[0], e), 1) != 0:
                listed[(tid % CHUNKS * VEC + e) // MK] = 1
        T.cuda.cta_sync()
        mine[0] = 0
        r[0] = 0                                      # rank: listed micro-tiles before j = tid
        if tid < 2 * 32:
            # warps 0 and 1 ballot the flags of micro-tiles 0..31 and 32..63 (a serial sum over
            # the flags before j took mk = 1's CTAs 64 dependent shared loads)
            for h in T.unroll(2):
                ballot[h] = warp_ballot(T.And(32 * h + tid % 32 < NMT, listed[T.min(32 * h + tid % 32, NMT - 1)] != 0))
            if tid < NMT:
                mine[0] = listed[tid]
                r[0] = lanes_below(T.if_then_else(tid < 32, ballot[0], ballot[1]), tid % 32)
                if tid >= 32:
                    r[0] = r[0] + T.Cast("int32", T.popcount(ballot[0]))
                if compact:
                    if mine[0] != 0:
                        for e in T.unroll(MK):
                            src[r[0] * MK + e] = tid * MK + e
            if tid == 0:
                n_listed[0] = T.Cast("int32", T.popcount(ballot[0]) + T.popcount(ballot[1]))
        T.cuda.cta_sync()
        if tid == 0:
            if g < G:
                inf[0] = n_listed[0]
                old[0] = T.cuda.atomic_add(T.address_of(ST[g]), state_add(inf[0], 1))
                base[0] = state_listed(old[0])
                last[0] = state_completes(old[0], CTAS)
        T.cuda.cta_sync()
        if g < G:
            inf[0] = n_listed[0]
            inf[1] = base[0]
            inf[2] = last[0]
            if tid < NMT:
                if mine[0] != 0:
                    SIDS[g * MKT + inf[1] + r[0]] = c * NMT + tid
            if compact:
                # the listed columns into Ac: output slot tid % 64 of rows tid / 64 + 4 i (a warp
                # stores 32 consecutive columns of a row)
                if tid % COLS < inf[0] * MK:
                    col[0] = src[tid % COLS]
                    for i in T.serial(BLOCK_M // SLOT_ROWS):
                        if g * BLOCK_M + tid // COLS + SLOT_ROWS * i < m:
                            AC[g * BLOCK_M + tid // COLS + SLOT_ROWS * i, inf[1] * MK + tid % COLS] = \
                                tile[(tid // COLS + SLOT_ROWS * i) * COLS + col[0]]
            if inf[2] != 0:
                close_strip(tid, g, m, inf[1] + inf[0], AC, CNT, ST)

    if compact:
        @T.prim_func(s_tir=False)
        def kernel(a: T.handle, state: T.handle, counts: T.handle, strip_ids: T.handle, ac: T.handle):
            M = T.int64()
            body(M, T.match_buffer(a, (M, K), in_dtype), T.match_buffer(state, (strip_state_words(M),), STATE_DTYPE),
                 T.match_buffer(counts, (strip_state_words(M),), "int32"),
                 T.match_buffer(strip_ids, (strip_state_words(M) * MKT,), "int32"), T.match_buffer(ac, (M, K), in_dtype))
    else:
        @T.prim_func(s_tir=False)
        def kernel(a: T.handle, state: T.handle, counts: T.handle, strip_ids: T.handle):
            M = T.int64()
            body(M, T.match_buffer(a, (M, K), in_dtype), T.match_buffer(state, (strip_state_words(M),), STATE_DTYPE),
                 T.match_buffer(counts, (strip_state_words(M),), "int32"),
                 T.match_buffer(strip_ids, (strip_state_words(M) * MKT,), "int32"), None)

    return lower_tirx(kernel, TARGET).with_attr(LIST_ATTR, {"k": K, "mk": MK, "dtype": in_dtype})


#: entries of a strip's ids one CTA of :func:`strip_pack_func` writes
PACK_SLICE = 1024


@functools.lru_cache(maxsize=32)
def strip_pack_func(k: int, mk: int, density_threshold: float | None = None) -> tirx.PrimFunc:
    """``(counts, strip_ids) -> (offsets[G + 1], ids[G * K/mk])``: the CSR tiles index of
    :func:`pit_tvm.index.tile_index_func` for ``(128, mk)``, ``group="row"``, with its dense
    fallback (more than ``density_threshold`` of the micro-tiles listed: every one listed).
    One CTA per ``PACK_SLICE`` entries of a strip, as the ids are written in full, ``-1``
    tails included (faster than one CTA per strip); ``G`` (the strips) is symbolic."""
    K, MK = int(k), int(mk)
    MKT = K // MK
    SLICES = -(-MKT // PACK_SLICE)
    thr = density_threshold

    def entry(sl, i, tid):
        """the strip entry thread ``tid`` of slice ``sl`` writes in step ``i``"""
        return sl * PACK_SLICE + i * THREADS + tid

    @T.prim_func(s_tir=False)
    def kernel(counts: T.handle, strip_ids: T.handle, offsets: T.handle, ids: T.handle):
        G = T.int64()
        CNT = T.match_buffer(counts, (G,), "int32")
        SIDS = T.match_buffer(strip_ids, (G * MKT,), "int32")
        OFF = T.match_buffer(offsets, (G + 1,), "int32")
        IDS = T.match_buffer(ids, (G * MKT,), "int32")
        T.device_entry()
        sl, g = T.cta_id([SLICES, T.max(T.Cast("int32", G), 1)])
        tid = T.thread_id([THREADS])
        before = T.alloc_buffer([THREADS], "int32", scope="shared")
        every = T.alloc_buffer([THREADS], "int32", scope="shared")
        acc = T.alloc_local([2], "int32")
        sums = T.alloc_local([3], "int32")    # strips before g, all strips, this strip
        n = T.Cast("int32", G)
        acc[0] = 0
        acc[1] = 0
        for i in T.serial((n + THREADS - 1) // THREADS):
            if i * THREADS + tid < n:
                acc[1] = acc[1] + CNT[i * THREADS + tid]
                if i * THREADS + tid < g:
                    acc[0] = acc[0] + CNT[i * THREADS + tid]
        before[tid] = acc[0]
        every[tid] = acc[1]
        T.cuda.cta_sync()
        for s in T.unroll(8):                 # THREADS = 2^8: tree sums
            if tid < T.shift_right(THREADS // 2, s):
                before[tid] = before[tid] + before[tid + T.shift_right(THREADS // 2, s)]
                every[tid] = every[tid] + every[tid + T.shift_right(THREADS // 2, s)]
            T.cuda.cta_sync()
        sums[0] = before[0]
        sums[1] = every[0]
        sums[2] = 0
        if g < n:
            sums[2] = CNT[g]
        if thr is not None and T.Cast("float64", sums[1]) > T.float64(thr) * T.Cast("float64", n * MKT):
            if g < n:
                for i in T.unroll(PACK_SLICE // THREADS):
                    if entry(sl, i, tid) < MKT:
                        IDS[g * MKT + entry(sl, i, tid)] = entry(sl, i, tid)
                if sl == 0 and tid == 0:
                    OFF[g] = g * MKT
            if g == 0 and sl == 0:
                if tid == 0:
                    OFF[n] = n * MKT
        else:
            if g < n:
                # entry e of strip g: its e-th listed id, or (e >= count) its share of the -1 tail
                # (the unlisted micro-tiles of the strips before it and its own)
                for i in T.unroll(PACK_SLICE // THREADS):
                    if entry(sl, i, tid) < sums[2]:
                        IDS[sums[0] + entry(sl, i, tid)] = SIDS[g * MKT + entry(sl, i, tid)]
                    elif entry(sl, i, tid) < MKT:
                        IDS[sums[1] + g * MKT - sums[0] + entry(sl, i, tid) - sums[2]] = -1
                if sl == 0 and tid == 0:
                    OFF[g] = sums[0]
            if g == 0 and sl == 0:
                if tid == 0:
                    OFF[n] = sums[1]

    return lower_tirx(kernel, TARGET)
