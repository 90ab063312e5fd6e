"""``epilogue_chains`` (pit_tvm/passes/epilogue.py), the analysis LowerToPIT and
DenseMatmulToPITKernels run a matmul's bias / activation / row scale / residual with: the
chains found in small TVMScript functions, given as the bindings of the function they name
(``EpilogueChain`` of the head call, the bias constant, the activation, the row scale and the
residual), and the ones it must not take; and, as a Before/Expected rewrite, a torch-form GELU
chain taken whole by the CPU dense path (DenseMatmulToPITKernels on llvm), which emits it again
after its kernel in the one form the kernels' epilogues use."""
from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from _ir_compare import assert_ir_equal
from pit_tvm.passes import DenseMatmulToPITKernels
from pit_tvm.passes.epilogue import EpilogueChain, epilogue_chains
from pit_tvm.passes.graph import FuncGraph

MATMUL = tvm.ir.Op.get("relax.matmul")
BIAS = np.linspace(-1, 1, 16).astype("float32")


def chains_of(mod):
    """``main``'s chains after matmuls, ``main`` with its bias bound, and its FuncGraph."""
    func = relax.transform.BindParams("main", {"b": BIAS})(mod)["main"]
    return epilogue_chains(func, lambda call: call.op.same_as(MATMUL)), FuncGraph(func)


def assert_chains(found, expected):
    """``found`` holds exactly ``expected``'s chains, each part the very expression expected."""
    assert len(found) == len(expected)
    for end, want in expected.items():
        got = found.get(end)
        assert got is not None, f"no chain ends at {end}"
        for part in ("head", "bias", "row_scale", "residual"):
            g, w = getattr(got, part), getattr(want, part)
            assert (g is None and w is None) or g.same_as(w), f"{part}: {g} != {w}"
        assert got.activation == want.activation


