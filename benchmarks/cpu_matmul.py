"""PIT matmul vs the dense TVM kernel (same schedule) vs numpy on the CPU.

    python benchmarks/cpu_matmul.py [--size 1024] [--repeat 5]

Median of repeated runs, all in one process; PIT time includes the index built every call.
Writes docs/results/cpu_matmul.json and .png (or under $OUT).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, tile_sparse, write_results  # noqa: E402


def main(argv=None):
    import platform

    import tvm

    import pit_tvm
    from pit_tvm.ops.matmul import DenseMatmul
    from pit_tvm.timing import median_ms

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    n = args.size
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    b = rng.standard_normal((n, n)).astype(np.float32)
    b_t = tvm.runtime.tensor(b, dev)
    dense = DenseMatmul(n, n, "float32", "llvm")
    kinds = {"row 1xK": (1, n), "k 32x1": (32, 1), "block 32x64": (32, 64)}
    rows = []
    for kind, mt in kinds.items():
        op = pit_tvm.sparse_matmul(n, n, "float32", micro_tile=mt, target="llvm")
        for s in (0.0, 0.5, 0.9, 0.95, 0.99):
            a = tile_sparse(n, n, mt, s, np.float32, rng)
            a_t = tvm.runtime.tensor(a, dev)
            np.testing.assert_allclose(op(a_t, b_t).numpy(), a @ b, rtol=1e-3, atol=1e-3)
            t_pit = median_ms(lambda: op(a_t, b_t), dev, args.repeat, 1)
            t_dense = median_ms(lambda: dense(a_t, b_t), dev, args.repeat, 1)
            t_np = median_ms(lambda: a @ b, dev, args.repeat, 1)
            rows.append({"kind": kind, "sparsity": s, "pit_ms": t_pit, "dense_tvm_ms": t_dense,
                         "numpy_ms": t_np, "speedup_vs_dense_tvm": t_dense / t_pit})
            print_table(rows[-1:], list(rows[-1]))

    def plot(ax, rs):
        for kind in kinds:
            pts = [r for r in rs if r["kind"] == kind]
            ax.plot([r["sparsity"] for r in pts], [r["speedup_vs_dense_tvm"] for r in pts], "o-", label=f"PIT {kind}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("sparsity (fraction of zero micro-tiles)")
        ax.set_ylabel("speedup over dense TVM kernel")
        ax.set_yscale("log")
        ax.legend()

    env = environment(f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}")
    env["shape"] = f"M=K=N={n} float32"
    print("\nall rows:")
    print_table(rows, list(rows[0]))
    print("written:", *write_results("cpu_matmul", env, rows, plot))


if __name__ == "__main__":
    main()
