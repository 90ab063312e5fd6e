"""Programmatic dependent launch (PDL) probe: chains of dense wgmma GEMMs in one Relax function
(BERT's shapes: 4096 rows, K = N = 768; and FFN pairs 768 -> 3072 -> 768), each built by
``pit_tvm.target.build`` with its kernels launched with PDL (as :func:`pit_tvm.schedules.wgmma.lower_tirx`
lowers them on sm_90) and without (the same kernels lowered without
:func:`pit_tvm.schedules.dependent_launch.with_dependent_launch`); median wall time of the chain
over its kernels, and whether the outputs are bit-identical.

    python3 benchmarks/sweeps/pdl_probe.py [CHAIN_LENGTH]   (default 48)
"""
import argparse

import numpy as np
import tvm
from tvm import relax

import pit_tvm.schedules.wgmma as wgmma
from pit_tvm.schedules.dependent_launch import launches_dependent
from pit_tvm.target import build
from pit_tvm.timing import median_ms

from pit_tvm.testing import gemm_chain_module

M = 4096


def gemm_kernel(k, n, pdl):
    """the dense wgmma kernel of ``k x n``, lowered with PDL or (``pdl=False``) without it"""
    wgmma.wgmma_row_gather_func.cache_clear()
    lower_with_pdl = wgmma.with_dependent_launch
    if not pdl:
        wgmma.with_dependent_launch = lambda func: func
    try:
        kernel = wgmma.wgmma_row_gather_func(k, n, dense=True)
    finally:
        wgmma.with_dependent_launch = lower_with_pdl
        wgmma.wgmma_row_gather_func.cache_clear()
    assert launches_dependent(kernel) == pdl
    return kernel


def chain_exe(widths, pdl):
    """one Relax function x -> x @ W_0 @ W_1 ..., widths = [K_0, N_0 = K_1, ...], each distinct
    GEMM lowered once"""
    kernels = {}

    def kernel_of(k, n):
        if (k, n) not in kernels:
            kernels[(k, n)] = gemm_kernel(k, n, pdl)
        return kernels[(k, n)]

    mod = gemm_chain_module(M, widths, kernel_of)
    ex = build(mod, tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    return relax.VirtualMachine(ex, tvm.cuda())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chain_length", nargs="?", type=int, default=48)
    length = parser.parse_args().chain_length
    dev = tvm.cuda()
    rng = np.random.default_rng(0)
    for name, widths in [("K=N=768", [768] * (length + 1)), ("768->3072->768", [768, 3072] * (length // 2) + [768])]:
        x = tvm.runtime.tensor(rng.standard_normal((M, widths[0])).astype(np.float16), dev)
        ws = [tvm.runtime.tensor((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16), dev)
              for k, n in zip(widths, widths[1:])]
        results = {}
        for pdl in (False, True, False, True):
            vm = chain_exe(widths, pdl)
            out = vm["main"](x, *ws)
            ms = median_ms(lambda: vm["main"](x, *ws), dev, repeat=30)
            results.setdefault(pdl, []).append(ms * 1e3 / (len(widths) - 1))
            if pdl:
                same = np.array_equal(out.numpy(), ref)
                print(f"  outputs equal with and without PDL: {same}", flush=True)
            else:
                ref = out.numpy()
        print(f"{name}: us per GEMM without PDL {results[False]}, with PDL {results[True]}", flush=True)


if __name__ == "__main__":
    main()
