"""``IntegerPowerToMultiply`` (pit_tvm/passes/integer_power.py): ``R.power(x, n)`` with ``n`` a
small integer constant becomes multiplies (CUDA compiles ``powf`` with ``--use_fast_math``:
``exp2(n * log2(x))``, NaN for a negative ``x``; GPT-2's / ALBERT's ``gelu_new`` ``x ** 3`` made
their fp16 CUDA builds NaN everywhere)."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from pit_tvm.nvcc import cuda_sources
from pit_tvm.passes.integer_power import IntegerPowerToMultiply
from pit_tvm.target import build, cuda_relax_pipeline, make_target


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((4, 8), "float16")):
        with R.dataflow():
            cube = R.power(x, R.const(3.0, "float16"))        # gelu_new
            square = R.power(x, R.const(2.0, "float16"))      # T5's RMS norm
            eighth = R.power(x, R.const(8.0, "float16"))
            inverse = R.power(x, R.const(-2.0, "float16"))
            one = R.power(x, R.const(0.0, "float16"))
            R.output(cube, square, eighth, inverse, one)
        return (cube, square, eighth, inverse, one)


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((4, 8), "float16")):
        with R.dataflow():
            sq = R.multiply(x, x)
            cube = R.multiply(sq, x)
            square = R.multiply(x, x)
            x2 = R.multiply(x, x)
            x4 = R.multiply(x2, x2)
            eighth = R.multiply(x4, x4)
            sq2 = R.multiply(x, x)
            inverse = R.divide(R.const(1.0, "float16"), sq2)
            one = R.ones_like(x)
            R.output(cube, square, eighth, inverse, one)
        return (cube, square, eighth, inverse, one)


def test_small_integer_powers_become_multiplies():
    tvm.ir.assert_structural_equal(IntegerPowerToMultiply(Before), Expected)


def test_other_powers_are_left_alone():
    """a fractional or large exponent, a tensor exponent, an exponent that broadcasts the base,
    an integer base: R.power stays"""
    @I.ir_module
    class Other:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), e: R.Tensor((4, 8), "float32"), s: R.Tensor((), "float32"),
                 i: R.Tensor((4, 8), "int32")):
            with R.dataflow():
                a = R.power(x, R.const(2.5, "float32"))
                b = R.power(x, R.const(9.0, "float32"))
                c = R.power(x, e)
                d = R.power(s, R.const([2.0, 2.0], "float32"))        # [2]: broadcasts the 0-d base
                f = R.power(i, R.const(2, "int32"))
                R.output(a, b, c, d, f)
            return (a, b, c, d, f)

    tvm.ir.assert_structural_equal(IntegerPowerToMultiply(Other), Other)


def _power_module(n: float, dtype: str) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 64), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.power(x, relax.const(n, dtype)))
        bb.emit_func_output(out)
    return bb.get()


def _inputs(dtype):
    """negative and positive values, zero among them"""
    return np.linspace(-3, 3, 4 * 64).reshape(4, 64).astype(dtype)


@pytest.mark.parametrize("n", [3.0, 2.0, -1.0])
def test_rewritten_module_matches_numpy_on_negative_bases(n):
    """the multiplies compute x ** n with the sign of x ** n (the CPU build of the rewritten module)"""
    x = _inputs("float32")
    ex = build(IntegerPowerToMultiply(_power_module(n, "float32")), "llvm")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(got, np.power(x, n), rtol=1e-6)


def test_cuda_pipeline_leaves_no_pow_in_the_kernels():
    """the CUDA pipeline runs the rewrite: a gelu_new-style x ** 3 reaches the CUDA source as
    products, not hpow / powf (fast-math NaN for x < 0)"""
    assert "IntegerPowerToMultiply" in str(cuda_relax_pipeline(make_target("cuda")))
    source = "\n".join(cuda_sources(build(_power_module(3.0, "float16"), "cuda")))
    kernel = source[source.index("__global__"):]
    assert "pow" not in kernel and "*" in kernel


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("n", [3.0, 2.0])
def test_gpu_power_of_negative_bases_matches_numpy(n, dtype):
    x = _inputs(dtype)
    dev = tvm.cuda(0)
    ex = build(_power_module(n, dtype), "cuda")
    got = relax.VirtualMachine(ex, dev)["main"](tvm.runtime.tensor(x, dev)).numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.astype("float32"), np.power(x.astype("float32"), n), rtol=2e-3, atol=1e-3)
