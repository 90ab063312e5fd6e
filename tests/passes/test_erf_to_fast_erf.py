"""``ErfToFastErf`` (pit_tvm/passes/fast_erf.py): an fp32 ``R.erf`` becomes a ``call_tir`` of
TOPI's ``fast_erf``; fp16 erf (whose TOPI form is 0.04 off) stays."""
from __future__ import annotations

import tvm
from tvm import te, topi
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from _ir_compare import assert_ir_equal
from pit_tvm.passes.fast_erf import ErfToFastErf


def _topi_fast_erf(shape):
    """The kernel the pass should call: TOPI's fast_erf on an fp32 tensor of ``shape``, as
    ``BlockBuilder.call_te`` makes it (a private PrimFunc with ``tirx.noalias``)."""
    x = te.placeholder([T.int64(d) for d in shape], "float32", name="x")
    func = te.create_prim_func([x, topi.fast_erf(x)])
    return func.without_attr("global_symbol").with_attr("tirx.noalias", True)


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((4, 8), "float32"), y: R.Tensor((4, 8), "float16")):
        with R.dataflow():
            a = R.erf(x)
            b = R.erf(y)
            R.output(a, b)
        return (a, b)


@I.ir_module
class Expected:
    @T.prim_func(private=True)
    def fast_erf(x: T.Buffer((T.int64(4), T.int64(8)), "float32"),
                 out: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        T.evaluate(0)       # replaced by TOPI's kernel in the test

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), y: R.Tensor((4, 8), "float16")):
        cls = Expected
        with R.dataflow():
            a = R.call_tir(cls.fast_erf, (x,), out_ty=R.Tensor((4, 8), "float32"))
            b = R.erf(y)
            R.output(a, b)
        return (a, b)


def test_fp32_erf_becomes_topi_fast_erf():
    expected = Expected.clone()
    expected[expected.get_global_var("fast_erf")] = _topi_fast_erf((4, 8))
    assert_ir_equal(ErfToFastErf(Before), expected)     # the kernel compared in full


def test_module_without_fp32_erf_is_left_alone():
    @I.ir_module
    class Half:
        @R.function
        def main(y: R.Tensor((4, 8), "float16"), z: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                b = R.erf(y)
                c = R.tanh(z)
                R.output(b, c)
            return (b, c)

    tvm.ir.assert_structural_equal(ErfToFastErf(Half), Half)
