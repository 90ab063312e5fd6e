"""PropagatePadding: the token-wise matmuls of a padded batch run on its real tokens.

The pass's decision on a Relax module (Before / Expected), the attribute through each op kind of
an encoder layer built with onnx.helper and where it must stop (a reduction, cumsum or
convolution over the tokens, a softmax without the mask), and numerics against onnxruntime on
the real tokens (the outputs at padded positions are not computed)."""
import pathlib
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from hypothesis import HealthCheck, given, settings, strategies as st
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import ir as I, relax as R

from pit_tvm.compile import compile_onnx
from pit_tvm.passes import AnnotateDynamicSparsity, PropagatePadding, annotations_of, import_onnx
from pit_tvm.passes.annotate import ANNOTATIONS_ATTR

RNG = np.random.default_rng(0)
BATCH, SEQ, HIDDEN = 3, 5, 16
FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "data" / "transformers"
REASON = ("padding propagated from graph input 'attention_mask': the rows of padded tokens reach only "
          "token-wise ops and masked attention; rows index built from the mask, shared by the matmuls it masks")


def _wrapper_attrs(fid, k):
    return {"pit.sparse_operand": "lhs", "pit.micro_tile": [1, k], "pit.rule": "M:SRead+SWrite",
            "pit.source": "padding:attention_mask", "pit.tensor": ["x", "a"][fid], "pit.reason": REASON,
            "pit.id": fid, "pit.row_mask_arg": 1}


# ----------------------------------------------------------------------------- the decision
@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((2, 4, 8), "float32"), w1: R.Tensor((8, 16), "float32"), w2: R.Tensor((16, 8), "float32"),
             w3: R.Tensor((8, 8), "float32"), attention_mask: R.Tensor((2, 4), "int64")):
        with R.dataflow():
            h = R.matmul(x, w1)
            a = R.nn.gelu(h)
            y = R.matmul(a, w2)                 # token-wise all the way to the output
            z = R.matmul(x, w3)
            pooled = R.sum(z, axis=[1])         # a sum over the sequence reads z's padded rows
            out = (y, pooled)
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function(private=True)
    def pit_matmul_0(a: R.Tensor((2, 4, 8), "float32"), b: R.Tensor((8, 16), "float32"),
                     row_mask: R.Tensor((2, 4), "int64")) -> R.Tensor((2, 4, 16), "float32"):
        R.func_attr(_wrapper_attrs(0, 8))
        gv = R.matmul(a, b)
        return gv

    @R.function(private=True)
    def pit_matmul_1(a: R.Tensor((2, 4, 16), "float32"), b: R.Tensor((16, 8), "float32"),
                     row_mask: R.Tensor((2, 4), "int64")) -> R.Tensor((2, 4, 8), "float32"):
        R.func_attr(_wrapper_attrs(1, 16))
        gv = R.matmul(a, b)
        return gv

    @R.function
    def main(x: R.Tensor((2, 4, 8), "float32"), w1: R.Tensor((8, 16), "float32"), w2: R.Tensor((16, 8), "float32"),
             w3: R.Tensor((8, 8), "float32"), attention_mask: R.Tensor((2, 4), "int64")):
        cls = Expected
        with R.dataflow():
            h = cls.pit_matmul_0(x, w1, attention_mask)
            a = R.nn.gelu(h)
            y = cls.pit_matmul_1(a, w2, attention_mask)
            z = R.matmul(x, w3)
            pooled = R.sum(z, axis=[1])
            out = (y, pooled)
            R.output(out)
        return out


def test_decision_before_expected():
    """The two matmuls whose padded rows reach only gelu and the output become rows-kind PIT
    matmuls given the mask; the one whose rows a sum over the sequence reads stays a matmul."""
    after = PropagatePadding("attention_mask")(Before)
    notes = annotations_of(after)
    main = after["main"].without_attr(ANNOTATIONS_ATTR)
    after.update_func(after.get_global_var("main"), main)
    tvm.ir.assert_structural_equal(after, Expected)
    assert [(n["tensor"], n["status"]) for n in notes] == [
        ("x", "pit"), ("a", "pit"), ("x", "dense"), ("pooled", "stop"), ("y", "output")]
    assert "sum over the sequence axis" in notes[3]["reason"]
    assert "'pooled'" in notes[2]["reason"]


