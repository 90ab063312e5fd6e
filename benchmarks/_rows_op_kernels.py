"""Device time of each kernel of the 4096^3 rows op (the index's two kernels, both row-count
tiers) with L2 flushed before every call, from torch.profiler (CUPTI sees TVM's launches).

    python3 benchmarks/_rows_op_kernels.py [SPARSITY ...]   (default 0.5 0.9 0.99)
"""
import sys
import numpy as np, torch, tvm
import pit_tvm
from torch.profiler import profile, ProfilerActivity

m = k = n = 4096
op = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=(1, k), target="cuda")
b = torch.randn(k, n, device="cuda", dtype=torch.float16)
flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
for s in [float(x) for x in (sys.argv[1:] or ["0.5", "0.9", "0.99"])]:
    rng = np.random.default_rng(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    a[torch.from_numpy(rng.permutation(m)[: int(round(s * m))]).cuda()] = 0
    a_t, b_t = tvm.runtime.from_dlpack(a), tvm.runtime.from_dlpack(b)
    for _ in range(3):
        op(a_t, b_t)
    torch.cuda.synchronize()
    reps = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            op(a_t, b_t)
        torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and "elementwise" not in e.name and "fill" not in e.name.lower():
            times.setdefault(e.name, []).append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
    line = f"s={s}: " + "  ".join(f"{name[:60]} {np.median(v):.1f}us x{len(v) // reps}" for name, v in times.items())
    print(line, flush=True)
