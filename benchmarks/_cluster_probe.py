"""Dense and rows wgmma kernels with and without 2-CTA clusters sharing B's K tiles by TMA
multicast (``WgmmaConfig.cluster_m``): device time per call (torch.profiler, L2 warm) and the
error against float32, for 4096^3 and BERT-base's layer shapes.

    python3 benchmarks/_cluster_probe.py [--8192] [BNxSTAGES ...]   (default: each shape's wgmma_config)

``--8192``: 8192^3 alone (B does not fit in L2), 82-8192 listed rows.
"""
import sys

import numpy as np
import torch
import tvm

sys.path.insert(0, "tests")
sys.path.insert(0, "benchmarks")
from _helpers import rows_index  # noqa: E402
from common import kernel_split_us  # noqa: E402
from pit_tvm.schedules.wgmma import WgmmaConfig, wgmma_config, wgmma_row_gather_func  # noqa: E402
from pit_tvm.target import build  # noqa: E402

T = tvm.runtime.from_dlpack
dev = tvm.cuda(0)
widths = [tuple(int(x) for x in s.split("x")) for s in sys.argv[1:] if s != "--8192"]
SHAPES = [(4096, 4096, 4096, (410, 2048, 4096)), (4096, 2048, 8192, (4096,)), (4096, 8192, 2048, (4096,)),
          (4096, 768, 3072, (2400,)), (4096, 3072, 768, (2400,)), (4096, 768, 2304, (2400,)),
          (4096, 768, 768, (2400,))]
if "--8192" in sys.argv:
    SHAPES = [(8192, 8192, 8192, (82, 410, 819, 4096, 8192))]


def device_us(fn):
    return sum(kernel_split_us(fn, iters=20).values())


for m, k, n, counts in SHAPES:
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
    c = torch.empty(m, n, device="cuda", dtype=torch.float16)
    ref = a.float() @ b.float()
    print(f"{m}x{k}x{n}: cuBLAS {device_us(lambda: torch.matmul(a, b)):6.1f} us", flush=True)
    for cnt in counts:
        base = wgmma_config(n, rows=cnt)
        for bn, st in widths or [(base.block_n, base.stages)]:
            line = f"  rows {cnt:5d} {bn}x{st}:"
            for cluster in (1, 2):
                cfg = WgmmaConfig(bn, st, 64, cluster_m=cluster)
                dense = cnt == m
                f = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, dense=dense, config=cfg)}),
                          "cuda:sm_90a")["main"]
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
                line += f"  cluster {cluster}: {device_us(lambda: f(*args, T(c))):6.1f} us (err {err:.1e})"
            print(line, flush=True)
