"""Rows-kernel time per wgmma tile width and row count (calibrates the width choice), and the
index's kernels under a cold L2.

    python3 benchmarks/_wgmma_widths.py
"""
import sys, json, os
import numpy as np, torch, tvm
from triton.testing import do_bench
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "tests")
from common import kernel_split_us
from pit_tvm.schedules.wgmma import WgmmaConfig, wgmma_row_gather_func
from pit_tvm.target import build
from test_tensorcore import rows_index

dev = tvm.cuda(0)
out = []
for (k, n, counts) in [(4096, 4096, (45, 205, 410, 820, 1229, 2048, 3072, 4096)),
                       (768, 768, (1200, 2400, 4096)), (768, 2304, (2400, 4096)),
                       (768, 3072, (2400, 4096)), (3072, 768, (2400, 4096))]:
    m = 4096
    for bn in (256, 192, 128, 64):
        if n % bn:
            continue
        ex = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, config=WgmmaConfig(bn, 4))}), "cuda:sm_90a")
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(k, n, device="cuda", dtype=torch.float16)
        c = torch.empty(m, n, device="cuda", dtype=torch.float16)
        for cnt in counts:
            nz = np.zeros(m, bool); nz[np.random.default_rng(0).choice(m, cnt, replace=False)] = True
            off, ids = rows_index(nz)
            args = [tvm.runtime.from_dlpack(x) for x in (a, b)] + [tvm.runtime.tensor(off, dev), tvm.runtime.tensor(ids, dev), tvm.runtime.from_dlpack(c)]
            us = do_bench(lambda: ex["main"](*args), warmup=10, rep=50) * 1e3
            out.append(dict(k=k, n=n, bn=bn, count=cnt, us=us))
            print(f"K={k} N={n} BN={bn} count={cnt}: {us:.1f} us", flush=True)

import pit_tvm
op = pit_tvm.sparse_matmul(4096, 4096, "float16", micro_tile=(1, 4096), target="cuda")
a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16); a[torch.rand(4096, device="cuda") < 0.9] = 0
at = tvm.runtime.from_dlpack(a)
flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
def cold(fn):
    def g():
        flush.zero_(); fn()
    return g
print("index do_bench (flushed):", do_bench(lambda: op.index(at)) * 1e3)
print("index split (cold):", kernel_split_us(cold(lambda: op.index(at))))
print("op split (cold):", kernel_split_us(cold(lambda: op(at, tvm.runtime.from_dlpack(a)))))
print("torch any (flushed):", do_bench(lambda: (a != 0).any(1)) * 1e3)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "widths.json"), "w"))