def test_bias_gelu_row_scale_chain():
    """GELU in the form tf / onnx.helper graphs write, then a padding mask as the row scale."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((8, 32), "float32"), w: R.Tensor((32, 16), "float32"), b: R.Tensor((16,), "float32"),
                 mask: R.Tensor((8, 1), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                z = R.add(y, b)
                half = R.multiply(z, R.const(0.5, "float32"))
                scaled = R.multiply(z, R.const(1 / math.sqrt(2), "float32"))
                e = R.erf(scaled)
                one = R.add(R.const(1.0, "float32"), e)
                g = R.multiply(half, one)
                out = R.multiply(g, mask)
                R.output(out)
            return out

    found, graph = chains_of(Before)
    bound, var = graph.bound, graph.var_by_name
    expected = {bound[var("out")]: EpilogueChain(bound[var("y")], bound[var("z")].args[1], "gelu", var("mask"))}
    assert_chains(found, expected)
    np.testing.assert_array_equal(expected[bound[var("out")]].bias.value.numpy(), BIAS)


def test_torch_gelu_and_residual_chains():
    """GELU as torch.onnx writes it (x / sqrt2 -> erf -> + 1 -> * x -> * 0.5); and a bias then a
    skip connection (residual) after a second matmul."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((8, 32), "float32"), w: R.Tensor((32, 16), "float32"), b: R.Tensor((16,), "float32"),
                 w2: R.Tensor((16, 16), "float32"), skip: R.Tensor((8, 16), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                z = R.add(y, b)
                d = R.divide(z, R.const(math.sqrt(2), "float32"))
                e = R.erf(d)
                one = R.add(e, R.const(1.0, "float32"))
                p = R.multiply(z, one)
                g = R.multiply(p, R.const(0.5, "float32"))
                y2 = R.matmul(g, w2)
                z2 = R.add(b, y2)
                out = R.add(z2, skip)
                R.output(out)
            return out

    found, graph = chains_of(Before)
    bound, var = graph.bound, graph.var_by_name
    assert_chains(found, {
        bound[var("g")]: EpilogueChain(bound[var("y")], bound[var("z")].args[1], "gelu", None),
        bound[var("out")]: EpilogueChain(bound[var("y2")], bound[var("z2")].args[0], None, None, var("skip"))})


@pytest.mark.parametrize("case", ["matmul_used_twice", "bias_not_constant", "relu_input_used_twice"])
def test_what_is_not_a_chain(case):
    """A matmul whose result has another use, a bias that is not a constant: no chain; a bias
    add used by more than the ReLU: the chain stops at the add."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((8, 32), "float32"), w: R.Tensor((32, 16), "float32"), b: R.Tensor((16,), "float32"),
                 c: R.Tensor((16,), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                z = R.add(y, b)
                r = R.nn.relu(z)
                R.output(r)
            return r

    @I.ir_module
    class MatmulTwice:
        @R.function
        def main(x: R.Tensor((8, 32), "float32"), w: R.Tensor((32, 16), "float32"), b: R.Tensor((16,), "float32"),
                 c: R.Tensor((16,), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                z = R.add(y, b)
                r = R.nn.relu(z)
                out = R.add(r, y)
                R.output(out)
            return out

    @I.ir_module
    class ReluInputTwice:
        @R.function
        def main(x: R.Tensor((8, 32), "float32"), w: R.Tensor((32, 16), "float32"), b: R.Tensor((16,), "float32"),
                 c: R.Tensor((16,), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                z = R.add(y, b)
                r = R.nn.relu(z)
                out = R.add(r, z)
                R.output(out)
            return out

    if case == "bias_not_constant":        # the bias a parameter (left unbound)
        assert epilogue_chains(Before["main"], lambda call: call.op.same_as(MATMUL)) == {}
        return
    found, graph = chains_of(MatmulTwice if case == "matmul_used_twice" else ReluInputTwice)
    if case == "matmul_used_twice":
        assert found == {}
    else:
        bound, var = graph.bound, graph.var_by_name
        assert_chains(found, {bound[var("z")]: EpilogueChain(bound[var("y")], bound[var("z")].args[1], None, None)})


def test_chain_is_emitted_after_the_cpu_dense_kernel():
    """The torch-form GELU and the row scale after ``x @ w + b``: the matmul becomes the CPU
    dense kernel and the whole chain is emitted after it (GELU as ``x * 0.5 * (1 + erf(x /
    sqrt2))``); nothing of the old chain is left."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((8, 32), "float32"), w: R.Tensor((32, 16), "float32"), b: R.Tensor((16,), "float32"),
                 mask: R.Tensor((8, 1), "float32")) -> R.Tensor((8, 16), "float32"):
            with R.dataflow():
                y = R.matmul(x, w)
                z = R.add(y, b)
                d = R.divide(z, R.const(math.sqrt(2), "float32"))
                e = R.erf(d)
                one = R.add(e, R.const(1.0, "float32"))
                p = R.multiply(z, one)
                g = R.multiply(p, R.const(0.5, "float32"))
                out = R.multiply(g, mask)
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @T.prim_func(private=True)
        def cpu_dense_matmul_k32_n16_float32_float32(a_h: T.handle, w: T.Buffer((32, 16), "float32"), c_h: T.handle):
            m = T.int64()
            a = T.match_buffer(a_h, (m, 32), "float32")
            c = T.match_buffer(c_h, (m, 16), "float32")
            T.evaluate(0)

        @R.function
        def main(x: R.Tensor((8, 32), "float32"), w: R.Tensor((32, 16), "float32"), b: R.Tensor((16,), "float32"),
                 mask: R.Tensor((8, 1), "float32")) -> R.Tensor((8, 16), "float32"):
            cls = Expected
            with R.dataflow():
                c = R.call_tir(cls.cpu_dense_matmul_k32_n16_float32_float32, (x, w),
                               out_ty=R.Tensor((8, 16), "float32"))
                z = R.add(c, b)
                half = R.multiply(z, R.const(0.5, "float32"))
                scaled = R.multiply(z, R.const(1 / math.sqrt(2), "float32"))
                e = R.erf(scaled)
                one = R.add(R.const(1.0, "float32"), e)
                g = R.multiply(half, one)
                masked = R.multiply(g, mask)
                out = masked
                R.output(out)
            return out

    bind = relax.transform.BindParams("main", {"b": BIAS})
    assert_ir_equal(DenseMatmulToPITKernels("llvm")(bind(Before)), bind(Expected))
