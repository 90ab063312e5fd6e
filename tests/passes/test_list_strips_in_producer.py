"""``ListStripsInProducer`` (pit_tvm/passes/strips.py): a strips index built by its own kernel
from the output of a dense wgmma kernel is built in that kernel's epilogue instead: one fused
call returns C and the index.

The modules are written in TVMScript with stub kernels (``T.evaluate(0)``), then the stubs
``dense`` and ``strips`` are replaced by the real generated kernels (the pass reads their
attrs); ``use`` (the PIT kernel reading C and the index) stays a stub.  The expected fused
kernel is the wgmma kernel generated with ``strips_mk``, compared in full.  No GPU is needed."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from _ir_compare import assert_ir_equal
from pit_tvm.passes.strips import ListStripsInProducer
from pit_tvm.schedules.wgmma import wgmma_row_gather_func
from pit_tvm.schedules.wgmma_strips import strip_list_func, strip_state_words

M, K, N, MK = 256, 256, 1024, 8          # (mk = 8: the index lists strips, no compacted copy)
STATE = np.zeros(strip_state_words(M), "float64")   # 2 strips of 128 rows


def dense_kernel(**kw):
    return wgmma_row_gather_func(K, N, "float16", "float16", bias=True, relu=True, dense=True, **kw)


@I.ir_module
class Before:
    @T.prim_func(private=True)
    def dense(x: T.handle, w: T.handle, b: T.handle, c: T.handle):
        T.evaluate(0)

    @T.prim_func(private=True)
    def strips(a: T.handle, state: T.handle, counts: T.handle, ids: T.handle):
        T.evaluate(0)

    @T.prim_func(private=True)
    def use(c: T.handle, counts: T.handle, ids: T.handle, y: T.handle):
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor((256, 256), "float16"), w: R.Tensor((256, 1024), "float16"),
             b: R.Tensor((1024,), "float16"), state: R.Tensor((2,), "float64")) -> R.Tensor((256, 1024), "float16"):
        cls = Before
        with R.dataflow():
            c = R.call_tir(cls.dense, (x, w, b), out_ty=R.Tensor((256, 1024), "float16"))
            listed = R.call_tir(cls.strips, (c, state), out_ty=[R.Tensor((2,), "int32"), R.Tensor((256,), "int32")])
            counts = listed[0]
            ids = listed[1]
            y = R.call_tir(cls.use, (c, counts, ids), out_ty=R.Tensor((256, 1024), "float16"))
            R.output(y)
        return y


@I.ir_module
class Expected:
    @T.prim_func(private=True)
    def dense(x: T.handle, w: T.handle, b: T.handle, c: T.handle):
        T.evaluate(0)

    @T.prim_func(private=True)
    def strips(a: T.handle, state: T.handle, counts: T.handle, ids: T.handle):
        T.evaluate(0)

    @T.prim_func(private=True)
    def dense_strips(x: T.handle, w: T.handle, b: T.handle, state: T.handle, c: T.handle, counts: T.handle,
                     ids: T.handle):
        T.evaluate(0)

    @T.prim_func(private=True)
    def use(c: T.handle, counts: T.handle, ids: T.handle, y: T.handle):
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor((256, 256), "float16"), w: R.Tensor((256, 1024), "float16"),
             b: R.Tensor((1024,), "float16"), state: R.Tensor((2,), "float64")) -> R.Tensor((256, 1024), "float16"):
        cls = Expected
        with R.dataflow():
            fused = R.call_tir(cls.dense_strips, (x, w, b, state),
                               out_ty=[R.Tensor((256, 1024), "float16"), R.Tensor((2,), "int32"),
                                       R.Tensor((256,), "int32")])
            c = fused[0]
            counts_f = fused[1]
            ids_f = fused[2]
            listed = (counts_f, ids_f)
            counts = listed[0]
            ids = listed[1]
            y = R.call_tir(cls.use, (c, counts, ids), out_ty=R.Tensor((256, 1024), "float16"))
            R.output(y)
        return y


def with_kernels(mod, **kernels):
    """``mod`` with the named stubs replaced by ``kernels`` and ``state`` bound to zeros (the
    pass takes a constant state, or an ``R.zeros`` per call)."""
    mod = mod.clone()
    for name, func in kernels.items():
        mod[mod.get_global_var(name)] = func
    return relax.transform.BindParams("main", {"state": STATE})(mod)


def test_strips_index_is_listed_in_the_producer():
    dense, strips = dense_kernel(), strip_list_func(N, MK, "float16")
    after = ListStripsInProducer()(with_kernels(Before, dense=dense, strips=strips))
    fused = dense_kernel(strips_mk=MK).with_attr("global_symbol", "dense_strips")
    assert_ir_equal(after, with_kernels(Expected, dense=dense, strips=strips, dense_strips=fused))


def test_producer_that_is_not_a_dense_wgmma_kernel_is_left_alone():
    """A producer the listing cannot be fused into (here a plain kernel, no wgmma dense attrs)."""
    mod = with_kernels(Before, strips=strip_list_func(N, MK, "float16"))
    tvm.ir.assert_structural_equal(ListStripsInProducer()(mod), mod)
