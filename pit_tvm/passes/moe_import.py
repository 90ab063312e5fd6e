"""Mixture-of-experts layers in ONNX, recognised and lowered to :func:`pit_tvm.ops.moe.emit_moe`.

Kept as one module: the three recognisers share the graph walker (``_Graph``), the expert-chain
matcher and the numerical check against :func:`~pit_tvm.ops.moe.reference_moe`, and their only
entry points are :func:`lower_moe_layers` and :func:`convert_pit_moe`; split, each part would
import the others' private helpers.

Three forms are recognised (:func:`lower_moe_layers`, run by ``compile_onnx`` before the Relax
import):

* ``hf_switch``: the TorchScript export of HF ``SwitchTransformers``' sparse MLP: the expert loop
  unrolled into per-expert chains ``NonZero`` -> ``Gather`` / ``GatherND`` (the expert's tokens) ->
  ``MatMul`` -> activation -> ``MatMul`` -> scaled by the routing weight -> ``ScatterND`` /
  ``ScatterElements`` (+ ``Add``) back to the tokens, all chains under one router (``Softmax`` ->
  ``ArgMax`` / ``TopK`` -> ``OneHot``, with the expert capacity as ``CumSum`` -> ``LessOrEqual``).
* ``dense_masked``: every expert applied to every token, each expert's output scaled by a routing
  weight selected through ``Equal`` / ``OneHot`` masks of the router's top-k, summed.
* ``com.microsoft.MoE``: onnxruntime's contrib op (the CPU kernel's semantics: ``router_probs``
  are logits, softmax over the experts, top-k, weights optionally renormalised; ``fc1`` / ``fc3``
  weights ``[E, f, d]``, ``fc2`` ``[E, d, f]``, transposed here to the op's layout).

Forms (a) and (b) are found by structure (groups of expert FFN chains reading the same token
tensor, the router above their masks), their routing parameters read from the graph, and then
**checked numerically**: the layer's subgraph is run with onnxruntime on random and on degenerate
(all tokens alike: every token to one expert, so capacity dropping happens) inputs and compared
with :func:`pit_tvm.ops.moe.reference_moe` for the extracted spec; where the graph leaves a
parameter open (renormalisation, what a dropped token outputs) the candidate that matches is
taken.  A layer replaced becomes one ``PitMoE`` node (domain ``pit_tvm``) that the Relax importer
converts with :func:`convert_pit_moe`.  What is not recognised or checked stays dense, with a
warning naming the node; a recognised variant the op does not support (an activation, a dtype;
``com.microsoft.MoE``'s SwiGLU ``alpha`` / ``limit``) falls back to the dense path: the contrib op
is then expanded into plain ONNX (:func:`dense_moe_nodes`), never a wrong answer.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

#: the op type and domain of the node a recognised layer becomes (converted by :func:`convert_pit_moe`)
PIT_MOE_OP = "PitMoE"
PIT_DOMAIN = "pit_tvm"
MS_DOMAIN = "com.microsoft"

#: shape-only ops walked through when tracing a tensor back to its source
_VIEW_OPS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Cast"}
_INDEX_OPS = {"Squeeze", "Unsqueeze", "Reshape", "Split", "Transpose", "Slice", "Gather", "Identity", "Cast",
              "Flatten", "Expand", "Concat"}
#: relative tolerance (of the largest output) of the numerical check of a recognised layer
#: against the fp64 reference, by the layer's dtype (a misread layer is off by O(1))
CHECK_RTOL = {"float32": 2e-4, "float64": 1e-9, "float16": 1e-2, "bfloat16": 5e-2}
CHECK_TOKENS = 16   # a symbolic token dim is given this size in the check
CHECK_ROWS = 256    # the check compares at most this many tokens with the reference


class MoEImportWarning(UserWarning):
    """An MoE-like layer left dense (not recognised, or a variant the op does not support)."""


# ---------------------------------------------------------------------------------------------
# graph helpers


class _Graph:
    """Producers, consumers and constant values of an ONNX graph."""

    def __init__(self, model: onnx.ModelProto, input_shapes=None):
        self.model = model
        self.input_shapes = dict(input_shapes or {})   # {graph input: static dims} for shape inference
        g = model.graph
        self.nodes = list(g.node)
        self.producer = {}
        self.consumers = defaultdict(list)
        for node in self.nodes:
            for o in node.output:
                if o:
                    self.producer[o] = node
            for i in node.input:
                if i:
                    self.consumers[i].append(node)
        self.consts = {t.name: t for t in g.initializer}
        self.graph_inputs = {i.name for i in g.input} - set(self.consts)
        self.outputs = {o.name for o in g.output}
        self.order = {id(n): k for k, n in enumerate(self.nodes)}
        self.by_id = {id(n): n for n in self.nodes}
        self._shapes = None

    def const(self, name):
        """The value of an initializer or a ``Constant`` node's output, else None."""
        if name in self.consts:
            return numpy_helper.to_array(self.consts[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
                if a.name in ("value_float", "value_int"):
                    return np.array(helper.get_attribute_value(a))
                if a.name in ("value_floats", "value_ints"):
                    return np.array(helper.get_attribute_value(a))
        return None

    def attr(self, node, name, default=None):
        for a in node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    def shapes(self) -> dict:
        """``{tensor: [dim]}`` from ONNX shape inference: an int, a symbolic dim's name, or None
        (unknown)."""
        if self._shapes is None:
            model = self.model
            if self.input_shapes:
                model = onnx.ModelProto()
                model.CopyFrom(self.model)
                for value in model.graph.input:
                    if value.name in self.input_shapes:
                        dims = value.type.tensor_type.shape.dim
                        for dim, size in zip(dims, self.input_shapes[value.name]):
                            dim.Clear()
                            dim.dim_value = int(size)
            try:
                inferred = onnx.shape_inference.infer_shapes(model)
            except Exception:  # noqa: BLE001 - shapes are a help, not a need
                inferred = self.model
            out, self._dtypes = {}, {}
            for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
                if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
                    self._dtypes[v.name] = v.type.tensor_type.elem_type
                if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
                    out[v.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                   for d in v.type.tensor_type.shape.dim]
            for name, t in self.consts.items():
                out[name] = list(t.dims)
            self._shapes = out
        return self._shapes

    def dtype(self, name) -> int | None:
        """The ONNX element type of ``name`` (from shape inference), else None."""
        self.shapes()
        if name in self.consts:
            return self.consts[name].data_type
        return self._dtypes.get(name)

    def back(self, name, through=_VIEW_OPS):
        """Walk ``name`` back through single-data-input view ops; returns the first tensor not
        produced by one."""
        while True:
            node = self.producer.get(name)
            if node is None or node.op_type not in through:
                return name
            name = node.input[0]

    def ancestors(self, names, stop=()) -> set:
        """Node ids of every node ``names`` depend on (not crossing the tensors in ``stop``)."""
        seen, todo = set(), list(names)
        stop = set(stop)
        while todo:
            t = todo.pop()
            if t in stop:
                continue
            node = self.producer.get(t)
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            todo.extend(i for i in node.input if i)
        return seen

    def label(self, node) -> str:
        return node.name or f"{node.op_type}->{node.output[0] if node.output else '?'}"


def _single_consumer(g: _Graph, name):
    users = g.consumers.get(name, [])
    return users[0] if len(users) == 1 and name not in g.outputs else None


# ---------------------------------------------------------------------------------------------
# expert FFN chains


@dataclasses.dataclass
class _Expert:
    fc1: onnx.NodeProto        # MatMul(A, W1)
    fc2: onnx.NodeProto        # MatMul(H, W2)
    w1: np.ndarray             # [d, f]
    w2: np.ndarray             # [f, d]
    b1: np.ndarray | None
    b2: np.ndarray | None
    activation: str
    out: str                   # the chain's output tensor (after fc2 and its bias)
    source: str                # the token tensor the chain reads (traced back through views / gathers)
    sparse: bool               # reads a gather of the tokens (form a) rather than all of them (form b)
    w3: np.ndarray | None = None   # gated (SwiGLU / GeGLU): act(x @ w1 + b1) * (x @ w3 + b3)
    b3: np.ndarray | None = None


def _activation_after(g: _Graph, name):
    """``(activation, output)`` of the elementwise activation applied to ``name`` (relu, silu as
    ``x * Sigmoid(x)``, gelu as Erf / Gelu, identity when the next node is the second MatMul)."""
    node = _single_consumer(g, name)
    if node is None:
        users = g.consumers.get(name, [])
        # silu / gelu read the pre-activation twice
        ops = sorted(u.op_type for u in users)
        if ops == ["Mul", "Sigmoid"]:
            sig = next(u for u in users if u.op_type == "Sigmoid")
            mul = next(u for u in users if u.op_type == "Mul")
            if sig.output[0] in mul.input:
                return "silu", mul.output[0]
        if ops in (["Div", "Mul"], ["Mul", "Mul"]):   # x * 0.5 * (1 + erf(x / sqrt 2)) (torch's gelu)
            for u in users:
                node = u
                for _ in range(6):
                    nxt = _single_consumer(g, node.output[0])
                    if nxt is None:
                        break
                    node = nxt
                    if node.op_type == "Mul" and name in node.input:
                        out = node.output[0]
                        after = _single_consumer(g, out)
                        if after is not None and after.op_type == "Mul" and g.const(
                                [i for i in after.input if i != out][0]) is not None:
                            out = after.output[0]
                        if any(g.by_id[i].op_type == "Erf" for i in g.ancestors([out], stop=[name])):
                            return "gelu", out
        return None
    if node.op_type == "Relu":
        return "relu", node.output[0]
    if node.op_type == "Gelu" and g.attr(node, "approximate", b"none") in (b"none", "none"):
        return "gelu", node.output[0]
    if node.op_type == "MatMul":
        return "identity", name
    return None


def _bias_after(g: _Graph, name, size):
    node = _single_consumer(g, name)
    if node is not None and node.op_type == "Add":
        other = [i for i in node.input if i != name]
        value = g.const(other[0]) if len(other) == 1 else None
        if value is not None and value.size == size and value.shape[-1:] == (size,):
            return value.reshape(size), node.output[0]
    return None, name


def _expert_at(g: _Graph, fc1) -> _Expert | None:
    """The expert FFN chain starting at the MatMul ``fc1`` (constant 2-D weight), else None."""
    w1 = g.const(fc1.input[1])
    if w1 is None or w1.ndim != 2:
        return None
    d, f = w1.shape
    b1, h = _bias_after(g, fc1.output[0], f)
    act = _activation_after(g, h)
    if act is None:
        return None
    activation, h = act
    fc2 = _single_consumer(g, h)
    w3 = b3 = None
    if fc2 is not None and fc2.op_type == "Mul" and activation in ("silu", "gelu"):
        gated = _gate_of(g, fc2, h, fc1.input[0], (d, f))
        if gated is None:
            return None
        w3, b3, h = gated
        activation = {"silu": "swiglu", "gelu": "geglu"}[activation]
        fc2 = _single_consumer(g, h)
    if fc2 is None or fc2.op_type != "MatMul" or fc2.input[0] != h:
        return None
    w2 = g.const(fc2.input[1])
    if w2 is None or w2.shape != (f, d):
        return None
    b2, out = _bias_after(g, fc2.output[0], d)
    a = g.back(fc1.input[0])
    sparse = False
    node = g.producer.get(a)
    if node is not None and node.op_type in ("Gather", "GatherND"):
        if not any(g.by_id[i].op_type == "NonZero" for i in g.ancestors([node.input[1]])):
            return None
        a, sparse = g.back(node.input[0]), True
    return _Expert(fc1, fc2, w1, w2, b1, b2, activation, out, a, sparse, w3, b3)


def _gate_of(g: _Graph, mul, act_out, tokens, shape):
    """``(w3, b3, output)`` where ``mul`` multiplies the activation ``act_out`` by a second
    projection ``tokens @ w3 (+ b3)`` of the same tokens (a gated FFN), else None."""
    other = [i for i in mul.input if i != act_out]
    if len(other) != 1:
        return None
    b3, lin = None, other[0]
    node = g.producer.get(lin)
    if node is not None and node.op_type == "Add":
        for i, j in ((0, 1), (1, 0)):
            value = g.const(node.input[j])
            if value is not None and value.size == shape[1]:
                b3, lin = value.reshape(shape[1]), node.input[i]
                break
    node = g.producer.get(lin)
    if node is None or node.op_type != "MatMul" or node.input[0] != tokens:
        return None
    w3 = g.const(node.input[1])
    if w3 is None or w3.shape != tuple(shape):
        return None
    return w3, b3, mul.output[0]


def _expert_groups(g: _Graph):
    """``[[_Expert]]``: chains of one shape, activation and form reading the same token tensor,
    at least two of them: the candidate MoE layers."""
    groups = defaultdict(list)
    for node in g.nodes:
        if node.op_type == "MatMul":
            e = _expert_at(g, node)
            if e is not None:
                key = (e.source, e.sparse, e.w1.shape, e.activation, e.b1 is None, e.b2 is None, e.b3 is None)
                groups[key].append(e)
    return [v for v in groups.values() if len(v) >= 2 and _looks_routed(g, v)]


def _looks_routed(g: _Graph, experts) -> bool:
    """Whether a group of FFN chains over one tensor looks like a mixture of experts: each reads
    a gather of the tokens (form a), or each output is scaled (``Mul``) by a weight of its own
    (form b).  Parallel FFN branches simply added are not (and are not warned about)."""
    if all(e.sparse for e in experts):
        return True
    return all(any(c.op_type == "Mul" for c in g.consumers.get(e.out, [])) for e in experts)


# ---------------------------------------------------------------------------------------------
# a recognised layer


@dataclasses.dataclass
class MoELayer:
    """What :func:`lower_moe_layers` replaces: ``output = MoE(x, router)`` with the parameters
    in the op's layout (``w1 [E, d, f]``, ``w2 [E, f, d]``)."""

    form: str
    x: str
    router: str
    output: str
    anchor: str                     # the node named in messages
    spec: dict                      # MoESpec fields
    w1: np.ndarray
    w2: np.ndarray
    b1: np.ndarray | None = None
    b2: np.ndarray | None = None
    w3: np.ndarray | None = None
    b3: np.ndarray | None = None
    per_sequence: bool = False      # capacity counted per sequence: x is [batch, sequence, d] (HF Switch)
    out_ndim: int = 0               # the output's rank (0: the token tensor's)

    def record(self, status="pit", reason=None) -> dict:
        s = self.spec
        what = (f"{self.form}: {s['num_experts']} experts, top-{s['top_k']} ({s['routing']}), "
                f"{s['activation']}" + (f", capacity {s['capacity']} (dropped tokens: {s['dropped_token']})"
                                        if s.get("capacity") is not None else ""))
        record = {"tensor": self.router, "source": f"moe:{self.router}", "status": status, "function": "moe",
                  "output": self.output, "reason": reason or f"{what}; routed-expert FFN (pit_tvm.ops.moe)"}
        if status == "pit":   # PIT's terms: one token row is the micro-tile, the token axis is permuted
            record.update(micro_tile=[1, int(self.w2.shape[2])], rule="M:SRead+SWrite")
        return record


def _router_of(g: _Graph, experts, output):
    """``(router tensor, top_k, routing, selector node)`` of the top-k / argmax node above the
    experts' masks, else a reason string."""
    inside = g.ancestors([output], stop=[experts[0].source])
    by_id = g.by_id
    selectors = [by_id[i] for i in inside if by_id[i].op_type in ("TopK", "ArgMax")]
    selectors.sort(key=lambda n: g.order[id(n)])
    if not selectors:
        return "no TopK / ArgMax router above the experts"
    sel = selectors[-1]   # the last top-k (group-limited routers have an earlier one)
    if sel.op_type == "TopK":
        k = g.const(sel.input[1])
        if k is None:
            return f"TopK {g.label(sel)}: k is not a constant"
        k = int(np.asarray(k).reshape(-1)[0])
        if g.attr(sel, "largest", 1) != 1:
            return f"TopK {g.label(sel)}: smallest-k routing is not supported"
    else:
        k = 1
        if g.attr(sel, "select_last_index", 0):
            return f"ArgMax {g.label(sel)}: select_last_index=1 is not supported"
    src = g.back(sel.input[0])
    prod = g.producer.get(src)
    if prod is not None and prod.op_type == "Softmax":
        return g.back(prod.input[0]), k, "softmax_topk", sel
    # top-k of the logits, then a softmax over the k values
    soft = [n for n in (by_id[i] for i in inside) if n.op_type == "Softmax"
            and g.back(n.input[0]) == sel.output[0]]
    if sel.op_type == "TopK" and soft:
        return src, k, "topk_softmax", sel
    return f"{sel.op_type} {g.label(sel)} reads {src!r}, not a Softmax over the experts"


def _capacity_of(g: _Graph, inside):
    """``(capacity, cumsum axis, the CumSum's input)`` of a ``CumSum`` -> ``LessOrEqual`` /
    ``Less`` constant capacity mask among the nodes ``inside``, else ``(None, None, None)``."""
    by_id = g.by_id
    for i in inside:
        node = by_id[i]
        if node.op_type != "CumSum":
            continue
        axis = g.const(node.input[1])
        for user in g.consumers.get(node.output[0], []):
            seen = user
            while seen.op_type in ("Cast",) and _single_consumer(g, seen.output[0]) is not None:
                seen = _single_consumer(g, seen.output[0])
            if seen.op_type in ("LessOrEqual", "Less") and len(seen.input) == 2:
                c = g.const(seen.input[1])
                if c is not None and c.size == 1:
                    cap = int(np.asarray(c).reshape(-1)[0]) - (1 if seen.op_type == "Less" else 0)
                    return cap, (int(np.asarray(axis).reshape(-1)[0]) if axis is not None else None), node.input[0]
    return None, None, None


def _token_signature(shape):
    """``(product of the static dims, sorted symbolic dims)`` of ``shape``; None if a dim is unknown."""
    if shape is None or any(d is None for d in shape):
        return None
    static = int(np.prod([d for d in shape if isinstance(d, int)]))
    return static, tuple(sorted(d for d in shape if isinstance(d, str)))


def _maybe_tokens(shape, d) -> bool:
    """Whether ``shape`` may be the tokens' (over symbolic dims): unknown, or ``[..., d]``"""
    return shape is None or (len(shape) >= 2 and shape[-1] == d)


def _first_common_descendant(g: _Graph, experts):
    """The first node (graph order) whose output depends on every expert chain's output and has
    as many elements as the token tensor (the combined output, not a partial one; over symbolic
    dims: ``[..., d]``, the numerical check confirms it)."""
    shapes = g.shapes()
    want = _token_signature(shapes.get(experts[0].source))
    d = experts[0].w2.shape[1]
    reach = defaultdict(set)
    for k, e in enumerate(experts):
        reach[e.out].add(k)
    full = set(range(len(experts)))
    for node in g.nodes:
        if node.op_type in ("Shape", "Size"):   # (depends on the experts' shapes, not their values)
            continue
        got = set()
        for i in node.input:
            got |= reach.get(i, set())
        if got:
            for o in node.output:
                reach[o] |= got
            if got == full and (_token_signature(shapes.get(node.output[0])) == want if want and not want[1]
                                else _maybe_tokens(shapes.get(node.output[0]), d)):
                return node
    return None


def _recognise_group(g: _Graph, experts, weight_dtype):
    """A :class:`MoELayer` (parameters read from the graph, still to be checked) or a reason."""
    combine = _first_common_descendant(g, experts)
    if combine is None:
        return "no tensor of the token tensor's shape combines every expert's output"
    output = combine.output[0]
    # the combine chain: a sum of the experts (Add chains, Sum), or the last Scatter -> Add
    found = _router_of(g, experts, output)
    if isinstance(found, str):
        return found
    router, k, routing, sel = found
    # transformers 4.x scales the combined tokens afterwards: ``router_probs * next_states``
    scale = _single_consumer(g, output)
    if scale is not None and scale.op_type == "Mul":
        other = [i for i in scale.input if i != output]
        router_node = g.producer.get(router)
        if len(other) == 1 and router_node is not None and id(router_node) in g.ancestors(
                other, stop=[experts[0].source]):
            output, combine = scale.output[0], scale
    shapes = g.shapes()
    rshape = shapes.get(router)
    n_experts = len(experts)
    if rshape is None or rshape[-1] != n_experts:  # (a symbolic or unknown dim is not E either)
        return f"router {router!r} has shape {rshape}, not [..., {n_experts}] (one logit per expert found)"
    # the experts in router column order: a chain reads column e of the mask through a constant index
    order = _expert_columns(g, experts, output)
    if isinstance(order, str):
        return order
    experts = [experts[i] for i in order]
    inside = g.ancestors([output], stop=[experts[0].source])
    capacity, axis, counted = _capacity_of(g, inside)
    per_sequence = False
    xshape = shapes.get(experts[0].source)
    cshape = shapes.get(counted)
    if capacity is not None and axis is not None and cshape is not None and -len(cshape) <= axis < len(cshape) \
            and isinstance(cshape[axis], int) and cshape[axis] <= capacity:
        # the count runs over an axis no longer than the capacity (transformers 5.17 counts over a
        # size-1 axis of the flattened tokens' one-hot [T, 1, E]): nothing is ever dropped
        capacity = None
    if capacity is not None:
        if len(rshape) == 3 and axis in (1, -2):
            # counted per sequence: x [batch, seq, d] with the router's leading dims, as the op counts it
            if xshape is None or len(xshape) != 3 or xshape[:2] != rshape[:2] or None in rshape[:2]:
                return (f"capacity counted per sequence of {router!r} {rshape}, but the tokens {experts[0].source!r} "
                        f"are {xshape}, not [batch, sequence, d] of the same batch and sequence")
            per_sequence = True
        elif not (axis in (0, -2) and len(rshape) == 2):
            return f"capacity CumSum over axis {axis} of {router!r} {rshape} not understood"
    group = rshape[1:2] if per_sequence else rshape[:-1]
    if capacity is not None and all(isinstance(v, int) for v in group) and capacity >= int(np.prod(group)):
        capacity, per_sequence = None, False   # no expert can receive more tokens than its capacity
    w1 = np.stack([e.w1 for e in experts]).astype(weight_dtype)
    w2 = np.stack([e.w2 for e in experts]).astype(weight_dtype)
    b1 = None if experts[0].b1 is None else np.stack([e.b1 for e in experts]).astype(weight_dtype)
    b2 = None if experts[0].b2 is None else np.stack([e.b2 for e in experts]).astype(weight_dtype)
    w3 = None if experts[0].w3 is None else np.stack([e.w3 for e in experts]).astype(weight_dtype)
    b3 = None if experts[0].b3 is None else np.stack([e.b3 for e in experts]).astype(weight_dtype)
    spec = {"num_experts": n_experts, "top_k": k, "routing": routing, "normalize_routing_weights": False,
            "router_input": "logits", "activation": experts[0].activation, "capacity": capacity,
            "dropped_token": "zero"}
    form = "hf_switch" if experts[0].sparse else "dense_masked"
    out_shape = shapes.get(output)
    return MoELayer(form, experts[0].source, router, output, g.label(combine), spec, w1, w2, b1, b2, w3, b3,
                    per_sequence=per_sequence, out_ndim=len(out_shape) if out_shape else 0)


def _expert_columns(g: _Graph, experts, output):
    """For each router column e, the index of the chain it selects (a constant index in the
    mask / weight selection each chain reads: ``Gather(.., e)``, ``Equal(idx, e)``, a Slice),
    else a reason (no constant at all).  Where the constants do not name one column per chain,
    the chains' graph order (the numerical check confirms or rejects it)."""
    cols = []
    for e in experts:
        region = g.ancestors([e.out], stop=[e.source]) | g.ancestors(
            [i for n in g.consumers.get(e.out, []) for i in n.input if i != e.out], stop=[e.source])
        by_id = g.by_id
        found = set()
        for i in region:
            node = by_id[i]
            if node.op_type == "Equal":
                for inp in node.input:
                    v = g.const(inp)
                    if v is not None and v.size == 1:
                        found.add(int(np.asarray(v).reshape(-1)[0]))
            elif node.op_type == "Gather" and node is not g.producer.get(e.fc1.input[0]):
                v = g.const(node.input[1])
                if v is not None and v.size == 1 and np.issubdtype(np.asarray(v).dtype, np.integer):
                    found.add(int(np.asarray(v).reshape(-1)[0]))
            elif node.op_type == "Slice":
                starts, ends = g.const(node.input[1]), g.const(node.input[2])
                if starts is not None and ends is not None and starts.size == 1 and int(ends.reshape(-1)[0]) == int(
                        starts.reshape(-1)[0]) + 1:
                    found.add(int(starts.reshape(-1)[0]))
        cols.append(found)
    n = len(experts)
    # each chain must name exactly one column not named by another chain (shared constants such as
    # a squeeze axis 0 drop out as common to all)
    common = set.intersection(*cols) if cols else set()
    own = [c - common for c in cols]
    if all(len(c) == 1 for c in own) and sorted(next(iter(c)) for c in own) == list(range(n)):
        order = [None] * n
        for k, c in enumerate(own):
            order[next(iter(c))] = k
        return order
    if all(len(c) == 0 for c in own) and all(c == common for c in cols) and len(common) == 0:
        return "cannot tell which router column each expert reads"
    # the columns are in graph order where each chain's own constants are ambiguous but distinct
    # (the numerical check confirms or rejects the order)
    return sorted(range(n), key=lambda k: g.order[id(experts[k].fc1)])


# ---------------------------------------------------------------------------------------------
# com.microsoft.MoE


def _ms_moe_layer(g: _Graph, node):
    """A :class:`MoELayer` for a ``com.microsoft.MoE`` node, a reason (recognised but not
    supported by the op: expanded dense) or raises for a node that cannot be valid."""
    from ..errors import UserError  # noqa: PLC0415
    from .frontend import UnsupportedOnnxError  # noqa: PLC0415

    label = g.label(node)
    ins = list(node.input) + [""] * (8 - len(node.input))
    names = ("input", "router_probs", "fc1_experts_weights", "fc1_experts_bias", "fc2_experts_weights",
             "fc2_experts_bias", "fc3_experts_weights", "fc3_experts_bias")
    values = {n: (g.const(i) if i else None) for n, i in zip(names, ins)}
    for n in ("fc1_experts_weights", "fc2_experts_weights"):
        if not ins[names.index(n)]:
            raise UserError(f"com.microsoft.MoE node {label!r}: input {n} is missing")
    for n in names[2:]:
        if ins[names.index(n)] and values[n] is None:
            raise UnsupportedOnnxError(f"com.microsoft.MoE node {label!r}: {n} {ins[names.index(n)]!r} is not a "
                                       "constant (the weights must be initializers)", label, "MoE")
    act = g.attr(node, "activation_type", b"relu")
    act = act.decode() if isinstance(act, bytes) else str(act)
    k = int(g.attr(node, "k", 1))
    fusion = int(g.attr(node, "swiglu_fusion", 0))
    w1t, w2t = values["fc1_experts_weights"], values["fc2_experts_weights"]
    if w1t.ndim != 3 or w2t.ndim != 3:
        raise UserError(f"com.microsoft.MoE node {label!r}: fc1 / fc2 weights must be 3-D [E, f, d] / [E, d, f], "
                        f"got {list(w1t.shape)} / {list(w2t.shape)}")
    n_experts, d, f = w2t.shape[0], w2t.shape[1], w2t.shape[2]
    shapes = g.shapes()
    rshape = shapes.get(ins[1])
    if rshape is not None and isinstance(rshape[-1], int) and rshape[-1] != n_experts:
        raise UserError(f"com.microsoft.MoE node {label!r}: router_probs {ins[1]!r} has {rshape[-1]} columns but "
                        f"there are {n_experts} experts")
    if rshape is not None and len(rshape) != 2:
        raise UserError(f"com.microsoft.MoE node {label!r}: router_probs {ins[1]!r} must be 2-D [tokens, experts], "
                        f"got shape {rshape}")
    if not 1 <= k <= n_experts:
        raise UserError(f"com.microsoft.MoE node {label!r}: k={k} must be between 1 and the {n_experts} experts")
    gated = act in ("swiglu", "geglu")
    fused = gated and fusion in (1, 2)
    if w1t.shape != (n_experts, (2 if fused else 1) * f, d):
        raise UserError(f"com.microsoft.MoE node {label!r}: fc1_experts_weights has shape {list(w1t.shape)}; with "
                        f"fc2_experts_weights {list(w2t.shape)} it must be {[n_experts, (2 if fused else 1) * f, d]}")
    b1t, b2t = values["fc1_experts_bias"], values["fc2_experts_bias"]
    w3t, b3t = values["fc3_experts_weights"], values["fc3_experts_bias"]
    if int(g.attr(node, "use_sparse_mixer", 0)):
        raise UnsupportedOnnxError(f"com.microsoft.MoE node {label!r}: use_sparse_mixer=1 (Phi-MoE's sparse mixer "
                                   "routing) is not supported", label, "MoE")
    if act not in ("relu", "gelu", "silu", "identity", "swiglu"):
        raise UnsupportedOnnxError(f"com.microsoft.MoE node {label!r}: activation_type {act!r} is not supported "
                                   "(relu, gelu, silu, identity, swiglu)", label, "MoE")
    if w3t is not None and not gated:
        raise UserError(f"com.microsoft.MoE node {label!r}: fc3_experts_weights given with activation_type "
                        f"{act!r} (only swiglu takes them)")
    if act == "gelu":
        return ("activation_type 'gelu' (onnxruntime's is the tanh approximation; the op's gelu is the exact "
                "erf form)")
    w1 = np.ascontiguousarray(np.transpose(w1t, (0, 2, 1)))   # [E, d, f*fusion]
    w2 = np.ascontiguousarray(np.transpose(w2t, (0, 2, 1)))   # [E, f, d]
    b1 = b1t
    w3 = b3 = None
    if act == "swiglu":
        alpha = float(g.attr(node, "activation_alpha", 1.0))
        beta = float(g.attr(node, "activation_beta", 0.0))
        if alpha != 1.0:
            return f"SwiGLU with activation_alpha={alpha} (x * sigmoid(alpha * x) is not SiLU)"
        if any(a.name == "swiglu_limit" for a in node.attribute):
            return "SwiGLU with swiglu_limit (clamped gate)"
        if fusion == 1:
            w1, w3 = w1[:, :, 0::2], w1[:, :, 1::2]
            if b1 is not None:
                b1, b3 = b1[:, 0::2], b1[:, 1::2]
        elif fusion == 2:
            w1, w3 = w1[:, :, :f], w1[:, :, f:]
            if b1 is not None:
                b1, b3 = b1[:, :f], b1[:, f:]
        else:
            if w3t is None:
                raise UserError(f"com.microsoft.MoE node {label!r}: swiglu_fusion=0 needs fc3_experts_weights")
            w3 = np.ascontiguousarray(np.transpose(w3t, (0, 2, 1)))
        if beta != 0.0:   # (x W3 + b3 + beta): beta is a bias
            b3 = (np.zeros((n_experts, f), w1.dtype) if b3 is None else b3) + np.asarray(beta, w1.dtype)
        w1, w3 = np.ascontiguousarray(w1), np.ascontiguousarray(w3)
        act = "swiglu"
    spec = {"num_experts": n_experts, "top_k": k, "routing": "softmax_topk",
            "normalize_routing_weights": bool(g.attr(node, "normalize_routing_weights", 0)),
            "router_input": "logits", "activation": act, "capacity": None, "dropped_token": "zero"}
    return MoELayer("com.microsoft.MoE", ins[0], ins[1], node.output[0], label, spec, w1, w2, b1, b2t, w3, b3)


def dense_moe_nodes(prefix, x, router, out, *, num_experts, top_k, normalize, activation, w1, w2,
                    b1=None, b2=None, w3=None, b3=None, alpha=1.0, beta=0.0, limit=None, mask="equal",
                    routing="softmax_topk", dtype=np.float32):
    """``(nodes, initializers)``: the dense-masked MoE in plain ONNX: every expert applied to every
    token of ``x [T, d]``, expert ``e``'s output scaled by its routing weight
    ``sum_j (idx[:, j] == e) * weight[:, j]`` (``mask="equal"``: ``Equal`` masks;
    ``"onehot"``: a ``OneHot`` of the top-k indices and a column ``Gather``), summed.  Weights in
    the op's layout (``w1 [E, d, f]``, ``w2 [E, f, d]``); ``router [T, E]`` logits; routing
    ``softmax_topk`` (softmax, top-k, optional renormalisation) or ``topk_softmax``.  Gated
    activations ``swiglu``: ``min(g, limit) * sigmoid(alpha * min(g, limit)) * (clip(l) + beta)``
    (``com.microsoft.MoE``'s form); ``gelu`` is the erf form, ``gelu_tanh`` the tanh approximation
    (``com.microsoft.MoE``'s).  The fallback of a contrib op the op does not support, and
    the builder of the dense-masked fixtures."""
    nodes, inits = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), f"{prefix}{name}"))
        return f"{prefix}{name}"

    def node(op, inputs, name, **attrs):
        nodes.append(helper.make_node(op, inputs, [f"{prefix}{name}"], name=f"{prefix}{name}", **attrs))
        return f"{prefix}{name}"

    kk = const("k", np.array([top_k], np.int64))
    if routing == "softmax_topk":
        probs = node("Softmax", [router], "probs", axis=-1)
        nodes.append(helper.make_node("TopK", [probs, kk], [f"{prefix}topv", f"{prefix}topi"], axis=-1,
                                      name=f"{prefix}topk"))
        weights = f"{prefix}topv"
        if normalize:
            total = node("ReduceSum", [weights, const("ax1", np.array([-1], np.int64))], "wsum", keepdims=1)
            weights = node("Div", [weights, total], "wnorm")
    else:
        nodes.append(helper.make_node("TopK", [router, kk], [f"{prefix}topv", f"{prefix}topi"], axis=-1,
                                      name=f"{prefix}topk"))
        weights = node("Softmax", [f"{prefix}topv"], "wsoft", axis=-1)
    idx = f"{prefix}topi"
    if mask == "onehot":
        hot = node("OneHot", [idx, const("depth", np.array(num_experts, np.int64)),
                              const("onoff", np.array([0, 1], dtype))], "onehot", axis=-1)   # [T, k, E]
        w3d = node("Unsqueeze", [weights, const("ax_1", np.array([-1], np.int64))], "w3d")
        gates = node("ReduceSum", [node("Mul", [hot, w3d], "hotw"), const("ax_k", np.array([-2], np.int64))],
                     "gates", keepdims=0)   # [T, E]
    terms = []
    for e in range(num_experts):
        if mask == "onehot":
            gate = node("Gather", [gates, const(f"e{e}", np.array([e], np.int64))], f"gate{e}", axis=1)
        else:
            hit = node("Cast", [node("Equal", [idx, const(f"e{e}", np.array(e, np.int64))], f"eq{e}")],
                       f"hit{e}", to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
            gate = node("ReduceSum", [node("Mul", [hit, weights], f"hw{e}"),
                                      const(f"axs{e}", np.array([-1], np.int64))], f"gate{e}", keepdims=1)
        h = node("MatMul", [x, const(f"w1_{e}", w1[e])], f"fc1_{e}")
        if b1 is not None:
            h = node("Add", [h, const(f"b1_{e}", b1[e])], f"fc1b_{e}")
        if activation == "relu":
            h = node("Relu", [h], f"act{e}")
        elif activation == "silu":
            h = node("Mul", [h, node("Sigmoid", [h], f"sig{e}")], f"act{e}")
        elif activation == "gelu":
            s2 = node("Div", [h, const(f"sqrt2_{e}", np.array(np.sqrt(2.0), dtype))], f"gd{e}")
            er = node("Add", [node("Erf", [s2], f"erf{e}"), const(f"one{e}", np.array(1.0, dtype))], f"ge{e}")
            h = node("Mul", [node("Mul", [h, er], f"gm{e}"), const(f"half{e}", np.array(0.5, dtype))], f"act{e}")
        elif activation == "gelu_tanh":   # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
            cube = node("Mul", [node("Mul", [h, h], f"sq{e}"), h], f"cube{e}")
            inner = node("Add", [h, node("Mul", [cube, const(f"c3_{e}", np.array(0.044715, dtype))], f"c3x{e}")],
                         f"inner{e}")
            th = node("Tanh", [node("Mul", [inner, const(f"s2pi{e}", np.array(np.sqrt(2 / np.pi), dtype))],
                                    f"targ{e}")], f"tanh{e}")
            er = node("Add", [th, const(f"one{e}", np.array(1.0, dtype))], f"ge{e}")
            h = node("Mul", [node("Mul", [h, er], f"gm{e}"), const(f"half{e}", np.array(0.5, dtype))], f"act{e}")
        elif activation == "swiglu":
            lin = node("MatMul", [x, const(f"w3_{e}", w3[e])], f"fc3_{e}")
            if b3 is not None:
                lin = node("Add", [lin, const(f"b3_{e}", b3[e])], f"fc3b_{e}")
            if limit is not None:
                h = node("Min", [h, const(f"lim{e}", np.array(limit, dtype))], f"gclip{e}")
                lin = node("Clip", [lin, const(f"nlim{e}", np.array(-limit, dtype)),
                                    const(f"plim{e}", np.array(limit, dtype))], f"lclip{e}")
            if beta:
                lin = node("Add", [lin, const(f"beta{e}", np.array(beta, dtype))], f"lb{e}")
            scaled = h if alpha == 1.0 else node("Mul", [h, const(f"alpha{e}", np.array(alpha, dtype))], f"ah{e}")
            sg = node("Sigmoid", [scaled], f"sg{e}")
            h = node("Mul", [node("Mul", [h, sg], f"glu{e}"), lin], f"act{e}")
        elif activation != "identity":
            raise ValueError(f"dense_moe_nodes: activation {activation!r} is not one of relu, silu, gelu, "
                             "gelu_tanh, swiglu, identity")
        y = node("MatMul", [h, const(f"w2_{e}", w2[e])], f"fc2_{e}")
        if b2 is not None:
            y = node("Add", [y, const(f"b2_{e}", b2[e])], f"fc2b_{e}")
        terms.append(node("Mul", [y, gate], f"y{e}"))
    nodes.append(helper.make_node("Sum", terms, [out], name=f"{prefix}sum"))
    return nodes, inits


def _expand_ms_moe(g: _Graph, node, nodes_out: list, inits_out: list):
    """The contrib node (checked by :func:`_ms_moe_layer`) as :func:`dense_moe_nodes`
    (flattening a 3-D input): its CPU kernel's semantics in plain ONNX."""
    ins = list(node.input) + [""] * (8 - len(node.input))
    get = (lambda i: g.const(ins[i]) if ins[i] else None)
    w1t, b1t, w2t, b2t, w3t, b3t = get(2), get(3), get(4), get(5), get(6), get(7)   # (constants: checked)
    act = g.attr(node, "activation_type", b"relu")
    act = act.decode() if isinstance(act, bytes) else str(act)   # (checked by _ms_moe_layer)
    n_experts, d, f = w2t.shape
    w1 = np.transpose(w1t, (0, 2, 1))
    w2 = np.transpose(w2t, (0, 2, 1))
    b1, w3, b3 = b1t, None, None
    fusion = int(g.attr(node, "swiglu_fusion", 0))
    if act == "swiglu":
        if fusion == 1:
            w1, w3 = w1[:, :, 0::2], w1[:, :, 1::2]
            b1, b3 = (None, None) if b1t is None else (b1t[:, 0::2], b1t[:, 1::2])
        elif fusion == 2:
            w1, w3 = w1[:, :, :f], w1[:, :, f:]
            b1, b3 = (None, None) if b1t is None else (b1t[:, :f], b1t[:, f:])
        else:
            w3, b3 = np.transpose(w3t, (0, 2, 1)), b3t
    limit = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "swiglu_limit"), None)
    prefix = f"{node.output[0]}__dense_"
    x2 = f"{prefix}x2"
    nodes_out.append(helper.make_node("Reshape", [ins[0], f"{prefix}flat"], [x2], name=x2))
    inits_out.append(numpy_helper.from_array(np.array([-1, d], np.int64), f"{prefix}flat"))
    y2 = f"{prefix}sum_out"
    nodes, inits = dense_moe_nodes(prefix, x2, ins[1], y2, num_experts=n_experts, top_k=int(g.attr(node, "k", 1)),
                                   normalize=bool(g.attr(node, "normalize_routing_weights", 0)),
                                   activation="gelu_tanh" if act == "gelu" else act,
                                   w1=np.ascontiguousarray(w1), w2=np.ascontiguousarray(w2), b1=b1, b2=b2t,
                                   w3=None if w3 is None else np.ascontiguousarray(w3), b3=b3,
                                   alpha=float(g.attr(node, "activation_alpha", 1.0)),
                                   beta=float(g.attr(node, "activation_beta", 0.0)), limit=limit,
                                   dtype=w2t.dtype)
    nodes_out.extend(nodes)
    inits_out.extend(inits)
    shape = f"{prefix}shape"
    nodes_out.append(helper.make_node("Shape", [ins[0]], [shape], name=shape))
    nodes_out.append(helper.make_node("Reshape", [y2, shape], [node.output[0]], name=f"{prefix}out"))


