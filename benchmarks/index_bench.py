"""Index build time on a GPU vs one read of the sparse tensor at memory bandwidth.

    python benchmarks/index_bench.py [--sizes 4096 8192] [--repeat 200] [--no-op]

For each size n (A is n x n fp16), sparsity 0.5/0.9/0.99 and micro-tile (1,K), (1,64), (32,1),
(32,64) (index group/micro-tile as ``SparseMatmul`` uses them, density_threshold 0.9 folded in):

* ``kernel_us``: the index PrimFunc alone, ``time_evaluator`` (device time, no Python; calls back
  to back, so A is partly in L2: the L2-swept index time is ``benchmarks/gpu_matmul.py``'s);
* ``op_index_us``: ``op.index(a)`` (output allocation + call), median of single calls with a
  device sync after each (what the first measurements reported); the op's index is the one its
  kernel reads (``op_index_micro_tile``: on sm_90a micro-tiles along K are covered by 128-row
  strips), and
  ``op_index_loop_us``: the same call issued back to back (Python cost overlaps the GPU);
* ``copy_us``: a torch device-to-device copy of A (reads n*n*2 bytes and writes as many):
  ``read_us = copy_us / 2`` is the time to read A once at the copy's bandwidth, and
  ``peak_read_us`` the same at 3.35 TB/s (H100 SXM HBM3). Target: kernel_us <= 1.3 x read_us.

Each index (the kernel's and the op's) is checked against the numpy reference first (``ok``).
Prints a table and writes
index_bench.json/.png under docs/results/ (or $OUT).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import environment, print_table, tile_sparse, write_results  # noqa: E402

HBM_PEAK = 3.35e12
THRESHOLD = 0.9


def _events_us(fn, iters, torch):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _median_sync_us(fn, dev, iters):
    for _ in range(5):
        fn()
    dev.sync()
    s = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        dev.sync()
        s.append((time.perf_counter() - t) * 1e6)
    return float(np.median(s))


def _same_index(offsets, ids, want_offsets, want_ids, group):
    """the index lists the reference's micro-tiles per group (a one-group index lists them in
    the order its CTAs finish, which its permutation-invariant consumers ignore)"""
    from pit_tvm.index import tiles_from_index

    def listed(o, i):
        return sorted(map(tuple, tiles_from_index(o, i, group).tolist()))
    return bool(np.array_equal(np.asarray(offsets.numpy()), want_offsets)
                and listed(offsets, ids) == listed(want_offsets, want_ids))


def _expected(data, mt, group, thr):
    from pit_tvm.index import reference_tile_index

    ro, ri = reference_tile_index(data, mt, group)
    cap, groups = len(ri), len(ro) - 1
    if thr is not None and cap and float(ro[-1]) > thr * cap:
        per = cap // groups
        ro = (np.arange(groups + 1) * per).astype(np.int32)
        ri = (np.arange(cap) % per).astype(np.int32)
    return ro, ri


def main(argv=None):
    import torch
    import tvm

    from pit_tvm.index import IndexBuilder, tile_index_func
    from pit_tvm.ops.matmul import MatmulPlan, SparseMatmul
    from pit_tvm.target import build

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--sparsities", type=float, nargs="+", default=[0.5, 0.9, 0.99])
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--no-op", action="store_true", help="skip SparseMatmul (no matmul kernel builds)")
    p.add_argument("--density-threshold", type=float, default=THRESHOLD, help="negative: None")
    args = p.parse_args(argv)
    thr = None if args.density_threshold < 0 else args.density_threshold
    dev = tvm.cuda(0)
    rng = np.random.default_rng(0)
    rows = []
    for n in args.sizes:
        a_dummy = torch.empty((n, n), dtype=torch.float16, device="cuda")
        b_dummy = torch.empty_like(a_dummy)
        copy_us = _events_us(lambda: b_dummy.copy_(a_dummy), args.repeat, torch)
        read_us = copy_us / 2
        peak_us = n * n * 2 / HBM_PEAK * 1e6
        print(f"n={n}: d2d copy {copy_us:.2f} us ({2 * n * n * 2 / copy_us / 1e6:.0f} GB/s) -> read {read_us:.2f} us;"
              f" peak read {peak_us:.2f} us", flush=True)
        for mt in [(1, n), (1, 64), (32, 1), (32, 64)]:
            plan = MatmulPlan(n, n, mt)
            imt, group = plan.index_micro_tile, plan.index_group
            t0 = time.time()
            f = tile_index_func(n, imt, group, "float16", "cuda", density_threshold=thr)
            name = "pit_index"
            ex = build(tvm.IRModule({name: f.with_attr("global_symbol", name)}), "cuda")
            mod = ex.jit() if hasattr(ex, "jit") else ex.mod
            fev = mod.time_evaluator(name, dev, number=args.repeat, repeat=5)
            builder = IndexBuilder(f, "cuda")
            op = None
            if not args.no_op:
                op = SparseMatmul(n, n, "float16", mt, "cuda", density_threshold=thr)
            print(f"  built {mt} ({group}, index tile {imt}) in {time.time() - t0:.1f}s", flush=True)
            for s in args.sparsities:
                data = tile_sparse(n, n, mt, s, np.float16, rng)
                a = torch.from_numpy(data).cuda()
                a_t = tvm.runtime.from_dlpack(a)
                offsets, ids = builder(a_t)
                ro, ri = _expected(data, imt, group, thr)
                ok = _same_index(offsets, ids, ro, ri, group)
                op_tile = None
                if op is not None:
                    # the op builds the index its kernel reads: on sm_90a the wgmma tiles kernel
                    # covers micro-tiles along K by 128-row strips (op.kernel_plan)
                    kp = op.kernel_plan
                    op_tile = f"{kp.index_micro_tile[0]}x{kp.index_micro_tile[1]}"
                    ro2, ri2 = _expected(data, kp.index_micro_tile, kp.index_group, thr)
                    o2, i2 = op.index(a_t)
                    ok = ok and _same_index(o2, i2, ro2, ri2, kp.index_group)
                # (a one-group index also takes its device counter, which every call leaves zero)
                state = [] if builder.state is None else [builder.state]
                kernel_us = float(np.median(fev(a_t, *state, offsets, ids).results)) * 1e6
                call = (lambda: op.index(a_t)) if op is not None else (lambda: builder(a_t))
                op_us = _median_sync_us(call, dev, min(args.repeat, 100))
                loop_us = _events_us(call, args.repeat, torch)
                row = {"n": n, "micro_tile": f"{mt[0]}x{'K' if mt[1] == n else mt[1]}", "group": group,
                       "sparsity": s, "tiles": int(len(ri)), "nonzero_tiles": int(ro[-1]) if len(ro) else 0,
                       "op_index_micro_tile": op_tile,
                       "kernel_us": kernel_us, "op_index_us": op_us, "op_index_loop_us": loop_us,
                       "copy_us": copy_us, "read_us": read_us, "peak_read_us": peak_us,
                       "kernel_vs_read": kernel_us / read_us, "kernel_vs_peak_read": kernel_us / peak_us,
                       "ok": ok}
                rows.append(row)
                print_table([row], list(row))
                sys.stdout.flush()

    cols = ["n", "micro_tile", "sparsity", "kernel_us", "op_index_us", "op_index_loop_us", "read_us",
            "kernel_vs_read", "kernel_vs_peak_read", "ok"]
    print()
    print_table(rows, cols)

    def plot(ax, rs):
        labels = [f"{r['n']} {r['micro_tile']} s={r['sparsity']}" for r in rs]
        x = np.arange(len(rs))
        ax.bar(x - 0.2, [r["kernel_vs_read"] for r in rs], 0.4, label="index kernel / one read of A")
        ax.bar(x + 0.2, [r["op_index_us"] / r["read_us"] for r in rs], 0.4, label="op.index(a) / one read of A")
        ax.axhline(1.3, color="red", lw=0.8, label="target 1.3x")
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
        ax.set_ylabel("time / read time")
        ax.legend(fontsize=7)

    env = environment(torch.cuda.get_device_name(0))
    env["dtype"] = "float16"
    env["density_threshold"] = thr
    print("written:", *write_results("index_bench", env, rows, plot))
    if not all(r["ok"] for r in rows):
        print("MISMATCH against the numpy reference:", [(r["n"], r["micro_tile"], r["sparsity"]) for r in rows
                                                        if not r["ok"]])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
