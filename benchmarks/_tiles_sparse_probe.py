"""The wgmma tiles kernel by tile config at high sparsity (4096^3 fp16, the benchmark's random
32x1 and 32x64 patterns, 128-row strips): device time per kernel of one op call, L2 flushed.
At 99 % a strip lists a few K tiles, so a CTA's fixed cost (prologue, epilogue, C's stores)
and the waves of one-CTA-an-SM grids, not the K loop, set the time.

    python3 benchmarks/_tiles_sparse_probe.py [BNxSTAGES ...]     (default 256x4 128x4 128x3 64x4 64x3)

H100, 2026-11-24 (at 6f702d8), device time in us: the strips index, the CSR pack, the tiles
kernel per config (256x4 / 128x4 / 128x3 / 64x4 / 64x3; 128x3 and 64x3 fit two and three CTAs
an SM, 124 and 74 registers), the idle dense fallback:

    32x64, 95 %: strips 17.1, pack 2.4, kernel 65.7 / 85.5 / 75.8 / 85.1 / 89.6, fallback 3.9-5.2
    32x64, 99 %: strips 17.3, pack 2.4, kernel 27.0 / 33.7 / 27.9 / 31.3 / 30.0, fallback 3.8-5.1
    32x1,  95 %: strips 23.4, pack 2.4, kernel 62.9 / 81.3 / 74.0 / 80.5 / 93.3, fallback 3.9-5.3
    32x1,  99 %: strips 22.7, pack 2.4, kernel 31.2 / 38.1 / 30.9 / 35.9 / 35.7, fallback 3.8-5.1

No config beats the default 256x4, so more CTAs an SM do not hide the per-CTA latency.  At 99 %
the kernels sum to ~50 us (32x64) against ~60 us of the op's wall time in
``benchmarks/gpu_matmul.py``: the four launches' gaps and the idle fallback (which only reads
whether the index is full, over four waves of one-CTA-an-SM grids) cost ~13 us.
"""
import sys

import numpy as np
import torch
import tvm

import pit_tvm.schedules.wgmma as wg
from pit_tvm.ops.matmul import SparseMatmul

sys.path.insert(0, "benchmarks")
from common import kernel_split_us  # noqa: E402
from gpu_matmul import expand, tile_pattern  # noqa: E402

m = k = n = 4096
flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
base = wg.wgmma_config
for mt in ((32, 64), (32, 1)):
    for s in (0.95, 0.99):
        on = torch.from_numpy(expand(tile_pattern(m, k, mt, s, np.random.default_rng(0)), mt, (m, k))).cuda()
        a = torch.randn(m, k, device="cuda", dtype=torch.float16) * on
        ref = a.float() @ b.float()
        at, bt = tvm.runtime.from_dlpack(a), tvm.runtime.from_dlpack(b)
        print(f"{mt[0]}x{mt[1]} at {s}: cuBLAS {sum(kernel_split_us(lambda: (flush.zero_(), a @ b)).values()):.1f} us "
              f"(with the flush)", flush=True)
        for spec in sys.argv[1:] or ["256x4", "128x4", "128x3", "64x4", "64x3"]:
            cfg = wg.WgmmaConfig(*(int(x) for x in spec.split("x")))
            wg.wgmma_config = lambda *args, _c=cfg, **kw: _c
            try:
                op = SparseMatmul(k, n, "float16", mt, "cuda")
            finally:
                wg.wgmma_config = base
            c = torch.from_dlpack(op(at, bt))
            err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
            split = kernel_split_us(lambda: (flush.zero_(), op(at, bt)))
            print(" ", spec, f"err {err:.1e}", "  ".join(f"{name.split('_k4096')[0][:40]} {us:.1f}"
                                                     for name, us in split.items() if name.startswith("pit_")),
                  flush=True)
