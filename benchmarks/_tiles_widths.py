"""The wgmma tiles kernel at the OPT FFN's fc2 (M 4096, K 8192, N 2048, fp16, 32x1 micro-tiles
covered by 128-row strips) by tile config, on an activation pattern like the FFN's: 10 % of the
columns of ``hidden`` non-zero for 99 % of the tokens, the rest for ~0.1 % (strip coverage
~22 %); device time per kernel of one op call, L2 flushed.

    python3 benchmarks/_tiles_widths.py [BNxSTAGES ...]     (default 256x4 256x3 128x4 128x6)
"""
import sys

import torch
import tvm

import pit_tvm.schedules.wgmma as wg
from pit_tvm.ops.matmul import SparseMatmul

sys.path.insert(0, "benchmarks")
from common import ffn_fc2_operands, kernel_split_us  # noqa: E402

m, k, n = 4096, 8192, 2048
a, b, on = ffn_fc2_operands(m, k, n)
ref = a.float() @ b.float()
strips = on.view(m // 128, 128, k).any(1).float().mean().item()
print(f"strip coverage {strips:.3f}, element density {on.float().mean().item():.3f}", flush=True)
flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
base = wg.wgmma_config
at, bt = tvm.runtime.from_dlpack(a), tvm.runtime.from_dlpack(b)
for spec in sys.argv[1:] or ["256x4", "256x3", "128x4", "128x6"]:
    cfg = wg.WgmmaConfig(*(int(x) for x in spec.split("x")))
    wg.wgmma_config = lambda *args, _c=cfg, **kw: _c
    try:
        op = SparseMatmul(k, n, "float16", (32, 1), "cuda")
    finally:
        wg.wgmma_config = base
    c = torch.from_dlpack(op(at, bt))
    err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
    split = kernel_split_us(lambda: (flush.zero_(), op(at, bt)))
    print(spec, f"err {err:.1e}", "  ".join(f"{name.split('_k8192')[0]} {us:.1f}" for name, us in split.items()
                                             if name.startswith("pit_")), flush=True)
