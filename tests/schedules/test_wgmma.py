"""wgmma dense tiles (pit_tvm.schedules.wgmma) for the row-gather, tiles and dense matmul on sm_90a.

CPU part: the lowered kernels build through the ordinary s_tir pipeline, carry the wgmma /
cp.async instructions, and nvcc compiles them for sm_90a; config choice and bad shapes.
GPU part (``@pytest.mark.gpu``, an H100): results against a float32 numpy reference at every
sparsity, ragged M, bias / ReLU, bf16 and fp32 out, the dense variant.
"""
from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import tvm

from pit_tvm.runtime.loader import numpy_dtype
from pit_tvm.nvcc import check_cuda_compiles, cuda_sources, find_nvcc, ptxas_log
from pit_tvm.schedules.wgmma import (
    MAX_SMEM_BYTES,
    THREADS,
    BCopyLayout,
    WgmmaConfig,
    needs_compaction,
    wgmma_applies,
    wgmma_config,
    wgmma_dense_fallback_func,
    wgmma_few_rows_tiers,
    wgmma_row_gather_func,
    wgmma_tiles_applies,
    wgmma_tiles_config,
    wgmma_tiles_gather_func,
)
from pit_tvm.target import build
from test_tensorcore import make_inputs, reference, run

TARGET = "cuda:sm_90a"


@functools.lru_cache(maxsize=None)
def _exe(k, n, in_dtype, out_dtype, bias, relu, dense=False, config=None):
    f = wgmma_row_gather_func(k, n, in_dtype, out_dtype, bias=bias, relu=relu, dense=dense,
                              config=config)
    return build(tvm.IRModule({"main": f}), TARGET)


# ---------------------------------------------------------------------------------------
# CPU: configs, builds, nvcc
# ---------------------------------------------------------------------------------------
def test_config_choice():
    """Widest wgmma N dividing N, deepest ring (<= 4) fitting 227 KiB with an fp32 C stage."""
    assert wgmma_config(4096) == WgmmaConfig(256, 4)      # 4 x (16 + 32) KiB = 192 KiB
    assert wgmma_config(2304) == WgmmaConfig(256, 4)      # 2304 = 9 x 256
    assert wgmma_config(384) == WgmmaConfig(192, 4)       # 384 = 2 x 192
    assert wgmma_config(320) == WgmmaConfig(64, 4)
    assert wgmma_config(100) is None
    # with an expected row count: the grid that takes the fewest waves of 132 CTAs, weighted by
    # tile speed (BERT's N=768 over 2048 rows: 48 CTAs of 256 columns or 96 of 128)
    assert wgmma_config(768, rows=2048) == WgmmaConfig(128, 6)   # one wave: the deeper ring
    assert wgmma_config(128, rows=2048) == WgmmaConfig(64, 8)    # 32 CTAs of 64 columns, one wave
    assert wgmma_config(128, rows=32768) == WgmmaConfig(128, 4)  # 256 CTAs: two waves
    assert wgmma_config(2304, rows=2048).block_n == 192
    assert wgmma_config(4096, rows=4096).block_n == 256
    assert wgmma_config(768, rows=None).block_n == 256
    # a given width takes the ring the choice would give it (benchmarks/sweeps/width_sweep.py)
    assert wgmma_config(768, rows=2400, block_n=64) == WgmmaConfig(64, 4)    # 228 CTAs: two waves
    assert wgmma_config(768, rows=1280, block_n=64) == WgmmaConfig(64, 8)    # 120 CTAs: one wave
    assert wgmma_config(768, rows=2400, block_n=96) is None
    for n in (4096, 384, 320):
        assert wgmma_config(n).smem_bytes("float32") <= MAX_SMEM_BYTES
    assert wgmma_applies(768, 3072, "float16", "float16", "sm_90a")
    assert not wgmma_applies(768, 3072, "float16", "float16", "sm_90")   # no wgmma without 'a'
    assert not wgmma_applies(96, 3072, "float16", "float16", "sm_90a")   # K % 64
    assert not wgmma_applies(768, 3072, "float32", "float32", "sm_90a")


def test_few_rows_tiers():
    """128-column tiles with a 6-deep ring (64 x 8 where N needs it) for as many rows as fill
    one wave of 132 CTAs, then 64 x 8 for the rows whose 64-column tiles do; none where the
    config's tiles are no wider."""
    t128, t64 = WgmmaConfig(128, 6), WgmmaConfig(64, 8)
    assert wgmma_few_rows_tiers(4096, WgmmaConfig(256, 4)) == [(512, t128), (256, t64)]   # 32 / 64 tiles a strip
    assert wgmma_few_rows_tiers(8192, WgmmaConfig(256, 4)) == [(256, t128), (128, t64)]
    assert wgmma_few_rows_tiers(768, WgmmaConfig(256, 4)) == [(128 * 22, t128), (128 * 11, t64)]
    assert wgmma_few_rows_tiers(192 * 5, WgmmaConfig(192, 4)) == [(128 * 8, t64)]   # 15 a strip
    assert wgmma_few_rows_tiers(17 * 1024, WgmmaConfig(256, 4)) == [(128, t128)]   # both wider than a wave
    assert wgmma_few_rows_tiers(768, WgmmaConfig(128, 4)) == []           # no wider than the tier's
    assert wgmma_few_rows_tiers(320, WgmmaConfig(64, 4)) == []
    # expected rows well above a tier's: every call would pay its no-op launch for nothing (the
    # widest tier's range ends at 2F, a narrower one's at F)
    assert wgmma_few_rows_tiers(4096, WgmmaConfig(256, 4), rows_hint=256) == [(512, t128), (256, t64)]
    assert wgmma_few_rows_tiers(4096, WgmmaConfig(256, 4), rows_hint=1024) == [(512, t128)]
    assert wgmma_few_rows_tiers(4096, WgmmaConfig(256, 4), rows_hint=1025) == []
    for above, upto in ((128, 128), (256, 128)):
        with pytest.raises(ValueError, match="rows_above < count <= rows_upto"):
            wgmma_row_gather_func(512, 256, rows_above=above, rows_upto=upto)
    with pytest.raises(ValueError, match="tiers"):
        wgmma_row_gather_func(512, 256, dense=True, rows_upto=128)


