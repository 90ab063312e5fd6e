"""Epilogue chains (bias, ReLU / GELU, row scale) found after matmuls and run in the kernels:
chain detection on imported graphs, the lowered CUDA graphs of both builds, CPU numerics
against onnxruntime, and GELU written the way torch.onnx exports it."""
from __future__ import annotations


import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from pit_tvm.passes import AnnotateDynamicSparsity, CombineParallelMatmuls, DenseMatmulToPITKernels, LowerToPIT
from pit_tvm.passes import import_onnx
from pit_tvm.passes.epilogue import epilogue_chains

from pit_tvm import testing as W

MATMUL = tvm.ir.Op.get("relax.matmul")


def _bert(layers=1, hidden=64, heads=4, seq=16):
    model = W.to_float16(W.bert_encoder(layers, hidden, heads))
    mod = import_onnx(model, shape_dict={"input_embeds": [2, seq, hidden], "attention_mask": [2, seq]})
    return CombineParallelMatmuls()(relax.transform.FoldConstant()(mod))


def test_bert_chains():
    """Per layer: QKV (its concatenated bias, before the slices), attention output and FFN-out
    (bias and the skip connection), FFN-in (bias, GELU, padding mask as the row scale)."""
    chains = list(epilogue_chains(_bert()["main"], lambda c: c.op.same_as(MATMUL)).values())
    got = sorted((c.activation or "-", c.row_scale is not None, c.residual is not None) for c in chains)
    assert got == [("-", False, False), ("-", False, True), ("-", False, True), ("gelu", True, False)]


def _gelu_torch_model(k=64, n=128):
    """``gelu(x @ w + b)`` as torch.onnx writes it: x / sqrt2 -> erf -> +1 -> * x -> * 0.5."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((k, n)).astype("float32"), "w"),
             numpy_helper.from_array(rng.standard_normal(n).astype("float32"), "b"),
             numpy_helper.from_array(np.array(np.sqrt(2), "float32"), "sqrt2"),
             numpy_helper.from_array(np.array(1.0, "float32"), "one"),
             numpy_helper.from_array(np.array(0.5, "float32"), "half")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["pre"]),
             helper.make_node("Div", ["pre", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["pre", "e1"], ["p"]),
             helper.make_node("Mul", ["p", "half"], ["y"])]
    graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_torch_gelu_form_and_cuda_kernel_name():
    """The torch.onnx GELU is one chain; on CUDA the dense matmul's kernel runs it."""
    mod = relax.transform.FoldConstant()(import_onnx(W.to_float16(_gelu_torch_model())))
    chains = list(epilogue_chains(mod["main"], lambda c: c.op.same_as(MATMUL)).values())
    assert [(c.activation, c.row_scale) for c in chains] == [("gelu", None)]
    out = DenseMatmulToPITKernels("cuda")(mod)
    script = out["main"].script()
    assert "_bias_gelu" in script and "R.erf" not in script and "R.matmul" not in script


@pytest.mark.parametrize("pit", [True, False])
def test_bert_cuda_graph_fuses_gelu_and_mask(pit):
    """The FFN-in matmul of both CUDA builds is one kernel with bias, GELU and the padding mask;
    no erf is left for an elementwise kernel."""
    mod = _bert()
    adds_before = mod["main"].script().count("R.add(")
    mod = AnnotateDynamicSparsity(auto=pit)(mod)
    mod = LowerToPIT(target="cuda")(mod)
    mod = DenseMatmulToPITKernels("cuda")(mod)
    mod = relax.transform.DeadCodeElimination()(mod)
    script = mod["main"].script()
    kernel = "pit_kernel_1x64" if pit else "tc_dense_matmul_k64_n256"
    assert f"{kernel}" in script and "_bias_gelu_rowscale" in script
    assert ("_bias_gelu_rowscale_masked" in script) == pit      # the scale is the index's mask
    # the QKV's and FFN-in's masked inputs: the kernels scale their rows, no masking multiply
    # is left (the attention output's, head dim 16 here, stays: the attention is not fused)
    assert "_rowscale_masked_ascale" in script if pit else "_rowscale_ascale" in script
    assert "_bias_ascale" in script
    assert "R.multiply(lv" not in script.split("layer_norm")[1]
    assert "R.multiply(input_embeds, row_mask)" not in script
    assert "R.erf" not in script
    # the output projection's and FFN-out's bias and skip connection, FFN-in's bias (and
    # GELU's 1 + erf), QKV's bias: only the attention mask's add is left
    assert script.count("_bias_residual") == 2
    assert script.count("R.add(") == adds_before - 7 == 1


def test_cpu_numerics_with_epilogues_match_onnxruntime():
    """On llvm the chain stays Relax ops after the PIT matmul: the encoder (PIT on) equals
    onnxruntime over real tokens, and so does the torch-form GELU layer."""
    ort = pytest.importorskip("onnxruntime")
    from pit_tvm.compile import compile_onnx

    model = W.bert_encoder(1, 64, 4)
    inputs = W.bert_inputs(64, batch=2, seq=16, lengths=[5, 16])
    got = compile_onnx(model, "llvm").run(inputs)[0]
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    real = inputs["attention_mask"].astype(bool)
    np.testing.assert_allclose(got[real], ref[real], rtol=1e-4, atol=1e-4)
    g = _gelu_torch_model()
    x = np.random.default_rng(1).standard_normal((4, 64)).astype("float32")
    np.testing.assert_allclose(compile_onnx(g, "llvm").run({"x": x})[0],
                               ort.InferenceSession(g.SerializeToString()).run(None, {"x": x})[0],
                               rtol=1e-4, atol=1e-4)