# ---------------------------------------------------------------------------------------------
# the numerical check


def _check_layer(g: _Graph, layer: MoELayer):
    """Run the layer's subgraph (from ``layer.x`` to its output and router) with onnxruntime on a
    random and a degenerate input; return the spec (candidates for what the graph leaves open)
    that :func:`~pit_tvm.ops.moe.reference_moe` matches on both, else a reason."""
    try:
        import onnxruntime as ort  # noqa: PLC0415
    except ImportError:
        return "onnxruntime is not installed (needed to check a recognised layer)"
    from ..ops.moe import MoESpec, reference_moe  # noqa: PLC0415

    inside = g.ancestors([layer.output, layer.router], stop=[layer.x])
    nodes = [n for n in g.nodes if id(n) in inside]
    produced = {o for n in nodes for o in n.output} | {layer.x}
    needed = {i for n in nodes for i in n.input if i} - produced
    external = [t for t in needed if t not in g.consts]
    if external:
        return f"the layer also reads {sorted(external)[:3]} (not only its token tensor {layer.x!r})"
    shapes = g.shapes()
    xshape = shapes.get(layer.x)
    if xshape is None or not isinstance(xshape[-1], int):
        return f"the shape of {layer.x!r} is unknown"
    if any(d is None for d in xshape):
        return f"the shape of {layer.x!r} ({xshape}) is unknown"
    xshape = [CHECK_TOKENS if isinstance(d, str) else d for d in xshape]
    elem = g.dtype(layer.x) or onnx.TensorProto.FLOAT
    np_dtype = helper.tensor_dtype_to_np_dtype(elem)
    graph = helper.make_graph(
        nodes, "moe_check", [helper.make_tensor_value_info(layer.x, elem, xshape)],
        [helper.make_tensor_value_info(layer.output, g.dtype(layer.output) or elem, None),
         helper.make_tensor_value_info(layer.router, g.dtype(layer.router) or elem, None)],
        [g.consts[t] for t in needed if t in g.consts])
    model = helper.make_model(graph, opset_imports=list(g.model.opset_import), ir_version=g.model.ir_version)
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 4   # (a failure is reported by the warning, not on stderr)
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001
        return f"onnxruntime cannot run the layer's subgraph ({type(err).__name__}: {str(err)[:200]})"
    rng = np.random.default_rng(0)
    samples = [rng.standard_normal(xshape).astype(np_dtype)]
    same = np.broadcast_to(samples[0].reshape(-1, xshape[-1])[:1], (int(np.prod(xshape[:-1])), xshape[-1]))
    samples.append(np.ascontiguousarray(same.reshape(xshape)))   # every token alike: one expert takes them all
    runs = []
    for x in samples:
        try:
            y, router = session.run(None, {layer.x: x})
        except Exception as err:  # noqa: BLE001
            hint = ("; it runs on random tokens but not when every token goes to one expert: the export's "
                    "expert loop depends on the input it was traced with (e.g. transformers' loop over the "
                    "experts hit, `expert_hit`): export with a loop over every expert" if runs else "")
            return f"onnxruntime failed on the layer's subgraph ({type(err).__name__}: {str(err)[:160]}){hint}"
        runs.append((x, router, y))
    candidates = [dict(layer.spec)]
    if layer.spec["routing"] == "softmax_topk":   # (with k = 1 too: every weight 1)
        candidates += [dict(c, normalize_routing_weights=True) for c in candidates]
    if layer.spec.get("capacity") is not None:
        candidates += [dict(c, dropped_token="input_scaled") for c in candidates]
    errors = []
    for cand in candidates:
        spec = MoESpec(**cand)
        worst = 0.0
        for x, router, y in runs:
            if y.size != x.size:
                worst = np.inf
                break
            want, got = _reference(reference_moe, x, router, y, layer, spec)
            scale = max(1.0, float(np.abs(want).max()))
            worst = max(worst, float(np.abs(want - got).max()) / scale)
        if worst <= CHECK_RTOL.get(str(np.dtype(np_dtype)), 1e-2):
            return cand
        errors.append(worst)
    return (f"the layer's output does not match the MoE read from the graph ({layer.spec['num_experts']} experts, "
            f"top-{layer.spec['top_k']} {layer.spec['routing']}, {layer.spec['activation']}; max relative error "
            f"{min(errors):.2e})")


