"""Probe the tensor-core PIT row-gather matmul (pit_tvm.schedules.tensorcore) on a CUDA GPU.

    python benchmarks/gpu_tc_probe.py [--size 4096] [--k K --n N] [--sparsity 0 0.5 0.9] [--number 20]
                                      [--configs 128x128x32w64x32s3 ...] [--kernels]
                                      [--split-k auto|off|both]

For every config of ``valid_configs(K, N)`` (or of ``--configs``): build, check numerics against a float32 reference
(max relative error), time the kernel with ``time_evaluator`` (the whole PrimFunc: the
complement zero-fill kernel + the matmul kernel) at M=K=N=size, fp16 in, fp16 out, rows of A
zero at the given sparsities.  TF/s counts *useful* FLOPs only: 2 * count * K * N.  Also
times torch.matmul (cuBLAS, dense) when torch is importable.  ``--kernels`` adds the device time of
each kernel (zero-fill, matmul, split-K) from torch.profiler.  ``--split-k``: the workload with
the split-K path of ``split_plan`` (auto, as ``sparse_matmul`` builds it), without it, or both.  Prints a table; writes
``$OUT/tc_probe.json`` when OUT is set.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (kernel_split_us, main_evaluator, main_module, evaluator_median_ms,  # noqa: E402
                    parse_tc_config, row_sparse_inputs, run_checked, torch_matmul_ms,
                    write_out_json)


def main(argv=None):
    import tvm

    from pit_tvm.schedules.tensorcore import (
        TensorCoreConfig,
        build,
        row_gather_matmul_func,
        schedule_row_gather_matmul,
        smem_bytes,
        split_plan,
        valid_configs,
    )

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--k", type=int, default=None, help="K (default: --size); M is --size")
    p.add_argument("--n", type=int, default=None, help="N (default: --size)")
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    p.add_argument("--number", type=int, default=20)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out-dtype", default="float16")
    p.add_argument("--configs", nargs="+", default=None,
                   help="configs to probe instead of valid_configs, e.g. 128x128x32w64x32s3")
    p.add_argument("--kernels", action="store_true",
                   help="also report each kernel's device time (torch.profiler)")
    p.add_argument("--split-k", choices=("auto", "off", "both"), default="auto")
    args = p.parse_args(argv)
    m = args.size
    k, n = args.k or m, args.n or m
    dev = tvm.cuda(0)
    if not dev.exist:
        raise SystemExit("no CUDA device")
    rng = np.random.default_rng(0)
    data = {s: row_sparse_inputs(m, k, n, s, rng) for s in args.sparsity}
    refs = {}
    for s, (a, b, off, ids) in data.items():
        ref = np.zeros((m, n), np.float32)
        rows = ids[: off[1]]
        ref[rows] = a[rows].astype(np.float32) @ b.astype(np.float32)
        refs[s] = ref

    cublas = torch_matmul_ms(m, k, n, args.number)
    results = {"device": str(dev.device_name) if hasattr(dev, "device_name") else "cuda",
               "size": m, "k": k, "n": n, "out_dtype": args.out_dtype, "cublas_dense_ms": cublas,
               "cublas_dense_tflops": (2 * m * k * n / cublas / 1e9) if cublas else None,
               "rows": []}
    header = f"{'config':<44} {'smem':>6} {'sparsity':>8} {'ms':>9} {'TF/s':>7} {'relerr':>8}"
    print(header)
    print("-" * len(header))
    configs = ([parse_tc_config(c, TensorCoreConfig) for c in args.configs] if args.configs
               else valid_configs(k, n, "float16"))
    variants = {"auto": (True,), "off": (False,), "both": (False, True)}[args.split_k]
    for cfg, with_split in ((c, v) for c in configs for v in variants):
        split_k, split_rows = split_plan(k, n, cfg) if with_split else (1, 0)
        func = row_gather_matmul_func(k, n, "float16", args.out_dtype, split_k=split_k,
                                      split_rows=split_rows)
        name = (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.warp_m}x{cfg.warp_n} "
                f"s{cfg.stages}" + (f" split{split_k}x{split_rows}" if split_k > 1 else ""))
        t0 = time.time()
        try:
            ex = build(schedule_row_gather_matmul(func, cfg), "cuda")
            mod = main_module(ex)
            fev = main_evaluator(ex, dev, args.number, args.repeat)
        except Exception as err:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            results["rows"].append({"config": cfg.as_dict(), "error": repr(err)})
            print(f"{name:<44} BUILD FAILED: {err!r}"[:200])
            continue
        build_s = time.time() - t0
        for s, (a, b, off, ids) in data.items():
            row = {"config": cfg.as_dict(), "name": name, "sparsity": s,
                   "split_k": split_k, "split_rows": split_rows,
                   "smem_bytes": smem_bytes(cfg), "build_s": build_s}
            try:
                targs, err = run_checked(mod, dev, (a, b, off, ids), (m, n), args.out_dtype,
                                         refs[s])
                ms = evaluator_median_ms(fev, targs)
                useful = 2.0 * int(off[1]) * k * n
                row.update(ms=ms, tflops=useful / ms / 1e9, max_rel_err=err,
                           speedup_vs_cublas=(cublas / ms) if cublas else None)
                split = ""
                if args.kernels:
                    row["kernels_us"] = kernel_split_us(lambda: mod["main"](*targs))
                    split = "  " + ", ".join(f"{kn[-8:]} {us:.1f}us"
                                             for kn, us in row["kernels_us"].items())
                print(f"{name:<44} {smem_bytes(cfg) // 1024:>5}K {s:>8.2f} {ms:>9.4f} "
                      f"{row['tflops']:>7.1f} {err:>8.1e}{split}")
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row["error"] = repr(e)
                print(f"{name:<44} sparsity {s}: RUN FAILED {e!r}"[:200])
            results["rows"].append(row)
    if cublas:
        print(f"{'torch.matmul (cuBLAS, dense)':<44} {'':>6} {'-':>8} {cublas:>9.4f} "
              f"{results['cublas_dense_tflops']:>7.1f}")
    write_out_json("tc_probe.json", results)
    return results


if __name__ == "__main__":
    main()
