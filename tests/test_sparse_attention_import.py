"""Importing attention with a run-time mask (issue 36): ``softmax(Q K^T * scale + M) V`` and its
``Where`` form, M computed from graph inputs, lowered to block-sparse attention by
``compile_onnx``; checked against onnxruntime on small fixtures built with ``onnx.helper``."""
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import pit_tvm
from pit_tvm.errors import UserError

ort = pytest.importorskip("onnxruntime")

B, H, S, D, W = 2, 2, 80, 16, 6
HIDDEN = H * D


def _model(nodes, inputs, initializers=(), out_type=TensorProto.FLOAT, out_shape=(B, S, HIDDEN)):
    graph = helper.make_graph(nodes, "attention", inputs, [helper.make_tensor_value_info("out", out_type, out_shape)],
                              initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _heads(name, src, nodes):
    """``src [B, S, HIDDEN]`` -> ``name [B, H, S, D]``"""
    nodes += [helper.make_node("Reshape", [src, "heads_shape"], [name + "_r"]),
              helper.make_node("Transpose", [name + "_r"], [name], perm=[0, 2, 1, 3])]


def longformer_style_model(form="additive", dtype=np.float32):
    """x [B, S, HIDDEN] and global_flags [B, S] int32 -> self-attention whose mask allows the
    +-W window, the global rows and the global columns (computed from global_flags each call)."""
    rng = np.random.default_rng(0)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    band = np.abs(np.arange(S)[:, None] - np.arange(S)[None, :]) <= W
    inits = [numpy_helper.from_array((rng.standard_normal((HIDDEN, HIDDEN)) * 0.3).astype(dtype), n)
             for n in ("wq", "wk", "wv")]
    inits += [numpy_helper.from_array(np.array([B, S, H, D], np.int64), "heads_shape"),
              numpy_helper.from_array(np.array([B, S, HIDDEN], np.int64), "out_shape"),
              numpy_helper.from_array(band, "band"),
              numpy_helper.from_array(np.array(1 / np.sqrt(D), dtype), "scale"),
              numpy_helper.from_array(np.array(0, dtype), "zero"),
              numpy_helper.from_array(np.array(-10000, dtype), "masked"),
              numpy_helper.from_array(np.array([1], np.int64), "ax1"),
              numpy_helper.from_array(np.array([2], np.int64), "ax2")]
    nodes = [helper.make_node("MatMul", ["x", w], [n]) for w, n in (("wq", "q2"), ("wk", "k2"), ("wv", "v2"))]
    for n in ("q", "k", "v"):
        _heads(n, n + "2", nodes)
    nodes += [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Mul", ["qk", "scale"], ["scores"]),
        helper.make_node("Cast", ["global_flags"], ["g"], to=TensorProto.BOOL),
        helper.make_node("Unsqueeze", ["g", "ax1"], ["g_keys"]),       # [B, 1, S]
        helper.make_node("Unsqueeze", ["g", "ax2"], ["g_rows"]),       # [B, S, 1]
        helper.make_node("Or", ["band", "g_keys"], ["a1"]),
        helper.make_node("Or", ["a1", "g_rows"], ["allowed3"]),        # [B, S, S]
        helper.make_node("Unsqueeze", ["allowed3", "ax1"], ["allowed"]),  # [B, 1, S, S]
    ]
    if form == "additive":
        nodes += [helper.make_node("Where", ["allowed", "zero", "masked"], ["bias"]),
                  helper.make_node("Add", ["scores", "bias"], ["logits"])]
    elif form == "where":
        nodes += [helper.make_node("Where", ["allowed", "scores", "masked"], ["logits"])]
    else:   # where with the condition negated: True = disallowed
        nodes += [helper.make_node("Not", ["allowed"], ["disallowed"]),
                  helper.make_node("Where", ["disallowed", "masked", "scores"], ["logits"])]
    nodes += [helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "v"], ["ctx"]),
              helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ctx_t", "out_shape"], ["out"])]
    inputs = [helper.make_tensor_value_info("x", elem, [B, S, HIDDEN]),
              helper.make_tensor_value_info("global_flags", TensorProto.INT32, [B, S])]
    return _model(nodes, inputs, inits, out_type=elem)


