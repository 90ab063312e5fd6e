"""How many threads TVM's CPU thread pool starts: one per physical core this process may use.

TVM sizes its pool, when neither ``TVM_NUM_THREADS`` nor ``OMP_NUM_THREADS`` is set, as half
the hardware threads on x86 (it assumes two hyper-threads per core).  On a machine whose
cores have one thread each (most cloud VMs) that is half the cores: on a 2-core VM every
parallel kernel ran on one core.  ``import pit_tvm`` sets ``TVM_NUM_THREADS`` to the physical
cores of the process's CPU affinity when the user set neither variable; the pool reads it when
it starts (the first parallel kernel), so a value the user sets before that still wins.
"""
from __future__ import annotations

import os
from pathlib import Path

#: the variables TVM's thread pool reads, in its order
THREAD_VARIABLES = ("TVM_NUM_THREADS", "OMP_NUM_THREADS")


def physical_cores(cpus=None, sysfs: Path = Path("/sys/devices/system/cpu")) -> int | None:
    """The physical cores among ``cpus`` (default: this process's CPU affinity): CPUs sharing a
    core (``topology/core_cpus_list``, or ``thread_siblings_list`` on older kernels) count once.
    None where the topology cannot be read (not Linux)."""
    if cpus is None:
        if not hasattr(os, "sched_getaffinity"):
            return None
        cpus = os.sched_getaffinity(0)
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        for name in ("core_cpus_list", "thread_siblings_list"):
            try:
                cores.add((topology / name).read_text().strip())
                break
            except OSError:
                continue
        else:
            return None
    return len(cores) or None


def use_physical_cores(environ=os.environ) -> None:
    """Set ``TVM_NUM_THREADS`` to :func:`physical_cores` unless a thread variable is set."""
    if any(environ.get(v) for v in THREAD_VARIABLES):
        return
    cores = physical_cores()
    if cores:
        environ["TVM_NUM_THREADS"] = str(cores)
