"""The small workloads compile through compile_onnx and match onnxruntime and the dense
(PIT-off) TVM build; FFN sparsity ~90%."""
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pit_tvm.testing import bert_encoder, bert_inputs, opt_ffn, opt_ffn_inputs, with_outputs
from pit_tvm.compile import compile_onnx

ort = pytest.importorskip("onnxruntime")


def ort_run(model, inputs):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)


def compiled(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile_onnx(model, **kw)


@pytest.mark.parametrize("d", [64, 256])
def test_opt_ffn_hidden_sparsity_is_about_90_percent(d):
    model = with_outputs(opt_ffn(d), ["hidden"])
    hidden = ort_run(model, opt_ffn_inputs(d, batch=4, seq=64))[1]
    sparsity = float((hidden == 0).mean())
    assert 0.87 <= sparsity <= 0.93, sparsity
    # OPT's structure: a few hot neurons fire for most tokens, most neurons rarely
    rate = (hidden > 0).reshape(-1, hidden.shape[-1]).mean(0)
    assert (rate > 0.5).mean() <= 0.12 and np.median(rate) < 0.15


@pytest.fixture(scope="module")
def ffn_builds():
    """(model, PIT build, PIT-off build: the same passes without annotations)"""
    model = opt_ffn(64)
    return model, compiled(model), compiled(model, auto=False)


@pytest.fixture(scope="module")
def bert_builds():
    model = bert_encoder(layers=2, hidden=64, heads=4)
    return model, compiled(model), compiled(model, auto=False)


def test_opt_ffn_small_matches_onnxruntime_and_the_dense_build(ffn_builds):
    model, cm, dense = ffn_builds
    assert [(a["tensor"], a["source"], a["status"]) for a in cm.annotations] == [("hidden", "relu", "pit")]
    assert [a["status"] for a in dense.annotations] == []
    for b, s in ((2, 16), (1, 5)):  # symbolic batch and sequence
        inputs = opt_ffn_inputs(64, batch=b, seq=s)
        out = cm.run(inputs)[0]
        np.testing.assert_allclose(out, ort_run(model, inputs)[0], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(out, dense.run(inputs)[0], rtol=1e-5, atol=1e-5)


def test_bert_encoder_small_matches_onnxruntime(bert_builds):
    model, cm, _ = bert_builds
    # 4 token-wise matmuls per layer (Q/K/V combined into one, attention output, FFN in and
    # out) read padding-masked activations (whole rows zero)
    pit = [a for a in cm.annotations if a["source"] == "padding:attention_mask"]
    assert len(pit) == 8 and all(a["rule"] == "M:SRead+SWrite" and a["status"] == "pit" for a in pit)
    assert {a["tensor"] for a in pit} >= {"l0.masked_in", "l0.ctx", "l0.ffn_in", "l0.ffn_act"}
    for b, s, lengths in ((3, 12, [12, 5, 1]), (2, 7, [3, 7])):
        inputs = bert_inputs(64, batch=b, seq=s, lengths=lengths)
        out = cm.run(inputs)[0]
        ref = ort_run(model, inputs)[0]
        valid = inputs["attention_mask"].astype(bool)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-4)
        assert np.isfinite(out[valid]).all()


@settings(max_examples=8, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=4))
def test_bert_pit_build_matches_the_dense_build(bert_builds, lengths):
    """any batch of lengths: the PIT build (padding rows skipped) equals the PIT-off build,
    whose kernels are the same dense ones, on the real tokens"""
    _, cm, dense = bert_builds
    inputs = bert_inputs(64, batch=len(lengths), seq=12, lengths=lengths)
    valid = inputs["attention_mask"].astype(bool)
    np.testing.assert_allclose(cm.run(inputs)[0][valid], dense.run(inputs)[0][valid], rtol=1e-4, atol=1e-4)


def test_bert_padding_rows_are_zero_at_the_masked_matmuls():
    model = with_outputs(bert_encoder(layers=1, hidden=64, heads=4), ["l0.ffn_act"])
    inputs = bert_inputs(64, batch=2, seq=10, lengths=[4, 10])
    act = ort_run(model, inputs)[1]
    assert not act[0, 4:].any() and act[0, :4].any() and act[1].any()
