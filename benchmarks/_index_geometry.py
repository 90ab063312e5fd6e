"""Probe: device time of the one-kernel rows index (4096 x 4096 fp16, L2 flushed) for other CTA
geometries (warps per CTA, rows per warp), beside torch's own read-bound kernels, and the rows
op's kernels at high sparsity.

    python3 benchmarks/_index_geometry.py
"""
import dataclasses
import sys

import numpy as np
import torch
import tvm

import pit_tvm
from pit_tvm.index import _tile_kernels as tk
from pit_tvm.index import tiles

sys.path.insert(0, "benchmarks")
from common import kernel_split_us  # noqa: E402

m = k = n = 4096
flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
base_geometry = tk.flag_geometry


def rows_a(s):
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    a[torch.from_numpy(np.random.default_rng(0).permutation(m)[: int(round(s * m))]).cuda()] = 0
    return a


def split(fn):
    return kernel_split_us(lambda: (flush.zero_(), fn()))


a = rows_a(0.5)
c = torch.empty_like(a)
for name, fn in [("amax", lambda: a.amax()), ("count_nonzero", lambda: torch.count_nonzero(a)),
                 ("zero_", lambda: c.zero_()), ("copy_", lambda: c.copy_(a))]:
    print(name, {kk: round(v, 1) for kk, v in split(fn).items() if "fill" not in kk or name == "zero_"}, flush=True)

for wpb, u in [(8, 1), (4, 1), (16, 1), (8, 2), (4, 2), (8, 4), (4, 4)]:
    def geometry(cols, mr, mc, dtype, _u=u):
        g = base_geometry(cols, mr, mc, dtype)
        upb = tk.WPB * _u * g.tpw
        chc = max(tk.CHC_MIN, upb * g.tpv)
        return dataclasses.replace(g, u=_u, upb=upb, fpb=upb * g.tpv, chc=chc, fb=chc // (upb * g.tpv))
    tk.WPB = wpb
    tk.flag_geometry = geometry
    func = tiles._tile_index_func(k, (1, k), "col", "float16", "cuda", density_threshold=0.9)
    b = tiles.IndexBuilder(func, "cuda")
    for s in (0.5, 0.9):
        a = rows_a(s)
        at = tvm.runtime.from_dlpack(a)
        off, ids = b(at)
        listed = int(off.numpy()[1])
        want = int((a != 0).any(1).sum())
        got = sorted(ids.numpy()[:listed].tolist())
        ok = got == torch.nonzero((a != 0).any(1)).flatten().tolist() and listed == want
        t = split(lambda: b(at))
        print(f"WPB={wpb} u={u} s={s}: ok={ok}", {kk[:40]: round(v, 1) for kk, v in t.items() if "index" in kk}, flush=True)
tk.WPB = 8
tk.flag_geometry = base_geometry

op = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=(1, k), target="cuda")
bt = tvm.runtime.from_dlpack(torch.randn(k, n, device="cuda", dtype=torch.float16))
for s in (0.5, 0.9, 0.95, 0.99):
    at = tvm.runtime.from_dlpack(rows_a(s))
    t = split(lambda: op(at, bt))
    print(f"rows op s={s}:", {kk[:48]: round(v, 1) for kk, v in t.items()}, flush=True)
