"""wgmma kernel time by K-tile depth and ring depth (block_k 64 x 4 stages vs 32 x 6-8), dense
and rows, with a numerics check against torch (fp32 accumulation).

    python3 benchmarks/_wgmma_depth.py
"""
import sys
import numpy as np, torch, tvm
from triton.testing import do_bench
sys.path.insert(0, "tests")
from _helpers import rows_index
from pit_tvm.schedules.wgmma import WgmmaConfig, wgmma_row_gather_func
from pit_tvm.target import build

T = tvm.runtime.from_dlpack
dev = tvm.cuda(0)
configs = [WgmmaConfig(256, 4, 64), WgmmaConfig(256, 8, 32), WgmmaConfig(256, 6, 32),
           WgmmaConfig(128, 4, 64), WgmmaConfig(128, 8, 32), WgmmaConfig(128, 12, 32),
           WgmmaConfig(192, 8, 32), WgmmaConfig(64, 12, 32)]
for (m, k, n, counts) in [(4096, 4096, 4096, (45, 410, 2048)), (4096, 768, 768, (2400,)),
                          (4096, 768, 2304, (2400,)), (4096, 768, 3072, (2400,)), (4096, 3072, 768, (2400,))]:
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
    c = torch.empty(m, n, device="cuda", dtype=torch.float16)
    ref = (a.float() @ b.float())
    for cfg in configs:
        if n % cfg.block_n:
            continue
        name = f"{cfg.block_n}x{cfg.block_k}s{cfg.stages}"
        try:
            dense = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, dense=True, config=cfg)}), "cuda:sm_90a")["main"]
            rows = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, config=cfg)}), "cuda:sm_90a")["main"]
        except Exception as e:  # noqa: BLE001
            print(f"{m}x{k}x{n} {name}: build error {str(e)[:100]}", flush=True)
            continue
        c.fill_(7)
        dense(T(a), T(b), T(c)); torch.cuda.synchronize()
        err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
        line = f"{m}x{k}x{n} {name}: dense {do_bench(lambda: dense(T(a), T(b), T(c))) * 1e3:7.1f} us (err {err:.1e})"
        for cnt in counts:
            nz = np.zeros(m, bool); nz[np.random.default_rng(0).choice(m, cnt, replace=False)] = True
            off, ids = (tvm.runtime.tensor(x, dev) for x in rows_index(nz))
            c.fill_(7)
            rows(T(a), T(b), off, ids, T(c)); torch.cuda.synchronize()
            sel = torch.from_numpy(nz).cuda()
            e = ((c.float()[sel] - ref[sel]).abs().max() / ref.abs().max()).item() + c.float()[~sel].abs().max().item()
            line += f"  rows{cnt} {do_bench(lambda: rows(T(a), T(b), off, ids, T(c))) * 1e3:6.1f} (err {e:.1e})"
        print(line, flush=True)