def _reference(reference_moe, x, router, y, layer: MoELayer, spec):
    """``(reference, y)`` over a prefix of the tokens (of each sequence where the capacity is
    counted per sequence): ``reference_moe`` (fp64, a loop over tokens) of at most
    :data:`CHECK_ROWS` tokens, and the same rows of the layer's output ``y``.  A prefix is enough:
    a token's output depends on itself and, through the capacity, on the tokens before it."""
    d = x.shape[-1]
    f64 = (lambda a: None if a is None else np.asarray(a, np.float64))
    n_experts = router.shape[-1]
    if layer.per_sequence:
        batch, seq = x.shape[0], x.shape[1]
        rows, keep = min(seq, CHECK_ROWS), max(1, min(batch, CHECK_ROWS // min(seq, CHECK_ROWS)))
        xs = x[:keep, :rows]
        rs = router.reshape(batch, seq, n_experts)[:keep, :rows].reshape(-1, n_experts)
        got = y.reshape(batch, seq, d)[:keep, :rows].reshape(-1, d)
    else:
        rows = min(x.size // d, CHECK_ROWS)
        xs, rs, got = x.reshape(-1, d)[:rows], router.reshape(-1, n_experts)[:rows], y.reshape(-1, d)[:rows]
    want = reference_moe(f64(xs), f64(rs), f64(layer.w1), f64(layer.w2), spec, b1=f64(layer.b1), b2=f64(layer.b2),
                         w3=f64(layer.w3), b3=f64(layer.b3))
    return want.reshape(-1, d), got.astype(np.float64)


def _op_refuses(g: _Graph, layer: MoELayer, target):
    """Why ``emit_moe`` refuses the layer (a dry run on its shapes and dtype), else None."""
    try:
        from tvm import relax  # noqa: PLC0415

        from ..ops.moe import MoESpec, emit_moe  # noqa: PLC0415
    except ImportError as err:
        return f"the MoE op is not available ({err})"
    spec = MoESpec(**layer.spec)
    dtype = str(helper.tensor_dtype_to_np_dtype(g.dtype(layer.x) or onnx.TensorProto.FLOAT))
    rdtype = str(helper.tensor_dtype_to_np_dtype(g.dtype(layer.router) or onnx.TensorProto.FLOAT))
    d = layer.w2.shape[2]
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([CHECK_TOKENS, d], dtype))
    r = relax.Var("r", relax.TensorType([CHECK_TOKENS, layer.spec["num_experts"]], rdtype))
    try:
        with bb.function("probe", [x, r]):
            with bb.dataflow():
                y = emit_moe(bb, x, r, *_weights(layer, dtype), spec, **_optional(layer, dtype), target=target)
                out = bb.emit_output(y)
            bb.emit_func_output(out)
    except Exception as err:  # noqa: BLE001 - any refusal: the layer stays dense
        return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return None


def _weights(layer: MoELayer, dtype):
    from tvm import relax  # noqa: PLC0415

    return relax.const(layer.w1.astype(dtype)), relax.const(layer.w2.astype(dtype))


def _optional(layer: MoELayer, dtype):
    from tvm import relax  # noqa: PLC0415

    return {k: relax.const(getattr(layer, k).astype(dtype)) for k in ("b1", "b2", "w3", "b3")
            if getattr(layer, k) is not None}


# ---------------------------------------------------------------------------------------------
# the rewrite


def _moe_node(layer: MoELayer, inits: list, tuning_log=None):
    """The ``PitMoE`` node replacing ``layer`` (its weights as new initializers; ``tuning_log``,
    where given, as the ``tuning_log`` attribute :func:`convert_pit_moe` passes to the op)."""
    prefix = f"{layer.output}__moe_"
    names = []
    for k in ("w1", "w2", "b1", "b2", "w3", "b3"):
        value = getattr(layer, k)
        if value is None:
            names.append("")
        else:
            inits.append(numpy_helper.from_array(np.ascontiguousarray(value), prefix + k))
            names.append(prefix + k)
    while names and not names[-1]:
        names.pop()
    s = layer.spec
    attrs = dict(num_experts=s["num_experts"], top_k=s["top_k"], routing=s["routing"],
                 normalize_routing_weights=int(bool(s["normalize_routing_weights"])), router_input=s["router_input"],
                 activation=s["activation"], capacity=-1 if s.get("capacity") is None else int(s["capacity"]),
                 dropped_token=s["dropped_token"], per_sequence=int(layer.per_sequence), form=layer.form,
                 out_ndim=layer.out_ndim)
    if tuning_log is not None:
        attrs["tuning_log"] = os.fspath(tuning_log)
    return helper.make_node(PIT_MOE_OP, [layer.x, layer.router, *names], [layer.output],
                            name=f"{prefix}node", domain=PIT_DOMAIN, **attrs)


def lower_moe_layers(model: onnx.ModelProto, target="llvm", *, check: bool = True, shapes=None, tuning_log=None):
    """``(model, records)``: ``model`` with each recognised MoE layer replaced by one ``PitMoE``
    node (``com.microsoft.MoE`` the op cannot take expanded into plain ONNX), and one annotation
    record per layer (``status`` ``pit`` or ``dense``, ``source`` ``moe:<router tensor>``).
    ``check``: verify forms (a) / (b) numerically before replacing them (see the module doc);
    ``shapes``: ``{graph input: static dims}`` fixing symbolic dims (``compile_onnx``'s ``shapes=``)
    for the shapes read and checked; ``target``: the build target (what the op is asked to take);
    ``tuning_log``: a ``pit-tvm tune --op moe`` database whose tuned tiles the layers' kernels use."""
    target = "llvm" if target is None else target
    g = _Graph(model, shapes)
    records, layers, expand = [], [], []
    for node in g.nodes:
        if node.op_type == "MoE" and node.domain == MS_DOMAIN:
            found = _ms_moe_layer(g, node)
            if isinstance(found, str):
                warnings.warn(f"com.microsoft.MoE node {g.label(node)!r}: {found} is not supported by the MoE op; "
                              "it runs dense (every expert on every token)", MoEImportWarning, stacklevel=2)
                records.append({"tensor": node.input[1], "source": f"moe:{node.input[1]}", "status": "dense",
                                "function": "moe", "output": node.output[0], "reason": f"{found}: expanded dense"})
                expand.append(node)
                continue
            why = _op_refuses(g, found, target)
            if why is not None:
                warnings.warn(f"com.microsoft.MoE node {g.label(node)!r}: the MoE op refuses it ({why}); it runs dense",
                              MoEImportWarning, stacklevel=2)
                records.append(found.record("dense", f"MoE op refused: {why}; expanded dense"))
                expand.append(node)
                continue
            layers.append(found)
    used = set()
    for experts in _expert_groups(g):
        anchor = g.label(experts[0].fc1)
        found = _recognise_group(g, experts, experts[0].w1.dtype)
        if isinstance(found, MoELayer) and found.output in used:
            continue
        if isinstance(found, MoELayer) and check:
            checked = _check_layer(g, found)
            if isinstance(checked, str):
                found = checked
            else:
                found.spec = checked
        if isinstance(found, str):
            warnings.warn(f"MoE-like layer at node {anchor!r} ({len(experts)} expert FFNs reading "
                          f"{experts[0].source!r}) not recognised: {found}; it stays dense", MoEImportWarning,
                          stacklevel=2)
            records.append({"tensor": experts[0].source, "source": "moe:?", "status": "dense", "function": "moe",
                            "output": "", "reason": f"not recognised at node {anchor!r}: {found}"})
            continue
        why = _op_refuses(g, found, target)
        if why is not None:
            warnings.warn(f"MoE layer at node {found.anchor!r} (router {found.router!r}): the MoE op refuses it "
                          f"({why}); it stays dense", MoEImportWarning, stacklevel=2)
            records.append(found.record("dense", f"MoE op refused: {why}; stays dense"))
            continue
        used.add(found.output)
        layers.append(found)
    if not layers and not expand:
        return model, records
    new_inits, new_nodes = [], []
    replaced = {layer.output: layer for layer in layers}
    for node in g.nodes:
        if node in expand:
            _expand_ms_moe(g, node, new_nodes, new_inits)
            continue
        outs = [o for o in node.output if o in replaced]
        if outs:
            layer = replaced[outs[0]]
            new_nodes.append(_moe_node(layer, new_inits, tuning_log))
            records.append(layer.record())
            continue
        new_nodes.append(node)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(_topological(_dead_code_removed(new_nodes, out.graph)))
    out.graph.initializer.extend(new_inits)
    used_names = {i for n in out.graph.node for i in n.input} | {o.name for o in out.graph.output}
    kept = [t for t in out.graph.initializer if t.name in used_names]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    if not any(op.domain == PIT_DOMAIN for op in out.opset_import):
        out.opset_import.append(helper.make_opsetid(PIT_DOMAIN, 1))
    return out, records


def _dead_code_removed(nodes, graph):
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output if o):
            kept.append(node)
            needed.update(i for i in node.input if i)
    return list(reversed(kept))


def _topological(nodes):
    """``nodes`` in an order where every tensor is produced before it is read (a ``PitMoE``
    node takes the place of its layer's last node; its router may come later in graph order)."""
    produced_by = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    done, order, state = set(), [], {}

    for start in range(len(nodes)):
        stack = [(start, False)]
        while stack:
            k, expanded = stack.pop()
            if k in done:
                continue
            if expanded:
                done.add(k)
                order.append(nodes[k])
                continue
            if state.get(k):
                continue
            state[k] = True
            stack.append((k, True))
            for i in reversed(nodes[k].input):
                p = produced_by.get(i)
                if p is not None and p not in done:
                    stack.append((p, False))
    return order


# ---------------------------------------------------------------------------------------------
# Relax


def convert_pit_moe(bb, inputs, attrs, target):
    """The ``PitMoE`` node as :func:`pit_tvm.ops.moe.emit_moe` (a capacity counted per sequence,
    as HF Switch counts it: ``x`` kept ``[batch, sequence, d]``; else ``x`` flattened to its
    tokens); the output in the token tensor's shape, or ``[T, d]`` where the layer's is 2-D."""
    from tvm import relax  # noqa: PLC0415

    from ..ops.moe import MoESpec, emit_moe  # noqa: PLC0415

    def text(v):
        return v.decode() if isinstance(v, bytes) else str(v)

    capacity = int(attrs.get("capacity", -1))
    spec = MoESpec(num_experts=int(attrs["num_experts"]), top_k=int(attrs["top_k"]), routing=text(attrs["routing"]),
                   normalize_routing_weights=bool(attrs.get("normalize_routing_weights", 0)),
                   router_input=text(attrs.get("router_input", "logits")), activation=text(attrs["activation"]),
                   capacity=None if capacity < 0 else capacity, dropped_token=text(attrs.get("dropped_token", "zero")))
    x, router, w1, w2 = inputs[0], inputs[1], inputs[2], inputs[3]
    opt = {k: (inputs[i] if len(inputs) > i else None) for i, k in ((4, "b1"), (5, "b2"), (6, "w3"), (7, "b3"))}
    opt = {k: v for k, v in opt.items() if v is not None}
    shape = list(x.ty.shape.values)
    d = shape[-1]
    n_experts = int(attrs["num_experts"])
    # (emit_moe counts a capacity per sequence: x's second-to-last axis, all tokens of a 2-D x)
    xg = x if int(attrs.get("per_sequence", 0)) else bb.normalize(relax.op.reshape(x, [-1, d]))
    r2 = bb.normalize(relax.op.reshape(router, [-1, n_experts]))
    tuning_log = text(attrs["tuning_log"]) if "tuning_log" in attrs else None
    y = bb.normalize(emit_moe(bb, xg, r2, w1, w2, spec, target=target, tuning_log=tuning_log, **opt))
    out_ndim = int(attrs.get("out_ndim", 0)) or len(shape)
    return bb.normalize(relax.op.reshape(y, [-1, d] if out_ndim == 2 else shape))
