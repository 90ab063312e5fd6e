"""``lower_moe_layers`` and ``convert_pit_moe`` (pit_tvm/passes/moe_import.py), the MoE import: a
dense-masked mixture-of-experts layer in ONNX (Before: every expert on every token, the terms
selected by ``Equal`` masks of the router's top-2, summed; 44 nodes) becomes one ``PitMoE`` node
with the experts' weights stacked (Expected ONNX nodes, compared as protos), which the Relax
import converts into the routed-expert op (Expected ``main``: routing, expert index, the grouped
gather / scatter GEMMs and the combine, compared structurally; the five generated kernels are
stubs compared by name and signature, :mod:`_ir_compare`).  The imported module is also run on
llvm against onnxruntime on the Before graph.  The HF Switch exports and ``com.microsoft.MoE``
are tests/passes/test_moe_import.py's (model level, against onnxruntime and torch)."""
from __future__ import annotations

import warnings

import numpy as np
import tvm
from onnx import helper, numpy_helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from _ir_compare import assert_ir_equal
from pit_tvm.passes import import_onnx
from pit_tvm.passes.moe_import import MoEImportWarning, lower_moe_layers
from test_moe_import import D, E, F, _dense_model, onnxruntime_output

TOKENS = 12
RNG = np.random.default_rng(3)
W1, W2 = (RNG.standard_normal((E, D, F)) * 0.4).astype("float32"), (RNG.standard_normal((E, F, D)) * 0.4).astype("float32")
B1, B2 = (RNG.standard_normal((E, F)) * 0.4).astype("float32"), (RNG.standard_normal((E, D)) * 0.4).astype("float32")


def before():
    """x[12, 16] -> router MatMul -> the dense-masked layer of 4 ReLU experts, top-2, into y"""
    return _dense_model(seed=0, tokens=TOKENS, w1=W1, w2=W2, b1=B1, b2=B2)


EXPECTED_MOE_NODE = helper.make_node(
    "PitMoE", ["x", "router_logits", "y__moe_w1", "y__moe_w2", "y__moe_b1", "y__moe_b2"], ["y"], name="y__moe_node",
    domain="pit_tvm", activation="relu", capacity=-1, dropped_token="zero", form="dense_masked",
    normalize_routing_weights=0, num_experts=E, out_ndim=2, per_sequence=0, router_input="logits",
    routing="softmax_topk", top_k=2)


