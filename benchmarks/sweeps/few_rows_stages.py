"""Device time of the rows op's kernels at K = N = M with the few-rows tiers' ring depths set
(:data:`pit_tvm.schedules.wgmma.FEW_ROWS_STAGES`), L2 flushed before every call (``common.kernel_split_us``).

    python3 benchmarks/sweeps/few_rows_stages.py [--size M] 128x6,64x8 128x7,64x9 ... [--sparsity 0.9 0.95 0.99]
"""
import argparse
import sys

import numpy as np
import torch
import tvm

import pit_tvm
from pit_tvm.schedules import wgmma

sys.path.insert(0, "benchmarks")
from common import kernel_split_us  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--size", type=int, default=4096, help="M = K = N")
parser.add_argument("rings", nargs="+", help="BNxSTAGES,... per variant, e.g. 128x6,64x8")
parser.add_argument("--sparsity", nargs="+", type=float, default=[0.9, 0.95, 0.99])
args = parser.parse_args()
m = k = n = args.size
b = tvm.runtime.from_dlpack(torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5)
flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
for ring in args.rings:
    wgmma.FEW_ROWS_STAGES.clear()
    wgmma.FEW_ROWS_STAGES.update({int(bn): int(st) for bn, st in (x.split("x") for x in ring.split(","))})
    op = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=(1, k), target="cuda")
    for s in args.sparsity:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        a[torch.from_numpy(np.random.default_rng(0).permutation(m)[: int(round(s * m))]).cuda()] = 0
        a_t = tvm.runtime.from_dlpack(a)
        c = torch.from_dlpack(op(a_t, b)).float()
        err = ((c - a.float() @ torch.from_dlpack(b).float()).abs().max()).item()
        split = kernel_split_us(lambda: (flush.zero_(), op(a_t, b)))
        tiers = {name.split("_")[2]: us for name, us in split.items() if name.startswith("pit_few_rows")}
        print(f"{ring} {m}^3 s={s}: " + "  ".join(f"{t} {us:.1f} us" for t, us in tiers.items())
              + f"  (max abs err {err:.2e})", flush=True)
