"""Longformer attention (issue 36): ``com.microsoft.LongformerAttention`` converted to block-sparse
attention (window + global tokens, padding from its mask), checked against Hugging Face's
``LongformerSelfAttention`` and ``LongformerModel`` (fixtures written by
scripts/export_longformer_fixtures.py) and an independent numpy implementation; a torch-exported
encoder whose window + global mask is computed in the graph, lowered and checked against
onnxruntime."""
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import pit_tvm
from pit_tvm.passes.contrib_attention import reference_longformer_attention

DATA = Path(__file__).resolve().parents[1] / "data" / "longformer"
NH, D, W = 2, 16, 8
HIDDEN = NH * D


def longformer_model(elem=TensorProto.FLOAT, num_heads=NH, window=W, hidden=HIDDEN, weight_shape=None,
                     batch="batch", sequence="sequence"):
    """one com.microsoft.LongformerAttention node, every operand a graph input"""
    names = [("input", elem, [batch, sequence, hidden]), ("weight", elem, weight_shape or [hidden, 3 * hidden]),
             ("bias", elem, [3 * hidden]), ("mask", elem, [batch, sequence]),
             ("global_weight", elem, [hidden, 3 * hidden]), ("global_bias", elem, [3 * hidden]),
             ("global", TensorProto.INT32, [batch, sequence])]
    node = helper.make_node("LongformerAttention", [n for n, _, _ in names], ["out"], domain="com.microsoft",
                            num_heads=num_heads, window=window)
    graph = helper.make_graph([node], "longformer", [helper.make_tensor_value_info(*n) for n in names],
                              [helper.make_tensor_value_info("out", elem, [batch, sequence, hidden])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def _feeds(rng, batch, sequence, dtype=np.float32, pad_rate=0.15, global_rate=0.08, hidden=HIDDEN, weight_scale=0.3):
    def w(*shape, s=weight_scale):
        return (rng.standard_normal(shape) * s).astype(dtype)

    mask = np.where(rng.random((batch, sequence)) < pad_rate, -10000.0, 0.0).astype(dtype)
    flags = (rng.random((batch, sequence)) < global_rate).astype(np.int32)
    return {"input": w(batch, sequence, hidden, s=1.0), "weight": w(hidden, 3 * hidden), "bias": w(3 * hidden, s=0.2),
            "mask": mask, "global_weight": w(hidden, 3 * hidden), "global_bias": w(3 * hidden, s=0.2),
            "global": flags}


def _reference(feeds, num_heads=NH, window=W):
    return reference_longformer_attention(feeds["input"], feeds["weight"], feeds["bias"], feeds["mask"],
                                          feeds["global_weight"], feeds["global_bias"], feeds["global"],
                                          num_heads, window)


@pytest.fixture(scope="module")
def compiled_fp32():
    return pit_tvm.compile_onnx(longformer_model())


def test_numpy_reference_matches_hugging_face():
    """the reference (written from the op's definition) against HF's LongformerSelfAttention"""
    z = np.load(DATA / "self_attention.npz")
    for i in range(2):
        got = reference_longformer_attention(z[f"hidden_{i}"], z["weight"], z["bias"], z[f"mask_{i}"],
                                             z["global_weight"], z["global_bias"], z[f"global_{i}"],
                                             int(z["num_heads"]), int(z["window"]))
        np.testing.assert_allclose(got, z[f"hf_output_{i}"], atol=2e-6, rtol=0)


def test_contrib_longformer_matches_hugging_face(compiled_fp32):
    z = np.load(DATA / "self_attention.npz")
    assert (int(z["num_heads"]), int(z["window"]), z["weight"].shape[0]) == (NH, W, HIDDEN)
    notes = [n for n in compiled_fp32.annotations if n["source"].startswith("attention:")]
    assert [(n["status"], n["source"], n["tensor"]) for n in notes] == [("pit", "attention:global,mask", "out")]
    assert "pit_attention_index" in compiled_fp32.lowered.script()
    for i in range(2):          # the global tokens change per call
        feeds = {"input": z[f"hidden_{i}"], "weight": z["weight"], "bias": z["bias"], "mask": z[f"mask_{i}"],
                 "global_weight": z["global_weight"], "global_bias": z["global_bias"], "global": z[f"global_{i}"]}
        np.testing.assert_allclose(compiled_fp32.run(feeds)[0], z[f"hf_output_{i}"], atol=1e-5, rtol=0)


@settings(max_examples=6, deadline=None)
@given(batch=st.integers(1, 3), sequence=st.integers(1, 300), pad_rate=st.sampled_from([0.0, 0.2, 1.0]),
       global_rate=st.sampled_from([0.0, 0.05, 0.5, 1.0]), seed=st.integers(0, 2**16))
def test_contrib_longformer_matches_reference(compiled_fp32, batch, sequence, pad_rate, global_rate, seed):
    """any B and S (tails of the 128-query blocks, S not a multiple of 2W), padding anywhere,
    no / some / all tokens global, all padding"""
    feeds = _feeds(np.random.default_rng(seed), batch, sequence, pad_rate=pad_rate, global_rate=global_rate)
    np.testing.assert_allclose(compiled_fp32.run(feeds)[0], _reference(feeds), atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_contrib_longformer_half_precision(dtype):
    """(the reference takes the rounded inputs; the tolerance is the dtype's rounding of the
    projections and the output, relative to the output's largest value)"""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    model = longformer_model(helper.np_dtype_to_tensor_dtype(np.dtype(np_dtype)), batch=2, sequence=70)
    compiled = pit_tvm.compile_onnx(model)
    feeds = {k: v.astype(np_dtype) if v.dtype == np.float32 else v
             for k, v in _feeds(np.random.default_rng(3), 2, 70).items()}
    got = compiled.run(feeds)[0]
    assert got.dtype == np_dtype
    want = _reference({k: v.astype(np.float32) if k != "global" else v for k, v in feeds.items()})
    tol = 2e-3 if dtype == "float16" else 2e-2
    np.testing.assert_allclose(got.astype(np.float64), want, atol=tol * np.abs(want).max(), rtol=0)


def test_contrib_longformer_dense_when_sparse_attention_off():
    compiled = pit_tvm.compile_onnx(longformer_model(), sparse_attention=False)
    notes = [n for n in compiled.annotations if n["source"].startswith("attention:")]
    assert [n["status"] for n in notes] == ["dense"] and "sparse_attention=False" in notes[0]["reason"]
    assert "pit_attention_index" not in compiled.lowered.script()
    rng = np.random.default_rng(4)
    for batch, sequence in ((2, 40), (1, 7)):       # (symbolic dims: one build)
        feeds = _feeds(rng, batch, sequence)
        np.testing.assert_allclose(compiled.run(feeds)[0], _reference(feeds), atol=2e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:attention 'out_local'")    # (the pass's word on the dense form)
def test_contrib_longformer_without_fast_kernel_is_dense_unless_named():
    """CUDA other than sm_90a: dense masks with a warning; naming the global input takes the
    sparse kernel anyway (the pass's policy for run-time masks)"""
    with pytest.warns(UserWarning, match="LongformerAttention 'out': no fast sparse kernel for cuda sm_80"):
        compiled = pit_tvm.compile_onnx(longformer_model(batch=1, sequence=32), target="cuda:sm_80")
    notes = {n["tensor"]: n["status"] for n in compiled.annotations if n["source"] == "attention:global,mask"}
    assert notes["out"] == "dense" and "pit" not in notes.values()
    compiled = pit_tvm.compile_onnx(longformer_model(batch=1, sequence=32), target="cuda:sm_80",
                                    sparse_attention="global")
    assert [(n["tensor"], n["status"]) for n in compiled.annotations
            if n["source"].startswith("attention:")] == [("out", "pit")]
    assert "pit_attention_index" in compiled.lowered.script()


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_heads=3), "hidden size 32 is not a multiple of num_heads=3"),
    (dict(weight_shape=[HIDDEN, 2 * HIDDEN]), r"'weight' must have shape \[32, 96\]"),
    (dict(window=-1), "window=-1"),
])
def test_contrib_longformer_bad_operands_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        pit_tvm.compile_onnx(longformer_model(**kwargs))
    assert "LongformerAttention" in str(info.value)