@pytest.mark.parametrize("block_n", [64, 128, 192, 256])
@pytest.mark.parametrize("block_k", [32, 64])
@pytest.mark.parametrize("tiles", [False, True])
def test_b_copy_layout_copies_each_chunk_once(block_n, block_k, tiles):
    """Every 16-byte chunk of a K tile of B is copied by exactly one (thread, i, h): at
    block_n=192, whose rows' 24 chunks do not divide the 256 threads, a lane pattern per row
    once left chunks uncopied (and BERT's output wrong on the H100)."""
    lay = BCopyLayout(block_n, block_k, tiles)
    copied = [(lay.row(t, i), lay.chunk(t, i, h))
              for t in range(THREADS) for i in range(lay.rows) for h in range(lay.groups)]
    assert sorted(copied) == [(r, c) for r in range(block_k) for c in range(block_n // 8)]
    if tiles and block_n == 256 and block_k == 64:
        assert lay.rows == 4     # 16 lanes a row: 4 index entries a thread per K tile


def test_op_runs_both_row_tiers():
    """The rows op on sm_90a: the many-rows kernel, then the few-rows kernel in place on its C."""
    import pit_tvm

    op = pit_tvm.sparse_matmul(512, 4096, "float16", micro_tile=(1, 512), target="cuda")
    src = "\n".join(cuda_sources(op.executable))
    assert src.count("m64n256k16") >= 4 and src.count("m64n128k16") >= 4    # the two tiers' wgmmas


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="K % 64"):
        wgmma_row_gather_func(100, 256)
    with pytest.raises(ValueError, match="float16"):
        wgmma_row_gather_func(128, 256, "float32", "float32")
    with pytest.raises(ValueError, match="shared memory"):
        wgmma_row_gather_func(128, 256, config=WgmmaConfig(256, 5))
    with pytest.raises(ValueError, match="row_scale_a comes with a bias"):
        wgmma_row_gather_func(128, 256, row_scale_a=True)
    with pytest.raises(ValueError, match="raster_m must be positive"):
        WgmmaConfig(256, 4, raster_m=0)


@pytest.mark.parametrize("in_dtype,out_dtype,bias,relu,dense", [
    ("float16", "float16", False, False, False),
    ("bfloat16", "float32", True, True, False),
    ("float16", "bfloat16", True, False, True),
    ("float16", "float32", False, True, True),
])
def test_cuda_build(in_dtype, out_dtype, bias, relu, dense):
    ex = _exe(256, 512, in_dtype, out_dtype, bias, relu, dense)
    src = "\n".join(m.inspect_source("cuda") for m in ex.mod.imports)
    t = "bf16" if in_dtype == "bfloat16" else "f16"
    assert f"wgmma.mma_async.sync.aligned.m64n256k16.f32.{t}.{t}" in src
    assert "wgmma.wait_group.sync.aligned" in src
    body = src[src.index('extern "C" __global__'):]
    # warp-specialized: a loader warpgroup fills the ring, B by TMA (dense: A too; rows: A's
    # listed rows by cp.async), and mbarriers hand its slots to the consumer warpgroups
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes" in src
    assert body.split(";", 1)[0].count("__grid_constant__ CUtensorMap") == (2 if dense else 1)
    assert "mbarrier.try_wait.parity" in src and "__launch_bounds__(384)" in body
    if dense:
        assert "cp_async_cg" not in body
    else:
        assert "cp_async_cg" in body and "cp.async.mbarrier.arrive.noinc" in src
    assert "extern __shared__" in src
    signature = src[src.index('extern "C" __global__'):].split(")", 2)[1]
    assert signature.count("int* __restrict__") == (0 if dense else 2)   # offsets, ids
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(ex, archs=("sm_90a",)) >= 1


def test_cuda_build_raster():
    """The launch order: the dense kernel's N and M tiles come from the CTA's place in launch
    order (groups of 16 M tiles); ``raster_m=1`` binds them to blockIdx.x / y; the rows kernels
    ignore it."""
    def source(**kw):
        ex = build(tvm.IRModule({"main": wgmma_row_gather_func(512, 512, **kw)}), TARGET)
        return "\n".join(m.inspect_source("cuda") for m in ex.mod.imports)

    plain_bn = "int bn = ((int)blockIdx.x);"
    assert WgmmaConfig().raster_m == 16
    assert plain_bn not in source(dense=True)
    assert plain_bn in source(dense=True, config=WgmmaConfig(256, 4, raster_m=1))
    assert source() == source(config=WgmmaConfig(256, 4, raster_m=1))
    tier = WgmmaConfig(64, 8)
    assert (source(config=tier, rows_upto=128) ==
            source(config=WgmmaConfig(64, 8, raster_m=1), rows_upto=128))


# ---------------------------------------------------------------------------------------
# GPU: numerics
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("m,count", [(4096, 4096), (4096, 0), (4096, 130), (4096, 2047),
                                     (3968, 3968), (3968, 1000), (77, 77), (77, 5), (129, 129)])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("raster", [3, 16])
def test_gpu_raster(m, count, dense, raster):
    """The dense kernel's grouped launch order against numpy: a last group of fewer M tiles (31
    tiles in groups of 16 or 3, one tile, two); bias + ReLU (rows: the same config, which
    they ignore; unlisted rows relu(bias))."""
    if dense and count != m:
        pytest.skip("dense lists every row")
    k, n = 1024, 512
    rng = np.random.default_rng(m + count)
    a = rng.standard_normal((m, k)).astype(np.float16)
    a[rng.permutation(m)[count:]] = 0
    b = (rng.standard_normal((k, n)) / k ** 0.5).astype(np.float16)
    bias_v = rng.standard_normal(n).astype(np.float16)
    f = wgmma_row_gather_func(k, n, bias=True, relu=True, dense=dense, config=WgmmaConfig(256, 4, raster_m=raster))
    ex = build(tvm.IRModule({"main": f}), TARGET)
    listed = np.flatnonzero(a.any(1)).astype(np.int32)
    offsets = np.array([0, len(listed)], np.int32)
    ids = np.concatenate([listed, np.setdiff1d(np.arange(m), listed)]).astype(np.int32)
    dev = tvm.cuda()
    t = lambda x: tvm.runtime.tensor(x, dev)  # noqa: E731
    c = t(np.full((m, n), 7, np.float16))
    ex["main"](*([t(a), t(b)] + ([] if dense else [t(offsets), t(ids)]) + [t(bias_v), c]))
    ref = np.maximum(a.astype(np.float32) @ b.astype(np.float32) + bias_v.astype(np.float32), 0)
    if not dense:   # an unlisted row is epilogue(0): relu(bias)
        ref[~a.any(1)] = np.maximum(bias_v.astype(np.float32), 0)
    np.testing.assert_allclose(c.numpy().astype(np.float32), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("count", [0, 41, 200, 300, 450, 600, 4000])
def test_gpu_rows_op_4096(count):
    """The rows op at K = N = 4096 (the benchmark's shape: the many-rows kernel, then the
    tiers): listed rows below, in and above the tiers against numpy, unlisted rows zero.  In a
    tier the rows past the listed rows' tiles are stored by every CTA's store warpgroup (at once
    in a CTA without such a tile: 0 rows; after the K loop in one with it: 128 of them at 200
    and 450 rows), the others with the tile."""
    import pit_tvm

    m = k = n = 4096
    rng = np.random.default_rng(count)
    a = rng.standard_normal((m, k)).astype(np.float16)
    a[rng.permutation(m)[count:]] = 0
    b = (rng.standard_normal((k, n)) / k ** 0.5).astype(np.float16)
    op = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=(1, k), target="cuda")
    got = op(a, b)
    np.testing.assert_allclose(got.astype(np.float32), a.astype(np.float32) @ b.astype(np.float32),
                               rtol=1e-2, atol=1e-2)
    assert np.all(got[~a.any(1)] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("m,sparsity", [(4096, 0.0), (4096, 0.5), (4096, 0.9), (4096, 0.99),
                                        (1000, 0.3), (77, 0.0), (300, 1.0)])
def test_gpu_rows(m, sparsity):
    k, n = 1024, 1024
    a, b, offsets, ids, _ = make_inputs(m, k, n, sparsity, seed=m)
    got = run(_exe(k, n, "float16", "float16", False, False), tvm.cuda(), a, b, offsets, ids,
              None, "float16")
    ref = reference(a, b, ids, offsets)
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2)
    unlisted = np.setdiff1d(np.arange(m), ids[: offsets[1]])
    assert np.all(got[unlisted] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("count", [0, 45, 256, 257, 512, 513, 1100])
def test_gpu_rows_tiers(count):
    """The rows op at N=4096 (few-rows tiers of 64-column tiles up to 256 rows, 128-column ones
    up to 512): listed rows on both sides of each tier boundary against numpy, unlisted rows
    zero."""
    import pit_tvm

    m, k, n = 1100, 512, 4096
    rng = np.random.default_rng(count)
    a = rng.standard_normal((m, k)).astype(np.float16)
    a[rng.permutation(m)[count:]] = 0
    b = (rng.standard_normal((k, n)) / k ** 0.5).astype(np.float16)
    op = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=(1, k), target="cuda", density_threshold=None)
    got = op(a, b)
    np.testing.assert_allclose(got.astype(np.float32), a.astype(np.float32) @ b.astype(np.float32),
                               rtol=1e-2, atol=1e-2)
    assert np.all(got[~a.any(1)] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("count", [0, 100, 128, 129, 256, 257, 600])
@pytest.mark.parametrize("epilogue", ["bias_relu", "bias_relu_f32", "bias_gelu_row_scale", "bias_residual"])
@pytest.mark.parametrize("m,k", [(700, 640), (2000, 128), (6000, 64)])
def test_gpu_rows_tiers_epilogues(m, k, epilogue, count):
    """Three tiers run in order on one C (as the op emits them), with boundaries at 128 and 256
    rows, with the epilogues: listed rows and unlisted ones (``epilogue(0)``) on both sides of
    each boundary.  The tiers' store warpgroups take the rows past the listed rows' tiles, a
    CTA's share under one batch of row ids at 700 x 640, two at 2000 x 128 and six at 6000 x 64
    (one K tile; there the many-rows kernel has more tiles, 141, than the GPU has SMs); with
    listed rows a multiple of 128 (128, 256) no tile holds both kinds."""
    from math import erf

    n, few = 768, 256
    rng = np.random.default_rng(count)
    a = rng.standard_normal((m, k)).astype(np.float16)
    listed = np.sort(rng.permutation(m)[:count]).astype(np.int32)
    ids = np.concatenate([listed, np.setdiff1d(np.arange(m, dtype=np.int32), listed)]).astype(np.int32)
    offsets = np.array([0, count], np.int32)
    b = (rng.standard_normal((k, n)) / k ** 0.5).astype(np.float16)
    bias_v = rng.standard_normal(n).astype(np.float16)
    flags = {"bias_relu": dict(bias=True, relu=True),
             "bias_relu_f32": dict(bias=True, relu=True, out_dtype="float32"),
             "bias_gelu_row_scale": dict(bias=True, gelu=True, row_scale=True),
             "bias_residual": dict(bias=True, residual=True)}[epilogue]
    out_dtype = flags.get("out_dtype", "float16")
    extra = rng.choice([1.0, 0.5], m).astype(np.float16) if "row_scale" in flags else (
        rng.standard_normal((m, n)).astype(np.float16) if "residual" in flags else None)
    dev = tvm.cuda()
    t = lambda x: tvm.runtime.tensor(x, dev)  # noqa: E731
    args = [t(a), t(b), t(offsets), t(ids), t(bias_v)] + ([] if extra is None else [t(extra)])
    c = t(np.full((m, n), 7, out_dtype))
    many = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, rows_above=few, **flags)}), TARGET)["main"]
    mid_f = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, rows_above=few // 2, rows_upto=few,
                                                              config=WgmmaConfig(128, 6), **flags)}), TARGET)["main"]
    few_f = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, rows_upto=few // 2, config=WgmmaConfig(64, 8),
                                                              **flags)}), TARGET)["main"]
    for kernel in (many, mid_f, few_f):
        kernel(*args, c)
    a_used = a.astype(np.float32)
    a_used[ids[count:]] = 0                       # the rows the index skips are zero rows
    pre = a_used @ b.astype(np.float32) + bias_v.astype(np.float32)
    if epilogue.startswith("bias_relu"):
        ref = np.maximum(pre, 0)
    elif epilogue == "bias_gelu_row_scale":
        ref = 0.5 * pre * (1 + np.vectorize(erf)(pre / np.sqrt(2))) * extra.astype(np.float32)[:, None]
    else:
        ref = pre.astype(np.float16).astype(np.float32) + extra.astype(np.float32)
    np.testing.assert_allclose(c.numpy().astype(np.float32), ref, rtol=1e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype,out_dtype,n,config", [
    ("float16", "float32", 768, None), ("bfloat16", "bfloat16", 384, None),
    ("float16", "float16", 512, WgmmaConfig(128, 3)), ("bfloat16", "float32", 192, None),
    ("float16", "float16", 768, WgmmaConfig(192, 4)), ("float16", "float32", 768, WgmmaConfig(64, 4)),
    ("float16", "float16", 768, WgmmaConfig(192, 8, 32)), ("bfloat16", "float32", 512, WgmmaConfig(256, 8, 32))])
