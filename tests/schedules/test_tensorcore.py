"""Tensor-core dense-tile schedule of the PIT row-gather matmul (pit_tvm.schedules.tensorcore).

CPU part: numerics of the *unscheduled* workload on llvm, CUDA builds + nvcc for sm_80/sm_90,
config validation.  GPU part (``@pytest.mark.gpu``): the scheduled kernel against a float32
numpy reference at several sparsities.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import tvm

from pit_tvm.runtime.loader import numpy_dtype
from pit_tvm.testing import rows_index
from pit_tvm.nvcc import check_cuda_compiles, find_nvcc
from pit_tvm.schedules.tensorcore import (
    TensorCoreConfig,
    build,
    row_gather_matmul_func,
    schedule_row_gather_matmul,
    smem_bytes,
    split_config,
    split_plan,
    valid_configs,
)
from pit_tvm.target import build as target_build


def make_inputs(m, k, n, sparsity, in_dtype="float16", bias=False, seed=0, count=None):
    """A with a fraction ``sparsity`` of all-zero rows (or exactly ``count`` non-zero rows),
    B, the (offsets, ids) index, bias."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    nz = rng.random(m) >= sparsity
    if count is not None:
        nz[:] = False
        nz[rng.choice(m, count, replace=False)] = True
    elif sparsity >= 1.0:
        nz[:] = False
    elif sparsity <= 0.0:
        nz[:] = True
    a[~nz] = 0
    b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    offsets, ids = rows_index(nz)
    dt = numpy_dtype(in_dtype)
    a, b = a.astype(dt), b.astype(dt)
    bias_v = rng.standard_normal(n).astype(dt) if bias else None
    return a, b, offsets, ids, bias_v


def reference(a, b, ids, offsets, bias=None, relu=False):
    """float32 numpy reference: listed rows get (A @ B)[row] (+bias, relu), others 0."""
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    out = np.zeros((a.shape[0], b.shape[1]), np.float32)
    rows = ids[: offsets[1]]
    v = a32[rows] @ b32
    if bias is not None:
        v = v + bias.astype(np.float32)
    if relu:
        v = np.maximum(v, 0)
    out[rows] = v
    return out


def run(ex, dev, a, b, offsets, ids, bias, out_dtype, fill=7.0):
    t = lambda x: tvm.runtime.tensor(x, dev)  # noqa: E731
    c = t(np.full((a.shape[0], b.shape[1]), fill, np.float32).astype(numpy_dtype(out_dtype)))
    args = [t(a), t(b), t(offsets), t(ids)] + ([t(bias)] if bias is not None else []) + [c]
    ex["main"](*args)
    return c.numpy().astype(np.float32)


# ---------------------------------------------------------------------------------------
# CPU: the unscheduled workload
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _cpu_exe(k, n, in_dtype, out_dtype, bias, relu, split_k=1, split_rows=0):
    f = row_gather_matmul_func(k, n, in_dtype, out_dtype, bias=bias, relu=relu,
                               split_k=split_k, split_rows=split_rows)
    return target_build(tvm.IRModule({"main": f}), "llvm")


@pytest.mark.parametrize(
    "m,sparsity,in_dtype,out_dtype,bias,relu",
    [
        (37, 0.5, "float16", "float32", False, False),
        (37, 0.0, "float16", "float32", False, False),   # fully dense A
        (37, 1.0, "float16", "float32", False, False),   # all-zero A: count = 0
        (64, 0.7, "float16", "float16", True, True),
        (50, 0.3, "bfloat16", "float32", True, False),
        (1, 0.0, "float16", "float32", False, True),
    ],
)
def test_unscheduled_cpu_numerics(m, sparsity, in_dtype, out_dtype, bias, relu):
    k, n = 32, 48
    ex = _cpu_exe(k, n, in_dtype, out_dtype, bias, relu)
    a, b, offsets, ids, bias_v = make_inputs(m, k, n, sparsity, in_dtype, bias, seed=m)
    got = run(ex, tvm.cpu(), a, b, offsets, ids, bias_v, out_dtype)
    ref = reference(a, b, ids, offsets, bias_v, relu)
    tol = 1e-5 if out_dtype == "float32" else 1e-2
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
    # unlisted rows are exactly zero (the C buffer was prefilled with 7)
    unlisted = np.setdiff1d(np.arange(m), ids[: offsets[1]])
    assert np.all(got[unlisted] == 0)


