"""CPUBatchedMatmul (pit_tvm.schedules.cpu_batched_matmul): attention's batched matmuls on the
CPU, row-parallel with the reduction outside the output row; against numpy, and what it leaves."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, topi

from pit_tvm.schedules.cpu_batched_matmul import CPUBatchedMatmul
from pit_tvm.target import build, make_target


def _legalized(shape_a, shape_b, with_scale=False):
    """A Relax module of ``a @ b`` (then ``* 0.125`` with ``with_scale``), legalized and fused."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType(shape_a, "float32"))
    b = relax.Var("b", relax.TensorType(shape_b, "float32"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit(relax.op.matmul(a, b))
            if with_scale:
                out = bb.emit(relax.op.multiply(out, relax.const(0.125, "float32")))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    seq = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                    relax.transform.FuseOps(), relax.transform.FuseTIR()])
    return seq(bb.get())


def _prim_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


@pytest.mark.parametrize("with_scale", [False, True])
def test_batched_matmul_is_scheduled_and_matches_numpy(with_scale):
    """[2, 3, 40, 24] @ [2, 3, 24, 56] (and a fused scale after it): the rule schedules the
    function (one parallel loop over the output rows) and the build equals numpy."""
    tgt = make_target("llvm")
    mod = _legalized([2, 3, 40, 24], [2, 3, 24, 56], with_scale)
    funcs = _prim_funcs(mod)
    scheduled = {name: CPUBatchedMatmul().apply(f, tgt, False) for name, f in funcs.items()}
    matmuls = [name for name in funcs if "matmul" in name]
    assert matmuls and all(scheduled[name] is not None for name in matmuls)
    assert "T.parallel" in scheduled[matmuls[0]].mod.script()
    ex = build(mod, tgt)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3, 40, 24)).astype("float32")
    b = rng.standard_normal((2, 3, 24, 56)).astype("float32")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    np.testing.assert_allclose(got, (a @ b) * (0.125 if with_scale else 1.0), rtol=1e-5, atol=1e-5)


def test_leaves_what_it_does_not_take():
    """A 2-D matmul (the dense twin's), a symbolic batch, an elementwise function and a CUDA
    target: None."""
    tgt = make_target("llvm")
    for name, f in _prim_funcs(_legalized([40, 24], [24, 56])).items():
        assert CPUBatchedMatmul().apply(f, tgt, False) is None, name
    n = tvm.tirx.Var("n", "int64")
    for name, f in _prim_funcs(_legalized([n, 3, 40, 24], [n, 3, 24, 56])).items():
        assert CPUBatchedMatmul().apply(f, tgt, False) is None, name
    x = tvm.te.placeholder((8, 8), name="x")
    relu = tvm.te.create_prim_func([x, topi.nn.relu(x)])
    assert CPUBatchedMatmul().apply(relu, tgt, False) is None
    batched = next(iter(_prim_funcs(_legalized([2, 3, 40, 24], [2, 3, 24, 56])).values()))
    assert CPUBatchedMatmul().apply(batched, make_target("cuda"), False) is None
