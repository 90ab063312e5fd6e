"""``compile_onnx(..., sample_inputs=)`` / ``pit-tvm compile --sample-inputs``: each activation-sparse
matmul's micro-tile (or dense) chosen from its pattern on sample inputs, recorded in the annotations,
and the build still right (against onnxruntime / numpy)."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pit_tvm.cli.main import main as cli_main
from pit_tvm.compile import compile_onnx
from pit_tvm.errors import UserError
from pit_tvm.tuning.choose import choose_micro_tile, default_latency_model
from pit_tvm.tuning.sample_tiles import candidates_for

ort = pytest.importorskip("onnxruntime")


def compiled(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile_onnx(model, target="llvm", **kw)


def expected_choice(activation: np.ndarray):
    """the reference decision for an activation: choose_micro_tile on the CPU's measured model,
    dense where the chosen micro-tile covers everything (nothing to skip)"""
    act = activation.reshape(-1, activation.shape[-1])
    choice = choose_micro_tile(act, candidates_for(*act.shape), default_latency_model(act.shape[1], "llvm"))
    if choice.is_dense or choice.coverage[choice.choice] >= 1.0:
        return "dense"
    return list(choice.choice)


def relu_mlp(tokens=256, d_model=64, hidden=128, live_tokens=0.1, seed=0):
    """x -> relu(x W1 + b1) W2 with most tokens' hidden rows zero (their inputs are zero and the
    bias negative): whole-row sparsity of the second matmul's operand; and a sample input"""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((d_model, hidden)) / np.sqrt(d_model)).astype(np.float32)
    b1 = np.full(hidden, -0.05, np.float32)
    w2 = (rng.standard_normal((hidden, d_model)) / np.sqrt(hidden)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["xw1"]), helper.make_node("Add", ["xw1", "b1"], ["pre"]),
         helper.make_node("Relu", ["pre"], ["hidden"]), helper.make_node("MatMul", ["hidden", "w2"], ["y"])],
        "relu_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [tokens, d_model])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [tokens, d_model])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((tokens, d_model)).astype(np.float32)
    x[rng.random(tokens) >= live_tokens] = 0.0
    return model, x, (w1, b1, w2)


def test_real_opt_relu_micro_tile_chosen_from_samples_matches_onnxruntime():
    """a real OPT export: both FFN ReLUs' decisions come from the samples' activations (computed
    here by onnxruntime and decided by choose_micro_tile), and the build matches onnxruntime"""
    from test_real_models import SHAPES, fixture, onnxruntime_output, padded_batch, real_token_error

    feeds = padded_batch()
    model = compiled(str(fixture("opt")), shapes=SHAPES, sample_inputs=feeds)
    relus = [a for a in model.annotations if a["source"] == "relu"]
    assert len(relus) == 2 and all(a["chosen_from"] == "sample_inputs" for a in relus), model.annotations
    probe = onnx.load(str(fixture("opt")))
    probe.graph.output.extend(helper.make_empty_tensor_value_info(a["tensor"]) for a in relus)
    acts = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        [a["tensor"] for a in relus], feeds)
    for rec, act in zip(relus, acts):
        want = expected_choice(act)
        assert (rec["status"] == "dense") if want == "dense" else (rec["micro_tile"] == want), (rec, want)
        assert "chosen from sample inputs" in rec["reason"] and "cpu_matmul.json" in rec["reason"]
    got = model.run(feeds)[0]
    assert real_token_error(got, onnxruntime_output("opt", feeds), feeds["attention_mask"]) <= 1e-4


def test_row_sparse_samples_choose_whole_rows_and_stay_correct(tmp_path):
    """most tokens' hidden rows zero: whole rows (1 x hidden) beat the default 32x1 strips; the
    build with that micro-tile matches numpy on fresh inputs of the same kind. The CLI reads
    the samples from an .npz and prints the choice."""
    model, x, (w1, b1, w2) = relu_mlp()
    hidden = np.maximum(x @ w1 + b1, 0)
    want_tile = expected_choice(hidden)
    assert want_tile == [1, 128]          # (the workload is built for it: a test of the choice)
    cm = compiled(model, sample_inputs={"x": x})
    (rec,) = [a for a in cm.annotations if a["source"] == "relu"]
    assert rec["status"] == "pit" and rec["micro_tile"] == want_tile and rec["rule"] == "M:SRead+SWrite", rec
    _, fresh, _ = relu_mlp(seed=1)
    fresh_ref = np.maximum(fresh @ w1 + b1, 0) @ w2
    np.testing.assert_allclose(cm.run({"x": fresh})[0], fresh_ref, rtol=1e-4, atol=1e-4)

    onnx.save(model, str(tmp_path / "mlp.onnx"))
    np.savez(tmp_path / "samples.npz", x=x)
    assert cli_main(["compile", str(tmp_path / "mlp.onnx"), "--sample-inputs", str(tmp_path / "samples.npz"),
                     "-o", str(tmp_path / "mlp.so")]) == 0
    from pit_tvm.runtime import load  # noqa: PLC0415

    lib = load(str(tmp_path / "mlp.so"))
    assert [a.get("micro_tile") for a in lib.meta["annotations"] if a["source"] == "relu"] == [want_tile]


@pytest.mark.parametrize("samples, match", [
    ({"y": np.zeros((256, 64), np.float32)}, r"unknown input\(s\) \['y'\].*missing input\(s\) \['x'\]"),
    ({"x": np.zeros((3, 64), np.float32)}, r"sample_inputs\[0\]: onnxruntime cannot run"),
    ("no_such_samples.npz", r"no_such_samples.npz: no such file"),
])
def test_bad_sample_inputs_are_named(samples, match):
    model, _, _ = relu_mlp()
    with pytest.raises(UserError, match=match):
        compiled(model, sample_inputs=samples)
