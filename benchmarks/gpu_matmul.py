"""PIT matmul (this stage's SIMT schedule) vs cuBLAS and torch gather->mm->scatter on a GPU.

    python benchmarks/gpu_matmul.py [--size 4096] [--repeat 20]

fp16 in, fp16 out, M=K=N=size, random patterns at the micro-tile granularity. PIT total =
index build + dense-fallback check + kernel, every call; "index" times the index alone.
All peers run in this process. Writes gpu_matmul.json/.png under docs/results/ (or $OUT).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, tile_sparse, write_results  # noqa: E402


def main(argv=None):
    import torch
    import tvm

    import pit_tvm
    from pit_tvm.timing import median_ms

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args(argv)
    n = args.size
    dev = tvm.cuda(0)
    rng = np.random.default_rng(0)
    b = torch.from_numpy(rng.standard_normal((n, n)).astype(np.float16)).cuda()
    b_t = tvm.runtime.from_dlpack(b)
    kinds = {"row 1xK": (1, n), "block 32x64": (32, 64), "k 32x1": (32, 1)}
    rows = []
    for kind, mt in kinds.items():
        op = pit_tvm.sparse_matmul(n, n, "float16", micro_tile=mt, target="cuda")
        for s in (0.0, 0.5, 0.9, 0.99):
            a = torch.from_numpy(tile_sparse(n, n, mt, s, np.float16, rng)).cuda()
            a_t = tvm.runtime.from_dlpack(a)
            c = torch.from_dlpack(op(a_t, b_t))
            ref = a.float() @ b.float()
            err = float((c.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
            t_pit = median_ms(lambda: op(a_t, b_t), dev, args.repeat)
            t_index = median_ms(lambda: op.index(a_t), dev, args.repeat)
            t_cublas = median_ms(lambda: torch.matmul(a, b), dev, args.repeat)

            def gather_mm_scatter():
                idx = a.abs().amax(1).nonzero().squeeze(1)      # host sync, as the peer needs
                out = torch.zeros_like(a[:, :n])
                out[idx] = a[idx] @ b
                return out

            t_gms = median_ms(gather_mm_scatter, dev, args.repeat)
            rows.append({"kind": kind, "sparsity": s, "pit_total_ms": t_pit, "pit_index_ms": t_index,
                         "cublas_ms": t_cublas, "torch_gather_mm_scatter_ms": t_gms,
                         "pit_speedup_vs_cublas": t_cublas / t_pit, "max_rel_err": err})
            print_table(rows[-1:], list(rows[-1]))

    def plot(ax, rs):
        for kind in kinds:
            pts = [r for r in rs if r["kind"] == kind]
            ax.plot([r["sparsity"] for r in pts], [r["pit_speedup_vs_cublas"] for r in pts], "o-", label=f"PIT {kind}")
        ax.axhline(1.0, color="gray", lw=0.8, label="cuBLAS dense")
        ax.set_xlabel("sparsity")
        ax.set_ylabel("speedup over cuBLAS (higher is better)")
        ax.set_yscale("log")
        ax.legend()

    env = environment(torch.cuda.get_device_name(0))
    env["shape"] = f"M=K=N={n} float16"
    print_table(rows, list(rows[0]))
    print("written:", *write_results("gpu_matmul_baseline", env, rows, plot))


if __name__ == "__main__":
    main()
