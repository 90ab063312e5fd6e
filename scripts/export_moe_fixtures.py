"""Write the small ONNX MoE fixtures of ``tests/passes/test_moe_import.py`` to ``tests/data/moe/``.

- ``switch_encoder.onnx`` / ``switch_encoder_capacity.onnx``: HF ``SwitchTransformersEncoderModel``
  (tiny config: d_model 16, d_ff 32, 4 experts, two sparse layers / one, random seeded weights) exported
  by the TorchScript exporter (``dynamo=False``, opset 17) at ``input_ids [2, 8]``; the second
  with ``expert_capacity=2`` so that tokens are dropped (per sequence, as HF counts).  HF's expert
  loop runs over the experts hit by the traced input (``expert_hit = ...nonzero()``), which the
  tracer unrolls for the example's experts only (a graph wrong for other inputs); the export
  replaces it with the static loop over every expert (what transformers' own fix PRs do), the
  same computation per expert: ``torch.where`` -> ``NonZero``, gather -> ``Gather``,
  ``index_add_`` -> ``ScatterElements`` + ``Add``.
- ``switch_v4_capacity.onnx``: the same model with the transformers 4.x sparse MLP (boolean-mask
  read / write: ``NonZero`` -> ``GatherND`` / ``ScatterND``; a dropped token keeps its input,
  scaled by its router probability).
- ``switch_dynamic_capacity.onnx``: ``switch_encoder_capacity`` exported with dynamic axes
  ``batch`` / ``sequence`` (compiled with ``shapes=``).
- ``switch_flat_router.onnx``: ``switch_encoder_capacity``'s model with transformers 5.17's
  router over the flattened tokens: its capacity count runs over a size-1 axis, so nothing is
  dropped (capacity 2 or not).
- ``switch_traced_loop.onnx``: transformers' own loop, as the tracer unrolls it (the example
  routes to every expert): the importer must refuse it (it fails when fewer experts are hit).
- ``dense_equal.onnx`` / ``dense_onehot.onnx``: the dense-masked form built with ``onnx.helper``
  (every expert on every token, ``Equal`` / ``OneHot`` masks of the router's top-k, a ``Sum``).
- ``ms_moe_*.onnx``: onnxruntime's ``com.microsoft.MoE`` (relu top-2 with biases on a 3-D input;
  SwiGLU interleaved (``swiglu_fusion=1``, the CPU kernel's only layout) with alpha 1 / beta 0,
  which the op takes; GPT-OSS's alpha 1.702 / beta 1 / limit 7, which falls back to dense).

Each ``.onnx`` has a ``.npz`` beside it with an example input and the source's output (torch's
for the HF exports, onnxruntime's for the others).  Needs torch and transformers (not needed by
the tests, which read the committed files)::

    PYTHONPATH=.:/work/torchenv/lib/python3.11/site-packages python scripts/export_moe_fixtures.py [--out DIR]
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "moe"
BATCH, SEQUENCE, VOCAB = 2, 8, 32
D, F, E = 16, 32, 4


# ------------------------------------------------------------------------------------------ HF


_ORIGINALS: dict = {}


def _static_experts_forward(self, hidden_states, selected_experts, routing_weights):
    """``SwitchTransformersExperts.forward`` over every expert (HF's loops over the experts the
    input hits, which the tracer unrolls for the example's experts only); the same computation"""
    import torch  # noqa: PLC0415

    final = torch.zeros_like(hidden_states)
    expert_mask = selected_experts.permute(2, 1, 0)
    for e in range(self.num_experts):
        idx, top_x = torch.where(expert_mask[e])
        current = hidden_states[None, top_x].reshape(-1, hidden_states.shape[-1])
        out = self[f"expert_{e}"](current) * routing_weights[top_x, idx, None]
        final.index_add_(0, top_x, out.to(hidden_states.dtype))
    return final


def _v4_sparse_mlp_forward(self, hidden_states):
    """transformers 4.x's ``SwitchTransformersSparseMLP.forward`` (boolean-mask read / write; a
    dropped token keeps its input, scaled by its router probability)"""
    router_mask, router_probs, _ = self.router(hidden_states)
    next_states = hidden_states.clone()
    for e in range(self.router.num_experts):
        token_indices = router_mask[:, :, e].bool()
        next_states[token_indices] = self.experts[f"expert_{e}"](hidden_states[token_indices]).to(next_states.dtype)
    return router_probs * next_states


def _flat_router_sparse_mlp_forward(self, hidden_states):
    """transformers 5.17's ``SwitchTransformersSparseMLP.forward`` (the GPU machine's; 5.24 routes
    per sequence): the router runs on the flattened tokens, so its capacity count (a cumsum over
    the one-hot's size-1 axis) never drops a token; the experts then run the static loop"""
    import torch  # noqa: PLC0415

    batch, sequence, hidden = hidden_states.shape
    flat = hidden_states.view(-1, hidden)
    router = self.router
    probs = torch.softmax(router.classifier(flat.to(router.dtype)), dim=-1, dtype=router.dtype).to(flat.dtype)
    _, index = torch.max(probs, dim=-1, keepdim=True)
    one_hot = torch.nn.functional.one_hot(index, num_classes=router.num_experts)
    selected = one_hot * (torch.cumsum(one_hot, dim=-2) <= router.expert_capacity)
    weights = torch.max(probs, dim=-1).values.unsqueeze(-1)
    return _static_experts_forward(self.experts, flat, selected, weights).reshape(batch, sequence, hidden)


def patch_switch_experts(loop: str = "static"):
    """Set the expert loop of transformers' SwitchTransformers for an export: ``"static"`` (every
    expert: what ``compile_onnx`` lowers to the MoE op; use it to export a real Switch model, e.g.
    for a benchmark), ``"v4"`` (transformers 4.x's sparse MLP), ``"flat"`` (5.17's router over
    the flattened tokens, then the static loop) or ``"traced"`` (transformers' own loop, restored)."""
    from transformers.models.switch_transformers import modeling_switch_transformers as sw  # noqa: PLC0415

    if loop not in ("static", "v4", "flat", "traced"):
        raise ValueError(f"loop must be 'static', 'v4', 'flat' or 'traced', got {loop!r}")
    originals = _ORIGINALS.setdefault("forward", (sw.SwitchTransformersExperts.forward,
                                                  sw.SwitchTransformersSparseMLP.forward))
    sw.SwitchTransformersExperts.forward = originals[0] if loop == "traced" else _static_experts_forward
    sw.SwitchTransformersSparseMLP.forward = {"v4": _v4_sparse_mlp_forward,
                                              "flat": _flat_router_sparse_mlp_forward}.get(loop, originals[1])


def _switch(capacity: int, loop: str, layers: int = 1):
    """The tiny Switch encoder (random seeded weights), its expert loop patched
    (:func:`patch_switch_experts`)"""
    import torch  # noqa: PLC0415
    import transformers as tf  # noqa: PLC0415

    torch.manual_seed(0)
    config = tf.SwitchTransformersConfig(vocab_size=VOCAB, d_model=D, d_kv=8, d_ff=F, num_layers=layers,
                                         num_sparse_encoder_layers=layers, num_heads=2, num_experts=E,
                                         expert_capacity=capacity, relative_attention_num_buckets=8,
                                         relative_attention_max_distance=16)
    model = tf.SwitchTransformersEncoderModel(config).eval()
    for p in model.parameters():   # HF's init leaves the experts tiny: spread them so routing matters
        torch.nn.init.normal_(p, std=0.5)
    patch_switch_experts(loop)
    return model


def export_switch(name: str, capacity: int, loop: str, out: pathlib.Path, layers: int = 1, dynamic: bool = False):
    import torch  # noqa: PLC0415

    model = _switch(capacity, loop, layers)

    class Wrapper(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            return self.m(input_ids=input_ids).last_hidden_state

    wrapper = Wrapper(model).eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    path = out / f"{name}.onnx"
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "last_hidden_state": {0: "batch", 1: "sequence"}}
    torch.onnx.export(wrapper, (ids,), str(path), dynamo=False, opset_version=17, input_names=["input_ids"],
                      output_names=["last_hidden_state"], dynamic_axes=axes if dynamic else None)
    with torch.no_grad():
        expected = wrapper(ids).numpy()
    proto = onnx.load(str(path))
    proto.producer_name, proto.producer_version = "pit-tvm export_moe_fixtures", ""
    onnx.save(proto, str(path))
    np.savez(out / f"{name}.npz", input_ids=ids.numpy(), expected=expected)


# ------------------------------------------------------------------------------------------ onnx.helper


def _model(nodes, inputs, outputs, inits, ms=False):
    graph = helper.make_graph(nodes, "moe", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if ms else [])
    model = helper.make_model(graph, opset_imports=opsets, producer_name="pit-tvm export_moe_fixtures")
    model.ir_version = 8
    return model


def dense_fixture(mask: str, routing: str, top_k: int, activation: str, normalize: bool, tokens="tokens"):
    from pit_tvm.passes.moe_import import dense_moe_nodes  # noqa: PLC0415

    rng = np.random.default_rng({"equal": 2, "onehot": 3}[mask])
    w = lambda *s: (rng.standard_normal(s) * 0.4).astype(np.float32)  # noqa: E731
    router_w = numpy_helper.from_array(w(D, E), "router_weight")
    nodes = [helper.make_node("MatMul", ["x", "router_weight"], ["router_logits"], name="router")]
    more, inits = dense_moe_nodes("moe/", "x", "router_logits", "y", num_experts=E, top_k=top_k,
                                  normalize=normalize, activation=activation, w1=w(E, D, F), w2=w(E, F, D),
                                  b1=w(E, F), b2=w(E, D), mask=mask, routing=routing)
    return _model(nodes + more, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [tokens, D])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [tokens, D])], [router_w] + inits)


