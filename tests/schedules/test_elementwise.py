"""VectorizedElementwise: the dlight rule giving static-shape injective kernels VEC elements per thread."""
import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from pit_tvm.testing import build_with_cuda_rules, legalized_cuda_module
from pit_tvm.nvcc import check_cuda_compiles, cuda_sources, find_nvcc
from pit_tvm.schedules.elementwise import VectorizedElementwise
from pit_tvm.target import cuda_schedule_rules, make_target

CUDA = make_target("cuda")


def gelu_bias_mask(x, b, m):
    """BERT's fused FFN activation: gelu(x + b) * row mask."""
    h = relax.op.add(x, b)
    g = relax.op.multiply(relax.op.multiply(h, relax.const(0.5, "float16")),
                          relax.op.add(relax.const(1.0, "float16"),
                                       relax.op.erf(relax.op.multiply(h, relax.const(0.7071, "float16")))))
    return relax.op.multiply(g, m)


def bias_transpose(x, b):
    """Bias add, then split heads: [B, S, H*D] -> [B, H, S, D] (a strided input)."""
    y = relax.op.reshape(relax.op.add(x, b), (2, 24, 3, 16))
    return relax.op.permute_dims(y, [0, 2, 1, 3])


CASES = {
    "gelu": (gelu_bias_mask, [(2, 24, 96), (96,), (2, 24, 1)]),
    "transpose": (bias_transpose, [(2, 24, 48), (48,)]),
}


def test_applies_with_static_shapes_and_declines_otherwise():
    for fn, shapes in CASES.values():
        _, prim = legalized_cuda_module(fn, *shapes)
        sch = VectorizedElementwise().apply(prim, CUDA, False)
        assert sch is not None and "T.vectorized" in sch.mod["main"].script()
    n = tirx.Var("n", "int64")
    _, prim = legalized_cuda_module(relax.op.nn.relu, (n, 64))
    assert VectorizedElementwise().apply(prim, CUDA, False) is None          # symbolic
    _, prim = legalized_cuda_module(relax.op.nn.relu, (8, 6))
    assert VectorizedElementwise().apply(prim, CUDA, False) is None          # 6 % VEC
    _, prim = legalized_cuda_module(lambda x: relax.op.sum(x, axis=[1]), (8, 64))
    assert VectorizedElementwise().apply(prim, CUDA, False) is None          # a reduction
    _, prim = legalized_cuda_module(relax.op.nn.relu, (8, 64))
    assert VectorizedElementwise().apply(prim, make_target("llvm"), False) is None
    names = [type(r).__name__ for r in cuda_schedule_rules()]
    assert names.index("VectorizedElementwise") < names.index("Fallback")


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_build(case):
    fn, shapes = CASES[case]
    ex = build_with_cuda_rules(legalized_cuda_module(fn, *shapes)[0])
    assert "half4" in "\n".join(cuda_sources(ex))
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(ex, archs=("sm_80", "sm_90")) >= 1


def _reference(case, arrays):
    f = [a.astype("float32") for a in arrays]
    if case == "gelu":
        from math import erf

        h = f[0] + f[1]
        return 0.5 * h * (1 + np.vectorize(erf)(h * 0.7071)) * f[2]
    return (f[0] + f[1]).reshape(2, 24, 3, 16).transpose(0, 2, 1, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_matches_numpy(case):
    fn, shapes = CASES[case]
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype("float16") for s in shapes]
    if case == "gelu":
        arrays[2] = (rng.random(shapes[2]) < 0.5).astype("float16")
    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(build_with_cuda_rules(legalized_cuda_module(fn, *shapes)[0]), dev)
    got = vm["main"](*(tvm.runtime.tensor(a, dev) for a in arrays)).numpy().astype("float32")
    np.testing.assert_allclose(got, _reference(case, arrays), atol=2e-2, rtol=1e-2)


