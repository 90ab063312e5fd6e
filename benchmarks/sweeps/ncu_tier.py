"""ncu target: a few-rows tier of the rows kernel at 4096^3 (64 x 8 up to 256 listed rows, else 128 x 6),
three runs.

    ncu --kernel-name regex:tier --launch-skip 2 --launch-count 1 [--page source --print-source sass --csv] \\
        python3 benchmarks/sweeps/ncu_tier.py [LISTED_ROWS]   (default 41)
"""
import argparse
import numpy as np, torch, tvm
from pit_tvm.testing import rows_index
from pit_tvm.schedules.wgmma import WgmmaConfig, wgmma_row_gather_func
from pit_tvm.target import build
m = k = n = 4096
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("listed_rows", nargs="?", type=int, default=41)
cnt = parser.parse_args().listed_rows
bn, st = (64, 8) if cnt <= 256 else (128, 6)
f = wgmma_row_gather_func(k, n, config=WgmmaConfig(bn, st), rows_upto=256 if bn == 64 else 512,
                          rows_above=0 if bn == 64 else 256)
ex = build(tvm.IRModule({"tier": f.with_attr("global_symbol", "tier")}), "cuda:sm_90a")["tier"]
dev = tvm.cuda(0)
a = torch.randn(m, k, device="cuda", dtype=torch.float16); b = torch.randn(k, n, device="cuda", dtype=torch.float16)
nz = np.zeros(m, bool); nz[np.random.default_rng(0).choice(m, cnt, replace=False)] = True
off, ids = (tvm.runtime.tensor(x, dev) for x in rows_index(nz))
c = torch.empty(m, n, device="cuda", dtype=torch.float16)
T = tvm.runtime.from_dlpack
for _ in range(3):
    ex(T(a), T(b), off, ids, T(c))
dev.sync()
print("done")
