"""Device time of each kernel of the rows op at K = N = M (the index kernel, the many-rows kernel and the few-rows tiers) with L2 flushed before every call (``common.kernel_split_us``, torch.profiler).

    python3 benchmarks/sweeps/rows_op_kernels.py [--size M] [SPARSITY ...]   (default 4096; 0.5 0.9 0.99)
"""
import argparse
import sys

import numpy as np
import torch
import tvm

import pit_tvm

sys.path.insert(0, "benchmarks")
from common import kernel_split_us  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--size", type=int, default=4096, help="M = K = N")
parser.add_argument("sparsity", nargs="*", type=float, default=[0.5, 0.9, 0.99])
args = parser.parse_args()
m = k = n = args.size
op = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=(1, k), target="cuda")
b = tvm.runtime.from_dlpack(torch.randn(k, n, device="cuda", dtype=torch.float16))
flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
for s in args.sparsity:
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    a[torch.from_numpy(np.random.default_rng(0).permutation(m)[: int(round(s * m))]).cuda()] = 0
    a_t = tvm.runtime.from_dlpack(a)
    split = kernel_split_us(lambda: (flush.zero_(), op(a_t, b)))
    kernels = {name: us for name, us in split.items() if name.startswith(("pit_index", "pit_kernel", "pit_few_rows"))}
    print(f"{m}^3 s={s}: " + "  ".join(f"{name} {us:.1f} us" for name, us in kernels.items())
          + f"  (sum {sum(kernels.values()):.1f} us)", flush=True)
