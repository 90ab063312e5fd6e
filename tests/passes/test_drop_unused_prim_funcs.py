"""``DropUnusedPrimFuncs`` (pit_tvm/passes/lower.py): the PrimFuncs no Relax function calls are
dropped (LowerToPIT's dead kernels after DeadCodeElimination); called ones, Relax functions and
the module attrs stay."""
from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from pit_tvm.passes.lower import DropUnusedPrimFuncs


@I.ir_module
class Before:
    I.module_attrs({"pit.onnx_names": {"x": "x"}})

    @T.prim_func
    def used(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32")):
        for i in range(4):
            b[i] = a[i] * T.float32(2)

    @T.prim_func
    def dead(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32")):
        for i in range(4):
            b[i] = a[i] + T.float32(1)

    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        cls = Before
        with R.dataflow():
            y = R.call_tir(cls.used, (x,), out_ty=R.Tensor((4,), "float32"))
            R.output(y)
        return y


@I.ir_module
class Expected:
    I.module_attrs({"pit.onnx_names": {"x": "x"}})

    @T.prim_func
    def used(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32")):
        for i in range(4):
            b[i] = a[i] * T.float32(2)

    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        cls = Expected
        with R.dataflow():
            y = R.call_tir(cls.used, (x,), out_ty=R.Tensor((4,), "float32"))
            R.output(y)
        return y


def test_uncalled_kernel_is_dropped():
    tvm.ir.assert_structural_equal(DropUnusedPrimFuncs(Before), Expected)


def test_module_whose_kernels_are_all_called_is_left_alone():
    tvm.ir.assert_structural_equal(DropUnusedPrimFuncs(Expected), Expected)
