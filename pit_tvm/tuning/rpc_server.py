"""``python -m pit_tvm.tuning.rpc_server --tracker HOST:PORT --key KEY``: a TVM RPC server for
PIT tuning.

It is ``python -m tvm.exec.rpc_server`` with the functions the PIT runner calls by name on the
server registered first (:func:`pit_tvm.tuning._worker.register_server_functions`: the cold-L2
flush that ``time_evaluator`` runs before every timed call).  Start one per GPU, pinned with
``CUDA_VISIBLE_DEVICES=i``; ``pit-tvm tune --gpus N`` does so itself.  Needs ``pit_tvm`` (and
TVM) importable: the environment, ``PYTHONPATH`` included, is what the server's sessions see.
Imports only TVM and the light worker module, so a server starts in a few seconds.

Sessions run one after another in one reused spawned process (:func:`init_server_process`),
not in a fork per session: a fork of a process that has initialised CUDA cannot use the GPU.
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


def init_server_process() -> None:
    """``server_init_callback`` of the RPC server, run in the process that accepts sessions:
    serves every session in one reused spawned process that registers the PIT functions
    (:mod:`pit_tvm.tuning._session_worker`, started here) instead of TVM's fresh fork per
    session, which cannot use a GPU the server process has initialised; and talks to the
    tracker without Nagle's delay (:func:`~pit_tvm.tuning._worker.no_delay`)."""
    from tvm.rpc import base, server

    from pit_tvm.tuning._session_worker import serve_connection, start_worker
    from pit_tvm.tuning._worker import no_delay

    server._serving = serve_connection
    # the connection to the tracker (re-registering after each session) without Nagle's delay
    connect = base.connect_with_retry
    if not getattr(connect, "no_delay", False):
        def connect_no_delay(*args, **kwargs):
            return no_delay(connect(*args, **kwargs))

        connect_no_delay.no_delay = True
        base.connect_with_retry = connect_no_delay
    start_worker()


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