def ms_moe_fixture(activation: str, k: int, bias: bool, three_d: bool, **attrs):
    rng = np.random.default_rng(4)
    w = lambda *s: (rng.standard_normal(s) * 0.4).astype(np.float32)  # noqa: E731
    fused = 2 if activation == "swiglu" else 1
    inits = [numpy_helper.from_array(w(E, fused * F, D), "fc1_w"), numpy_helper.from_array(w(E, D, F), "fc2_w"),
             numpy_helper.from_array(w(D, E), "router_weight")]
    if bias:
        inits += [numpy_helper.from_array(w(E, fused * F), "fc1_b"), numpy_helper.from_array(w(E, D), "fc2_b")]
    shape = [BATCH, SEQUENCE, D] if three_d else [BATCH * SEQUENCE, D]
    nodes = []
    x2 = "x"
    if three_d:
        inits.append(numpy_helper.from_array(np.array([-1, D], np.int64), "flat"))
        nodes.append(helper.make_node("Reshape", ["x", "flat"], ["x2"], name="flatten"))
        x2 = "x2"
    nodes.append(helper.make_node("MatMul", [x2, "router_weight"], ["router_logits"], name="router"))
    nodes.append(helper.make_node("MoE", ["x", "router_logits", "fc1_w", "fc1_b" if bias else "", "fc2_w",
                                          "fc2_b" if bias else ""], ["y"], name="moe", domain="com.microsoft",
                                  k=k, activation_type=activation, **attrs))
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits, ms=True)


