"""Where a SparseMatmul call spends host time (rows, 4096^2 fp16, 99 % zero rows)."""
import sys, time, numpy as np, torch, tvm
sys.path.insert(0, "benchmarks")
import pit_tvm
from common import kernel_split_us
m = k = n = 4096
op = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=(1, k), target="cuda")
a = torch.randn(m, k, device="cuda", dtype=torch.float16)
a[torch.rand(m, device="cuda") < 0.99] = 0
b = torch.randn(k, n, device="cuda", dtype=torch.float16)
at, bt = tvm.runtime.from_dlpack(a), tvm.runtime.from_dlpack(b)
off, ids = op._index_buffers(m)
c = torch.empty(m, n, device="cuda", dtype=torch.float16); ct = tvm.runtime.from_dlpack(c)
def wall(fn, it=200):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(it): fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / it * 1e6
def host(fn, it=200):   # host time only: no sync inside
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(it): fn()
    d = (time.perf_counter() - t) / it * 1e6
    torch.cuda.synchronize(); return d
for name, fn in [("from_dlpack(a)", lambda: tvm.runtime.from_dlpack(a)),
                 ("torch.empty C", lambda: torch.empty(m, n, device="cuda", dtype=torch.float16)),
                 ("index call", lambda: op._index(at, off, ids)),
                 ("op(a, b)", lambda: op(a, b)),
                 ("op(at, bt, out=ct)", lambda: op(at, bt, out=ct))]:
    print(f"{name:<22} host {host(fn):8.1f} us   wall {wall(fn):8.1f} us")
print("device per op(a,b):", kernel_split_us(lambda: op(a, b)))
