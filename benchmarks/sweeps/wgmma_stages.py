"""wgmma rows/dense kernel time by tile width, ring depth (prefetch distance = stages - 2) and
K-tile depth, for few rows (latency-bound K loops) and BERT-size layers, checked against torch.

    python3 benchmarks/sweeps/wgmma_stages.py [--square] [BNxSTAGES[xBK] ...]   (e.g. 64x8 128x6 256x8x32)

``--square``: 4096^3 only; ``COUNTS=45,205,410``: its listed-row counts (the few-rows tier's
evidence, :data:`pit_tvm.schedules.wgmma.FEW_ROWS_STAGES`).
"""
import argparse
import os
import numpy as np, torch, tvm
from triton.testing import do_bench
from pit_tvm.testing import rows_index
from pit_tvm.schedules.wgmma import WgmmaConfig, wgmma_row_gather_func
from pit_tvm.target import build

T = tvm.runtime.from_dlpack
dev = tvm.cuda(0)
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("configs", nargs="*", help="BNxSTAGES[xBK]")
parser.add_argument("--square", action="store_true")
ARGS = parser.parse_args()
square = ARGS.square
names = ARGS.configs or ["256x4", "128x4", "128x6", "64x4", "64x6", "64x8"]
configs = [WgmmaConfig(*(int(x) for x in s.split("x"))) for s in names]
counts = tuple(int(x) for x in os.environ.get("COUNTS", "45,410,2048").split(","))
shapes = [(4096, 4096, 4096, counts), (4096, 768, 768, (2400,)), (4096, 768, 2304, (2400,)),
          (4096, 3072, 768, (2400,)), (4096, 768, 3072, (2400,))][:1 if square else None]
for (m, k, n, counts) in shapes:
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
    c = torch.empty(m, n, device="cuda", dtype=torch.float16)
    ref = a.float() @ b.float()
    cublas = do_bench(lambda: torch.matmul(a, b)) * 1e3
    line0 = f"{m}x{k}x{n} cuBLAS dense {cublas:6.1f} us"
    for cnt in counts:
        sel = torch.zeros(m, dtype=torch.bool, device="cuda")
        sel[torch.from_numpy(np.random.default_rng(0).choice(m, cnt, replace=False)).cuda()] = True
        idx = sel.nonzero().squeeze(1)
        line0 += f"  gather-mm{cnt} {do_bench(lambda: a[idx] @ b) * 1e3:6.1f}"
    print(line0, flush=True)
    for cfg in configs:
        if n % cfg.block_n:
            continue
        name = f"{cfg.block_n}x{cfg.stages}x{cfg.block_k}"
        try:
            dense = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, dense=True, config=cfg)}), "cuda:sm_90a")["main"]
            rows = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, config=cfg)}), "cuda:sm_90a")["main"]
        except Exception as e:  # noqa: BLE001
            print(f"  {name}: build error {str(e)[:200]}", flush=True)
            continue
        c.fill_(7)
        dense(T(a), T(b), T(c)); torch.cuda.synchronize()
        err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
        line = f"  {name}: dense {do_bench(lambda: dense(T(a), T(b), T(c))) * 1e3:7.1f} us (err {err:.1e})"
        for cnt in counts:
            nz = np.zeros(m, bool); nz[np.random.default_rng(0).choice(m, cnt, replace=False)] = True
            off, ids = (tvm.runtime.tensor(x, dev) for x in rows_index(nz))
            c.fill_(7)
            rows(T(a), T(b), off, ids, T(c)); torch.cuda.synchronize()
            s = torch.from_numpy(nz).cuda()
            e = ((c.float()[s] - ref[s]).abs().max() / ref.abs().max()).item() + c.float()[~s].abs().max().item()
            line += f"  rows{cnt} {do_bench(lambda: rows(T(a), T(b), off, ids, T(c))) * 1e3:6.1f} (err {e:.1e})"
        print(line, flush=True)
