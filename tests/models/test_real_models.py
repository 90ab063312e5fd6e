"""Real ``transformers`` exports through the front door (issue 34): tiny random-weight BERT,
RoBERTa, DistilBERT, ALBERT, ELECTRA, MiniLM-shaped BERT, OPT, GPT-2 and T5 encoder, exported by
``torch.onnx.export`` (TorchScript opset 17, and the dynamo exporter where it works), compile with
``compile_onnx(..., shapes=)`` and match onnxruntime on the real tokens of a padded batch.

The fixtures are made by ``scripts/export_transformers_fixtures.py`` (torch + transformers; not
needed here)."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

from pit_tvm.testing import to_float16
from pit_tvm.cli.main import main as cli_main
from pit_tvm.compile import compile_onnx
from pit_tvm.errors import UserError
from pit_tvm.passes.frontend import fold_shape_computations

ort = pytest.importorskip("onnxruntime")

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "transformers"
TORCHSCRIPT = ["bert", "roberta", "distilbert", "albert", "electra", "minilm", "opt", "gpt2", "t5_encoder"]
#: (torch.export fails on T5's encoder: its attention output's view of a transposed tensor)
DYNAMO = [f"{arch}_dynamo" for arch in TORCHSCRIPT if arch != "t5_encoder"]
#: the TorchScript exporter's lowest supported opset, on the model whose causal mask is hardest
OPSET14 = ["gpt2_opset14"]
BATCH, SEQUENCE, LENGTHS = 2, 16, [16, 9]
SHAPES = {"input_ids": [BATCH, SEQUENCE], "attention_mask": [BATCH, SEQUENCE]}


def fixture(name: str) -> Path:
    return FIXTURES / f"{name}.onnx"


def padded_batch(lengths=LENGTHS, sequence=SEQUENCE, seed=0) -> dict:
    """token ids (padding: id 0) and the attention mask of sequences of ``lengths`` padded to ``sequence``"""
    rng = np.random.default_rng(seed)
    mask = (np.arange(sequence)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    ids = rng.integers(3, 100, (len(lengths), sequence)).astype(np.int64) * mask
    return {"input_ids": ids, "attention_mask": mask}


def onnxruntime_output(name: str, feeds: dict) -> np.ndarray:
    sess = ort.InferenceSession(str(fixture(name)), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def real_token_error(got, want, mask) -> float:
    """max |got - want| over the real (unpadded) tokens, relative to the largest |want| there"""
    real = mask.astype(bool)
    got, want = np.asarray(got, np.float64)[real], np.asarray(want, np.float64)[real]
    assert np.isfinite(got).all()
    return float(np.abs(got - want).max() / np.abs(want).max())


def compiled(model, **kw):
    """``compile_onnx`` of a fixture path or a ModelProto, its warnings silenced"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile_onnx(model if isinstance(model, onnx.ModelProto) else str(model), **kw)


def test_every_fixture_is_there_with_its_interface():
    """the fixtures' names and interface are what the tests (and the padding pass's) rely on"""
    for name in TORCHSCRIPT + DYNAMO + OPSET14:
        model = onnx.load(str(fixture(name)))
        opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        assert opset >= 18 if name.endswith("_dynamo") else opset == (14 if name in OPSET14 else 17), (name, opset)
        inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
        assert inputs == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}, name
        assert [o.name for o in model.graph.output] == ["last_hidden_state"], name


@pytest.mark.parametrize("name", TORCHSCRIPT + DYNAMO + OPSET14)
def test_export_with_fixed_shapes_matches_onnxruntime(name):
    feeds = padded_batch()
    model = compiled(fixture(name), target="llvm", shapes=SHAPES)
    got = model.run(feeds)[0]
    want = onnxruntime_output(name, feeds)
    assert got.shape == want.shape
    assert real_token_error(got, want, feeds["attention_mask"]) <= 1e-4


