"""The body of the Hopper wgmma GEMMs: one ``T.macro`` closure per kernel, built for its mode
("rows" / "dense" / "tiles"), epilogue and loop (all-threads or warp-specialized), with the
PrimFunc signature of its variant.

Why one closure (and one module) for five kernels: the rows, dense, tiles, dense fallback and
few-rows tier kernels share the tile's K loop, fragment staging and SWrite statement for
statement (their generated CUDA is pinned byte for byte by benchmarks/sweeps/cuda_fingerprint.py).  The pieces
live in the sibling modules: config, smem, barriers, ring, loaders, epilogue, strips.

One CTA = 2 consumer warpgroups (256 threads) computes a 128 x BN tile of compacted rows::

    for each 64-deep K tile kt (STAGES-deep ring in shared memory):
        SRead   A_s[128, 64]  <- A[ids[p0:p0+128], k0:k0+64]   16 B per row chunk, 128B-swizzled
                B_s[64, BN]   <- B[k0:k0+64, n0:n0+BN]           MN-major, 64-column atoms of
                                                                 64 rows x 128 B, 128B-swizzled
        warpgroup g: 4 x wgmma m64nBNk16, A_s[64g:64g+64, 16i:16i+16] x B_s[16i:16i+16, :]
                     -> acc[BN / 2] fp32 registers per thread; one wgmma group kept in flight
    SWrite  acc -> epilogue (bias, relu / gelu, row scale, cast) -> C_s[128, BN + pad] -> 16 B
            stores to rows ids[p] of C (epilogue(0) for count <= p < M), + residual

Warp-specialized (dense and rows with 64-deep K tiles, the tiles kernel with ``tiles_ws``): a
third warpgroup fills the ring (B, and dense A, by TMA; A's listed rows or B's listed rows by
cp.async) through the full / empty mbarrier ring, the consumers only compute::

    loader,   K tile kt into slot s = kt % STAGES: wait empty[s]; expect_tx(full[s]); loads
    consumer, K tile q: wait full[q % STAGES]; 4 x wgmma; release empty[(q - 1) % STAGES]

The all-threads loop (the few-rows tiers, block_k 32, an fp32 residual, thin micro-tiles):
cp.async of K tile kt + STAGES - 2 while K tile kt computes, a CTA barrier a K tile.
"""
from __future__ import annotations

from types import SimpleNamespace

from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.index._tile_kernels import STATE_DTYPE
from pit_tvm.index.tiles import strip_micro_tile, strip_positions
from pit_tvm.schedules.hopper.barriers import (CONSUMERS_BARRIER, STORE_READY_BARRIER, exit_thread,
                                               named_barrier_arrive, named_barrier_sync)
from pit_tvm.schedules.hopper.config import (BLOCK_K, BLOCK_M, CONSUMER_WARPGROUPS, LOADER_THREADS,
                                             STAGING_CONSUMER_REGISTERS, STAGING_LOADER_REGISTERS, STORE_BATCH,
                                             STORER_THREADS, THREADS, BCopyLayout, c_row_pitch)
from pit_tvm.schedules.hopper.epilogue import Epilogue
from pit_tvm.schedules.hopper.experts import END, EXPERT, PAIRS, ExpertRow, ExpertTiles, pair_grid
from pit_tvm.schedules.hopper.loaders import GEMM_LOADER_NAMES, gemm_loaders
from pit_tvm.schedules.hopper.operands import TileOperands, TileRegisters
from pit_tvm.schedules.hopper.planner import SMS, residual_spills_ws, tiles_ws_applies
from pit_tvm.schedules.hopper.ring import MbarrierRing
from pit_tvm.schedules.hopper.smem import (PTX_TYPE, SWIZZLE_64B, SWIZZLE_128B, k_major_strides, mn_major_strides,
                                           swizzle_64b, swizzle_128b, tma_map_encoder)
from pit_tvm.schedules.hopper.strips import TileStripLister, strip_state_words
from pit_tvm.schedules.hopper.tiers import UnlistedRowStorer
from pit_tvm.schedules.limits import dtype_bytes
from pit_tvm.schedules.signature import without_params


def index_is_full(offsets, m, tiles_per_strip: int):
    """Whether a ``(128, mk)`` tiles index (``tiles_per_strip = K / mk``) lists every micro-tile:
    the device-side dense fallback wrote it so, or the pattern is dense."""
    strips = (m + BLOCK_M - 1) // BLOCK_M
    return offsets[strips] == strips * tiles_per_strip