def test_unscheduled_ignores_rows_past_count():
    """Rows ids[count:] are zeroed, never computed into; a listed row that is all zero gives 0."""
    k, n, m = 32, 48, 20
    ex = _cpu_exe(k, n, "float16", "float32", False, False)
    a, b, offsets, ids, _ = make_inputs(m, k, n, 0.5, seed=3)
    got = run(ex, tvm.cpu(), a, b, offsets, ids, None, "float32")
    np.testing.assert_allclose(got, reference(a, b, ids, offsets), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 29])
@pytest.mark.parametrize("bias_relu", [False, True])
def test_unscheduled_split_k_cpu_numerics(count, bias_relu):
    """The split-K path (count <= split_rows = 16) and the full-K path (count > 16) give
    the same rows, and only listed rows are written."""
    m, k, n = 29, 64, 48
    ex = _cpu_exe(k, n, "float16", "float32", bias_relu, bias_relu, 4, 16)
    a, b, offsets, ids, bias_v = make_inputs(m, k, n, 0.0, "float16", bias_relu, seed=count,
                                             count=count)
    got = run(ex, tvm.cpu(), a, b, offsets, ids, bias_v, "float32")
    ref = reference(a, b, ids, offsets, bias_v, bias_relu)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    unlisted = np.setdiff1d(np.arange(m), ids[: offsets[1]])
    assert np.all(got[unlisted] == 0)


def test_split_plan():
    """Hand-computed for the H100 target of 132 SMs: N=4096 with 128-wide CTA tiles has 32
    N tiles, so the full-K grid fills at most one CTA per SM up to 4 row tiles (512 rows);
    4 K slices give 4 x 4 x 32 = 512 <= 4 x 132 CTAs (8 would give 1024)."""
    cfg = TensorCoreConfig()
    assert split_config(cfg, 4096, 4096) == TensorCoreConfig(block_k=64, stages=4)
    assert split_plan(4096, 4096, cfg) == (4, 512)
    # N=768: 6 N tiles -> 22 row tiles (2816 rows); 8 slices = 1056 > 528 CTAs, 4 = 528
    assert split_plan(4096, 768, cfg) == (4, 22 * 128)
    # K too short for 2 slices of 4 stages of 64 (nor of the 32-deep config's 3 stages x 2)
    assert split_plan(128, 4096, cfg) == (1, 0)
    # slices shallower than SPLIT_MIN_SLICE_K are not cut: BERT-base's 768-deep layers stay
    # full-K; 3072 deep takes 2 slices of 1536 (4 would be 768)
    assert split_plan(768, 768, cfg) == (1, 0)
    assert split_plan(3072, 768, cfg) == (2, 22 * 128)
    # a config whose deep variant does not fit keeps its own K tile
    assert split_config(TensorCoreConfig(block_m=256, block_n=256, warp_m=64, warp_n=64,
                                         block_k=32, stages=2), 4096, 4096).block_k == 32


def test_split_plan_fills_the_target_arch_sms():
    """the split-K grid fills the SMs of the target's arch (limits.sm_count), not the H100's on
    every arch: the A100 (sm_80, 108 SMs) fits 3 row tiles of N=4096 in a wave, the H100 4"""
    from pit_tvm.schedules.limits import sm_count

    cfg = TensorCoreConfig()
    assert sm_count("sm_90a") == sm_count(tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})) == 132
    assert sm_count("sm_80") == 108
    assert split_plan(4096, 4096, cfg, "float16", "sm_80") == split_plan(4096, 4096, cfg, sms=108) == (4, 384)
    assert split_plan(4096, 4096, cfg, "float16", "sm_90") == split_plan(4096, 4096, cfg, sms=132) == (4, 512)


