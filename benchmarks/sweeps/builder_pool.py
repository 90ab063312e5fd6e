"""The same tuning task with MetaSchedule's LocalBuilder (a fresh worker per core every round) and
with pit-tvm's pooled builder (workers kept across rounds): the wall time of ``tune_matmul`` in
each, one process per run, alternating.  Default: the CPU rows space (llvm), K = N = 256, 48 trials in rounds of 8.

    python3 benchmarks/sweeps/builder_pool.py [--runs 2] [--trials 48] [--per-round 8]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time


def tune_once(builder_kind: str, trials: int, per_round: int) -> None:
    from tvm.s_tir import meta_schedule as ms

    from pit_tvm.tuning._worker import build_module, export_shared
    from pit_tvm.tuning.builder import default_builder
    from pit_tvm.tuning.tune import tune_matmul

    cores = os.cpu_count() or 1
    builder = (default_builder(cores) if builder_kind == "pooled" else
               ms.builder.LocalBuilder(max_workers=cores, timeout_sec=600, f_build=build_module,
                                       f_export=export_shared))
    start = time.perf_counter()
    tune_matmul(256, 256, "float16", "llvm", trials=trials, work_dir=tempfile.mkdtemp(), m=264,
                trials_per_iter=per_round, population_size=2 * per_round, builder=builder, progress=False)
    print(f"tune_seconds={time.perf_counter() - start:.1f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--trials", type=int, default=48)
    p.add_argument("--per-round", type=int, default=8)
    p.add_argument("--one", choices=["local", "pooled"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        tune_once(args.one, args.trials, args.per_round)
        return
    for _ in range(args.runs):
        for kind in ("local", "pooled"):
            out = subprocess.run([sys.executable, __file__, "--one", kind, "--trials", str(args.trials),
                                  "--per-round", str(args.per_round)], check=True, capture_output=True, text=True)
            seconds = next(line.split("=")[1] for line in out.stdout.splitlines() if line.startswith("tune_seconds="))
            print(f"{kind:>7}: {float(seconds):6.1f} s of tune_matmul ({args.trials} trials, rounds of "
                  f"{args.per_round})", flush=True)


if __name__ == "__main__":
    main()
