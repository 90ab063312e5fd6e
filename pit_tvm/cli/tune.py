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

Where candidates are measured: on the local GPU (default); through an RPC tracker with
``--rpc HOST:PORT --key KEY`` (servers on this machine or others, started with ``python -m
pit_tvm.tuning.rpc_server``; builds stay here); or with ``--gpus N|all`` on a tracker and one
server per GPU that this command starts and stops (``--servers N``: N CPU servers, for
``--target llvm``).  See docs/guide/tuning.md.
"""
from __future__ import annotations

import contextlib
import sys

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
    p.add_argument("--target", default="cuda", help="cuda | cuda:sm_90 | cuda:sm_80 (default cuda = sm_90a); llvm: a small CPU space, "
                        "to try --rpc / --servers without a GPU")
    p.add_argument("--trials", type=positive_int, default=512, help="measured candidates (default 512)")
    p.add_argument("--trials-per-iter", type=positive_int, default=32,
                   help="candidates per MetaSchedule iteration (default 32)")
    p.add_argument("--m", type=positive_int, default=None,
                   help="rows of the tuning workload, not a multiple of 16 (default 4104)")
    p.add_argument("--work-dir", default=None, metavar="DIR",
                   help="log root (default ./tuning_logs); the database goes to DIR/<gpu>/[wgmma_]<op>_k_n_dtype")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT",
                   help="measure through this RPC tracker (with --key); builds stay on this machine")
    p.add_argument("--key", default=None, help="the tracker's device key of the servers to measure on")
    p.add_argument("--gpus", default=None, metavar="N|all",
                   help="start a tracker and one RPC server per GPU (GPUs 0..N-1) here, measure on them, "
                        "stop them at the end")
    p.add_argument("--servers", type=int, default=None, metavar="N",
                   help="start a tracker and N RPC servers sharing this machine's CPU (--target llvm)")
    p.add_argument("--rpc-timeout", type=float, default=120.0,
                   help="seconds one RPC measurement (session) may take (default 120)")
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
    from pit_tvm.tuning.rpc import RpcError  # noqa: PLC0415

    try:
        micro_tile = (1, None) if args.micro_tile is None else parse_micro_tile(args.micro_tile)
        with _measuring_on(args, kwargs.get("density", TILES_TUNE_DENSITY)) as (runner, servers):
            path = tune_matmul(args.k, args.n, args.dtype, target=args.target, trials=args.trials,
                               work_dir=args.work_dir, micro_tile=micro_tile, trials_per_iter=args.trials_per_iter,
                               seed=args.seed, progress=not args.no_progress, runner=runner, servers=servers,
                               **kwargs)
    except (ValueError, NotImplementedError, RpcError) as err:   # sizes / micro-tile / target / tracker
        raise UserError(err) from err
    if _is_cpu(args.target):
        return _report_cpu(path)
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


def _is_cpu(target) -> bool:
    from pit_tvm.target import make_target  # noqa: PLC0415

    return make_target(target).kind.name == "llvm"


@contextlib.contextmanager
def _measuring_on(args, density: float):
    """(runner, servers-in-use callback) for the options: (None, None) measures on the local
    GPU; ``--rpc`` through a tracker; ``--gpus`` / ``--servers`` on a :class:`LocalCluster`
    that is stopped when the block exits (also on Ctrl-C and errors)."""
    from pit_tvm.tuning.rpc import LocalCluster, RpcError, parse_tracker, rpc_runner, tracker_servers  # noqa: PLC0415

    local = args.gpus is not None or args.servers is not None
    if args.rpc is not None and local:
        raise RpcError("--rpc measures on an existing tracker; --gpus / --servers start one: pass one of them")
    if args.rpc is None and not local:
        if args.key is not None:
            raise RpcError("--key names the servers of a tracker: pass --rpc HOST:PORT too")
        yield None, None
        return
    if args.gpus is not None and args.servers is not None:
        raise RpcError("--gpus starts one server per GPU, --servers N CPU servers: pass one of them")
    cluster = None
    if local:
        if args.gpus is not None:
            gpus = str(args.gpus).strip().lower()
            if gpus != "all" and not (gpus.isdigit() and int(gpus) > 0):
                raise RpcError(f"--gpus takes a positive number or 'all', got {args.gpus!r}")
            cluster = LocalCluster(None if gpus == "all" else int(gpus), gpus=True,
                                   key=args.key or "pit-local")
        else:
            cluster = LocalCluster(args.servers, gpus=False, key=args.key or "pit-local")
        cluster.__enter__()
        host, port, key = cluster.host, cluster.port, cluster.key
    else:
        if args.key is None:
            raise RpcError("--rpc needs --key: the device key the servers registered under")
        host, port = parse_tracker(args.rpc)
        key = args.key
    runner = None
    try:
        runner = rpc_runner(host, port, key, density=density, session_timeout=args.rpc_timeout)

        def servers() -> str:
            count, _ = tracker_servers(host, port, key)
            return f"{count} x {key}@{host}:{port}"

        yield runner, servers
    finally:
        try:
            if runner is not None:
                runner.shutdown()
        finally:
            if cluster is not None:
                cluster.__exit__(*sys.exc_info())


def _report_cpu(path) -> int:
    """the CPU space's best record (its logs hold no PIT config to print)"""
    from tvm.s_tir import meta_schedule as ms  # noqa: PLC0415

    records = [r for r in ms.database.JSONDatabase(work_dir=str(path)).get_all_tuning_records()
               if r.run_secs and all(0 < float(x) < 1e9 for x in r.run_secs)]
    if not records:
        print(f"no valid record measured; database: {path}")
        return 1
    best = min(sum(float(x) for x in r.run_secs) / len(r.run_secs) for r in records)
    print(f"best: {best * 1e6:.1f} us ({len(records)} measured records)")
    print(f"database: {path}")
    return 0