@I.ir_module
class Expected:
    """(the router's and the experts' weights are parameters here, bound to their values in the test)"""

    I.module_attrs({"pit.onnx_names": {"router_logits": "router_logits", "x": "x", "y": "y"}})

    @T.prim_func(private=True)
    def pit_moe_routing_e4_k2_softmax_topk_logits_float32(logits_h: T.handle, expert_h: T.handle, weight_h: T.handle):
        ntok, slots = T.int64(), T.int64()
        logits = T.match_buffer(logits_h, (ntok, 4), "float32")
        expert = T.match_buffer(expert_h, (ntok, 2), "int32")
        weight = T.match_buffer(weight_h, (slots,), "float32")
        T.evaluate(0)

    @T.prim_func(private=True)
    def pit_expert_index_e4_k2(expert_h: T.handle, offsets: T.Buffer((5,), "int32"), rows_h: T.handle):
        ntok, slots = T.int64(), T.int64()
        expert = T.match_buffer(expert_h, (ntok, 2), "int32")
        rows = T.match_buffer(rows_h, (slots,), "int32")
        T.evaluate(0)

    @T.prim_func(private=True)
    def pit_grouped_gather_e4_k16_n32_top2_float32_float32_bias_relu(
            x_h: T.handle, rows_h: T.handle, offsets: T.Buffer((5,), "int32"), w1: T.Buffer((4, 16, 32), "float32"),
            b1: T.Buffer((4, 32), "float32"), h_h: T.handle):
        ntok, p = T.int64(), T.int64()
        x = T.match_buffer(x_h, (ntok, 16), "float32")
        rows = T.match_buffer(rows_h, (p,), "int32")
        h = T.match_buffer(h_h, (p, 32), "float32")
        T.evaluate(0)

    @T.prim_func(private=True)
    def pit_grouped_scatter_e4_k32_n16_top2_float32_float32_bias(
            h_h: T.handle, rows_h: T.handle, offsets: T.Buffer((5,), "int32"), w2: T.Buffer((4, 32, 16), "float32"),
            b2: T.Buffer((4, 16), "float32"), weight_h: T.handle, y_h: T.handle):
        p = T.int64()
        h = T.match_buffer(h_h, (p, 32), "float32")
        rows = T.match_buffer(rows_h, (p,), "int32")
        weight = T.match_buffer(weight_h, (p,), "float32")
        y = T.match_buffer(y_h, (p, 16), "float32")
        T.evaluate(0)

    @T.prim_func(private=True)
    def pit_moe_combine_k2_d16_float32_float32(slots_h: T.handle, out_h: T.handle):
        ntok, slots = T.int64(), T.int64()
        y_slots = T.match_buffer(slots_h, (slots, 16), "float32")
        out = T.match_buffer(out_h, (ntok, 16), "float32")
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor((12, 16), "float32"), router_weight: R.Tensor((16, 4), "float32"),
             w1: R.Tensor((4, 16, 32), "float32"), b1: R.Tensor((4, 32), "float32"),
             w2: R.Tensor((4, 32, 16), "float32"), b2: R.Tensor((4, 16), "float32")) -> R.Tensor((12, 16), "float32"):
        R.func_attr({"num_input": 1})
        cls = Expected
        with R.dataflow():
            router_logits = R.matmul(x, router_weight)
            logits = R.reshape(router_logits, R.shape([12, 4]))
            routed = R.call_tir(cls.pit_moe_routing_e4_k2_softmax_topk_logits_float32, (logits,),
                                out_ty=[R.Tensor((12, 2), "int32"), R.Tensor((24,), "float32")])
            experts = routed[0]
            weights = routed[1]
            index = R.call_tir(cls.pit_expert_index_e4_k2, (experts,),
                               out_ty=[R.Tensor((5,), "int32"), R.Tensor((24,), "int32")])
            offsets = index[0]
            rows = index[1]
            tokens = R.reshape(x, R.shape([12, 16]))
            hidden = R.call_tir(cls.pit_grouped_gather_e4_k16_n32_top2_float32_float32_bias_relu,
                                (tokens, rows, offsets, w1, b1), out_ty=R.Tensor((24, 32), "float32"))
            y_slots = R.call_tir(cls.pit_grouped_scatter_e4_k32_n16_top2_float32_float32_bias,
                                 (hidden, rows, offsets, w2, b2, weights), out_ty=R.Tensor((24, 16), "float32"))
            combined = R.call_tir(cls.pit_moe_combine_k2_d16_float32_float32, (y_slots,),
                                  out_ty=R.Tensor((12, 16), "float32"))
            y = R.reshape(combined, R.shape([12, 16]))
            gv = y
            R.output(gv)
        return gv


def _lowered():
    with warnings.catch_warnings():
        warnings.simplefilter("error", MoEImportWarning)        # recognised: no warning
        return lower_moe_layers(before())


def test_dense_masked_layer_becomes_one_pit_moe_node():
    model = before()
    lowered, records = _lowered()
    router = next(n for n in model.graph.node if n.name == "router")
    assert list(lowered.graph.node) == [router, EXPECTED_MOE_NODE]
    weights = {t.name: numpy_helper.to_array(t) for t in lowered.graph.initializer}
    assert sorted(weights) == sorted(["router_weight", "y__moe_w1", "y__moe_w2", "y__moe_b1", "y__moe_b2"])
    for name, want in (("y__moe_w1", W1), ("y__moe_w2", W2), ("y__moe_b1", B1), ("y__moe_b2", B2)):
        np.testing.assert_array_equal(weights[name], want)
    assert [(r["status"], r["source"], r["output"]) for r in records] == [("pit", "moe:router_logits", "y")]
    assert any(o.domain == "pit_tvm" for o in lowered.opset_import)


def test_pit_moe_node_imports_as_the_routed_expert_op():
    lowered, _ = _lowered()
    weights = {t.name: numpy_helper.to_array(t) for t in lowered.graph.initializer}
    mod = import_onnx(lowered, target="llvm")
    expected = relax.transform.BindParams("main", {
        "router_weight": weights["router_weight"], "w1": W1, "b1": B1, "w2": W2, "b2": B2})(Expected)
    assert_ir_equal(mod, expected)

    x = np.random.default_rng(5).standard_normal((TOKENS, D)).astype("float32")
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(got, onnxruntime_output(before(), {"x": x}), rtol=1e-5, atol=1e-5)


def test_layer_without_the_moe_structure_is_left_alone():
    """A plain FFN (no router, no experts): the model comes back as it was, with no record."""
    model = before()
    del model.graph.node[:]
    model.graph.node.extend([helper.make_node("MatMul", ["x", "router_weight"], ["r"]),
                             helper.make_node("MatMul", ["r", "back"], ["y"])])
    model.graph.initializer.append(numpy_helper.from_array(np.ones((E, D), "float32"), "back"))
    lowered, records = lower_moe_layers(model)
    assert lowered is model and records == []

