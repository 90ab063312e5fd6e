"""The def-use helpers of pit_tvm/passes/graph.py (``FuncGraph``, ``call_tir_parts``,
``scalar_constant``, ``op_name``, ``other_operand``) on a small TVMScript module: each answer
given as the bindings and parameters of the function it is about."""
from __future__ import annotations

from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from pit_tvm.passes.graph import FuncGraph, call_tir_parts, op_name, other_operand, scalar_constant


@I.ir_module
class Module:
    @T.prim_func(private=True)
    def double(a: T.Buffer((4, 8), "float32"), b: T.Buffer((4, 8), "float32")):
        for i, j in T.grid(4, 8):
            b[i, j] = a[i, j] * T.float32(2)

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), m: R.Tensor((4, 1), "float32"), w: R.Tensor((8, 8), "float32")):
        cls = Module
        with R.dataflow():
            t = R.permute_dims(x, [1, 0])
            u = R.permute_dims(t, [1, 0])
            h = R.multiply(u, m)
            s = R.multiply(h, R.const(0.5, "float32"))
            d = R.call_tir(cls.double, (s,), out_ty=R.Tensor((4, 8), "float32"))
            y = R.matmul(d, w)
            z = R.add(y, d)
            R.output(z)
        return z


def test_func_graph_def_use():
    g = FuncGraph(Module["main"])
    var = g.var_by_name
    x, m, w = Module["main"].params
    assert [b.var.name for b in g.bindings] == ["t", "u", "h", "s", "d", "y", "z"]
    assert g.bound[var("h")].same_as(g.bindings[2].value) and op_name(g.bound[var("h")]) == "relax.multiply"
    assert g.uses[var("d")] == 2 and [v.name for v in g.users[var("d")]] == ["y", "z"]
    assert g.uses[var("z")] == 1                              # the function's result
    assert g.sole_user(var("h")).same_as(var("s")) and g.sole_user(var("d")) is None
    assert g.single(var("y"), "relax.matmul").same_as(g.bound[var("y")])
    assert g.single(var("d"), "relax.call_tir") is None      # used twice
    assert g.single(var("y"), "relax.add") is None           # another op
    passed, producer = g.chain(var("u"), {"relax.permute_dims"})
    assert [v.name for v in passed] == ["u", "t", "x"] and producer.same_as(x)
    assert g.param_ancestors(var("z")) == frozenset({x, m, w})
    assert g.param_ancestors(var("h")) == frozenset({x, m})
    assert var("nothing") is None


def test_call_and_constant_helpers():
    g = FuncGraph(Module["main"])
    var = g.var_by_name
    callee, args = call_tir_parts(g.bound[var("d")])
    assert callee.same_as(Module.get_global_var("double")) and len(args) == 1 and args[0].same_as(var("s"))
    assert call_tir_parts(g.bound[var("y")]) is None
    assert scalar_constant(g.bound[var("s")].args[1]) == 0.5
    assert scalar_constant(var("h")) is None
    assert scalar_constant(relax.const([1.0, 2.0], "float32")) is None     # not one element
    assert other_operand(g.bound[var("h")], var("u")).same_as(var("m"))
    assert op_name(g.bound[var("d")]) == "relax.call_tir" and op_name(var("d")) is None
    assert op_name(relax.Call(Module.get_global_var("double"), [var("s")])) is None   # not an Op
