"""``python -m pit_tvm.tuning.rpc_server --tracker HOST:PORT --key KEY``: a TVM RPC server for
PIT tuning.

It is ``python -m tvm.exec.rpc_server`` with the functions the PIT runner calls by name on the
server registered first (:func:`pit_tvm.tuning._worker.register_server_functions`: the cold-L2
flush that ``time_evaluator`` runs before every timed call).  Start one per GPU, pinned with
``CUDA_VISIBLE_DEVICES=i``; ``pit-tvm tune --gpus N`` does so itself.  Needs ``pit_tvm`` (and
TVM) importable: the environment, ``PYTHONPATH`` included, is what the server's sessions see.
Imports only TVM and the light worker module, so a server starts in a few seconds.

On a GPU box each RPC session runs in a spawned process (:func:`init_server_process`), not one
forked from the server: a process that has loaded the CUDA driver cannot be forked usefully.
"""
from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pit_tvm.tuning.rpc_server",
                                description=__doc__.splitlines()[0])
    p.add_argument("--tracker", required=True, metavar="HOST:PORT", help="the RPC tracker to register with")
    p.add_argument("--key", required=True, help="the device key the tuner asks the tracker for")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=9090, help="first port to try (default 9090)")
    p.add_argument("--port-end", type=int, default=9199, help="last port to try (default 9199)")
    p.add_argument("--custom-addr", default=None,
                   help="the address reported to the tracker (default: the one the tracker sees)")
    p.add_argument("--silent", action="store_true", help="no INFO log lines")
    return p


def parse_tracker(text: str) -> tuple[str, int]:
    """``HOST:PORT`` -> ``(host, port)``, with a clear error"""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT for the RPC tracker, got {text!r}")
    return host, int(port)


def cuda_driver_loaded() -> bool:
    """Whether this process has the CUDA driver loaded (importing TVM loads it where the CUDA
    runtime is present); then a forked child cannot use the GPU."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return "libcuda.so" in maps.read()
    except OSError:
        return True          # cannot tell: spawn, which is always safe


def init_server_process() -> None:
    """``server_init_callback`` of the RPC server, run in the process that accepts sessions:
    registers the PIT functions; where the CUDA driver is loaded (:func:`cuda_driver_loaded`)
    each session is a spawned process running :func:`pit_tvm.tuning._session_init.serve_session`
    instead of TVM's forked one.  Why: a forked session failed every CUDA call with
    ``cudaErrorInitializationError``; a spawned one starts clean but must register the PIT
    functions itself.  Without CUDA, sessions stay forked (they start at once)."""
    import multiprocessing

    from tvm.rpc import server

    from pit_tvm.tuning._session_init import serve_session
    from pit_tvm.tuning._worker import register_server_functions

    register_server_functions()
    if cuda_driver_loaded():
        multiprocessing.set_start_method("spawn", force=True)
        server._serve_loop = serve_session     # what ``server._serving`` starts per session


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from tvm import rpc  # noqa: PLC0415

    if not args.silent:
        logging.basicConfig(level=logging.INFO)
    server = rpc.Server(args.host, args.port, args.port_end, key=args.key,
                        tracker_addr=parse_tracker(args.tracker), custom_addr=args.custom_addr,
                        silent=args.silent, server_init_callback=init_server_process)
    print(f"pit rpc server: port {server.port}, key {args.key!r}, tracker {args.tracker}", flush=True)
    server.proc.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
