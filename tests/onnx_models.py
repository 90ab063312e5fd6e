"""Small ONNX models shared by test files of different folders (imported as ``onnx_models``:
tests/conftest.py puts tests/ on the path)."""
import numpy as np
from onnx import TensorProto, helper, numpy_helper


def small_model(seed=0, n_out=16):
    """x[batch, seq, 32] -> MatMul -> Relu (hidden) -> MatMul -> y, plus a mean-pooled second output."""
    rng = np.random.default_rng(seed)
    inits = {"w1": rng.standard_normal((32, 64)).astype("float32"),
             "w2": rng.standard_normal((64, n_out)).astype("float32"), "axes": np.array([1], "int64")}
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["hidden"]),
         helper.make_node("MatMul", ["hidden", "w2"], ["y"]),
         helper.make_node("ReduceMean", ["y", "axes"], ["pooled"], keepdims=0)],
        "small",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", n_out]),
         helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", n_out])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    return m
