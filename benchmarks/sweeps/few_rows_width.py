"""The few-rows tiers' tile width at 4096^3 and 8192^3: a tier's kernel alone (rows_upto: the
rows whose tiles fill one wave) for 128x6 against 64x8 tiles, at 1 / 5 / 10 % of the rows
listed (those in its range), beside a memset of C.

    python3 benchmarks/sweeps/few_rows_width.py [BNxSTAGES ...]
"""
import argparse

import numpy as np
import torch
import tvm
from triton.testing import do_bench

from pit_tvm.testing import rows_index  # noqa: E402

from pit_tvm.schedules.wgmma import WgmmaConfig, wgmma_row_gather_func  # noqa: E402
from pit_tvm.target import build  # noqa: E402

T = tvm.runtime.from_dlpack
dev = tvm.cuda(0)
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("configs", nargs="*", default=["128x6", "64x8", "64x6"], help="BNxSTAGES of the tier")
names = parser.parse_args().configs
for size in (4096, 8192):
    m = k = n = size
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
    c = torch.empty(m, n, device="cuda", dtype=torch.float16)
    ref = a.float() @ b.float()
    print(f"{size}^3 cuBLAS {do_bench(lambda: torch.matmul(a, b)) * 1e3:7.1f} us, "
          f"memset C {do_bench(lambda: c.zero_()) * 1e3:6.1f} us", flush=True)
    for name in names:
        bn, stages = (int(x) for x in name.split("x"))
        line = f"  {name}:"
        upto = 128 * (132 // (n // bn))     # the tier's rows: its tiles fill one wave
        kern = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, config=WgmmaConfig(bn, stages),
                                                                 rows_upto=upto)}), "cuda:sm_90a")["main"]
        for frac in (0.01, 0.05, 0.1):
            cnt = int(m * frac)
            if cnt > upto:
                continue
            nz = np.zeros(m, bool)
            nz[np.random.default_rng(0).choice(m, cnt, replace=False)] = True
            off, ids = (tvm.runtime.tensor(x, dev) for x in rows_index(nz))
            c.fill_(7)
            kern(T(a), T(b), off, ids, T(c))
            torch.cuda.synchronize()
            s = torch.from_numpy(nz).cuda()
            err = ((c.float()[s] - ref[s]).abs().max() / ref.abs().max()).item() + c.float()[~s].abs().max().item()
            line += f"  {cnt} rows {do_bench(lambda: kern(T(a), T(b), off, ids, T(c))) * 1e3:6.1f} us (err {err:.0e})"
        print(line, flush=True)
