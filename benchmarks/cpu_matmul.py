"""PIT matmul vs the dense TVM kernel (same schedule) vs numpy on the CPU.

    python benchmarks/cpu_matmul.py [--size 1024] [--repeat 5] [--dense-sizes 1024,2048,4096] [--threads N]

Median of repeated runs, all in one process; PIT time includes the index built every call.
The dense sweep compares the dense TVM kernel with numpy (OpenBLAS) at M=K=N for each of
``--dense-sizes``, in rounds (this box is shared): each round times one TVM call and one numpy
call.  Before every timed block the benchmark sleeps :data:`QUIET_S`: each library's idle
threads spin for a while after a call (OpenBLAS's for ~0.1 s) and slowed the other library's
next calls up to 2x.  It records which OpenBLAS kernel
numpy runs (threadpoolctl, where installed). ``--threads N`` runs both on N threads.
Writes docs/results/cpu_matmul.json and .png (or under $OUT; ``--name`` for another name).
"""
from __future__ import annotations

import argparse
import os
import sys


def _set_threads_and_blas_env(argv):
    """Before numpy loads OpenBLAS: unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE (set on some
    machines, they pick another kernel than the CPU's own and slow numpy) and, with
    ``--threads N``, fix both libraries' thread counts."""
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        os.environ.pop(var, None)
    if "--threads" in argv:
        n = argv[argv.index("--threads") + 1]
        os.environ["TVM_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = n


_set_threads_and_blas_env(sys.argv)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, tile_sparse, write_results  # noqa: E402


#: seconds of sleep before each timed block (module docstring)
QUIET_S = 0.3


def quiet_median_ms(fn, dev, repeat: int) -> float:
    """``median_ms`` of ``fn`` after :data:`QUIET_S` of sleep (the other library's threads idle)"""
    import time  # noqa: PLC0415

    from pit_tvm.timing import median_ms  # noqa: PLC0415

    time.sleep(QUIET_S)
    return median_ms(fn, dev, repeat, 1)


def blas_info() -> list:
    """numpy's BLAS as threadpoolctl sees it (library, kernel architecture, threads)."""
    try:
        import threadpoolctl  # noqa: PLC0415
    except ImportError:
        return [{"threadpoolctl": "not installed"}]
    return [{k: v for k, v in info.items() if k in ("internal_api", "version", "architecture", "num_threads")}
            for info in threadpoolctl.threadpool_info() if info.get("user_api") == "blas"]


def dense_sweep(sizes, repeat: int, rng) -> list[dict]:
    """Dense TVM kernel vs numpy at M=K=N in ``sizes``, in rounds (module docstring), medians."""
    import statistics  # noqa: PLC0415
    import time  # noqa: PLC0415

    import tvm  # noqa: PLC0415

    from pit_tvm.ops.matmul import DenseMatmul  # noqa: PLC0415

    rows = []
    for n in sizes:
        a = rng.standard_normal((n, n)).astype(np.float32)
        b = rng.standard_normal((n, n)).astype(np.float32)
        dense = DenseMatmul(n, n, "float32", "llvm")
        a_t, b_t = tvm.runtime.tensor(a), tvm.runtime.tensor(b)
        c_t = tvm.runtime.empty((n, n), "float32")
        dense(a_t, b_t, c_t)
        np.testing.assert_allclose(c_t.numpy(), a @ b, rtol=1e-3, atol=1e-2 * np.sqrt(n))
        times = {"tvm": [], "numpy": []}
        for _ in range(repeat):
            for name, fn in (("tvm", lambda: dense(a_t, b_t, c_t)), ("numpy", lambda: a @ b)):
                time.sleep(QUIET_S)
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e3)
        t_tvm, t_np = statistics.median(times["tvm"]), statistics.median(times["numpy"])
        rows.append({"kind": "dense", "size": n, "dense_tvm_ms": t_tvm, "numpy_ms": t_np,
                     "tvm_gflops": 2 * n**3 / t_tvm / 1e6, "numpy_gflops": 2 * n**3 / t_np / 1e6,
                     "tvm_over_numpy": t_tvm / t_np})
        print_table(rows[-1:], list(rows[-1]))
    return rows


def main(argv=None):
    import platform

    import tvm

    import pit_tvm
    from pit_tvm.ops.matmul import DenseMatmul
    from pit_tvm.timing import median_ms

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dense-sizes", default="1024,2048,4096", help="M=K=N of the dense sweep (comma list, '' for none)")
    p.add_argument("--threads", type=int, help="threads of TVM and OpenBLAS (default: theirs)")
    p.add_argument("--name", default="cpu_matmul", help="results name")
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
            t_pit, t_dense, t_np = (quiet_median_ms(fn, dev, args.repeat) for fn in (
                lambda: op(a_t, b_t), lambda: dense(a_t, b_t), lambda: a @ b))
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

    dense_rows = dense_sweep([int(x) for x in args.dense_sizes.split(",") if x.strip()], args.repeat, rng)
    env = environment(f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}")
    env["shape"] = f"M=K=N={n} float32"
    env["blas"] = blas_info()
    env["threads"] = args.threads or "default"
    env["command"] = "python benchmarks/cpu_matmul.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print("\nall rows:")
    print_table(rows, list(rows[0]))
    if dense_rows:
        print_table(dense_rows, list(dense_rows[0]))
    print("written:", *write_results(args.name, env, rows + dense_rows, plot))


if __name__ == "__main__":
    main()