def test_declines_misaligned_reads():
    """A slice starting one element in would make misaligned vector loads: declined; one
    starting on a VEC boundary of VEC-multiple rows is vectorised."""
    shifted = legalized_cuda_module(
        lambda x: relax.op.strided_slice(x, axes=[1], begin=[1], end=[65]), (8, 68))[1]
    assert VectorizedElementwise().apply(shifted, CUDA, False) is None
    aligned = legalized_cuda_module(
        lambda x: relax.op.strided_slice(x, axes=[1], begin=[4], end=[68]), (8, 68))[1]
    assert VectorizedElementwise().apply(aligned, CUDA, False) is not None  # starts at 4, rows of 68


def test_reads_through_a_vec_multiple_modulo_are_vectorised():
    """Merging heads reads ``x[b, h, s, v % 64]``-style indices: a vector never wraps 64."""
    merge = legalized_cuda_module(
        lambda x: relax.op.reshape(relax.op.permute_dims(x, [0, 2, 1, 3]), (2, 24, 48)), (2, 3, 24, 16))[1]
    assert VectorizedElementwise().apply(merge, CUDA, False) is not None
    odd = legalized_cuda_module(
        lambda x: relax.op.reshape(relax.op.permute_dims(x, [0, 2, 1, 3]), (2, 24, 18)), (2, 3, 24, 6))[1]
    assert VectorizedElementwise().apply(odd, CUDA, False) is None       # v % 6 wraps inside a vector


def test_a_scalar_read_is_broadcast():
    """A 0-d operand (a folded exponent or scale) has no last dim to check: the kernel is
    vectorised with the scalar broadcast (the rule's alignment check indexed it, IndexError)."""
    _, prim = legalized_cuda_module(lambda x, s: relax.op.multiply(x, s), (8, 64), ())
    sch = VectorizedElementwise().apply(prim, CUDA, False)
    assert sch is not None and "T.vectorized" in sch.mod["main"].script()


def _mask_cast(m):
    """the dynamo exports' ``attention_mask`` (int64) cast to bool"""
    return relax.op.astype(m, "bool")


def _wrap_ids(ids):
    """negative token ids wrapped: a bool only in registers"""
    wrapped = relax.op.add(ids, relax.const(100, "int64"))
    return relax.op.where(relax.op.less(ids, relax.const(0, "int64")), wrapped, ids)


def _bool_unit_dim_to_half(m):
    """a ``[2, 16, 1]`` bool mask as ``[2, 16]`` fp16 (T5's mask read)"""
    return relax.op.reshape(relax.op.astype(m, "float16"), (2, 16))


def test_declines_bool_vectors():
    """TVM's CUDA codegen types a bool x4 access ``ushort4`` (8 bytes for 4, at 4-byte offsets:
    cudaErrorMisalignedAddress, and writes past the end): a bool output or a bool read walking
    the vector is declined; a bool kept in registers is not a memory access"""
    cast = legalized_cuda_module(_mask_cast, (2, 16), dtype="int64")
    assert VectorizedElementwise().apply(cast[1], CUDA, False) is None
    to_half = legalized_cuda_module(lambda m: relax.op.astype(m, "float16"), (2, 16), dtype="bool")[1]
    assert VectorizedElementwise().apply(to_half, CUDA, False) is None
    # T5's mask: a [.., S, 1] bool read at [.., v, 0] is contiguous, loaded as a vector too
    unit_last = legalized_cuda_module(_bool_unit_dim_to_half, (2, 16, 1), dtype="bool")[1]
    assert VectorizedElementwise().apply(unit_last, CUDA, False) is None
    assert VectorizedElementwise().apply(legalized_cuda_module(_wrap_ids, (2, 16), dtype="int64")[1], CUDA, False)
    source = "\n".join(cuda_sources(build_with_cuda_rules(cast[0])))
    assert "ushort4" not in source and "bool" in source


