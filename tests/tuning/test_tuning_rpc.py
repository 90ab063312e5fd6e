"""Tuning through TVM's RPC tracker (pit_tvm.tuning.rpc, ``pit-tvm tune --rpc / --servers``).

On localhost with the llvm target (CPU servers; the same runner hooks as on GPUs): a tracker and
two servers of :class:`LocalCluster` serve ``--rpc``; the launcher (``--servers 2``) starts and
stops its own.  Checked: the databases hold measured records whose best kernel builds and
matches numpy; the remote arguments are the local runner's valid index; the errors (no
tracker, wrong key with the keys listed, a server without the flush); a server killed mid-run
(the run goes on on the other, earlier records untouched); no process left behind, also after
an error inside the launcher and a Ctrl-C of a process holding a cluster.
"""
from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import tvm
from tvm import rpc
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from pit_tvm.testing import rows_index
from pit_tvm.cli.main import main as cli_main
from pit_tvm.tuning import space as S
from pit_tvm.tuning._worker import alloc_pit_arguments, rpc_alloc_pit_arguments, rpc_run_evaluator_cold_l2
from pit_tvm.tuning.rpc import LocalCluster, RpcError, check_tracker, free_port, rpc_runner, tracker_servers
from pit_tvm.tuning.tune import tune_matmul

K, N, M = 64, 64, 40          # M not a multiple of 16 (tuning_workload)
KEY = "pit-test"
TUNE = ["tune", "--k", str(K), "--n", str(N), "--m", str(M), "--target", "llvm",
        "--trials-per-iter", "3", "--rpc-timeout", "60"]
ROOT = Path(__file__).resolve().parents[2]


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _alive(pids) -> list[int]:
    """those of ``pids`` still running (zombies waiting for their parent count as gone)"""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _group_pids(procs) -> set[int]:
    """the started processes and every descendant (PopenWorkers, session processes)"""
    pids = set()
    for proc in procs:
        pids.add(proc.pid)
        try:
            pids |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return pids


def _records(db_dir: Path) -> list[str]:
    return [x for x in (db_dir / "database_tuning_record.json").read_text().splitlines() if x.strip()]


def _measured(line: str) -> bool:
    secs = json.loads(line)[1][1] or []
    return bool(secs) and all(0 < float(x) < 1e9 for x in secs)


@derived_object
class _KillServerOnFirstBatch(ms.runner.PyRunner):
    """submits the first batch, waits until both servers hold a session (none is free at the
    tracker), then SIGKILLs one server's process group"""

    def __init__(self, inner, proc, tracker) -> None:
        super().__init__()
        self.inner, self.proc, self.tracker = inner, proc, tracker
        self.killed_at, self.both_busy = None, False

    def run(self, runner_inputs):
        futures = self.inner.run(runner_inputs)
        if self.killed_at is None:
            session = rpc.connect_tracker(*self.tracker)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not self.both_busy:
                self.both_busy = session.summary()["queue_info"].get(KEY, {}).get("free", 2) == 0
                time.sleep(0.01)
            time.sleep(0.3)       # into the sessions (each times 400 runs after a 32 MiB flush)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.killed_at = len(runner_inputs)
        return futures


