"""Tuning measured on several GPUs (one box or several) through TVM's RPC tracker.

TVM's engine does the distribution: a tracker (``python -m tvm.exec.rpc_tracker``, or
:mod:`pit_tvm.tuning.rpc_tracker`: the same without Nagle's delay on its replies) hands
each measurement to a free RPC server registered under a device key, and MetaSchedule's
``RPCRunner`` keeps one session per server busy.  What is PIT's here:

- :func:`rpc_runner`: an ``RPCRunner`` whose argument and timing hooks are the local runner's
  (:func:`~pit_tvm.tuning._worker.rpc_alloc_pit_arguments`: a valid index for the sparse
  workloads, sent to the server, the inputs kept there for the task's next candidates;
  :func:`~pit_tvm.tuning._worker.rpc_run_evaluator_cold_l2`:
  every timed run after a cache flush, which runs on the server) and tracker requests sent
  without Nagle's delay (:func:`~pit_tvm.tuning._worker.rpc_create_session`), after
  :func:`check_tracker` says the tracker answers and has servers under the key; wrapped in
  :class:`RetryingRunner` (a candidate whose session failed, e.g. its server died, is
  measured once more on another server; failing again, it is recorded as failed).
- :class:`LocalCluster`: on one box, a tracker (:mod:`pit_tvm.tuning.rpc_tracker`) and one
  server per GPU (each pinned with ``CUDA_VISIBLE_DEVICES``; on a CPU target, N CPU servers),
  stopped when the block exits, also on Ctrl-C, SIGTERM and errors.

Servers must be started with ``python -m pit_tvm.tuning.rpc_server`` (it registers the flush
function the timing calls on the server, and the argument cache).
"""
from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from pit_tvm.tuning._worker import (rpc_alloc_pit_arguments, rpc_create_session, rpc_run_evaluator_cold_l2,
                                    warm_runner_worker)
from pit_tvm.tuning.rpc_server import parse_tracker

__all__ = ["RpcError", "check_tracker", "rpc_runner", "RetryingRunner", "LocalCluster",
           "parse_tracker", "free_port", "DEFAULT_KEY"]

#: the key ``pit-tvm tune --gpus`` registers its servers under
DEFAULT_KEY = "pit-local"


class RpcError(RuntimeError):
    """The tracker is unreachable, has no server under the key, or a server did not start."""


def _tracker_session(host: str, port: int, timeout: float):
    """``tvm.rpc.connect_tracker`` after a plain TCP probe (TVM's connect retries for a
    minute; the probe fails in ``timeout`` seconds with the address in the message)"""
    from tvm import rpc  # noqa: PLC0415

    try:
        with closing(socket.create_connection((host, int(port)), timeout=timeout)):
            pass
    except OSError as err:
        raise RpcError(f"cannot reach the RPC tracker at {host}:{port} ({err.strerror or err}): start "
                       f"one with `python -m pit_tvm.tuning.rpc_tracker --host 0.0.0.0 --port {port}`, "
                       "or pass --gpus N to start a tracker and servers on this machine") from err
    try:
        return rpc.connect_tracker(host, int(port))
    except Exception as err:  # noqa: BLE001 - not a tracker, or it closed the connection
        raise RpcError(f"{host}:{port} does not answer as an RPC tracker: {err}") from err


def tracker_servers(host: str, port: int, key: str, timeout: float = 5.0) -> tuple[int, list[str]]:
    """(servers registered under ``key``, free or busy; every key the tracker has servers under)"""
    summary = _tracker_session(host, port, timeout).summary()
    keys = {}
    for info in summary.get("server_info", []):
        k = str(info.get("key", ""))
        if k.startswith("server:"):
            k = k[len("server:"):]
            keys[k] = keys.get(k, 0) + 1
    return keys.get(key, 0), sorted(keys)


