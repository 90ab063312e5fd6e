"""wgmma kernels with one or two wgmma groups left running per K tile (``WgmmaConfig.inflight``;
prefetch distance = stages - 1 - inflight): the few-rows tier at 4096^3 and the rows kernel on
BERT's layer shapes, checked against torch.

    python3 benchmarks/_wgmma_inflight.py [BNxSTAGESxINFLIGHT ...]   (default 128x6x1 128x6x2 256x4x1 256x4x2)
"""
import sys

import numpy as np
import torch
import tvm
from triton.testing import do_bench

sys.path.insert(0, "tests")
from _helpers import rows_index  # noqa: E402
from pit_tvm.schedules.wgmma import SMS, WgmmaConfig, wgmma_few_rows_tier, wgmma_row_gather_func  # noqa: E402
from pit_tvm.target import build  # noqa: E402

T = tvm.runtime.from_dlpack
dev = tvm.cuda(0)
names = sys.argv[1:] or ["128x6x1", "128x6x2", "256x4x1", "256x4x2"]
configs = [WgmmaConfig(int(bn), int(st), inflight=int(inf)) for bn, st, inf in (s.split("x") for s in names)]
shapes = [(4096, 4096, 4096, (41, 205, 410, 2048)), (4096, 3072, 768, (2400,)), (4096, 768, 768, (2400,)),
          (4096, 768, 3072, (2400,))]


def check(c, ref, nz):
    s = torch.from_numpy(nz).cuda()
    return ((c.float()[s] - ref[s]).abs().max() / ref.abs().max()).item() + c.float()[~s].abs().max().item()


for m, k, n, counts in shapes:
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
    c = torch.empty(m, n, device="cuda", dtype=torch.float16)
    ref = a.float() @ b.float()
    print(f"{m}x{k}x{n} cuBLAS dense {do_bench(lambda: torch.matmul(a, b)) * 1e3:6.1f} us", flush=True)
    for cfg in configs:
        if n % cfg.block_n:
            continue
        name = f"{cfg.block_n}x{cfg.stages} inflight {cfg.inflight}"
        try:
            rows = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, config=cfg)}), "cuda:sm_90a")["main"]
            tier = wgmma_few_rows_tier(n, WgmmaConfig(256, 4))
            few = (build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, config=cfg, rows_upto=tier[0])}),
                         "cuda:sm_90a")["main"] if tier and cfg.block_n < 256 else None)
        except Exception as e:  # noqa: BLE001
            print(f"  {name}: build error {str(e)[:200]}", flush=True)
            continue
        line = f"  {name}:"
        counters = tvm.runtime.tensor(np.zeros(SMS, np.int32), dev)
        partials = tvm.runtime.tensor(np.zeros(SMS * cfg.block_n // 2 * 256, np.float32), dev)
        for cnt in counts:
            nz = np.zeros(m, bool)
            nz[np.random.default_rng(0).choice(m, cnt, replace=False)] = True
            off, ids = (tvm.runtime.tensor(x, dev) for x in rows_index(nz))
            c.fill_(7)
            rows(T(a), T(b), off, ids, T(c))
            torch.cuda.synchronize()
            line += f"  rows{cnt} {do_bench(lambda: rows(T(a), T(b), off, ids, T(c))) * 1e3:6.1f} (err {check(c, ref, nz):.0e})"
            if few is not None and cnt <= tier[0]:
                c.fill_(7)
                few(T(a), T(b), off, ids, counters, T(c), partials)
                torch.cuda.synchronize()
                line += (f" few {do_bench(lambda: few(T(a), T(b), off, ids, counters, T(c), partials)) * 1e3:6.1f}"
                         f" (err {check(c, ref, nz):.0e})")
        print(line, flush=True)