def _save_with_ort(model, name: str, out: pathlib.Path, shape):
    import onnxruntime as ort  # noqa: PLC0415

    onnx.checker.check_model(model)
    onnx.save(model, str(out / f"{name}.onnx"))
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.savez(out / f"{name}.npz", x=x, expected=session.run(None, {"x": x})[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--no-hf", action="store_true", help="only the onnx.helper fixtures (no torch)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tokens = BATCH * SEQUENCE
    _save_with_ort(dense_fixture("equal", "softmax_topk", 2, "relu", True), "dense_equal", args.out, [tokens, D])
    _save_with_ort(dense_fixture("onehot", "topk_softmax", 2, "silu", False), "dense_onehot", args.out, [tokens, D])
    _save_with_ort(ms_moe_fixture("relu", 2, True, True), "ms_moe_relu", args.out, [BATCH, SEQUENCE, D])
    _save_with_ort(ms_moe_fixture("swiglu", 2, True, False, swiglu_fusion=1, activation_alpha=1.0,
                                  activation_beta=0.0, normalize_routing_weights=1),
                   "ms_moe_swiglu", args.out, [tokens, D])
    _save_with_ort(ms_moe_fixture("swiglu", 2, True, False, swiglu_fusion=1, activation_alpha=1.702,
                                  activation_beta=1.0, swiglu_limit=7.0),
                   "ms_moe_swiglu_limit", args.out, [tokens, D])
    if not args.no_hf:
        export_switch("switch_encoder", 64, "static", args.out, layers=2)
        export_switch("switch_encoder_capacity", 2, "static", args.out)
        export_switch("switch_v4_capacity", 2, "v4", args.out)
        export_switch("switch_traced_loop", 64, "traced", args.out)
        export_switch("switch_dynamic_capacity", 2, "static", args.out, dynamic=True)
        export_switch("switch_flat_router", 2, "flat", args.out)
    for path in sorted(args.out.iterdir()):
        print(f"{path.name}: {path.stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
