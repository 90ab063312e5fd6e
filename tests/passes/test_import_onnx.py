"""``import_onnx`` (pit_tvm/passes/frontend.py), the frontend the passes start from: an ONNX
graph becomes the Relax module TVM's importer makes, each binding named after its ONNX output
(sanitised), with the ``pit.onnx_names`` map as a module attr; a node the importer cannot
convert is an ``UnsupportedOnnxError`` naming it."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from pit_tvm.passes import UnsupportedOnnxError, import_onnx

RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((16, 8)).astype("float32")
W2 = RNG.standard_normal((8, 4)).astype("float32")


def mlp(relu_op="Relu"):
    """x[batch, 16] @ w1 -> ReLU (its output named ``act/out``) -> @ w2, weights as initializers."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["hidden"], name="fc1"),
             helper.make_node(relu_op, ["hidden"], ["act/out"], name="act"),
             helper.make_node("MatMul", ["act/out", "w2"], ["y"], name="fc2")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
                              [numpy_helper.from_array(W1, "w1"), numpy_helper.from_array(W2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@I.ir_module
class Expected:
    """(the weights are parameters here, bound to the initializers' values in the test)"""

    I.module_attrs({"pit.onnx_names": {"act/out": "act_out", "hidden": "hidden", "x": "x", "y": "y"}})

    @R.function
    def main(x: R.Tensor(("batch", 16), "float32"), w1: R.Tensor((16, 8), "float32"),
             w2: R.Tensor((8, 4), "float32")) -> R.Tensor(("batch", 4), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            hidden = R.matmul(x, w1)
            act_out = R.nn.relu(hidden)
            y = R.matmul(act_out, w2)
            gv = y
            R.output(gv)
        return gv


def test_onnx_graph_imports_with_its_tensor_names():
    mod = import_onnx(mlp())
    expected = relax.transform.BindParams("main", {"w1": W1, "w2": W2})(Expected)
    tvm.ir.assert_structural_equal(mod, expected)
    # (structural equality maps variables by position, not by name: the names, checked here,
    # are what AnnotateDynamicSparsity resolves sparse= by)
    names = [b.var.name for block in mod["main"].body.blocks for b in block.bindings]
    assert names == ["hidden", "act_out", "y", "gv"]


def test_node_the_importer_cannot_convert_is_a_clear_error():
    with pytest.raises(UnsupportedOnnxError, match="'act'.*NoSuchOp"):
        import_onnx(mlp(relu_op="NoSuchOp"))
