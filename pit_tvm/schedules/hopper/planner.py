"""Which Hopper GEMM takes a shape, and with which tiles: the applicability checks, the
tile-width cost model (whole waves of :data:`SMS` CTAs, weighted by :data:`TILE_SPEED`) and the
rows kernel's few-rows tiers.  The measurements behind the numbers here are in
docs/design/hopper_kernels.md ("Measurement history of the wgmma GEMM").
"""
from __future__ import annotations

from dataclasses import replace

from pit_tvm.schedules.hopper.config import BLOCK_K, BLOCK_M, MAX_SMEM_BYTES, WGMMA_ARCH, WgmmaConfig
from pit_tvm.schedules.limits import IN_DTYPES, OUT_DTYPES, dtype_bytes, sm_count


def wgmma_applies(k: int, n: int, in_dtype: str, out_dtype: str, arch: str) -> bool:
    return (arch == WGMMA_ARCH and in_dtype in IN_DTYPES and out_dtype in OUT_DTYPES
            and k % BLOCK_K == 0 and wgmma_config(n) is not None)


#: relative speed of one CTA's work per output element for each wgmma N (narrower tiles move
#: more B per FLOP; 128 measured, 192 and 64 interpolated: docs/design/measurements.md#wgmma-planner)
TILE_SPEED = {256: 1.0, 192: 0.92, 128: 0.82, 64: 0.6}
#: SMs of the target: CTAs past a multiple of it start a new wave
SMS = sm_count(WGMMA_ARCH)
#: deepest ring: on the H100 4 stages beat 6 at every N
MAX_STAGES = 4
#: the few-rows tiers' ring depth by tile width (one wave of CTAs, each bound by load latency:
#: deeper than :data:`MAX_STAGES`; deeper still measured the same)
FEW_ROWS_STAGES = {128: 6, 64: 8}


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
        # one wave of CTAs, each alone on its SM for its whole K loop: the few-rows tier's
        # deeper ring
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
    same kernel, no launch of its own) where :func:`tiles_ws_applies` (thin micro-tiles measured
    slower that way)."""
    config = wgmma_config(n, rows)
    if config is None:
        return None
    return replace(config, tiles_ws=tiles_ws_applies(mk, config.block_n, out_dtype, residual))


def wgmma_few_rows_tiers(n: int, config: WgmmaConfig, out_dtype: str = "float16",
                         rows_hint=None) -> list[tuple[int, WgmmaConfig]]:
    """The rows kernel's persistent tiers below ``config``'s many-rows kernel, widest first:
    ``[(F_0, config_0), (F_1, config_1)]`` with F descending; tier i runs when the index lists
    at most F_i rows and more than F_(i+1) (the last tier: from none), the many-rows kernel
    above F_0.  Few rows leave most SMs idle at the many-rows tile width, and each CTA's K loop
    is bound by load latency: a tier takes 128- or 64-column tiles with a deeper ring, F = the
    rows whose tiles fill one wave of :data:`SMS` CTAs (narrower tiles win while they fit one
    wave).  A tier is left out where it is no narrower than the one above it or would take no
    rows of its own.  Every call pays each idle kernel's no-op launch, so the widest tier is
    left out where the expected rows (``rows_hint``) are over 2F, a narrower one where they are
    over its F.  A tier keeps the all-threads K loop; a third warpgroup of each CTA stores the
    rows past its listed rows' tiles once the CTA's K loop is done."""
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
            # (the expected rows are the many-rows kernel's: a tier would only add its no-op
            # launch, which cost more than its deeper ring gained in BERT's layers)
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
    """Micro-tiles narrower than one 16-byte copy are gathered by
    :func:`.compact_a.wgmma_compact_a_func` first (a 2-byte gather inside the GEMM would be a
    load per element on its critical path)."""
    return mk * 2 % 16 != 0

