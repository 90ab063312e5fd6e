"""Programmatic dependent launch (PDL) probe: chains of dense wgmma GEMMs in one Relax function
(BERT's shapes: 4096 rows, K = N = 768; and FFN pairs 768 -> 3072 -> 768), built by
``pit_tvm.target.build`` (every kernel launched with PDL, :mod:`pit_tvm.passes.dependent_launch`)
or by ``tvm.compile`` (TVM's own TIR pipeline: launched plainly); median wall time of the chain
over its kernels.

    python3 benchmarks/_pdl_probe.py [CHAIN_LENGTH]   (default 48)
"""
import sys

import numpy as np
import tvm
from tvm import relax

from pit_tvm.schedules.wgmma import wgmma_row_gather_func
from pit_tvm.target import build
from pit_tvm.timing import median_ms

M = 4096


def chain_exe(widths, pdl):
    """one Relax function x -> x @ W_0 @ W_1 ..., widths = [K_0, N_0 = K_1, ...]"""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((M, widths[0]), "float16"))
    ws = [relax.Var(f"w{i}", relax.TensorType((k, n), "float16")) for i, (k, n) in enumerate(zip(widths, widths[1:]))]
    with bb.function("main", [x] + ws):
        with bb.dataflow():
            h = x
            for w, (k, n) in zip(ws, zip(widths, widths[1:])):
                kernel = wgmma_row_gather_func(k, n, dense=True).with_attr("global_symbol", f"gemm_{k}_{n}")
                gv = bb.add_func(kernel, f"gemm_{k}_{n}")
                h = bb.emit(relax.call_tir(gv, [h, w], relax.TensorType((M, n), "float16")))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    ex = build(bb.get(), target) if pdl else tvm.compile(bb.get(), target=target)
    return relax.VirtualMachine(ex, tvm.cuda())


def main():
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 48
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
