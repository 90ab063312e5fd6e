"""PIT matmul on shapes the fast kernels' tiles do not divide (odd K, N, M), large K on the
CPU, and NaN / Inf in B beside the micro-tiles the index skips (issue 32, issue 34 item 5)."""
import re
import warnings

import numpy as np
import pytest

import pit_tvm
from pit_tvm.runtime.loader import numpy_dtype
from pit_tvm.nvcc import check_cuda_compiles, find_nvcc
from pit_tvm.ops.matmul import DenseMatmul

TOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}
CUDA_TARGETS = ["cuda", "cuda:sm_90", "cuda:sm_80"]
#: K and N no kernel tile divides (and K below every K tile)
ODD_K, ODD_N = 100, 72


def skip_unless_cubin_runs_here(target):
    """Skip where ``target``'s cubin cannot load on this GPU: TVM's nvcc build embeds a cubin for
    the named arch only (no PTX), and a cubin runs on GPUs of its major arch, not on later ones
    (an sm_80 kernel on an H100 fails with CUDA_ERROR_NO_BINARY_FOR_GPU)."""
    if ":sm_" not in target:
        return
    import tvm

    want = target.split(":sm_")[1][:2]
    have = tvm.cuda(0).compute_version.replace(".", "")
    if have[0] != want[0] or have[1:] < want[1:]:
        pytest.skip(f"{target}'s cubin does not load on this sm_{have} GPU (its build is checked by nvcc)")


