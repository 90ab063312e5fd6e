"""``DenseMatmulToPITKernels`` (pit_tvm/passes/dense.py): a matmul on a static 2-D weight runs on
the PIT kernels' dense twin: on CUDA the tensor-core kernel with the bias + ReLU chain in its
epilogue, on the CPU the dense CPU kernel with the chain left as Relax ops after it.  Batched
matmuls keep the normal path.  The kernels are stubs in ``Expected`` (:mod:`_ir_compare`); their
numerics are tests/passes/test_passes.py's and tests/schedules/test_tensorcore.py's."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from _ir_compare import assert_ir_equal
from pit_tvm.passes import DenseMatmulToPITKernels

BIAS = np.linspace(-1, 1, 256).astype("float16")


def with_bias(mod):
    """``main``'s ``b`` bound to the constant bias (an epilogue chain's bias is a constant)."""
    return relax.transform.BindParams("main", {"b": BIAS})(mod)


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((2, 64, 128), "float16"), w: R.Tensor((128, 256), "float16"),
             b: R.Tensor((256,), "float16")) -> R.Tensor((2, 64, 256), "float16"):
        with R.dataflow():
            y = R.matmul(x, w)
            z = R.add(y, b)
            r = R.nn.relu(z)
            R.output(r)
        return r


@I.ir_module
class ExpectedCUDA:
    """x flattened to [tokens, K], one tensor-core kernel computing relu(x @ w + b), the result
    reshaped back."""

    @T.prim_func(private=True)
    def tc_dense_matmul_k128_n256_float16_float16_bias_relu_m128(a_h: T.handle, w: T.Buffer((128, 256), "float16"),
                                                                 b: T.Buffer((256,), "float16"), c_h: T.handle):
        m = T.int64()
        a = T.match_buffer(a_h, (m, 128), "float16")
        c = T.match_buffer(c_h, (m, 256), "float16")
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor((2, 64, 128), "float16"), w: R.Tensor((128, 256), "float16"),
             b: R.Tensor((256,), "float16")) -> R.Tensor((2, 64, 256), "float16"):
        cls = ExpectedCUDA
        with R.dataflow():
            rows = R.reshape(x, R.shape([128, 128]))
            c = R.call_tir(cls.tc_dense_matmul_k128_n256_float16_float16_bias_relu_m128, (rows, w, b),
                           out_ty=R.Tensor((128, 256), "float16"))
            y = R.reshape(c, R.shape([2, 64, 256]))
            r = y
            R.output(r)
        return r


@I.ir_module
class ExpectedCPU:
    """The dense CPU kernel, then the bias and the ReLU as Relax ops."""

    @T.prim_func(private=True)
    def cpu_dense_matmul_k128_n256_float16_float16(a_h: T.handle, w: T.Buffer((128, 256), "float16"), c_h: T.handle):
        m = T.int64()
        a = T.match_buffer(a_h, (m, 128), "float16")
        c = T.match_buffer(c_h, (m, 256), "float16")
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor((2, 64, 128), "float16"), w: R.Tensor((128, 256), "float16"),
             b: R.Tensor((256,), "float16")) -> R.Tensor((2, 64, 256), "float16"):
        cls = ExpectedCPU
        with R.dataflow():
            rows = R.reshape(x, R.shape([128, 128]))
            c = R.call_tir(cls.cpu_dense_matmul_k128_n256_float16_float16, (rows, w),
                           out_ty=R.Tensor((128, 256), "float16"))
            y = R.reshape(c, R.shape([2, 64, 256]))
            z = R.add(y, b)
            r1 = R.nn.relu(z)
            r = r1
            R.output(r)
        return r


@pytest.mark.parametrize("target,expected", [("cuda", ExpectedCUDA), ("llvm", ExpectedCPU)])
def test_weight_matmul_runs_on_the_dense_kernel(target, expected):
    assert_ir_equal(DenseMatmulToPITKernels(target)(with_bias(Before)), with_bias(expected))


@pytest.mark.parametrize("target", ["cuda", "llvm"])
def test_batched_matmul_is_left_alone(target):
    """A batched right operand (attention's matmuls) is no weight matmul: unchanged."""
    @I.ir_module
    class Batched:
        @R.function
        def main(x: R.Tensor((2, 64, 128), "float16"), y: R.Tensor((2, 128, 64), "float16")):
            with R.dataflow():
                s = R.matmul(x, y)
                R.output(s)
            return s

    tvm.ir.assert_structural_equal(DenseMatmulToPITKernels(target)(Batched), Batched)
