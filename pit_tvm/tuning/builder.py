"""The tuning builder: MetaSchedule's ``LocalBuilder`` work, in worker processes that outlive a batch.

``LocalBuilder`` starts a fresh pool of worker processes for every batch of candidates (TVM's
comment: a memory leak in long-lived workers), and each fresh worker pays for importing TVM
(7.5 s on the H200 box, where the import also initialises CUDA) before its first compile.
:class:`PooledBuilder` keeps its pool from batch to batch and recycles each worker after
:data:`BUILDS_PER_WORKER` builds instead, which bounds the leak; :func:`close_builder` ends the
pool when a search is done (the pool's own destructor may deadlock at garbage collection).
"""
from __future__ import annotations

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder.local_builder import _serialize_params, _worker_func
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

#: builds a worker runs before it is replaced by a fresh one
BUILDS_PER_WORKER = 64


@derived_object
class PooledBuilder(ms.builder.PyBuilder):
    """``LocalBuilder``'s builds (``f_build`` then ``f_export`` on each candidate, in ``max_workers``
    processes, ``timeout_sec`` each) in a pool kept across batches until :meth:`close`."""

    def __init__(self, max_workers: int, timeout_sec: float, f_build, f_export,
                 builds_per_worker: int = BUILDS_PER_WORKER) -> None:
        super().__init__()
        self.max_workers, self.timeout_sec = max_workers, timeout_sec
        self.f_build, self.f_export = f_build, f_export
        self.builds_per_worker = builds_per_worker
        self.pool = None

    def build(self, build_inputs):
        if self.pool is None:
            self.pool = PopenPoolExecutor(max_workers=self.max_workers, timeout=self.timeout_sec,
                                          maximum_process_uses=self.builds_per_worker)
        jobs = [(self.f_build, self.f_export, b.mod, b.target, _serialize_params(b.params)) for b in build_inputs]
        results = []
        for outcome in self.pool.map_with_error_catching(lambda job: _worker_func(*job), jobs):
            if outcome.status == StatusKind.COMPLETE:
                results.append(ms.builder.BuilderResult(outcome.value, None))
            elif outcome.status == StatusKind.TIMEOUT:
                results.append(ms.builder.BuilderResult(
                    None, f"PooledBuilder: Timeout, killed after {self.timeout_sec} seconds"))
            else:
                results.append(ms.builder.BuilderResult(
                    None, f"PooledBuilder: An exception occurred\n{outcome.value}"))
        return results

    def close(self) -> None:
        """Stop the worker processes (a later :meth:`build` starts new ones)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


def default_builder(max_workers: int):
    """The builder of ``pit-tvm tune``: :class:`PooledBuilder` over ``max_workers`` processes,
    compiling with :func:`pit_tvm.tuning._worker.build_module` into linked ``.so`` files."""
    from pit_tvm.tuning._worker import build_module, export_shared

    return PooledBuilder(max_workers, 600, build_module, export_shared)


def close_builder(builder) -> None:
    """:meth:`PooledBuilder.close` of ``builder`` or of the builder it wraps (``inner``); other
    builders keep no processes between batches and are left as they are."""
    while builder is not None:
        if isinstance(builder, PooledBuilder):
            builder.close()
            return
        builder = getattr(builder, "inner", None)
