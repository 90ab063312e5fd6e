"""A target for ncu: the wgmma tiles kernel at the OPT FFN's fc2 (M 4096, K 8192, N 2048, fp16,
32x1 micro-tiles covered by 128-row strips, the pattern of ``_tiles_widths.py``: ~22 % strip
coverage), then the dense kernel of the same shape, each run three times.

    ncu --kernel-name regex:"pit_kernel|fc2_dense" --launch-skip 2 --launch-count 2 \\
        python3 benchmarks/sweeps/ncu_tiles_ffn.py
"""
import argparse
import sys

import torch
import tvm

from pit_tvm.ops.matmul import SparseMatmul
from pit_tvm.schedules.wgmma import wgmma_row_gather_func
from pit_tvm.target import build

sys.path.insert(0, "benchmarks")
from common import ffn_fc2_operands  # noqa: E402

argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

m, k, n = 4096, 8192, 2048
a, b, _ = ffn_fc2_operands(m, k, n)
at, bt = tvm.runtime.from_dlpack(a), tvm.runtime.from_dlpack(b)
op = SparseMatmul(k, n, "float16", (32, 1), "cuda")
dense = build(tvm.IRModule({"fc2_dense": wgmma_row_gather_func(k, n, dense=True).with_attr("global_symbol", "fc2_dense")}),
              "cuda:sm_90a")["fc2_dense"]
c = tvm.runtime.empty((m, n), "float16", tvm.cuda(0))
for _ in range(3):
    op(at, bt)
for _ in range(3):
    dense(at, bt, c)
torch.cuda.synchronize()
