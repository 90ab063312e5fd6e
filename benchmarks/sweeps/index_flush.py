"""Probe: the rows index (4096 x 4096 fp16, one kernel) against one read of A by a minimal Triton
kernel and a copy of A, with L2 swept before each call by a read (clean), by a write (dirty:
triton.testing.do_bench's zero_) or not at all: device time per kernel (torch.profiler).

    python3 benchmarks/sweeps/index_flush.py

Under ncu (``--cache-control none``), with the write sweep before each call, the index kernel
writes ~11 MB to DRAM (the sweep's dirty lines it evicts) for its 8 KiB of ids.
"""
import argparse
import sys

import numpy as np
import torch
import tvm

from pit_tvm.index import tiles

sys.path.insert(0, "benchmarks")
from common import kernel_split_us  # noqa: E402
from gpu_matmul import L2_STATES, l2_sweep  # noqa: E402
from peers.read_once import read_once_fn  # noqa: E402

argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

m = k = 4096
sweeps = dict({l2: l2_sweep(torch, l2) for l2 in L2_STATES}, none=lambda: None)

builder = tiles.IndexBuilder(tiles._tile_index_func(k, (1, k), "col", "float16", "cuda", density_threshold=0.9),
                             "cuda")
for s in (0.5, 0.9):
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    a[torch.from_numpy(np.random.default_rng(0).permutation(m)[: int(round(s * m))]).cuda()] = 0
    at = tvm.runtime.from_dlpack(a)
    off, _ = builder(at)
    assert int(off.numpy()[1]) == int((a != 0).any(1).sum())
    c = torch.empty_like(a)
    calls = {"index": lambda: builder(at), "read A once": read_once_fn(a), "copy A": lambda: c.copy_(a)}
    for l2, sweep in sweeps.items():
        row = {}
        for name, fn in calls.items():
            before = set(kernel_split_us(sweep, iters=3)) if l2 != "none" else set()
            t = kernel_split_us(lambda: (sweep(), fn()))
            row[name] = round(sum(v for kk, v in t.items() if kk not in before), 1)
        print(f"s={s} L2 {l2}: {row} us (half the copy, a read at the copy's bandwidth: {row['copy A'] / 2:.1f} us)",
              flush=True)
