"""wgmma rows kernel time by tile config and listed-row count at M=4096 (the few-rows tier's
evidence, :data:`pit_tvm.schedules.wgmma.FEW_ROWS_STAGES`), checked against torch.

    COUNTS=45,205,410 python3 benchmarks/_rows_tiers.py [BNxSTAGES ...]   (e.g. 256x4 128x6 64x8)
"""
import os
import sys
import numpy as np, torch, tvm
from triton.testing import do_bench
sys.path.insert(0, "tests")
from _helpers import rows_index
from pit_tvm.schedules.wgmma import WgmmaConfig, wgmma_row_gather_func
from pit_tvm.target import build

T = tvm.runtime.from_dlpack
dev = tvm.cuda(0)
k = n = 4096
b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
c0 = torch.empty(4096, n, device="cuda", dtype=torch.float16)
print(f"memset 4096x4096 fp16: {do_bench(lambda: c0.zero_()) * 1e3:6.1f} us", flush=True)
COUNTS = [int(x) for x in os.environ.get("COUNTS", "45,100,410").split(",")]
for name in sys.argv[1:] or ["256x4", "128x4", "64x4", "64x8"]:
    cfg = WgmmaConfig(*(int(x) for x in name.split("x")))
    rows = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, config=cfg)}), "cuda:sm_90a")["main"]
    line = f"{name}:"
    m = 4096
    for cnt in COUNTS:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        c = torch.empty(m, n, device="cuda", dtype=torch.float16)
        nz = np.zeros(m, bool); nz[np.random.default_rng(0).choice(m, cnt, replace=False)] = True
        off, ids = (tvm.runtime.tensor(x, dev) for x in rows_index(nz))
        rows(T(a), T(b), off, ids, T(c)); torch.cuda.synchronize()
        ref = a.float()[torch.from_numpy(nz).cuda()] @ b.float()
        err = ((c.float()[torch.from_numpy(nz).cuda()] - ref).abs().max() / ref.abs().max()).item()
        line += f"  rows{cnt} {do_bench(lambda: rows(T(a), T(b), off, ids, T(c))) * 1e3:6.1f} (err {err:.0e})"
    print(line, flush=True)
