"""wgmma dense tiles for the PIT matmuls (rows and tiles kinds) and dense matmuls on the H100 (sm_90a).

The mma.sync kernels of :mod:`pit_tvm.schedules.tensorcore` top out near 0.4x cuBLAS on the
H100: Hopper's tensor cores reach full rate only through the asynchronous warpgroup MMA
(``wgmma.mma_async``), which reads both operands straight from shared memory.  TVM 0.27 has
no schedule primitive or tensor intrinsic for it, so this kernel is written explicitly in
TIRx (``T.ptx`` wgmma / cp.async, ``T.cuda.wgmma.encode_matrix_descriptor``) and lowered to
plain TIR (:func:`lower_tirx`), which the ordinary s_tir build (and a Relax ``call_tir``)
takes like any scheduled PrimFunc.

Workload: the same as :func:`pit_tvm.schedules.tensorcore.row_gather_matmul_func`::

    wgmma_row_gather(A[M, K], B[K, N], offsets: int32[2], ids: int32[M], [bias: N,] C[M, N])
    count = offsets[1]                 # read on the device only
    C[ids[p], :] = epilogue(A[ids[p], :] @ B)   for p < count    (fp32 accumulation)
    C[ids[p], :] = epilogue(0)                  for count <= p < M   (a zero row: 0 without bias)

``dense=True`` drops ``offsets`` and ``ids`` (``ids[p] = p``, ``count = M``): a model's dense
layers use that.  The unlisted rows are zeroed by the CTA whose p-tile holds them (CTAs past
``count`` only store zeros), so there is no separate zero-fill launch.

The same kernel body serves the *tiles* kind (:func:`wgmma_tiles_gather_func`, micro-tiles
along K covered by 128-row strips): the CTA of strip g reads K positions ``q`` of its list,
A's rows ``128g..`` at column ``column(q)`` (or a compacted copy of A for micro-tiles under 16
bytes wide, :func:`wgmma_compact_a_func`) and B's row ``column(q)``, for as many K tiles as the
strip lists (read on the device), and stores rows ``128g..`` of C directly.

One CTA = 2 warpgroups (256 threads) computes a 128 x BN tile of compacted rows::

    for each 64-deep K tile kt (STAGES-deep ring in shared memory, prefetch distance STAGES-2):
        SRead   A_s[128, 64]  <- A[ids[p0:p0+128], k0:k0+64]   cp.async, 16 B per row chunk,
                                   128B-swizzled K-major (chunk c of row r at c ^ (r % 8))
                B_s[64, BN]   <- B[k0:k0+64, n0:n0+BN]           cp.async, MN-major, 64-column
                                   atoms of 64 rows x 128 B, 128B-swizzled (chunk ^ (k % 8))
        warpgroup g: 4 x wgmma m64nBNk16, A_s[64g:64g+64, 16i:16i+16] x B_s[16i:16i+16, :]
                     -> acc[BN / 2] fp32 registers per thread; one wgmma group kept in flight
    SWrite  acc -> epilogue (bias, relu / gelu, row scale, cast) -> C_s[128, BN + pad] -> 16 B stores to rows
            ids[p] of C (epilogue(0) for count <= p < M), + residual

A dense kernel can also list its C's 128-row strips for a PIT matmul reading C (``strips_mk``,
:func:`wgmma_row_gather_func`): the staged tile's chunks flag its non-zero columns, and the
listed ones are placed in the strip by one atomic add per CTA while the SWrite stores.

Warp-specialized (dense and rows kernels with 64-deep K tiles, not the few-rows tier): a third
warpgroup fills the ring and the two above only compute, with no CTA barrier in the K loop::

    loader warpgroup (threads 256..383), K tile kt into slot s = kt % STAGES:
        wait empty[s] (the consumers released K tile kt - STAGES)
        thread 256: expect_tx(full[s], bytes); TMA B_s <- B[k0:k0+64, n0:n0+BN] (BN / 64 atoms
                    of 64 x 64, 128B swizzle); dense: TMA A_s <- A[p0:p0+128, k0:k0+64] too
        rows: each thread cp.async 8 chunks of A's listed rows into A_s (as above), then
              cp.async.mbarrier.arrive.noinc(full[s]) when they land
        then the warpgroup exits (the epilogue's CTA barriers wait only for live threads)
    consumer warpgroup g, K tile q: wait full[q % STAGES]; 4 x wgmma; keep one group in
        flight; arrive empty[(q - 1) % STAGES] once K tile q - 1's wgmma retired

H100 (``python3 benchmarks/_ws_probe.py`` at 7e82e0d, a probe since removed; 4096^3 fp16
dense; the all-threads kernel 219 us, cuBLAS 181): the same loop loading by cp.async from 1 /
2 / 4 loader warps took 448 / 289 / 222 us (issuing cp.async bounds it), by TMA 200 us;
4096 x 2048 x 8192 218 against 245 us, 4096 x 8192 x 2048 188 against 211 (cuBLAS 203, 195).
A TMA per listed row of A (rows) took 4096^3 from 225 to 1010 us: small boxes are slow, so A's
rows stay cp.async.
ptxas allocates registers for 12 warps whatever the count past 8, so 168 a thread: the dense
kernel with an fp32 residual (32 chunks loaded ahead of the SWrite) would spill and keeps the
all-threads loop, as does the few-rows tier.  (Two loader warpgroups would leave 128 registers,
too few for the m64n256 wgmma: ptxas allocates for the launch count even where ``setmaxnreg``
hands the loaders' registers to the consumers.)

The tiles kernel is warp-specialized where A's K tile is one TMA box of A (micro-tiles a
multiple of 64 columns wide, :func:`wgmma_tiles_config`)::

    loader warpgroup, K tile kt into slot s (``tiles_loader``):
        wait empty[s]; thread 256: expect_tx(full[s]); TMA A_s <- A[p0:p0+128, col:col+64], col
                    the column of K position 64 kt's micro-tile
        each loader thread: cp.async 16 chunks of B's listed rows (16 lanes a row; its 8 rows'
                    index entries: one load a thread, one K tile ahead, and a shuffle a row),
                    then cp.async.mbarrier.arrive.noinc(full[s])
        a full index (the dense fallback): TMA A_s and B_s at K tile kt, as the dense kernel

so it runs the dense fallback too, without a launch of its own.  Thin micro-tiles keep the
all-threads loop: with A compacted and its box read from the compacted A, B's rows scattered one
by one, the same loop measured slower (the OPT FFN's fc2 58.4 -> 61.9 us), as did an earlier
trial copying A by cp.async too, 24 chunks a loader thread (63.5 -> 72.6 us; 86c8377, reverted).

Shared memory per CTA: STAGES * (128 * 64 + 64 * BN) * 2 bytes (BN=256, 4 stages: 192 KiB).
(``WgmmaConfig.block_k=32``: 32-deep K tiles, A rows of 64 B with the 64-byte swizzle, chunk c
of row r at c ^ (r / 2 % 4); measured slower, kept for rows / dense as a tuning knob.)

What bounds the loop on the H100 (``benchmarks/_wgmma_stages.py``, ``_ncu_wgmma.py``): a
128 x 256 x 64 step is ~0.56 us of one SM's tensor-core rate, so few rows take one CTA's whole
K loop at N=256 (45 rows of 4096^3: 59-64 us); narrower tiles spread it over more SMs but pay
~0.4 us of fixed cost per step (N=64, 8 stages: 37 us).  (Before the SWrite loaded its row ids
ahead, the zero-only CTAs' id-load latency hid this: every width measured ~58 us.)

So a rows matmul runs as tiers chosen on the device by the row count
(:func:`wgmma_few_rows_tiers`): the kernel above for many rows, and for at most F rows
(the rows whose 128-column tiles fill one wave) 128-column tiles with a 6-deep ring on
persistent CTAs, a store warpgroup of each storing the unlisted rows; for fewer still (the rows
whose 64-column tiles fill one wave) 64-column tiles with an 8-deep ring.  All are launched,
those not needed return at once.  4096^3 at 99 % / 95 % of rows empty: kernel 57 -> 47-49 /
48-54 us with the 128-column tier (``benchmarks/gpu_matmul.py``, H100, two runs).

Tried and dropped: splitting the few-rows tier's K loop over the idle SMs (partial sums through
an L2 workspace, the last split of a tile adding them; 665ee14 with
``benchmarks/_few_rows_splits.py``).  It took 41 rows of 4096^3 from 43.8 to 36.4 us, but the
kernel that could split ran ~6 us slower wherever it did not (410 rows: 47.7 -> 54.0 us; nvcc
recomputed the loop's address arithmetic every K tile), and the unlisted rows' stores (a 32 MiB
memset alone takes 14.6 us) bound what it can gain.  Tried again on the warp-specialized rows
kernel (trial 3c7cbe5, reverted; ``python3 benchmarks/_split_k_probe.py`` there): a 1-D grid
whose first CTAs split each tile of listed rows over up to ``SMS / tiles`` CTAs (at most 2 or
4), fp32 partials through a workspace, the last split adding them before the epilogue.  Device
time per call (torch.profiler, L2 warm, H100, 2026-11-24), 4096^3 at 41 / 205 / 410 / 1024 /
2048 / 4096 listed rows: the op's kernels 30.2 / 40.2 / 42.9 / 55.6 / 99.6 / 195.9 us, the split
kernel's best width 32.9 / 40.8 / 44.4 / 57.9 / 106.7 / 210.1 us (where nothing splits the 1-D
grid's dynamic K range costs ~7 %); 128 rows alone (no unlisted rows) 22.9 against 21.7 us with
4 splits of 128 columns (4x fewer K steps a CTA, 5 % faster); BERT's FFN-out (4096 x 3072 x 768,
2,400 rows) 23.8 against 23.8 us, its output projection (K = 768) 7.4 against 9.2 us.  Fewer K
steps a CTA barely shortened a call.  Also tried: launching the tiles kernel's CTAs strip-major,
so that the CTAs running together share B's N tiles (4aa3458, ``benchmarks/_tiles_raster.py``):
the FFN's fc2 61.0 against 60.4 us.  ncu on that kernel (``benchmarks/_ncu_tiles_ffn.py``): DRAM
34 % and SM 54 % of peak, L2 hit rate 67 % (the dense kernel of the shape: 19 %, 76 %, 81 %):
neither memory nor tensor cores bound it; ~1.3 us per K tile under ncu against 0.93 dense.  A
deeper pipeline does not help it either: 32-deep K tiles (the block_k check relaxed for the
trial) with 8 or 6 stages took 74.8 / 75.1 us against 60.4-60.7 at 256x4 (``_tiles_widths.py
256x4 256x8x32 256x6x32``), so its K step's fixed cost, not load latency, is what to cut.
Gathering B with 16 lanes a row, so that a thread loads 4 index entries a K tile instead of 8,
took it 60.4-60.7 -> 57.9-58.0 us (222 -> 203 registers).  L2 traffic under ncu (the same probe,
2026-11-24): the tiles kernel 378 MB in 70.3 us, the dense kernel of the shape 1.23 GB in 238.8
us: both ~5.2-5.4 TB/s, 54-55 % of ncu's L2 peak.  That is not what bounds them: 2-CTA clusters
of consecutive M tiles sharing B's K tiles by TMA multicast (each CTA loads half of each B atom's
rows into both rings, a consumer releases a slot on both CTAs' ``empty`` barriers, the loaders
wait for the last releases before exiting; trial f29e813, reverted, ``python3
benchmarks/_cluster_probe.py [--8192]`` there) cut B's L2 reads in half and measured, device time
per call on the H100 (2026-11-24), 4096^3 dense 197.1 -> 193.4 us, 2,048 of 4,096 rows 101.6 ->
100.2, 410 rows 42.8 -> 43.5; 4096 x 2048 x 8192 215.0 -> 214.1, 4096 x 8192 x 2048 184.8 ->
186.3; BERT's 2,400-row layers 8-26 % slower (FFN-out 24.2 -> 26.2 us); 8192^3 dense 1674.5 ->
1619.7, 4,096 of 8,192 rows 825.3 -> 790.0, 819 rows 211.7 -> 214.4.  Gains of 2-4 % on the
largest grids only (4096^3 dense 1.9 %), so it was not kept.

Launch order (``WgmmaConfig.raster_m``, :data:`RASTER_M`): a grid's CTAs start x (N tiles)
first, so a wave of 132 CTAs of 128 x 256 tiles took ~4 M tiles and every N tile, reading all of
B; at 8192^3 B (128 MiB) does not fit L2, and each wave read it from DRAM again.  Launched in
groups of 16 M tiles (Triton's grouped order), a wave takes 16 M tiles of ~8 N tiles.  Device
time with L2 flushed, H100 (``python3 benchmarks/_raster_probe.py [--4096]`` at ad36474,
2026-11-24), groups of 1 -> 8 -> 16 M tiles: 8192^3 819 / 2,048 / 4,096 rows and dense 204.9 /
404.3 / 787.6 / 1699.5 -> 191.4 / 389.7 / 748.0 / 1469.0 -> 191.6 / 388.0 / 745.1 / 1462.0 us
(cuBLAS 1441.6); 4096^3 2,048 rows and dense 98.0 / 189.3 -> 99.0 / 186.0 -> 98.5 / 184.8 us
(cuBLAS 178.6).  Only the dense kernels take it: the rows kernel grouped (at 19ea360) made
BERT's rows kernels over ~2,400 of 4,096 rows 15-29 % slower (device time per call, 12 layers:
QKV 256.0 -> 305.1 us, FFN-in 392.7 -> 449.6; ``python3 benchmarks/_model_kernels.py bert
--pit``), CTAs of listed rows queued behind zero-only ones starting their K loops late; grouping
only the listed rows' M tiles (their count read first) made its GELU variant spill.  The
clusters above, rebuilt at 501e860 and measured in the same run, added nothing to the grouped
order (8192^3 dense 1470.9, 4,096 rows 741.3 us) and lost where a
cluster pairs a tile of listed rows with an idle one (819 rows 213.2; 82 rows 110.9 -> 146.0 us
with L2 warm, ``benchmarks/_cluster_probe.py --8192`` there), so they were taken out again.

Also tried: the same kernels on SMS persistent CTAs (trial 1eca2dd, reverted; ``python3
benchmarks/_pws_probe.py`` there), the loader filling a CTA's next tile's ring while its consumers
store the last tile straight from their fragments (half2 stores: the ring holds no staged tile).
Device time on the H100, grid -> persistent: 4096^3 dense 190.6 -> 207.9 us, 2,048 rows 98.5 ->
125.7; BERT's FFN-in with GELU over 2,400 rows 30.6 -> 48.2, dense 43.5 -> 57.6.  With C's stores
left out of both (a diagnostic build on top of the trial, not committed) the persistent loop was
still slower: 184.3 -> 186.3, 93.5 -> 97.9, 25.6 -> 37.5, 38.0 -> 47.3 us; so C's stores cost the
grid kernels 4.4-6.8 us a call, and a persistent grid here gains nothing that would pay for them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import tvm
from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.index._tile_kernels import (STATE_DTYPE, lanes_below, state_add, state_completes, state_listed,
                                         warp_ballot)
from pit_tvm.index.tiles import column_of_id, strip_column, strip_micro_tile, strip_positions
from pit_tvm.schedules.dependent_launch import with_dependent_launch
from pit_tvm.schedules.limits import IN_DTYPES, OUT_DTYPES, dtype_bytes, max_smem_bytes
from pit_tvm.target import sm_version

__all__ = ["WgmmaConfig", "BCopyLayout", "WGMMA_ARCH", "wgmma_applies", "wgmma_config", "wgmma_tiles_config",
           "tiles_ws_applies", "residual_spills_ws", "wgmma_row_gather_func",
           "wgmma_few_rows_tiers",
           "wgmma_tiles_applies", "needs_compaction", "wgmma_tiles_gather_func",
           "wgmma_compact_a_func", "wgmma_dense_fallback_func", "index_is_full", "lower_tirx", "DENSE_ATTR", "ROWS_ATTR",
           "dense_kernel_args", "strip_state_words", "strip_closer"]

#: the only arch with wgmma (the ``a`` suffix: arch-specific features, H100 / H200)
WGMMA_ARCH = "sm_90a"
BLOCK_M = 128          # 2 warpgroups x wgmma M=64
BLOCK_K = 64           # one 128-byte swizzle atom of fp16/bf16 along K
THREADS = 256
MAX_SMEM_BYTES = max_smem_bytes(WGMMA_ARCH)
_PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}
_SWIZZLE_128B = 3      # encode_matrix_descriptor's codes for the 128- and 64-byte swizzles
_SWIZZLE_64B = 2
_TARGET = tvm.target.Target({"kind": "cuda", "arch": WGMMA_ARCH})
#: the warpgroup after the two consumer warpgroups that loads the ring of a warp-specialized kernel
#: (ptxas allocates registers for 12 warps even with 9, so a whole warpgroup costs nothing more)
LOADER_THREADS = 128
#: the warpgroup after the consumers of a few-rows tier that stores C's rows past its listed rows'
#: tiles once the CTA's K loop is done
STORER_THREADS = 128
#: unlisted rows a store thread loads the ids of at a time, the next batch's before this batch's
#: stores (nvcc does not move a load above a store to C, which may alias it, so ids loaded just
#: before their use would cost a load latency per row)
STORE_BATCH = 8
_TMA_LOAD_2D = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
_TMA_SWIZZLE_128B = 3          # CUtensorMapSwizzle / CUtensorMapL2promotion codes
_TMA_L2_PROMOTION_128B = 2


def _exit_thread():
    """PTX ``exit``: the calling thread ends (CTA barriers then wait only for the others)"""
    return T.cuda.func_call("pit_exit_thread", source_code=(
        "__forceinline__ __device__ void pit_exit_thread() { asm volatile(\"exit;\" ::: \"memory\"); }"))


#: the attr of a dense wgmma kernel: the arguments of :func:`wgmma_row_gather_func` that made it
DENSE_ATTR = "pit.wgmma_dense"
#: the attr of a rows wgmma kernel: its :class:`WgmmaConfig`'s tile width, ring depth and K tile
ROWS_ATTR = "pit.wgmma_rows"
#: M tiles per launch-order group of the dense kernels (``WgmmaConfig.raster_m``,
#: measured in the module docstring)
RASTER_M = 16


@dataclass(frozen=True)
class WgmmaConfig:
    """Tile knobs: ``block_n`` (wgmma N, 64..256, multiple of 64), ``stages`` (shared-memory
    ring depth, >= 3: ``stages - 2`` K tiles load while one computes and the previous one's
    wgmma may still run) and ``block_k`` (K tile depth: 64, or 32 for rows / dense).
    (Loading ``stages - 1`` ahead, with a second CTA barrier per K tile before a slot is
    refilled, measured slower on the H100: 257 vs 218 us at 4096^3.  So did ``block_k=32``
    with twice the stages: 316 vs 229 us dense at 4096^3 (``benchmarks/_wgmma_stages.py
    256x4 256x8x32``); a K tile's time is mostly fixed cost per loop step, not load latency.)"""

    block_n: int = 256
    stages: int = 4
    block_k: int = BLOCK_K   # 64 (A rows of 128 B, 128-byte swizzle) or 32 (64 B, 64-byte swizzle)
    #: the tiles kernel warp-specialized (a loader warpgroup, ``tiles_loader``), not the
    #: all-threads loop
    tiles_ws: bool = False
    #: the dense kernels' launch order: CTAs in groups of ``raster_m`` M tiles, each group's N
    #: tiles one after another (1: row-major, every N tile of an M tile first)
    raster_m: int = RASTER_M

    def __post_init__(self):
        if self.raster_m < 1:
            raise ValueError(f"raster_m must be positive, got {self.raster_m}")

    def smem_bytes(self, out_dtype: str = "float16") -> int:
        ring = self.stages * (BLOCK_M * self.block_k + self.block_k * self.block_n) * 2
        return max(ring, _c_stage_elems(self.block_n, out_dtype) * dtype_bytes(out_dtype))


@dataclass(frozen=True)
class BCopyLayout:
    """Which 16-byte chunks of a K tile of B (``block_k`` rows of ``block_n / 8`` chunks) each
    of a CTA's threads copies: for ``i < rows`` and ``h < groups``, chunk ``chunk(tid, i, h)``
    of the tile's row ``row(tid, i)`` (ints or TIR expressions).

    The tiles kind, where ``16`` divides a row's chunks: 16 lanes a row (two 256-byte runs a
    warp), rows ``tid / 16 + 16 i``, so that a thread gathers 4 rows of B a K tile at
    ``block_n=256`` (their index entries loaded per K tile), not 8.  Otherwise the chunks in
    linear order, chunk ``tid + THREADS i`` of the tile (at ``block_n=192`` a row's 24 chunks
    do not divide ``THREADS``, so no lane pattern repeats across rows)."""

    block_n: int
    block_k: int
    tiles: bool
    threads: int = THREADS    # the copying threads (a warp-specialized loader's)

    @property
    def row_chunks(self) -> int:
        return self.block_n // 8

    @property
    def lanes(self) -> int:
        """threads per row of B (0: the linear order)"""
        return 16 if self.tiles and self.row_chunks % 16 == 0 else 0

    @property
    def groups(self) -> int:
        return self.row_chunks // self.lanes if self.lanes else 1

    @property
    def rows(self) -> int:
        return self.block_k * self.row_chunks // self.threads // self.groups

    def row(self, tid, i):
        if self.lanes:
            return tid // self.lanes + (self.threads // self.lanes) * i
        return (tid + self.threads * i) // self.row_chunks

    def chunk(self, tid, i, h):
        if self.lanes:
            return tid % self.lanes + self.lanes * h
        return (tid + self.threads * i) % self.row_chunks


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


def _c_row(block_n: int, out_dtype: str) -> int:
    """Row pitch of the staged C tile in elements: 16 bytes of padding spreads the 8 rows one
    warp's fragments hit over all banks."""
    return block_n + 16 // dtype_bytes(out_dtype)


def _c_stage_elems(block_n: int, out_dtype: str) -> int:
    """the staged C tile, then one row of the value of a zero row (``epilogue(0)``)"""
    return BLOCK_M * _c_row(block_n, out_dtype) + block_n


def wgmma_applies(k: int, n: int, in_dtype: str, out_dtype: str, arch: str) -> bool:
    return (arch == WGMMA_ARCH and in_dtype in IN_DTYPES and out_dtype in OUT_DTYPES
            and k % BLOCK_K == 0 and wgmma_config(n) is not None)


#: relative speed of one CTA's work per output element for each wgmma N (narrower tiles move
#: more B per FLOP).  H100, 4096^3 fp16, one wave per N tile count: 256 x 4 stages 218 us,
#: 128 x 4 stages 266 us (0.82); 192 and 64 are interpolated, not measured.
TILE_SPEED = {256: 1.0, 192: 0.92, 128: 0.82, 64: 0.6}
#: SMs of the H100 SXM: CTAs past a multiple of it start a new wave
SMS = 132
#: deepest ring: on the H100 4 stages beat 6 at every N (128 x 6: 283-295 us vs 266)
MAX_STAGES = 4


def wgmma_config(n: int, rows: int | None = None, block_n: int | None = None) -> WgmmaConfig | None:
    """The default tiles for N: the wgmma N (256, 192, 128 or 64, dividing N) and the deepest
    ring that fits, up to :data:`MAX_STAGES`.  Without ``rows`` the widest N; with the expected
    number of rows the one whose grid takes the least time in whole waves of :data:`SMS` CTAs
    (a narrow layer over few rows fills the GPU with narrower tiles: BERT's N=768 over ~2400
    rows is 57 CTAs of 256 columns, 114 of 128); when that grid is one wave, 128- and 64-column
    tiles take the few-rows tier's deeper ring (:data:`FEW_ROWS_STAGES`).  ``block_n``: that
    width instead of the chosen one (its ring as above; None where it does not divide N)."""
    candidates = [bn for bn in (256, 192, 128, 64) if n % bn == 0]
    if block_n is not None:
        candidates = [bn for bn in candidates if bn == block_n]
    if not candidates:
        return None
    block_n = candidates[0]
    if rows is not None:
        row_tiles = max(1, -(-int(rows) // BLOCK_M))

        def cost(bn):
            return -(-row_tiles * (n // bn) // SMS) * bn / TILE_SPEED[bn]

        block_n = min(candidates, key=cost)
    stages = 3
    while stages < MAX_STAGES and WgmmaConfig(block_n, stages + 1).smem_bytes("float32") <= MAX_SMEM_BYTES:
        stages += 1
    one_wave = rows is not None and row_tiles * (n // block_n) <= SMS
    if one_wave and block_n in FEW_ROWS_STAGES:
        # one wave of CTAs, each alone on its SM for its whole K loop: the deeper ring of the
        # few-rows tier (H100, 2,400 rows, 128-column tiles: K=3072 N=768 33.4 against 35.7 us,
        # K=768 N=768 13.4 against 14.7 us; ``python3 benchmarks/_wgmma_stages.py 128x4 128x6``)
        stages = FEW_ROWS_STAGES[block_n]
    return WgmmaConfig(block_n, stages)


def residual_spills_ws(residual: bool, out_dtype: str) -> bool:
    """An fp32 residual, its 32 chunks loaded ahead of the SWrite, spills in a warp-specialized
    kernel (12 warps: 168 registers a thread), which then keeps the all-threads loop."""
    return residual and dtype_bytes(out_dtype) == 4


def tiles_ws_applies(mk: int, block_n: int, out_dtype: str, residual: bool) -> bool:
    """Whether the warp-specialized tiles loop takes these tiles: micro-tiles a multiple of 64
    wide (A's K tile is one TMA box of A), tiles a multiple of 128 wide (16 lanes a row of B),
    and no residual that spills there (:func:`residual_spills_ws`)."""
    return mk % BLOCK_K == 0 and block_n % 128 == 0 and not residual_spills_ws(residual, out_dtype)


def wgmma_tiles_config(n: int, mk: int, rows: int | None = None, out_dtype: str = "float16",
                       residual: bool = False) -> WgmmaConfig | None:
    """The tiles kernel's tiles for N and ``(128, mk)`` micro-tiles: :func:`wgmma_config`'s,
    warp-specialized (``tiles_ws``: A's K tile loaded by TMA, and the dense fallback run by the
    same kernel, no launch of its own) where :func:`tiles_ws_applies`.  H100, device time of
    the kernel alone, all-threads -> warp-specialized (``python3 benchmarks/_tiles_widths.py [--random] 256x4 256x4ws``,
    2026-11-24): 4096^3 with 32x64 micro-tiles at 95 / 99 % 65.5 -> 59.4, 26.9 -> 26.3 us.
    (Thin micro-tiles, A compacted and its K tile loaded by TMA from the compacted A, B's rows
    scattered one by one, measured slower that way: 32x1 at 95 / 99 % 62.9 -> 67.1, 31.4 -> 32.2
    us, the OPT FFN's fc2 58.4 -> 61.9 us.)"""
    config = wgmma_config(n, rows)
    if config is None:
        return None
    return replace(config, tiles_ws=tiles_ws_applies(mk, config.block_n, out_dtype, residual))


#: erfc(z) ~ poly(t) * exp(-z^2), t = 1 / (1 + P z), z >= 0, poly(t) = sum_i A_i t^i for i = 1..5
#: (Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7 in erf): P, then A_1..A_5
_ERFC_P = 0.3275911
_ERFC_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def gelu_erf(v):
    """GELU in its erf form, ``v * Phi(v)`` (fp32, CUDA): within 5e-7 of the exact value (as
    close as fp32 math on CUDA's ``erff`` gets) in about 19 PTX instructions against 33: one fast
    reciprocal, one fast exp, one polynomial, no branch (``erff`` evaluates two polynomials and
    selects).  The epilogue runs it on every element after the K loop while the tensor cores
    idle: BERT's FFN-in GELU took ~10 us of each call on the H100.

    With z = |v| / sqrt(2): ``Phi(-|v|) = erfc(z) / 2 = q``, ``Phi(v) = 1 - q`` for v >= 0."""
    f32 = T.float32
    x, t = tirx.Var("x", "float32"), tirx.Var("t", "float32")
    half_poly = f32(0.5 * _ERFC_A[-1])           # poly(t) / 2, Horner
    for a in reversed(_ERFC_A[:-1]):
        half_poly = half_poly * t + f32(0.5 * a)
    q = half_poly * t * T.call_pure_extern("float32", "__expf", x * (x * f32(-0.5)))
    one_over = T.call_pure_extern("float32", "__fdividef", f32(1),
                                  f32(1) + f32(_ERFC_P * 0.7071067811865476) * T.fabs(x))
    phi = tirx.Let(t, one_over, T.Select(x >= f32(0), f32(1) - q, q))
    return tirx.Let(x, v, x * phi)


def lower_tirx(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc:
    """Lower an explicit TIRx kernel (``T.device_entry``, ``T.cta_id``...) to plain TIR with
    launch_thread bindings, so that the s_tir build pipeline (Relax's) compiles it; for sm_90
    and later launched with programmatic dependent launch (:mod:`pit_tvm.schedules.dependent_launch`)."""
    mod = tvm.IRModule({"main": func.with_attr("target", target)})
    with target:
        mod = tvm.transform.Sequential([tirx.transform.LowerTIRx(),
                                        tirx.transform.LowerTIRxOpaque()])(mod)
    lowered = mod["main"].without_attr("target").with_attr("tirx.is_scheduled", True)
    return with_dependent_launch(lowered) if sm_version(target) >= 90 else lowered


@functools.lru_cache(maxsize=64)
def wgmma_row_gather_func(k: int, n: int, in_dtype: str = "float16", out_dtype: str = "float16",
                          bias: bool = False, relu: bool = False, dense: bool = False,
                          config: WgmmaConfig | None = None, gelu: bool = False,
                          row_scale: bool = False, row_scale_masks: bool = False,
                          residual: bool = False, rows_above: int = 0, rows_upto: int = 0,
                          row_scale_a: bool = False, strips_mk: int = 0) -> tirx.PrimFunc:
    """The lowered wgmma row-gather (or, ``dense=True``, plain) matmul PrimFunc; ``M`` is a
    symbolic int64, K and N compile-time.  Epilogue: ``bias`` (a ``[N]`` parameter), then
    ``relu`` or ``gelu`` (erf form), then ``row_scale`` (a ``[M]`` parameter after the bias,
    of the input dtype, multiplying row i: a padding mask).  ``row_scale_masks``: the row scale
    is zero on every row the index skips (it is the mask the index was built from), so those
    rows are stored as zeros.  Raises ValueError when the shape or dtypes do not fit (see
    :func:`wgmma_applies`).  ``residual`` (with a bias only): a ``[M, N]`` parameter of the
    output dtype added last, in the output dtype (a transformer's skip connection).
    ``row_scale_a`` (with a bias): the row-scale parameter ``s`` multiplies A's rows, before
    the bias (``A`` is given unscaled: ``act(s * (a @ b) + bias)`` for ``act((s * a) @ b +
    bias)``, then ``* s`` with ``row_scale`` too): a GEMM on a padding-masked input without
    the masking kernel.

    The tiers of :func:`wgmma_few_rows_tiers`, each writing all of C when it runs and nothing
    otherwise: ``rows_above=F`` runs when the index lists more than F rows, ``rows_upto=F``
    when it lists at most F (on :data:`SMS` persistent CTAs), both for ``rows_above < count <=
    rows_upto``.

    ``strips_mk`` (dense, fp16/bf16 out): the epilogue also builds the one-pass strips index of
    C (:func:`pit_tvm.schedules.wgmma_strips.strip_list_func` on C, for ``(128, strips_mk)``
    micro-tiles) from the staged tile, so a PIT matmul consuming C need not read it again:
    the function takes the strips' ``state`` after the epilogue's inputs and writes ``counts``,
    ``strip_ids`` (and, for micro-tiles under 16 bytes, the compacted ``ac``) after ``c``.
    Dense kernels carry :data:`DENSE_ATTR`, the arguments that rebuild them."""
    if rows_upto and rows_above >= rows_upto:
        raise ValueError(f"a tier runs for rows_above < count <= rows_upto: no rows between "
                         f"{rows_above} and {rows_upto}")
    if dense and (rows_above or rows_upto):
        raise ValueError("a dense kernel has no row tiers (it lists every row)")
    if relu and gelu:
        raise ValueError("relu and gelu are alternatives")
    if row_scale and not bias:
        raise ValueError("row_scale comes with a bias (the kernel variants that take it)")
    if row_scale_a and not bias:
        raise ValueError("row_scale_a comes with a bias (the kernel variants that take it)")
    if residual and (not bias or relu or gelu or row_scale or row_scale_a):
        raise ValueError("residual comes with a bias alone (the kernel variants that take it)")
    config = config or wgmma_config(n)
    if (config is None or k % BLOCK_K or n % config.block_n or config.block_n % 64
            or config.block_k not in (32, 64)):
        raise ValueError(f"wgmma tiles need K % {BLOCK_K} == 0 and N % block_n == 0 "
                         f"(block_n a multiple of 64, block_k 32 or 64), got K={k}, N={n}, {config}")
    if in_dtype not in IN_DTYPES or out_dtype not in OUT_DTYPES:
        raise ValueError(f"wgmma takes {IN_DTYPES} in and {OUT_DTYPES} out, got {in_dtype} -> {out_dtype}")
    if config.stages < 3 or config.smem_bytes(out_dtype) > MAX_SMEM_BYTES:
        raise ValueError(f"{config} needs >= 3 stages and at most {MAX_SMEM_BYTES} B of shared memory")
    if strips_mk and (not dense or dtype_bytes(out_dtype) != 2 or 64 % int(strips_mk)):
        raise ValueError(f"strips_mk lists a dense kernel's fp16/bf16 C in micro-tiles dividing 64 columns, "
                         f"got strips_mk={strips_mk}, dense={dense}, {out_dtype}")
    act = "relu" if relu else ("gelu" if gelu else None)
    func = _kernel(int(k), int(n), in_dtype, out_dtype, bool(bias), act, "dense" if dense else "rows",
                   config, row_scale=bool(row_scale), row_scale_masks=bool(row_scale_masks),
                   residual=bool(residual), rows_above=int(rows_above), rows_upto=int(rows_upto),
                   row_scale_a=bool(row_scale_a), strips_mk=int(strips_mk))
    func = lower_tirx(func, _TARGET)
    if dense:
        return func.with_attr(DENSE_ATTR, {
            "k": int(k), "n": int(n), "in_dtype": in_dtype, "out_dtype": out_dtype, "bias": bool(bias),
            "relu": bool(relu), "gelu": bool(gelu), "row_scale": bool(row_scale), "residual": bool(residual),
            "row_scale_a": bool(row_scale_a), "block_n": config.block_n, "stages": config.stages,
            "block_k": config.block_k, "strips_mk": int(strips_mk)})
    # (the op layer looks for it: the rows kernel may be split into the row-count tiers, planned
    # from this config)
    return func.with_attr(ROWS_ATTR, {"block_n": config.block_n, "stages": config.stages, "block_k": config.block_k})


def dense_kernel_args(func) -> dict | None:
    """The keyword arguments of :func:`wgmma_row_gather_func` that rebuild the dense kernel
    ``func`` (``config`` a :class:`WgmmaConfig`), or None for any other PrimFunc."""
    attrs = func.attrs
    if attrs is None or DENSE_ATTR not in attrs:
        return None
    args = {key: (str(v) if key.endswith("dtype") else int(v)) for key, v in attrs[DENSE_ATTR].items()}
    config = WgmmaConfig(args.pop("block_n"), args.pop("stages"), args.pop("block_k"))
    flags = ("bias", "relu", "gelu", "row_scale", "residual", "row_scale_a")
    return dict(args, **{f: bool(args[f]) for f in flags}, config=config, dense=True)


#: the few-rows tiers' ring depth by tile width (H100, 4096^3 fp16 rows, one wave of CTAs:
#: 205 rows 128 x 6 43.0 us against 128 x 4 55.6 and 256 x 4 62.9; 45 rows 64 x 8 38.2 against
#: 64 x 4 52.9; ``COUNTS=45,205 python3 benchmarks/_wgmma_stages.py --square 256x4 128x4 128x6
#: 64x4 64x8``).  Deeper still (the most that fits: 128 x 7, 64 x 9) measured the same, the
#: running tier's device time in the op 44.9 / 38.5 / 36.7 -> 45.3 / 38.8 / 36.6 us at 4096^3 and
#: 90 / 95 / 99 % of rows empty, 91.8 / 94.6 -> 89.1 / 95.4 us at 8192^3 and 97 / 99 % (H100,
#: 2026-11-24, ``python3 benchmarks/_few_rows_stages.py [--size 8192 --sparsity 0.97 0.99 --]
#: 128x6,64x8 128x7,64x9``)
FEW_ROWS_STAGES = {128: 6, 64: 8}


def wgmma_few_rows_tiers(n: int, config: WgmmaConfig, out_dtype: str = "float16",
                         rows_hint=None) -> list[tuple[int, WgmmaConfig]]:
    """The rows kernel's persistent tiers below ``config``'s many-rows kernel, widest first:
    ``[(F_0, config_0), (F_1, config_1)]`` with F descending; tier i runs when the index lists
    at most F_i rows and more than F_(i+1) (the last tier: from none), the many-rows kernel
    above F_0.  Few rows leave most SMs idle at the many-rows tile width, and each CTA's K loop
    is bound by load latency: a tier takes 128- or 64-column tiles with a deeper ring, F = the
    rows whose tiles fill one wave of :data:`SMS` CTAs.  A tier is left out where it is no
    narrower than the one above it or would take no rows of its own.  Every call pays each
    idle kernel's no-op launch (H100, 4096^3, device time: the many-rows kernel's 4.2-4.3 us, a
    tier's 1.3-1.4 us; ``python3 benchmarks/_rows_op_kernels.py 0 0.5 0.9 0.95 0.99``,
    2026-11-24), so the widest tier is left out where the expected rows (``rows_hint``) are over
    2F, a narrower one where they are over its F.

    Why two widths (H100, kernel alone, ``python3 benchmarks/_few_rows_width.py``,
    2026-11-24): at 4096^3 40 / 204 / 409 rows took 44.4 / 48.5 / 53.6 us with 128 x 6 tiles and
    35.0 / 42.9 / 66.6 with 64 x 8 (F_1 = 256 rows); at 8192^3 81 / 409 rows 120.4 / 201.7 us
    and 109.3 / 250.9 (F_1 = 128): narrower tiles win while they fit one wave.  The tiers keep
    the all-threads K loop: warp-specialized (a trial, reverted: safe up to their F, where each
    CTA computes at most its first tile) they measured 44.8 / 47.0 / 51.7 and 35.8 / 42.8 us at
    4096^3, 127.2 and 107.6 at 8192^3, within noise of the above.  What bounds a tier's K loop
    (ncu on the H100, ``ncu --kernel-name regex:tier --page source --print-source sass ...
    python3 benchmarks/_ncu_tier.py 410``, 2026-11-24, 410 of 4096 rows, 128 x 6): not L2 (53 %
    of its peak) nor DRAM (26 %); the tensor pipe is busy ~40 % of the time.  A K step is ~150
    SASS instructions a consumer warp (4 wgmma, their descriptors, the slot's ``% 6``, the
    proxy fence and CTA barrier, the next K tile's 8 cp.async and their addresses), each warp
    issuing one every ~10.5 cycles with two consumer warps a scheduler: ~1,250 cycles a step
    against ~420 for the wgmma.  Fewer instructions a step, not more bandwidth, is what would
    speed it up (a deeper ring does not, see :data:`FEW_ROWS_STAGES`).  Nor did the slot's
    modulo, where ~16 % of the loop's stall samples fell: the slots counted on from K tile to K
    tile (a trial, reverted) measured 45.2-45.3 -> 46.1 us at 410 rows (128 x 6) and 110.7-111.1
    -> 112.5 us at 8192^3 and 97 % (``_rows_op_kernels.py``, H100, 2026-11-24).  The unlisted rows' stores
    stay after the K loops: a trial (reverted) in which a tier without an epilogue stored them
    as whole rows of C, one row id a row, a CTA with a tile storing one of its rows per K step
    of that tile and the rest in batches of 8 after it, measured slower: 67.6 / 66.6 / 66.9 and
    44.8 / 45.1 us at 4096^3, 155.3 and 118.1 at 8192^3; in the op (4096^3 at 90 / 95 / 99 %)
    the tier's device time went 49.3 / 38.5 / 32.8 -> 57.8 / 39.0 / 38.4 us.  Nor does the
    many-rows kernel, launched anyway, store them well: a trial (reverted) in which it stored the
    p-tiles past the listed rows whenever the tier's idle CTAs were too few (the tier then only
    computing) measured, device time of the op's kernels with L2 flushed (``python3
    benchmarks/_rows_op_kernels.py --size 8192 0.9 0.95 0.99`` and ``--size 4096``, H100,
    2026-11-24), many-rows + tier kernel: 8192^3 at 99 % 13.5 + 101.2 -> 76.7 + 58.2 us, 4096^3
    at 90 % 4.3 + 50.1 -> 20.7 + 38.0, at 95 % 4.3 + 38.8 -> 20.4 + 27.5: its CTAs, one an SM
    with the ring's shared memory, stored 127 MiB at 1.7 TB/s where the tier's CTAs, after their
    K loops, reach ~2.9.  Nor does a many-rows kernel on a strided grid pay off (trial c5a605f,
    a2ec094, reverted): SMS CTAs, each striding over the tiles, the loader warpgroup staying for
    every tile and the ring's barriers counting on from tile to tile, so that an idle launch
    under a tier's count is one wave.  Idle it took 4.4 -> 1.5 us at 4096^3 and 13.6 -> 1.4 us at
    8192^3, but busy it ran slower (device time, ``_rows_op_kernels.py``, H100, 2026-11-24): with
    the tiles round robin 191.8 -> 208.6 us at 4096^3 with every row listed, 98.9 -> 111.3 at
    50 %, 8192^3 1602 -> 1706, 808.6 -> 857.7 and 209.8 -> 239.3 us at 90 % (there the CTAs
    left with a computed tile fewer idled while the others computed; with every row listed,
    where round robin is the launch order of a CTA per tile, it was 6-9 % slower too, not
    profiled); with those CTAs taking the store-only tiles first, 262.4, 143.6, 2172, 1087.5
    and 279.9 us (167 registers, not 155), and the op's total at 4096^3 (``gpu_matmul.py
    --patterns row``) 289 / 161 / 68 / 55 / 54 us at 0 / 50 / 90 / 95 / 99 %.

    The rows past a tier's tiles of listed rows are stored by a third warpgroup of each CTA
    (``store_unlisted`` in :func:`wgmma_row_gather_func`'s kernel): whole rows of C, the ids of 8
    at a time, once the CTA's K loop is done (a CTA without a tile: at once).  Before, the CTAs
    strode over C's tiles after their K loops, or the idle CTAs alone stored them where they
    could within about one K loop.  Device time of the tier that runs, before -> after (H100,
    2026-11-24, ``python3 benchmarks/_rows_op_kernels.py [--size 8192] SPARSITY``, the old code
    from ``git archive`` in the same run): 4096^3 at 90 / 95 / 99 % 50.1 / 38.8 / 36.7 -> 45.0 /
    38.3 / 36.3 us, 8192^3 at 99 % 101.3 -> 94.1 us.  Storing beside the K loop (the store
    warpgroup starting at once) measured 43.8 / 37.2 / 36.1 and 108.1 us: at 8192^3 that K loop
    streams B (128 MiB) from DRAM, and C's stores beside it slowed it more than they gained."""
    tiers: list[tuple[int, WgmmaConfig]] = []
    for block_n in (128, 64) if n % 128 == 0 else (64,):
        few = WgmmaConfig(block_n, FEW_ROWS_STAGES[block_n])
        few_rows = BLOCK_M * max(1, SMS // (n // block_n))
        above = tiers[-1] if tiers else None
        if block_n >= config.block_n or few.smem_bytes(out_dtype) > MAX_SMEM_BYTES:
            break           # (as wide as the many-rows tiles: no more CTAs for few rows)
        if above is not None and few_rows >= above[0]:
            continue        # (one strip's tiles fill a wave at both widths)
        if rows_hint is not None and rows_hint > (few_rows if above else 2 * few_rows):
            # (a deeper ring alone measured no gain in BERT's N=768 layers, 562 against 569 us,
            # for ~100 us of no-op launches; benchmarks/_without_few_rows_tier.py
            # benchmarks/_model_kernels.py bert --pit)
            break
        tiers.append((few_rows, few))
    return tiers


def wgmma_tiles_applies(k: int, n: int, micro_tile, in_dtype: str, out_dtype: str, arch: str) -> bool:
    """The tiles kernel takes micro-tiles ``(mr, mk)`` with ``mr`` dividing 128 (they are
    covered by 128-row strips, one K list per CTA) and ``mk`` dividing K, ``mk < K``."""
    mr, mk = (int(x) for x in micro_tile)
    return (wgmma_applies(k, n, in_dtype, out_dtype, arch) and 0 < mr <= BLOCK_M
            and BLOCK_M % mr == 0 and 0 < mk < k and k % mk == 0)


def needs_compaction(mk: int, in_dtype: str) -> bool:
    """Micro-tiles narrower than one 16-byte copy are gathered by :func:`wgmma_compact_a_func`
    first (a 2-byte gather inside the GEMM would be a load per element on its critical path)."""
    return mk * 2 % 16 != 0


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
    When :func:`needs_compaction`, ``a`` must be the output of :func:`wgmma_compact_a_func`
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
    func = _kernel(int(k), int(n), in_dtype, out_dtype, bool(bias), None, "tiles", config, mk=int(mk),
                   a_compact=needs_compaction(mk, in_dtype), residual=bool(residual))
    return lower_tirx(func, _TARGET)


def _tiles_epilogue(bias: bool, residual: bool) -> None:
    """The tiles kind's epilogues: none, a bias, or a bias then a residual (an FFN's second
    matmul and its skip connection); ValueError otherwise."""
    if residual and not bias:
        raise ValueError("residual comes with a bias (the kernel variants that take it)")


def index_is_full(offsets, m, tiles_per_strip: int):
    """Whether a ``(128, mk)`` tiles index (``tiles_per_strip = K / mk``) lists every micro-tile:
    the device-side dense fallback wrote it so, or the pattern is dense."""
    strips = (m + BLOCK_M - 1) // BLOCK_M
    return offsets[strips] == strips * tiles_per_strip


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
    func = _kernel(int(k), int(n), in_dtype, out_dtype, bool(bias), None, "dense", config, full_mk=int(mk),
                   residual=bool(residual))
    return lower_tirx(func, _TARGET)


@functools.lru_cache(maxsize=64)
def wgmma_compact_a_func(k: int, mk: int, in_dtype: str = "float16") -> tirx.PrimFunc:
    """SRead of A for thin micro-tiles, as a kernel of its own: ``Ac[128g + i, q] =
    A[128g + i, column(q)]`` for the strip's compact positions ``q < cnt_g * mk``, zeros up to
    the next multiple of 64 (the tiles kernel's K tile); columns past that are not written.
    Parameters ``(a, offsets, ids, ac)``, index as for :func:`wgmma_tiles_gather_func`."""
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

    return lower_tirx(kernel, _TARGET)


def _kernel(K, N, in_dtype, out_dtype, has_bias, act, mode, cfg, mk=0, a_compact=False,  # noqa: C901
            full_mk=0, row_scale=False, row_scale_masks=False, residual=False, rows_above=0, rows_upto=0,
            row_scale_a=False, strips_mk=0):
    """The kernel body for ``mode`` "rows" / "dense" (see the module docstring) or "tiles"
    (:func:`wgmma_tiles_gather_func`: strip ``bm``'s listed micro-tiles of width ``mk``).
    ``full_mk`` (dense): the kernel takes a tiles index of ``(128, full_mk)`` micro-tiles and
    runs only when it lists every one (:func:`wgmma_dense_fallback_func`).  Rows: ``rows_above``
    runs only when the index lists more rows than that, ``rows_upto`` only when it lists at
    most that many, on a persistent grid (:func:`wgmma_few_rows_tiers`).  ``strips_mk`` (dense):
    the epilogue also builds the strips index of C for ``(128, strips_mk)`` micro-tiles (see
    :func:`wgmma_row_gather_func`)."""
    BN, STAGES = cfg.block_n, cfg.stages
    BM, BK = BLOCK_M, cfg.block_k
    KT = K // BK
    A_ROW_CHUNKS = BK // 8                # 16-byte chunks per A row of a K tile (8 or 4)
    tiles = mode == "tiles"
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
    C_ROW = _c_row(BN, out_dtype)
    Z_OFF = BM * C_ROW                    # (out dtype elements) the zero row's value, after C
    C_VEC = 16 // dtype_bytes(out_dtype)  # elements per 16-byte store
    C_CHUNKS = BM * BN // C_VEC // THREADS
    C_ROW_CHUNKS = BN // C_VEC
    smem_elems = cfg.smem_bytes(out_dtype) // 2   # the ring, or the staged C tile after it
    # dense and rows, 64-deep K tiles, not the few-rows tier: the warp-specialized K loop (see
    # ``tma_loader``, ``ws_k_loop``), but where a residual would spill (:func:`residual_spills_ws`).
    # The tiles kernel with ``cfg.tiles_ws`` (micro-tiles a multiple of 64 wide, so that A's K
    # tile is one TMA box of A): see ``tiles_loader``.  It also runs the dense fallback itself.
    ws_tiles = tiles and cfg.tiles_ws
    if ws_tiles and (BK != BLOCK_K or not tiles_ws_applies(mk, BN, out_dtype, residual)):
        raise ValueError(f"the warp-specialized tiles kernel takes micro-tiles a multiple of {BLOCK_K} wide, "
                         f"block_n a multiple of 128 and no fp32 residual, got mk={mk}, {cfg}, {out_dtype}")
    ws = ((mode in ("dense", "rows") and BK == BLOCK_K and not persistent
           and not residual_spills_ws(residual, out_dtype)) or ws_tiles)
    LAUNCH_THREADS = THREADS + LOADER_THREADS if ws else (THREADS + STORER_THREADS if persistent else THREADS)
    RASTER = cfg.raster_m if mode == "dense" else 1
    # a ring slot's bytes that TMA loads: dense A and B; rows B (the loader warpgroup copies A's
    # listed rows); ws tiles A and B on a full index, else A (the loaders copy B's listed rows),
    # see ``tiles_loader``
    TX_BYTES = ((A_TILE if mode == "dense" or ws_tiles else 0) + B_TILE) * dtype_bytes(in_dtype)
    FULL_ARRIVALS = 1 + (LOADER_THREADS if mode == "rows" or ws_tiles else 0)
    A_LOADER_CHUNKS = BM * BK // 8 // LOADER_THREADS     # rows: A's 16-byte chunks a loader thread copies
    loader_b_copy = BCopyLayout(BN, BK, True, LOADER_THREADS)
    strips = strips_mk > 0
    # strips: the listing's scratch (int32 words) after the staged C tile: a flag per micro-tile
    # of the CTA's columns, the tile column of each output slot, each warp's listed count, and
    # (base, last) of the CTA's atomic add
    S_NMT = BN // strips_mk if strips else 0         # micro-tiles per CTA
    S_MKT = N // strips_mk if strips else 0          # micro-tiles per strip of C
    S_COMPACT = strips and needs_compaction(strips_mk, out_dtype)
    S_LISTED = (_c_stage_elems(BN, out_dtype) * dtype_bytes(out_dtype) + 3) // 4
    S_SRC = S_LISTED + S_NMT
    S_WARPS = S_SRC + BN
    S_INFO = S_WARPS + THREADS // 32
    # the listing's per-thread values (one int32 local array): whether its micro-tile is listed,
    # its rank in its warp and in the CTA, the CTA's listed count, the CTA's base in the strip,
    # whether the CTA completes the strip, an output slot's tile column
    MINE, WARP_RANK, RANK, LISTED, BASE, LAST, SLOT_COL = range(7)
    if strips:
        smem_elems = max(smem_elems, (S_INFO + 2) * 2)
        close_strip = strip_closer(strips_mk, S_COMPACT, out_dtype)
    t = _PTX_TYPE[in_dtype]
    wgmma = f"wgmma.mma_async.sync.aligned.m64n{BN}k16.f32.{t}.{t}"
    # descriptor offsets are in 16-byte units: A (K-major, 128B swizzle): 8-row groups 1024 B
    # apart (LBO unused); B (MN-major, 128B swizzle): 64-column atoms BK * 128 B apart (LBO),
    # 8-row groups 1024 B apart (SBO)
    A_LBO, A_SBO = 1, 8 * BK * 2 // 16
    A_SWIZZLE = _SWIZZLE_128B if BK == 64 else _SWIZZLE_64B
    B_LBO, B_SBO = BK * 128 // 16, 1024 // 16
    zero_out = tirx.const(0, out_dtype)

    def activation(v):
        if act == "relu":
            return T.max(v, T.float32(0))
        if act == "gelu":
            return gelu_erf(v)
        return v

    def epilogue(v, bias_buf, col, scale):
        """fp32 accumulator -> (A's row scale,) bias, activation, row scale (``scale``: the
        row's, fp32) -> output dtype"""
        if row_scale_a and scale is not None:   # (a zero row's product: zero, whatever its scale)
            v = v * scale
        if has_bias:
            v = v + T.Cast("float32", bias_buf[col])
        v = activation(v)
        return T.Cast(out_dtype, v * scale if row_scale else v)

    def plus_residual(v, res_regs, j, e):
        """the skip connection (chunk j's element e, loaded ahead), added in the output dtype
        (as the graph's own add)"""
        return v + res_regs[j * C_VEC + e] if residual else v

    # epilogue(0) is zero but for a bias (unless a masking row scale zeroes it) or a row scale
    # that is not the index's mask: the store warpgroup computes it only then (the SWrite's
    # branches take the same cases: a bias's value staged once, a row scale's per element)
    unlisted_nonzero = (has_bias and not row_scale) or (row_scale and not row_scale_masks)

    def unlisted(bias_buf, rs_buf, row, col):
        """the value of a row of A that the index does not list (a zero row): epilogue(0)"""
        return epilogue(T.float32(0), bias_buf, col, T.Cast("float32", rs_buf[row]) if row_scale else None)

    def row_of(ids_buf, p):
        return ids_buf[p] if mode == "rows" else p

    def row_id(ids_buf, p, m):
        """(int64) the row of A / C that compacted row p maps to, the last one past M (not stored)"""
        return T.Cast("int64", row_of(ids_buf, T.min(p, m - 1)))

    def a_chunk(t, copiers, j):
        """A's K-tile chunk that thread t of ``copiers`` copies j-th: (tile row, 16-byte chunk)"""
        return (t + copiers * j) // A_ROW_CHUNKS, (t + copiers * j) % A_ROW_CHUNKS

    def count_of(off_buf, m):
        return off_buf[1] if mode == "rows" else m

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
        return p < count if mode == "rows" else True

    def b_valid(off_buf, g, q):
        return q < n_valid(off_buf, g) if tiles else True

    def a_col_of(cols, j, q):
        return cols[j] if tiles else q

    def b_row_of(rows, j, q):
        return rows[j] if tiles else q

    b_kr = b_copy.row

    def a_swizzled(ch, r):
        """the 16-byte slot of chunk ch of A's tile row r: 128-byte swizzle (8 chunks a row)
        XORs with r % 8, the 64-byte one (4 chunks) with (r / 2) % 4"""
        if BK == 64:
            return T.bitwise_xor(ch, r % 8)
        return T.bitwise_xor(ch, (r // 2) % 4)

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
        part in the tile, so there named barrier 1 over them alone"""
        if persistent:
            return T.ptx["bar.sync"](T.uint32(1), T.uint32(THREADS))
        return T.cuda.cta_sync()

    def copy16(dst, src, valid):
        """16-byte cp.async (a call to wrap in ``T.evaluate``); zero-fills the destination where
        ``valid`` is false"""
        if mode != "dense":
            return T.ptx["cp.async.cg.shared.global"](dst, src, 16,
                                                      T.Cast("uint32", T.if_then_else(valid, 16, 0)))
        return T.ptx["cp.async.cg.shared.global"](dst, src, 16)

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
                a_valid(OFF, bm, kt * BK + ch * 8, bm * BM + r, count)))

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
                                 + T.bitwise_xor(gch % 8, kr % 8) * 8]),
                    B.ptr_to([b_row_of(b_row_id, i, kt * BK + kr), bn * BN + gch * 8]),
                    b_valid(OFF, bm, kt * BK + kr)))

    @T.macro
    def sread(kt, tid, bn, bm, count, OFF, A, B, smem, a_row, a_col, b_row_id):
        """SRead of K tile kt into ring slot kt % STAGES (cp.async, not yet committed)"""
        sread_a(kt, tid, THREADS, bm, count, OFF, A, smem, a_row, a_col)
        sread_b(kt, tid, b_copy, bn, bm, OFF, B, smem, b_row_id)

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
                    smem.view("int32")[S_LISTED + (tid % C_ROW_CHUNKS * C_VEC + 2 * e + h) // strips_mk] = 1  # (all write 1)
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
    def tma_loader(tid, bn, bm, m, count, OFF, IDS, A, smem, bars, map_a, map_b, a_row, a_col):
        """ws: the loader warpgroup's K loop.  Once the consumers released ring slot kt % STAGES
        (its ``empty`` mbarrier), its first thread loads B's BN / 64 atoms of 64 x 64 (dense:
        and A's 128 x 64 box) by TMA, their bytes counted on the slot's ``full`` mbarrier; TMA
        writes the 128-byte swizzle the wgmma descriptors read (it follows the shared-memory
        address) and zeros past M.  Rows: every loader thread copies 8 chunks of A's listed
        rows by cp.async (``sread_a``), arriving on ``full`` when they land.  The tiles kernel
        on a full index (see ``tiles_loader``) runs this loop as the dense kernel, each loader
        thread arriving on ``full`` at once (the slot's arrival count is the tiles loop's)."""
        lane = tid - THREADS
        if mode == "rows":
            for j in T.unroll(A_LOADER_CHUNKS):
                a_row[j] = row_id(IDS, bm * BM + a_chunk(lane, LOADER_THREADS, j)[0], m)
        for kt in T.serial(KT):
            s = kt % STAGES
            if kt >= STAGES:
                T.cuda.mbarrier_wait(bars.ptr_to([STAGES + s]), (kt // STAGES + 1) % 2)
            if lane == 0:
                T.ptx.mbarrier.arrive.expect_tx.shared.b64(bars.ptr_to([s]), T.uint32(TX_BYTES))
                if mode == "dense" or ws_tiles:
                    T.ptx[_TMA_LOAD_2D](smem.ptr_to([s * A_TILE]), T.address_of(map_a), kt * BK, bm * BM,
                                        bars.ptr_to([s]))
                for atom in T.unroll(BN // 64):
                    T.ptx[_TMA_LOAD_2D](smem.ptr_to([B_BASE + s * B_TILE + atom * BK * 64]),
                                        T.address_of(map_b), bn * BN + atom * 64, kt * BK, bars.ptr_to([s]))
            if mode == "rows":
                sread_a(kt, lane, LOADER_THREADS, bm, count, OFF, A, smem, a_row, a_col)
            if mode == "rows" or ws_tiles:
                T.ptx["cp.async.mbarrier.arrive.noinc.shared.b64"](bars.ptr_to([s]))

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
        8192^3 ~4 % slower than the dense fallback kernel on the H100.)"""
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
            if kt >= STAGES:
                T.cuda.mbarrier_wait(bars.ptr_to([STAGES + s]), (kt // STAGES + 1) % 2)
            if lane == 0:
                T.ptx.mbarrier.arrive.expect_tx.shared.b64(bars.ptr_to([s]),
                                                           T.uint32(A_TILE * dtype_bytes(in_dtype)))
                T.ptx[_TMA_LOAD_2D](smem.ptr_to([s * A_TILE]), T.address_of(map_a), a_col[0], bm * BM,
                                    bars.ptr_to([s]))
            sread_b(kt, lane, loader_b_copy, bn, bm, OFF, B, smem, b_row_id)
            T.ptx["cp.async.mbarrier.arrive.noinc.shared.b64"](bars.ptr_to([s]))

    @T.macro
    def ws_k_loop(tid, bm, OFF, smem, acc, desc_a, desc_b, bars):
        """ws: a consumer warpgroup's K loop: wait for slot q % STAGES to fill, issue its wgmma,
        and release the slot of K tile q - 1 once that one's wgmma retired"""
        for q in T.serial(k_tiles(OFF, bm)):
            slot = q % STAGES
            T.cuda.mbarrier_wait(bars.ptr_to([slot]), (q // STAGES) % 2)
            if mode != "dense":
                # (A's rows, the tiles kind's B rows, came by cp.async, the generic proxy; wgmma
                # reads through the async one)
                T.ptx["fence.proxy.async.shared::cta"]()
            wgmma_step(slot, acc, desc_a, desc_b)
            if q > 0:
                if tid % 128 == 0:
                    T.ptx.mbarrier.arrive.shared.b64(bars.ptr_to([STAGES + (q - 1) % STAGES]), T.uint32(1))

    @T.macro
    def tile(bn, bm, tid, m, A, B, OFF, IDS, BIAS, RS, RES, C, smem, acc, a_row, c_row, rs_val, res_v,
             a_col, b_row_id, a_col_next, b_row_next, desc_a, desc_b, ST, CNT, SIDS, AC, orw, ballot, sloc, old,
             bars, map_a, map_b):
        """the 128 x BN tile (bn, bm) of C: SRead, wgmma K loop, epilogue, SWrite"""
        count = count_of(OFF, m)
        p0 = bm * BM
        if runs(OFF, m, p0 < count):
            wg = tid // 128
            if ws:
                # full[s] waits for one arrival and the slot's TMA bytes (rows: and each loader
                # thread's cp.async), empty[s] for both consumer warpgroups
                if tid == 0:
                    for s in T.unroll(STAGES):
                        T.ptx.mbarrier.init.shared.b64(bars.ptr_to([s]), T.uint32(FULL_ARRIVALS))
                        T.ptx.mbarrier.init.shared.b64(bars.ptr_to([STAGES + s]), T.uint32(2))
                T.evaluate(consumer_sync())
                if tid >= THREADS:
                    if tiles:
                        if full_index(OFF, m):     # (the dense fallback: the dense kernel's loop)
                            tma_loader(tid, bn, bm, m, count, OFF, IDS, A, smem, bars, map_a, map_b, a_row, a_col)
                        else:
                            tiles_loader(tid, bn, bm, m, OFF, IDS, B, smem, bars, map_a, a_col, b_row_id, a_col_next,
                                         b_row_next)
                    else:
                        tma_loader(tid, bn, bm, m, count, OFF, IDS, A, smem, bars, map_a, map_b, a_row, a_col)
                    # (the rest of the kernel is the consumers': a CTA barrier waits for every
                    # thread that has not exited)
                    T.evaluate(_exit_thread())
            for i in T.unroll(ACC):
                acc[i] = T.float32(0)
            # the A rows this thread copies: row r = (tid + 256 j) / 8 of the tile, for every K tile
            if not ws:
                for j in T.unroll(A_CHUNKS):
                    a_row[j] = row_id(IDS, p0 + a_chunk(tid, THREADS, j)[0], m)
            # descriptors of ring slot 0 (this warpgroup's 64 A rows; B's first k16 rows): the
            # other slots and k16 steps add their 16-byte offsets to the start-address field
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_a[0]),
                                                  smem.ptr_to([wg * 64 * BK]), A_LBO, A_SBO,
                                                  A_SWIZZLE)
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b[0]), smem.ptr_to([B_BASE]),
                                                  B_LBO, B_SBO, _SWIZZLE_128B)
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
            for nb in T.unroll(BN // 8):
                for i in T.unroll(2):
                    # (no assignment in a vectorized loop: TIRx makes it a one-element local)
                    for e in T.vectorized(2):
                        smem.view(out_dtype)[(wg * 64 + w * 16 + lane // 4 + 8 * i) * C_ROW
                                             + nb * 8 + (lane % 4) * 2 + e] = epilogue(
                            acc[nb * 4 + i * 2 + e], BIAS, bn * BN + nb * 8 + (lane % 4) * 2 + e, rs_val[i])
            T.evaluate(consumer_sync())
        if ws:
            if tid >= THREADS:    # (a CTA that skips its tile: the loader leaves here)
                T.evaluate(_exit_thread())
        if persistent:
            if T.Not(outside_tier(OFF, m)):      # (the K loop is done: the store warpgroup may start)
                T.ptx["bar.arrive"](T.uint32(2), T.uint32(THREADS + STORER_THREADS))
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
        # its time (45 of 4096 rows: ~70 % of the stall samples on the H100)
        if runs(OFF, m, p0 < stored_below(OFF, m)):
            for j in T.unroll(C_CHUNKS):
                c_row[j] = row_id(IDS, p0 + (tid + THREADS * j) // C_ROW_CHUNKS, m)
            if residual:
                # every residual chunk loaded before the first store, for the same reason
                for j in T.unroll(C_CHUNKS):
                    for e in T.vectorized(C_VEC):
                        res_v[j * C_VEC + e] = RES[c_row[j], bn * BN + (tid + THREADS * j) % C_ROW_CHUNKS * C_VEC + e]
        for j in T.unroll(C_CHUNKS):
            r = (tid + THREADS * j) // C_ROW_CHUNKS
            ch = (tid + THREADS * j) % C_ROW_CHUNKS
            if runs(OFF, m, T.And(p0 < stored_below(OFF, m), p0 + r < m) if persistent else p0 + r < m):
                if p0 + r < count:
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

    ROW_CHUNKS = N // C_VEC                                  # 16-byte chunks of a row of C
    STORE_CHUNKS = (ROW_CHUNKS + STORER_THREADS - 1) // STORER_THREADS   # of a row, per store thread

    @T.macro
    def store_unlisted(cta, lane, m, OFF, IDS, BIAS, RS, RES, C, z_id, z_val, z_res):
        """a few-rows tier's store warpgroup (``lane`` = tid - THREADS): C's rows past the listed
        rows' tiles, p >= P = 128 ceil(count / 128), all unlisted: ``C[ids[p]] = epilogue(0)``
        (+ the residual), once the CTA's K loop is done.  CTA c takes p = P + c + SMS i, a row at
        a time, 16-byte chunks lane + 128 h of it; the ids of STORE_BATCH rows at a time."""
        pz = (count_of(OFF, m) + BM - 1) // BM * BM
        mine = (T.max(m - pz - cta, 0) + SMS - 1) // SMS       # this CTA's rows
        if mine > 0:           # (no ids to read where C has no rows here, M = 0 included)
            for j in T.unroll(STORE_BATCH):
                z_id[STORE_BATCH + j] = IDS[T.min(pz + cta + SMS * j, m - 1)]
        for b in T.serial((mine + STORE_BATCH - 1) // STORE_BATCH):
            for j in T.unroll(STORE_BATCH):
                z_id[j] = z_id[STORE_BATCH + j]
                z_id[STORE_BATCH + j] = IDS[T.min(pz + cta + SMS * (STORE_BATCH * (b + 1) + j), m - 1)]
            for j in T.unroll(STORE_BATCH):
                if STORE_BATCH * b + j < mine:
                    if residual:       # (the row's chunks loaded before its first store)
                        for h in T.unroll(STORE_CHUNKS):
                            if lane + STORER_THREADS * h < ROW_CHUNKS:
                                for e in T.vectorized(C_VEC):
                                    z_res[h * C_VEC + e] = RES[T.Cast("int64", z_id[j]),
                                                               (lane + STORER_THREADS * h) * C_VEC + e]
                    for h in T.unroll(STORE_CHUNKS):
                        if lane + STORER_THREADS * h < ROW_CHUNKS:
                            if unlisted_nonzero:
                                for e in T.unroll(C_VEC):
                                    z_val[e] = plus_residual(unlisted(
                                        BIAS, RS, T.Cast("int64", z_id[j]),
                                        (lane + STORER_THREADS * h) * C_VEC + e), z_res, h, e)
                                for e in T.vectorized(C_VEC):
                                    C[T.Cast("int64", z_id[j]), (lane + STORER_THREADS * h) * C_VEC + e] = z_val[e]
                            else:      # no bias, or a row scale that is zero wherever the index skips a row
                                for e in T.vectorized(C_VEC):
                                    C[T.Cast("int64", z_id[j]), (lane + STORER_THREADS * h) * C_VEC + e] = zero_out

    @T.macro
    def device_body(M, A, B, OFF, IDS, BIAS, RS, RES, C, ST, CNT, SIDS, AC, map_a, map_b):
        T.device_entry()
        if persistent:
            cta = T.cta_id([SMS])
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
        res_v = T.alloc_local([C_CHUNKS * C_VEC if residual else 1], out_dtype)   # residual chunks
        # tiles: this K tile's A columns and B rows (ws: a loader thread's), and the next K tile's
        a_col = T.alloc_local([A_CHUNKS], "int32")
        b_row_id = T.alloc_local([lb_rows if ws_tiles else B_ROWS], "int32")
        a_col_next = T.alloc_local([A_CHUNKS], "int32")
        b_row_next = T.alloc_local([B_ROWS], "int32")
        desc_a = T.alloc_local([1], "uint64")
        desc_b = T.alloc_local([1], "uint64")
        orw = T.alloc_local([4], "uint32")                  # strips: this thread's chunks of C, OR-ed
        ballot = T.alloc_local([1], "uint32")
        sloc = T.alloc_local([7], "int32")                  # strips: MINE ... SLOT_COL
        old = T.alloc_local([1], STATE_DTYPE)               # strips: the atomic add's old state
        bars = T.alloc_buffer([2 * STAGES if ws else 1], "uint64", scope="shared", align=8)  # ws: full, empty
        # few-rows tier, the store warpgroup: two batches of row ids, a chunk's values, a row's residual
        z_id = T.alloc_local([2 * STORE_BATCH if persistent else 1], "int32")
        z_val = T.alloc_local([C_VEC], out_dtype)
        z_res = T.alloc_local([STORE_CHUNKS * C_VEC if persistent and residual else 1], out_dtype)
        m = T.Cast("int32", M)
        if persistent:
            # few rows on SMS CTAs: CTA c computes and stores tile c where the listed rows' tiles
            # (at most SMS within the tier) include it; every CTA's store warpgroup stores a
            # share of the rows past them once the CTA's K loop is done (barrier 2: the
            # consumers arrive, it waits).  Nothing when another tier runs.  (No branch or loop
            # around the tile: the sync pass cannot place its barriers inside a branch, and in a
            # loop it puts one at the top, which would wait for the store warpgroup; the tile's
            # own conditions, ``runs``, hold it.  The one it puts before the SWrite waits for the
            # store warpgroup to exit.)
            if tid >= THREADS:
                if T.Not(outside_tier(OFF, m)):
                    # (after the CTA's K loop: stores beside it slowed a K loop that streams B
                    # from DRAM, see wgmma_few_rows_tiers)
                    T.ptx["bar.sync"](T.uint32(2), T.uint32(THREADS + STORER_THREADS))
                    store_unlisted(cta, tid - THREADS, m, OFF, IDS, BIAS, RS, RES, C, z_id, z_val, z_res)
                T.evaluate(_exit_thread())
            tile(cta % (N // BN), cta // (N // BN),
                 tid, m, A, B, OFF, IDS, BIAS, RS, RES, C, smem, acc, a_row, c_row, rs_val, res_v, a_col,
                 b_row_id, a_col_next, b_row_next, desc_a, desc_b, ST, CNT, SIDS, AC, orw, ballot, sloc, old,
                 bars, map_a, map_b)
        else:
            tile(bn, bm, tid, m, A, B, OFF, IDS, BIAS, RS, RES, C, smem, acc, a_row, c_row, rs_val, res_v,
                 a_col, b_row_id, a_col_next, b_row_next, desc_a, desc_b, ST, CNT, SIDS, AC, orw, ballot, sloc, old,
                 bars, map_a, map_b)

    @T.macro
    def encode_tma_map(tmap, data, cols, rows, box_cols, box_rows):
        """(host) the TMA descriptor of a row-major [rows, cols] operand of the input dtype, boxes
        of box_rows x box_cols, 128-byte swizzle"""
        T.tensormap_encode_tiled(tmap, data, cols, rows, cols * dtype_bytes(in_dtype), box_cols, box_rows, 1, 1,
                                 descriptor_dtype=in_dtype, rank=2, interleave=0, swizzle=_TMA_SWIZZLE_128B,
                                 l2_promotion=_TMA_L2_PROMOTION_128B, oob_fill=0, force_cu_dtype=-1)

    @T.macro
    def body_ws(M, A, B, OFF, IDS, BIAS, RS, RES, C, ST, CNT, SIDS, AC):
        # (host) the TMA descriptors of B (64 x 64 atoms) and, dense, A (128 x 64 boxes), with
        # the 128-byte swizzle
        map_b: T.let[T.TensorMap()] = T.tvm_stack_alloca("tensormap", 1)
        encode_tma_map(map_b, B.data, N, K, 64, BK)
        if mode == "dense" or ws_tiles:
            map_a: T.let[T.TensorMap()] = T.tvm_stack_alloca("tensormap", 1)
            encode_tma_map(map_a, A.data, K, M, BK, BM)
            device_body(M, A, B, OFF, IDS, BIAS, RS, RES, C, ST, CNT, SIDS, AC, map_a, map_b)
        else:
            device_body(M, A, B, OFF, IDS, BIAS, RS, RES, C, ST, CNT, SIDS, AC, None, map_b)

    @T.macro
    def body(M, A, B, OFF, IDS, BIAS, RS, RES, C, ST, CNT, SIDS, AC):
        device_body(M, A, B, OFF, IDS, BIAS, RS, RES, C, ST, CNT, SIDS, AC, None, None)

    return _signature(K, N, in_dtype, out_dtype, has_bias, mode, body_ws if ws else body, MKT, full_mk, row_scale or row_scale_a,
                      residual, S_MKT, S_COMPACT)


def _signature(K, N, in_dtype, out_dtype, has_bias, mode, body, mkt=0, full_mk=0, row_scale=False,
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
             T.match_buffer(ac, (M, N), out_dtype))

    names = ("a", "b", "offsets", "ids", "bias", "row_scale", "residual", "state", "c", "counts", "strip_ids", "ac")
    params = [p for name, p in zip(names, kernel.params) if takes.get(name, True)]
    return tirx.PrimFunc(params, kernel.body, kernel.ret_type, kernel.attrs)