# ---------------------------------------------------------------------------------------
# CUDA builds (no GPU needed): TVM codegen + nvcc for sm_80 and sm_90
# ---------------------------------------------------------------------------------------
BUILD_CASES = [
    ("float16", "float32", False, False, TensorCoreConfig()),
    ("float16", "float16", True, True, TensorCoreConfig(stages=1)),
    ("bfloat16", "bfloat16", True, True, TensorCoreConfig()),
    ("bfloat16", "float32", False, False,
     TensorCoreConfig(block_m=64, block_n=128, warp_m=32, warp_n=64, stages=4)),
    ("float16", "float16", False, True, TensorCoreConfig(block_k=64, stages=2)),
]


@pytest.mark.parametrize("in_dtype,out_dtype,bias,relu,cfg", BUILD_CASES)
def test_cuda_build(in_dtype, out_dtype, bias, relu, cfg):
    k, n = 256, 256
    func = schedule_row_gather_matmul(
        row_gather_matmul_func(k, n, in_dtype, out_dtype, bias=bias, relu=relu), cfg)
    ex = build(func, "cuda")
    src = "\n".join(m.inspect_source("cuda") for m in ex.mod.imports)
    ab = "bf16" if in_dtype == "bfloat16" else "f16"
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32" in src
    assert "ldmatrix.sync.aligned" in src
    if cfg.stages > 1:
        assert "cp.async" in src and "cp_async_wait_group" in src
    else:
        assert "cp.async.cg" not in src
    assert "OFF_ptr[1]" in src              # count read on the device (early exit, SWrite guard)
    assert "extern __shared__" in src       # dynamic shared memory
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(ex, archs=("sm_80", "sm_90")) >= 2


@pytest.mark.parametrize("in_dtype,out_dtype,bias,relu", [
    ("float16", "float16", False, False), ("bfloat16", "float32", True, True)])
def test_cuda_build_split_k(in_dtype, out_dtype, bias, relu):
    """The workload with the split-K path: four kernels (zero fill, full-K, split-K, sum),
    the two matmul paths guarded on the device by count against split_rows."""
    k, n = 2048, 256
    cfg = TensorCoreConfig()
    sk, rows = split_plan(k, n, cfg, in_dtype)
    assert sk > 1
    func = schedule_row_gather_matmul(row_gather_matmul_func(
        k, n, in_dtype, out_dtype, bias=bias, relu=relu, split_k=sk, split_rows=rows), cfg)
    ex = build(func, "cuda")
    src = "\n".join(m.inspect_source("cuda") for m in ex.mod.imports)
    assert src.count("__global__") == 8          # 4 declarations + 4 definitions
    assert f"({rows} < OFF_ptr[1])" in src and f"(OFF_ptr[1] <= {rows})" in src
    assert "Part_ptr" in src and "blockIdx.z" in src
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(ex, archs=("sm_80", "sm_90")) >= 2


def test_every_valid_config_schedules():
    for k, n in ((4096, 4096), (1024, 3072)):
        cfgs = valid_configs(k, n, "float16")
        assert len(cfgs) >= 5
        for cfg in cfgs:
            schedule_row_gather_matmul(row_gather_matmul_func(k, n), cfg)


def test_config_errors():
    f = row_gather_matmul_func(96, 256)
    with pytest.raises(ValueError, match="K=96"):
        schedule_row_gather_matmul(f, TensorCoreConfig(block_k=64))
    with pytest.raises(ValueError, match="N=200"):
        schedule_row_gather_matmul(row_gather_matmul_func(64, 200), TensorCoreConfig())
    big = TensorCoreConfig(block_m=256, block_n=256, block_k=64, stages=4)
    assert smem_bytes(big) > 227 * 1024
    with pytest.raises(ValueError, match="shared memory"):
        schedule_row_gather_matmul(row_gather_matmul_func(1024, 1024), big)
    with pytest.raises(ValueError, match="multiple of the warp"):
        schedule_row_gather_matmul(f, TensorCoreConfig(block_m=128, warp_m=48))
    assert valid_configs(96, 200) == []


