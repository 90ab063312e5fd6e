"""``ReshapeOutputsAsViews`` (pit_tvm/passes/output_views.py): a legalized reshape that the
function returns is bound to a DataflowVar first (which RewriteDataflowReshape then turns into a
view); a reshape of a parameter, or one the function does not return, is left alone."""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from pit_tvm.passes import ReshapeOutputsAsViews
from pit_tvm.passes.graph import op_name


@I.ir_module
class Before:
    @T.prim_func(private=True, s_tir=True)
    def reshape(a: T.Buffer((T.int64(4), T.int64(4)), "float32"), out: T.Buffer((T.int64(16),), "float32")):
        for i in range(T.int64(16)):
            with T.sblock("T_reshape"):
                vi = T.axis.spatial(T.int64(16), i)
                out[vi] = a[vi // T.int64(4), vi % T.int64(4)]

    @R.function
    def main(x: R.Tensor((4, 4), "float32")) -> R.Tensor((16,), "float32"):
        cls = Before
        with R.dataflow():
            a = R.add(x, x)
            y = R.call_tir(cls.reshape, (a,), out_ty=R.Tensor((16,), "float32"))
            R.output(y)
        return y


@I.ir_module
class Expected:
    @T.prim_func(private=True, s_tir=True)
    def reshape(a: T.Buffer((T.int64(4), T.int64(4)), "float32"), out: T.Buffer((T.int64(16),), "float32")):
        for i in range(T.int64(16)):
            with T.sblock("T_reshape"):
                vi = T.axis.spatial(T.int64(16), i)
                out[vi] = a[vi // T.int64(4), vi % T.int64(4)]

    @R.function
    def main(x: R.Tensor((4, 4), "float32")) -> R.Tensor((16,), "float32"):
        cls = Expected
        with R.dataflow():
            a = R.add(x, x)
            y_view = R.call_tir(cls.reshape, (a,), out_ty=R.Tensor((16,), "float32"))
            y = y_view
            R.output(y)
        return y


def test_returned_reshape_is_bound_to_a_dataflow_var():
    kept = Before["main"]
    after = ReshapeOutputsAsViews(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert Before["main"].same_as(kept)       # the pass's input module is not changed
    # what it is for: RewriteDataflowReshape now makes the copy a view (R.reshape), as it does
    # not on the input
    views = relax.transform.RewriteDataflowReshape()

    def ops(mod):
        return [op_name(b.value) for b in mod["main"].body.blocks[0].bindings]

    assert ops(views(after)) == ["relax.add", "relax.reshape", None]
    assert ops(views(Before)) == ["relax.add", "relax.call_tir"]


def test_reshape_of_a_parameter_or_not_returned_is_left_alone():
    """A view of a parameter would alias the caller's input; a reshape the function does not
    return (a later block reads it) is not an output copy."""
    @I.ir_module
    class Kept:
        @T.prim_func(private=True, s_tir=True)
        def reshape(a: T.Buffer((T.int64(4), T.int64(4)), "float32"), out: T.Buffer((T.int64(16),), "float32")):
            for i in range(T.int64(16)):
                with T.sblock("T_reshape"):
                    vi = T.axis.spatial(T.int64(16), i)
                    out[vi] = a[vi // T.int64(4), vi % T.int64(4)]

        @R.function
        def of_param(x: R.Tensor((4, 4), "float32")) -> R.Tensor((16,), "float32"):
            cls = Kept
            with R.dataflow():
                y = R.call_tir(cls.reshape, (x,), out_ty=R.Tensor((16,), "float32"))
                R.output(y)
            return y

        @R.function
        def not_returned(x: R.Tensor((4, 4), "float32")) -> R.Tensor((16,), "float32"):
            cls = Kept
            with R.dataflow():
                a = R.add(x, x)
                y = R.call_tir(cls.reshape, (a,), out_ty=R.Tensor((16,), "float32"))
                R.output(y)
            z = R.add(y, y)
            return z

    tvm.ir.assert_structural_equal(ReshapeOutputsAsViews(Kept), Kept)
