"""The tuning builder keeps its worker processes across batches (pit_tvm.tuning.builder): a fresh
worker pays for importing TVM (7.5 s on the H200 box) before its first compile."""
from __future__ import annotations

import os

import tvm
from tvm.s_tir import meta_schedule as ms
from tvm import te

from pit_tvm.tuning.builder import PooledBuilder, close_builder
from pit_tvm.tuning.space import PitBuilder


def _add_one():
    a = te.placeholder((16,), "float32", name="a")
    b = te.compute((16,), lambda i: a[i] + 1.0, name="b")
    return te.create_prim_func([a, b])


def _inputs(count):
    return [ms.builder.BuilderInput(tvm.IRModule({"main": _add_one()}), tvm.target.Target("llvm"))
            for _ in range(count)]


def _worker_pids(builder, count=2):
    """the process id of the worker that built each of ``count`` candidates (its ``f_export``)"""
    results = builder.build(_inputs(count))
    assert all(r.error_msg is None for r in results), [r.error_msg for r in results]
    return {r.artifact_path for r in results}


def test_workers_outlive_a_batch_until_closed():
    builder = PooledBuilder(1, 120, None, lambda mod: str(os.getpid()))
    try:
        first = _worker_pids(builder)
        assert len(first) == 1 and first != {str(os.getpid())}
        assert _worker_pids(builder) == first            # the next batch: the same worker
        close_builder(PitBuilder(builder))               # (through the tuning wrapper)
        assert builder.pool is None
        assert _worker_pids(builder) != first            # a new pool after close
    finally:
        builder.close()


def test_a_worker_is_replaced_after_its_builds():
    builder = PooledBuilder(1, 120, None, lambda mod: str(os.getpid()), builds_per_worker=1)
    try:
        assert len(_worker_pids(builder, 3)) == 3
    finally:
        builder.close()


def test_a_failed_build_is_a_result_and_the_pool_goes_on():
    def fail(mod, target, params):
        raise RuntimeError("no such kernel")

    builder = PooledBuilder(1, 120, fail, None)
    try:
        (result,) = builder.build(_inputs(1))
        assert result.artifact_path is None and "no such kernel" in result.error_msg
        builder.f_build = None              # the default build: the same pool builds again
        (result,) = builder.build(_inputs(1))
        assert result.error_msg is None and os.path.exists(result.artifact_path)
    finally:
        builder.close()
