"""Device time of each kernel of the 4096^3 rows op (the index kernel, the many-rows kernel and the few-rows tiers) with L2 flushed before every call (``common.kernel_split_us``, torch.profiler).

    python3 benchmarks/_rows_op_kernels.py [SPARSITY ...]   (default 0.5 0.9 0.99)
"""
import sys

import numpy as np
import torch
import tvm

import pit_tvm

sys.path.insert(0, "benchmarks")
from common import kernel_split_us  # noqa: E402

m = k = n = 4096
op = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=(1, k), target="cuda")
b = tvm.runtime.from_dlpack(torch.randn(k, n, device="cuda", dtype=torch.float16))
flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
for s in [float(x) for x in (sys.argv[1:] or ["0.5", "0.9", "0.99"])]:
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    a[torch.from_numpy(np.random.default_rng(0).permutation(m)[: int(round(s * m))]).cuda()] = 0
    a_t = tvm.runtime.from_dlpack(a)
    split = kernel_split_us(lambda: (flush.zero_(), op(a_t, b)))
    print(f"s={s}: " + "  ".join(f"{name} {us:.1f} us" for name, us in split.items()
                                 if name.startswith(("pit_index", "pit_kernel", "pit_few_rows"))), flush=True)