@pytest.mark.skipif(__import__("pit_tvm.nvcc", fromlist=["find_nvcc"]).find_nvcc() is None, reason="nvcc not found")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_contrib_longformer_builds_for_cuda(head_dim):
    """sm_90a, fp16, the head dims of the Hopper kernel (the GPU test's models): the sparse
    path, compiled to device code; both passes (local rows, global rows) take the global tokens
    apart although the padding comes as documents"""
    from pit_tvm.nvcc import check_cuda_compiles

    compiled = pit_tvm.compile_onnx(longformer_model(TensorProto.FLOAT16, hidden=2 * head_dim, window=64),
                                    target="cuda")
    assert [n["status"] for n in compiled.annotations if n["source"].startswith("attention:")] == ["pit"]
    kernels = [gv.name_hint for gv in compiled.lowered.get_global_vars()
               if gv.name_hint.startswith("pit_sparse_attention_hopper_")]
    assert len(kernels) == 2 and all(name.endswith("_gsplit") and "_g_d_" in name for name in kernels), kernels
    assert check_cuda_compiles(compiled.executable, archs=("sm_90a",)) >= 1


@pytest.mark.skipif(__import__("pit_tvm.nvcc", fromlist=["find_nvcc"]).find_nvcc() is None, reason="nvcc not found")
def test_exported_longformer_half_dense_cuda_build_compiles():
    """The HF LongformerModel export in float16 with its attention left dense (what a target
    without the fast kernel runs): the rows' global / padding choice fused into the P V matmul
    compiles to device code (a boolean where there became a vector select nvcc rejected), and
    reads no boolean as a vector (TVM types 4 bools ``ushort4``: 8 bytes, a misaligned address on
    the H200 at 12 layers)"""
    from pit_tvm.nvcc import check_cuda_compiles, cuda_sources
    from pit_tvm.testing import to_float16

    model = to_float16(onnx.load(DATA / "longformer_model.onnx"))
    shapes = {n: [1, 64] for n in ("input_ids", "attention_mask", "global_attention_mask")}
    compiled = pit_tvm.compile_onnx(model, "cuda", shapes=shapes, auto=False, sparse_attention=False)
    assert all(n["status"] != "pit" for n in compiled.annotations)
    assert "ushort4" not in "\n".join(cuda_sources(compiled.executable))
    assert check_cuda_compiles(compiled.executable, archs=("sm_90a",)) >= 1


