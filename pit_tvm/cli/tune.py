"""``pit-tvm tune --op matmul --k K --n N [--micro-tile RxC] [--dtype float16] [--target cuda] [--trials 512] [--work-dir DIR]``.

Tunes the tensor-core PIT kernel of a micro-tile (default whole rows) with MetaSchedule and
the XGBoost cost model on the local GPU, writes the JSON database under
``<work-dir>/<gpu-name>/[wgmma_]matmul[_RxC]_k{K}_n{N}_{dtype}/`` (work-dir defaults to
``tuning_logs``) and prints the best record's latency and that path (pass it, or the
work-dir, to ``sparse_matmul(..., tuning_log=...)`` / ``pit-tvm compile --tuning-log``).  The
space is the kernel the target's builds run: on the default ``cuda`` (sm_90a) the wgmma
kernels' tile width and ring depth (``wgmma_...`` logs; for micro-tiles along K also the
loader warpgroup, in 128-row strips: ``wgmma_matmul_128xC_...``), for ``cuda:sm_90`` /
``cuda:sm_80`` the mma.sync schedules' tiles, K tile and stages (``matmul_...`` logs).
"""
from __future__ import annotations

from pit_tvm.cli.main import positive_int
from pit_tvm.errors import UserError

OPS = ("matmul",)


def register(subparsers) -> None:
    p = subparsers.add_parser("tune", help="tune a PIT kernel with MetaSchedule (GPU)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--op", default="matmul", choices=OPS, help="operator (default matmul)")
    p.add_argument("--k", type=positive_int, required=True, help="reduction size K")
    p.add_argument("--n", type=positive_int, required=True, help="output columns N")
    p.add_argument("--micro-tile", default=None, metavar="RxC",
                   help="micro-tile along K, e.g. 32x64 or 32x1 (default: whole rows, 1xK)")
    p.add_argument("--density", type=float, default=None,
                   help="micro-tiles along K: the fraction of each strip's micro-tiles the measured index "
                        "lists (default 0.5)")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    p.add_argument("--target", default="cuda", help="cuda | cuda:sm_80 (default cuda = sm_90a)")
    p.add_argument("--trials", type=positive_int, default=512, help="measured candidates (default 512)")
    p.add_argument("--trials-per-iter", type=positive_int, default=32,
                   help="candidates per MetaSchedule iteration (default 32)")
    p.add_argument("--m", type=positive_int, default=None,
                   help="rows of the tuning workload, not a multiple of 16 (default 4104)")
    p.add_argument("--work-dir", default=None, metavar="DIR",
                   help="log root (default ./tuning_logs); the database goes to DIR/<gpu>/[wgmma_]<op>_k_n_dtype")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    from pit_tvm.cli.compile import parse_micro_tile  # noqa: PLC0415 - heavy imports
    from pit_tvm.schedules.tensorcore_tiles import TilesConfig  # noqa: PLC0415
    from pit_tvm.schedules.wgmma import WgmmaConfig  # noqa: PLC0415
    from pit_tvm.tuning.tune import TILES_TUNE_DENSITY, best_record, tune_matmul  # noqa: PLC0415

    kwargs = {}
    if args.m is not None:
        kwargs["m"] = args.m
    if args.density is not None:
        kwargs["density"] = args.density
    try:
        micro_tile = (1, None) if args.micro_tile is None else parse_micro_tile(args.micro_tile)
        path = tune_matmul(args.k, args.n, args.dtype, target=args.target, trials=args.trials,
                           work_dir=args.work_dir, micro_tile=micro_tile, trials_per_iter=args.trials_per_iter,
                           seed=args.seed, progress=not args.no_progress, **kwargs)
    except (ValueError, NotImplementedError) as err:   # sizes / micro-tile / target the kernel does not take
        raise UserError(err) from err
    best = best_record(path, args.k, args.n, args.dtype, args.target, micro_tile=micro_tile)
    if best is None:
        print(f"no valid record measured; database: {path}")
        return 1
    c = best.config
    if isinstance(c, WgmmaConfig):
        config = f"wgmma tile 128x{c.block_n}x{c.block_k}, ring of {c.stages}" + (", loader warpgroup" * c.tiles_ws)
    elif isinstance(c, TilesConfig):
        config = f"N tile {c.block_n}, K step {c.block_k}, warp {c.warp_m}x{c.warp_n}, stages {c.stages}"
    else:
        config = f"block {c.block_m}x{c.block_n}x{c.block_k}, warp {c.warp_m}x{c.warp_n}, stages {c.stages}"
    if micro_tile[1] is None:
        listed = f"{2.0 * best.m * args.k * args.n / best.run_secs / 1e12:.1f} TF/s at M={best.m}, every row listed"
    else:
        density = TILES_TUNE_DENSITY if args.density is None else args.density
        listed = f"M={best.m}, {density:.0%} of each strip's micro-tiles listed"
    print(f"best: {best.run_secs * 1e6:.1f} us ({listed})  config: {config}")
    print(f"database: {path}")
    return 0