# ---------------------------------------------------------------------------------------
# GPU: the scheduled kernel on CUDA
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _gpu_exe(k, n, in_dtype, out_dtype, bias, relu, cfg):
    func = schedule_row_gather_matmul(
        row_gather_matmul_func(k, n, in_dtype, out_dtype, bias=bias, relu=relu), cfg)
    return build(func, "cuda")


GPU_CASES = [
    ("float16", "float32", False, False, TensorCoreConfig()),
    ("float16", "float16", True, True, TensorCoreConfig(stages=1)),
    ("bfloat16", "float32", True, False, TensorCoreConfig()),
    ("float16", "float32", False, False,
     TensorCoreConfig(block_m=64, block_n=128, warp_m=32, warp_n=64, stages=4)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("in_dtype,out_dtype,bias,relu,cfg", GPU_CASES)
def test_gpu_numerics(sparsity, in_dtype, out_dtype, bias, relu, cfg):
    m, k, n = 1000, 512, 256          # M not a multiple of any block_m: ragged last tile
    ex = _gpu_exe(k, n, in_dtype, out_dtype, bias, relu, cfg)
    a, b, offsets, ids, bias_v = make_inputs(m, k, n, sparsity, in_dtype, bias, seed=7)
    got = run(ex, tvm.cuda(0), a, b, offsets, ids, bias_v, out_dtype, fill=np.nan)
    ref = reference(a, b, ids, offsets, bias_v, relu)
    assert not np.isnan(got).any(), "rows left unwritten"
    tol = {"float32": 2e-3, "float16": 1e-2, "bfloat16": 3e-2}[out_dtype]
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * max(1.0, np.abs(ref).max()))
    unlisted = np.setdiff1d(np.arange(m), ids[: offsets[1]])
    assert np.all(got[unlisted] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype,out_dtype,bias,relu", [
    ("float16", "float16", False, False), ("bfloat16", "float32", True, True),
    ("float16", "float32", True, False)])
def test_gpu_split_k_numerics(in_dtype, out_dtype, bias, relu):
    """Counts on both sides of split_rows, M not a multiple of any tile: the split-K path
    below, the full-K path above, every unlisted row zero, nothing left unwritten."""
    m, k, n = 1000, 2048, 4096
    cfg = TensorCoreConfig()
    sk, rows = split_plan(k, n, cfg, in_dtype)
    assert sk > 1 and rows < m
    func = schedule_row_gather_matmul(row_gather_matmul_func(
        k, n, in_dtype, out_dtype, bias=bias, relu=relu, split_k=sk, split_rows=rows), cfg)
    ex = build(func, "cuda")
    tol = {"float32": 2e-3, "float16": 1e-2, "bfloat16": 3e-2}[out_dtype]
    for count in (0, 1, 37, min(rows, m) - 1, min(rows, m), min(rows + 1, m), m):
        a, b, offsets, ids, bias_v = make_inputs(m, k, n, 0.0, in_dtype, bias, seed=count,
                                                 count=count)
        got = run(ex, tvm.cuda(0), a, b, offsets, ids, bias_v, out_dtype, fill=np.nan)
        ref = reference(a, b, ids, offsets, bias_v, relu)
        assert not np.isnan(got).any(), f"count={count}: rows left unwritten"
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * max(1.0, np.abs(ref).max()),
                                   err_msg=f"count={count}")


@pytest.mark.gpu
def test_gpu_large_m_all_configs():
    m, k, n = 4096 + 40, 1024, 1024
    a, b, offsets, ids, _ = make_inputs(m, k, n, 0.9, "float16", seed=11)
    ref = reference(a, b, ids, offsets)
    for cfg in valid_configs(k, n, "float16"):
        ex = _gpu_exe(k, n, "float16", "float32", False, False, cfg)
        got = run(ex, tvm.cuda(0), a, b, offsets, ids, None, "float32", fill=np.nan)
        np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max(),
                                   err_msg=str(cfg))
