"""``CombineParallelMatmuls`` (pit_tvm/passes/combine.py): matmuls that share their left operand,
on constant weights, become one matmul on the concatenated weights (and one add of the
concatenated biases) followed by one ``strided_slice`` per branch.

The modules are written with the weights as parameters and bound to constants with
``BindParams`` (TVMScript has no literal for a tensor constant): the pass only takes constant
weights, and the structural comparison compares the constants' values."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from pit_tvm.passes import CombineParallelMatmuls

RNG = np.random.default_rng(0)
W = {"w0": RNG.standard_normal((16, 8)), "w1": RNG.standard_normal((16, 8)), "w2": RNG.standard_normal((16, 4)),
     "b0": RNG.standard_normal(8), "b1": RNG.standard_normal(8), "b2": RNG.standard_normal(4)}
W = {name: value.astype("float32") for name, value in W.items()}


def bound(mod, values):
    """``mod`` with ``main``'s parameters named in ``values`` bound to those constants."""
    return relax.transform.BindParams("main", values)(mod)


@I.ir_module
class Before:
    """Q, K and V projections of x, each with its bias."""

    @R.function
    def main(x: R.Tensor((8, 16), "float32"), w0: R.Tensor((16, 8), "float32"), w1: R.Tensor((16, 8), "float32"),
             w2: R.Tensor((16, 4), "float32"), b0: R.Tensor((8,), "float32"), b1: R.Tensor((8,), "float32"),
             b2: R.Tensor((4,), "float32")):
        with R.dataflow():
            q = R.matmul(x, w0)
            q1 = R.add(q, b0)
            k = R.matmul(x, w1)
            k1 = R.add(k, b1)
            v = R.matmul(x, w2)
            v1 = R.add(v, b2)
            R.output(q1, k1, v1)
        return (q1, k1, v1)


@I.ir_module
class Expected:
    """One [16, 20] matmul and one bias add; each projection a slice of columns."""

    @R.function
    def main(x: R.Tensor((8, 16), "float32"), w: R.Tensor((16, 20), "float32"), b: R.Tensor((20,), "float32")):
        with R.dataflow():
            qkv = R.matmul(x, w, out_dtype="float32")
            qkv1 = R.add(qkv, b)
            q1 = R.strided_slice(qkv1, (1,), (0,), (8,))
            k1 = R.strided_slice(qkv1, (1,), (8,), (16,))
            v1 = R.strided_slice(qkv1, (1,), (16,), (20,))
            R.output(q1, k1, v1)
        return (q1, k1, v1)


def combined_expected():
    """``Expected`` with the three projections' weights and biases concatenated"""
    return bound(Expected, {"w": np.concatenate([W["w0"], W["w1"], W["w2"]], axis=1),
                            "b": np.concatenate([W["b0"], W["b1"], W["b2"]])})


def test_shared_input_projections_become_one_matmul():
    after = CombineParallelMatmuls()(bound(Before, W))
    tvm.ir.assert_structural_equal(after, combined_expected())


@I.ir_module
class BiasFirst:
    """The same projections as ``torch.onnx.export`` writes ``nn.Linear``: ``Add(bias, MatMul)``."""

    @R.function
    def main(x: R.Tensor((8, 16), "float32"), w0: R.Tensor((16, 8), "float32"), w1: R.Tensor((16, 8), "float32"),
             w2: R.Tensor((16, 4), "float32"), b0: R.Tensor((8,), "float32"), b1: R.Tensor((8,), "float32"),
             b2: R.Tensor((4,), "float32")):
        with R.dataflow():
            q = R.matmul(x, w0)
            q1 = R.add(b0, q)
            k = R.matmul(x, w1)
            k1 = R.add(b1, k)
            v = R.matmul(x, w2)
            v1 = R.add(b2, v)
            R.output(q1, k1, v1)
        return (q1, k1, v1)


def test_bias_added_first_is_combined_too():
    after = CombineParallelMatmuls()(bound(BiasFirst, W))
    tvm.ir.assert_structural_equal(after, combined_expected())


def test_what_it_cannot_take_is_left_alone():
    """Weights that are parameters (not constants), and constant-weight matmuls of distinct
    left operands, are left as they are."""
    @I.ir_module
    class Apart:
        @R.function
        def main(x: R.Tensor((8, 16), "float32"), y: R.Tensor((8, 16), "float32"), w0: R.Tensor((16, 8), "float32"),
                 w1: R.Tensor((16, 8), "float32")):
            with R.dataflow():
                q = R.matmul(x, w0)
                k = R.matmul(y, w1)
                R.output(q, k)
            return (q, k)

    tvm.ir.assert_structural_equal(CombineParallelMatmuls()(Before), Before)       # weights not constant
    distinct = bound(Apart, {"w0": W["w0"], "w1": W["w1"]})
    tvm.ir.assert_structural_equal(CombineParallelMatmuls()(distinct), distinct)