def padding_mask_model():
    """q, k, v [B, H, S, D] and attention_mask [B, S] (1 token, 0 padding) -> the BERT-style key
    padding bias [B, 1, 1, S]."""
    inits = [numpy_helper.from_array(np.array(0.25, np.float32), "scale"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(-10000.0, np.float32), "big"),
             numpy_helper.from_array(np.array([1, 2], np.int64), "axes")]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"]),
             helper.make_node("Mul", ["qk", "scale"], ["scores"]),
             helper.make_node("Cast", ["attention_mask"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("Sub", ["one", "mf"], ["pad"]),
             helper.make_node("Mul", ["pad", "big"], ["bias2"]),
             helper.make_node("Unsqueeze", ["bias2", "axes"], ["bias"]),
             helper.make_node("Add", ["scores", "bias"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
             helper.make_node("MatMul", ["probs", "v"], ["out"])]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, H, S, D]) for n in ("q", "k", "v")]
    inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [B, S]))
    return _model(nodes, inputs, inits, out_shape=(B, H, S, D))


def _ort(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def _global_flags(rng):
    g = (rng.random((B, S)) < 0.05).astype(np.int32)
    g[:, 0] = 1
    return g


@pytest.mark.parametrize("form", ["additive", "where", "where_not"])
def test_window_and_global_mask_lowered_and_matches_onnxruntime(form):
    model = longformer_style_model(form)
    compiled = pit_tvm.compile_onnx(model)
    notes = [n for n in compiled.annotations if n["source"].startswith("attention:")]
    assert [n["status"] for n in notes] == ["pit"], compiled.annotations
    assert notes[0]["source"] == "attention:global_flags" and notes[0]["tensor"] == "ctx"
    assert "pit_attention_index" in compiled.lowered.script()       # the block index runs in the graph
    rng = np.random.default_rng(1)
    for _ in range(2):                                              # the global tokens change per call
        feeds = {"x": rng.standard_normal((B, S, HIDDEN)).astype(np.float32), "global_flags": _global_flags(rng)}
        np.testing.assert_allclose(compiled.run(feeds)[0], _ort(model, feeds), atol=2e-5, rtol=2e-5)


def test_key_padding_mask_taken_only_when_named():
    model = padding_mask_model()
    rng = np.random.default_rng(2)
    feeds = {n: rng.standard_normal((B, H, S, D)).astype(np.float32) for n in ("q", "k", "v")}
    lengths = np.array([S - 13, 9])
    feeds["attention_mask"] = (np.arange(S)[None, :] < lengths[:, None]).astype(np.int64)
    want = _ort(model, feeds)
    default = pit_tvm.compile_onnx(model)
    assert not any(n["source"].startswith("attention:") for n in default.annotations)
    np.testing.assert_allclose(default.run(feeds)[0], want, atol=2e-5, rtol=2e-5)
    named = pit_tvm.compile_onnx(model, sparse_attention="attention_mask")
    notes = [n for n in named.annotations if n["source"] == "attention:attention_mask"]
    assert [n["status"] for n in notes] == ["pit"]
    np.testing.assert_allclose(named.run(feeds)[0], want, atol=2e-5, rtol=2e-5)
    off = pit_tvm.compile_onnx(model, sparse_attention=False)
    assert not any(n["source"].startswith("attention:") for n in off.annotations)


def test_unsupported_attention_stays_dense_with_a_warning():
    model = longformer_style_model("additive", dtype=np.float64)
    with pytest.warns(UserWarning, match="stays dense: .*dtype float64"):
        compiled = pit_tvm.compile_onnx(model)
    notes = [n for n in compiled.annotations if n["source"].startswith("attention:")]
    assert [n["status"] for n in notes] == ["dense"]
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((B, S, HIDDEN)), "global_flags": _global_flags(rng)}
    np.testing.assert_allclose(compiled.run(feeds)[0], _ort(model, feeds), atol=1e-9, rtol=1e-9)


def test_unknown_mask_input_is_a_user_error():
    with pytest.raises(UserError, match="unknown input 'nope'"):
        pit_tvm.compile_onnx(padding_mask_model(), sparse_attention="nope")
    with pytest.raises(TypeError, match="sparse_attention="):
        pit_tvm.compile_onnx(padding_mask_model(), sparse_attention=3)


@pytest.mark.skipif(__import__("pit_tvm.nvcc", fromlist=["find_nvcc"]).find_nvcc() is None, reason="nvcc not found")
def test_imported_model_builds_for_cuda():
    from pit_tvm.nvcc import check_cuda_compiles

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = pit_tvm.compile_onnx(longformer_style_model("where"), target="cuda:sm_80")
    assert any(n["status"] == "pit" and n["source"] == "attention:global_flags" for n in compiled.annotations)
    assert check_cuda_compiles(compiled.executable, archs=("sm_80",)) >= 1
