"""The few-rows tier's split K against none (``pit_tvm.schedules.wgmma.MAX_SPLITS`` 1): the
kernel alone at 4096^3 fp16 (do_bench, L2 cleared; the median of 5 interleaved rounds), checked
against torch.

    python3 benchmarks/_few_rows_splits.py [MAX_SPLITS ...]   (default 8 1: the default, no split)
"""
import sys

import numpy as np
import torch
import tvm
from triton.testing import do_bench

sys.path.insert(0, "tests")
from _helpers import rows_index  # noqa: E402
import pit_tvm.schedules.wgmma as w  # noqa: E402
from pit_tvm.target import build  # noqa: E402

T = tvm.runtime.from_dlpack
dev = tvm.cuda(0)
m = k = n = 4096
counts = (0, 41, 100, 205, 300, 410)
a = torch.randn(m, k, device="cuda", dtype=torch.float16)
b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
c = torch.empty(m, n, device="cuda", dtype=torch.float16)
ref = a.float() @ b.float()
few_rows, cfg = w.wgmma_few_rows_tier(n, w.WgmmaConfig(256, 4))
shares = [int(x) for x in sys.argv[1:]] or [w.MAX_SPLITS, 1]
kernels = {}
for share in shares:
    w.MAX_SPLITS = share
    w.wgmma_row_gather_func.cache_clear()
    kernels[share] = build(tvm.IRModule({"main": w.wgmma_row_gather_func(k, n, config=cfg, rows_upto=few_rows)}),
                           "cuda:sm_90a")["main"]
counters = tvm.runtime.tensor(np.zeros(w.SMS, np.int32), dev)
partials = tvm.runtime.tensor(np.zeros(w.SMS * cfg.block_n // 2 * 256, np.float32), dev)
print(f"C.zero_() (32 MiB memset) {do_bench(lambda: c.zero_()) * 1e3:5.1f} us", flush=True)
times = {(share, cnt): [] for share in shares for cnt in counts}
for cnt in counts:
    nz = np.zeros(m, bool)
    nz[np.random.default_rng(0).choice(m, cnt, replace=False)] = True
    off, ids = (tvm.runtime.tensor(x, dev) for x in rows_index(nz))
    s = torch.from_numpy(nz).cuda()
    for share, few in kernels.items():
        c.fill_(7)
        few(T(a), T(b), off, ids, counters, T(c), partials)
        torch.cuda.synchronize()
        err = c.float()[~s].abs().max().item() + (
            ((c.float()[s] - ref[s]).abs().max() / ref.abs().max()).item() if cnt else 0.0)
        assert err < 1e-2, (share, cnt, err)
    for _ in range(5):           # interleaved rounds: the median of 5 per (kernel, count)
        for share, few in kernels.items():
            times[share, cnt].append(do_bench(lambda: few(T(a), T(b), off, ids, counters, T(c), partials)) * 1e3)
for share in shares:
    print(f"MAX_SPLITS {share}:" + "".join(f"  {cnt} rows {np.median(times[share, cnt]):5.1f} us"
                                            f" ({min(times[share, cnt]):.1f}-{max(times[share, cnt]):.1f})"
                                            for cnt in counts), flush=True)
