"""The wgmma rows kernel with every row (and every other row) listed, against the dense wgmma
kernel and cuBLAS, 4096^3 fp16: what the row gather costs over the dense kernel (the dense
kernel has no id loads at all).  Put an older ``pit_tvm`` first on PYTHONPATH for an A/B.

    python3 benchmarks/_rows_full.py
"""
import sys
import numpy as np, torch, tvm
from triton.testing import do_bench
sys.path.insert(0, "tests")
from _helpers import rows_index
from pit_tvm.schedules.wgmma import wgmma_row_gather_func
from pit_tvm.target import build

T = tvm.runtime.from_dlpack
dev = tvm.cuda(0)
m = k = n = 4096
a = torch.randn(m, k, device="cuda", dtype=torch.float16)
b = torch.randn(k, n, device="cuda", dtype=torch.float16)
c = torch.empty(m, n, device="cuda", dtype=torch.float16)
dense = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, dense=True)}), "cuda:sm_90a")["main"]
rows = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n)}), "cuda:sm_90a")["main"]
for label, nz in (("all rows", np.ones(m, bool)), ("half", np.arange(m) % 2 == 0)):
    off, ids = (tvm.runtime.tensor(x, dev) for x in rows_index(nz))
    print(f"{label}: cuBLAS {do_bench(lambda: torch.matmul(a, b)) * 1e3:.1f} us  dense {do_bench(lambda: dense(T(a), T(b), T(c))) * 1e3:.1f} us"
          f"  rows {do_bench(lambda: rows(T(a), T(b), off, ids, T(c))) * 1e3:.1f} us", flush=True)
