"""RowReduction: the warp-per-row dlight rule for softmax / layer norm with static shapes."""
import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.s_tir import dlight as dl

from pit_tvm.nvcc import check_cuda_compiles, find_nvcc
from pit_tvm.schedules.row_reduction import RowReduction
from pit_tvm.target import build, cuda_schedule_rules, make_target

CUDA = make_target("cuda")


def _legalized(build_fn, *shapes, dtype="float16"):
    """A Relax module of one operator, legalized and fused (what dlight sees in a model)."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType(s, dtype)) for i, s in enumerate(shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(build_fn(*params))
        bb.emit_func_output(out)
    with CUDA:
        return tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                         relax.transform.FuseOps(), relax.transform.FuseTIR()])(bb.get())


def _prim(mod):
    return [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)][0]


def softmax_mod(shape=(4, 3, 40, 40)):
    return _legalized(lambda x: relax.op.nn.softmax(x, axis=-1), shape)


def layer_norm_mod(rows=(4, 40), d=96):
    return _legalized(lambda x, g, b: relax.op.nn.layer_norm(x, g, b, axes=[-1]), (*rows, d), (d,), (d,))


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


def test_is_ahead_of_general_reduction():
    names = [type(r).__name__ for r in cuda_schedule_rules()]
    assert names.index("RowReduction") < names.index("GeneralReduction")


def _built(mod):
    with CUDA:
        mod = dl.ApplyDefaultSchedule(*cuda_schedule_rules())(mod)
    return build(mod, CUDA)


@pytest.mark.parametrize("mod_fn", [softmax_mod, layer_norm_mod])
def test_cuda_build(mod_fn):
    ex = _built(mod_fn())
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(ex, archs=("sm_80", "sm_90")) >= 1


@pytest.mark.gpu
def test_gpu_softmax_and_layer_norm_match_numpy():
    rng = np.random.default_rng(0)
    dev = tvm.cuda(0)
    # rows not a multiple of the CTA's rows (40 % 8 == 0, 3 heads) and a row of 40 (not 32k)
    x = rng.standard_normal((4, 3, 40, 40)).astype("float16")
    vm = relax.VirtualMachine(_built(softmax_mod()), dev)
    got = vm["main"](tvm.runtime.tensor(x, dev)).numpy().astype("float32")
    e = np.exp(x.astype("float32") - x.astype("float32").max(-1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(-1, keepdims=True), atol=3e-3)
    x = rng.standard_normal((4, 40, 96)).astype("float16")
    g, b = rng.standard_normal(96).astype("float16"), rng.standard_normal(96).astype("float16")
    vm = relax.VirtualMachine(_built(layer_norm_mod()), dev)
    got = vm["main"](*(tvm.runtime.tensor(v, dev) for v in (x, g, b))).numpy().astype("float32")
    xf = x.astype("float32")
    ref = (xf - xf.mean(-1, keepdims=True)) / np.sqrt(xf.var(-1, keepdims=True) + 1e-5) * g + b
    np.testing.assert_allclose(got, ref, atol=2e-2, rtol=1e-2)
