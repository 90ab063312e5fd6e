"""Run one wgmma kernel a few times (a target for ncu): rows over COUNT random rows of 4096^3,
the tiles kernel over a 32x1 pattern at SPARSITY (micro-tile mk=1, with its compaction), or
the whole rows op (index kernels and both row-count tiers) at SPARSITY of rows.

    ncu ... python3 benchmarks/sweeps/ncu_wgmma.py rows 256x4 45
    ncu ... python3 benchmarks/sweeps/ncu_wgmma.py tiles 0.9
    ncu ... python3 benchmarks/sweeps/ncu_wgmma.py rows-op 0.9
"""
import argparse
import sys
import numpy as np, tvm
sys.path.insert(0, "benchmarks")
from pit_tvm.testing import rows_index
from common import tile_sparse
from pit_tvm.schedules.wgmma import WgmmaConfig, wgmma_row_gather_func
from pit_tvm.target import build

dev = tvm.cuda(0)
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("kernel", choices=["rows", "tiles", "rows-op"])
parser.add_argument("values", nargs="+", help="rows: BNxSTAGES COUNT; tiles, rows-op: SPARSITY")
ARGS = parser.parse_args()
argv = [None, ARGS.kernel, *ARGS.values]
rng = np.random.default_rng(0)
if argv[1] == "rows":
    cfg = WgmmaConfig(*(int(x) for x in argv[2].split("x")))
    m = k = n = 4096
    f = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, config=cfg)}), "cuda:sm_90a")["main"]
    nz = np.zeros(m, bool); nz[rng.choice(m, int(argv[3]), replace=False)] = True
    a = rng.standard_normal((m, k)).astype("float16"); b = rng.standard_normal((k, n)).astype("float16")
    args = [tvm.runtime.tensor(x, dev) for x in (a, b, *rows_index(nz))] + [tvm.runtime.empty((m, n), "float16", dev)]
    for _ in range(3):
        f(*args)
else:
    import pit_tvm
    m, k, n = 4096, 4096, 4096
    micro_tile = (32, 1) if argv[1] == "tiles" else (1, k)
    op = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=micro_tile, target="cuda")
    a = tile_sparse(m, k, micro_tile, float(argv[2]), "float16", rng)
    b = rng.standard_normal((k, n)).astype("float16")
    at, bt = tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev)
    for _ in range(3):
        op(at, bt)
dev.sync()
