"""MoE layers imported from ONNX (issue 35, item 4): HF SwitchTransformers' TorchScript export
(transformers 5.x's ``index_add_`` experts with and without dropping tokens, 4.x's boolean-mask
``GatherND`` / ``ScatterND`` experts), the dense-masked form and ``com.microsoft.MoE``, each
compiled with ``compile_onnx`` against onnxruntime (and the HF exports against torch's output,
saved by ``scripts/export_moe_fixtures.py``); the annotations; what falls back to dense (with a
warning, still correct); and the errors of bad contrib nodes."""
from __future__ import annotations

import functools
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from pit_tvm.cli.compile import format_annotations
from pit_tvm.compile import compile_onnx
from pit_tvm.errors import UserError
from pit_tvm.passes.frontend import UnsupportedOnnxError
from pit_tvm.passes.moe_import import MoEImportWarning, dense_moe_nodes, lower_moe_layers

ort = pytest.importorskip("onnxruntime")

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "moe"
HF = ["switch_encoder", "switch_encoder_capacity", "switch_v4_capacity", "switch_flat_router"]
HELPER = ["dense_equal", "dense_onehot", "ms_moe_relu", "ms_moe_swiglu"]
#: the router tensors a fixture's annotations must name (one per MoE layer)
ROUTER = {}
ROUTER.update({name: ["/m/encoder/block.0/layer.1/mlp/router/classifier/MatMul_output_0"] for name in HF})
ROUTER["switch_encoder"] = [f"/m/encoder/block.{i}/layer.1/mlp/router/classifier/MatMul_output_0" for i in (0, 1)]
ROUTER["switch_flat_router"] = ["/m/encoder/block.0/layer.1/mlp/classifier/MatMul_output_0"]   # (its export's scope)
ROUTER.update({name: ["router_logits"] for name in HELPER})
#: what each recognised layer is read as (form, top_k, routing, activation, capacity)
FORM = {"switch_encoder": ("hf_switch", "top-1", "relu", None),
        "switch_encoder_capacity": ("hf_switch", "top-1", "relu", "capacity 2 (dropped tokens: zero)"),
        "switch_v4_capacity": ("hf_switch", "top-1", "relu", "capacity 2 (dropped tokens: input_scaled)"),
        # (transformers 5.17: the capacity is counted over a size-1 axis, so it drops nothing)
        "switch_flat_router": ("hf_switch", "top-1", "relu", None),
        "dense_equal": ("dense_masked", "top-2 (softmax_topk)", "relu", None),
        "dense_onehot": ("dense_masked", "top-2 (topk_softmax)", "silu", None),
        "ms_moe_relu": ("com.microsoft.MoE", "top-2", "relu", None),
        "ms_moe_swiglu": ("com.microsoft.MoE", "top-2", "swiglu", None)}
D, F, E = 16, 32, 4


def fixture(name: str) -> Path:
    return FIXTURES / f"{name}.onnx"


def onnxruntime_output(model, feeds: dict) -> np.ndarray:
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def moe_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, MoEImportWarning)]


@functools.lru_cache(maxsize=None)
def compiled(name: str):
    """``(model, MoE warnings)`` of a fixture compiled for llvm (once per session)"""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = compile_onnx(str(fixture(name)), target="llvm")
    return model, moe_warnings(caught)


def example_feeds(name: str, seed: int) -> dict:
    """the fixture's saved input (seed 0) or a new random one of its shape"""
    saved = np.load(FIXTURES / f"{name}.npz")
    key = "input_ids" if "input_ids" in saved else "x"
    if seed == 0:
        return {key: saved[key]}
    rng = np.random.default_rng(seed)
    if key == "input_ids":
        return {key: rng.integers(0, 32, saved[key].shape).astype(np.int64)}
    return {key: rng.standard_normal(saved[key].shape).astype(np.float32)}


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.isfinite(got).all()
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


def moe_notes(model) -> list[dict]:
    return [a for a in model.annotations if str(a.get("source", "")).startswith("moe:")]


