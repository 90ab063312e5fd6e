"""The process that serves a PIT RPC server's sessions, one after another.

TVM's server forks a fresh process per session.  On a GPU box that cannot work (importing TVM
initialises CUDA, and a fork of such a process fails every CUDA call), and a spawned process
per session costs the import and the CUDA start-up again every time (seconds on an H200:
longer than the measurement).  So a PIT server keeps one spawned :class:`SessionWorker`,
started before the first session arrives, and hands it each accepted connection (the socket
passes over a pipe).  Like the local runner's reused worker, a session that leaves the device
unusable (a sticky CUDA error), dies, or outlives its timeout costs the worker: a new one is
started for the next session.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import socket
from multiprocessing import reduction

logger = logging.getLogger("pit_tvm.rpc_server")


class _WorkDir:
    """the part of ``tvm.contrib.utils.TempDirectory`` a session uses (the server owns the folder)"""

    def __init__(self, path: str) -> None:
        self.path = path

    def relpath(self, name: str) -> str:
        return os.path.join(self.path, name)


def _device_usable() -> bool:
    """whether this process's GPU (if it has one) still takes work after a session"""
    import tvm

    try:
        device = tvm.cuda(0)
        if device.exist:
            device.sync()
        return True
    except Exception:  # noqa: BLE001 - a sticky CUDA error: this process is done
        return False


def worker_main(conn) -> None:
    """entry point of the spawned worker: register the PIT functions, then serve every
    connection the server sends, answering whether the device is still usable after each"""
    from tvm.rpc import server

    from pit_tvm.tuning._worker import register_server_functions

    register_server_functions()
    while True:
        try:
            load_library, work_dir = conn.recv()
        except EOFError:                  # the server is gone
            return
        sock = socket.socket(fileno=reduction.recv_handle(conn))
        os.chdir(work_dir)                # uploaded files of different sessions never meet
        try:
            server._serve_loop(sock, load_library, _WorkDir(work_dir))
        finally:
            sock.detach()                 # TVM's server loop closes the connection itself
        usable = _device_usable()
        conn.send(usable)
        if not usable:
            return


class SessionWorker:
    """One spawned :func:`worker_main` process and the pipe to it."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child_conn,), daemon=True)
        self.proc.start()
        child_conn.close()

    def serve(self, sock: socket.socket, load_library, work_dir: str, timeout: float | None) -> str:
        """serve one accepted connection: ``"ok"``, ``"timeout"`` (still running after
        ``timeout`` seconds), ``"died"`` or ``"unusable"`` (the worker must be replaced)"""
        try:
            self.conn.send((load_library, work_dir))
            reduction.send_handle(self.conn, sock.fileno(), self.proc.pid)
        except OSError:                   # the worker is gone (its end of the pipe is closed)
            return "died"
        if not self.conn.poll(timeout):
            return "timeout"
        try:
            usable = self.conn.recv()
        except EOFError:
            return "died"
        return "ok" if usable else "unusable"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.join(5.0)
        self.conn.close()


_current: dict = {}


def start_worker() -> None:
    """start the server's session worker now, so that it is ready for the first session"""
    if "worker" not in _current:
        _current["worker"] = SessionWorker()


def serve_connection(sock, addr, opts, load_library) -> None:
    """``tvm.rpc.server._serving`` for a PIT server: the session runs in the reused worker"""
    from tvm.support import utils
    from tvm.rpc import _ffi_api

    logger.info("connected from %s", addr)
    start_worker()
    work = utils.tempdir()
    timeout = opts.get("timeout")
    outcome = _current["worker"].serve(sock, load_library, work.path, timeout)
    if outcome == "timeout":
        _ffi_api.ReturnException(sock.fileno(), f"RPCSessionTimeoutError: Your {timeout}s session has expired, "
                                                 'try to increase the "session_timeout" value.')
    if outcome != "ok":
        logger.info("session worker %s: starting a new one", outcome)
        _current.pop("worker").stop()
        start_worker()
    work.remove()
    sock.close()
