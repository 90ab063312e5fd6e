"""PIT matmul against numpy: every micro-tile kind, dtype and sparsity; CUDA codegen via nvcc."""
import functools
import re
from pathlib import Path

import numpy as np
import tvm
import pytest
from hypothesis import given, settings, strategies as st

import pit_tvm
from pit_tvm.runtime.loader import numpy_dtype
from pit_tvm.nvcc import check_cuda_compiles, cuda_sources, find_nvcc
from pit_tvm.ops.matmul import DenseMatmul

K, N = 96, 80                       # N and (for 64-wide tiles) K do not divide the tiles
MICRO_TILES = [(1, K), (32, 1), (32, 64), (1, 64)]
DTYPES = ["float32", "float16", "bfloat16"]
TOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}


@functools.lru_cache(maxsize=None)
def op_for(micro_tile, dtype, target="llvm", density_threshold=0.9):
    return pit_tvm.sparse_matmul(K, N, dtype, micro_tile=micro_tile, target=target,
                                 density_threshold=density_threshold)


def test_readme_api_names_resolve():
    """every ``pit_tvm.NAME(`` the README shows is a public name of the package"""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    names = set(re.findall(r"pit_tvm\.(\w+)\(", readme))
    assert {"sparse_matmul", "compile_onnx", "choose_micro_tile"} <= names
    assert names <= set(pit_tvm.__all__)
    assert all(callable(getattr(pit_tvm, name)) for name in pit_tvm.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        pit_tvm.nonexistent


def sparse_input(m, micro_tile, sparsity, dtype, rng):
    """A with whole micro-tiles zero at the given sparsity (edge tiles partial)."""
    mr, mk = micro_tile
    mask = rng.random((-(-m // mr), -(-K // mk))) >= sparsity
    a = rng.standard_normal((m, K)) * np.kron(mask, np.ones((mr, mk)))[:m, :K]
    return a.astype(numpy_dtype(dtype))


def reference(a, b, dtype):
    return (a.astype(np.float32) @ b.astype(np.float32)).astype(numpy_dtype(dtype)).astype(np.float32)


@pytest.mark.parametrize("micro_tile", MICRO_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99, 1.0])
def test_matches_numpy(micro_tile, dtype, sparsity):
    rng = np.random.default_rng(hash((micro_tile, dtype, sparsity)) % 2**32)
    op = op_for(micro_tile, dtype)
    for m in (77, 64):
        a = sparse_input(m, micro_tile, sparsity, dtype, rng)
        b = rng.standard_normal((K, N)).astype(numpy_dtype(dtype))
        c = op(a, b)
        assert c.shape == (m, N) and c.dtype == numpy_dtype(dtype)
        np.testing.assert_allclose(c.astype(np.float32), reference(a, b, dtype), rtol=TOL[dtype], atol=TOL[dtype] * 4)


@pytest.mark.parametrize("micro_tile", MICRO_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_without_dense_fallback_and_index(micro_tile):
    """With the fallback off the PIT kernel handles a fully dense A on its own."""
    rng = np.random.default_rng(1)
    op = op_for(micro_tile, "float32", density_threshold=None)
    a = sparse_input(50, micro_tile, 0.0, "float32", rng)
    b = rng.standard_normal((K, N)).astype(np.float32)
    np.testing.assert_allclose(op(a, b), a @ b, rtol=1e-4, atol=1e-4)
    offsets, ids = op.index(a)
    assert offsets.numpy()[-1] == ids.numpy().size  # every micro-tile listed


def test_out_argument_and_independent_results():
    """out= writes C in place (TVM tensor or numpy through DLPack) and is checked; results of
    successive calls (VM pooled allocator) do not alias each other."""
    rng = np.random.default_rng(4)
    op = op_for((1, K), "float32")
    b = rng.standard_normal((K, N)).astype(np.float32)
    a1 = sparse_input(40, (1, K), 0.5, "float32", rng)
    a2 = sparse_input(40, (1, K), 0.5, "float32", rng)
    c1 = op(tvm.runtime.tensor(a1), tvm.runtime.tensor(b))
    c2 = op(tvm.runtime.tensor(a2), tvm.runtime.tensor(b))
    np.testing.assert_allclose(c1.numpy(), a1 @ b, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(c2.numpy(), a2 @ b, rtol=1e-4, atol=1e-4)
    for out in (tvm.runtime.empty((40, N), "float32"), np.full((40, N), np.nan, np.float32)):
        assert op(a1, b, out=out) is out
        got = out.numpy() if isinstance(out, tvm.runtime.Tensor) else out
        np.testing.assert_allclose(got, a1 @ b, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="out must have shape"):
        op(a1, b, out=np.zeros((41, N), np.float32))
    with pytest.raises(ValueError, match="out: dtype"):
        op(a1, b, out=np.zeros((40, N), np.float64))
    with pytest.raises(TypeError, match="a TVM tensor or a DLPack tensor"):
        op(a1, b, out=[[0.0]])


def test_dense_baseline_matches():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((45, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    np.testing.assert_allclose(DenseMatmul(K, N, "float32", "llvm")(a, b), a @ b, rtol=1e-4, atol=1e-4)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 90), density=st.floats(0.0, 1.0), seed=st.integers(0, 2**16),
       kind=st.sampled_from([(1, K), (32, 64)]))
def test_fuzz_random_masks(m, density, seed, kind):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, K)).astype(np.float32)
    a *= rng.random((m, K)) < density          # element-level pattern: tiles partly full
    b = rng.standard_normal((K, N)).astype(np.float32)
    np.testing.assert_allclose(op_for(kind, "float32")(a, b), a @ b, rtol=1e-4, atol=1e-4)


def test_bad_input_errors():
    op = op_for((1, K), "float32")
    b = np.zeros((K, N), np.float32)
    with pytest.raises(ValueError, match="A must have shape"):
        op(np.zeros((4, K + 1), np.float32), b)
    with pytest.raises(ValueError, match="B must have shape"):
        op(np.zeros((4, K), np.float32), np.zeros((K, N + 1), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        op(np.zeros((4, K), np.float64), b)
    with pytest.raises(ValueError, match="unsupported dtype"):
        pit_tvm.sparse_matmul(K, N, "int8")
    with pytest.raises(ValueError, match="does not fit the PIT axis"):
        pit_tvm.sparse_matmul(K, N, "float32", micro_tile=(1, K + 1))
    with pytest.raises(ValueError, match="micro_tile"):
        pit_tvm.sparse_matmul(K, N, "float32", micro_tile=(0, 4))


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("micro_tile", MICRO_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_cuda_codegen_compiles_with_nvcc(micro_tile):
    op = op_for(micro_tile, "float16", "cuda")
    assert check_cuda_compiles(op.executable, archs=("sm_80", "sm_90")) >= 2


def test_thin_micro_tile_runs_on_tensor_cores_as_16_row_cover():
    """On CUDA a 1x64 micro-tile (thinner than an mma tile) is indexed and computed as
    16x64 tiles by the mma.sync tiles kernel (sm_80 / sm_90), as 128x64 by the wgmma one
    (sm_90a, the default); on the CPU it stays 1x64."""
    op = pit_tvm.sparse_matmul(256, 128, "float16", micro_tile=(1, 64), target="cuda:sm_90")
    assert op.micro_tile == (1, 64) and op.kernel_plan.micro_tile == (16, 64)
    assert "mma.sync" in "\n".join(cuda_sources(op.executable))
    op = pit_tvm.sparse_matmul(256, 128, "float16", micro_tile=(1, 64), target="cuda")
    assert op.micro_tile == (1, 64) and op.kernel_plan.micro_tile == (128, 64)
    assert "wgmma.mma_async" in "\n".join(cuda_sources(op.executable))
    # the CPU, fp32 (SIMT) and tile-unaligned N keep the requested micro-tile
    assert op_for((1, 64), "float16").kernel_plan.micro_tile == (1, 64)
    assert op_for((1, 64), "float16", "cuda").kernel_plan.micro_tile == (1, 64)     # N=80
    assert pit_tvm.sparse_matmul(256, 128, "float32", micro_tile=(1, 64),
                                 target="cuda").kernel_plan.micro_tile == (1, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_thin_micro_tile_cover_matches_numpy(dtype):
    rng = np.random.default_rng(5)
    k, n = 256, 128
    op = pit_tvm.sparse_matmul(k, n, dtype, micro_tile=(1, 64), target="cuda")
    for m, sparsity in ((300, 0.0), (300, 0.9), (77, 0.99), (64, 1.0), (33, 0.5)):
        mask = rng.random((m, k // 64)) >= sparsity
        a = (rng.standard_normal((m, k)) * np.kron(mask, np.ones((1, 64)))).astype(numpy_dtype(dtype))
        b = rng.standard_normal((k, n)).astype(numpy_dtype(dtype))
        np.testing.assert_allclose(op(a, b).astype(np.float32), reference(a, b, dtype),
                                   rtol=TOL[dtype], atol=TOL[dtype] * 8)


@pytest.mark.gpu
@pytest.mark.parametrize("micro_tile", MICRO_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99, 1.0])
def test_cuda_matches_numpy(micro_tile, dtype, sparsity):
    rng = np.random.default_rng(7)
    op = op_for(micro_tile, dtype, "cuda")
    for m in (300, 64):
        a = sparse_input(m, micro_tile, sparsity, dtype, rng)
        b = rng.standard_normal((K, N)).astype(numpy_dtype(dtype))
        c = op(a, b)
        np.testing.assert_allclose(c.astype(np.float32), reference(a, b, dtype), rtol=TOL[dtype], atol=TOL[dtype] * 4)


@pytest.mark.gpu
def test_cuda_dense_baseline_matches():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((300, K)).astype(np.float16)
    b = rng.standard_normal((K, N)).astype(np.float16)
    c = DenseMatmul(K, N, "float16", "cuda")(a, b)
    np.testing.assert_allclose(c.astype(np.float32), reference(a, b, "float16"), rtol=2e-2, atol=8e-2)


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("k,n,micro_tile", [(96, 16, (1, 96)), (32, 20, (1, 32)), (64, 16, (32, 1)), (48, 7, (4, 16))])
def test_cuda_odd_shapes_build(k, n, micro_tile):
    """Narrow or odd N and K keep constant-size tiles (buffer compaction used to trip on them)."""
    op = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=micro_tile, target="cuda")
    assert check_cuda_compiles(op.executable, archs=("sm_90",)) >= 1


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch,mma", [("sm_90", "mma.sync"), ("sm_90a", "wgmma.mma_async")])
def test_cuda_rows_fp16_uses_tensor_cores(arch, mma):
    """sm_90 (and sm_80) get the mma.sync schedule, sm_90a (the default "cuda") wgmma."""
    op = pit_tvm.sparse_matmul(256, 256, "float16", micro_tile=(1, 256), target=f"cuda:{arch}")
    from pit_tvm.nvcc import cuda_sources

    src = "\n".join(cuda_sources(op.executable))
    assert mma in src and "cp.async" in src
    assert ("ldmatrix" in src) == (mma == "mma.sync")
    assert check_cuda_compiles(op.executable, archs=(arch,)) >= 1
    if arch == "sm_90a":
        assert pit_tvm.sparse_matmul(256, 256, "float16", micro_tile=(1, 256),
                                     target="cuda").executable is not None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 1.0])
def test_cuda_tensor_core_rows_match(dtype, sparsity):
    rng = np.random.default_rng(11)
    op = pit_tvm.sparse_matmul(256, 256, dtype, micro_tile=(1, 256), target="cuda")
    a = (rng.standard_normal((333, 256)) * (rng.random((333, 1)) >= sparsity)).astype(numpy_dtype(dtype))
    b = rng.standard_normal((256, 256)).astype(numpy_dtype(dtype))
    ref = (a.astype(np.float32) @ b.astype(np.float32)).astype(numpy_dtype(dtype)).astype(np.float32)
    np.testing.assert_allclose(op(a, b).astype(np.float32), ref, rtol=TOL[dtype], atol=TOL[dtype] * 8)


def test_cpu_graph_kernels_keep_noalias():
    """A Relax graph over a symbolic M holds VMShapeLower's shape function; the CPU build marks
    it ``noalias`` (``pit_tvm.target.mark_shape_funcs_noalias``), so LLVM keeps ``noalias`` on
    the kernels' pointers (without it the CPU kernels lost their register tiles: the rows op
    at 1024^3 fp32 ran in 61 ms instead of 28)."""
    import re

    op = pit_tvm.sparse_matmul(64, 64, "float32", micro_tile=(1, 64), target="llvm")
    ll = op.executable.mod.imports[0].inspect_source("ll")
    kernel = [line for line in ll.splitlines() if re.match(r"define .*@pit_kernel_\w*_compute_\(", line)]
    assert len(kernel) == 1 and "ptr noalias" in kernel[0], kernel
    assert re.search(r"define .*@shape_func_compute_\(ptr noalias", ll)