def check_tracker(host: str, port: int, key: str, timeout: float = 5.0) -> int:
    """The number of servers under ``key`` at the tracker ``host:port``; :class:`RpcError`
    naming the problem when it is unreachable or has none (with the keys it has)."""
    count, keys = tracker_servers(host, port, key, timeout)
    if count == 0:
        have = ", ".join(repr(k) for k in keys) if keys else "none: no server is registered"
        raise RpcError(f"the RPC tracker at {host}:{port} has no server under key {key!r} (its keys: "
                       f"{have}); start servers with `python -m pit_tvm.tuning.rpc_server "
                       f"--tracker {host}:{port} --key {key}`")
    return count


@derived_object
class RetryingRunner(ms.runner.PyRunner):
    """A runner that measures a candidate once more when its run failed for a reason other
    than a timeout (a server that died mid-session, a dropped connection): the tracker then
    hands it to another server.  Failing twice, it is recorded as failed, like any failed
    run; the search goes on, and records already in the database are never touched."""

    def __init__(self, inner, retries: int = 1) -> None:
        super().__init__()
        self.inner = inner
        self.retries = int(retries)
        self.retried = 0
        self.errors: list[str] = []     # the last line of each error that was measured again

    def run(self, runner_inputs):
        return [_RetryFuture(self, inp, fut) for inp, fut in zip(runner_inputs, self.inner.run(runner_inputs))]

    def shutdown(self) -> None:
        """stop the inner runner's worker processes"""
        pool = getattr(self.inner, "pool", None)
        if pool is not None:
            pool.shutdown()


@derived_object
class _RetryFuture(ms.runner.PyRunnerFuture):
    def __init__(self, runner: RetryingRunner, runner_input, future) -> None:
        super().__init__()
        self.runner, self.runner_input, self.future = runner, runner_input, future

    def done(self) -> bool:
        return self.future.done()

    def result(self):
        res = self.future.result()
        tries = 0
        while (res.error_msg is not None and not str(res.error_msg).startswith("RPCRunner: Timeout")
               and tries < self.runner.retries):
            tries += 1
            self.runner.retried += 1
            self.runner.errors.append(str(res.error_msg).strip().splitlines()[-1][:300])
            res = self.runner.inner.run([self.runner_input])[0].result()
        return res


def rpc_runner(host: str, port: int, key: str, *, density: float = 0.5, number: int = 5,
               repeat: int = 3, session_timeout: float = 120.0, workers: int | None = None,
               check_timeout: float = 5.0, f_alloc_argument=None) -> RetryingRunner:
    """A runner measuring through the tracker ``host:port`` on the servers under ``key``,
    with the local runner's argument and cold-cache timing hooks (see the module docstring).
    ``workers`` sessions at a time (default: the servers the tracker has now), each worker
    process started now (:func:`~pit_tvm.tuning._worker.warm_runner_worker`).
    ``f_alloc_argument``: another workload's argument hook (the MoE grouped GEMM's,
    :func:`~pit_tvm.tuning._worker.rpc_alloc_moe_arguments`); default the matmul's."""
    count = check_tracker(host, port, key, check_timeout)    # (a clear error first, workers given or not)
    workers = int(workers or count)
    inner = ms.runner.RPCRunner(
        rpc_config=ms.runner.RPCConfig(tracker_host=host, tracker_port=int(port), tracker_key=key,
                                       session_priority=1, session_timeout_sec=int(session_timeout)),
        evaluator_config=ms.runner.EvaluatorConfig(number=number, repeat=repeat, min_repeat_ms=0,
                                                   enable_cpu_cache_flush=False),
        f_create_session=rpc_create_session,
        f_alloc_argument=f_alloc_argument or functools.partial(rpc_alloc_pit_arguments, density=float(density)),
        f_run_evaluator=rpc_run_evaluator_cold_l2,
        max_workers=workers)
    for _ in range(workers):
        inner.pool.submit(warm_runner_worker, 1.0)
    return RetryingRunner(inner)


def free_port(host: str = "127.0.0.1") -> int:
    """a TCP port free on ``host`` now"""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _cuda_device_count() -> int:
    import tvm  # noqa: PLC0415

    count = 0
    while count < 64 and tvm.cuda(count).exist:
        count += 1
    return count