#: the exports compiled over symbolic dims in every run (one per kind of shape arithmetic: the
#: padding mask's Range, OPT's and GPT-2's causal masks at opset 14 and 17, T5's relative
#: positions, the dynamo exporter's); the others under the ``slow`` marker
SYMBOLIC_EVERY_RUN = ["bert", "opt", "gpt2_opset14", "t5_encoder", "bert_dynamo", "gpt2_dynamo"]


@pytest.mark.parametrize("name", [n if n in SYMBOLIC_EVERY_RUN else pytest.param(n, marks=pytest.mark.slow)
                                  for n in TORCHSCRIPT + DYNAMO + OPSET14])
def test_export_without_shapes_is_right_at_two_sizes(name):
    """over symbolic batch / sequence dims (no shapes=): one build, right at two batch / sequence
    sizes (the Range of position ids / masks over the sequence dim keeps a symbolic length)"""
    model = compiled(fixture(name), target="llvm")
    assert [i["shape"] for i in model.inputs] == [["batch", "sequence"]] * 2
    for lengths, sequence in (([16, 9], 16), ([5], 7)):
        feeds = padded_batch(lengths, sequence)
        assert real_token_error(model.run(feeds)[0], onnxruntime_output(name, feeds), feeds["attention_mask"]) <= 1e-4