def test_gpu_rows_bias_relu_dtypes(in_dtype, out_dtype, n, config):
    m, k = 333, 640
    a, b, offsets, ids, bias_v = make_inputs(m, k, n, 0.4, in_dtype, bias=True, seed=n)
    got = run(_exe(k, n, in_dtype, out_dtype, True, True, config=config), tvm.cuda(), a, b,
              offsets, ids, bias_v, out_dtype)
    ref = reference(a, b, ids, offsets, bias_v, relu=True)
    # rows the index does not list are zero rows of A: relu(bias) there (mma.sync kernels: 0)
    ref[ids[offsets[1]:]] = np.maximum(bias_v.astype(np.float32), 0)
    tol = 3e-2 if "bfloat16" in (in_dtype, out_dtype) else 1e-2
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dense,masks,scale_a", [(False, False, False), (False, True, False), (True, False, False),
                                                 (False, True, True), (True, False, True)])
def test_gpu_bias_gelu_row_scale(dense, masks, scale_a):
    """BERT's FFN-in epilogue, ``gelu(a @ b + bias) * mask[row]``: rows the index lists, and the
    rows it does not (zero rows of A: ``gelu(bias) * mask[row]``, not zero; ``masks``: the
    scale is the index's row mask, zero there); ``scale_a``: A is given unscaled and the kernel
    scales its rows by the same mask first."""
    from math import erf

    m, k, n = 333, 768, 3072
    a, b, offsets, ids, bias_v = make_inputs(m, k, n, 0.0 if dense else 0.4, bias=True, seed=5)
    rs = np.random.default_rng(6).choice([1.0, 0.5], m).astype(np.float16)
    rs[ids[offsets[1]:]] = 0.0 if masks else 1.5
    f = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, bias=True, gelu=True, row_scale=True,
                                                          row_scale_masks=masks, dense=dense,
                                                          row_scale_a=scale_a)}), TARGET)["main"]
    dev = tvm.cuda()
    t = lambda x: tvm.runtime.tensor(x, dev)  # noqa: E731
    c = t(np.full((m, n), 7, np.float16))
    a_in = a
    if scale_a:   # the kernel is given A before its rows are scaled (unlisted rows: anything)
        a_in = a.copy()
        a_in[ids[offsets[1]:]] = 3
        a = (a_in.astype(np.float32) * rs.astype(np.float32)[:, None]).astype(np.float16)
        if not dense:
            a[ids[offsets[1]:]] = 0
    f(*([t(a_in), t(b)] + ([] if dense else [t(offsets), t(ids)]) + [t(bias_v), t(rs), c]))
    pre = a.astype(np.float32) @ b.astype(np.float32) + bias_v.astype(np.float32)   # zero rows: bias
    ref = 0.5 * pre * (1 + np.vectorize(erf)(pre / np.sqrt(2))) * rs.astype(np.float32)[:, None]
    np.testing.assert_allclose(c.numpy().astype(np.float32), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dense", [False, True])
def test_gpu_gelu_epilogue_is_exact_gelu_in_fp32(dense):
    """The GELU epilogue (``gelu_erf``: a fast erfc, not CUDA's ``erff``) against float64 GELU of
    the same kernel's fp32 pre-activation (same accumulation order): within 1e-6 (relative above
    1) over pre-activations of standard deviation 4, zero at zero and positive above it."""
    from math import erf

    m, k, n = 300, 768, 768
    a, b, offsets, ids, bias_v = make_inputs(m, k, n, 0.0 if dense else 0.3, bias=True, seed=21)
    b = (b.astype(np.float32) * 4).astype(np.float16)
    bias_v[:8] = [0, -0.0, 1, -1, 6, -6, 12, -12]                # exact inputs where A's rows are zero
    dev = tvm.cuda()
    t = lambda x: tvm.runtime.tensor(x, dev)  # noqa: E731
    outs = []
    for gelu in (False, True):
        f = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, "float16", "float32", bias=True, gelu=gelu,
                                                              dense=dense)}), TARGET)["main"]
        c = t(np.zeros((m, n), np.float32))
        f(*([t(a), t(b)] + ([] if dense else [t(offsets), t(ids)]) + [t(bias_v), c]))
        outs.append(c.numpy().astype(np.float64))
    pre, got = outs
    assert np.abs(pre).max() > 12
    want = 0.5 * pre * (1 + np.vectorize(erf)(pre / np.sqrt(2)))
    assert np.all(np.abs(got - want) <= 1e-6 * np.maximum(1, np.abs(pre)))
    assert np.all(got[pre == 0] == 0) and np.all(got[pre > 0] > 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dense", [False, True])
def test_gpu_bias_input_row_scale(dense):
    """A GEMM on a row-scaled input, ``(s * x) @ b + bias``, given x and s (BERT's QKV on its
    padding-masked input): listed rows, and unlisted ones (``bias``: their A rows are zero)."""
    m, k, n = 333, 768, 2304
    a, b, offsets, ids, bias_v = make_inputs(m, k, n, 0.0 if dense else 0.4, bias=True, seed=11)
    rs = np.random.default_rng(12).choice([1.0, 0.5, 2.0], m).astype(np.float16)
    x = a.copy()
    x[ids[offsets[1]:]] = 5                    # unlisted rows: not read (A there is s * x = 0)
    rs[ids[offsets[1]:]] = 0 if not dense else rs[ids[offsets[1]:]]
    f = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, bias=True, row_scale_a=True, dense=dense)}),
              TARGET)["main"]
    dev = tvm.cuda()
    t = lambda v: tvm.runtime.tensor(v, dev)  # noqa: E731
    c = t(np.full((m, n), 7, np.float16))
    f(*([t(x), t(b)] + ([] if dense else [t(offsets), t(ids)]) + [t(bias_v), t(rs), c]))
    scaled = (x.astype(np.float32) * rs.astype(np.float32)[:, None]).astype(np.float16).astype(np.float32)
    ref = scaled @ b.astype(np.float32) + bias_v.astype(np.float32)
    np.testing.assert_allclose(c.numpy().astype(np.float32), ref, rtol=1e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dense", [False, True])
def test_gpu_bias_residual(dense):
    """A skip connection in the epilogue, ``fp16(a @ b + bias) + r`` (added in fp16 as the graph
    does): listed rows, and unlisted ones (``bias + r``)."""
    m, k, n = 333, 3072, 768
    a, b, offsets, ids, bias_v = make_inputs(m, k, n, 0.0 if dense else 0.4, bias=True, seed=8)
    r = np.random.default_rng(9).standard_normal((m, n)).astype(np.float16)
    f = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, bias=True, residual=True, dense=dense)}),
              TARGET)["main"]
    dev = tvm.cuda()
    t = lambda x: tvm.runtime.tensor(x, dev)  # noqa: E731
    c = t(np.full((m, n), 7, np.float16))
    f(*([t(a), t(b)] + ([] if dense else [t(offsets), t(ids)]) + [t(bias_v), t(r), c]))
    pre = (a.astype(np.float32) @ b.astype(np.float32) + bias_v.astype(np.float32)).astype(np.float16)
    np.testing.assert_allclose(c.numpy().astype(np.float32), (pre + r).astype(np.float32), rtol=1e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m,bias", [(4096, False), (129, True), (5, False)])
def test_gpu_dense(m, bias):
    k, n = 768, 2304
    rng = np.random.default_rng(m)
    a = rng.standard_normal((m, k)).astype(np.float16)
    b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16)
    bias_v = rng.standard_normal(n).astype(np.float16) if bias else None
    dev = tvm.cuda()
    t = lambda x: tvm.runtime.tensor(x, dev)  # noqa: E731
    c = t(np.full((m, n), 7, np.float16))
    _exe(k, n, "float16", "float16", bias, False, dense=True)["main"](
        *([t(a), t(b)] + ([t(bias_v)] if bias else []) + [c]))
    ref = a.astype(np.float32) @ b.astype(np.float32)
    if bias:
        ref = ref + bias_v.astype(np.float32)
    np.testing.assert_allclose(c.numpy().astype(np.float32), ref, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------
# The tiles kind (micro-tiles along K, covered by 128-row strips)
# ---------------------------------------------------------------------------------------
TILE_CASES = [(32, 1), (32, 64), (128, 1), (1, 64), (64, 8)]


def test_tiles_config_warp_specializes_wide_micro_tiles():
    """A loader warpgroup (A's K tile by TMA) where micro-tiles are 64 columns wide or wider;
    the all-threads loop for thinner ones (measured faster there on the H100).  The op's
    kernel for 32x64 micro-tiles loads A by TMA and launches the loader warpgroup."""
    import pit_tvm

    assert wgmma_tiles_config(4096, 64).tiles_ws and wgmma_tiles_config(4096, 128).tiles_ws
    assert not any(wgmma_tiles_config(4096, mk).tiles_ws for mk in (1, 2, 8, 32))
    assert wgmma_tiles_config(4096, 64).block_n == wgmma_config(4096).block_n
    assert not wgmma_tiles_config(4096, 64, out_dtype="float32", residual=True).tiles_ws   # (would spill)
    assert not wgmma_tiles_config(192, 64).tiles_ws                  # 192-column tiles: no 16-lane B rows
    with pytest.raises(ValueError, match="warp-specialized tiles kernel"):
        wgmma_tiles_gather_func(4096, 4096, 32, config=WgmmaConfig(tiles_ws=True))
    for micro_tile, ws in (((32, 64), True), ((32, 8), False)):
        op = pit_tvm.sparse_matmul(512, 256, "float16", micro_tile=micro_tile, target="cuda")
        src = "\n".join(cuda_sources(op.executable))
        # the tiles kernel's signature: its launch bounds, and A's TMA descriptor
        kernel = re.search(r"__global__ void (__launch_bounds__\(\d+\)) pit_kernel_\w+\(([^;{]*)\)", src)
        assert ("CUtensorMap map_a" in kernel.group(2)) == ws
        assert kernel.group(1) == ("__launch_bounds__(384)" if ws else "__launch_bounds__(256)")
        # the dense fallback's own kernel only beside the all-threads loop
        assert ("pit_dense_fallback_" in src) == (not ws)


def test_tiles_applies():
    assert wgmma_tiles_applies(512, 256, (32, 1), "float16", "float16", "sm_90a")
    assert not wgmma_tiles_applies(512, 256, (48, 1), "float16", "float16", "sm_90a")   # 128 % 48
    assert not wgmma_tiles_applies(512, 256, (32, 512), "float16", "float16", "sm_90a")  # rows kind
    assert not wgmma_tiles_applies(512, 256, (32, 1), "float16", "float16", "sm_90")
    assert needs_compaction(1, "float16") and needs_compaction(4, "float16")
    assert not needs_compaction(8, "float16") and not needs_compaction(64, "bfloat16")


_PTXAS_CASES = {
    "rows_256x4": lambda: wgmma_row_gather_func(4096, 4096),
    "rows_64x8": lambda: wgmma_row_gather_func(768, 768, config=WgmmaConfig(64, 8)),
    "dense_bias_relu_bf16": lambda: wgmma_row_gather_func(768, 3072, "bfloat16", "float32", bias=True,
                                                          relu=True, dense=True),
    "rows_bias_gelu_row_scale": lambda: wgmma_row_gather_func(768, 3072, bias=True, gelu=True, row_scale=True),
    "rows_bias_gelu_row_mask": lambda: wgmma_row_gather_func(768, 3072, bias=True, gelu=True, row_scale=True,
                                                             row_scale_masks=True),
    "rows_bias_residual": lambda: wgmma_row_gather_func(3072, 768, bias=True, residual=True),
    "dense_bias_residual_f32": lambda: wgmma_row_gather_func(768, 768, "float16", "float32", bias=True,
                                                             residual=True, dense=True),
    "dense_bias_gelu_row_scale": lambda: wgmma_row_gather_func(768, 3072, bias=True, gelu=True, row_scale=True,
                                                               dense=True),
    "tiles_mk1": lambda: wgmma_tiles_gather_func(8192, 2048, 1),
    "tiles_mk8": lambda: wgmma_tiles_gather_func(4096, 4096, 8),
    "tiles_mk64_128": lambda: wgmma_tiles_gather_func(4096, 4096, 64, config=WgmmaConfig(128, 4)),
    "tiles_ws_mk64_bias_residual": lambda: wgmma_tiles_gather_func(8192, 2048, 64, bias=True, residual=True,
                                                                   config=WgmmaConfig(tiles_ws=True)),
    "tiles_ws_mk128_128": lambda: wgmma_tiles_gather_func(4096, 4096, 128, config=WgmmaConfig(128, 4, tiles_ws=True)),
    "dense_fallback": lambda: wgmma_dense_fallback_func(4096, 4096, 1),
    "rows_bias_gelu_row_mask_scale_a": lambda: wgmma_row_gather_func(768, 3072, bias=True, gelu=True, row_scale=True,
                                                                     row_scale_masks=True, row_scale_a=True),
    "rows_bias_scale_a": lambda: wgmma_row_gather_func(768, 2304, bias=True, row_scale_a=True),
    "rows_above": lambda: wgmma_row_gather_func(4096, 4096, rows_above=512),
    "rows_above_bias_gelu_row_scale_f32": lambda: wgmma_row_gather_func(768, 3072, out_dtype="float32", bias=True,
                                                                        gelu=True, row_scale=True, rows_above=256),
    "rows_upto_128x6": lambda: wgmma_row_gather_func(4096, 4096, rows_upto=512, config=WgmmaConfig(128, 6)),
    "rows_upto_bias_residual": lambda: wgmma_row_gather_func(3072, 768, bias=True, residual=True, rows_upto=2816,
                                                             config=WgmmaConfig(128, 6)),
    # (the store warpgroup computes epilogue(0) with each row's scale, 8 fp32 chunks a row)
    "rows_upto_bias_gelu_row_scale_f32": lambda: wgmma_row_gather_func(
        768, 4096, out_dtype="float32", bias=True, gelu=True, row_scale=True, rows_upto=256, config=WgmmaConfig(64, 8)),
}


@pytest.mark.parametrize("case", sorted(_PTXAS_CASES))
def test_ptxas_keeps_wgmma_async(case):
    """ptxas neither serialises the wgmmas (C7515: the tiles kernel's loop, which may run no
    wgmma for an empty strip, did that to every K tile) nor spills, for each kernel kind."""
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    ex = build(tvm.IRModule({"main": _PTXAS_CASES[case]()}), TARGET)
    log = ptxas_log(cuda_sources(ex)[0], "sm_90a")
    assert "Used" in log and "registers" in log, log[-2000:]
    assert "C7515" not in log and "serialized" not in log, log[-2000:]
    assert re.search(r"\b0 bytes spill stores", log), log[-2000:]


@pytest.mark.parametrize("micro_tile", [(32, 1), (32, 64)])
def test_sparse_matmul_tiles_build(micro_tile):
    """The op on the default target: the index for 128-row strips, the compaction kernel for
    micro-tiles under 16 bytes wide, the wgmma tiles kernel; nvcc compiles it for sm_90a."""
    import pit_tvm

    op = pit_tvm.sparse_matmul(512, 256, "float16", micro_tile=micro_tile, target="cuda")
    src = "\n".join(cuda_sources(op.executable))
    assert "wgmma.mma_async" in src and "mma.sync" not in src
    assert src.count("cp_async_cg") >= 3            # helper + A and B loads in the kernel body
    kernels = src.count('extern "C" __global__')
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(op.executable, archs=("sm_90a",)) >= 1
    assert kernels >= (3 if needs_compaction(micro_tile[1], "float16") else 2)


@pytest.mark.gpu
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("micro_tile", TILE_CASES)
def test_gpu_sparse_matmul_tiles(micro_tile, sparsity):
    """End to end on the H100: device index for 128-row strips, compaction, wgmma tiles kernel,
    against float32 numpy, M not a multiple of 128."""
    import pit_tvm
    from test_tensorcore_tiles import make_inputs as tiles_inputs

    m, k, n = 1000, 512, 256
    a, b, _, _ = tiles_inputs(m, k, n, micro_tile, sparsity, "float16", seed=int(sparsity * 100))
    op = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=micro_tile, target="cuda",
                               out_dtype="float32")
    dev = tvm.cuda(0)
    got = op(tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev)).numpy()
    ref = a.astype(np.float32) @ b.astype(np.float32)
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * max(np.abs(ref).max(), 1.0))


