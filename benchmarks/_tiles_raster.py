"""The wgmma tiles kernel at the OPT FFN's fc2 (the pattern of ``_tiles_widths.py``: M 4096,
K 8192, N 2048, 32x1 micro-tiles, ~22 % strip coverage) with its CTAs launched strip-major
(``TILES_STRIPS_FASTEST``: the CTAs running together share B's N tiles) and N-tile-major (they
share A's strips); device time per kernel of one op call, L2 flushed, interleaved runs.

    python3 benchmarks/_tiles_raster.py
"""
import sys

import numpy as np
import torch
import tvm

import pit_tvm.schedules.wgmma as wg
from pit_tvm.ops.matmul import SparseMatmul

sys.path.insert(0, "benchmarks")
from common import kernel_split_us  # noqa: E402

m, k, n = 4096, 8192, 2048
rng = np.random.default_rng(0)
rate = np.full(k, 0.0011)
rate[rng.permutation(k)[: k // 10]] = 0.99
on = torch.rand(m, k, device="cuda") < torch.from_numpy(rate).float().cuda()
a = (torch.rand(m, k, device="cuda", dtype=torch.float16) + 0.1) * on
b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
ref = a.float() @ b.float()
flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
at, bt = tvm.runtime.from_dlpack(a), tvm.runtime.from_dlpack(b)
ops = {}
for strips_fastest in (True, False):
    wg.TILES_STRIPS_FASTEST = strips_fastest
    wg.wgmma_tiles_gather_func.cache_clear()
    ops["strip-major" if strips_fastest else "N-tile-major"] = SparseMatmul(k, n, "float16", (32, 1), "cuda")
times = {name: [] for name in ops}
for _ in range(5):
    for name, op in ops.items():
        c = torch.from_dlpack(op(at, bt))
        assert ((c.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
        split = kernel_split_us(lambda: (flush.zero_(), op(at, bt)))
        times[name].append(next(us for kname, us in split.items() if kname.startswith("pit_kernel")))
for name, ts in times.items():
    print(f"{name:13s} tiles kernel median {np.median(ts):.1f} us  ({' '.join(f'{t:.1f}' for t in ts)})")
