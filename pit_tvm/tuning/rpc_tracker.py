"""``python -m pit_tvm.tuning.rpc_tracker --port PORT``: TVM's RPC tracker, answering without
Nagle's delay.

It is ``python -m tvm.exec.rpc_tracker`` (same options, same protocol: TVM's servers and
clients use it unchanged) with ``TCP_NODELAY`` on every connection it accepts.  Why: the
tracker writes each reply as two sends (its length, then its JSON); with Nagle's algorithm the
second waits for the peer's delayed ACK of the first, ~40 ms on Linux, once per measurement
(the runner's request for a server) and once per re-registration of a server after each
session (CHANGELOG, issue 37).  ``pit-tvm tune --gpus N`` starts this one; a tracker shared by
several boxes can be either.
"""
from __future__ import annotations

import argparse
import logging
import sys


def answer_without_delay() -> None:
    """make TVM's tracker set ``TCP_NODELAY`` on each connection it accepts (in this process)"""
    from tvm.rpc import tracker

    from pit_tvm.tuning._worker import no_delay

    handler = tracker.TCPEventHandler
    if getattr(handler.__init__, "no_delay", False):
        return
    init = handler.__init__

    def init_no_delay(self, tracker_handler, sock, addr):
        init(self, tracker_handler, no_delay(sock), addr)

    init_no_delay.no_delay = True
    handler.__init__ = init_no_delay


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pit_tvm.tuning.rpc_tracker", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=9190, help="first port to try (default 9190)")
    p.add_argument("--port-end", type=int, default=9199, help="last port to try (default 9199)")
    p.add_argument("--silent", action="store_true", help="no INFO log lines")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from tvm.rpc.tracker import PopenTrackerServerState  # noqa: PLC0415

    if not args.silent:
        logging.basicConfig(level=logging.INFO)
    answer_without_delay()
    # the tracker's state object, in this process (TVM's ``Tracker`` runs the same in a Popen worker)
    state = PopenTrackerServerState(args.host, args.port, args.port_end, silent=args.silent)
    print(f"pit rpc tracker: {args.host}:{state.port}", flush=True)
    state.thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
