"""RowReduction: the warp-per-row dlight rule for softmax / layer norm with static shapes."""
import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from pit_tvm.testing import build_with_cuda_rules, legalized_cuda_module
from pit_tvm.nvcc import check_cuda_compiles, find_nvcc
from pit_tvm.schedules.row_reduction import RowReduction
from pit_tvm.target import cuda_schedule_rules, make_target

CUDA = make_target("cuda")


def _prim(mod):
    return [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)][0]


def softmax_mod(shape=(4, 3, 40, 40)):
    return legalized_cuda_module(lambda x: relax.op.nn.softmax(x, axis=-1), shape)[0]


def layer_norm_mod(rows=(4, 40), d=96):
    return legalized_cuda_module(lambda x, g, b: relax.op.nn.layer_norm(x, g, b, axes=[-1]),
                                 (*rows, d), (d,), (d,))[0]


def test_applies_to_softmax_and_layer_norm_with_static_shapes():
    for mod in (softmax_mod(), layer_norm_mod()):
        sch = RowReduction().apply(_prim(mod), CUDA, False)
        assert sch is not None
        script = sch.mod["main"].script()
        assert 'thread="threadIdx.y"' in script and 'thread="threadIdx.x"' in script
        assert "T.int64(32), thread=\"threadIdx.x\"" in script


def test_declines_symbolic_rows_and_long_rows():
    n = tirx.Var("n", "int64")
    assert RowReduction().apply(_prim(softmax_mod((n, 64))), CUDA, False) is None
    assert RowReduction().apply(_prim(softmax_mod((8, 8192))), CUDA, False) is None
    assert RowReduction().apply(_prim(softmax_mod()), make_target("llvm"), False) is None


def test_declines_multi_block_spatial_functions():
    """A split (one spatial block per output, no reduction) is not a row reduction."""
    mod, prim = legalized_cuda_module(lambda x: relax.op.split(x, [64, 128], axis=-1), (8, 192))
    assert RowReduction().apply(prim, CUDA, False) is None
    build_with_cuda_rules(mod)


def test_is_ahead_of_general_reduction():
    names = [type(r).__name__ for r in cuda_schedule_rules()]
    assert names.index("RowReduction") < names.index("GeneralReduction")


@pytest.mark.parametrize("mod_fn", [softmax_mod, layer_norm_mod])
def test_cuda_build(mod_fn):
    ex = build_with_cuda_rules(mod_fn())
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(ex, archs=("sm_80", "sm_90")) >= 1


@pytest.mark.gpu
def test_gpu_softmax_and_layer_norm_match_numpy():
    rng = np.random.default_rng(0)
    dev = tvm.cuda(0)
    # rows not a multiple of the CTA's rows (40 % 8 == 0, 3 heads) and a row of 40 (not 32k)
    x = rng.standard_normal((4, 3, 40, 40)).astype("float16")
    vm = relax.VirtualMachine(build_with_cuda_rules(softmax_mod()), dev)
    got = vm["main"](tvm.runtime.tensor(x, dev)).numpy().astype("float32")
    e = np.exp(x.astype("float32") - x.astype("float32").max(-1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(-1, keepdims=True), atol=3e-3)
    x = rng.standard_normal((4, 40, 96)).astype("float16")
    g, b = rng.standard_normal(96).astype("float16"), rng.standard_normal(96).astype("float16")
    vm = relax.VirtualMachine(build_with_cuda_rules(layer_norm_mod()), dev)
    got = vm["main"](*(tvm.runtime.tensor(v, dev) for v in (x, g, b))).numpy().astype("float32")
    xf = x.astype("float32")
    ref = (xf - xf.mean(-1, keepdims=True)) / np.sqrt(xf.var(-1, keepdims=True) + 1e-5) * g + b
    np.testing.assert_allclose(got, ref, atol=2e-2, rtol=1e-2)
