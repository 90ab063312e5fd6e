"""``pit-tvm tune --op matmul --k K --n N [--dtype float16] [--target cuda] [--trials 512] [--work-dir DIR]``.

Tunes the tensor-core PIT kernel (whole-row micro-tiles) with MetaSchedule and the XGBoost
cost model on the local GPU, writes the JSON database under
``<work-dir>/<gpu-name>/matmul_k{K}_n{N}_{dtype}/`` (work-dir defaults to ``tuning_logs``) and
prints the best record's latency and that path (pass it, or the work-dir, to
``sparse_matmul(..., tuning_log=...)`` / ``pit-tvm compile --tuning-log``).  The space is the
kernel the target's builds run: on the default ``cuda`` (sm_90a) the wgmma kernel's tile width
and ring depth (``wgmma_matmul_...`` logs), for ``cuda:sm_90`` / ``cuda:sm_80`` the mma.sync
schedule's tiles, K tile and stages (``matmul_...`` logs).
"""
from __future__ import annotations

import sys

OPS = ("matmul",)


def register(subparsers) -> None:
    p = subparsers.add_parser("tune", help="tune a PIT kernel with MetaSchedule (GPU)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--op", default="matmul", choices=OPS, help="operator (default matmul)")
    p.add_argument("--k", type=int, required=True, help="reduction size K")
    p.add_argument("--n", type=int, required=True, help="output columns N")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    p.add_argument("--target", default="cuda", help="cuda | cuda:sm_80 (default cuda = sm_90a)")
    p.add_argument("--trials", type=int, default=512, help="measured candidates (default 512)")
    p.add_argument("--trials-per-iter", type=int, default=32,
                   help="candidates per MetaSchedule iteration (default 32)")
    p.add_argument("--m", type=int, default=None,
                   help="rows of the tuning workload, not a multiple of 16 (default 4104)")
    p.add_argument("--work-dir", default=None, metavar="DIR",
                   help="log root (default ./tuning_logs); the database goes to DIR/<gpu>/[wgmma_]<op>_k_n_dtype")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    from pit_tvm.schedules.wgmma import WgmmaConfig  # noqa: PLC0415 - heavy imports
    from pit_tvm.tuning.tune import best_record, tune_matmul  # noqa: PLC0415

    kwargs = {}
    if args.m is not None:
        kwargs["m"] = args.m
    try:
        path = tune_matmul(args.k, args.n, args.dtype, target=args.target, trials=args.trials,
                           work_dir=args.work_dir, trials_per_iter=args.trials_per_iter,
                           seed=args.seed, progress=not args.no_progress, **kwargs)
    except (ValueError, NotImplementedError) as err:
        print(f"pit-tvm tune: error: {err}", file=sys.stderr)
        return 2
    best = best_record(path, args.k, args.n, args.dtype, args.target)
    if best is None:
        print(f"no valid record measured; database: {path}")
        return 1
    flops = 2.0 * best.m * args.k * args.n
    c = best.config
    config = (f"wgmma tile 128x{c.block_n}x{c.block_k}, ring of {c.stages}" if isinstance(c, WgmmaConfig)
              else f"block {c.block_m}x{c.block_n}x{c.block_k}, warp {c.warp_m}x{c.warp_n}, stages {c.stages}")
    print(f"best: {best.run_secs * 1e6:.1f} us ({flops / best.run_secs / 1e12:.1f} TF/s at "
          f"M={best.m}, every row listed)  config: {config}")
    print(f"database: {path}")
    return 0
