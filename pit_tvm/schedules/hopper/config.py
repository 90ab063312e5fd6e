"""Tile constants and configs of the Hopper wgmma GEMMs: the CTA's shape (two consumer
warpgroups of wgmma m64, plus a loader or store warpgroup), :class:`WgmmaConfig` (the tuning
knobs) and :class:`BCopyLayout` (which thread copies which chunk of B).

A CTA computes a 128 x ``block_n`` tile of C with 64-deep (or 32-deep) K tiles in a
``stages``-deep shared-memory ring; the staged C tile of the epilogue reuses the ring's memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm

from pit_tvm.schedules.limits import dtype_bytes, max_smem_bytes

#: the only arch with wgmma (the ``a`` suffix: arch-specific features, H100 / H200)
WGMMA_ARCH = "sm_90a"
BLOCK_M = 128          # 2 warpgroups x wgmma M=64
BLOCK_K = 64           # one 128-byte swizzle atom of fp16/bf16 along K
THREADS = 256          # the two consumer warpgroups
CONSUMER_WARPGROUPS = THREADS // 128
#: dynamic shared memory per block of the target arch
MAX_SMEM_BYTES = max_smem_bytes(WGMMA_ARCH)
#: the target the Hopper kernels are lowered for
TARGET = tvm.target.Target({"kind": "cuda", "arch": WGMMA_ARCH})
#: the warpgroup after the two consumer warpgroups that loads the ring of a warp-specialized kernel
#: (ptxas allocates registers for 12 warps even with 9, so a whole warpgroup costs nothing more)
LOADER_THREADS = 128
#: registers a thread after ``setmaxnreg`` in a loader + 2 consumer warpgroups kernel launched one CTA
#: an SM: the loader hands its registers to the consumers (128 x 40 + 256 x 232 = 64512 of the SM's
#: 65536); ptxas otherwise allocates 65536 / 384 = 168 to every thread
LOADER_REGISTERS = 40
CONSUMER_REGISTERS = 232
#: the same where the loader also copies by cp.async (the attention's mask tiles, the glu GEMM's A rows:
#: their offsets' arithmetic spills in 40)
STAGING_LOADER_REGISTERS = 72
STAGING_CONSUMER_REGISTERS = 216
#: the warpgroup after the consumers of a few-rows tier that stores C's rows past its listed rows'
#: tiles once the CTA's K loop is done
STORER_THREADS = 128
#: unlisted rows a store thread loads the ids of at a time, the next batch's before this batch's
#: stores (nvcc does not move a load above a store to C, which may alias it, so ids loaded just
#: before their use would cost a load latency per row)
STORE_BATCH = 8

#: the attr of a dense wgmma kernel: the arguments of ``wgmma_row_gather_func`` that made it
DENSE_ATTR = "pit.wgmma_dense"
#: the attr of a rows wgmma kernel: its :class:`WgmmaConfig`'s tile width, ring depth and K tile
ROWS_ATTR = "pit.wgmma_rows"
#: M tiles per launch-order group of the dense kernels (``WgmmaConfig.raster_m``; grouped so that
#: a wave of CTAs shares B's columns in L2, docs/design/hopper_kernels.md)
RASTER_M = 16


@dataclass(frozen=True)
class WgmmaConfig:
    """Tile knobs: ``block_n`` (wgmma N, 64..256, multiple of 64), ``stages`` (shared-memory
    ring depth, >= 3: ``stages - 2`` K tiles load while one computes and the previous one's
    wgmma may still run) and ``block_k`` (K tile depth: 64, or 32 for rows / dense; a K tile's
    time is mostly fixed cost per loop step, so 64 is the default)."""

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
        return max(ring, c_stage_elems(self.block_n, out_dtype) * dtype_bytes(out_dtype))


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



def c_row_pitch(block_n: int, out_dtype: str) -> int:
    """Row pitch of the staged C tile in elements: 16 bytes of padding spreads the 8 rows one
    warp's fragments hit over all banks."""
    return block_n + 16 // dtype_bytes(out_dtype)


def c_stage_elems(block_n: int, out_dtype: str) -> int:
    """the staged C tile, then one row of the value of a zero row (``epilogue(0)``)"""
    return BLOCK_M * c_row_pitch(block_n, out_dtype) + block_n
