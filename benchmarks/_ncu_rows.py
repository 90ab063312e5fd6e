"""Run the rows TC kernel a few times (a target for ncu).

    ncu ... python3 benchmarks/_ncu_rows.py 128x128x32w64x64s3 0.99 [--split]
"""
import sys, numpy as np, tvm
sys.path.insert(0, "benchmarks")
from common import parse_tc_config, row_sparse_inputs
from pit_tvm.schedules.tensorcore import TensorCoreConfig, row_gather_matmul_func, schedule_row_gather_matmul, build, split_plan
cfg = parse_tc_config(sys.argv[1], TensorCoreConfig)
s = float(sys.argv[2])
sk, sr = split_plan(4096, 4096, cfg) if "--split" in sys.argv[3:] else (1, 0)
ex = build(schedule_row_gather_matmul(row_gather_matmul_func(4096, 4096, "float16", "float16", split_k=sk, split_rows=sr), cfg), "cuda")
mod = ex.jit() if hasattr(ex, "jit") else ex.mod
dev = tvm.cuda(0)
a, b, off, ids = row_sparse_inputs(4096, 4096, 4096, s, np.random.default_rng(0))
args = [tvm.runtime.tensor(x, dev) for x in (a, b, off, ids)] + [tvm.runtime.empty((4096, 4096), "float16", dev)]
for _ in range(3):
    mod["main"](*args)
dev.sync()
