"""Launch order of the dense wgmma kernel's CTAs (``WgmmaConfig.raster_m``: M tiles per
launch-order group; 1 = row-major), device time per call with L2 flushed (torch.profiler) and
the error against float32, at 8192^3 (B does not fit L2) and 4096^3.  (The rows kernels ignore
``raster_m``; their grouped figures in ``pit_tvm/schedules/wgmma.py``'s docstring were measured
with this probe at ad36474.)

    python3 benchmarks/sweeps/raster_probe.py [--4096]
"""
import argparse
import sys

import torch
import tvm

sys.path.insert(0, "benchmarks")
from common import kernel_split_us  # noqa: E402
from pit_tvm.schedules.wgmma import WgmmaConfig, wgmma_row_gather_func  # noqa: E402
from pit_tvm.target import build  # noqa: E402

T = tvm.runtime.from_dlpack
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--4096", dest="small", action="store_true", help="4096^3 instead of 8192^3")
size = 4096 if parser.parse_args().small else 8192
m = k = n = size
flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
a = torch.randn(m, k, device="cuda", dtype=torch.float16)
b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
c = torch.empty(m, n, device="cuda", dtype=torch.float16)
ref = a.float() @ b.float()


def device_us(fn):
    split = kernel_split_us(lambda: (flush.zero_(), fn()), iters=10)
    return sum(v for key, v in split.items() if "elementwise" not in key and "fill" not in key.lower())


print(f"{size}^3: cuBLAS {device_us(lambda: torch.matmul(a, b)):7.1f} us", flush=True)
line = "  dense:"
for raster in (1, 8, 16):
    cfg = WgmmaConfig(256, 4, raster_m=raster)
    f = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, dense=True, config=cfg)}), "cuda:sm_90a")["main"]
    f(T(a), T(b), T(c))
    torch.cuda.synchronize()
    err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
    line += f"  raster {raster} {device_us(lambda: f(T(a), T(b), T(c))):7.1f}" + ("" if err < 1e-2 else " WRONG")
print(line, flush=True)