def _remote_and_local_arguments(cluster) -> dict:
    """{workload: [(the RPC runner's arguments on a server, the local runner's)] per
    repetition}, as numpy; the session is released on return"""
    session = rpc.connect_tracker(cluster.host, cluster.port).request(KEY, session_timeout=60)
    rows = ms.arg_info.ArgInfo.from_prim_func(S.tuning_workload(K, N, "float16", "float16", M))
    tiles = ms.arg_info.ArgInfo.from_prim_func(S.tiles_tuning_workload(256, N, (16, 32), "float16", "float16", M))
    out = {}
    for name, info in (("rows", rows), ("tiles", tiles)):
        info = [a.as_json() for a in info]
        remote = rpc_alloc_pit_arguments(session, session.cpu(0), info, 2, density=0.5)
        local = alloc_pit_arguments(tvm.cpu(0), info, 2, density=0.5)
        out[name] = [([a.numpy() for a in r], [a.numpy() for a in loc]) for r, loc in zip(remote, local)]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every tune of this module (MetaSchedule's loggers are set up per process): --rpc through
    the CLI, the remote arguments, the error paths, a server killed mid-run, the launcher."""
    root = tmp_path_factory.mktemp("rpc_logs")
    before = _children()
    out = {"stopped": []}
    stop = LocalCluster.stop

    def recording_stop(self):      # every process a cluster started, recorded before it stops them
        out["stopped"].append(_group_pids(self.procs))
        stop(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalCluster, "stop", recording_stop)
        _tune_all(root, out)
    out["left"] = _children() - before
    return out


def _tune_all(root: Path, out: dict) -> None:
    with LocalCluster(2, gpus=False, key=KEY) as cluster:
        out["servers"] = tracker_servers(cluster.host, cluster.port, KEY)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):      # the progress bar
            out["rpc_rc"] = cli_main(TUNE + ["--trials", "6", "--rpc", cluster.tracker, "--key", KEY,
                                             "--work-dir", str(root / "rpc")])
        out["rpc_bar"] = err.getvalue()
        out["rpc_db"] = root / "rpc" / "cpu" / f"cpu_matmul_k{K}_n{N}_float16"
        out["rpc_lines"] = _records(out["rpc_db"])

        out["args"] = _remote_and_local_arguments(cluster)
        gc.collect()              # the session is closed: both servers free again
        tracker = rpc.connect_tracker(cluster.host, cluster.port)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and tracker.summary()["queue_info"][KEY]["free"] < 2:
            time.sleep(0.1)

        # a server killed while its sessions run: resume the --rpc database
        out["before_kill"] = _records(out["rpc_db"])
        inner = rpc_runner(cluster.host, cluster.port, KEY, number=20, repeat=20, session_timeout=60)
        killer = _KillServerOnFirstBatch(inner, cluster.procs[2], (cluster.host, cluster.port))
        tune_matmul(K, N, "float16", "llvm", trials=6, work_dir=root / "rpc", m=M, trials_per_iter=3,
                    runner=killer, progress=False)
        inner.shutdown()
        out["killed_at"], out["both_busy"] = killer.killed_at, killer.both_busy
        out["retried"], out["retry_errors"] = inner.retried, inner.errors
        out["after_kill"] = _records(out["rpc_db"])
        out["servers_after_kill"] = tracker_servers(cluster.host, cluster.port, KEY)

    # the launcher: its own tracker and two CPU servers, stopped at the end
    out["launch_rc"] = cli_main(TUNE + ["--trials", "3", "--servers", "2", "--no-progress",
                                        "--work-dir", str(root / "launch")])
    out["launch_lines"] = _records(root / "launch" / "cpu" / f"cpu_matmul_k{K}_n{N}_float16")
    # an error inside the launcher's block (llvm tunes whole rows only)
    out["launch_error_rc"] = cli_main(TUNE + ["--trials", "3", "--servers", "1", "--micro-tile", "16x32",
                                              "--no-progress", "--work-dir", str(root / "err")])


def test_rpc_tune_writes_measured_records_with_progress(runs):
    assert runs["servers"][0] == 2 and KEY in runs["servers"][1]
    assert runs["rpc_rc"] == 0
    measured = [x for x in runs["rpc_lines"] if _measured(x)]
    assert len(measured) >= 3, runs["rpc_lines"]
    bar = runs["rpc_bar"]
    assert "best_us=" in bar and f"servers=2 x {KEY}@127.0.0.1:" in bar


def test_rpc_database_best_kernel_builds_and_matches_numpy(runs):
    """the best record's trace replays on the workload, builds for llvm and computes the PIT
    matmul (listed rows gathered, the others zero) for a random index"""
    db = ms.database.JSONDatabase(work_dir=str(runs["rpc_db"]))
    workload = S.tuning_workload(K, N, "float16", "float16", M)
    (best,) = db.get_top_k(db.commit_workload(tvm.IRModule({"main": workload})), 1)
    assert _measured(json.dumps([0, best.as_json()]))
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": workload}))
    best.trace.apply_to_schedule(sch, remove_postproc=False)
    ex = tvm.compile(sch.mod, target="llvm")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K)).astype("float16")
    b = (rng.standard_normal((K, N)) / 8).astype("float16")
    offsets, ids = rows_index(rng.random(M) < 0.6)
    c = tvm.runtime.tensor(np.full((M, N), 7, "float16"))
    ex["main"](*(tvm.runtime.tensor(x) for x in (a, b, offsets, ids)), c)
    ref = np.zeros((M, N), np.float32)
    listed = ids[: offsets[1]]
    ref[listed] = a[listed].astype(np.float32) @ b.astype(np.float32)
    np.testing.assert_allclose(c.numpy().astype(np.float32), ref, rtol=2e-2, atol=2e-2)


def test_rpc_arguments_are_the_local_runners_valid_index(runs):
    for name, reps in runs["args"].items():
        for rep, (remote, local) in enumerate(reps):
            assert [x.shape for x in remote] == [x.shape for x in local]
            np.testing.assert_array_equal(remote[2], local[2])      # offsets
            np.testing.assert_array_equal(remote[3], local[3])      # ids
            offsets, ids = remote[2], remote[3]
            if name == "rows":
                assert offsets.tolist() == [0, M] and ids.tolist() == list(range(M))
            else:
                strips, per = len(offsets) - 1, len(ids) // (len(offsets) - 1)
                for g in range(strips):
                    listed = ids[offsets[g]:offsets[g + 1]]
                    assert len(listed) == round(0.5 * per) and np.all(np.diff(listed) > 0)
                    assert listed.min() >= 0 and listed.max() < per
            for x in remote[:2]:                 # A, B filled on the server
                assert np.isfinite(x.astype(np.float32)).all() and np.abs(x.astype(np.float32)).max() > 0


def test_server_killed_mid_run_the_run_goes_on(runs):
    before, after = runs["before_kill"], runs["after_kill"]
    assert runs["killed_at"] is not None and runs["both_busy"]
    assert runs["retried"] >= 1, runs["retry_errors"]     # the killed server's session, measured again
    assert after[:len(before)] == before                 # nothing already in the database is lost
    new = after[len(before):]
    assert new and sum(_measured(x) for x in new) >= 3    # measured on the surviving server
    assert runs["servers_after_kill"][0] == 1


def test_launcher_tunes_and_leaves_no_process(runs):
    assert runs["launch_rc"] == 0 and any(_measured(x) for x in runs["launch_lines"])
    assert runs["launch_error_rc"] == 2
    # three clusters: the --rpc one, the launcher's, the launcher's that met an error
    assert len(runs["stopped"]) == 3
    assert [len(pids) >= n + 1 for pids, n in zip(runs["stopped"], (2, 2, 1))] == [True] * 3
    assert [_alive(pids) for pids in runs["stopped"]] == [[], [], []]
    assert runs["left"] == set()


def test_unreachable_tracker_is_a_clear_error():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(RpcError, match=f"cannot reach the RPC tracker at 127.0.0.1:{port}"):
        check_tracker("127.0.0.1", port, KEY, timeout=2.0)
    assert time.monotonic() - start < 10


def test_cli_rpc_errors(capsys):
    port = free_port()
    assert cli_main(TUNE + ["--trials", "2", "--rpc", f"127.0.0.1:{port}", "--key", KEY]) == 2
    assert "cannot reach the RPC tracker" in capsys.readouterr().err
    assert cli_main(TUNE + ["--trials", "2", "--rpc", "127.0.0.1", "--key", KEY]) == 2
    assert "expected HOST:PORT" in capsys.readouterr().err
    assert cli_main(TUNE + ["--trials", "2", "--rpc", f"127.0.0.1:{port}"]) == 2
    assert "--rpc needs --key" in capsys.readouterr().err
    assert cli_main(TUNE + ["--trials", "2", "--rpc", f"127.0.0.1:{port}", "--key", KEY, "--servers", "2"]) == 2
    assert "pass one of them" in capsys.readouterr().err


def test_wrong_key_lists_the_trackers_keys():
    with LocalCluster(1, gpus=False, key="pit-other") as cluster:
        with pytest.raises(RpcError, match=r"no server under key 'h100' \(its keys: 'pit-other'\)"):
            check_tracker(cluster.host, cluster.port, "h100")


class _SessionWithout:
    def get_function(self, name):
        raise AttributeError(f"RPC server has no function {name}")


def test_server_without_the_flush_says_how_to_start_it():
    with pytest.raises(RuntimeError, match="python -m pit_tvm.tuning.rpc_server"):
        rpc_run_evaluator_cold_l2(_SessionWithout(), None, None, None, [])


def test_ctrl_c_stops_the_cluster():
    """a process holding a LocalCluster, interrupted as by Ctrl-C: tracker and server gone (the
    process takes SIGINT as a shell's child does, whatever the test process left blocked or ignored)"""
    code = ("import signal, time\n"
            "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from pit_tvm.tuning.rpc import LocalCluster\n"
            "with LocalCluster(1, gpus=False, key='ctrl-c') as c:\n"
            "    print(' '.join(str(p.pid) for p in c.procs), flush=True)\n"
            "    time.sleep(300)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        group = {c.pid for p in pids for c in psutil.Process(p).children(recursive=True)} | set(pids)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with open(f"/proc/{proc.pid}/status") as f:
                signals = [line.strip() for line in f if line.startswith("Sig")]
            pytest.fail(f"the interrupted process still runs after 60 s ({signals})")
    finally:
        if proc.poll() is None:
            proc.kill()
            for pid in _alive(group):           # (a failed run leaves no cluster behind)
                psutil.Process(pid).kill()
    assert proc.returncode != 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(group):
        time.sleep(0.2)
    assert _alive(group) == []


@pytest.mark.gpu
def test_gpu_every_space_tunes_through_local_gpu_servers(tmp_path):
    """On the GPU box: the wgmma rows / tiles kernels and the mma.sync rows / tiles schedules,
    each tuned for a few trials through one server per GPU (at most 2): measured records whose
    best config replays, and no server left.  (All in one test: MetaSchedule's loggers.)"""
    from pit_tvm.tuning.rpc import _cuda_device_count
    from pit_tvm.tuning.tune import best_record

    if _cuda_device_count() == 0:
        pytest.skip("no CUDA device")
    before = _children()
    cases = [("cuda", (1, None)), ("cuda", (32, 64)), ("cuda:sm_90", (1, None)), ("cuda:sm_90", (32, 64))]
    with LocalCluster(min(2, _cuda_device_count()), gpus=True, key="pit-gpu-test") as cluster:
        runner = rpc_runner(cluster.host, cluster.port, cluster.key, session_timeout=120)
        try:
            for target, micro_tile in cases:
                path = tune_matmul(512, 256, "float16", target, trials=4, trials_per_iter=4, population_size=16,
                                   micro_tile=micro_tile, work_dir=tmp_path, runner=runner, progress=False)
                lines = _records(path)
                assert sum(_measured(x) for x in lines) >= 2, (target, micro_tile, lines[:2])
                best = best_record(path, 512, 256, "float16", target, micro_tile=micro_tile)
                assert best is not None and 0 < best.run_secs < 1e-2, (target, micro_tile)
        finally:
            runner.shutdown()
    assert _children() - before == set()


def test_sessions_run_one_after_another_in_one_reused_worker():
    """every session of a server runs in the same spawned worker (CUDA is started once per
    server, not per candidate), which has the flush registered, and each session gets a
    fresh working folder"""
    with LocalCluster(1, gpus=False, key="reuse") as cluster:
        server = psutil.Process(cluster.procs[1].pid)
        workers = []
        for i in range(3):
            sess = rpc.connect_tracker(cluster.host, cluster.port).request("reuse", session_timeout=30)
            data = tvm.runtime.tensor(np.arange(64, dtype="uint8"), sess.cpu(0))
            sess.get_function("pit.flush_l2")(data)
            if i == 0:
                sess.upload(bytearray(b"first"), "left_by_session_0.txt")
            else:
                with pytest.raises(Exception):
                    sess.download("left_by_session_0.txt")
            np.testing.assert_array_equal(data.numpy(), np.arange(64, dtype="uint8"))
            workers.append({p.pid for p in server.children(recursive=True)})
            del data, sess
    assert len(workers[0]) >= 1 and workers[0] == workers[1] == workers[2], workers


def test_a_worker_that_fails_a_session_is_replaced(monkeypatch):
    """a session that timed out, killed its worker or left the device unusable costs the
    worker: the next session gets a new one; a session that went well keeps it"""
    from pit_tvm.tuning import _session_worker as sw

    outcomes, started, stopped = iter(["ok", "died", "timeout", "unusable"]), [], []

    class FakeWorker:
        def __init__(self):
            started.append(self)

        def serve(self, sock, load_library, work_dir, timeout):
            assert os.path.isdir(work_dir) and timeout == 5.0
            return next(outcomes)

        def stop(self):
            stopped.append(self)

    returned = []
    monkeypatch.setattr(sw, "SessionWorker", FakeWorker)
    monkeypatch.setattr(sw, "_current", {})
    from tvm.rpc import _ffi_api
    monkeypatch.setattr(_ffi_api, "ReturnException", lambda fd, msg: returned.append(msg))

    class Sock:
        def fileno(self):
            return -1

        def close(self):
            pass

    for _ in range(4):
        sw.serve_connection(Sock(), ("127.0.0.1", 1), {"timeout": 5.0}, None)
    assert len(started) == 4 and stopped == started[:3]
    assert len(returned) == 1 and "session has expired" in returned[0]


def _listening():
    import socket  # noqa: PLC0415

    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    return server


def _nodelay(sock) -> bool:
    import socket  # noqa: PLC0415

    return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


def test_tracker_requests_leave_without_nagle_delay():
    """the runner's session hook turns Nagle's algorithm off on its tracker socket, then asks the
    tracker for a session under the config's key, priority and timeout"""
    import socket  # noqa: PLC0415

    from pit_tvm.tuning._worker import rpc_create_session  # noqa: PLC0415

    server = _listening()
    sock = socket.create_connection(server.getsockname())
    asked = {}

    class Tracker:
        _sock = sock

        def request(self, **kw):
            asked.update(kw)
            return "session"

    from types import SimpleNamespace  # noqa: PLC0415

    # (the fields of MetaSchedule's RPCConfig that the hook reads)
    config = SimpleNamespace(tracker_key="k", session_priority=3, session_timeout_sec=9, connect_tracker=Tracker)
    assert not _nodelay(sock)
    assert rpc_create_session(config) == "session"
    assert _nodelay(sock) and asked == {"key": "k", "priority": 3, "session_timeout": 9}
    sock.close()
    server.close()


def test_server_process_talks_to_the_tracker_without_nagle_delay(monkeypatch):
    """after the server's init callback, its tracker connections (``base.connect_with_retry``)
    have Nagle's algorithm off, and a second call does not wrap the function again"""
    from tvm.rpc import base, server  # noqa: PLC0415

    from pit_tvm.tuning import _session_worker, rpc_server  # noqa: PLC0415

    monkeypatch.setattr(base, "connect_with_retry", base.connect_with_retry)
    monkeypatch.setattr(server, "_serving", server._serving)
    monkeypatch.setattr(_session_worker, "start_worker", lambda: None)
    rpc_server.init_server_process()
    wrapped = base.connect_with_retry
    rpc_server.init_server_process()
    assert base.connect_with_retry is wrapped
    listener = _listening()
    sock = base.connect_with_retry(listener.getsockname())
    assert _nodelay(sock)
    sock.close()
    listener.close()


def test_tracker_answers_without_nagle_delay(monkeypatch):
    """``python -m pit_tvm.tuning.rpc_tracker`` hands TVM's tracker each accepted connection
    with Nagle's algorithm off, and patching twice does not wrap it again"""
    import socket  # noqa: PLC0415

    from tvm.rpc import tracker  # noqa: PLC0415

    from pit_tvm.tuning.rpc_tracker import answer_without_delay  # noqa: PLC0415

    handed = []
    monkeypatch.setattr(tracker.TCPEventHandler, "__init__",
                        lambda self, handler, sock, addr: handed.append((handler, sock, addr)))
    answer_without_delay()
    wrapped = tracker.TCPEventHandler.__init__
    answer_without_delay()
    assert tracker.TCPEventHandler.__init__ is wrapped
    listener = _listening()
    client = socket.create_connection(listener.getsockname())
    accepted, addr = listener.accept()
    assert not _nodelay(accepted)
    tracker.TCPEventHandler.__new__(tracker.TCPEventHandler).__init__("tracker", accepted, addr)
    assert handed == [("tracker", accepted, addr)] and _nodelay(accepted)
    for s in (client, accepted, listener):
        s.close()


def test_server_keeps_a_tasks_arguments_between_sessions():
    """a PIT server fills a task's inputs once: the next session of the same task gets the
    same contents (the server's random fill differs call to call), the output freshly
    allocated; another task's are filled for it, and the first task's are still kept after
    it, up to KEPT_TASKS tasks (then the least recently used is filled anew)"""
    from pit_tvm.tuning import _worker  # noqa: PLC0415

    tiles = [a.as_json() for a in ms.arg_info.ArgInfo.from_prim_func(
        S.tiles_tuning_workload(256, N, (16, 32), "float16", "float16", M))]
    rows = [a.as_json() for a in ms.arg_info.ArgInfo.from_prim_func(S.tuning_workload(K, N, "float16", "float16", M))]
    with LocalCluster(1, gpus=False, key="pit-cache") as cluster:
        def arguments(info):
            session = rpc.connect_tracker(cluster.host, cluster.port).request("pit-cache", session_timeout=60)
            try:
                return [[a.numpy() for a in rep] for rep in rpc_alloc_pit_arguments(session, session.cpu(0), info, 2)]
            finally:
                del session
                gc.collect()

        first, again, other, back = arguments(tiles), arguments(tiles), arguments(rows), arguments(tiles)
        # more tasks than the server keeps (the rows workload at other densities): tiles' is dropped
        for density in range(_worker.KEPT_TASKS):
            session = rpc.connect_tracker(cluster.host, cluster.port).request("pit-cache", session_timeout=60)
            rpc_alloc_pit_arguments(session, session.cpu(0), rows, 2, density=0.1 * (density + 1))
            del session
            gc.collect()
        dropped = arguments(tiles)
    for kept in (again, back):
        for rep in range(2):
            for i in range(4):              # A, B, offsets, ids
                np.testing.assert_array_equal(kept[rep][i], first[rep][i])
            assert kept[rep][4].shape == first[rep][4].shape
    assert not np.array_equal(dropped[0][0], first[0][0])       # filled anew
    np.testing.assert_array_equal(dropped[0][3], first[0][3])   # (the index is drawn the same way)
    assert np.abs(other[0][0].astype(np.float32)).max() > 0
