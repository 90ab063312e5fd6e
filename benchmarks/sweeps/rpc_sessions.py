"""Where an RPC measurement's time goes: each session's stages (create through the tracker,
upload, argument allocation, the timed runs, cleanup), which server took it, and how the
sessions of 1 and of N servers overlap.

    python3 benchmarks/sweeps/rpc_sessions.py --servers 1 2                   # GPU box, mma.sync rows
    python3 benchmarks/sweeps/rpc_sessions.py --servers 1 2 --target llvm     # CPU servers

Runs a short ``tune_matmul`` through :class:`pit_tvm.tuning.rpc.LocalCluster` with the runner of
:func:`pit_tvm.tuning.rpc.rpc_runner`, its hooks each wrapped to log its start and duration;
every line is appended to ``$OUT/rpc_sessions_<n>.log`` (or the working folder) as it happens,
so a run cut short by a time limit still leaves its log.  Then prints, per server count, the
mean of each stage, the sessions per server and the wall time of each round's measurements
(sessions without a 1 s gap between them).  Why: 2 GPU servers measured no faster than 1
(CHANGELOG, issue 37).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

LOG_ENV = "PIT_RPC_SESSIONS_LOG"


def _log(stage: str, start: float) -> None:
    with open(os.environ[LOG_ENV], "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()} {stage} {start:.4f} {time.time() - start:.4f}\n")


def _server_port_recorder():
    """wrap ``tvm.rpc.client.connect`` (in the runner's worker) to remember the server's port"""
    import tvm.rpc.client as client

    if not getattr(client.connect, "_pit_recorded", False):
        connect = client.connect

        def recorded(url, port, *args, **kwargs):
            recorded.port = port
            return connect(url, port, *args, **kwargs)

        recorded._pit_recorded, recorded.port = True, None
        client.connect = recorded
    return client.connect


def create_session(rpc_config):
    from pit_tvm.tuning._worker import rpc_create_session

    connect, t = _server_port_recorder(), time.time()
    session = rpc_create_session(rpc_config)
    _log(f"create@{connect.port}", t)
    return session


def upload_module(session, local_path, remote_path):
    from tvm.s_tir.meta_schedule.runner import rpc_runner as r

    t = time.time()
    module = r.default_upload_module(session, local_path, remote_path)
    _log("upload", t)
    return module


def alloc_argument(session, device, args_info, alloc_repeat):
    from pit_tvm.tuning._worker import rpc_alloc_pit_arguments

    t = time.time()
    args = rpc_alloc_pit_arguments(session, device, args_info, alloc_repeat)
    _log("alloc", t)
    return args


def run_evaluator(session, rt_mod, device, evaluator_config, repeated_args):
    from pit_tvm.tuning._worker import rpc_run_evaluator_cold_l2

    t = time.time()
    costs = rpc_run_evaluator_cold_l2(session, rt_mod, device, evaluator_config, repeated_args)
    _log("eval", t)
    return costs


def cleanup(session, remote_path):
    from tvm.s_tir.meta_schedule.runner import rpc_runner as r

    t = time.time()
    r.default_cleanup(session, remote_path)
    _log("cleanup", t)


def run(servers: int, args, out_dir: str) -> str:
    from pit_tvm.tuning.rpc import LocalCluster, rpc_runner
    from pit_tvm.tuning.tune import tune_matmul

    log = os.path.join(out_dir, f"rpc_sessions_{servers}.log")
    if os.path.exists(log):
        os.remove(log)
    os.environ[LOG_ENV] = log
    gpu = args.target != "llvm"
    with LocalCluster(servers, gpus=gpu, key=f"sessions{servers}") as cluster:
        # the runner pit-tvm tune uses, each hook wrapped to log (RPCRunner reads them per run)
        runner = rpc_runner(cluster.host, int(cluster.port), cluster.key)
        inner = runner.inner
        inner.f_create_session, inner.f_upload_module, inner.f_alloc_argument = (
            create_session, upload_module, alloc_argument)
        inner.f_run_evaluator, inner.f_cleanup = run_evaluator, cleanup
        t = time.perf_counter()
        try:
            k, n, m = (4096, 4096, None) if gpu else (64, 64, 40)
            tune_matmul(k, n, "float16", args.target, trials=args.trials, trials_per_iter=args.per_round,
                        runner=runner, work_dir=tempfile.mkdtemp(), progress=False,
                        **({} if m is None else {"m": m}))
        finally:
            runner.shutdown()
        print(f"{servers} server(s): tuning {time.perf_counter() - t:.1f} s", flush=True)
    return log


def summarize(servers: int, log: str) -> None:
    rows = [line.split() for line in open(log, encoding="utf-8")]
    stages = collections.defaultdict(list)
    for _, stage, _, took in rows:
        stages[stage.split("@")[0]].append(float(took))
    by_server = collections.Counter(stage.split("@")[1] for _, stage, _, _ in rows if stage.startswith("create@"))
    sessions = sorted((float(start), float(start) + float(took)) for _, stage, start, took in rows if stage == "eval")
    spans = sorted((float(start), float(start) + float(took)) for _, stage, start, took in rows
                   if stage.startswith("create@") or stage == "cleanup")
    rounds, first, last = [], None, None     # a round: sessions without a 1 s gap between them
    for start, end in spans:
        if last is not None and start - last > 1.0:
            rounds.append(round(last - first, 2))
            first = None
        first = start if first is None else first
        last = end if last is None else max(last, end)
    if first is not None:
        rounds.append(round(last - first, 2))
    print(f"{servers} server(s): {sum(by_server.values())} sessions, per server {dict(by_server)}; mean s "
          + ", ".join(f"{k} {sum(v) / len(v):.3f}" for k, v in stages.items())
          + f"; each round's sessions took {rounds} s ({len(sessions)} timed)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--target", default="cuda:sm_90", help="cuda:sm_90 (GPU servers) or llvm (CPU servers)")
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--per-round", type=int, default=16)
    args = p.parse_args(argv)
    # the runner's worker processes import this module by name (the hooks are pickled by reference)
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in [here, os.environ.get("PYTHONPATH", "")] if x)
    sys.path.insert(0, here)
    out_dir = os.environ.get("OUT", ".")
    import rpc_sessions  # noqa: PLC0415 - this file as a module, so the hooks pickle by its name

    for servers in args.servers:
        summarize(servers, rpc_sessions.run(servers, args, out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
