"""One tuning task on 1 GPU and on N GPUs of this box, through TVM's RPC tracker.

    python3 benchmarks/tune_rpc.py                 # 1 vs 2 GPUs, mma.sync rows kernel 4096x4096 fp16, 64 trials
    python3 benchmarks/tune_rpc.py --gpus 1 2 4 --trials 128

The default space is the mma.sync rows schedule's (``--target cuda:sm_90``: a few hundred
configs); the wgmma rows kernel's (``--target cuda``) has 16, fewer than a useful trial count.

Every configuration runs the same task with the same seed and trial count in a fresh
database, on a tracker and one RPC server per GPU that :class:`pit_tvm.tuning.rpc.LocalCluster`
starts and stops (``pit-tvm tune --gpus N``); builds run on this machine's CPU cores in every
configuration.  ``--local`` adds the local runner (no RPC) as a baseline.  Writes
``docs/results/tune_rpc.{json,png}`` (under ``$OUT`` when set) and prints a table: wall time,
measured trials per minute, failed trials, best latency.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import environment, print_table, write_results  # noqa: E402


def _records(db_dir):
    """(measured, failed, best mean seconds) of a database"""
    measured, failed, best = 0, 0, math.inf
    path = os.path.join(db_dir, "database_tuning_record.json")
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            secs = [float(x) for x in (json.loads(line)[1][1] or [])]
            if secs and all(0 < x < 1e9 for x in secs):
                measured += 1
                best = min(best, sum(secs) / len(secs))
            else:
                failed += 1
    return measured, failed, best


def run_config(args, gpus: int | None, work_dir: str) -> dict:
    """tune once on ``gpus`` GPU servers (None: the local runner); the row of the table"""
    from pit_tvm.tuning.rpc import LocalCluster, rpc_runner, tracker_servers
    from pit_tvm.tuning.tune import tune_matmul

    micro_tile = (1, None) if args.micro_tile is None else tuple(int(x) for x in args.micro_tile.split("x"))
    kw = dict(target=args.target, trials=args.trials, work_dir=work_dir, micro_tile=micro_tile,
              trials_per_iter=args.trials_per_iter, seed=args.seed, progress=not args.no_progress)
    start = time.perf_counter()
    if gpus is None:
        path = tune_matmul(args.k, args.n, args.dtype, **kw)
        name = "local runner"
    else:
        with LocalCluster(gpus, gpus=True, key=f"bench{gpus}") as cluster:
            runner = rpc_runner(cluster.host, cluster.port, cluster.key, session_timeout=args.rpc_timeout)
            try:
                path = tune_matmul(args.k, args.n, args.dtype, runner=runner,
                                   servers=lambda: f"{tracker_servers(cluster.host, cluster.port, cluster.key)[0]}",
                                   **kw)
            finally:
                runner.shutdown()
        name = f"rpc, {gpus} GPU" + ("s" if gpus > 1 else "")
    wall = time.perf_counter() - start
    measured, failed, best = _records(path)
    return {"config": name, "gpus": gpus or 1, "wall_s": wall, "trials": measured + failed,
            "measured": measured, "failed": failed,
            "trials_per_min": (measured + failed) / wall * 60.0,
            "best_us": best * 1e6 if best < math.inf else None, "log": str(path)}


def plot_rows(ax, rows) -> None:
    """wall time per configuration, with the best latency it found as the bar's label"""
    names = [r["config"] for r in rows]
    bars = ax.bar(names, [r["wall_s"] for r in rows], color="tab:blue")
    for bar, r in zip(bars, rows):
        best = r["best_us"]
        label = "no valid run" if best is None else f"best {best:.0f} us"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8)
    ax.set_ylabel("tuning wall time (s), builds included")


def _gpu_names() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return [x.strip() for x in out.stdout.splitlines() if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--target", default="cuda:sm_90", help="cuda:sm_90 (mma.sync, default) | cuda (wgmma) | cuda:sm_80")
    p.add_argument("--micro-tile", default=None, metavar="RxC", help="default: whole rows")
    p.add_argument("--trials", type=int, default=64)
    p.add_argument("--trials-per-iter", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="GPU server counts to compare")
    p.add_argument("--local", action="store_true", help="also run the local runner (no RPC)")
    p.add_argument("--rpc-timeout", type=float, default=120.0)
    p.add_argument("--keep-logs", default=None, metavar="DIR", help="keep the databases under DIR")
    p.add_argument("--name", default="tune_rpc")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    root = args.keep_logs or tempfile.mkdtemp(prefix="tune_rpc_")
    rows = []
    try:
        configs = ([None] if args.local else []) + list(args.gpus)
        for gpus in configs:
            work_dir = os.path.join(root, "local" if gpus is None else f"gpus{gpus}")
            rows.append(run_config(args, gpus, work_dir))
            print(f"{rows[-1]['config']}: {rows[-1]['wall_s']:.1f} s", flush=True)
    finally:
        if args.keep_logs is None:
            shutil.rmtree(root, ignore_errors=True)
    names = _gpu_names()
    env = environment(names[0] if names else "unknown")
    env["gpus"] = names
    env["cpu_cores"] = os.cpu_count()
    task = {"k": args.k, "n": args.n, "dtype": args.dtype, "target": args.target,
            "micro_tile": args.micro_tile, "trials": args.trials, "trials_per_iter": args.trials_per_iter,
            "seed": args.seed}
    env["task"] = task
    json_path, png_path = write_results(args.name, env, rows, plot_rows)
    print_table(rows, ["config", "wall_s", "trials", "failed", "trials_per_min", "best_us"])
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
