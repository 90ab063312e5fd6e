"""Tensor-core PIT kernel for the tiles kind (pit_tvm.schedules.tensorcore_tiles).

CPU part: numerics of the *unscheduled* workload on llvm, CUDA builds + nvcc for sm_80/sm_90,
config validation, the sparse_matmul plug-in.  GPU part (``@pytest.mark.gpu``): the scheduled
kernel against a float32 numpy reference at several sparsities, M not a multiple of mr.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import tvm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pit_tvm.nvcc import check_cuda_compiles, find_nvcc
from pit_tvm.schedules.tensorcore_tiles import (
    TilesConfig,
    build,
    check_tiles_config,
    schedule_tiles_gather_matmul,
    tiles_gather_matmul_func,
    tiles_smem_bytes,
    valid_tiles_configs,
)
from pit_tvm.runtime.loader import numpy_dtype
from pit_tvm.testing import tiles_inputs as make_inputs
from pit_tvm.target import build as target_build


def reference(a, b):
    return a.astype(np.float32) @ b.astype(np.float32)


def run(ex, dev, a, b, offsets, ids, out_dtype, fill=7.0):
    t = lambda x: tvm.runtime.tensor(x, dev)  # noqa: E731
    c = t(np.full((a.shape[0], b.shape[1]), fill, np.float32).astype(numpy_dtype(out_dtype)))
    ex["main"](t(a), t(b), t(offsets), t(ids), c)
    return c.numpy().astype(np.float32)


# ---------------------------------------------------------------------------------------
# CPU: the unscheduled workload
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _cpu_exe(k, n, micro_tile, in_dtype, out_dtype, a_compact=False):
    f = tiles_gather_matmul_func(k, n, micro_tile, in_dtype, out_dtype, a_compact=a_compact)
    return target_build(tvm.IRModule({"main": f}), "llvm")


@pytest.mark.parametrize(
    "m,micro_tile,sparsity,in_dtype,out_dtype,a_compact",
    [
        (70, (32, 8), 0.5, "float16", "float32", False),     # M not a multiple of mr
        (64, (32, 16), 0.0, "float16", "float32", False),    # dense
        (64, (32, 16), 1.0, "float16", "float32", False),    # empty: every row written with 0
        (40, (16, 1), 0.7, "float16", "float16", False),     # 2-byte column gather
        (50, (16, 32), 0.5, "bfloat16", "float32", False),
        (5, (16, 4), 0.3, "float16", "float32", False),      # M < mr
        # A gathered by its own kernel (A_compact) first: ragged strips, dense, empty, M < mr
        (70, (32, 1), 0.8, "float16", "float32", True),
        (64, (32, 1), 0.0, "float16", "float16", True),
        (64, (16, 1), 1.0, "bfloat16", "float32", True),
        (5, (16, 4), 0.3, "float16", "float32", True),
    ],
)
def test_unscheduled_cpu_numerics(m, micro_tile, sparsity, in_dtype, out_dtype, a_compact):
    k, n = 64, 48
    ex = _cpu_exe(k, n, micro_tile, in_dtype, out_dtype, a_compact)
    a, b, offsets, ids = make_inputs(m, k, n, micro_tile, sparsity, in_dtype, seed=m)
    got = run(ex, tvm.cpu(), a, b, offsets, ids, out_dtype)
    tol = 1e-5 if out_dtype == "float32" else 1e-2
    np.testing.assert_allclose(got, reference(a, b), rtol=tol, atol=tol)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 100), micro_tile=st.sampled_from([(16, 1), (32, 1), (16, 4)]),
       sparsity=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_fuzz_compact_a_matches_the_in_kernel_gather(m, micro_tile, sparsity, seed):
    """The A_compact workload (A gathered by its own block first, zero pad) computes what the
    plain tiles workload does, for any M, pattern and thin micro-tile."""
    k, n = 64, 32
    a, b, offsets, ids = make_inputs(m, k, n, micro_tile, sparsity, "float16", seed=seed)
    plain = run(_cpu_exe(k, n, micro_tile, "float16", "float32"), tvm.cpu(), a, b, offsets, ids, "float32")
    compact = run(_cpu_exe(k, n, micro_tile, "float16", "float32", True), tvm.cpu(), a, b, offsets, ids,
                  "float32")
    np.testing.assert_array_equal(compact, plain)
    np.testing.assert_allclose(compact, reference(a, b), rtol=1e-5, atol=1e-4)


def test_unscheduled_uses_only_listed_tiles():
    """Tiles missing from the index contribute nothing, even when A is non-zero there."""
    m, k, n, mt = 64, 64, 32, (32, 16)
    ex = _cpu_exe(k, n, mt, "float16", "float32")
    rng = np.random.default_rng(1)
    a = rng.standard_normal((m, k)).astype(np.float16)
    b = rng.standard_normal((k, n)).astype(np.float16)
    offsets = np.array([0, 1, 3], np.int32)          # strip 0: tile 2; strip 1: tiles 0, 3
    ids = np.array([2, 0, 3, -1, -1, -1, -1, -1], np.int32)
    got = run(ex, tvm.cpu(), a, b, offsets, ids, "float32")
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    ref = np.zeros((m, n), np.float32)
    ref[:32] = a32[:32, 32:48] @ b32[32:48]
    ref[32:] = a32[32:, 0:16] @ b32[0:16] + a32[32:, 48:64] @ b32[48:64]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# CUDA builds (no GPU needed): TVM codegen + nvcc for sm_80 and sm_90
# ---------------------------------------------------------------------------------------
BUILD_CASES = [
    ((32, 64), "float16", "float16", TilesConfig()),
    ((32, 64), "bfloat16", "float32", TilesConfig()),
    ((32, 1), "float16", "float16", TilesConfig()),
    ((32, 1), "bfloat16", "bfloat16", TilesConfig(stages=4)),
    ((32, 64), "float16", "float32", TilesConfig(stages=1)),
    ((64, 64), "float16", "float16", TilesConfig(block_n=256, warp_n=64)),
    ((16, 32), "float16", "float16", TilesConfig(block_n=128, block_k=64, warp_m=16, warp_n=32)),
    ((128, 8), "bfloat16", "float16", TilesConfig(block_n=128, warp_m=64, warp_n=64, stages=4)),
]


def _source(ex):
    return "\n".join(m.inspect_source("cuda") for m in ex.mod.imports)


@pytest.mark.parametrize("micro_tile,in_dtype,out_dtype,cfg", BUILD_CASES)
def test_cuda_build(micro_tile, in_dtype, out_dtype, cfg):
    k, n = 512, 256
    func = schedule_tiles_gather_matmul(
        tiles_gather_matmul_func(k, n, micro_tile, in_dtype, out_dtype), cfg)
    ex = build(func, "cuda")
    src = _source(ex)
    ab = "bf16" if in_dtype == "bfloat16" else "f16"
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32" in src
    assert "ldmatrix.sync.aligned" in src
    if cfg.stages > 1:
        # B rows (and A runs when mk >= 8) are cp.async'ed; wait counts are constants
        assert "cp.async" in src and "cp_async_wait_group" in src
    else:
        assert "cp.async.cg" not in src
    assert "pit_k_steps" in src             # the k loop bound read on the device
    assert "OFF_ptr[" in src
    assert "extern __shared__" in src
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(ex, archs=("sm_80", "sm_90")) >= 2


def test_compact_a_kernel_then_vectorised_a_gather():
    """mk = 1 with a_compact: a separate A_compact kernel, then the GEMM reads A with 16-byte
    cp.async (no 2-byte predicated gather in the GEMM kernel); configs need block_k <= pad."""
    from pit_tvm.schedules.tensorcore_tiles import COMPACT_PAD, needs_compact_a

    assert needs_compact_a((32, 1), "float16") and not needs_compact_a((32, 8), "float16")
    k, n = 512, 256
    func = schedule_tiles_gather_matmul(
        tiles_gather_matmul_func(k, n, (32, 1), "float16", "float16", a_compact=True), TilesConfig())
    src = _source(build(func, "cuda"))
    assert src.count("__global__") == 4           # A_compact + the GEMM (decl + def each)
    gemm = src[src.rindex("__global__"):]
    gemm = gemm if "mma.sync" in gemm else src[src.index("__global__"):src.rindex("__global__")]
    assert "mma.sync" in gemm and "condval" not in gemm
    assert all(c.block_k <= COMPACT_PAD for c in valid_tiles_configs(k, n, (32, 1), a_compact=True))
    with pytest.raises(ValueError, match="COMPACT_PAD"):
        check_tiles_config(k, n, (32, 1), "float16", TilesConfig(block_k=128, stages=1), a_compact=True)
    if find_nvcc() is not None:
        assert check_cuda_compiles(build(func, "cuda"), archs=("sm_80", "sm_90")) >= 2


def test_a_gather_vectorised_when_runs_are_16_bytes():
    k, n = 512, 256
    for mk, vec_a in ((64, True), (8, True), (1, False)):
        func = schedule_tiles_gather_matmul(
            tiles_gather_matmul_func(k, n, (32, mk), "float16", "float16"), TilesConfig())
        src = _source(build(func, "cuda"))
        assert src.count("ptx_cp_async") > 0    # B rows (and A runs) by 16-byte cp.async
        # mk < 8: a predicated 2-byte gather of the A columns (synchronous loads)
        assert ("condval" in src) == (not vec_a), mk


@pytest.mark.parametrize("micro_tile", [(32, 64), (32, 1), (64, 64), (16, 32), (128, 1)])
def test_every_valid_config_schedules(micro_tile):
    cfgs = valid_tiles_configs(4096, 4096, micro_tile, "float16")
    assert len(cfgs) >= 4
    f = tiles_gather_matmul_func(4096, 4096, micro_tile, "float16", "float16")
    for cfg in cfgs:
        schedule_tiles_gather_matmul(f, cfg)


def test_config_errors():
    f = tiles_gather_matmul_func(256, 256, (32, 64))
    with pytest.raises(ValueError, match="mr=24"):
        check_tiles_config(256, 256, (24, 64), "float16", TilesConfig())
    with pytest.raises(ValueError, match="mr=1 "):
        check_tiles_config(256, 256, (1, 64), "float16", TilesConfig())
    with pytest.raises(ValueError, match="N=200"):
        schedule_tiles_gather_matmul(tiles_gather_matmul_func(256, 200, (32, 64)), TilesConfig())
    with pytest.raises(ValueError, match="K=96"):
        schedule_tiles_gather_matmul(tiles_gather_matmul_func(96, 256, (32, 32)),
                                     TilesConfig(block_k=64))
    with pytest.raises(ValueError, match="one must divide"):
        schedule_tiles_gather_matmul(tiles_gather_matmul_func(480, 256, (32, 48)),
                                     TilesConfig(block_k=32))
    with pytest.raises(ValueError, match="warp tile"):
        schedule_tiles_gather_matmul(f, TilesConfig(warp_m=64))
    with pytest.raises(ValueError, match="float32"):
        check_tiles_config(256, 256, (32, 64), "float32", TilesConfig())
    big = TilesConfig(block_n=256, block_k=64, warp_n=64, stages=8)
    assert tiles_smem_bytes(big, 128) > 227 * 1024
    with pytest.raises(ValueError, match="shared memory"):
        check_tiles_config(4096, 4096, (128, 64), "float16", big)
    assert valid_tiles_configs(96, 200, (32, 32)) == []
    assert valid_tiles_configs(4096, 4096, (8, 64)) == []
    with pytest.raises(ValueError, match="multiple of mk"):
        tiles_gather_matmul_func(100, 64, (32, 64))


def test_sparse_matmul_uses_tensor_core_tiles_kernel():
    from pit_tvm.ops.matmul import pit_matmul_func

    f = pit_matmul_func(512, 256, "float16", "float16", (32, 64), "cuda")
    assert str(f.attrs["pit.workload"]).startswith("tiles_gather_matmul_32x64")
    f = pit_matmul_func(512, 256, "bfloat16", "float32", (32, 1), "cuda")
    assert str(f.attrs["pit.workload"]).startswith("tiles_gather_matmul_32x1")
    # no tensor-core config: the SIMT kernel
    for args in (("float32", "float32", (32, 64)), ("float16", "float16", (8, 64))):
        f = pit_matmul_func(512, 256, args[0], args[1], args[2], "cuda")
        assert "pit.workload" not in (f.attrs or {})
    f = pit_matmul_func(512, 200, "float16", "float16", (32, 64), "cuda")
    assert "pit.workload" not in (f.attrs or {})


def test_sparse_matmul_cuda_build_with_tiles_kernel():
    from pit_tvm.ops.matmul import sparse_matmul

    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    # sm_90 (and sm_80): this schedule; sm_90a, the default, runs the wgmma tiles kernel
    op = sparse_matmul(512, 256, "float16", micro_tile=(32, 64), target="cuda:sm_90")
    src = "\n".join(_all_sources(op.executable))
    assert "mma.sync" in src and "pit_k_steps" in src
    assert check_cuda_compiles(op.executable, archs=("sm_90",)) >= 1


def _all_sources(ex):
    from pit_tvm.nvcc import cuda_sources

    return cuda_sources(ex)


# ---------------------------------------------------------------------------------------
# GPU: the scheduled kernel on CUDA
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _gpu_exe(k, n, micro_tile, in_dtype, out_dtype, cfg, a_compact=False):
    func = schedule_tiles_gather_matmul(
        tiles_gather_matmul_func(k, n, micro_tile, in_dtype, out_dtype, a_compact=a_compact), cfg)
    return build(func, "cuda")


GPU_CASES = [
    ((32, 64), "float16", "float32", TilesConfig()),
    ((32, 64), "float16", "float16", TilesConfig(stages=1)),
    ((32, 64), "bfloat16", "float32", TilesConfig(block_n=256, block_k=64, warp_n=64)),
    ((32, 1), "float16", "float32", TilesConfig()),
    ((32, 1), "float16", "float16", TilesConfig(stages=4)),
    ((32, 1), "bfloat16", "float32", TilesConfig(stages=2)),
    ((64, 64), "float16", "float32", TilesConfig(block_n=128, warp_m=64, warp_n=64, stages=4)),
    ((16, 32), "float16", "float32", TilesConfig(block_n=128, block_k=64, warp_m=16, warp_n=32)),
    ((32, 1), "float16", "float32", TilesConfig(), True),              # A_compact first
    ((32, 1), "bfloat16", "float16", TilesConfig(block_k=64, stages=3), True),
    ((128, 1), "float16", "float32", TilesConfig(block_n=128, warp_m=64, warp_n=64, stages=4), True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_numerics(sparsity, case):
    micro_tile, in_dtype, out_dtype, cfg, *compact = case
    m, k, n = 1000, 512, 256          # M not a multiple of mr: ragged last strip
    ex = _gpu_exe(k, n, micro_tile, in_dtype, out_dtype, cfg, bool(compact and compact[0]))
    a, b, offsets, ids = make_inputs(m, k, n, micro_tile, sparsity, in_dtype, seed=7)
    got = run(ex, tvm.cuda(0), a, b, offsets, ids, out_dtype, fill=np.nan)
    ref = reference(a, b)
    assert not np.isnan(got).any(), "rows left unwritten"
    tol = {"float32": 2e-3, "float16": 1e-2, "bfloat16": 3e-2}[out_dtype]
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * max(1.0, np.abs(ref).max()))
    if sparsity >= 1.0:
        assert np.all(got == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("micro_tile", [(32, 64), (32, 1)])
def test_gpu_all_configs(micro_tile):
    m, k, n = 2048 + 40, 1024, 1024
    a, b, offsets, ids = make_inputs(m, k, n, micro_tile, 0.9, "float16", seed=11)
    ref = reference(a, b)
    for cfg in valid_tiles_configs(k, n, micro_tile, "float16"):
        ex = _gpu_exe(k, n, micro_tile, "float16", "float32", cfg)
        got = run(ex, tvm.cuda(0), a, b, offsets, ids, "float32", fill=np.nan)
        np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max(),
                                   err_msg=str(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("micro_tile", [(32, 64), (32, 1)])
def test_gpu_sparse_matmul_op(micro_tile):
    """End to end: device index + densify + tensor-core tiles kernel."""
    from pit_tvm.ops.matmul import sparse_matmul

    m, k, n = 1000, 512, 256
    a, b, _, _ = make_inputs(m, k, n, micro_tile, 0.9, "float16", seed=5)
    op = sparse_matmul(k, n, "float16", micro_tile=micro_tile, target="cuda",
                       out_dtype="float32")
    dev = tvm.cuda(0)
    got = op(tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev)).numpy()
    ref = reference(a, b)
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())
