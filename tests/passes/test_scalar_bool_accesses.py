"""``ScalarBoolAccesses`` (pit_tvm/passes/bool_vectors.py): a vectorised loop that reads a ``bool``
buffer becomes an unrolled one (TVM's CUDA codegen would load 4 bools as an 8-byte ``ushort4``);
a vectorised loop over other dtypes is left vectorised.  The dense CUDA build of the Longformer
export, where dlight's matmul epilogue read its ``where`` condition that way, is checked in
tests/passes/test_longformer.py."""
from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import tirx as T

from pit_tvm.passes.bool_vectors import ScalarBoolAccesses


@I.ir_module
class Before:
    @T.prim_func(s_tir=True)
    def where(c: T.Buffer((64,), "bool"), x: T.Buffer((64,), "float16"), y: T.Buffer((64,), "float16")):
        for i in range(16):
            for v in T.vectorized(4):
                with T.sblock("w"):
                    vi = T.axis.spatial(64, i * 4 + v)
                    y[vi] = T.Select(c[vi], x[vi], T.float16(0))

    @T.prim_func(s_tir=True)
    def scale(x: T.Buffer((64,), "float16"), y: T.Buffer((64,), "float16")):
        for i in range(16):
            for v in T.vectorized(4):
                with T.sblock("s"):
                    vi = T.axis.spatial(64, i * 4 + v)
                    y[vi] = x[vi] * T.float16(2)


@I.ir_module
class Expected:
    @T.prim_func(s_tir=True)
    def where(c: T.Buffer((64,), "bool"), x: T.Buffer((64,), "float16"), y: T.Buffer((64,), "float16")):
        for i in range(16):
            for v in T.unroll(4):
                with T.sblock("w"):
                    vi = T.axis.spatial(64, i * 4 + v)
                    y[vi] = T.Select(c[vi], x[vi], T.float16(0))

    @T.prim_func(s_tir=True)
    def scale(x: T.Buffer((64,), "float16"), y: T.Buffer((64,), "float16")):
        for i in range(16):
            for v in T.vectorized(4):
                with T.sblock("s"):
                    vi = T.axis.spatial(64, i * 4 + v)
                    y[vi] = x[vi] * T.float16(2)


def test_bool_vector_loop_unrolled_other_loops_kept():
    tvm.ir.assert_structural_equal(ScalarBoolAccesses(Before), Expected)


@I.ir_module
class BoolStore:
    @T.prim_func(s_tir=True)
    def less(x: T.Buffer((64,), "float32"), m: T.Buffer((64,), "bool")):
        for i in range(16):
            for v in T.vectorized(4):
                with T.sblock("l"):
                    vi = T.axis.spatial(64, i * 4 + v)
                    m[vi] = x[vi] < T.float32(0)


@I.ir_module
class BoolStoreExpected:
    @T.prim_func(s_tir=True)
    def less(x: T.Buffer((64,), "float32"), m: T.Buffer((64,), "bool")):
        for i in range(16):
            for v in T.unroll(4):
                with T.sblock("l"):
                    vi = T.axis.spatial(64, i * 4 + v)
                    m[vi] = x[vi] < T.float32(0)


def test_bool_vector_store_unrolled():
    tvm.ir.assert_structural_equal(ScalarBoolAccesses(BoolStore), BoolStoreExpected)