class LocalCluster:
    """A tracker and ``servers`` RPC servers on this machine, for the ``with`` block.

    ``gpus=True``: server ``i`` sees GPU ``i`` alone (``CUDA_VISIBLE_DEVICES=i``, so its
    ``cuda(0)``); ``servers=None`` then means every GPU.  Without GPUs (a CPU target), the
    servers share the CPU.  Every process is started in its own session (a terminal's Ctrl-C
    reaches the tuner only) and its whole process group is stopped when the block exits, on
    an exception, Ctrl-C or SIGTERM.  The children inherit the environment (``PYTHONPATH``
    included, with this project on it)."""

    def __init__(self, servers: int | None = None, *, gpus: bool = True, key: str = DEFAULT_KEY,
                 host: str = "127.0.0.1", start_timeout: float = 120.0, silent: bool = True) -> None:
        if gpus:
            available = _cuda_device_count()
            if available == 0:
                raise RpcError("--gpus: this machine has no CUDA device (on a CPU target, --servers N "
                               "starts N CPU servers)")
            servers = available if servers is None else int(servers)
            if not 0 < servers <= available:
                raise RpcError(f"asked for {servers} GPU servers, this machine has {available} GPU(s)")
        elif servers is None or int(servers) <= 0:
            raise RpcError(f"the number of local RPC servers must be positive, got {servers}")
        self.servers, self.gpus, self.key, self.host = int(servers), bool(gpus), key, host
        self.start_timeout, self.silent = float(start_timeout), bool(silent)
        self.port: int | None = None
        self.procs: list[subprocess.Popen] = []
        self._old_sigterm = None

    @property
    def tracker(self) -> str:
        return f"{self.host}:{self.port}"

    def _env(self, gpu: int | None) -> dict:
        env = dict(os.environ)
        project = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        paths = env.get("PYTHONPATH", "").split(os.pathsep)
        if project not in paths:
            env["PYTHONPATH"] = os.pathsep.join(p for p in [project, *paths] if p)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        return env

    def _spawn(self, args, gpu=None) -> subprocess.Popen:
        out = subprocess.DEVNULL if self.silent else None
        proc = subprocess.Popen([sys.executable, *args], env=self._env(gpu), stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start(self) -> "LocalCluster":
        import importlib.util  # noqa: PLC0415

        if importlib.util.find_spec("tornado") is None:
            raise RpcError("TVM's RPC tracker needs the tornado package: pip install tornado")
        try:
            self.port = free_port(self.host)
            self._spawn(["-m", "pit_tvm.tuning.rpc_tracker", "--host", self.host, "--port", str(self.port),
                         "--port-end", str(self.port + 1), "--silent"])
            for i in range(self.servers):
                port = free_port(self.host)
                self._spawn(["-m", "pit_tvm.tuning.rpc_server", "--tracker", self.tracker, "--key", self.key,
                             "--host", self.host, "--port", str(port), "--port-end", str(port + 1),
                             "--custom-addr", self.host] + (["--silent"] if self.silent else []),
                            gpu=i if self.gpus else None)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        count = 0
        while time.monotonic() < deadline:
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                raise RpcError(f"a local RPC process exited at start (exit code {dead[0].returncode}): "
                               f"{' '.join(dead[0].args[1:])}")
            try:
                count, _ = tracker_servers(self.host, self.port, self.key, timeout=2.0)
            except RpcError:
                count = 0
            if count >= self.servers:
                return
            time.sleep(0.5)
        raise RpcError(f"{count} of {self.servers} local RPC servers registered with the tracker at "
                       f"{self.tracker} within {self.start_timeout:.0f} s")

    def stop(self) -> None:
        """SIGTERM every process group started here, SIGKILL what is left after 5 s"""
        for proc in self.procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)   # the group's other members too (session children)
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []

    def __enter__(self) -> "LocalCluster":
        import threading  # noqa: PLC0415

        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_exit)
        try:
            return self.start()
        except BaseException:
            self._restore_sigterm()
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None


def _raise_exit(signum, _frame):
    raise SystemExit(128 + signum)


def _signal_group(proc: subprocess.Popen, sig) -> None:
    """``sig`` to the process group of ``proc`` (started with ``start_new_session``: its
    group id is its pid), which holds the PopenWorker and the session processes it forked"""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