def range_over_reduced_shape(by_value=False) -> onnx.ModelProto:
    """y = x + Range(0, ReduceMax(Shape(x)[[1]])): a bound TVM's importer (and pit-tvm's symbolic
    Range) cannot follow over symbolic dims, that onnxsim folds once the shape is fixed;
    ``by_value``: Range(0, ReduceMax(lengths)) instead, a size no shape fixes"""
    from onnx import TensorProto, helper, numpy_helper  # noqa: PLC0415

    nodes = [helper.make_node("Shape", ["x"], ["x_shape"]),
             helper.make_node("Gather", ["x_shape", "axis_1"], ["sequence_1d"]),
             helper.make_node("ReduceMax", ["lengths" if by_value else "sequence_1d"], ["sequence"], keepdims=0),
             helper.make_node("Range", ["zero", "sequence", "one"], ["positions"]),
             helper.make_node("Cast", ["positions"], ["positions_float"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["x", "positions_float"], ["y"])]
    consts = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("zero", 0), ("one", 1), ("axis_1", [1]))]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence"])]
    if by_value:
        inputs.append(helper.make_tensor_value_info("lengths", TensorProto.INT64, ["batch"]))
    graph = helper.make_graph(nodes, "positions", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence"])], consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_shape_arithmetic_it_cannot_follow_names_the_tensor_and_the_fix_that_works():
    """where the symbolic dims cannot be kept: one ValueError naming the tensors whose shapes come
    from data, the input's symbolic dims and shapes= / --shape; and that fix compiles it right"""
    model = range_over_reduced_shape()
    with pytest.raises(ValueError) as info:
        compiled(model, target="llvm")
    text = str(info.value)
    assert not isinstance(info.value, AttributeError)
    assert "the shapes of ['positions', 'positions_float', 'y'] are computed from data" in text, text
    assert "x ['batch', 'sequence']" in text and "shapes={'x': [batch, sequence]}" in text, text
    assert "--shape x=<batch>x<sequence>" in text, text
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(compiled(model, target="llvm", shapes={"x": [3, 5]}).run({"x": x})[0], want, rtol=1e-6)


def test_a_size_taken_from_input_values_is_named_without_a_false_fix():
    """a Range up to max(lengths): its length is the input's values, which shapes= cannot fix, and
    the error says so (naming the tensor and the input) instead of suggesting shapes="""
    with pytest.raises(ValueError) as info:
        compiled(range_over_reduced_shape(by_value=True), target="llvm")
    text = str(info.value)
    assert "the shape of 'positions' depends on the values of input(s) ['lengths']" in text, text
    assert "shapes= cannot fix this one" in text and "shapes={" not in text, text


def test_shape_arithmetic_folds_and_weights_stay():
    """with the shapes fixed, onnxsim leaves no Shape / Range / causal-mask Expand shape computed
    at run time in GPT-2's export, and every weight is the exported one, bit for bit"""
    model = onnx.load(str(fixture("gpt2")))
    folded = fold_shape_computations(model, SHAPES)
    ops = {n.op_type for n in folded.graph.node}
    assert not ops & {"Shape", "Range", "ConstantOfShape"}, ops
    before = {t.name: t.raw_data for t in model.graph.initializer if len(t.raw_data) > 4096}
    after = {t.name: t.raw_data for t in folded.graph.initializer if t.name in before}
    assert before and after == before
    # the model keeps its symbolic inputs (only the folding saw them fixed)
    assert [d.dim_param for d in folded.graph.input[0].type.tensor_type.shape.dim] == ["batch", "sequence"]


def test_cli_compiles_an_export(tmp_path):
    out = tmp_path / "gpt2.so"
    code = cli_main(["compile", str(fixture("gpt2")), "--target", "llvm", "--shape", "input_ids=2x16",
                     "--shape", "attention_mask=2x16", "-o", str(out)])
    assert code == 0 and out.exists() and (tmp_path / "gpt2.so.json").exists()
    from pit_tvm.runtime import load  # noqa: PLC0415

    feeds = padded_batch()
    got = load(str(out)).run(feeds)[0]
    assert real_token_error(got, onnxruntime_output("gpt2", feeds), feeds["attention_mask"]) <= 1e-4


@pytest.mark.parametrize("shapes, match", [
    ({"input_id": [2, 16], "attention_mask": [2, 16]}, r"unknown input 'input_id'.*input_ids"),
    ({"input_ids": [2, 16, 1], "attention_mask": [2, 16]}, r"'input_ids' is \['batch', 'sequence'\].*\[2, 16, 1\]"),
])
def test_bad_shapes_are_named(shapes, match):
    with pytest.raises(ValueError, match=match):
        compile_onnx(str(fixture("bert")), shapes=shapes)


def test_bad_files_are_named(tmp_path):
    with pytest.raises(UserError, match="missing.onnx: no such file"):
        compile_onnx(str(tmp_path / "missing.onnx"))
    text = tmp_path / "notes.onnx"
    text.write_text("input_ids, attention_mask -> last_hidden_state\n")
    with pytest.raises(UserError, match="notes.onnx: not an ONNX model"):
        compile_onnx(str(text))
    assert cli_main(["compile", str(text), "-o", str(tmp_path / "x.so")]) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("name", TORCHSCRIPT + DYNAMO)
def test_export_in_float16_on_cuda_matches_onnxruntime(name):
    """the same exports converted to float16, built for the GPU with the padding lowered to PIT,
    against onnxruntime's float32 on the real tokens"""
    feeds = padded_batch()
    model = compiled(to_float16(onnx.load(str(fixture(name)))), target="cuda", shapes=SHAPES,
                     padding="attention_mask")
    assert any(a.get("status") == "pit" and str(a.get("source", "")).startswith("padding:")
               for a in model.annotations), model.annotations
    got = model.run(feeds)[0]
    assert got.dtype == np.float16
    assert real_token_error(got, onnxruntime_output(name, feeds), feeds["attention_mask"]) <= 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("name", SYMBOLIC_EVERY_RUN)
def test_export_in_float16_on_cuda_without_shapes_is_right_at_two_sizes(name):
    """one float16 CUDA build over symbolic batch / sequence dims, right at two sizes"""
    model = compiled(to_float16(onnx.load(str(fixture(name)))), target="cuda")
    for lengths, sequence in (([16, 9], 16), ([5, 3, 7], 7)):
        feeds = padded_batch(lengths, sequence)
        got = model.run(feeds)[0]
        assert got.dtype == np.float16
        assert real_token_error(got, onnxruntime_output(name, feeds), feeds["attention_mask"]) <= 5e-3


def test_float16_cuda_build_has_no_fast_math_pow_nor_bool_vectors():
    """T5's fp16 encoder built for CUDA (no GPU needed): its RMS norm's ``x ** 2`` is a product
    (``--use_fast_math``'s ``powf`` is NaN for x < 0; GPT-2's / ALBERT's gelu_new ``x ** 3`` made
    them NaN everywhere) and its bool mask is not read as ``ushort4`` vectors (an 8-byte access
    to 4 bools: cudaErrorMisalignedAddress, as the dynamo exports' mask cast was)"""
    from pit_tvm.nvcc import cuda_sources  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = compile_onnx(to_float16(onnx.load(str(fixture("t5_encoder")))), "cuda", shapes=SHAPES, auto=False)
    kernels = "\n".join(src[src.index("__global__"):] for src in cuda_sources(model.executable))  # no headers
    assert "pow(" not in kernels and "(ushort4*)" not in kernels
    assert "bool*" in kernels        # the mask is still read, by scalar loads


def _fused_attention_build(**kw):
    """``bert_head64`` (one head of 64) in float16 for CUDA at 2 x 128 tokens, lengths 128 and 37:
    the sizes the fused-attention kernel takes"""
    feeds = padded_batch([128, 37], 128)
    model = compiled(to_float16(onnx.load(str(fixture("bert_head64")))), target="cuda",
                     shapes={name: [2, 128] for name in feeds}, **kw)
    return model, feeds


def test_exported_sdpa_attention_is_fused_on_cuda():
    """the ``transformers`` export's attention (SDPA as ``torch.onnx`` writes it) becomes the
    fused-attention kernel reading the combined QKV projection in place (no GPU needed)"""
    model, _ = _fused_attention_build(padding="attention_mask")
    kernels = [gv.name_hint for gv in model.lowered.get_global_vars()]
    assert any(k.startswith("fused_attention_b2_h1_s128_d64_float16_packed_merged") for k in kernels), kernels
    assert not any(k.startswith(("softmax", "isnan")) for k in kernels), kernels


@pytest.mark.gpu
@pytest.mark.parametrize("padding", ["attention_mask", None])
def test_exported_attention_fused_on_cuda_matches_onnxruntime(padding):
    model, feeds = _fused_attention_build(padding=padding, cuda_graph=True)
    got = model.run(feeds)[0]
    assert real_token_error(got, onnxruntime_output("bert_head64", feeds), feeds["attention_mask"]) <= 5e-3


def test_sample_inputs_give_the_padding_matmuls_their_expected_density(monkeypatch):
    """with ``padding=`` and ``sample_inputs=`` (no ``expected_density``), the PIT matmuls of the
    padded rows are planned for the samples' real-token fraction, and the annotations say so"""
    import pit_tvm.compile as C  # noqa: PLC0415

    seen = []
    lower = C.LowerToPIT

    def spy(**kw):
        seen.append(kw.get("expected_density"))
        return lower(**kw)

    monkeypatch.setattr(C, "LowerToPIT", spy)
    samples = [padded_batch([16, 4]), padded_batch([8, 12], seed=1)]     # 20 and 20 of 32 tokens real
    model = compiled(fixture("bert"), target="llvm", shapes=SHAPES, padding="attention_mask", sample_inputs=samples)
    assert seen == [0.625]
    padded = [a for a in model.annotations if a.get("status") == "pit" and a["source"] == "padding:attention_mask"]
    assert padded and all(a["expected_density"] == 0.625 for a in padded)
    feeds = padded_batch()
    assert real_token_error(model.run(feeds)[0], onnxruntime_output("bert", feeds), feeds["attention_mask"]) <= 1e-4
