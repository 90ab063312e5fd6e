"""What each wgmma epilogue costs on BERT's FFN-in shape (4096 x 768 x 3072, 2400 listed rows):
the rows kernel without epilogue, with a bias, bias + GELU, and BERT's bias + GELU + row scales.

    python3 benchmarks/sweeps/epilogue_cost.py [BNxSTAGES ...]
"""
import argparse
import numpy as np, torch, tvm
from triton.testing import do_bench
from pit_tvm.testing import rows_index
from pit_tvm.schedules.wgmma import WgmmaConfig, wgmma_row_gather_func
from pit_tvm.target import build

T = tvm.runtime.from_dlpack
dev = tvm.cuda(0)
m, k, n, cnt = 4096, 768, 3072, 2400
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("configs", nargs="*", default=["256x4"], help="BNxSTAGES of the rows kernel")
names = parser.parse_args().configs
a = torch.randn(m, k, device="cuda", dtype=torch.float16)
b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
bias = torch.randn(n, device="cuda", dtype=torch.float16)
nz = np.zeros(m, bool); nz[np.random.default_rng(0).choice(m, cnt, replace=False)] = True
rs = torch.from_numpy(nz.astype(np.float16)).cuda()
off, ids = (tvm.runtime.tensor(x, dev) for x in rows_index(nz))
c = torch.empty(m, n, device="cuda", dtype=torch.float16)
variants = {"none": {}, "bias": dict(bias=True), "bias+gelu": dict(bias=True, gelu=True),
            "bias+relu": dict(bias=True, relu=True),
            "bert": dict(bias=True, gelu=True, row_scale=True, row_scale_masks=True, row_scale_a=True)}
for name in names:
    cfg = WgmmaConfig(*(int(x) for x in name.split("x")))
    line = f"{name}:"
    for vname, kw in variants.items():
        for dense in (False, True):
            f = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, dense=dense, config=cfg, **kw)}),
                      "cuda:sm_90a")["main"]
            args = ([] if dense else [off, ids]) + ([T(bias)] if kw.get("bias") else []) \
                + ([T(rs)] if kw.get("row_scale") else [])
            run = lambda: f(T(a), T(b), *args, T(c))
            line += f"  {vname}{'(dense)' if dense else ''} {do_bench(run) * 1e3:6.1f}"
    print(line, flush=True)