@pytest.mark.parametrize("name", HF + HELPER)
def test_fixture_lowers_to_the_moe_op_and_matches_onnxruntime(name):
    """every form compiles to one MoE op (its routing / index / grouped GEMM kernels in the
    built module, its annotation ``pit`` naming the router) and matches onnxruntime on the saved
    input and a new one (HF: also the saved torch output)"""
    model, warned = compiled(name)
    assert warned == []
    notes = moe_notes(model)
    assert sorted(n["tensor"] for n in notes) == ROUTER[name], model.annotations
    for note in notes:
        assert note["status"] == "pit" and note["source"] == f"moe:{note['tensor']}"
        form, top, act, capacity = FORM[name]
        assert note["reason"].startswith(form) and top in note["reason"] and act in note["reason"]
        assert (capacity in note["reason"]) if capacity else "capacity" not in note["reason"]
        assert note["micro_tile"] == [1, D] and note["rule"] == "M:SRead+SWrite"
    assert "source=moe:" in format_annotations(model.annotations)   # what pit-tvm compile prints
    kernels = [gv.name_hint for gv in model.lowered.get_global_vars()]
    assert any(k.startswith("pit_moe_routing") for k in kernels) and any("grouped_scatter" in k for k in kernels)
    for seed in (0, 1):
        feeds = example_feeds(name, seed)
        got = model.run(feeds)[0]
        assert relative_error(got, onnxruntime_output(fixture(name), feeds)) <= 1e-5
        if seed == 0:
            assert relative_error(got, np.load(FIXTURES / f"{name}.npz")["expected"]) <= 1e-5


@pytest.mark.parametrize("name", ["switch_encoder_capacity", "switch_v4_capacity"])
def test_capacity_fixtures_drop_tokens(name):
    """the capacity fixtures drop tokens on their saved input (else they would not test the
    dropping): in onnxruntime, the same graph with a capacity of 1000 gives another output"""
    model = onnx.load(str(fixture(name)))
    for node in model.graph.node:
        if node.op_type == "Constant" and any(n.op_type == "LessOrEqual" and node.output[0] in n.input
                                              for n in model.graph.node):
            value = numpy_helper.to_array(node.attribute[0].t)
            node.attribute[0].t.CopyFrom(numpy_helper.from_array(np.full_like(value, 1000)))
    feeds = example_feeds(name, 0)
    assert relative_error(onnxruntime_output(model, feeds), onnxruntime_output(fixture(name), feeds)) > 1e-2


def test_dense_masked_over_symbolic_tokens():
    """the dense-masked fixture's token dim is symbolic: other token counts run too"""
    model = compiled("dense_equal")[0]
    for tokens in (1, 5, 40):
        x = np.random.default_rng(tokens).standard_normal((tokens, D)).astype(np.float32)
        assert relative_error(model.run({"x": x})[0], onnxruntime_output(fixture("dense_equal"), {"x": x})) <= 1e-5


def test_unsupported_contrib_variant_runs_dense_with_a_warning():
    """com.microsoft.MoE's GPT-OSS SwiGLU (alpha 1.702, beta 1, limit 7): recognised, not an
    activation of the op: expanded into plain ONNX, with a warning naming the node; correct"""
    model, warned = compiled("ms_moe_swiglu_limit")
    assert len(warned) == 1 and "'moe'" in warned[0] and "activation_alpha" in warned[0]
    (note,) = moe_notes(model)
    assert note["status"] == "dense" and note["source"] == "moe:router_logits"
    for seed in (0, 2):
        feeds = example_feeds("ms_moe_swiglu_limit", seed)
        assert relative_error(model.run(feeds)[0], onnxruntime_output(fixture("ms_moe_swiglu_limit"), feeds)) <= 1e-5


def _graph_model(nodes, inits, dtype=TensorProto.FLOAT, tokens=12):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, [tokens, D])],
                              [helper.make_tensor_value_info("y", dtype, [tokens, D])], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _dense_model(seed=0, dtype=np.float32, tokens=12, scale_expert=None, **kw):
    rng = np.random.default_rng(seed)
    w = lambda *s: (rng.standard_normal(s) * 0.4).astype(dtype)  # noqa: E731
    args = dict(num_experts=E, top_k=2, normalize=False, activation="relu", w1=w(E, D, F), w2=w(E, F, D), b1=w(E, F),
                b2=w(E, D), dtype=dtype)
    args.update(kw)
    if args["activation"] == "swiglu":
        args.update(w3=w(E, D, F), b3=w(E, F))
    nodes, inits = dense_moe_nodes("m/", "x", "router_logits", "y", **args)
    if scale_expert is not None:   # expert e's term scaled twice: not the MoE its parts read as
        term = f"m/y{scale_expert}"
        nodes.insert(next(i for i, n in enumerate(nodes) if n.op_type == "Sum"),
                     helper.make_node("Mul", [term, "two"], [term + "x2"], name="doubled"))
        nodes[-1].input[scale_expert] = term + "x2"
        inits.append(numpy_helper.from_array(np.array(2.0, dtype), "two"))
    router = helper.make_node("MatMul", ["x", "router_weight"], ["router_logits"], name="router")
    inits.append(numpy_helper.from_array(w(D, E), "router_weight"))
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return _graph_model([router] + nodes, inits, elem, tokens)


