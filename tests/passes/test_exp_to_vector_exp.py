"""``ExpToVectorExp`` (pit_tvm/passes/vector_exp.py): an fp32 ``T.exp`` of a PrimFunc becomes
Cephes' ``expf`` as arithmetic LLVM can vectorise (clamp, reduction by ln 2 in two parts, a
degree-5 polynomial, 2**n from exponent bits; inf / 0 / NaN kept), written out in ``Expected``;
an fp16 ``exp`` and a PrimFunc that reads bf16 keep ``T.exp``.  The rewritten kernel is also run
on llvm against numpy's ``exp`` at the range ends and special values (its whole fp32 range is
tests/schedules/test_cpu_row_reduction.py's)."""
from __future__ import annotations

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import tirx as T

from pit_tvm.passes.vector_exp import ExpToVectorExp


@I.ir_module
class Before:
    @T.prim_func(s_tir=True)
    def f(x: T.Buffer((8,), "float32"), y: T.Buffer((8,), "float32")):
        for i in range(8):
            with T.sblock("e"):
                vi = T.axis.spatial(8, i)
                y[vi] = T.exp(x[vi])


@I.ir_module
class Expected:
    @T.prim_func(s_tir=True)
    def f(x: T.Buffer((8,), "float32"), y: T.Buffer((8,), "float32")):
        for i in range(8):
            with T.sblock("e"):
                vi = T.axis.spatial(8, i)
                T.reads(x[vi])
                T.writes(y[vi])
                exp_x = T.float32()
                exp_xc = T.float32()
                exp_n = T.float32()
                exp_r = T.float32()
                y[vi] = T.Let(
                    T.Select(T.isnan(exp_x), exp_x,
                             T.Select(exp_x > T.float32(88.72283935546875), T.float32("inf"),
                                      T.Select(exp_x < T.float32(-103.97208404541016), T.float32(0.0), T.Let(T.Let(T.Let(
                                          # the polynomial on the remainder r, times 2**half * 2**(n - half)
                                          ((((((T.float32(1.9875691500e-4) * exp_r + T.float32(1.3981999507e-3)) * exp_r
                                               + T.float32(8.3334519073e-3)) * exp_r + T.float32(4.1665795894e-2)) * exp_r
                                             + T.float32(1.6666665459e-1)) * exp_r + T.float32(5.0000001201e-1))
                                           * (exp_r * exp_r) + exp_r + T.float32(1.0))
                                          * T.reinterpret("float32", T.Cast("int32", T.floor(exp_n * T.float32(0.5))) + 127 << 23)
                                          * T.reinterpret("float32", T.Cast("int32", exp_n - T.floor(exp_n * T.float32(0.5))) + 127 << 23),
                                          where={exp_r: exp_xc - exp_n * T.float32(0.693359375) - exp_n * T.float32(-2.12194440e-4)}),
                                          where={exp_n: T.floor(exp_xc * T.float32(1.44269504088896341) + T.float32(0.5))}),
                                          where={exp_xc: T.max(T.min(exp_x, T.float32(88.72283935546875)),
                                                               T.float32(-103.97208404541016))})))),
                    where={exp_x: x[vi]})


def test_fp32_exp_becomes_the_vectorisable_polynomial():
    after = ExpToVectorExp(Before)
    tvm.ir.assert_structural_equal(after, Expected)

    x = np.array([0.0, 1.0, -1.0, 10.5, 88.7, 89.0, -104.0, np.nan], "float32")
    got = tvm.runtime.tensor(np.zeros(8, "float32"))
    tvm.compile(after, target="llvm")["f"](tvm.runtime.tensor(x), got)
    with np.errstate(over="ignore"):
        want = np.exp(x)
    np.testing.assert_allclose(got.numpy(), want, rtol=3e-7)     # inf past the range, 0 below, NaN kept


def test_fp16_exp_and_bf16_functions_are_left_alone():
    @I.ir_module
    class Other:
        @T.prim_func(s_tir=True)
        def half(x: T.Buffer((8,), "float16"), y: T.Buffer((8,), "float16")):
            for i in range(8):
                with T.sblock("e"):
                    vi = T.axis.spatial(8, i)
                    y[vi] = T.exp(x[vi])

        @T.prim_func(s_tir=True)
        def bf16(x: T.Buffer((8,), "bfloat16"), y: T.Buffer((8,), "float32")):
            for i in range(8):
                with T.sblock("e"):
                    vi = T.axis.spatial(8, i)
                    y[vi] = T.exp(T.Cast("float32", x[vi]))

    tvm.ir.assert_structural_equal(ExpToVectorExp(Other), Other)
