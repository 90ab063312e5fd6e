"""Tune the shipped tensor-core PIT matmul logs on a GPU (the benchmark shapes).

    python3 benchmarks/tune_h100.py [--sizes 4096 8192] [--trials 64 64] [--targets cuda cuda:sm_90]
                                    [--micro-tiles rows 32x64 32x1 1x64] [--out DIR]

For each size S and target: ``tune_matmul(S, S, "float16", target, trials)`` (rows kind, tuning
M = S + 8, every row listed) into ``DIR/tuning_logs/<gpu>/``: for ``cuda`` (sm_90a) the wgmma
kernel's space (``wgmma_matmul_kS_nS_float16/``), for ``cuda:sm_90`` the mma.sync schedule's
(``matmul_kS_nS_float16/``).  Then the log's kernel (mma.sync: ``load_best``, the symbolic-M
kernel with the early exit re-applied; wgmma: the kernel of the best config) is checked against
numpy (M = 1000, 60 % zero rows) and timed at M = S (all rows listed) next to the untuned
default (mma.sync: the first valid config; wgmma: the config planned without a log).

A micro-tile along K (``32x64``, ``32x1``, ``1x64``) tunes the tiles kernel the target runs for
it (``cuda``: the wgmma tiles kernel in 128-row strips, so 1x64 and 32x64 share one log;
``cuda:sm_90``: the mma.sync tiles schedule) with half of each strip's micro-tiles listed; then
the op (``sparse_matmul`` with the log, index included) is checked against numpy and timed
next to the op without it on random micro-tile patterns at 50 % and 90 % sparsity.  Writes
``DIR/tune_summary.json`` and prints one line per (size, target, micro-tile).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import evaluator_median_ms, main_evaluator, row_sparse_inputs  # noqa: E402


def _inputs(m, k, n, sparsity, seed=0):
    return row_sparse_inputs(m, k, n, sparsity, np.random.default_rng(seed))


def _check_and_time(func, default_func, size, number=20, repeat=5):
    import tvm

    from pit_tvm.schedules.tensorcore import build

    dev = tvm.cuda(0)
    out = {}
    ex = build(func, "cuda")
    # numerics (fp16 in, fp16 out) on a ragged M with 60 % zero rows
    a, b, off, ids = _inputs(1000, size, size, 0.6, seed=1)
    t = lambda x: tvm.runtime.tensor(x, dev)  # noqa: E731
    c = t(np.full((1000, size), np.nan, np.float16))
    ex["main"](t(a), t(b), t(off), t(ids), c)
    got = c.numpy().astype(np.float32)
    rows = ids[: off[1]]
    ref = np.zeros_like(got)
    ref[rows] = a[rows].astype(np.float32) @ b.astype(np.float32)
    scale = float(np.abs(ref).max()) or 1.0
    out["max_rel_err"] = float(np.nanmax(np.abs(got - ref)) / scale)
    out["nan"] = bool(np.isnan(got).any())
    # timing at M = size, every row listed
    a, b, off, ids = _inputs(size, size, size, 0.0, seed=2)
    args = [t(a), t(b), t(off), t(ids), t(np.zeros((size, size), np.float16))]
    for name, f in (("tuned", ex), ("default", build(default_func, "cuda"))):
        ms = evaluator_median_ms(main_evaluator(f, dev, number, repeat), args)
        out[f"{name}_ms"] = ms
        out[f"{name}_tflops"] = 2.0 * size ** 3 / (ms * 1e-3) / 1e12
    return out


def _check_and_time_op(size, micro_tile, target, root, sparsities=(0.5, 0.9), iters=50):
    """the tiles op with the log (``tuned``) and without it (``default``): max relative error
    against numpy (size <= 4096; above, against the default op) and the device time of a call
    (every kernel it launches, index included, from the profiler: wall times of one op drifted
    by 1.6x between two identical kernels)"""
    import tvm

    import pit_tvm
    from common import kernel_split_us, tile_sparse

    dev = tvm.cuda(0)
    ops = {"tuned": pit_tvm.sparse_matmul(size, size, "float16", micro_tile, target, tuning_log=root),
           "default": pit_tvm.sparse_matmul(size, size, "float16", micro_tile, target)}
    rng = np.random.default_rng(3)
    b = (rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float16)
    b_t = tvm.runtime.tensor(b, dev)
    out = {}
    for s in sparsities:
        a = tile_sparse(size, size, micro_tile, s, np.float16, rng)
        a_t = tvm.runtime.tensor(a, dev)
        got = {name: op(a_t, b_t).numpy().astype(np.float32) for name, op in ops.items()}
        ref = a.astype(np.float32) @ b.astype(np.float32) if size <= 4096 else got["default"]
        scale = float(np.abs(ref).max()) or 1.0
        out[f"max_rel_err_s{int(s * 100)}"] = float(np.abs(got["tuned"] - ref).max() / scale)
        for name, op in ops.items():
            out[f"{name}_device_us_s{int(s * 100)}"] = sum(kernel_split_us(lambda op=op: op(a_t, b_t), iters).values())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--trials", type=int, nargs="+", default=[64, 64])
    p.add_argument("--targets", nargs="+", default=["cuda", "cuda:sm_90"],
                   help="cuda (sm_90a: the wgmma kernel) and / or cuda:sm_90 (the mma.sync schedule)")
    p.add_argument("--micro-tiles", nargs="+", default=["rows"],
                   help="rows (whole rows) and / or micro-tiles along K: RxC, e.g. 32x64 32x1 1x64")
    p.add_argument("--trials-per-iter", type=int, default=32)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--check-only", metavar="ROOT", default=None,
                   help="no tuning: check and time the best records of the logs under ROOT (e.g. tuning_logs)")
    args = p.parse_args(argv)
    trials = (args.trials * len(args.sizes))[: len(args.sizes)] if len(args.trials) == 1 \
        else args.trials
    from dataclasses import asdict

    from pit_tvm.schedules.tensorcore import (row_gather_matmul_func, schedule_row_gather_matmul,
                                              valid_configs)
    from pit_tvm.schedules.wgmma import wgmma_config, wgmma_row_gather_func
    from pit_tvm.cli.compile import parse_micro_tile
    from pit_tvm.tuning.tune import (best_record, gpu_name, kernel_micro_tile, load_best, tune_matmul,
                                     tuned_kernel)

    root = args.check_only or os.path.join(args.out, "work", "tuning_logs")
    summary = {"gpu": gpu_name(), "results": []}
    done = set()
    for (size, n_trials), target, mt_text in [(st, tg, mt) for st in zip(args.sizes, trials) for tg in args.targets
                                              for mt in args.micro_tiles]:
        t0 = time.time()
        micro_tile = (1, None) if mt_text == "rows" else parse_micro_tile(mt_text)
        kernel = tuned_kernel(size, size, "float16", target, micro_tile=micro_tile)
        entry = {"k": size, "n": size, "dtype": "float16", "trials": n_trials, "target": target, "kernel": kernel,
                 "micro_tile": mt_text}
        try:
            log_key = (size, kernel, kernel_micro_tile(kernel, size, size, micro_tile))
            if log_key not in done and not args.check_only:   # (1x64 and 32x64 share one wgmma tiles log)
                tune_matmul(size, size, "float16", target, trials=n_trials, work_dir=root, micro_tile=micro_tile,
                                   m=size + 8, trials_per_iter=args.trials_per_iter)
                done.add(log_key)
                entry["tune_s"] = round(time.time() - t0, 1)
            best = best_record(root, size, size, "float16", target, micro_tile=micro_tile)
            if best is None:
                entry["error"] = "no valid record"
            else:
                entry["log"] = os.path.relpath(best.log_dir, os.path.dirname(os.path.abspath(root)))
                entry["best_us"] = best.run_secs * 1e6
                if micro_tile[1] is None:
                    entry["best_tflops_tune_m"] = 2.0 * best.m * size * size / best.run_secs / 1e12
                entry["config"] = asdict(best.config)
                if not args.no_check and micro_tile[1] is not None:
                    entry.update(_check_and_time_op(size, micro_tile, target, root))
                elif not args.no_check and kernel == "wgmma":
                    entry.update(_check_and_time(
                        wgmma_row_gather_func(size, size, config=best.config),
                        wgmma_row_gather_func(size, size, config=wgmma_config(size)), size))
                elif not args.no_check:
                    func = load_best(best.log_dir, size, size, "float16", target)
                    default = schedule_row_gather_matmul(
                        row_gather_matmul_func(size, size, "float16", "float16"),
                        valid_configs(size, size, "float16")[0])
                    entry.update(_check_and_time(func, default, size))
        except Exception:  # noqa: BLE001 - keep going, report
            entry["error"] = traceback.format_exc()[-3000:]
        entry["total_s"] = round(time.time() - t0, 1)
        summary["results"].append(entry)
        print("RESULT", json.dumps({k: v for k, v in entry.items() if k != "error"}),
              "ERROR" if "error" in entry else "", flush=True)
        if "error" in entry:
            print(entry["error"], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if all("error" not in e for e in summary["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
