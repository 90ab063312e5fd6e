"""TVM's CPU thread pool gets one thread per physical core (pit_tvm.threads): TVM alone would
take half the hardware threads on x86, one core of a 2-core VM."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pit_tvm.threads import physical_cores, use_physical_cores


def _fake_sysfs(tmp_path, core_of_cpu: dict[int, str]):
    for cpu, core in core_of_cpu.items():
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "core_cpus_list").write_text(core + "\n")
    return tmp_path


@pytest.mark.parametrize("core_of_cpu, cpus, cores", [
    ({0: "0", 1: "1"}, {0, 1}, 2),                        # a VM: one thread per core
    ({0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}, {0, 1, 2, 3}, 2),   # two hyper-threads per core
    ({0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}, {0, 2}, 1),          # affinity to one core's threads
])
def test_physical_cores_counts_each_core_once(tmp_path, core_of_cpu, cpus, cores):
    assert physical_cores(cpus, _fake_sysfs(tmp_path, core_of_cpu)) == cores


def test_unreadable_topology_is_none(tmp_path):
    assert physical_cores({0, 1}, tmp_path) is None


@pytest.mark.parametrize("variable", ["TVM_NUM_THREADS", "OMP_NUM_THREADS"])
def test_a_thread_count_the_user_set_is_kept(variable):
    environ = {variable: "3"}
    use_physical_cores(environ)
    assert environ == {variable: "3"}


def _pool_threads(**env) -> int:
    """TVM's CPU pool size in a fresh process that imports pit_tvm first, with ``env``"""
    clean = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    code = "import pit_tvm, tvm; print(tvm.get_global_func('runtime.NumThreads')())"
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return int(out.stdout.strip().splitlines()[-1])


def test_tvm_pool_runs_one_thread_per_physical_core():
    assert _pool_threads() == physical_cores()
    assert _pool_threads(TVM_NUM_THREADS="1") == 1