_LOOP_CASES = [(False, mt) for mt in [(32, 1), (128, 2), (32, 8), (32, 32), (32, 64)]] + [
    (True, mt) for mt in [(32, 64), (128, 64), (64, 128), (1, 256)]]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1000, 4096])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("threshold", [0.9, None])
@pytest.mark.parametrize("tiles_ws,micro_tile", _LOOP_CASES)
def test_gpu_tiles_loops(monkeypatch, tiles_ws, micro_tile, threshold, sparsity, m):
    """The tiles kernel's two K loops, all threads loading and computing (with the dense
    fallback kernel after it) or a loader warpgroup (A's K tile by TMA, micro-tiles a multiple
    of 64 wide; a full index, from the fallback or listed in the strips' order without a
    threshold, run as the dense kernel), with the bias and skip connection, against float32
    numpy; a second call on another pattern."""
    from tvm import relax

    import pit_tvm.schedules.wgmma as wg
    from pit_tvm.ops.matmul import emit_pit_matmul
    from test_tensorcore_tiles import make_inputs as tiles_inputs

    k, n = 1024, 512
    config = WgmmaConfig(256, 4, tiles_ws=tiles_ws)
    monkeypatch.setattr(wg, "wgmma_tiles_config", lambda *args, **kw: config)
    bb = relax.BlockBuilder()
    args = [relax.Var("a", relax.TensorType([m, k], "float16")), relax.Var("b", relax.TensorType([k, n], "float16")),
            relax.Var("bias", relax.TensorType([n], "float16")), relax.Var("res", relax.TensorType([m, n], "float16"))]
    with bb.function("main", args):
        with bb.dataflow():
            out = bb.emit_output(emit_pit_matmul(bb, args[0], args[1], micro_tile=micro_tile, target="cuda",
                                                 bias=args[2], residual=args[3], density_threshold=threshold))
        bb.emit_func_output(out)
    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(build(bb.get(), "cuda"), dev)
    rng = np.random.default_rng(1)
    bias = rng.standard_normal(n).astype(np.float16)
    for s, seed in ((sparsity, int(sparsity * 100)), (0.99, 7)):
        a, b, _, _ = tiles_inputs(m, k, n, micro_tile, s, "float16", seed=seed)
        res = rng.standard_normal((m, n)).astype(np.float16)
        got = vm["main"](*(tvm.runtime.tensor(v, dev) for v in (a, b, bias, res))).numpy().astype(np.float32)
        ref = a.astype(np.float32) @ b.astype(np.float32) + bias.astype(np.float32) + res.astype(np.float32)
        np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * max(np.abs(ref).max(), 1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("micro_tile", [(32, 1), (32, 64)])
def test_gpu_sparse_matmul_tiles_out(micro_tile):
    """op(a, b, out=c) runs the same graph as op(a, b), A compaction included, and fills c."""
    import pit_tvm
    from test_tensorcore_tiles import make_inputs as tiles_inputs

    m, k, n = 1000, 512, 256
    a, b, _, _ = tiles_inputs(m, k, n, micro_tile, 0.9, "float16", seed=3)
    op = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=micro_tile, target="cuda", out_dtype="float32")
    dev = tvm.cuda(0)
    out = tvm.runtime.tensor(np.full((m, n), np.nan, np.float32), dev)
    assert op(tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev), out=out) is out
    ref = a.astype(np.float32) @ b.astype(np.float32)
    np.testing.assert_allclose(out.numpy(), ref, rtol=2e-3, atol=2e-3 * max(np.abs(ref).max(), 1.0))


