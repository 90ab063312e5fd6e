"""Warp-specialized dense and rows wgmma kernels with and without the persistent grid
(``WgmmaConfig.persistent``: SMS CTAs loop over the tiles, the loader filling the next tile's
ring while the consumers store the last one from their fragments): device time per call
(torch.profiler, L2 warm) and the error against float32, for 4096^3 and BERT-base's layers.

    python3 benchmarks/_pws_probe.py [--8192]
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
#: (M, K, N, listed-row counts (M: the dense kernel), epilogue)
SHAPES = [(4096, 4096, 4096, (410, 2048, 4096), ""), (4096, 2048, 8192, (4096,), "relu"),
          (4096, 8192, 2048, (4096,), ""), (4096, 768, 3072, (2400, 4096), "gelu"),
          (4096, 3072, 768, (2400, 4096), "residual"), (4096, 768, 2304, (2400, 4096), "bias"),
          (4096, 768, 768, (2400, 4096), "residual"), (4000, 768, 768, (33, 3999), "bias")]
if "--8192" in sys.argv:
    SHAPES = [(8192, 8192, 8192, (410, 819, 4096, 8192), "")]


def device_us(fn):
    return sum(kernel_split_us(fn, iters=20).values())


for m, k, n, counts, epi in SHAPES:
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    res = torch.randn(m, n, device="cuda", dtype=torch.float16)
    c = torch.empty(m, n, device="cuda", dtype=torch.float16)
    kw = {"": {}, "bias": {"bias": True}, "relu": {"bias": True, "relu": True},
          "gelu": {"bias": True, "gelu": True}, "residual": {"bias": True, "residual": True}}[epi]
    ref = a.float() @ b.float()
    if epi:
        ref = ref + bias.float()
    if epi == "relu":
        ref = ref.relu()
    if epi == "gelu":
        ref = torch.nn.functional.gelu(ref)
    zero_row = (torch.nn.functional.gelu(bias.float()) if epi == "gelu" else bias.float().relu() if epi == "relu"
                else bias.float() if epi else torch.zeros(n, device="cuda"))
    print(f"{m}x{k}x{n} {epi or 'plain'}: cuBLAS {device_us(lambda: torch.matmul(a, b)):6.1f} us", flush=True)
    for cnt in counts:
        dense = cnt == m
        base = wgmma_config(n, rows=cnt)
        line = f"  {'dense' if dense else 'rows'} {cnt:5d} {base.block_n}x{base.stages}:"
        for persistent in (False, True):
            cfg = WgmmaConfig(base.block_n, base.stages, 64, persistent)
            f = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, dense=dense, config=cfg, **kw)}),
                      "cuda:sm_90a")["main"]
            nz = np.zeros(m, bool)
            nz[np.random.default_rng(0).choice(m, cnt, replace=False)] = True
            args = [T(a), T(b)] + ([] if dense else [tvm.runtime.tensor(x, dev) for x in rows_index(nz)])
            args += [T(bias)] if epi else []
            args += [T(res)] if epi == "residual" else []
            c.fill_(7)
            f(*args, T(c))
            torch.cuda.synchronize()
            s = torch.from_numpy(nz).cuda()
            want = torch.where(s[:, None], ref, zero_row[None, :])
            if epi == "residual":
                want = want + res.float()
            err = ((c.float() - want).abs().max() / ref.abs().max()).item()
            line += f"  {'persistent' if persistent else 'grid'} {device_us(lambda: f(*args, T(c))):6.1f} us (err {err:.1e})"
        print(line, flush=True)