# --------------------------------------------------------------------------- an exported encoder
BOTH_MASKS = "attention:attention_mask,global_attention_mask"
ENCODER_SHAPES = {"inputs_embeds": [2, 64, HIDDEN], "attention_mask": [2, 64], "global_attention_mask": [2, 64]}


def _encoder_feeds(rng, n_global):
    mask = np.ones((2, 64), np.int64)
    mask[1, 64 - rng.integers(1, 30):] = 0
    flags = np.zeros((2, 64), np.int64)
    flags[:, 0] = 1
    flags[0, rng.choice(np.arange(1, 64), n_global, replace=False)] = 1
    return {"inputs_embeds": rng.standard_normal((2, 64, HIDDEN)).astype(np.float32), "attention_mask": mask,
            "global_attention_mask": flags}


def test_exported_window_global_encoder_lowered_and_matches_onnxruntime():
    """torch export of a BERT-style encoder whose mask is the window + global tokens + padding,
    computed in the graph from its two mask inputs: both layers' attention runs block-sparse"""
    ort = pytest.importorskip("onnxruntime")
    path = DATA / "window_global_encoder.onnx"
    compiled = pit_tvm.compile_onnx(str(path), shapes=ENCODER_SHAPES)
    notes = [n for n in compiled.annotations if n["source"].startswith("attention:")]
    assert [(n["status"], n["source"]) for n in notes] == [("pit", BOTH_MASKS)] * 2
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(6)
    for n_global in (1, 6):     # the pattern changes per call
        feeds = _encoder_feeds(rng, n_global)
        got, want = compiled.run(feeds)[0], session.run(None, feeds)[0]
        real = feeds["attention_mask"].astype(bool)     # (padding rows: the op gives 0 where no key is allowed)
        np.testing.assert_allclose(got[real], want[real], atol=2e-5, rtol=0)