def tile_sparse(m, k, micro_tile, density, dtype, rng):
    """A whose micro-tiles (edge ones partial) are non-zero with probability ``density``, and
    the boolean tile mask."""
    mr, mk = micro_tile
    mask = rng.random((-(-m // mr), -(-k // mk))) < density
    a = rng.standard_normal((m, k)) * np.kron(mask, np.ones((mr, mk)))[:m, :k]
    return a.astype(numpy_dtype(dtype)), mask


def reference(a, b, dtype):
    return (a.astype(np.float32) @ b.astype(np.float32)).astype(numpy_dtype(dtype)).astype(np.float32)


def skipping_reference(a, b, mask, micro_tile):
    """``a @ b`` in which the micro-tiles ``mask`` marks zero contribute exactly 0 (float64)."""
    mr, mk = micro_tile
    m, k = a.shape
    c = np.zeros((m, b.shape[1]))
    with np.errstate(invalid="ignore"):
        for tr, tc in zip(*np.nonzero(mask)):
            rows, cols = slice(tr * mr, min(m, tr * mr + mr)), slice(tc * mk, min(k, tc * mk + mk))
            c[rows] += a[rows, cols].astype(np.float64) @ b[cols].astype(np.float64)
    return c


# ------------------------------------------------------------------ odd K, N on CUDA (build)
@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("k,n,dtype,micro_tile,target", [
    (1000, 64, "float32", (1, 1000), "cuda:sm_80"),     # K past whole K tiles
    (100, 72, "bfloat16", (1, 100), "cuda:sm_90"),      # K and N
    (999, 3000, "float16", (1, 999), "cuda"),           # sm_90a: no wgmma / mma.sync tile fits
    (1, 1, "float16", (1, 1), "cuda"),
    (1000, 100, "float16", (32, 64), "cuda:sm_80"),     # a partial last micro-tile along K
])
def test_cuda_unaligned_shapes_compile(k, n, dtype, micro_tile, target):
    """Any K, N builds on every CUDA target: where no tensor-core kernel's tiles fit, the SIMT
    kernel runs it, and fp16 / bf16 say so."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        op = pit_tvm.sparse_matmul(k, n, dtype, micro_tile=micro_tile, target=target)
    said = [str(w.message) for w in caught if "SIMT kernel runs it" in str(w.message)]
    assert bool(said) == (dtype != "float32")
    arch = {"cuda": "sm_90a"}.get(target, target.split(":")[-1])
    assert check_cuda_compiles(op.executable, archs=(arch,)) >= 1


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
def test_cuda_dense_baseline_unaligned_compiles():
    op = DenseMatmul(ODD_K, ODD_N, "float32", target="cuda:sm_80")
    assert check_cuda_compiles(op.executable, archs=("sm_80",)) >= 1


#: (K, N, micro-tile): K and N unaligned (partial last micro-tiles along K), N alone
UNALIGNED_CASES = [(ODD_K, ODD_N, (1, ODD_K)), (ODD_K, ODD_N, (32, 64)), (ODD_K, ODD_N, (1, 64)),
                   (ODD_K, ODD_N, (16, 1)), (128, 30, (1, 128)), (128, 30, (32, 64))]


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,micro_tile", UNALIGNED_CASES,
                         ids=[f"k{k}_n{n}_{t[0]}x{t[1]}" for k, n, t in UNALIGNED_CASES])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("target", CUDA_TARGETS)
def test_cuda_unaligned_shapes_match_numpy(target, dtype, k, n, micro_tile):
    skip_unless_cubin_runs_here(target)
    rng = np.random.default_rng(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        op = pit_tvm.sparse_matmul(k, n, dtype, micro_tile=micro_tile, target=target)
    b = rng.standard_normal((k, n)).astype(numpy_dtype(dtype))
    for m, density in ((1, 1.0), (77, 0.5), (300, 0.95), (129, 0.0)):
        a, _ = tile_sparse(m, k, micro_tile, density, dtype, rng)
        np.testing.assert_allclose(op(a, b).astype(np.float32), reference(a, b, dtype),
                                   rtol=TOL[dtype], atol=TOL[dtype] * 8)


@pytest.mark.gpu
@pytest.mark.parametrize("target", CUDA_TARGETS)
def test_cuda_issue_shape_matches_numpy(target):
    """the shape of the report: K = 1000, N = 3000 (no multiple of 64), fp16 whole rows"""
    skip_unless_cubin_runs_here(target)
    rng = np.random.default_rng(12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        op = pit_tvm.sparse_matmul(1000, 3000, "float16", micro_tile=(1, 1000), target=target)
    b = rng.standard_normal((1000, 3000)).astype(np.float16)
    for m in (5, 333):
        a, _ = tile_sparse(m, 1000, (1, 1000), 0.5, "float16", rng)
        np.testing.assert_allclose(op(a, b).astype(np.float32), reference(a, b, "float16"),
                                   rtol=2e-2, atol=0.3)


# ------------------------------------------------------------------ large K on the CPU
@pytest.mark.parametrize("k", [11008, 40000])
def test_cpu_rows_large_k_builds_and_matches(k):
    """The whole-row gather is vectorised in chunks of at most 64 lanes: a K-lane vector took
    minutes to build past K ~ 11000 and failed in LLVM past 32768."""
    rng = np.random.default_rng(k)
    n = 5
    op = pit_tvm.sparse_matmul(k, n, "float32", micro_tile=(1, k), target="llvm")
    ir = "".join(m.inspect_source("ll") for m in op.executable.mod.imports)
    lanes = [int(x) for x in re.findall(r"<(\d+) x float>", ir)]
    assert lanes and max(lanes) <= 64
    a = rng.standard_normal((3, k)).astype(np.float32)
    a[1] = 0
    b = rng.standard_normal((k, n)).astype(np.float32)
    np.testing.assert_allclose(op(a, b), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)


# ------------------------------------------------------------------ NaN / Inf in B
def _b_with_non_finite(k, n, dtype, rng):
    b = rng.standard_normal((k, n)).astype(numpy_dtype(dtype))
    b[0, 1], b[k // 2, 2], b[k - 1, 3] = np.nan, np.inf, -np.inf
    return b


def _check_skipped_tiles_contribute_zero(op, dtype, rng, k, n):
    """Below and above the density threshold alike, C is ``a @ b`` with every micro-tile the
    index skips (all-zero micro-tiles of the kernel's plan) contributing exactly 0, whatever B
    holds there."""
    micro_tile = op.kernel_plan.micro_tile
    b = _b_with_non_finite(k, n, dtype, rng)
    for density in (0.3, 0.97):
        a, mask = tile_sparse(96, k, micro_tile, density, dtype, rng)
        mask[0, 0] = False                 # a skipped micro-tile beside B's NaN row
        a[:micro_tile[0], :micro_tile[1]] = 0
        want = skipping_reference(a, b, mask, micro_tile)
        got = op(a, b).astype(np.float64)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype] * 8, equal_nan=True)


@pytest.mark.parametrize("micro_tile", [(1, 96), (32, 1), (32, 64), (4, 96)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_cpu_nan_in_b_beside_skipped_tiles(micro_tile):
    rng = np.random.default_rng(sum(micro_tile))
    op = pit_tvm.sparse_matmul(96, 80, "float32", micro_tile=micro_tile, target="llvm", density_threshold=0.9)
    _check_skipped_tiles_contribute_zero(op, "float32", rng, 96, 80)


@pytest.mark.gpu
@pytest.mark.parametrize("micro_tile", [(1, 256), (32, 1)], ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("target", ["cuda:sm_90", "cuda:sm_80"])
def test_cuda_nan_in_b_beside_skipped_tiles(target, dtype, micro_tile):
    """mma.sync / SIMT kernels: the same on both sides of the threshold"""
    skip_unless_cubin_runs_here(target)
    rng = np.random.default_rng(3)
    op = pit_tvm.sparse_matmul(256, 128, dtype, micro_tile=micro_tile, target=target, density_threshold=0.9)
    _check_skipped_tiles_contribute_zero(op, dtype, rng, 256, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("micro_tile", [(1, 256), (128, 64)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_cuda_sm90a_nan_in_b(micro_tile):
    """sm_90a: whole rows as everywhere; the wgmma tiles kernel's dense fallback (above the
    threshold) multiplies every micro-tile, so there NaN / Inf reach C as in numpy's a @ b,
    and with ``density_threshold=None`` skipped micro-tiles contribute 0 at every density."""
    rng = np.random.default_rng(4)
    op = pit_tvm.sparse_matmul(256, 128, "float16", micro_tile=micro_tile, target="cuda", density_threshold=None)
    _check_skipped_tiles_contribute_zero(op, "float16", rng, 256, 128)
    if micro_tile[0] == 1:
        op = pit_tvm.sparse_matmul(256, 128, "float16", micro_tile=micro_tile, target="cuda")
        _check_skipped_tiles_contribute_zero(op, "float16", rng, 256, 128)
    else:
        op = pit_tvm.sparse_matmul(256, 128, "float16", micro_tile=micro_tile, target="cuda", density_threshold=0.0)
        b = _b_with_non_finite(256, 128, "float16", rng)
        a, _ = tile_sparse(256, 256, micro_tile, 0.5, "float16", rng)
        with np.errstate(invalid="ignore"):
            want = a.astype(np.float64) @ b.astype(np.float64)
        np.testing.assert_array_equal(np.isnan(op(a, b).astype(np.float64)), np.isnan(want))


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
def test_compile_onnx_unaligned_fp16_builds():
    """A model's matmuls of tile-unaligned K, N (fp16, the default cuda target): the PIT
    lowering and the tensor-core dense kernels do not take them, TVM's kernels do (warned)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from pit_tvm.compile import compile_onnx

    rng = np.random.default_rng(0)
    weights = {"w1": rng.standard_normal((100, 72)).astype("float16"),
               "w2": rng.standard_normal((72, 30)).astype("float16")}
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["hidden"]),
         helper.make_node("MatMul", ["hidden", "w2"], ["y"])], "m",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 100])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", 30])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    with pytest.warns(UserWarning, match="stays dense"):
        cm = compile_onnx(model, "cuda", shapes={"x": [13, 100]})
    assert check_cuda_compiles(cm.executable, archs=("sm_90a",)) >= 1
