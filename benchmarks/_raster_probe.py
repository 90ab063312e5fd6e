"""Launch order of the dense / rows wgmma kernels' CTAs (``WgmmaConfig.raster_m``: M tiles per
launch-order group; 1 = row-major), device time per call with L2 flushed (torch.profiler) and
the error against float32, at 8192^3 (B does not fit L2) and 4096^3.  Since 3498333 only the
dense kernel (the last count of each size) takes ``raster_m``; the rows kernels' figures in
``pit_tvm/schedules/wgmma.py``'s docstring were measured at ad36474.

    python3 benchmarks/_raster_probe.py [--4096]
"""
import sys

import numpy as np
import torch
import tvm

sys.path.insert(0, "tests")
sys.path.insert(0, "benchmarks")
from _helpers import rows_index  # noqa: E402
from common import kernel_split_us  # noqa: E402
from pit_tvm.schedules.wgmma import WgmmaConfig, wgmma_row_gather_func  # noqa: E402
from pit_tvm.target import build  # noqa: E402

T = tvm.runtime.from_dlpack
dev = tvm.cuda(0)
size = 4096 if "--4096" in sys.argv else 8192
m = k = n = size
counts = (819, 2048, 4096, 8192) if size == 8192 else (2048, 4096)
flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
a = torch.randn(m, k, device="cuda", dtype=torch.float16)
b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
c = torch.empty(m, n, device="cuda", dtype=torch.float16)
ref = a.float() @ b.float()


def device_us(fn):
    split = kernel_split_us(lambda: (flush.zero_(), fn()), iters=10)
    return sum(v for key, v in split.items() if "elementwise" not in key and "fill" not in key.lower())


print(f"{size}^3: cuBLAS {device_us(lambda: torch.matmul(a, b)):7.1f} us", flush=True)
for cnt in counts:
    line = f"  rows {cnt:5d}:"
    for raster in (1, 8, 16):
        cfg = WgmmaConfig(256, 4, raster_m=raster)
        dense = cnt == m
        f = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, dense=dense, config=cfg)}), "cuda:sm_90a")["main"]
        nz = np.zeros(m, bool)
        nz[np.random.default_rng(0).choice(m, cnt, replace=False)] = True
        args = [T(a), T(b)] + ([] if dense else [tvm.runtime.tensor(x, dev) for x in rows_index(nz)])
        c.fill_(7)
        f(*args, T(c))
        torch.cuda.synchronize()
        s = torch.from_numpy(nz).cuda()
        err = ((c.float()[s] - ref[s]).abs().max() / ref.abs().max()).item()
        if not dense:
            err += c.float()[~s].abs().max().item()
        line += f"  raster {raster} {device_us(lambda: f(*args, T(c))):7.1f}" + ("" if err < 1e-2 else " WRONG")
    print(line, flush=True)
