"""The fused attention kernel on BERT-base's batch (32 x 128 tokens, 12 heads, packed Q/K/V,
merged output, padding row scale) with the benchmark's padding mask against a mask with no
padding: what skipping the masked keys' and padded queries' reads saves, same kernel.

    python3 benchmarks/sweeps/attention_padding.py
"""
import argparse
import sys

import numpy as np
import torch
import tvm
from triton.testing import do_bench

sys.path.insert(0, "benchmarks")
from pit_tvm.schedules.attention import fused_attention_func  # noqa: E402
from pit_tvm.target import build  # noqa: E402

argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

B, H, S, D = 32, 12, 128, 64
W = 3 * H * D
f = build(tvm.IRModule({"main": fused_attention_func(B, H, S, D, 0.125, packed=((W, 0), (W, H * D), (W, 2 * H * D)),
                                                     out_packed=True, row_scale=True)}), "cuda:sm_90a")["main"]
lengths = np.random.default_rng(0).integers(16, S + 1, size=B)     # as benchmarks/models.py
qkv = torch.randn(B, S, W, device="cuda", dtype=torch.float16)
out = torch.empty(B, S, H * D, device="cuda", dtype=torch.float16)
flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
T = tvm.runtime.from_dlpack
for name, lens in (("padded (benchmark lengths)", lengths), ("no padding", np.full(B, S))):
    real = torch.from_numpy(np.arange(S)[None, :] < lens[:, None]).cuda()
    mask = torch.where(real, 0.0, -10000.0).to(torch.float16).reshape(B, 1, 1, S)
    rows = real.to(torch.float16).reshape(B, S, 1)
    args = [T(qkv), T(qkv), T(qkv), T(mask), T(rows), T(out)]

    def cold():
        flush.zero_()
        f(*args)
    flush_us = do_bench(lambda: flush.zero_(), warmup=5, rep=50) * 1e3
    us = do_bench(lambda: f(*args), warmup=10, rep=100) * 1e3
    cold_us = do_bench(cold, warmup=5, rep=50) * 1e3 - flush_us
    print(f"{name:28s} real tokens {real.float().mean().item():.3f}: warm L2 {us:6.1f} us, cold L2 {cold_us:6.1f} us",
          flush=True)
