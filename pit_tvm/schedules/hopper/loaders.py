"""The GEMM's loaders (SRead): shared-memory ring slots filled from global memory.

- TMA tiles (``tma_loader``): B's 64 x 64 atoms (and the dense kernel's 128 x 64 box of A) by
  one thread, completing on the ring's ``full`` mbarrier with the 128-byte swizzle;
- rows gathered through an index by cp.async (``sread_a``): A's listed rows, 16-byte chunks,
  zero-filled past the count;
- gathered K columns (``index_ahead``, ``sread_b``, ``tiles_loader``): the tiles kind's listed
  micro-tile columns of A and rows of B, the index entries loaded one K tile ahead.

The all-threads loop calls ``sread`` (A then B by every thread); the warp-specialized loader
warpgroup runs ``tma_loader`` or ``tiles_loader``.
"""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from pit_tvm.index.tiles import column_of_id
from pit_tvm.schedules.hopper.config import LOADER_THREADS, THREADS
from pit_tvm.schedules.hopper.smem import TMA_LOAD_2D, swizzle_128b
from pit_tvm.schedules.limits import dtype_bytes

#: what the loaders take from the kernel's plan (:func:`.gemm_body.gemm_kernel`): tile shapes
#: (``A_TILE = BM x BK``, ``B_TILE = BK x BN`` elements a slot, B's ring at ``B_BASE``), the
#: copy layouts, the ring, and the index helpers of the kernel's mode
GEMM_LOADER_NAMES = ('A_CHUNKS', 'A_LOADER_CHUNKS', 'A_ROW_CHUNKS', 'A_TILE', 'BK', 'BM', 'BN', 'B_BASE', 'B_ROWS',
                     'B_TILE', 'KT', 'STAGES', 'TX_BYTES', 'a_box', 'a_chunk', 'a_col_of', 'a_row_id', 'a_swizzled',
                     'a_valid', 'b_copy', 'b_k_row', 'b_kr', 'b_row_of', 'b_valid', 'copy16', 'first_row',
                     'gather_a', 'gathers_rows', 'in_dtype', 'k_tiles', 'loader_b_copy', 'micro_tile_id', 'mk',
                     'mode', 'ring', 'tiles', 'ws_tiles')