def test_cuda_build_of_the_exported_encoder_on_the_cpu():
    """What the GPU test below builds (fp32): its kernels' schedules, thread loops run serially on
    the CPU (pit_tvm.testing.cuda_schedules_on_cpu), match onnxruntime; and its layer norms keep
    each row's mean and variance in every lane's registers.  (On an H200 the layer norms kept them
    in shared memory, which lanes 1-31 read before lane 0 wrote it: NaN and rows ~30x too small)"""
    from tvm import relax

    from pit_tvm.nvcc import cuda_kernels, cuda_sources
    from pit_tvm.testing import cuda_schedules_on_cpu

    ort = pytest.importorskip("onnxruntime")
    path = DATA / "window_global_encoder.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = pit_tvm.compile_onnx(str(path), shapes=ENCODER_SHAPES, target="cuda",
                                        sparse_attention="global_attention_mask")
    kernels = {name: body for src in cuda_sources(compiled.executable) for name, (_, body) in cuda_kernels(src).items()}
    norms = [name for name in kernels if name.startswith("layer_norm")]
    assert norms and all("__shared__" not in kernels[name] for name in norms), norms
    vm = relax.VirtualMachine(cuda_schedules_on_cpu(compiled.lowered), tvm.cpu())
    feeds = _encoder_feeds(np.random.default_rng(8), 4)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = vm["main"](*(tvm.runtime.tensor(feeds[i["name"]]) for i in compiled.inputs)).numpy()
    real = feeds["attention_mask"].astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- GPU (the lead runs these)
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_contrib_longformer_matches_reference(head_dim):
    """sm_90a, fp16, the head dims of the Hopper kernel: the sparse path (not the dense fallback).
    The weights are scaled by 1 / sqrt(hidden) so that the scores are O(1): with the CPU tests'
    0.3 the scores of these head dims reach tens, and fp16's rounding of the inputs and
    projections alone moves the output by more than the tolerance (the CPU build too)"""
    hidden = 2 * head_dim
    model = longformer_model(TensorProto.FLOAT16, hidden=hidden, window=64)
    compiled = pit_tvm.compile_onnx(model, target="cuda")
    notes = [n for n in compiled.annotations if n["source"].startswith("attention:")]
    assert [n["status"] for n in notes] == ["pit"], notes
    rng = np.random.default_rng(7)
    for batch, sequence in ((2, 512), (1, 1000)):
        feeds = _feeds(rng, batch, sequence, np.float16, pad_rate=0.1, global_rate=0.02, hidden=hidden,
                       weight_scale=hidden ** -0.5)
        got = compiled.run(feeds)[0].astype(np.float64)
        np.testing.assert_allclose(got, _reference(feeds, window=64), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_exported_window_global_encoder_matches_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    path = DATA / "window_global_encoder.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = pit_tvm.compile_onnx(str(path), shapes=ENCODER_SHAPES, target="cuda",
                                        sparse_attention="global_attention_mask")
    assert [n["status"] for n in compiled.annotations if n["source"].startswith("attention:")] == ["pit", "pit"]
    feeds = _encoder_feeds(np.random.default_rng(8), 4)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    real = feeds["attention_mask"].astype(bool)
    np.testing.assert_allclose(compiled.run(feeds)[0][real], want[real], atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- HF LongformerModel
MODEL_SHAPES = {n: [2, 64] for n in ("input_ids", "attention_mask", "global_attention_mask")}


def test_hf_longformer_model_with_contrib_attention_matches_hugging_face():
    """HF LongformerModel exported as ONNX Runtime's exporter does (each self-attention one
    com.microsoft.LongformerAttention node): both layers run block-sparse; the whole model matches
    HF's eager output, on two calls with different global tokens and padding"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # (TVM's take / gather notes on the embeddings)
        compiled = pit_tvm.compile_onnx(str(DATA / "longformer_model.onnx"), shapes=MODEL_SHAPES)
    notes = [n for n in compiled.annotations if n["source"].startswith("attention:")]
    assert [(n["status"], n["source"]) for n in notes] == [("pit", BOTH_MASKS)] * 2
    z = np.load(DATA / "longformer_model_io.npz")
    for i in range(2):
        feeds = {n: z[f"{n}_{i}"] for n in MODEL_SHAPES}
        np.testing.assert_allclose(compiled.run(feeds)[0], z[f"hf_output_{i}"], atol=2e-5, rtol=0)


@pytest.mark.skipif(__import__("pit_tvm.nvcc", fromlist=["find_nvcc"]).find_nvcc() is None, reason="nvcc not found")
def test_hf_longformer_model_builds_for_cuda():
    """what the GPU test below builds (fp32, static shapes), compiled to sm_90a device code: its
    fused ``where(global rows, global, local)`` kernel once vectorised a select on a bool x4
    value that nvcc rejects (ushort4 to float4)"""
    from pit_tvm.nvcc import check_cuda_compiles

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = pit_tvm.compile_onnx(str(DATA / "longformer_model.onnx"), shapes=MODEL_SHAPES, target="cuda",
                                        sparse_attention="global_attention_mask")
    assert [n["status"] for n in compiled.annotations if n["source"].startswith("attention:")] == ["pit", "pit"]
    assert check_cuda_compiles(compiled.executable, archs=("sm_90a",)) >= 1


@pytest.mark.gpu
def test_gpu_hf_longformer_model_with_contrib_attention_matches_hugging_face():
    """(head dim 16, fp32: no fast kernel, so the global input is named to take the sparse one)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = pit_tvm.compile_onnx(str(DATA / "longformer_model.onnx"), shapes=MODEL_SHAPES, target="cuda",
                                        sparse_attention="global_attention_mask")
    assert [n["status"] for n in compiled.annotations if n["source"].startswith("attention:")] == ["pit", "pit"]
    z = np.load(DATA / "longformer_model_io.npz")
    for i in range(2):
        feeds = {n: z[f"{n}_{i}"] for n in MODEL_SHAPES}
        np.testing.assert_allclose(compiled.run(feeds)[0], z[f"hf_output_{i}"], atol=1e-4, rtol=0)
