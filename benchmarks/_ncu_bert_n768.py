"""A target for ncu: BERT's FFN-out GEMM (K 3072, N 768, fp16, bias + residual), as the PIT build
runs it (the rows kernel over 2,400 of 4,096 rows, the tile width planned for them) and as the
PIT-off build does (the dense kernel over 4,096 rows), each run three times.

    ncu --kernel-name regex:ffnout --launch-skip 2 --launch-count 4 --section SpeedOfLight \\
        --section WarpStateStats python3 benchmarks/_ncu_bert_n768.py

(the 3rd rows launch and the three dense ones are profiled; read the rows one and the last dense)

H100, 2026-11-24, at 7742ee5 (durations under ncu):
- rows kernel (128 x 6 tiles; 6 x 32 CTAs, 114 of them computing, the rest storing the unlisted
  rows): 33.9 us. SM active cycles 39,945 of 52,323 elapsed (76 %); Compute (SM) throughput
  43.8 %, DRAM 24.3 %, L2 33.1 %, L2 hit rate 67.7 %.
- dense kernel (192 x 4 tiles; 4 x 32 CTAs): 37.2 us. Compute (SM) throughput 69.4 %, DRAM
  31.0 %, L2 36.4 %.
Neither is memory-bound.  The rows kernel idles a quarter of the SM cycles (one wave of 114
computing CTAs on 132 SMs), and its busy SMs run below the dense kernel's rate (narrower tiles,
one CTA an SM).
"""
import sys

import numpy as np
import torch
import tvm

from pit_tvm.schedules.wgmma import wgmma_config, wgmma_row_gather_func
from pit_tvm.target import build

sys.path.insert(0, "tests")
from _helpers import rows_index  # noqa: E402

m, k, n, rows = 4096, 3072, 768, 2400
TV = tvm.runtime.from_dlpack
dev = tvm.cuda(0)
kernels = {}
for name, kw in (("ffnout_rows", dict(config=wgmma_config(n, rows))),
                 ("ffnout_dense", dict(config=wgmma_config(n, m), dense=True))):
    func = wgmma_row_gather_func(k, n, bias=True, residual=True, **kw).with_attr("global_symbol", name)
    kernels[name] = build(tvm.IRModule({name: func}), "cuda:sm_90a")[name]
    print(name, kw["config"], flush=True)
a = TV(torch.randn(m, k, device="cuda", dtype=torch.float16))
b = TV(torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5)
bias = TV(torch.randn(n, device="cuda", dtype=torch.float16))
res = TV(torch.randn(m, n, device="cuda", dtype=torch.float16))
c = TV(torch.empty(m, n, device="cuda", dtype=torch.float16))
nz = np.zeros(m, bool)
nz[np.random.default_rng(0).choice(m, rows, replace=False)] = True
off, ids = (tvm.runtime.tensor(x, dev) for x in rows_index(nz))
for _ in range(3):
    kernels["ffnout_rows"](a, b, off, ids, bias, res, c)
for _ in range(3):
    kernels["ffnout_dense"](a, b, bias, res, c)
torch.cuda.synchronize()
