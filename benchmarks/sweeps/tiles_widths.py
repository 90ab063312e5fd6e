"""The wgmma tiles kernel by tile config: device time per kernel of one op call, L2 flushed.

    python3 benchmarks/sweeps/tiles_widths.py [BNxSTAGES[ws] ...]        (default 256x4 256x3 128x4 128x6;
                                                                   ws: the warp-specialized loop)
    python3 benchmarks/sweeps/tiles_widths.py --random [BNxSTAGES[ws] ...]  (default 256x4 128x4 128x3 64x4 64x3)

Default: the OPT FFN's fc2 (M 4096, K 8192, N 2048, fp16, 32x1 micro-tiles covered by 128-row
strips) on an activation pattern like the FFN's: 10 % of the columns of ``hidden`` non-zero for
99 % of the tokens, the rest for ~0.1 % (strip coverage ~22 %).

``--random``: 4096^3 with ``benchmarks/gpu_matmul.py``'s random 32x64 and 32x1 patterns at 95 and
99 %, where a strip lists a few K tiles, so a CTA's fixed cost (prologue, epilogue, C's stores)
and the waves of one-CTA-an-SM grids, not the K loop, set the time.  H100, 2026-11-24 (at
6f702d8), in us: the strips index, the CSR pack, the tiles kernel per config (256x4 / 128x4 /
128x3 / 64x4 / 64x3; 128x3 and 64x3 fit two and three CTAs an SM, 124 and 74 registers), the
idle dense fallback:

    32x64, 95 %: strips 17.1, pack 2.4, kernel 65.7 / 85.5 / 75.8 / 85.1 / 89.6, fallback 3.9-5.2
    32x64, 99 %: strips 17.3, pack 2.4, kernel 27.0 / 33.7 / 27.9 / 31.3 / 30.0, fallback 3.8-5.1
    32x1,  95 %: strips 23.4, pack 2.4, kernel 62.9 / 81.3 / 74.0 / 80.5 / 93.3, fallback 3.9-5.3
    32x1,  99 %: strips 22.7, pack 2.4, kernel 31.2 / 38.1 / 30.9 / 35.9 / 35.7, fallback 3.8-5.1

No config beats the default 256x4, so more CTAs an SM do not hide the per-CTA latency.  At 99 %
the kernels sum to ~50 us (32x64) against ~60 us of the op's wall time in
``benchmarks/gpu_matmul.py``: the four launches' gaps and the idle fallback (which only reads
whether the index is full, over four waves of one-CTA-an-SM grids) cost ~13 us.

The warp-specialized loop (``256x4ws``, now the default for 32x64; it runs a full index itself,
so the op has no fallback kernel) at ad42057 against 256x4 in one run: 32x64 at 95 % kernel 61.8
against 65.8 + fallback 3.9 us, at 99 % 27.3 against 27.1 + 3.9.
"""
import argparse
import sys

import numpy as np
import torch
import tvm

import pit_tvm.schedules.wgmma as wg
from pit_tvm.ops.matmul import SparseMatmul

sys.path.insert(0, "benchmarks")
from common import ffn_fc2_operands, kernel_split_us  # noqa: E402
from pit_tvm.testing import expand, tile_pattern  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("configs", nargs="*", help="BNxSTAGES[ws] tile configs")
parser.add_argument("--random", action="store_true", help="random micro-tile patterns")
ARGS = parser.parse_args()
RANDOM = ARGS.random
specs = ARGS.configs or (
    ["256x4", "128x4", "128x3", "64x4", "64x3"] if RANDOM else ["256x4", "256x3", "128x4", "128x6"])
flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")


def cases():
    """(name, a, b, micro-tile) of each pattern measured"""
    if not RANDOM:
        a, b, on = ffn_fc2_operands(4096, 8192, 2048)
        strips = on.view(-1, 128, on.shape[1]).any(1).float().mean().item()
        yield f"FFN fc2, strip coverage {strips:.3f}, element density {on.float().mean().item():.3f}", a, b, (32, 1)
        return
    m = k = n = 4096
    b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
    for mt in ((32, 64), (32, 1)):
        for s in (0.95, 0.99):
            on = torch.from_numpy(expand(tile_pattern(m, k, mt, s, np.random.default_rng(0)), mt, (m, k))).cuda()
            yield f"{mt[0]}x{mt[1]} at {s}", torch.randn(m, k, device="cuda", dtype=torch.float16) * on, b, mt


base = wg.wgmma_tiles_config
for name, a, b, mt in cases():
    ref = a.float() @ b.float()
    at, bt = tvm.runtime.from_dlpack(a), tvm.runtime.from_dlpack(b)
    print(name, flush=True)
    for spec in specs:
        ws = spec.endswith("ws")      # "256x4ws": the warp-specialized tiles loop
        cfg = wg.WgmmaConfig(*(int(x) for x in spec.removesuffix("ws").split("x")), tiles_ws=ws)
        if ws and not wg.tiles_ws_applies(mt[1], cfg.block_n, "float16", False):
            print(" ", spec, "n/a (wg.tiles_ws_applies)")
            continue
        wg.wgmma_tiles_config = lambda *args, _c=cfg, **kw: _c
        try:
            op = SparseMatmul(a.shape[1], b.shape[1], "float16", mt, "cuda")
        finally:
            wg.wgmma_tiles_config = base
        c = torch.from_dlpack(op(at, bt))
        err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
        split = kernel_split_us(lambda: (flush.zero_(), op(at, bt)))
        print(" ", spec, f"err {err:.1e}", "  ".join(f"{kname.split(f'_k{a.shape[1]}')[0][:40]} {us:.1f}" for kname, us in split.items()
                                                 if kname.startswith("pit_")), flush=True)