def gemm_loaders(k: SimpleNamespace) -> SimpleNamespace:
    """The loader macros of the GEMM kernel whose plan is ``k`` (the names of
    :data:`GEMM_LOADER_NAMES`)."""
    A_CHUNKS = k.A_CHUNKS
    A_LOADER_CHUNKS = k.A_LOADER_CHUNKS
    A_ROW_CHUNKS = k.A_ROW_CHUNKS
    A_TILE = k.A_TILE
    a_box = k.a_box
    BK = k.BK
    BM = k.BM
    BN = k.BN
    B_BASE = k.B_BASE
    B_ROWS = k.B_ROWS
    B_TILE = k.B_TILE
    KT = k.KT
    STAGES = k.STAGES
    TX_BYTES = k.TX_BYTES
    a_chunk = k.a_chunk
    a_col_of = k.a_col_of
    a_row_id = k.a_row_id
    a_swizzled = k.a_swizzled
    a_valid = k.a_valid
    b_copy = k.b_copy
    b_k_row = k.b_k_row
    b_kr = k.b_kr
    b_row_of = k.b_row_of
    b_valid = k.b_valid
    copy16 = k.copy16
    first_row = k.first_row
    gather_a = k.gather_a
    gathers_rows = k.gathers_rows
    in_dtype = k.in_dtype
    k_tiles = k.k_tiles
    loader_b_copy = k.loader_b_copy
    micro_tile_id = k.micro_tile_id
    mk = k.mk
    mode = k.mode
    ring = k.ring
    tiles = k.tiles
    ws_tiles = k.ws_tiles

    @T.macro
    def index_ahead(kt, tid, m, bm, OFF, IDS, a_col, b_row_id, a_col_next, b_row_next):
        """tiles: K tile kt's A columns and B rows from the index entries loaded the iteration
        before, and the next tile's loaded now; called before any cp.async of the iteration (each
        one orders memory, so a load after one would wait for it)"""
        if tiles:
            for j in T.unroll(A_CHUNKS):
                qa = kt * BK + (tid + THREADS * j) % A_ROW_CHUNKS * 8
                if gather_a:
                    a_col[j] = column_of_id(a_col_next[j], qa, mk)
                    a_col_next[j] = micro_tile_id(OFF, IDS, m, bm, qa + BK)
                else:
                    a_col[j] = qa   # (a compacted A holds position q in column q)
            for i in T.unroll(B_ROWS):
                qb = kt * BK + b_kr(tid, i)
                b_row_id[i] = column_of_id(b_row_next[i], qb, mk)
                b_row_next[i] = micro_tile_id(OFF, IDS, m, bm, qb + BK)

    @T.macro
    def sread_a(kt, t, copiers, bm, count, OFF, A, smem, a_row, a_col):
        """SRead of A's K tile kt into ring slot kt % STAGES by thread t of ``copiers`` (all
        threads, or a warp-specialized kernel's loader warpgroup): its chunks of rows ``a_row``"""
        for j in T.unroll(BM * BK // 8 // copiers):
            r, ch = a_chunk(t, copiers, j)
            # (a compacted A, like rows / dense, holds K position q in column q)
            T.evaluate(copy16(
                smem.ptr_to([kt % STAGES * A_TILE + r * BK + a_swizzled(ch, r) * 8]),
                A.ptr_to([a_row[j], a_col_of(a_col, j, kt * BK + ch * 8)]),
                a_valid(OFF, bm, kt * BK + ch * 8, first_row(bm) + r, count)))

    @T.macro
    def sread_b(kt, t, layout, bn, bm, OFF, B, smem, b_row_id):
        """SRead of B's K tile kt into ring slot kt % STAGES by thread t of ``layout``'s copiers:
        MN-major 64-column atoms, 128-byte swizzle (chunk ^ (k % 8))"""
        for i in T.unroll(layout.rows):
            for h in T.unroll(layout.groups):
                kr = layout.row(t, i)
                gch = layout.chunk(t, i, h)
                # tiles: B's row column(q) for the strip's compact position q
                T.evaluate(copy16(
                    smem.ptr_to([B_BASE + kt % STAGES * B_TILE + (gch // 8) * (BK * 64) + kr * 64
                                 + swizzle_128b(gch % 8, kr) * 8]),
                    B.ptr_to([b_row_of(b_row_id, i, kt * BK + kr), bn * BN + gch * 8]),
                    b_valid(OFF, bm, kt * BK + kr)))

    @T.macro
    def sread(kt, tid, bn, bm, count, OFF, A, B, smem, a_row, a_col, b_row_id):
        """SRead of K tile kt into ring slot kt % STAGES (cp.async, not yet committed)"""
        sread_a(kt, tid, THREADS, bm, count, OFF, A, smem, a_row, a_col)
        sread_b(kt, tid, b_copy, bn, bm, OFF, B, smem, b_row_id)

    @T.macro
    def tma_b_atoms(map_b, first, atoms, col, s, kt, bm, smem, bars):
        """TMA of ``atoms`` 64 x 64 atoms of B's K tile kt from ``map_b`` (columns ``col`` ..) into
        ring slot s's B tile from its atom ``first`` on, counted on the slot's ``full`` mbarrier"""
        for atom in T.unroll(atoms):
            T.ptx[TMA_LOAD_2D](smem.ptr_to([B_BASE + s * B_TILE + (first + atom) * BK * 64]),
                                T.address_of(map_b), col + atom * 64, b_k_row(bm, kt * BK), ring.full(bars, s))

    @T.macro
    def tma_loader(tid, bn, bm, m, count, OFF, IDS, A, smem, bars, map_a, map_b, map_b3, a_row, a_col):
        """ws: the loader warpgroup's K loop.  Once the consumers released ring slot kt % STAGES
        (its ``empty`` mbarrier), its first thread loads B's BN / 64 atoms of 64 x 64 (dense:
        and A's 128 x 64 box) by TMA, their bytes counted on the slot's ``full`` mbarrier; TMA
        writes the 128-byte swizzle the wgmma descriptors read (it follows the shared-memory
        address) and zeros past M.  Rows (and the grouped GEMM: its expert's rows, B = W[e]):
        every loader thread copies 8 chunks of A's listed rows by cp.async (``sread_a``),
        arriving on ``full`` when they land; with ``map_b3`` (glu) B's first BN / 128 atoms are
        W1's and the others W3's, both at the tile's BN / 2 columns of C.  The tiles kernel
        on a full index (see ``tiles_loader``) runs this loop as the dense kernel, each loader
        thread arriving on ``full`` at once (the slot's arrival count is the tiles loop's)."""
        lane = tid - THREADS
        if gathers_rows:
            for j in T.unroll(A_LOADER_CHUNKS):
                a_row[j] = a_row_id(IDS, first_row(bm) + a_chunk(lane, LOADER_THREADS, j)[0], m)
        for kt in T.serial(KT):
            s = kt % STAGES
            ring.acquire(bars, s, kt)
            if lane == 0:
                ring.expect_tx(bars, s, TX_BYTES)
                if a_box or ws_tiles:
                    T.ptx[TMA_LOAD_2D](smem.ptr_to([s * A_TILE]), T.address_of(map_a), kt * BK, first_row(bm),
                                        ring.full(bars, s))
                if map_b3 is None:
                    tma_b_atoms(map_b, 0, BN // 64, bn * BN, s, kt, bm, smem, bars)
                else:
                    tma_b_atoms(map_b, 0, BN // 128, bn * (BN // 2), s, kt, bm, smem, bars)
                    tma_b_atoms(map_b3, BN // 128, BN // 128, bn * (BN // 2), s, kt, bm, smem, bars)
            if gathers_rows:
                sread_a(kt, lane, LOADER_THREADS, bm, count, OFF, A, smem, a_row, a_col)
            if gathers_rows or ws_tiles:
                ring.arrive_on_copies(bars, s)

    lb_rows = loader_b_copy.rows

    def b_id_row(lane):
        """ws tiles: the K tile row whose index entry loader thread ``lane`` loads.  B's copy
        layout gives a loader warp 16 rows, ``2w + h + 8i`` (16 lanes a row: ``h = lane / 16``),
        and lane ``h + 2i`` holds row ``2w + h + 8i``'s entry: one load a thread a K tile, not
        ``lb_rows``, then a shuffle per row."""
        return lane // 32 * 2 + lane % 2 + 8 * (lane // 2 % 8)

    def b_entry(entry, lane, i):
        """ws tiles: the index entry of loader thread ``lane``'s i-th row of B, from the lane
        that loaded it"""
        return T.call_extern("int32", "__shfl_sync", T.uint32(0xFFFFFFFF), entry, lane % 32 // 16 + 2 * i, 32)

    @T.macro
    def tiles_loader(tid, bn, bm, m, OFF, IDS, B, smem, bars, map_a, a_col, b_row_id, a_col_next, b_row_next):
        """ws tiles: the loader warpgroup's K loop over the strip's listed K tiles.  Once the
        consumers released slot kt % STAGES, thread 0 loads A's 128 x 64 box by TMA at the
        column of K position kt * 64's micro-tile (for the empty strip's one K tile, a column
        of its all-zero rows), and every loader thread copies 16 chunks of B's listed rows by
        cp.async (16 lanes a row, zero-filled past the list) and arrives on the slot's ``full``
        mbarrier when they land.  Each thread loads one index entry a K tile, one tile ahead,
        and takes its 8 rows' entries by shuffles (``b_id_row``).  (A full index, the dense
        fallback or a dense pattern, runs ``tma_loader`` instead: A's and B's K tile kt by TMA,
        K position q = column q for both operands.  Tested per K tile inside this loop, it ran
        slower than the dense fallback kernel: docs/design/measurements.md#wgmma-planner.)"""
        lane = tid - THREADS
        a_col_next[0] = micro_tile_id(OFF, IDS, m, bm, 0)
        b_row_next[0] = micro_tile_id(OFF, IDS, m, bm, b_id_row(lane))
        for kt in T.serial(k_tiles(OFF, bm)):
            s = kt % STAGES
            a_col[0] = column_of_id(a_col_next[0], kt * BK, mk)
            a_col_next[0] = micro_tile_id(OFF, IDS, m, bm, kt * BK + BK)
            for i in T.unroll(lb_rows):
                b_row_id[i] = column_of_id(b_entry(b_row_next[0], lane, i), kt * BK + loader_b_copy.row(lane, i),
                                           mk)
            b_row_next[0] = micro_tile_id(OFF, IDS, m, bm, kt * BK + BK + b_id_row(lane))
            ring.acquire(bars, s, kt)
            if lane == 0:
                ring.expect_tx(bars, s, A_TILE * dtype_bytes(in_dtype))
                T.ptx[TMA_LOAD_2D](smem.ptr_to([s * A_TILE]), T.address_of(map_a), a_col[0], bm * BM,
                                    ring.full(bars, s))
            sread_b(kt, lane, loader_b_copy, bn, bm, OFF, B, smem, b_row_id)
            ring.arrive_on_copies(bars, s)

    return SimpleNamespace(index_ahead=index_ahead, sread_a=sread_a, sread_b=sread_b, sread=sread,
                           tma_loader=tma_loader, tiles_loader=tiles_loader)
