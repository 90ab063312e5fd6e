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

``--op moe --d D --f F --experts E [--top-k K] [--tokens T] [--mode gather|scatter|glu|both]
[--routing balanced|zipf]`` tunes the MoE op's grouped wgmma GEMMs (sm_90a): fc1 ("gather",
K = d, N = f), fc2 ("scatter", K = f, N = d), a gated fc1's both halves in one kernel ("glu",
K = d, N = f), tile width x ring depth, measured on ``T``
tokens routed at random; the databases go to ``<work-dir>/<gpu-name>/wgmma_moe_...`` and
``moe_ffn(..., tuning_log=...)`` reads them (:mod:`pit_tvm.tuning.moe`).
"""
from __future__ import annotations

import contextlib
import sys

from pit_tvm.cli.main import positive_int
from pit_tvm.errors import UserError

OPS = ("matmul", "moe")


def register(subparsers) -> None:
    p = subparsers.add_parser("tune", help="tune a PIT kernel with MetaSchedule (GPU)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--op", default="matmul", choices=OPS, help="operator (default matmul)")
    p.add_argument("--k", type=positive_int, default=None, help="matmul: reduction size K (required)")
    p.add_argument("--n", type=positive_int, default=None, help="matmul: output columns N (required)")
    moe = p.add_argument_group("--op moe (the MoE op's grouped GEMMs, sm_90a)")
    moe.add_argument("--d", type=positive_int, default=None, help="hidden size d (fc1: K = d; fc2: N = d)")
    moe.add_argument("--f", type=positive_int, default=None, help="expert width f (fc1: N = f; fc2: K = f)")
    moe.add_argument("--experts", type=positive_int, default=None, help="number of experts E")
    moe.add_argument("--top-k", type=positive_int, default=1, help="experts per token (default 1)")
    moe.add_argument("--tokens", type=positive_int, default=None,
                     help="tokens T of the measured routing (default 4096; <= 256 tunes the decode-size tiles)")
    moe.add_argument("--mode", default="both", choices=("gather", "scatter", "glu", "both"),
                     help="which grouped GEMM: gather (fc1), scatter (fc2), glu (a gated fc1's both halves) "
                          "or both gather and scatter (default)")
    moe.add_argument("--routing", default="balanced", choices=("balanced", "zipf"),
                     help="the measured routing: uniform over the experts, or Zipf-skewed (default balanced)")
    p.add_argument("--micro-tile", default=None, metavar="RxC",
                   help="micro-tile along K, e.g. 32x64 or 32x1 (default: whole rows, 1xK)")
    p.add_argument("--density", type=float, default=None,
                   help="micro-tiles along K: the fraction of each strip's micro-tiles the measured index "
                        "lists (default 0.5)")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    p.add_argument("--target", default="cuda", help="cuda | cuda:sm_90 | cuda:sm_80 (default cuda = sm_90a); llvm: a small CPU space, "
                        "to try --rpc / --servers without a GPU")
    p.add_argument("--trials", type=positive_int, default=None,
                   help="measured candidates (default 512; --op moe: 24 a mode)")
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
    if args.op == "moe":
        return _run_moe(args)
    if args.k is None or args.n is None:
        raise UserError("pit-tvm tune --op matmul needs --k K and --n N")
    for flag, value in (("--d", args.d), ("--f", args.f), ("--experts", args.experts), ("--tokens", args.tokens)):
        if value is not None:
            raise UserError(f"{flag} is an option of --op moe, not of --op matmul")
    if args.trials is None:
        args.trials = 512
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


def _run_moe(args) -> int:
    """``--op moe``: tune the grouped GEMM of each mode asked for, print each best config"""
    from pit_tvm.tuning.moe import DEFAULT_TOKENS, best_moe_record, tune_moe  # noqa: PLC0415
    from pit_tvm.tuning.rpc import RpcError  # noqa: PLC0415

    missing = [flag for flag, v in (("--d", args.d), ("--f", args.f), ("--experts", args.experts)) if v is None]
    if missing:
        raise UserError(f"pit-tvm tune --op moe needs {', '.join(missing)} (the layer: hidden size d, expert "
                        "width f, number of experts)")
    for flag, value in (("--k", args.k), ("--n", args.n), ("--micro-tile", args.micro_tile),
                        ("--density", args.density), ("--m", args.m)):
        if value is not None:
            raise UserError(f"{flag} is an option of --op matmul; --op moe takes --d, --f, --experts, --top-k, "
                            "--tokens")
    if _is_cpu(args.target):
        raise UserError("the MoE op's grouped GEMM has no knobs on the CPU (the generic TIR kernel's tiles are "
                        "fixed): --op moe tunes the sm_90a wgmma kernel, --target cuda")
    tokens = args.tokens or DEFAULT_TOKENS
    modes = ("gather", "scatter") if args.mode == "both" else (args.mode,)
    shapes = {"gather": (args.d, args.f), "scatter": (args.f, args.d), "glu": (args.d, args.f)}
    paths = {}
    try:
        from functools import partial  # noqa: PLC0415

        from pit_tvm.tuning._worker import rpc_alloc_moe_arguments  # noqa: PLC0415

        for mode in modes:
            alloc = partial(rpc_alloc_moe_arguments, mode=mode, top_k=args.top_k, routing=args.routing)
            with _measuring_on(args, 0.5, alloc) as (runner, servers):
                k, n = shapes[mode]
                paths[mode] = tune_moe(mode, k, n, args.experts, args.top_k, args.dtype, tokens, target=args.target,
                                       trials=args.trials or 24, work_dir=args.work_dir, routing=args.routing,
                                       trials_per_iter=min(args.trials_per_iter, args.trials or 24), seed=args.seed,
                                       progress=not args.no_progress, runner=runner, servers=servers)
    except (ValueError, RpcError) as err:
        raise UserError(err) from err
    rc = 0
    for mode, path in paths.items():
        k, n = shapes[mode]
        best = best_moe_record(path, mode, k, n, args.experts, args.top_k, args.dtype, args.target, tokens)
        if best is None:
            print(f"{mode}: no valid record measured; database: {path}")
            rc = 1
            continue
        c = best.config
        print(f"{mode} (K={k}, N={n}): best {best.run_secs * 1e6:.1f} us at T={best.tokens} ({args.routing} routing)  "
              f"config: wgmma tile 128x{c.block_n}x{c.block_k}, ring of {c.stages}")
        print(f"database: {path}")
    return rc


@contextlib.contextmanager
def _measuring_on(args, density: float, rpc_alloc=None):
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
        runner = rpc_runner(host, port, key, density=density, session_timeout=args.rpc_timeout,
                            f_alloc_argument=rpc_alloc)

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
