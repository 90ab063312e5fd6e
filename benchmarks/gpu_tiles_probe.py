"""Probe the tensor-core PIT tiles kernel (pit_tvm.schedules.tensorcore_tiles) on a CUDA GPU.

    python benchmarks/gpu_tiles_probe.py [--size 4096] [--k K --n N] [--micro-tiles 32x64 32x1]
                                         [--sparsity 0 0.5 0.9 0.99] [--number 20]

For every micro-tile and every config of ``valid_tiles_configs(K, N, micro_tile)``: build,
check numerics against a float32 reference (max relative error), time the kernel with
``time_evaluator`` at M=K=N=size, fp16 in, fp16 out, a fraction ``sparsity`` of the (mr, mk)
micro-tiles of A zero (uniformly at random).  The index (offsets, ids) is built on the host
(numpy reference) and is not timed.  Reports ms, *useful* TF/s (2 * nnz_tiles * mr * mk * N
FLOPs), dense-equivalent TF/s (2 * M * K * N / time) and the speedup over torch.matmul
(cuBLAS, dense) when torch is importable.  Prints a table; writes ``$OUT/tiles_probe.json``
when OUT is set.
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
from common import (main_evaluator, main_module, evaluator_median_ms, run_checked,  # noqa: E402
                    torch_matmul_ms, write_out_json)


def _inputs(m, k, n, micro_tile, sparsity, rng):
    from pit_tvm.index.tiles import reference_tile_index

    mr, mk = micro_tile
    keep = rng.random((-(-m // mr), k // mk)) >= sparsity
    mask = np.repeat(np.repeat(keep, mr, 0), mk, 1)[:m]
    a = (rng.standard_normal((m, k)).astype(np.float32) * mask).astype(np.float16)
    b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16)
    off, ids = reference_tile_index(mask, micro_tile, "row")
    return a, b, off, ids


def _ref(a, b):
    try:
        import torch

        if torch.cuda.is_available():
            at = torch.from_numpy(a.astype(np.float32)).cuda()
            bt = torch.from_numpy(b.astype(np.float32)).cuda()
            torch.backends.cuda.matmul.allow_tf32 = False
            return (at @ bt).cpu().numpy()
    except ImportError:
        pass
    return a.astype(np.float32) @ b.astype(np.float32)


def main(argv=None):
    import tvm

    from pit_tvm.schedules.tensorcore_tiles import (
        build,
        schedule_tiles_gather_matmul,
        needs_compact_a,
        tiles_gather_matmul_func,
        tiles_smem_bytes,
        valid_tiles_configs,
    )

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--micro-tiles", nargs="+", default=["32x64", "32x1"])
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.0, 0.5, 0.9, 0.99])
    p.add_argument("--number", type=int, default=20)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out-dtype", default="float16")
    p.add_argument("--max-configs", type=int, default=None)
    p.add_argument("--k", type=int, default=None, help="K (default: --size); M is --size")
    p.add_argument("--n", type=int, default=None, help="N (default: --size)")
    args = p.parse_args(argv)
    m = args.size
    k, n = args.k or m, args.n or m
    dev = tvm.cuda(0)
    if not dev.exist:
        raise SystemExit("no CUDA device")
    cublas = torch_matmul_ms(m, k, n, args.number)
    results = {"device": str(getattr(dev, "device_name", "cuda")), "size": m, "k": k, "n": n,
               "out_dtype": args.out_dtype, "cublas_dense_ms": cublas,
               "cublas_dense_tflops": (2 * m * k * n / cublas / 1e9) if cublas else None,
               "rows": []}
    header = (f"{'micro':>6} {'config':<22} {'smem':>5} {'spars':>5} {'ms':>8} {'useTF/s':>8} "
              f"{'dnsTF/s':>8} {'vsTorch':>7} {'relerr':>8}")
    print(header)
    print("-" * len(header))
    for mt_s in args.micro_tiles:
        mt = tuple(int(x) for x in mt_s.split("x"))
        rng = np.random.default_rng(0)
        data = {s: _inputs(m, k, n, mt, s, rng) for s in args.sparsity}
        refs = {s: _ref(a, b) for s, (a, b, _, _) in data.items()}
        # as sparse_matmul builds it: A gathered by its own kernel when mk is under 16 bytes
        compact = needs_compact_a(mt, "float16")
        func = tiles_gather_matmul_func(k, n, mt, "float16", args.out_dtype, a_compact=compact)
        cfgs = valid_tiles_configs(k, n, mt, "float16", a_compact=compact)[: args.max_configs]
        for cfg in cfgs:
            name = cfg.name()
            t0 = time.time()
            try:
                ex = build(schedule_tiles_gather_matmul(func, cfg), "cuda")
                mod = main_module(ex)
                fev = main_evaluator(ex, dev, args.number, args.repeat)
            except Exception as err:  # noqa: BLE001 - report and go on
                traceback.print_exc()
                results["rows"].append({"micro_tile": mt, "config": cfg.as_dict(),
                                        "error": repr(err)})
                print(f"{mt_s:>6} {name:<22} BUILD FAILED: {err!r}"[:200])
                continue
            build_s = time.time() - t0
            smem = tiles_smem_bytes(cfg, mt[0])
            for s, (a, b, off, ids) in data.items():
                nnz = int(off[-1])
                row = {"micro_tile": mt, "config": cfg.as_dict(), "name": name, "sparsity": s,
                       "nnz_tiles": nnz, "smem_bytes": smem, "build_s": build_s}
                try:
                    targs, err = run_checked(mod, dev, (a, b, off, ids), (m, n),
                                             args.out_dtype, refs[s])
                    ms = evaluator_median_ms(fev, targs)
                    useful = 2.0 * nnz * mt[0] * mt[1] * n
                    row.update(ms=ms, tflops=useful / ms / 1e9,
                               dense_equiv_tflops=2.0 * m * k * n / ms / 1e9, max_rel_err=err,
                               speedup_vs_torch=(cublas / ms) if cublas else None)
                    print(f"{mt_s:>6} {name:<22} {smem // 1024:>4}K {s:>5.2f} {ms:>8.4f} "
                          f"{row['tflops']:>8.1f} {row['dense_equiv_tflops']:>8.1f} "
                          f"{(cublas / ms) if cublas else float('nan'):>7.2f} {err:>8.1e}")
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row["error"] = repr(e)
                    print(f"{mt_s:>6} {name:<22} sparsity {s}: RUN FAILED {e!r}"[:200])
                results["rows"].append(row)
    if cublas:
        print(f"torch.matmul (cuBLAS, dense): {cublas:.4f} ms, "
              f"{results['cublas_dense_tflops']:.1f} TF/s")
    ok = [r for r in results["rows"] if "ms" in r]
    best = {}
    for r in ok:
        key = (f"{r['micro_tile'][0]}x{r['micro_tile'][1]}", r["sparsity"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    results["best"] = {f"{key[0]}@{key[1]}": {"name": r["name"], "ms": r["ms"],
                                               "tflops": r["tflops"],
                                               "max_rel_err": r["max_rel_err"]}
                       for key, r in best.items()}
    print("best per (micro-tile, sparsity):")
    for key, r in best.items():
        print(f"  {key[0]:>6} {key[1]:>5.2f}: {r['name']:<22} {r['ms']:.4f} ms "
              f"{r['tflops']:.1f} TF/s err {r['max_rel_err']:.1e}")
    write_out_json("tiles_probe.json", results)
    return results


if __name__ == "__main__":
    main()