def _outer_dim_slice(begin):
    """``x[:, begin:begin + 64, 0]`` of an ``[8, 68, 1]`` tensor: the vector axis walks dim 1"""
    return lambda x: relax.op.reshape(relax.op.strided_slice(x, axes=[1], begin=[begin], end=[begin + 64]), (8, 64))


def test_reads_walking_an_outer_dim_are_checked():
    """a read whose last dim is a unit dim and whose vector axis walks the one before it is
    contiguous in memory, and TVM may load it as a vector (it did T5's ``[.., S, 1]`` bool mask):
    its start is checked as a last-dim read's is"""
    shifted = legalized_cuda_module(_outer_dim_slice(1), (8, 68, 1))[1]
    assert VectorizedElementwise().apply(shifted, CUDA, False) is None
    aligned = legalized_cuda_module(_outer_dim_slice(4), (8, 68, 1))[1]
    assert VectorizedElementwise().apply(aligned, CUDA, False) is not None


@pytest.mark.gpu
def test_gpu_bool_and_outer_dim_kernels_match_numpy():
    """the kernels the rule now declines or checks run and are right (misaligned address before)"""
    dev = tvm.cuda(0)
    mask = (np.arange(32).reshape(2, 16) % 3 == 0).astype("int64")

    def run(fn, shape, dtype, x):
        vm = relax.VirtualMachine(build_with_cuda_rules(legalized_cuda_module(fn, shape, dtype=dtype)[0]), dev)
        return vm["main"](tvm.runtime.tensor(x, dev)).numpy()

    np.testing.assert_array_equal(run(_mask_cast, (2, 16), "int64", mask), mask.astype(bool))
    bools = mask.astype(bool).reshape(2, 16, 1)
    np.testing.assert_array_equal(run(_bool_unit_dim_to_half, (2, 16, 1), "bool", bools), mask.astype("float16"))
    x = np.random.default_rng(0).standard_normal((8, 68, 1)).astype("float16")
    for begin in (1, 4):
        np.testing.assert_array_equal(run(_outer_dim_slice(begin), (8, 68, 1), "float16", x), x[:, begin:begin + 64, 0])


def _row_select(c, a, b):
    """``where(c[b, 0, s, 0] < 0, a, b)`` over heads and head dim: a condition constant along
    the vector (Longformer's global / padding rows picked per token)"""
    return relax.op.where(relax.op.less(c, relax.const(0.0, str(c.ty.dtype))), a, b)


ROW_SELECT_SHAPES = [(2, 1, 64, 1), (2, 2, 64, 16), (2, 2, 64, 16)]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_declines_selects_constant_along_the_vector(dtype):
    """TVM broadcasts a select condition that does not vary along the vector to a bool x4
    value declared ``float4 v = make_ushort4(..)`` (nvcc: no conversion from ushort4): such a
    kernel is declined (Fallback's compiles); a condition that varies along it stays vectorised"""
    mod, prim = legalized_cuda_module(_row_select, *ROW_SELECT_SHAPES, dtype=dtype)
    assert VectorizedElementwise().apply(prim, CUDA, False) is None
    assert VectorizedElementwise().apply(legalized_cuda_module(_wrap_ids, (2, 16), dtype="int64")[1], CUDA, False)
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(build_with_cuda_rules(mod), archs=("sm_90a",)) >= 1


@pytest.mark.gpu
def test_gpu_row_select_matches_numpy():
    rng = np.random.default_rng(0)
    c, a, b = (rng.standard_normal(s).astype("float32") for s in ROW_SELECT_SHAPES)
    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(build_with_cuda_rules(legalized_cuda_module(_row_select, *ROW_SELECT_SHAPES,
                                                                          dtype="float32")[0]), dev)
    got = vm["main"](*(tvm.runtime.tensor(x, dev) for x in (c, a, b))).numpy()
    np.testing.assert_array_equal(got, np.where(c < 0, a, b))