def test_block_k_32_build():
    """32-deep K tiles (rows / dense): A rows of 64 bytes under the 64-byte swizzle (descriptor
    code 2), twice the wgmma k16 steps' tiles; nvcc compiles it.  The tiles kind and other
    depths are refused."""
    ex = _exe(512, 768, "float16", "float16", True, True, config=WgmmaConfig(192, 8, 32))
    src = "\n".join(m.inspect_source("cuda") for m in ex.mod.imports)
    body = src[src.index('extern "C" __global__'):]
    assert "m64n192k16" in src and body.count("cp_async_cg") >= 2
    assert ", 2);" in body and ", 3);" in body          # A: 64-byte swizzle, B: 128-byte
    with pytest.raises(ValueError, match="block_k"):
        wgmma_row_gather_func(512, 768, config=WgmmaConfig(192, 8, 48))
    from pit_tvm.schedules.wgmma import wgmma_tiles_gather_func

    with pytest.raises(ValueError, match="block_k"):
        wgmma_tiles_gather_func(512, 256, 64, config=WgmmaConfig(256, 8, 32))
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(ex, archs=("sm_90a",)) >= 1


def test_wgmma_path_skips_mma_sync_imports():
    """Building the default CUDA rows op and a model's dense kernel (both wgmma) does not import
    the mma.sync schedules, whose tvm.s_tir.tensor_intrin import parses every TVM tensor
    intrinsic (~14 s on a CPU core; a model's first compile took 60 s with it)."""
    import subprocess
    import sys

    code = ("import sys, pit_tvm; pit_tvm.sparse_matmul(512, 256, 'float16', micro_tile=(1, 512), target='cuda'); "
            "from pit_tvm.ops.matmul import _cuda_dense_kernel; "
            "assert _cuda_dense_kernel(512, 256, 'float16', 'float16', True, True, 'sm_90a') is not None; "
            "print(sorted(m for m in ('tvm.s_tir.tensor_intrin.cuda', 'pit_tvm.schedules.tensorcore') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("micro_tile", [(32, 1), (32, 64)])
def test_tiles_dense_fallback_graph(micro_tile):
    """The graph emit_pit_matmul builds on the default target: index (+ compaction), tiles
    kernel, then (thin micro-tiles, the all-threads tiles loop) the dense fallback kernel in
    place on the tiles kernel's output; the kernels that branch on a full index read it (the
    CUDA source compares offsets[strips] with strips x K / mk) and nvcc compiles the op.  The
    warp-specialized tiles kernel (32x64) runs a full index itself: no fallback kernel."""
    folded = wgmma_tiles_config(256, micro_tile[1]).tiles_ws
    import pit_tvm
    from tvm import relax
    from pit_tvm.ops.matmul import emit_pit_matmul

    k, n = 512, 256
    bb = relax.BlockBuilder()
    m = tvm.tirx.Var("m", "int64")
    a = relax.Var("a", relax.TensorType([m, k], "float16"))
    b = relax.Var("b", relax.TensorType([k, n], "float16"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(emit_pit_matmul(bb, a, b, micro_tile=micro_tile, target="cuda"))
        bb.emit_func_output(out)
    text = bb.get()["main"].script()
    inplace = [line for line in text.splitlines() if "call_tir_inplace" in line]
    assert ("pit_dense_fallback_" in text) == (not folded)
    if not folded:
        assert len(inplace) == 1 and "pit_dense_fallback_" in inplace[0]
        assert text.index("pit_kernel_") < text.index("call_tir_inplace")

    op = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=micro_tile, target="cuda")
    src = "\n".join(cuda_sources(op.executable))
    bodies = dict(re.findall(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\([^)]*\) \{'
                             r'(.*?)(?=extern "C"|\Z)', src, flags=re.S))
    full = f"* {k // micro_tile[1]})"                             # strips x tiles per strip
    # (the compaction, when the micro-tiles need one, is part of the one-pass index: it always runs)
    guarded = [name for name in bodies if name.startswith(("pit_kernel_", "pit_dense_fallback_", "pit_compact_"))]
    assert len(guarded) == (1 if folded else 2)
    for name in guarded:
        assert full in bodies[name], name
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(op.executable, archs=("sm_90a",)) >= 1


def _rows_kernel_width(m, k, n, **emit_kw) -> int:
    """the wgmma N of the rows kernel emit_pit_matmul picks for a static ``[m, k] @ [k, n]``"""
    from tvm import relax
    from pit_tvm.ops.matmul import emit_pit_matmul

    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType([m, k], "float16"))
    b = relax.Var("b", relax.TensorType([k, n], "float16"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(emit_pit_matmul(bb, a, b, micro_tile=(1, k), target="cuda", **emit_kw))
        bb.emit_func_output(out)
    kernels = [f for gv, f in bb.get().functions_items() if gv.name_hint.startswith("pit_kernel_")]
    assert len(kernels) == 1
    column_tiles = int(re.search(r'launch_thread\("blockIdx.x", (\d+)\)', kernels[0].script()).group(1))
    return n // column_tiles


def test_expected_density_plans_the_rows_kernel_width():
    """BERT's FFN-in (4096 x 768 @ 768 x 3072): planned for the default half of the rows, 16 row
    tiles of 192 columns fill two waves of 132 CTAs as 256 columns do (192 wins on tile count);
    for 58.6 % of the rows (2,400: 19 row tiles) 192 columns need a third wave and 256 do not
    (H100, ``benchmarks/sweeps/width_sweep.py``: 2,304-2,560 rows 30.9-32.9 us at 256 against
    38.0-38.9 at 192).  A bad fraction is an error naming it."""
    assert _rows_kernel_width(4096, 768, 3072) == 192
    assert _rows_kernel_width(4096, 768, 3072, expected_density=0.586) == 256
    assert _rows_kernel_width(4096, 768, 768, expected_density=0.586) == 128     # one wave of 114 CTAs
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(ValueError, match="expected_density"):
            _rows_kernel_width(4096, 768, 3072, expected_density=bad)


def _tiles_epilogue_module(k, n, micro_tile, residual=True):
    """``a @ b + bias (+ r)`` through emit_pit_matmul on CUDA, M symbolic."""
    from tvm import relax
    from pit_tvm.ops.matmul import emit_pit_matmul

    bb = relax.BlockBuilder()
    m = tvm.tirx.Var("m", "int64")
    a = relax.Var("a", relax.TensorType([m, k], "float16"))
    b = relax.Var("b", relax.TensorType([k, n], "float16"))
    bias = relax.Var("bias", relax.TensorType([n], "float16"))
    r = relax.Var("r", relax.TensorType([m, n], "float16"))
    with bb.function("main", [a, b, bias] + ([r] if residual else [])):
        with bb.dataflow():
            out = bb.emit_output(emit_pit_matmul(bb, a, b, micro_tile=micro_tile, target="cuda", bias=bias,
                                                 residual=r if residual else None))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("residual", [False, True])
def test_tiles_kernels_run_bias_and_residual(residual):
    """An FFN's fc2, ``hidden @ w + bias + x``: the wgmma tiles kernel and its dense fallback
    both take the bias (and the residual), so no elementwise kernel follows them; nvcc compiles
    both variants (ptxas keeps the wgmmas async, no spills)."""
    mod = _tiles_epilogue_module(512, 256, (32, 1), residual)
    text = mod["main"].script()
    tag = "_bias_residual" if residual else "_bias"
    calls = [line for line in text.splitlines() if "R.call_tir" in line or "call_tir_inplace" in line]
    assert any("pit_kernel_" in c and tag in c for c in calls), text
    fallback = [c for c in calls if "pit_dense_fallback_" in c]
    # (a, b, offsets, bias[, residual], c): c, written in place, is argument 4 or 5
    assert len(fallback) == 1 and tag in fallback[0] and f"inplace_indices=[{4 + residual}]" in fallback[0]
    assert "R.add" not in text
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    for name in ("pit_kernel_", "pit_dense_fallback_"):
        gv = next(g for g in mod.get_global_vars() if g.name_hint.startswith(name))
        ex = build(tvm.IRModule({"main": mod[gv].with_attr("global_symbol", "main")}), TARGET)
        log = ptxas_log(cuda_sources(ex)[0], "sm_90a")
        assert "C7515" not in log and re.search(r"\b0 bytes spill stores", log), log[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("sparsity", [0.0, 0.9, 1.0])
@pytest.mark.parametrize("micro_tile", [(32, 1), (32, 64)])
def test_gpu_tiles_bias_residual(micro_tile, sparsity):
    """``a @ b + bias + r`` on the H100 through the tiles kernel (0.9), the dense fallback (0.0)
    and all-empty strips (1.0: ``bias + r`` on every row), M not a multiple of 128."""
    from tvm import relax
    from test_tensorcore_tiles import make_inputs as tiles_inputs

    m, k, n = 1000, 512, 256
    a, b, _, _ = tiles_inputs(m, k, n, micro_tile, sparsity, "float16", seed=int(sparsity * 10) + 7)
    rng = np.random.default_rng(8)
    bias_v = rng.standard_normal(n).astype(np.float16)
    r = rng.standard_normal((m, n)).astype(np.float16)
    vm = relax.VirtualMachine(build(_tiles_epilogue_module(k, n, micro_tile), "cuda"), tvm.cuda(0))
    t = lambda x: tvm.runtime.tensor(x, tvm.cuda(0))  # noqa: E731
    got = vm["main"](t(a), t(b), t(bias_v), t(r)).numpy().astype(np.float32)
    pre = (a.astype(np.float32) @ b.astype(np.float32) + bias_v.astype(np.float32)).astype(np.float16)
    ref = pre.astype(np.float32) + r.astype(np.float32)
    np.testing.assert_allclose(got, ref, rtol=1e-2, atol=1e-2 * max(np.abs(ref).max(), 1.0))