def gemm_kernel(K, N, in_dtype, out_dtype, has_bias, act, mode, cfg, mk=0, a_compact=False,  # noqa: C901
                full_mk=0, row_scale=False, row_scale_masks=False, residual=False, rows_above=0, rows_upto=0,
                row_scale_a=False, strips_mk=0, num_experts=0, top_k=1, gate=False, glu=False):
    """The kernel body for ``mode`` "rows" / "dense" (see :mod:`.rows`) or "tiles"
    (:func:`.tiles.wgmma_tiles_gather_func`: strip ``bm``'s listed micro-tiles of width ``mk``).
    ``full_mk`` (dense): the kernel takes a tiles index of ``(128, full_mk)`` micro-tiles and
    runs only when it lists every one (:func:`.tiles.wgmma_dense_fallback_func`).  Rows: ``rows_above``
    runs only when the index lists more rows than that, ``rows_upto`` only when it lists at
    most that many, on a persistent grid (:func:`.planner.wgmma_few_rows_tiers`).  ``strips_mk`` (dense):
    the epilogue also builds the strips index of C for ``(128, strips_mk)`` micro-tiles (see
    :func:`.rows.wgmma_row_gather_func`).  "gather" / "scatter": the grouped GEMM of
    :mod:`.grouped` over ``num_experts`` weights (a CTA's tile: its expert and rows, see
    ``expert_tile``); gather reads A's rows ``ids[p] // top_k``, and with ``gate`` multiplies each
    output element by the same element of a gate tensor (C's shape and dtype; a gated FFN's
    other half).  ``glu`` (gather): B is two weights, W1 (the activated half of a gated FFN)
    and W3 (its linear half), and C = act(A W1 + b1) * (A W3 + b3), the product in fp32, rounded
    once to C's dtype; a tile's BN accumulator columns are BN / 2 of each, and it stores BN / 2
    columns of C (docs/design/moe.md, "One GEMM for both halves")."""
    BN, STAGES = cfg.block_n, cfg.stages
    BM, BK = BLOCK_M, cfg.block_k
    KT = K // BK
    A_ROW_CHUNKS = BK // 8                # 16-byte chunks per A row of a K tile (8 or 4)
    tiles = mode == "tiles"
    # the grouped GEMM (see .grouped): CTAs take (expert, 128-row tile of its list) pairs
    grouped = mode in ("gather", "scatter")
    gathers_rows = mode in ("rows", "gather")    # A's rows by cp.async through the index
    # scatter's A (fc1's compact rows, the expert's rows contiguous from the tile's first) and the
    # dense A: a TMA box a K tile (past the expert's rows: the next expert's rows, or zeros past
    # M, computed but not stored)
    a_box = mode == "dense" or mode == "scatter"
    if grouped and (BK != BLOCK_K or residual or row_scale_a or rows_upto or strips_mk
                    or not 0 < num_experts <= THREADS):
        raise ValueError(f"the grouped GEMM takes 64-deep K tiles, no residual / tiers / strips and "
                         f"1..{THREADS} experts, got {cfg}, num_experts={num_experts}")
    if gate and mode != "gather":
        raise ValueError(f"a gate multiplies the grouped gather's output only, got mode {mode!r}")
    if glu and (mode != "gather" or gate or BN % 128):
        raise ValueError(f"both halves of a gated FFN in one tile: the grouped gather, no gate tensor, block_n a "
                         f"multiple of 128 (each half whole 64-column atoms), got mode {mode!r}, {cfg}")
    # the columns of C a tile stores: BN, or with ``glu`` BN / 2 (its accumulator's columns
    # BN / 2 .. BN - 1 are the linear half's, for the same columns of C)
    CN = BN // 2 if glu else BN
    # glu: launched one CTA an SM, the loader warpgroup hands registers to the consumers
    # (``setmaxnreg``): with ptxas's 168 a thread the two halves' epilogue spilled 4-28 bytes
    register_split = glu
    # a few-rows tier: SMS CTAs, CTA c computing tile c of the listed rows' tiles (there are at
    # most SMS), then its store warpgroup storing a share of C's rows past them (``store_unlisted``)
    persistent = rows_upto > 0
    MKT = K // mk if tiles else 0         # micro-tile columns per strip
    PREFETCH = STAGES - 2                 # K tiles in flight ahead of the one computed
    A_TILE, B_TILE = BM * BK, BK * BN     # elements per ring slot
    B_BASE = STAGES * A_TILE              # B ring after the A ring (one dynamic allocation)
    ACC = BN // 2                         # fp32 accumulators per thread (m64 x BN / 128)
    A_CHUNKS = BM * BK // 8 // THREADS    # 16-byte chunks per thread per K tile
    b_copy = BCopyLayout(BN, BK, tiles)
    B_ROWS = b_copy.rows
    C_ROW = c_row_pitch(CN, out_dtype)
    Z_OFF = BM * C_ROW                    # (out dtype elements) the zero row's value, after C
    C_VEC = 16 // dtype_bytes(out_dtype)  # elements per 16-byte store
    C_CHUNKS = BM * CN // C_VEC // THREADS
    C_ROW_CHUNKS = CN // C_VEC
    smem_elems = cfg.smem_bytes(out_dtype) // 2   # the ring, or the staged C tile after it
    # dense and rows, 64-deep K tiles, not the few-rows tier: the warp-specialized K loop (see
    # ``tma_loader``, ``ws_k_loop``), but where a residual would spill (:func:`residual_spills_ws`).
    # The tiles kernel with ``cfg.tiles_ws`` (micro-tiles a multiple of 64 wide, so that A's K
    # tile is one TMA box of A): see ``tiles_loader``.  It also runs the dense fallback itself.
    ws_tiles = tiles and cfg.tiles_ws
    if ws_tiles and (BK != BLOCK_K or not tiles_ws_applies(mk, BN, out_dtype, residual)):
        raise ValueError(f"the warp-specialized tiles kernel takes micro-tiles a multiple of {BLOCK_K} wide, "
                         f"block_n a multiple of 128 and no fp32 residual, got mk={mk}, {cfg}, {out_dtype}")
    ws = ((mode in ("dense", "rows", "gather", "scatter") and BK == BLOCK_K and not persistent
           and not residual_spills_ws(residual, out_dtype)) or ws_tiles)
    LAUNCH_THREADS = THREADS + LOADER_THREADS if ws else (THREADS + STORER_THREADS if persistent else THREADS)
    RASTER = cfg.raster_m if mode == "dense" else 1
    # a ring slot's bytes that TMA loads: dense A and B; rows B (the loader warpgroup copies A's
    # listed rows); ws tiles A and B on a full index, else A (the loaders copy B's listed rows),
    # see ``tiles_loader``
    TX_BYTES = ((A_TILE if a_box or ws_tiles else 0) + B_TILE) * dtype_bytes(in_dtype)
    FULL_ARRIVALS = 1 + (LOADER_THREADS if gathers_rows or ws_tiles else 0)
    ring = MbarrierRing(STAGES)       # ws: the loader warpgroup fills it, the consumers drain it
    A_LOADER_CHUNKS = BM * BK // 8 // LOADER_THREADS     # rows: A's 16-byte chunks a loader thread copies
    loader_b_copy = BCopyLayout(BN, BK, True, LOADER_THREADS)
    strips = strips_mk > 0
    # strips: the listing of C's non-zero micro-tiles in the epilogue (``list_tile`` before the
    # SWrite, ``place_tile`` after it), its scratch after the staged C tile
    lister = TileStripLister(BN, N, out_dtype, strips_mk) if strips else None
    S_NMT = lister.S_NMT if strips else 0            # micro-tiles per CTA
    S_MKT = lister.S_MKT if strips else 0            # micro-tiles per strip of C
    S_COMPACT = strips and lister.S_COMPACT
    S_LISTED = lister.S_LISTED if strips else 0      # (int32 words) the flags of the CTA's micro-tiles
    if strips:
        smem_elems = max(smem_elems, lister.smem_bytes // 2)
        list_tile, place_tile = lister.list_tile, lister.place_tile
    t = PTX_TYPE[in_dtype]
    wgmma = f"wgmma.mma_async.sync.aligned.m64n{BN}k16.f32.{t}.{t}"
    # descriptor offsets are in 16-byte units: A (K-major, 128B swizzle): 8-row groups 1024 B
    # apart (LBO unused); B (MN-major, 128B swizzle): 64-column atoms BK * 128 B apart (LBO),
    # 8-row groups 1024 B apart (SBO)
    A_LBO, A_SBO = k_major_strides(BK)
    A_SWIZZLE = SWIZZLE_128B if BK == 64 else SWIZZLE_64B
    B_LBO, B_SBO = mn_major_strides(BK)
    zero_out = tirx.const(0, out_dtype)

    ep = Epilogue(out_dtype, has_bias, act, row_scale, row_scale_a, row_scale_masks, residual, gate)
    epilogue, plus_residual, unlisted = ep.apply, ep.plus_residual, ep.unlisted
    # the store warpgroup computes epilogue(0) only where it is not zero (the SWrite's branches
    # take the same cases: a bias's value staged once, a row scale's per element)
    unlisted_nonzero = ep.unlisted_nonzero

    def row_of(ids_buf, p):
        """the row of C (and of the row scale) that compacted row p maps to"""
        return ids_buf[p] if mode in ("rows", "scatter") else p

    def row_id(ids_buf, p, m):
        """(int64) the row of A / C that compacted row p maps to, the last one past M (not stored)"""
        return T.Cast("int64", row_of(ids_buf, T.min(p, m - 1)))

    def a_row_id(ids_buf, p, m):
        """(int64) the row of A that compacted row p reads (gather: the token of flat
        assignment ids[p], ``ids[p] // top_k``; scatter: row p), the last one past M"""
        if mode == "gather":
            return T.Cast("int64", T.floordiv(ids_buf[T.min(p, m - 1)], top_k))
        if mode == "scatter":
            return T.Cast("int64", T.min(p, m - 1))
        return row_id(ids_buf, p, m)

    def first_row(bm):
        """the tile's first compacted row: ``bm * 128``; grouped: ``bm`` is the CTA's
        ``expert_tile`` registers (expert, first row, end of the expert's rows)"""
        return bm[1] if grouped else bm * BM

    def b_k_row(bm, k0):
        """the row of B's TMA map that holds K position k0 (grouped: in expert ``bm[0]``'s
        weight, the map being over all experts' ``[E * K, N]``)"""
        return bm[0] * K + k0 if grouped else k0

    def bias_of(bias_buf, bm):
        """the bias the epilogue indexes by column (grouped: the expert's row of ``[E, N]``)"""
        return ExpertRow(bias_buf, bm[0]) if grouped else bias_buf

    def staged_value(acc, a, bm, bias_buf, bias3_buf, col, scale):
        """the epilogue of accumulator ``a`` (column ``col`` of C); glu: times the linear
        half's, accumulator ``a + CN / 2`` (the same column of W3)"""
        if glu:
            return ep.glu(acc[a], acc[a + CN // 2], bias_of(bias_buf, bm), bias_of(bias3_buf, bm), col)
        return epilogue(acc[a], bias_of(bias_buf, bm), col, scale)

    def a_chunk(t, copiers, j):
        """A's K-tile chunk that thread t of ``copiers`` copies j-th: (tile row, 16-byte chunk)"""
        return (t + copiers * j) // A_ROW_CHUNKS, (t + copiers * j) % A_ROW_CHUNKS

    def count_of(off_buf, m):
        return off_buf[1] if mode == "rows" else m   # (grouped: m is the end of the expert's rows)

    def n_valid(off_buf, g):
        return strip_positions(off_buf, g, mk)

    def k_tiles(off_buf, g):
        """K tiles the loop loads and computes.  Tiles: the strip's count, but at least one (a
        zero-filled one for an empty strip): with a loop that may run no wgmma, ptxas
        serialises every wgmma of the kernel (C7515: non-wgmma definitions of the
        accumulators, here their zero-init, reach the pipeline stage)."""
        return T.max((n_valid(off_buf, g) + BK - 1) // BK, 1) if tiles else KT

    def micro_tile_id(off_buf, ids_buf, m, g, q):
        """the index entry of strip g's K position q (a global load; column_of_id finishes it)"""
        return strip_micro_tile(off_buf, ids_buf, g, q, mk, (m + BM - 1) // BM * MKT - 1)

    gather_a = tiles and not a_compact    # tiles, mk >= 8: A's listed columns read in place

    def a_valid(off_buf, g, q, p, count):
        """whether the A chunk of K position q, tile row p is read (else zero-filled): tiles,
        positions the strip lists; rows, the listed rows (an unlisted row's product is not
        stored, so reading it would only take bandwidth)"""
        # (a compacted A holds zeros from the count up to the next K tile: the same as the
        # zero fill, which the empty strip's K tile needs as it reads nothing written)
        if tiles:
            return q < n_valid(off_buf, g)
        return p < count if gathers_rows else True

    def b_valid(off_buf, g, q):
        return q < n_valid(off_buf, g) if tiles else True

    def a_col_of(cols, j, q):
        return cols[j] if tiles else q

    def b_row_of(rows, j, q):
        return rows[j] if tiles else q

    b_kr = b_copy.row

    def a_swizzled(ch, r):
        """the 16-byte slot of chunk ch of A's tile row r: 128-byte swizzle (8 chunks a row),
        64-byte for 32-deep K tiles (4 chunks)"""
        return swizzle_128b(ch, r) if BK == 64 else swizzle_64b(ch, r)

    def full_index(off_buf, m):
        """tiles: the index lists every micro-tile (the dense fallback, or a dense pattern)"""
        return index_is_full(off_buf, m, MKT)

    def runs(off_buf, m, cond):
        """``cond`` where this kernel runs: the tiles kernel unless its index is full (the
        warp-specialized one always: it runs a full index as the dense kernel), the dense
        fallback only then (its CTAs still pass the barriers, but load and store nothing), the
        many-rows tier of the rows kernel only above its row count, a few-rows tier only on its
        own row counts"""
        if ws_tiles:
            return cond
        if persistent:
            return T.And(T.Not(outside_tier(off_buf, m)), cond)
        if tiles:
            return T.And(T.Not(full_index(off_buf, m)), cond)
        if full_mk:
            return T.And(index_is_full(off_buf, m, K // full_mk), cond)
        if rows_above > 0:
            return T.And(count_of(off_buf, m) > rows_above, cond)
        return cond

    def stored_below(off_buf, m):
        """the tiles this kernel's SWrite stores: p0 below it (a few-rows tier's store warpgroup
        stores the tiles past the listed rows' ones)"""
        return count_of(off_buf, m) if persistent else m

    def outside_tier(off_buf, m):
        """a few-rows tier's count is not its own: over ``rows_upto`` or at most ``rows_above``"""
        over = count_of(off_buf, m) > rows_upto
        return T.Or(over, count_of(off_buf, m) <= rows_above) if rows_above > 0 else over

    def consumer_sync():
        """the barrier of the tile's 256 threads: a few-rows tier's store warpgroup takes no
        part in the tile, so there the named barrier of them alone"""
        if persistent:
            return named_barrier_sync(CONSUMERS_BARRIER, THREADS)
        return T.cuda.cta_sync()

    def copy16(dst, src, valid):
        """16-byte cp.async (a call to wrap in ``T.evaluate``); zero-fills the destination where
        ``valid`` is false"""
        if mode != "dense":
            return T.ptx["cp.async.cg.shared.global"](dst, src, 16,
                                                      T.Cast("uint32", T.if_then_else(valid, 16, 0)))
        return T.ptx["cp.async.cg.shared.global"](dst, src, 16)

    if grouped:
        experts = ExpertTiles(num_experts, mode, N, CN, out_dtype, smem_elems * 2 // 4)
        expert_tile, store_unlisted_grouped = experts.expert_tile, experts.store_unlisted

    loaders = gemm_loaders(SimpleNamespace(**{name: value for name, value in locals().items()
                                              if name in GEMM_LOADER_NAMES}))
    index_ahead, sread = loaders.index_ahead, loaders.sread
    tma_loader, tiles_loader = loaders.tma_loader, loaders.tiles_loader
    lb_rows = loader_b_copy.rows                  # ws tiles: rows of B a loader thread copies


    @T.macro
    def wgmma_step(slot, acc, desc_a, desc_b):
        """the warpgroup's wgmma on ring slot ``slot`` (its 64 rows of A x B, 4 k16 steps), one
        commit group; returns once the group before it retired (one group stays in flight)"""
        T.ptx.wgmma.fence.sync.aligned()
        for kk in T.unroll(BK // 16):
            T.ptx[wgmma](
                *[acc[i] for i in range(ACC)],
                desc_a[0] + T.Cast("uint64", (slot * A_TILE + kk * 16) // 8),
                desc_b[0] + T.Cast("uint64", (slot * B_TILE + kk * 16 * 64) // 8),
                True, 1, 1, 0, 1)
        T.ptx.wgmma.commit_group.sync.aligned()
        T.ptx.wgmma.wait_group.sync.aligned(1)


    @T.macro
    def ws_k_loop(tid, bm, OFF, smem, acc, desc_a, desc_b, bars):
        """ws: a consumer warpgroup's K loop: wait for slot q % STAGES to fill, issue its wgmma,
        and release the slot of K tile q - 1 once that one's wgmma retired"""
        for q in T.serial(k_tiles(OFF, bm)):
            slot = q % STAGES
            ring.wait_full(bars, slot, q)
            if mode != "dense":
                # (A's rows, the tiles kind's B rows, came by cp.async, the generic proxy; wgmma
                # reads through the async one)
                T.ptx["fence.proxy.async.shared::cta"]()
            wgmma_step(slot, acc, desc_a, desc_b)
            ring.release(bars, q, tid)

    @T.macro
    def tile(bn, bm, tid, m, io, smem, regs, bars, map_a, map_b, map_b3):
        """the 128 x BN tile (bn, bm) of C: SRead, wgmma K loop, epilogue, SWrite (``io``: the
        kernel's buffers, ``regs``: this thread's registers, ``bars``: the ring's mbarriers)"""
        A, B, OFF, IDS, BIAS, RS, RES, C, ST, CNT, SIDS, AC, B3, BIAS3 = io.unpacked()
        acc, a_row, c_row, rs_val, res_v, a_col, b_row_id, a_col_next, b_row_next, desc_a, desc_b, orw, ballot, \
            sloc, old = regs.unpacked()
        count = count_of(OFF, m)
        p0 = first_row(bm)
        if runs(OFF, m, p0 < count):
            wg = tid // 128
            if ws:
                # full[s] waits for one arrival and the slot's TMA bytes (rows: and each loader
                # thread's cp.async), empty[s] for both consumer warpgroups
                if tid == 0:
                    ring.init(bars, FULL_ARRIVALS, CONSUMER_WARPGROUPS)
                T.evaluate(consumer_sync())
                if tid >= THREADS:
                    if register_split:
                        T.ptx["setmaxnreg.dec.sync.aligned.u32"](STAGING_LOADER_REGISTERS)
                    if tiles:
                        if full_index(OFF, m):     # (the dense fallback: the dense kernel's loop)
                            tma_loader(tid, bn, bm, m, count, OFF, IDS, A, smem, bars, map_a, map_b, map_b3, a_row,
                                       a_col)
                        else:
                            tiles_loader(tid, bn, bm, m, OFF, IDS, B, smem, bars, map_a, a_col, b_row_id, a_col_next,
                                         b_row_next)
                    else:
                        tma_loader(tid, bn, bm, m, count, OFF, IDS, A, smem, bars, map_a, map_b, map_b3, a_row, a_col)
                    # (the rest of the kernel is the consumers': a CTA barrier waits for every
                    # thread that has not exited)
                    T.evaluate(exit_thread())
                if register_split:
                    T.ptx["setmaxnreg.inc.sync.aligned.u32"](STAGING_CONSUMER_REGISTERS)
            for i in T.unroll(ACC):
                acc[i] = T.float32(0)
            # the A rows this thread copies: row r = (tid + 256 j) / 8 of the tile, for every K tile
            if not ws:
                for j in T.unroll(A_CHUNKS):
                    a_row[j] = a_row_id(IDS, p0 + a_chunk(tid, THREADS, j)[0], m)
            # descriptors of ring slot 0 (this warpgroup's 64 A rows; B's first k16 rows): the
            # other slots and k16 steps add their 16-byte offsets to the start-address field
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_a[0]),
                                                  smem.ptr_to([wg * 64 * BK]), A_LBO, A_SBO,
                                                  A_SWIZZLE)
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b[0]), smem.ptr_to([B_BASE]),
                                                  B_LBO, B_SBO, SWIZZLE_128B)
            if ws:
                ws_k_loop(tid, bm, OFF, smem, acc, desc_a, desc_b, bars)
            else:
                if tiles:
                    # K tile 0's index entries; each iteration then loads the next tile's while
                    # this one's cp.async go out (a lookup just before its use cost the tiles
                    # kernel a global-load latency per K tile)
                    for j in T.unroll(A_CHUNKS):
                        if gather_a:
                            a_col_next[j] = micro_tile_id(OFF, IDS, m, bm, (tid + THREADS * j) % A_ROW_CHUNKS * 8)
                    for i in T.unroll(B_ROWS):
                        b_row_next[i] = micro_tile_id(OFF, IDS, m, bm, b_kr(tid, i))
                # the first PREFETCH K tiles' loads (as many as there are), one commit group each
                # (a peeled loop: no test of the loop counter against PREFETCH in the one below)
                for kt in T.serial(PREFETCH):
                    if kt < k_tiles(OFF, bm):
                        index_ahead(kt, tid, m, bm, OFF, IDS, a_col, b_row_id, a_col_next, b_row_next)
                        sread(kt, tid, bn, bm, count, OFF, A, B, smem, a_row, a_col, b_row_id)
                    T.ptx["cp.async.commit_group"]()
                # then compute K tile kt - PREFETCH and load K tile kt (while there is one)
                for q in T.serial(k_tiles(OFF, bm)):
                    kt = q + PREFETCH
                    if tiles:
                        if kt < k_tiles(OFF, bm):
                            index_ahead(kt, tid, m, bm, OFF, IDS, a_col, b_row_id, a_col_next, b_row_next)
                    # tile kt - PREFETCH has landed (at most PREFETCH - 1 younger groups pending)
                    T.ptx["cp.async.wait_group"](PREFETCH - 1)
                    T.ptx["fence.proxy.async.shared::cta"]()
                    T.evaluate(consumer_sync())
                    slot = q % STAGES
                    wgmma_step(slot, acc, desc_a, desc_b)      # then wgmma kt - PREFETCH - 1 has retired
                    if kt < k_tiles(OFF, bm):
                        # slot kt % STAGES held tile kt - STAGES = kt - PREFETCH - 2: its wgmma
                        # retired in both warpgroups before the barrier
                        sread(kt, tid, bn, bm, count, OFF, A, B, smem, a_row, a_col, b_row_id)
                    T.ptx["cp.async.commit_group"]()
            T.ptx.wgmma.wait_group.sync.aligned(0)
            T.ptx["cp.async.wait_group"](0)
            T.evaluate(consumer_sync())
            # fragments -> staged C tile: thread (warp w, lane l) of warpgroup g holds rows
            # 64g + 16w + l/4 (+8) and columns 8nb + 2(l%4) (+1) in acc[4nb + 2i + e]
            w = (tid % 128) // 32
            lane = tid % 32
            if row_scale or row_scale_a:   # the scales of this thread's two fragment rows
                for i in T.unroll(2):
                    rs_val[i] = T.Cast("float32", RS[row_of(IDS, T.min(p0 + wg * 64 + w * 16 + lane // 4 + 8 * i,
                                                                       m - 1))])
            if strips:
                # (the listing's flags: the K loop's ring held them)
                if tid < S_NMT:
                    smem.view("int32")[S_LISTED + tid] = 0
            for nb in T.unroll(CN // 8):
                for i in T.unroll(2):
                    # (no assignment in a vectorized loop: TIRx makes it a one-element local)
                    for e in T.vectorized(2):
                        smem.view(out_dtype)[(wg * 64 + w * 16 + lane // 4 + 8 * i) * C_ROW
                                             + nb * 8 + (lane % 4) * 2 + e] = staged_value(
                            acc, nb * 4 + i * 2 + e, bm, BIAS, BIAS3, bn * CN + nb * 8 + (lane % 4) * 2 + e,
                            rs_val[i])
            T.evaluate(consumer_sync())
        if ws:
            if tid >= THREADS:    # (a CTA that skips its tile: the loader leaves here)
                T.evaluate(exit_thread())
        if persistent:
            if T.Not(outside_tier(OFF, m)):      # (the K loop is done: the store warpgroup may start)
                T.evaluate(named_barrier_arrive(STORE_READY_BARRIER, THREADS + STORER_THREADS))
        T.evaluate(consumer_sync())
        if strips:
            list_tile(bn, bm, tid, m, smem, ST, orw, ballot, sloc, old)
        if has_bias and not row_scale and mode == "rows":
            # the value of a zero row (unlisted rows: epilogue(0), the same for every row)
            for j in T.unroll((BN + THREADS - 1) // THREADS):
                if tid + THREADS * j < BN:
                    smem.view(out_dtype)[Z_OFF + tid + THREADS * j] = epilogue(
                        T.float32(0), BIAS, bn * BN + tid + THREADS * j, None)
            T.evaluate(consumer_sync())
        # SWrite: 16-byte row chunks to C[ids[p]] (epilogue(0) for count <= p < M).  The rows' ids
        # are all loaded before the first store: a store between two id loads orders them, and
        # one id load's latency per chunk made the zero-only CTAs of a few-rows call most of
        # its time (docs/design/measurements.md#wgmma-planner)
        if runs(OFF, m, p0 < stored_below(OFF, m)):
            for j in T.unroll(C_CHUNKS):
                c_row[j] = row_id(IDS, p0 + (tid + THREADS * j) // C_ROW_CHUNKS, m)
            if residual or gate:
                # every residual (gate) chunk loaded before the first store, for the same reason
                for j in T.unroll(C_CHUNKS):
                    for e in T.vectorized(C_VEC):
                        res_v[j * C_VEC + e] = RES[c_row[j], bn * CN + (tid + THREADS * j) % C_ROW_CHUNKS * C_VEC + e]
        for j in T.unroll(C_CHUNKS):
            r = (tid + THREADS * j) // C_ROW_CHUNKS
            ch = (tid + THREADS * j) % C_ROW_CHUNKS
            if runs(OFF, m, T.And(p0 < stored_below(OFF, m), p0 + r < m) if persistent else p0 + r < m):
                if grouped:   # (the expert's rows: m is their end; the rows past it are others')
                    for e in T.vectorized(C_VEC):
                        C[c_row[j], bn * CN + ch * C_VEC + e] = ep.times_gate(
                            smem.view(out_dtype)[r * C_ROW + ch * C_VEC + e], res_v, j, e)
                elif p0 + r < count:
                    for e in T.vectorized(C_VEC):
                        C[c_row[j], bn * BN + ch * C_VEC + e] = plus_residual(
                            smem.view(out_dtype)[r * C_ROW + ch * C_VEC + e], res_v, j, e)
                elif has_bias and not row_scale:
                    for e in T.vectorized(C_VEC):
                        C[c_row[j], bn * BN + ch * C_VEC + e] = plus_residual(
                            smem.view(out_dtype)[Z_OFF + ch * C_VEC + e], res_v, j, e)
                elif row_scale and not row_scale_masks:
                    # (element by element: TVM's CUDA codegen breaks 8-wide fp32 vectors)
                    for e in T.unroll(C_VEC):
                        C[c_row[j], bn * BN + ch * C_VEC + e] = unlisted(BIAS, RS, c_row[j], bn * BN + ch * C_VEC + e)
                else:     # no bias, or a row scale that is zero wherever the index skips a row
                    for e in T.vectorized(C_VEC):
                        C[c_row[j], bn * BN + ch * C_VEC + e] = zero_out
        if strips:
            place_tile(bn, bm, tid, m, p0, smem, ST, CNT, SIDS, AC, sloc, old)

    # a few-rows tier's store warpgroup: C's rows past the listed rows' tiles
    unlisted_rows = UnlistedRowStorer(ep, N, count_of)
    store_unlisted, STORE_CHUNKS = unlisted_rows.store_unlisted, unlisted_rows.STORE_CHUNKS

    @T.macro
    def device_body(M, A, B, OFF, IDS, BIAS, RS, RES, C, ST, CNT, SIDS, AC, B3, BIAS3, map_a, map_b, map_b3):
        T.device_entry()
        if register_split:
            # (setmaxnreg needs the registers at entry known: one CTA an SM)
            T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        if persistent:
            cta = T.cta_id([SMS])
        elif grouped:
            # (expert, tile) pairs, at most ceil(M / 128) + min(E, M) of them (see .experts)
            bn, bt = T.cta_id([N // CN, pair_grid(M, num_experts)])
        elif RASTER > 1:
            # grouped launch order: the CTAs launched together take RASTER consecutive M tiles for
            # a run of N tiles, so that they share B's columns (and A's rows) in L2; CTA t in
            # launch order, of the group of M tiles ``first..first + size``
            bx, by = T.cta_id([N // BN, T.Cast("int32", (M + BM - 1) // BM)])
            t = by * (N // BN) + bx
            first = t // (RASTER * (N // BN)) * RASTER
            size = T.min(T.Cast("int32", (M + BM - 1) // BM) - first, RASTER)
            bn = t % (RASTER * (N // BN)) // size
            bm = first + t % (RASTER * (N // BN)) % size
        else:
            bn, bm = T.cta_id([N // BN, T.Cast("int32", (M + BM - 1) // BM)])
        tid = T.thread_id([LAUNCH_THREADS])
        smem = T.alloc_buffer([smem_elems], in_dtype, scope="shared.dyn", align=1024)
        acc = T.alloc_local([ACC], "float32")
        # the A rows this thread copies (ws rows: this loader thread's, A_LOADER_CHUNKS of them)
        a_row = T.alloc_local([A_LOADER_CHUNKS if ws else A_CHUNKS], "int64")
        c_row = T.alloc_local([C_CHUNKS], "int64")       # the C rows this thread stores
        rs_val = T.alloc_local([2], "float32")           # row_scale: its fragment rows' scales
        res_v = T.alloc_local([C_CHUNKS * C_VEC if residual or gate else 1], out_dtype)   # residual / gate chunks
        # tiles: this K tile's A columns and B rows (ws: a loader thread's), and the next K tile's
        a_col = T.alloc_local([A_CHUNKS], "int32")
        b_row_id = T.alloc_local([lb_rows if ws_tiles else B_ROWS], "int32")
        a_col_next = T.alloc_local([A_CHUNKS], "int32")
        b_row_next = T.alloc_local([B_ROWS], "int32")
        desc_a = T.alloc_local([1], "uint64")
        desc_b = T.alloc_local([1], "uint64")
        orw = T.alloc_local([4], "uint32")                  # strips: this thread's chunks of C, OR-ed
        ballot = T.alloc_local([1], "uint32")
        sloc = T.alloc_local([TileStripLister.SLOTS], "int32")   # strips: the listing's values
        old = T.alloc_local([1], STATE_DTYPE)               # strips: the atomic add's old state
        bars = T.alloc_buffer([2 * STAGES if ws else 1], "uint64", scope="shared", align=8)  # ws: full, empty
        # few-rows tier, the store warpgroup: two batches of row ids, a chunk's values, a row's residual
        z_id = T.alloc_local([2 * STORE_BATCH if persistent else 1], "int32")
        z_val = T.alloc_local([C_VEC], out_dtype)
        z_res = T.alloc_local([STORE_CHUNKS * C_VEC if persistent and residual else 1], out_dtype)
        io = T.meta_var(TileOperands(A, B, OFF, IDS, BIAS, RS, RES, C, ST, CNT, SIDS, AC, B3, BIAS3))
        regs = T.meta_var(TileRegisters(acc, a_row, c_row, rs_val, res_v, a_col, b_row_id, a_col_next, b_row_next,
                                        desc_a, desc_b, orw, ballot, sloc, old))
        m = T.Cast("int32", M)
        if persistent:
            # few rows on SMS CTAs: CTA c computes and stores tile c where the listed rows' tiles
            # (at most SMS within the tier) include it; every CTA's store warpgroup stores a
            # share of the rows past them once the CTA's K loop is done (STORE_READY_BARRIER: the
            # consumers arrive, it waits).  Nothing when another tier runs.  (No branch or loop
            # around the tile: the sync pass cannot place its barriers inside a branch, and in a
            # loop it puts one at the top, which would wait for the store warpgroup; the tile's
            # own conditions, ``runs``, hold it.  The one it puts before the SWrite waits for the
            # store warpgroup to exit.)
            if tid >= THREADS:
                if T.Not(outside_tier(OFF, m)):
                    # (after the CTA's K loop: stores beside it slowed a K loop that streams B
                    # from DRAM, see wgmma_few_rows_tiers)
                    T.evaluate(named_barrier_sync(STORE_READY_BARRIER, THREADS + STORER_THREADS))
                    store_unlisted(cta, tid - THREADS, m, OFF, IDS, BIAS, RS, RES, C, z_id, z_val, z_res)
                T.evaluate(exit_thread())
            tile(cta % (N // BN), cta // (N // BN), tid, m, io, smem, regs, bars, map_a, map_b, map_b3)
        elif grouped:
            # this CTA's expert and rows (CTA-uniform registers: expert, first row, end of the
            # expert's rows, tiles in all), then its tile, or, past the tiles, its share of the
            # rows that no tile stores
            grp = T.alloc_local([4], "int32")
            expert_tile(bt, tid, OFF, grp)
            tile(bn, grp, tid, grp[END], io, smem, regs, bars, map_a, map_b, map_b3)
            if grp[EXPERT] < 0:
                store_unlisted_grouped(bn, bt - grp[PAIRS], pair_grid(M, num_experts) - grp[PAIRS], tid, m, OFF,
                                       IDS, C, smem)
        else:
            tile(bn, bm, tid, m, io, smem, regs, bars, map_a, map_b, map_b3)

    encode_tma_map = tma_map_encoder(in_dtype)

    @T.macro
    def body_ws(M, A, B, OFF, IDS, BIAS, RS, RES, C, ST, CNT, SIDS, AC, B3, BIAS3):
        # (host) the TMA descriptors of B (64 x 64 atoms; glu: and of W3) and, dense, A (128 x 64
        # boxes), with the 128-byte swizzle
        map_b: T.let[T.TensorMap()] = T.tvm_stack_alloca("tensormap", 1)
        encode_tma_map(map_b, B.data, N, K * num_experts if grouped else K, 64, BK)
        if glu:
            map_b3: T.let[T.TensorMap()] = T.tvm_stack_alloca("tensormap", 1)
            encode_tma_map(map_b3, B3.data, N, K * num_experts, 64, BK)
            device_body(M, A, B, OFF, IDS, BIAS, RS, RES, C, ST, CNT, SIDS, AC, B3, BIAS3, None, map_b, map_b3)
        elif a_box or ws_tiles:
            map_a: T.let[T.TensorMap()] = T.tvm_stack_alloca("tensormap", 1)
            encode_tma_map(map_a, A.data, K, M, BK, BM)
            device_body(M, A, B, OFF, IDS, BIAS, RS, RES, C, ST, CNT, SIDS, AC, B3, BIAS3, map_a, map_b, None)
        else:
            device_body(M, A, B, OFF, IDS, BIAS, RS, RES, C, ST, CNT, SIDS, AC, B3, BIAS3, None, map_b, None)

    @T.macro
    def body(M, A, B, OFF, IDS, BIAS, RS, RES, C, ST, CNT, SIDS, AC, B3, BIAS3):
        device_body(M, A, B, OFF, IDS, BIAS, RS, RES, C, ST, CNT, SIDS, AC, None, None, None, None, None)

    if grouped:
        return grouped_signature(K, N, num_experts, in_dtype, out_dtype, has_bias, mode, body_ws, gate, glu)
    return gemm_signature(K, N, in_dtype, out_dtype, has_bias, mode, body_ws if ws else body, MKT, full_mk,
                          row_scale or row_scale_a, residual, S_MKT, S_COMPACT)


def gemm_signature(K, N, in_dtype, out_dtype, has_bias, mode, body, mkt=0, full_mk=0, row_scale=False,
                   residual=False, strips_mkt=0, strips_compact=False):
    """The PrimFunc around ``body`` with exactly the parameters its variant takes, in the order
    ``a, b[, offsets][, ids][, bias][, row_scale][, residual][, state], c[, counts, strip_ids[,
    ac]]``: the index unless dense (the dense fallback, ``full_mk``, takes the tiles index's
    ``offsets`` alone and writes ``c`` in place), then the epilogue's inputs; a dense kernel
    that lists C's strips (``strips_mkt`` micro-tiles a strip) takes their state and writes
    the strips index (and, ``strips_compact``, the compacted C) after C.  ``body``'s operands:
    ``M, A, B, offsets, ids, bias, row_scale, residual, C, state, counts, strip_ids, ac``; it
    reads none that its variant does not take, so those parameters are dropped from the
    function built with all of them."""
    strips = mode == "tiles" or bool(full_mk)
    takes = {"offsets": mode != "dense" or bool(full_mk), "ids": mode in ("rows", "tiles"), "bias": has_bias,
             "row_scale": row_scale, "residual": residual, "state": bool(strips_mkt),
             "counts": bool(strips_mkt), "strip_ids": bool(strips_mkt), "ac": strips_compact}

    def offsets_shape(M):
        return (strip_state_words(M) + 1,) if strips else (2,)

    def ids_shape(M):
        return (strip_state_words(M) * mkt,) if mode == "tiles" else (M,)

    @T.prim_func(s_tir=False)
    def kernel(a: T.handle, b: T.handle, offsets: T.handle, ids: T.handle, bias: T.handle, row_scale: T.handle,
               residual: T.handle, state: T.handle, c: T.handle, counts: T.handle, strip_ids: T.handle,
               ac: T.handle):
        M = T.int64()
        body(M, T.match_buffer(a, (M, K), in_dtype), T.match_buffer(b, (K, N), in_dtype),
             T.match_buffer(offsets, offsets_shape(M), "int32"), T.match_buffer(ids, ids_shape(M), "int32"),
             T.match_buffer(bias, (N,), in_dtype), T.match_buffer(row_scale, (M,), in_dtype),
             T.match_buffer(residual, (M, N), out_dtype), T.match_buffer(c, (M, N), out_dtype),
             T.match_buffer(state, (strip_state_words(M),), STATE_DTYPE),
             T.match_buffer(counts, (strip_state_words(M),), "int32"),
             T.match_buffer(strip_ids, (strip_state_words(M) * max(strips_mkt, 1),), "int32"),
             T.match_buffer(ac, (M, N), out_dtype), None, None)

    names = ("a", "b", "offsets", "ids", "bias", "row_scale", "residual", "state", "c", "counts", "strip_ids", "ac")
    return without_params(kernel, names, {name for name, taken in takes.items() if not taken})


def grouped_signature(K, N, num_experts, in_dtype, out_dtype, has_bias, mode, body, gate=False, glu=False):
    """The grouped GEMM's PrimFunc around ``body`` (:mod:`.grouped`): gather
    ``x[T, K], assignments[P], offsets[E + 1], w[E, K, N][, bias[E, N]][, gate[P, N]], h[P, N]``; scatter
    ``h[P, K], assignments[P], offsets[E + 1], w[E, K, N][, bias[E, N]], route_weight[P] (fp32),
    y[P, N]``; ``glu``: ``x[T, K], assignments[P], offsets[E + 1], w1[E, K, N], w3[E, K, N][, b1[E, N],
    b3[E, N]], h[P, N]``.  ``body``'s operands as :func:`gemm_signature`'s (A, B, offsets, ids, bias,
    row scale = route weight, the gate as the residual, C; no strips), then W3 and its bias."""
    E = num_experts
    takes = {"w3": glu, "bias": has_bias, "bias3": has_bias and glu, "gate": gate,
             "route_weight": mode == "scatter"}

    @T.prim_func(s_tir=False)
    def kernel(a: T.handle, assignments: T.handle, offsets: T.handle, w: T.handle, w3: T.handle, bias: T.handle,
               bias3: T.handle, gate: T.handle, route_weight: T.handle, c: T.handle):
        P = T.int64()
        A_ROWS = T.int64()   # gather: tokens (scatter: P)
        body(P, T.match_buffer(a, (P if mode == "scatter" else A_ROWS, K), in_dtype),
             T.match_buffer(w, (E, K, N), in_dtype), T.match_buffer(offsets, (E + 1,), "int32"),
             T.match_buffer(assignments, (P,), "int32"), T.match_buffer(bias, (E, N), in_dtype),
             T.match_buffer(route_weight, (P,), "float32"), T.match_buffer(gate, (P, N), out_dtype),
             T.match_buffer(c, (P, N), out_dtype), None, None, None, None,
             T.match_buffer(w3, (E, K, N), in_dtype), T.match_buffer(bias3, (E, N), in_dtype))

    names = ("a", "assignments", "offsets", "w", "w3", "bias", "bias3", "gate", "route_weight", "c")
    return without_params(kernel, names, {name for name, taken in takes.items() if not taken})