# ----------------------------------------------------------------------------- ONNX encoder layers
def _init(shape, scale=0.3):
    return (RNG.standard_normal(shape) * scale).astype("float32")


def encoder_layer(mask_kind="additive", tail=None, fill=-1e9, mask_name="attention_mask", dims=(BATCH, SEQ, HIDDEN)):
    """x[batch, seq, hidden] -> one-head attention (Q, K, V, output projections; the mask as an
    additive bias ``(1 - mask) * fill``, a Where, or not at all) -> residual, LayerNorm -> SiLU
    FFN -> residual; then ``tail``: None, a (masked) mean over the sequence, a cumsum or a
    convolution over the tokens.  ``causal_where``: a decoder as GPT-2 exports it, the causal
    mask and-ed with the padding mask in a Where, and the token-wise matmuls on the
    ``[batch * seq, hidden]`` rows (its Conv1D layers)."""
    batch, seq, h = dims
    elem = TensorProto.FLOAT
    flat = mask_kind == "causal_where"

    def linear(inp, w, out):
        if not flat:
            return [helper.make_node("MatMul", [inp, w], [out])]
        return [helper.make_node("Reshape", [inp, "rows"], [f"{inp}_rows_for_{out}"]),
                helper.make_node("MatMul", [f"{inp}_rows_for_{out}", w], [out + "_rows"]),
                helper.make_node("Reshape", [out + "_rows", "tokens"], [out])]

    inits = {n: _init((h, h), h ** -0.5) for n in ("wq", "wk", "wv", "wo", "w1", "w2")}
    inits.update(bo=_init((h,)), gamma=1 + _init((h,), 0.1), beta=_init((h,), 0.1), scale=np.array(0.25, "float32"),
                 one=np.array(1.0, "float32"), fill=np.array(fill, "float32"), ax1=np.array([1], "int64"),
                 ax2=np.array([2], "int64"),
                 rows=np.array([-1, h], "int64"), tokens=np.array([batch, seq, h], "int64"),
                 causal=np.tril(np.ones((seq, seq), bool)))
    nodes = [n for w, o in (("wq", "q"), ("wk", "k"), ("wv", "v")) for n in linear("x", w, o)]
    nodes += [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
              helper.make_node("MatMul", ["q", "kt"], ["qk"]), helper.make_node("Mul", ["qk", "scale"], ["scores"]),
              helper.make_node("Cast", [mask_name], ["maskf"], to=elem),
              helper.make_node("Unsqueeze", ["maskf", "ax1"], ["keys"])]
    if mask_kind == "additive":
        nodes += [helper.make_node("Sub", ["one", "keys"], ["inv"]), helper.make_node("Mul", ["inv", "fill"], ["bias"]),
                  helper.make_node("Add", ["scores", "bias"], ["masked"])]
    elif mask_kind == "where":
        nodes += [helper.make_node("Cast", ["keys"], ["keep"], to=TensorProto.BOOL),
                  helper.make_node("Where", ["keep", "scores", "fill"], ["masked"])]
    elif mask_kind == "causal_where":
        nodes += [helper.make_node("Cast", ["keys"], ["keys_bool"], to=TensorProto.BOOL),
                  helper.make_node("And", ["keys_bool", "causal"], ["keep"]),
                  helper.make_node("Where", ["keep", "scores", "fill"], ["masked"])]
    else:
        nodes += [helper.make_node("Identity", ["scores"], ["masked"])]
    nodes += [helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "v"], ["ctx"]),
              *linear("ctx", "wo", "o"), helper.make_node("Add", ["o", "bo"], ["ob"]),
              helper.make_node("Add", ["ob", "x"], ["res"]),
              helper.make_node("LayerNormalization", ["res", "gamma", "beta"], ["ln"], axis=-1),
              *linear("ln", "w1", "f"), helper.make_node("Sigmoid", ["f"], ["sg"]),
              helper.make_node("Mul", ["f", "sg"], ["act"]), *linear("act", "w2", "f2"),
              helper.make_node("Add", ["f2", "ln"], ["hidden"])]
    out_shape = [batch, seq, h]
    if tail == "mean":
        nodes += [helper.make_node("ReduceMean", ["hidden"], ["y"], axes=[1], keepdims=0)]
        out_shape = [batch, h]
    elif tail == "masked_mean":
        nodes += [helper.make_node("Unsqueeze", ["maskf", "ax2"], ["rowmask"]),
                  helper.make_node("Mul", ["hidden", "rowmask"], ["kept"]),
                  helper.make_node("ReduceSum", ["kept", "ax1"], ["total"], keepdims=0),
                  helper.make_node("ReduceSum", ["rowmask", "ax1"], ["count"], keepdims=0),
                  helper.make_node("Div", ["total", "count"], ["y"])]
        out_shape = [batch, h]
    elif tail == "cumsum":
        inits["axis"] = np.array(1, "int64")
        nodes += [helper.make_node("CumSum", ["hidden", "axis"], ["y"])]
    elif tail == "conv":
        inits["wc"] = _init((h, h, 3))
        nodes += [helper.make_node("Transpose", ["hidden"], ["channels"], perm=[0, 2, 1]),
                  helper.make_node("Conv", ["channels", "wc"], ["conv"], pads=[1, 1]),
                  helper.make_node("Transpose", ["conv"], ["y"], perm=[0, 2, 1])]
    else:
        nodes += [helper.make_node("Identity", ["hidden"], ["y"])]
    graph = helper.make_graph(
        nodes, "encoder_layer",
        [helper.make_tensor_value_info("x", elem, [batch, seq, h]),
         helper.make_tensor_value_info(mask_name, TensorProto.INT64, [batch, seq])],
        [helper.make_tensor_value_info("y", elem, out_shape)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _padded(lengths=(5, 3, 1), dims=(BATCH, SEQ, HIDDEN)):
    mask = (np.arange(dims[1])[None] < np.array(lengths)[:, None]).astype("int64")
    return {"x": _init(dims, 1.0), "attention_mask": mask}


def _decide(model):
    mod = relax.transform.FoldConstant()(import_onnx(model))
    return annotations_of(PropagatePadding("attention_mask")(AnnotateDynamicSparsity()(mod)))


def _compile(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile_onnx(model, padding="attention_mask", **kw)


def _weight_matmuls_left(mod) -> int:
    """the matmuls of ``main`` on a constant 2-D weight that are not PIT wrappers"""
    left = []

    def visit(expr):
        if (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.matmul"
                and isinstance(expr.args[1], tvm.ir.GenericConst) and len(expr.args[1].ty.shape) == 2):
            left.append(expr)

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return len(left)


def _assert_close_on_real_tokens(model, cm, feeds, rtol=1e-4, run_feeds=None):
    """``cm`` on ``run_feeds`` (default ``feeds``) against onnxruntime's ``model`` on ``feeds``, at
    the real tokens"""
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    real = feeds["attention_mask"].astype(bool)
    for want, got in zip(ref, cm.run(run_feeds or feeds)):
        if want.ndim == 3:
            want, got = want[real], got[real]
        if want.size == 0:
            continue
        scale = np.abs(want).max()
        assert np.abs(want.astype("float32") - got).max() <= rtol * scale, np.abs(want - got).max() / scale


@pytest.fixture(scope="module")
def encoder_layers():
    """{mask kind: (model, compiled with padding=)}, compiled once for the module"""
    return {kind: (model, _compile(model)) for kind, model in
            ((kind, encoder_layer(kind)) for kind in ("additive", "causal_where"))}


@pytest.mark.parametrize("mask_kind", ["additive", "causal_where"])
def test_encoder_layer_runs_on_real_tokens(encoder_layers, mask_kind):
    """Every matmul of the layer (Q, K, V combined into one, output, FFN; on [batch, seq, K] or
    [batch * seq, K] rows) is a rows-kind PIT matmul listing the real tokens, from one rows index
    built from the mask; the real tokens' outputs match onnxruntime, the padded ones are not
    computed."""
    model, cm = encoder_layers[mask_kind]
    pit = [n for n in cm.annotations if n["status"] == "pit"]
    # (Q, K and V of one operand are combined into one matmul; after three reshapes they are not)
    assert len(pit) == (6 if mask_kind == "causal_where" else 4)
    assert all(n["source"] == "padding:attention_mask" and n["micro_tile"] == [1, HIDDEN] for n in pit)
    assert [n["status"] for n in cm.annotations if n["status"] != "pit"] == ["output"]
    assert "not computed" in cm.annotations[-1]["reason"]
    assert cm.lowered["main"].script().count("R.call_tir(pit_row_index_") == 1
    _assert_close_on_real_tokens(model, cm, _padded((5, 3, 1)))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mask=st.lists(st.integers(0, 1), min_size=BATCH * SEQ, max_size=BATCH * SEQ))
def test_any_mask_matches_on_real_tokens(encoder_layers, mask):
    """The analysis does not assume right padding: any 0/1 mask (left padding, holes, a row
    with no real token) gives the reference's values at the real tokens."""
    model, cm = encoder_layers["causal_where"]
    feeds = _padded()
    feeds["attention_mask"] = np.array(mask, "int64").reshape(BATCH, SEQ)
    _assert_close_on_real_tokens(model, cm, feeds)


@pytest.mark.parametrize("mask_kind", ["additive", "causal_where"])
def test_batch_as_long_as_the_sequence(mask_kind):
    """batch == sequence == heads-free scores [b, s, s]: the layouts come from where the tensors
    come from, not from their sizes, so only the key axis is masked and every matmul is PIT."""
    notes = _decide(encoder_layer(mask_kind, dims=(4, 4, HIDDEN)))
    assert [n["status"] for n in notes] == ["pit"] * 6 + ["output"], notes


@pytest.mark.parametrize("tail,reason", [
    ("mean", "mean over the sequence axis"),
    ("cumsum", "cumsum over the sequence axis"),
    ("conv", "conv1d is not known to keep tokens apart"),
])
def test_token_mixing_op_stops_propagation(tail, reason):
    """A reduction, a cumsum or a convolution over the tokens reads the padded rows: every
    matmul whose rows reach it stays dense, and the stop says why."""
    notes = _decide(encoder_layer(tail=tail))
    stops = [n for n in notes if n["status"] == "stop"]
    assert len(stops) == 1 and reason in stops[0]["reason"], notes
    assert stops[0]["tensor"] == "y" or tail == "conv"
    dense = [n for n in notes if n["status"] == "dense" and n["source"] == "padding:attention_mask"]
    assert len(dense) == 6 and all(stops[0]["tensor"] in n["reason"] for n in dense)
    assert not any(n["status"] in ("pit", "output") for n in notes)


def test_mean_over_tokens_numerics_stay_exact():
    model = encoder_layer(tail="mean")
    cm = _compile(model)
    assert not any(n["status"] == "pit" for n in cm.annotations)
    feeds = _padded()
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(cm.run(feeds)[0], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("mask_kind,fill,reason", [
    ("none", -1e9, "softmax over the sequence axis without a mask"),
    ("additive", -100.0, "softmax over the sequence axis without a mask"),   # too weak to mask
])
def test_attention_without_a_mask_stops(mask_kind, fill, reason):
    notes = _decide(encoder_layer(mask_kind, fill=fill))
    stops = {n["tensor"]: n["reason"] for n in notes if n["status"] == "stop"}
    assert reason in stops["probs"], notes
    assert "matmul sums over the sequence axis" in stops["ctx"]      # V's rows, weighted by unmasked probs
    # Q and K feed the unmasked softmax, V reaches the context matmul: the attention's inputs stay
    # dense; what the attention output feeds (output projection, FFN) only reaches the output
    statuses = [n["status"] for n in notes
                if n["source"] == "padding:attention_mask" and n["status"] in ("pit", "dense")]
    assert statuses.count("dense") == 3 and statuses.count("pit") == 3


def test_masked_mean_pooling_propagates():
    """``sum(hidden * mask) / sum(mask)`` zeroes the padded rows before the sum over the
    sequence: nothing stops, and the pooled output is exact."""
    model = encoder_layer(tail="masked_mean")
    cm = _compile(model)
    assert [n["status"] for n in cm.annotations] == ["pit"] * 4      # (Q, K and V combined)
    feeds = _padded((5, 2, 1))
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(cm.run(feeds)[0], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


# ----------------------------------------------------------------------------- opting in
def test_opt_in_and_mask_input_errors():
    model = encoder_layer()
    mod = relax.transform.FoldConstant()(import_onnx(model))
    notes = annotations_of(AnnotateDynamicSparsity()(mod))
    assert [n["status"] for n in notes] == ["input"] and "padding=" in notes[0]["reason"]
    assert [n["status"] for n in annotations_of(PropagatePadding(True)(mod))].count("pit") == 6
    with pytest.raises(ValueError, match=r"padding='lengths': no such graph input.*\['attention_mask', 'x'\]"):
        PropagatePadding("lengths")(mod)
    with pytest.raises(ValueError, match="padding=True: no rank-2 graph input"):
        PropagatePadding(True)(relax.transform.FoldConstant()(import_onnx(encoder_layer(mask_name="keep"))))


def test_symbolic_mask_shape_is_a_recorded_stop():
    model = encoder_layer()
    for value in (model.graph.input[0], model.graph.input[1]):
        value.type.tensor_type.shape.dim[0].dim_param = "batch"
    mod = relax.transform.FoldConstant()(import_onnx(model))
    with pytest.warns(UserWarning, match="static shape"):
        notes = annotations_of(PropagatePadding("attention_mask")(mod))
    assert [n["status"] for n in notes] == ["stop"] and "shapes=" in notes[0]["reason"]


# ----------------------------------------------------------------------------- real exports
#: fixtures of tests/data/transformers (tests/models/test_real_models.py checks them all without padding=):
#: BERT from both exporters (dynamo's attention merges batch and heads), decoders combining the
#: padding mask with the causal mask (GPT-2: Conv1D matmuls on [batch * seq, K] rows; OPT: a
#: relu FFN, whose second matmul keeps the relu source), T5 (a relative position bias added to
#: the mask bias)
REAL_MODELS = ["bert", "bert_dynamo", "gpt2", "opt", "t5_encoder"]


@pytest.mark.parametrize("name", REAL_MODELS)
def test_transformers_export_on_real_tokens(name):
    """A ``transformers`` export (the mask only biases the attention scores; decoders combine
    it with the causal mask): every token-wise matmul is a PIT matmul of the real tokens, and
    the real tokens' hidden states match onnxruntime."""
    path = FIXTURES / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"fixture {path.name} not present")
    batch, seq = 3, 8
    cm = _compile(str(path), shapes={"input_ids": [batch, seq], "attention_mask": [batch, seq]})
    padding = [n for n in cm.annotations if n["source"] == "padding:attention_mask"]
    assert [n for n in padding if n["status"] == "stop" or "rows would reach" in n["reason"]] == []
    assert sum(n["status"] == "pit" for n in padding) >= 3 * 2     # >= 3 per layer, 2 layers
    assert _weight_matmuls_left(cm.ir) == 0        # every matmul on weights is a PIT matmul
    assert cm.lowered["main"].script().count("R.call_tir(pit_row_index_") == 1
    model = onnx.load(str(path))
    ids = RNG.integers(0, 100, (batch, seq)).astype("int64")
    for lengths in ((8, 5, 1), (3, 8, 6)):
        mask = (np.arange(seq)[None] < np.array(lengths)[:, None]).astype("int64")
        _assert_close_on_real_tokens(model, cm, {"input_ids": ids, "attention_mask": mask})


@pytest.mark.gpu
def test_gpu_fp16_encoder_layer_on_real_tokens():
    """On CUDA (float16: the tensor-core rows kernels) the layer's matmuls list the real tokens,
    and the real tokens match onnxruntime's float32 model."""
    from pit_tvm.testing import to_float16

    dims = (4, 128, 256)
    model = encoder_layer(dims=dims, fill=-1e4)
    cm = _compile(to_float16(model), target="cuda")
    assert sum(n["status"] == "pit" for n in cm.annotations) == 4
    assert "pit_kernel" in cm.lowered.script() and "pit_row_index_" in cm.lowered["main"].script()
    for lengths in ((128, 77, 1, 30), (0, 128, 64, 5)):
        feeds = _padded(lengths, dims)
        half = dict(feeds, x=feeds["x"].astype("float16"))
        _assert_close_on_real_tokens(model, cm, feeds, rtol=2e-2, run_feeds=half)


@pytest.mark.parametrize("axis,propagates", [(-1, True), (1, False)])
def test_split_and_concat(axis, propagates):
    """A rotate-half (split, negate, concat of the halves) keeps the tokens apart along the
    hidden axis; along the sequence axis it mixes them: a stop."""
    h = HIDDEN
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["q"]),
             helper.make_node("Split", ["q", "halves"], ["q1", "q2"], axis=axis),
             helper.make_node("Neg", ["q2"], ["minus_q2"]),
             helper.make_node("Concat", ["minus_q2", "q1"], ["rotated"], axis=axis),
             helper.make_node("MatMul", ["rotated", "w2"], ["y"])]
    half = h // 2 if axis == -1 else 2
    graph = helper.make_graph(
        nodes, "rotate_half",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, 4, h]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [BATCH, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, 4, h])],
        [numpy_helper.from_array(_init((h, h)), "w1"), numpy_helper.from_array(_init((h, h)), "w2"),
         numpy_helper.from_array(np.array([half, half], "int64"), "halves")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    notes = _decide(model)
    if propagates:
        assert [n["status"] for n in notes] == ["pit", "pit", "output"], notes
    else:
        assert [n["status"] for n in notes if n["status"] != "dense"] == ["stop"], notes
        assert "along the batch or sequence axis" in [n for n in notes if n["status"] == "stop"][0]["reason"]


# ----------------------------------------------------------------------------- the CLI
def test_cli_compile_padding(tmp_path, capsys):
    """``pit-tvm compile --padding MASK``: the annotations it prints list the token-wise matmuls
    as PIT of ``padding:MASK``, and the exported library matches onnxruntime on the real tokens;
    a mask name that is not a graph input is an error naming it (exit code 2)"""
    from pit_tvm.cli.main import main
    from pit_tvm.runtime import load

    model = encoder_layer()
    onnx.save(model, tmp_path / "layer.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["compile", str(tmp_path / "layer.onnx"), "--padding", "attention_mask",
                     "-o", str(tmp_path / "layer.so")]) == 0
    printed = capsys.readouterr().out
    pit_lines = [line for line in printed.splitlines() if " pit " in line and "source=padding:attention_mask" in line]
    assert len(pit_lines) == 4, printed     # (Q, K, V combined into one matmul)
    _assert_close_on_real_tokens(model, load(tmp_path / "layer.so"), _padded((5, 3, 1)))
    assert main(["compile", str(tmp_path / "layer.onnx"), "--padding", "lengths", "-o", str(tmp_path / "bad.so")]) == 2
    err = capsys.readouterr().err
    assert "padding='lengths'" in err and "attention_mask" in err


def test_cli_padding_flag_alone_means_the_mask_named_like_one():
    """``--padding`` without a name is ``padding=True`` (the one input named like a mask);
    without the flag, None (padding not propagated)"""
    from pit_tvm.cli.main import build_parser

    parse = build_parser().parse_args
    assert parse(["compile", "m.onnx", "--padding", "-o", "m.so"]).padding is True
    assert parse(["compile", "m.onnx", "--padding", "mask", "-o", "m.so"]).padding == "mask"
    assert parse(["compile", "m.onnx", "-o", "m.so"]).padding is None
