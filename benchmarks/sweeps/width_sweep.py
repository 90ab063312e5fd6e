"""Rows-kernel time per tile width over a sweep of listed-row counts, for BERT-base's layer
shapes (the evidence behind :func:`pit_tvm.schedules.wgmma.wgmma_config`'s width choice).

    python3 benchmarks/sweeps/width_sweep.py [--gelu]      -> $OUT/width_sweep.json (or /tmp)

Each width runs with the ring :func:`wgmma_config` would give it for that row count (the
deeper one where its grid is one wave).  ``--gelu``: the FFN-in shape alone, with its bias +
GELU epilogue, over 1,792-3,072 rows (BERT's batches).
"""
import argparse
import json
import os

import numpy as np
import torch
import tvm
from triton.testing import do_bench

from pit_tvm.testing import rows_index  # noqa: E402
from pit_tvm.schedules.wgmma import wgmma_config, wgmma_row_gather_func  # noqa: E402
from pit_tvm.target import build  # noqa: E402

M = 4096
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--gelu", action="store_true", help="FFN-in with its bias + GELU epilogue")
GELU = parser.parse_args().gelu
SHAPES = [(768, 3072)] if GELU else [(768, 3072), (768, 2304), (3072, 768), (768, 768)]
COUNTS = list(range(1792, 3073, 256)) if GELU else list(range(512, M + 1, 256))
dev = tvm.cuda(0)
out = []


for k, n in SHAPES:
    a = torch.randn(M, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
    c = torch.empty(M, n, device="cuda", dtype=torch.float16)
    kernels = {}
    for bn in (256, 192, 128, 64):
        if n % bn:
            continue
        for cnt in COUNTS:
            cfg = wgmma_config(n, cnt, block_n=bn)
            if cfg not in kernels:
                mod = tvm.IRModule({"main": wgmma_row_gather_func(k, n, config=cfg, bias=GELU, gelu=GELU)})
                kernels[cfg] = build(mod, "cuda:sm_90a")["main"]
            nz = np.zeros(M, bool)
            nz[np.random.default_rng(cnt).choice(M, cnt, replace=False)] = True
            off, ids = rows_index(nz)
            bias = [tvm.runtime.from_dlpack(torch.randn(n, device="cuda", dtype=torch.float16))] if GELU else []
            args = [tvm.runtime.from_dlpack(a), tvm.runtime.from_dlpack(b), tvm.runtime.tensor(off, dev),
                    tvm.runtime.tensor(ids, dev), *bias, tvm.runtime.from_dlpack(c)]
            us = do_bench(lambda: kernels[cfg](*args), warmup=10, rep=40) * 1e3
            out.append(dict(k=k, n=n, bn=bn, stages=cfg.stages, count=cnt, us=round(us, 2)))
    for cnt in COUNTS:
        row = {r["bn"]: r["us"] for r in out if (r["k"], r["n"], r["count"]) == (k, n, cnt)}
        best = min(row, key=row.get)
        print(f"K={k} N={n} rows={cnt}: " + "  ".join(f"{bn}:{us:6.1f}" for bn, us in row.items())
              + f"  best {best}", flush=True)

path = os.path.join(os.environ.get("OUT", "/tmp"), "width_sweep_gelu.json" if GELU else "width_sweep.json")
json.dump(dict(device=torch.cuda.get_device_name(), m=M, results=out), open(path, "w"), indent=1)
print("wrote", path)
