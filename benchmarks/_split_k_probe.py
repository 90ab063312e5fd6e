"""The split-K rows kernel (``wgmma_row_gather_func(max_splits=)``) against the rows kernels the
op runs today (the many-rows kernel and the few-rows tier, both launched, or the one kernel where
there is no tier), by listed-row count: device time per call (torch.profiler, L2 warm), outputs
checked against torch.  (Timed from Python with do_bench, a call of a few-rows kernel is bound by
the host's launch, not the GPU.)

    python3 benchmarks/_split_k_probe.py [--square]

``--square``: 4096^3 only.  BERT's shapes (2,400 of 4,096 rows) run with their epilogues.
"""
import sys

import numpy as np
import torch
import tvm

sys.path.insert(0, "tests")
sys.path.insert(0, "benchmarks")
from _helpers import rows_index  # noqa: E402
from common import kernel_split_us  # noqa: E402

from pit_tvm.schedules.wgmma import (BLOCK_M, SMS, WgmmaConfig, wgmma_config,  # noqa: E402
                                     wgmma_few_rows_tier, wgmma_row_gather_func)
from pit_tvm.target import build  # noqa: E402

TV = tvm.runtime.from_dlpack
dev = tvm.cuda(0)
square = "--square" in sys.argv
# (M, K, N, counts, epilogue)
shapes = [(4096, 4096, 4096, (41, 205, 410, 1024, 2048, 4096), {})]
if not square:
    shapes += [(4096, 3072, 768, (2400,), dict(bias=True, residual=True)),
               (4096, 768, 768, (2400,), dict(bias=True, residual=True)),
               (4096, 768, 3072, (2400,), dict(bias=True, gelu=True)),
               (4096, 768, 2304, (2400,), dict(bias=True))]


def built(func):
    return build(tvm.IRModule({"main": func}), "cuda:sm_90a")["main"]


def device_us(fn):
    return sum(kernel_split_us(fn, iters=20).values())


for (m, k, n, counts, epi) in shapes:
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    res = torch.randn(m, n, device="cuda", dtype=torch.float16)
    c = torch.empty(m, n, device="cuda", dtype=torch.float16)
    extra = [TV(bias)] if epi.get("bias") else []
    extra += [TV(res)] if epi.get("residual") else []
    ta, tb, tc = TV(a), TV(b), TV(c)
    print(f"{m}x{k}x{n} {epi} cuBLAS dense {device_us(lambda: torch.matmul(a, b)):6.1f} us", flush=True)
    for cnt in counts:
        cfg = wgmma_config(n, cnt)
        tier = wgmma_few_rows_tier(n, cfg, "float16", cnt)
        if tier is None:
            today = [built(wgmma_row_gather_func(k, n, config=cfg, **epi))]
        else:
            today = [built(wgmma_row_gather_func(k, n, config=cfg, rows_above=tier[0], **epi)),
                     built(wgmma_row_gather_func(k, n, config=tier[1], rows_upto=tier[0], **epi))]
        nz = np.zeros(m, bool)
        nz[np.random.default_rng(0).choice(m, cnt, replace=False)] = True
        off, ids = (tvm.runtime.tensor(x, dev) for x in rows_index(nz))
        s = torch.from_numpy(nz).cuda()
        v = a.float() @ b.float()
        if epi.get("bias"):
            v = v + bias.float()
        if epi.get("gelu"):
            v = torch.nn.functional.gelu(v)
        ref = torch.where(s[:, None], v, torch.zeros_like(v))
        if epi.get("bias") and not epi.get("gelu"):
            ref = torch.where(s[:, None], ref, bias.float().expand(m, n))
        elif epi.get("gelu"):
            ref = torch.where(s[:, None], ref, torch.nn.functional.gelu(bias.float()).expand(m, n))
        if epi.get("residual"):
            ref = (ref.half() + res).float()

        def err():
            torch.cuda.synchronize()
            return ((c.float() - ref).abs().max() / ref.abs().max()).item()

        def run_today():
            for f in today:
                f(ta, tb, off, ids, *extra, tc)

        c.fill_(7)
        run_today()
        line = f"  rows {cnt:5d}: today ({cfg.block_n}x{cfg.stages}{' + tier' if tier else ''}) " \
               f"{device_us(run_today):6.1f} us (err {err():.1e})"
        for bn, ms in ((256, 2), (256, 4), (128, 2), (128, 4)):
            if n % bn:
                continue
            sc = WgmmaConfig(bn, 4)
            f = built(wgmma_row_gather_func(k, n, config=sc, max_splits=ms, **epi))
            sem = tvm.runtime.tensor(np.zeros(SMS, np.int32), dev)
            part = tvm.runtime.empty((SMS * BLOCK_M * bn,), "float32", dev)

            def run_split():
                f(ta, tb, off, ids, *extra, sem, tc, part)

            c.fill_(7)
            run_split()
            e = err()
            t = device_us(run_split)
            left = int(np.abs(sem.numpy()).sum())
            line += f" | {bn}x4 s{ms} {t:6.1f} (err {e:.1e}{', SEM LEFT ' + str(left) if left else ''})"
        print(line, flush=True)