def _compile_with_warnings(model, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled_model = compile_onnx(model, target="llvm", **kw)
    return compiled_model, moe_warnings(caught)


def _lowered_with_warnings(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered, records = lower_moe_layers(model)
    return lowered, records, moe_warnings(caught)


def test_layer_that_is_not_the_moe_its_parts_read_stays_dense():
    """a dense-masked layer whose expert 2 is scaled twice reads as an MoE by structure; the
    numerical check refuses it: the graph stays as it is, with a warning naming the expert's
    node"""
    model = _dense_model(scale_expert=2)
    lowered, records, warned = _lowered_with_warnings(model)
    assert len(warned) == 1 and "'m/fc1_0'" in warned[0] and "does not match" in warned[0]
    assert [r["status"] for r in records] == ["dense"] and lowered is model


def test_soft_mixture_without_top_k_is_not_recognised():
    """every expert weighted by its softmax probability (no top-k: not a routed MoE): a warning
    names the node, the graph stays as it is"""
    rng = np.random.default_rng(4)
    w = lambda *s: (rng.standard_normal(s) * 0.4).astype(np.float32)  # noqa: E731
    inits = [numpy_helper.from_array(w(D, E), "router_weight")]
    nodes = [helper.make_node("MatMul", ["x", "router_weight"], ["logits"], name="router"),
             helper.make_node("Softmax", ["logits"], ["probs"], axis=-1, name="softmax")]
    terms = []
    for e in range(2):
        inits += [numpy_helper.from_array(w(D, F), f"w1_{e}"), numpy_helper.from_array(w(F, D), f"w2_{e}"),
                  numpy_helper.from_array(np.array([e], np.int64), f"col{e}")]
        nodes += [helper.make_node("MatMul", ["x", f"w1_{e}"], [f"h{e}"], name=f"expert{e}_fc1"),
                  helper.make_node("Relu", [f"h{e}"], [f"a{e}"]),
                  helper.make_node("MatMul", [f"a{e}", f"w2_{e}"], [f"o{e}"]),
                  helper.make_node("Gather", ["probs", f"col{e}"], [f"p{e}"], axis=1),
                  helper.make_node("Mul", [f"o{e}", f"p{e}"], [f"t{e}"])]
        terms.append(f"t{e}")
    nodes.append(helper.make_node("Sum", terms, ["y"], name="combine"))
    model = _graph_model(nodes, inits)
    lowered, records, warned = _lowered_with_warnings(model)
    assert len(warned) == 1 and "'expert0_fc1'" in warned[0] and "no TopK / ArgMax" in warned[0]
    assert [r["status"] for r in records] == ["dense"] and lowered is model


def test_layer_the_op_refuses_stays_dense():
    """a dense-masked layer in float64 (recognised and checked; the op takes fp32 / fp16 / bf16
    only): a warning says the op refuses it, and it stays dense and correct"""
    model = _dense_model(dtype=np.float64)
    compiled_model, warned = _compile_with_warnings(model)
    assert len(warned) == 1 and "refuses" in warned[0] and "router_logits" in warned[0]
    (note,) = moe_notes(compiled_model)
    assert note["status"] == "dense" and note["source"] == "moe:router_logits"
    x = np.random.default_rng(6).standard_normal((12, D))
    assert relative_error(compiled_model.run({"x": x})[0], onnxruntime_output(model, {"x": x})) <= 1e-9


def test_dense_masked_swiglu_layer():
    """a dense-masked layer of gated experts (Mixtral's ``w2(silu(x w1) * x w3)``): recognised as
    swiglu and matching onnxruntime"""
    model = _dense_model(11, tokens=10, activation="swiglu", routing="topk_softmax")
    compiled_model, warned = _compile_with_warnings(model)
    assert warned == [] and [n["status"] for n in moe_notes(compiled_model)] == ["pit"]
    assert "swiglu" in moe_notes(compiled_model)[0]["reason"]
    x = np.random.default_rng(11).standard_normal((10, D)).astype(np.float32)
    assert relative_error(compiled_model.run({"x": x})[0], onnxruntime_output(model, {"x": x})) <= 1e-5


@settings(max_examples=3, deadline=None)
@given(top_k=st.integers(1, 3), routing=st.sampled_from(["softmax_topk", "topk_softmax"]), normalize=st.booleans(),
       activation=st.sampled_from(["relu", "silu", "gelu", "identity", "swiglu"]),
       mask=st.sampled_from(["equal", "onehot"]),
       tokens=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_dense_masked_layers_fuzz(top_k, routing, normalize, activation, mask, tokens, seed):
    """dense-masked layers of random routing, activation and mask form: recognised (status
    ``pit``) and matching onnxruntime"""
    model = _dense_model(seed, tokens=tokens, top_k=top_k, routing=routing, activation=activation, mask=mask,
                         normalize=normalize and routing == "softmax_topk")
    compiled_model, warned = _compile_with_warnings(model)
    assert warned == [] and [n["status"] for n in moe_notes(compiled_model)] == ["pit"]
    x = np.random.default_rng(seed).standard_normal((tokens, D)).astype(np.float32)
    assert relative_error(compiled_model.run({"x": x})[0], onnxruntime_output(model, {"x": x})) <= 1e-5


def _ms_moe(k=2, router_columns=E, fc1_shape=(E, F, D), fc2_shape=(E, D, F), **attrs):
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(rng.standard_normal(fc1_shape).astype(np.float32), "fc1"),
             numpy_helper.from_array(rng.standard_normal(fc2_shape).astype(np.float32), "fc2"),
             numpy_helper.from_array(rng.standard_normal((D, router_columns)).astype(np.float32), "router_weight")]
    nodes = [helper.make_node("MatMul", ["x", "router_weight"], ["router_logits"], name="router"),
             helper.make_node("MoE", ["x", "router_logits", "fc1", "", "fc2"], ["y"], name="bad_moe",
                              domain="com.microsoft", k=k, **attrs)]
    return _graph_model(nodes, inits)


def test_contrib_gelu_is_expanded_with_its_tanh_form():
    """com.microsoft.MoE's gelu is onnxruntime's tanh approximation, not the op's exact erf gelu:
    expanded into plain ONNX (a warning says why) that onnxruntime agrees with"""
    model = _ms_moe(activation_type="gelu")
    lowered, records, warned = _lowered_with_warnings(model)
    assert len(warned) == 1 and "'bad_moe'" in warned[0] and "tanh" in warned[0]
    assert [r["status"] for r in records] == ["dense"]
    assert not any(n.domain for n in lowered.graph.node)
    x = np.random.default_rng(8).standard_normal((12, D)).astype(np.float32)
    assert relative_error(onnxruntime_output(lowered, {"x": x}), onnxruntime_output(model, {"x": x})) <= 1e-5


@pytest.mark.parametrize("kw, error, message", [
    (dict(use_sparse_mixer=1), UnsupportedOnnxError, r"'bad_moe'.*use_sparse_mixer=1"),
    (dict(activation_type="relu2"), UnsupportedOnnxError, r"'bad_moe'.*activation_type 'relu2' is not supported"),
])
def test_unsupported_contrib_variant_is_a_clear_error(kw, error, message):
    """what neither the op nor the dense expansion computes is refused, naming the node"""
    with pytest.raises(error, match=message):
        lower_moe_layers(_ms_moe(**kw))


@pytest.mark.parametrize("kw, message", [
    (dict(k=5), r"'bad_moe'.*k=5 must be between 1 and the 4 experts"),
    (dict(router_columns=3), r"'bad_moe'.*router_probs 'router_logits' has 3 columns but there are 4 experts"),
    (dict(fc1_shape=(E, F, D + 1)), r"'bad_moe'.*fc1_experts_weights has shape \[4, 32, 17\]"),
    (dict(fc2_shape=(E, D)), r"'bad_moe'.*must be 3-D"),
])
def test_bad_contrib_node_is_a_clear_error(kw, message):
    """a com.microsoft.MoE that cannot be valid (k > E, a router of the wrong width, weights that
    disagree) is a UserError naming the node and the problem"""
    with pytest.raises(UserError, match=message):
        lower_moe_layers(_ms_moe(**kw))


def test_float16_switch_export_builds_for_cuda():
    """the capacity export in float16 built for CUDA (device code, no GPU needed): lowered to the
    MoE op, whose routing, expert index and grouped GEMM kernels are in the CUDA source"""
    from pit_tvm.testing import to_float16  # noqa: PLC0415
    from pit_tvm.nvcc import cuda_sources  # noqa: PLC0415

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = compile_onnx(to_float16(onnx.load(str(fixture("switch_encoder_capacity")))), target="cuda")
    assert moe_warnings(caught) == [] and [n["status"] for n in moe_notes(model)] == ["pit"]
    source = "\n".join(cuda_sources(model.executable))
    assert "pit_moe_routing" in source and "grouped_gather" in source and "grouped_scatter" in source


@pytest.mark.gpu
@pytest.mark.parametrize("name", HF + HELPER)
def test_fixture_in_float16_on_cuda_matches_onnxruntime(name):
    """the fixtures in float16, built for the GPU: the MoE op (its grouped GEMM kernels; Hopper's
    on sm_90a) against onnxruntime's float32"""
    from pit_tvm.testing import to_float16  # noqa: PLC0415

    shapes = {"x": [16, D]} if name.startswith("dense") else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = compile_onnx(to_float16(onnx.load(str(fixture(name)))), target="cuda", shapes=shapes)
    notes = moe_notes(model)        # (switch_encoder has two MoE layers)
    assert moe_warnings(caught) == [] and sorted(n["tensor"] for n in notes) == ROUTER[name]
    assert {n["status"] for n in notes} == {"pit"}
    feeds = example_feeds(name, 0)
    got = model.run({k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()})[0]
    assert got.dtype == np.float16
    assert relative_error(got, onnxruntime_output(fixture(name), feeds)) <= 2e-2


def test_export_of_the_traced_expert_loop_is_refused():
    """transformers' own expert loop (over the experts the traced example hit) exports chains for
    those experts only, a graph wrong for other inputs: not lowered (a warning names the node),
    the graph left as exported"""
    model = onnx.load(str(fixture("switch_traced_loop")))
    lowered, records, warned = _lowered_with_warnings(model)
    assert len(warned) == 1 and "not recognised" in warned[0] and "/wi/MatMul'" in warned[0]
    assert [r["status"] for r in records] == ["dense"]
    assert lowered is model


@pytest.mark.parametrize("batch, sequence", [(2, 8), (3, 12)])
def test_export_with_dynamic_axes_compiles_with_shapes(batch, sequence):
    """the capacity export with dynamic batch / sequence axes, compiled with ``shapes=``: lowered
    (capacity per sequence) and matching onnxruntime, at the traced shape (also torch's output)
    and another"""
    name = "switch_dynamic_capacity"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = compile_onnx(str(fixture(name)), target="llvm", shapes={"input_ids": [batch, sequence]})
    assert moe_warnings(caught) == []
    (note,) = moe_notes(model)
    assert note["status"] == "pit" and "capacity 2 (dropped tokens: zero)" in note["reason"]
    saved = np.load(FIXTURES / f"{name}.npz")
    ids = (saved["input_ids"] if (batch, sequence) == saved["input_ids"].shape
           else np.random.default_rng(9).integers(0, 32, (batch, sequence)).astype(np.int64))
    got = model.run({"input_ids": ids})[0]
    assert relative_error(got, onnxruntime_output(fixture(name), {"input_ids": ids})) <= 1e-5
    if ids is saved["input_ids"]:
        assert relative_error(got, saved["expected"]) <= 1e-5


def test_imported_layers_take_the_tuning_log(monkeypatch, tmp_path):
    """``compile_onnx(..., tuning_log=)`` reaches the MoE op of every imported layer: its grouped
    GEMMs ask the log for their tiles (both GEMMs of each layer, the log compile_onnx was given)"""
    import pit_tvm.ops.moe as moe_op
    from pit_tvm.passes import import_onnx
    from pit_tvm.passes.moe_import import lower_moe_layers

    asked = []
    planned = moe_op.grouped_tile_config

    def recording(mode, k, n, num_experts, top_k, dtype, target, tokens=None, tuning_log=None):
        asked.append((mode, tuning_log))
        return planned(mode, k, n, num_experts, top_k, dtype, target, tokens, None)

    monkeypatch.setattr(moe_op, "grouped_tile_config", recording)
    proto, records = lower_moe_layers(onnx.load(str(fixture("switch_encoder"))), "cuda", tuning_log=tmp_path)
    assert {r["status"] for r in records} == {"pit"}
    asked.clear()                      # (lower_moe_layers' dry run of the op asks without a log)
    import_onnx(proto, target="cuda")
    assert sorted({mode for mode, _ in asked}) == ["gather", "scatter"]
    assert {log for _, log in asked} == {str(tmp_path)}
