"""Device time of each kernel of the 4096^3 tiles op (the strips index, its CSR pack, the A
compaction, the tiles kernel and the dense fallback) on gpu_matmul.py's random micro-tile
patterns, with L2 flushed before every call (``common.kernel_split_us``, torch.profiler).

    python3 benchmarks/sweeps/tiles_op_kernels.py MICRO_TILE [SPARSITY ...]   e.g. 32x64 0.5 0.9 0.99
"""
import argparse
import sys

import numpy as np
import torch
import tvm

import pit_tvm

sys.path.insert(0, "benchmarks")
from common import kernel_split_us  # noqa: E402
from gpu_matmul import micro_tile_for  # noqa: E402
from pit_tvm.testing import expand, tile_pattern  # noqa: E402

m = k = n = 4096
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("micro_tile", help="e.g. 32x64")
parser.add_argument("sparsity", nargs="*", type=float, default=[0.5, 0.9, 0.99])
ARGS = parser.parse_args()
mt = micro_tile_for(ARGS.micro_tile, k)
op = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=mt, target="cuda")
b = tvm.runtime.from_dlpack(torch.randn(k, n, device="cuda", dtype=torch.float16))
flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
for s in ARGS.sparsity:
    mask = expand(tile_pattern(m, k, mt, s, np.random.default_rng(0)), mt, (m, k))
    a = torch.randn(m, k, device="cuda", dtype=torch.float16) * torch.from_numpy(mask).cuda()
    a_t = tvm.runtime.from_dlpack(a)
    split = kernel_split_us(lambda: (flush.zero_(), op(a_t, b)))
    print(f"{ARGS.micro_tile} s={s}: " + "  ".join(f"{name} {us:.1f} us" for name, us in split.items()
                                               if name.startswith("pit")), flush=True)
