"""Helpers shared by the tests and the benchmarks: numpy references of the PIT index, sparsity
pattern generators, small Relax / ONNX workload builders.  Importable as ``pit_tvm.testing``, so
neither tests/ nor benchmarks/ puts the other on ``sys.path``.

References and patterns: :func:`rows_index`, :func:`tile_pattern`, :func:`expand`,
:func:`tiles_inputs` (numpy dtypes of TVM names: :func:`pit_tvm.runtime.loader.numpy_dtype`).
Relax builders: :func:`legalized_cuda_module`, :func:`build_with_cuda_rules`, :func:`gemm_chain_module`.  CUDA schedules on the CPU: :func:`serial_thread_loops`,
:func:`cuda_schedules_on_cpu`.

ONNX workloads, built in code (no downloads), with symbolic batch/seq dims:

* :func:`opt_ffn` — an OPT-style FFN block ``y = x + fc2(relu(fc1(LN(x))))`` whose ReLU output
  ``hidden`` is ~90% zero with OPT's structure: a few "hot" neurons fire for most tokens, most
  neurons are silent for most tokens (strongly negative fc1 biases). After LayerNorm each
  pre-activation is ~N(bias, 1), so biases set the per-neuron firing rate exactly.
* :func:`bert_encoder` — a BERT-base-style post-LN encoder over input embeddings with an
  ``attention_mask`` [batch, seq] (1 = token, 0 = padding). Padding is the dynamic sparsity: the
  token-wise matmuls (QKV, attention output, FFN in/out) read activations multiplied by the mask,
  so padded rows are zero (outputs at padded positions are don't-care, as in BERT).

Small variants for tests: ``opt_ffn(d=64)``, ``bert_encoder(layers=2, hidden=64, heads=4)``.
"""
from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def rows_index(nonzero_rows: np.ndarray):
    """The rows-kind PIT index of a boolean row mask: ``offsets = [0, count]`` and ``ids``
    (the non-zero rows ascending, then the others ascending), as the device index kernel
    lays it out."""
    rows = np.nonzero(nonzero_rows)[0].astype(np.int32)
    ids = np.concatenate([rows, np.nonzero(~np.asarray(nonzero_rows, bool))[0]]).astype(np.int32)
    return np.array([0, len(rows)], np.int32), ids


def tiles_inputs(m, k, n, micro_tile, sparsity, in_dtype="float16", seed=0):
    """A with a fraction ``sparsity`` of zero (mr, mk) micro-tiles, B, and the row-group index
    (:func:`pit_tvm.index.tiles.reference_tile_index`)."""
    from pit_tvm.index.tiles import reference_tile_index
    from pit_tvm.runtime.loader import numpy_dtype

    mr, mk = micro_tile
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    tr, tc = -(-m // mr), k // mk
    keep = rng.random((tr, tc)) >= sparsity
    if sparsity >= 1.0:
        keep[:] = False
    elif sparsity <= 0.0:
        keep[:] = True
    mask = np.repeat(np.repeat(keep, mr, 0), mk, 1)[:m]
    a = a * mask
    b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    dt = numpy_dtype(in_dtype)
    a, b = a.astype(dt), b.astype(dt)
    offsets, ids = reference_tile_index(a.astype(np.float32), micro_tile, "row")
    return a, b, offsets, ids


def legalized_cuda_module(build_fn, *shapes, dtype="float16"):
    """A Relax module of one operator ``build_fn(*params)``, legalized and fused for CUDA: the
    PrimFunc a dlight rule sees in a model. Returns ``(module, its PrimFunc)``."""
    import tvm
    from tvm import relax, tirx

    from pit_tvm.target import make_target

    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType(s, dtype)) for i, s in enumerate(shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(build_fn(*params))
        bb.emit_func_output(out)
    with make_target("cuda"):
        mod = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                        relax.transform.FuseOps(), relax.transform.FuseTIR()])(bb.get())
    prim = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)][0]
    return mod, prim


def build_with_cuda_rules(mod):
    """``mod`` scheduled by pit_tvm's CUDA dlight rules and built."""
    from tvm.s_tir import dlight as dl

    from pit_tvm.target import build, cuda_schedule_rules, make_target

    cuda = make_target("cuda")
    with cuda:
        mod = dl.ApplyDefaultSchedule(*cuda_schedule_rules())(mod)
    return build(mod, cuda)


def _thread_binding_calls(src: str):
    """``(start, end, extent)`` of each ``T.thread_binding(extent, thread=..., ...)`` in TVMScript
    ``src`` (the extent may hold parentheses and the annotations a dict, so a scan, not a regex)."""
    head = "T.thread_binding("
    pos = src.find(head)
    while pos >= 0:
        depth, i, comma = 1, pos + len(head), None
        while depth:
            ch = src[i]
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            elif ch == "," and depth == 1 and comma is None:
                comma = i
            i += 1
        yield pos, i, src[pos + len(head):comma]
        pos = src.find(head, i)


def _shared_written_and_read_in_one_thread_loop(func) -> str | None:
    """The name of a shared buffer that one ``threadIdx`` loop of ``func`` writes in its own body
    (not in a nested thread loop, which covers the whole tile when run serially) and reads in
    another statement of it (a tiled GEMM whose threads each load part of the tile, meet at a
    barrier, then read all of it), else None: run serially, the first thread would read what
    the others have not written yet.  A read in the statement that writes the buffer (a tree
    reduction's step ``s[t] = s[t] + s[t + h]``) runs right serially and does not count."""
    import tvm_ffi
    from tvm import ir, tirx
    from tvm_ffi.structural import WalkResult

    def is_thread_loop(node):
        return (isinstance(node, tirx.For) and node.thread_binding is not None
                and str(node.thread_binding.thread_tag).startswith("threadIdx"))

    def shared_name(buffer):
        return buffer.name if str(buffer.scope()).startswith("shared") else None

    def loads(node, skip=None):
        found = set()
        tvm_ffi.structural_walk(node, (ir.TensorLoad, lambda n: found.add(shared_name(n.source))
                                       if not (skip is not None and n.source.same_as(skip)) else None))
        return found - {None}

    loops = []
    tvm_ffi.structural_walk(func.body, (tirx.For, lambda f: loops.append(f) if is_thread_loop(f) else None))
    for loop in loops:
        stored, loaded = set(), set()

        def visit(node):
            if is_thread_loop(node):                # a nested thread loop: its reads only
                loaded.update(loads(node.body))
                return WalkResult.SKIP
            if isinstance(node, tirx.BufferStore):
                if shared_name(node.buffer):
                    stored.add(node.buffer.name)
                loaded.update(loads(node.value, skip=node.buffer), *(loads(i) for i in node.indices))
                return WalkResult.SKIP
            if isinstance(node, ir.TensorLoad):
                loaded.update(loads(node))
                return WalkResult.SKIP
            return WalkResult.ADVANCE

        tvm_ffi.structural_walk(loop.body, visit, order="pre")
        if stored & loaded:
            return sorted(stored & loaded)[0]
    return None


def serial_thread_loops(func):
    """``func`` (a GPU-scheduled s_tir PrimFunc) with every ``blockIdx`` / ``threadIdx`` / vthread
    loop serial and its shared buffers global, so that it builds and runs for llvm: the schedule's
    loop bounds, predicates and indexing checked on the CPU.  Only for kernels whose threads meet
    only between sibling thread loops and keep no per-thread buffer unindexed by the thread across
    them (dlight schedules, the PIT index and generic attention kernels); a kernel with explicit
    barriers, or whose threads meet inside one thread loop (a shared tile written and read there:
    a tiled GEMM), is refused.  What the CUDA lowering adds (barriers, warp shuffles, vector types) it
    cannot see: a kernel that matches here can still race on the GPU."""
    import tvm

    src = func.script()
    if "T.launch_thread" in src or "T.env_thread" in src or "tvm_storage_sync" in src:
        raise ValueError("serial_thread_loops: the PrimFunc binds threads outside thread_binding loops or "
                         "synchronises them explicitly; only thread_binding loops can run serially")
    shared = _shared_written_and_read_in_one_thread_loop(func)
    if shared is not None:
        raise ValueError(f"serial_thread_loops: one threadIdx loop both writes and reads shared buffer {shared!r} "
                         "(its threads meet at a barrier inside the loop); it cannot run serially")
    out, last = [], 0
    for start, end, extent in _thread_binding_calls(src):
        out += [src[last:start], f"T.serial({extent})"]
        last = end
    src = "".join(out) + src[last:]
    src = src.replace('scope="shared.dyn"', 'scope="global"').replace('scope="shared"', 'scope="global"')
    src = src.replace("T.alloc_shared(", "T.alloc_buffer(")
    return tvm.script.from_source(src)


def cuda_schedules_on_cpu(mod):
    """A Relax VM executable for llvm of ``mod`` (a module as given to the CUDA build, e.g.
    ``compile_onnx(..., target="cuda").lowered``) whose every PrimFunc is the one the CUDA build
    schedules (:func:`pit_tvm.target.cuda_schedule_passes`), its thread loops serial
    (:func:`serial_thread_loops`): the CUDA build's schedules run on the CPU."""
    import tvm
    from tvm import tirx
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    from pit_tvm.target import cuda_schedule_passes, make_target

    cuda, llvm = make_target("cuda"), make_target("llvm")
    with cuda, tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential(cuda_schedule_passes(cuda))(mod)
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc):
            serial = serial_thread_loops(func)
            mod[gv] = serial.with_attr("global_symbol", gv.name_hint) if "global_symbol" in (func.attrs or {}) else serial
    lower = tvm.transform.Sequential(cpu.dataflow_lower_passes(llvm) + cpu.finalize_passes(llvm))
    with llvm, tvm.transform.PassContext(opt_level=3):
        return tvm.compile(mod, target=llvm, relax_pipeline=lower)


def tile_pattern(m: int, k: int, micro_tile, sparsity: float, rng) -> np.ndarray:
    """Boolean grid ``(ceil(m/mr), ceil(k/mk))`` with exactly ``round((1-s)·T)`` non-zero micro-tiles."""
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity}")
    mr, mk = micro_tile
    shape = (-(-m // mr), -(-k // mk))
    total = shape[0] * shape[1]
    nnz = int(round((1.0 - sparsity) * total))
    grid = np.zeros(total, bool)
    grid[rng.choice(total, size=nnz, replace=False)] = True
    return grid.reshape(shape)


def expand(grid, micro_tile, shape):
    """Element mask of a micro-tile grid (numpy or torch), cropped to ``shape``."""
    mr, mk = micro_tile
    if isinstance(grid, np.ndarray):
        full = np.repeat(np.repeat(grid, mr, axis=0), mk, axis=1)
    else:
        full = grid.repeat_interleave(mr, 0).repeat_interleave(mk, 1)
    return full[: shape[0], : shape[1]]


def gemm_chain_module(m: int, widths, kernel_of):
    """A Relax module whose ``main(x, w_0, w_1, ...)`` is ``x @ w_0 @ w_1 ...`` in fp16, each
    step one ``call_tir`` of ``kernel_of(k, n)`` (a dense GEMM PrimFunc), ``x`` of ``m x
    widths[0]`` and ``w_i`` of ``widths[i] x widths[i + 1]``: back-to-back launches, each
    reading the one before's output."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, widths[0]), "float16"))
    ws = [relax.Var(f"w{i}", relax.TensorType((k, n), "float16")) for i, (k, n) in enumerate(zip(widths, widths[1:]))]
    with bb.function("main", [x] + ws):
        with bb.dataflow():
            h = x
            for w, (k, n) in zip(ws, zip(widths, widths[1:])):
                gv = bb.add_func(kernel_of(k, n).with_attr("global_symbol", f"gemm_{k}_{n}"), f"gemm_{k}_{n}")
                h = bb.emit(relax.call_tir(gv, [h, w], relax.TensorType((m, n), "float16")))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return bb.get()


class _Graph:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self._n = [], [], 0

    def const(self, name, array):
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(self, op, inputs, output=None, **attrs):
        self._n += 1
        output = output or f"{op.lower()}_{self._n}"
        self.nodes.append(helper.make_node(op, inputs, [output], **attrs))
        return output

    def linear(self, x, w, b, output=None):
        return self.node("Add", [self.node("MatMul", [x, w]), b], output)

    def layer_norm(self, x, d, prefix, output=None):
        g = self.const(f"{prefix}.gamma", np.ones(d, "float32"))
        b = self.const(f"{prefix}.beta", np.zeros(d, "float32"))
        return self.node("LayerNormalization", [x, g, b], output, axis=-1, epsilon=1e-5)

    def model(self, name, inputs, outputs):
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        onnx.checker.check_model(model)
        return model


def ffn_firing_rates(hidden: int, sparsity: float = 0.9, hot_fraction: float = 0.1, hot_rate: float = 0.99,
                     rng=None) -> np.ndarray:
    """Each hidden neuron's probability of a non-zero ReLU output, OPT's structure: ``hot_fraction``
    of the neurons (chosen by ``rng``) fire for ``hot_rate`` of the tokens, the rest at the rate
    that leaves ~``sparsity`` zeros in all."""
    rng = rng or np.random.default_rng(0)
    n_hot = max(1, int(round(hot_fraction * hidden)))
    cold_rate = max(1e-4, ((1.0 - sparsity) * hidden - hot_rate * n_hot) / (hidden - n_hot))
    rates = np.full(hidden, cold_rate)
    rates[rng.permutation(hidden)[:n_hot]] = hot_rate
    return rates


def ffn_biases(hidden: int, sparsity: float = 0.9, hot_fraction: float = 0.1, hot_rate: float = 0.99,
               rng=None) -> np.ndarray:
    """fc1 biases giving the :func:`ffn_firing_rates` for ~N(bias, 1) pre-activations:
    ``P(N(b, 1) > 0) = rate``."""
    rates = ffn_firing_rates(hidden, sparsity, hot_fraction, hot_rate, rng)
    return np.vectorize(NormalDist().inv_cdf)(rates).astype("float32")


def opt_ffn(d: int = 2048, hidden: int | None = None, sparsity: float = 0.9, *, seed: int = 0,
            batch="batch", seq="seq") -> onnx.ModelProto:
    """OPT FFN block on ``x`` [batch, seq, d] -> ``y``; the ReLU output is named ``hidden``."""
    hidden = hidden or 4 * d
    g = _Graph(seed)
    w1 = g.const("fc1.weight", (g.rng.standard_normal((d, hidden)) / math.sqrt(d)).astype("float32"))
    b1 = g.const("fc1.bias", ffn_biases(hidden, sparsity, rng=g.rng))
    w2 = g.const("fc2.weight", (g.rng.standard_normal((hidden, d)) / math.sqrt(hidden)).astype("float32"))
    b2 = g.const("fc2.bias", (0.02 * g.rng.standard_normal(d)).astype("float32"))
    ln = g.layer_norm("x", d, "final_layer_norm", "ln")
    h = g.node("Relu", [g.linear(ln, w1, b1, "fc1_out")], "hidden")
    out = g.linear(h, w2, b2, "fc2_out")
    g.node("Add", ["x", out], "y")
    return g.model(
        "opt_ffn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, d])],
    )


def opt_ffn_inputs(d: int = 2048, batch: int = 2, seq: int = 16, seed: int = 1) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal((batch, seq, d)).astype("float32")}


def bert_encoder(layers: int = 12, hidden: int = 768, heads: int = 12, ffn: int | None = None, *,
                 seed: int = 0, batch="batch", seq="seq") -> onnx.ModelProto:
    """BERT-style encoder: ``input_embeds`` [batch, seq, hidden], ``attention_mask`` [batch, seq]
    (int64) -> ``last_hidden_state``. Layer ``i``'s masked FFN activation is ``l{i}.ffn_act``."""
    ffn = ffn or 4 * hidden
    dh = hidden // heads
    assert dh * heads == hidden, "hidden must be divisible by heads"
    g = _Graph(seed)

    def w(name, shape, std=0.02):
        return g.const(name, (std * g.rng.standard_normal(shape)).astype("float32"))

    axes1 = g.const("axes_last", np.array([2], "int64"))
    axes12 = g.const("axes_12", np.array([1, 2], "int64"))
    split_shape = g.const("shape_split", np.array([0, 0, heads, dh], "int64"))
    merge_shape = g.const("shape_merge", np.array([0, 0, hidden], "int64"))
    one = g.const("one", np.array(1.0, "float32"))
    neg = g.const("neg_big", np.array(-10000.0, "float32"))
    scale = g.const("attn_scale", np.array(1.0 / math.sqrt(dh), "float32"))
    half = g.const("half", np.array(0.5, "float32"))
    rsqrt2 = g.const("rsqrt2", np.array(1.0 / math.sqrt(2.0), "float32"))

    maskf = g.node("Cast", ["attention_mask"], "mask_f", to=TensorProto.FLOAT)
    rows = g.node("Unsqueeze", [maskf, axes1], "row_mask")  # [B, S, 1]
    add_mask = g.node("Mul", [g.node("Sub", [one, g.node("Unsqueeze", [maskf, axes12])]), neg],
                      "additive_mask")  # [B, 1, 1, S]

    def heads_of(x):
        return g.node("Transpose", [g.node("Reshape", [x, split_shape])], perm=[0, 2, 1, 3])

    h = "input_embeds"
    for i in range(layers):
        p = f"l{i}"
        hm = g.node("Mul", [h, rows], f"{p}.masked_in")
        q = heads_of(g.linear(hm, w(f"{p}.q.w", (hidden, hidden)), w(f"{p}.q.b", hidden)))
        k = heads_of(g.linear(hm, w(f"{p}.k.w", (hidden, hidden)), w(f"{p}.k.b", hidden)))
        v = heads_of(g.linear(hm, w(f"{p}.v.w", (hidden, hidden)), w(f"{p}.v.b", hidden)))
        kt = g.node("Transpose", [k], perm=[0, 1, 3, 2])
        scores = g.node("Add", [g.node("Mul", [g.node("MatMul", [q, kt]), scale]), add_mask])
        probs = g.node("Softmax", [scores], axis=-1)
        ctx = g.node("Transpose", [g.node("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        ctx = g.node("Mul", [g.node("Reshape", [ctx, merge_shape]), rows], f"{p}.ctx")
        attn = g.linear(ctx, w(f"{p}.o.w", (hidden, hidden)), w(f"{p}.o.b", hidden))
        h1 = g.layer_norm(g.node("Add", [h, attn]), hidden, f"{p}.ln1")
        h1m = g.node("Mul", [h1, rows], f"{p}.ffn_in")
        pre = g.linear(h1m, w(f"{p}.fc1.w", (hidden, ffn)), w(f"{p}.fc1.b", ffn))
        gelu = g.node("Mul", [g.node("Mul", [pre, half]),
                              g.node("Add", [one, g.node("Erf", [g.node("Mul", [pre, rsqrt2])])])])
        act = g.node("Mul", [gelu, rows], f"{p}.ffn_act")
        out = g.linear(act, w(f"{p}.fc2.w", (ffn, hidden)), w(f"{p}.fc2.b", hidden))
        h = g.layer_norm(g.node("Add", [h1, out]), hidden, f"{p}.ln2",
                         "last_hidden_state" if i == layers - 1 else f"{p}.out")
    return g.model(
        "bert_encoder",
        [helper.make_tensor_value_info("input_embeds", TensorProto.FLOAT, [batch, seq, hidden]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [batch, seq])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, [batch, seq, hidden])],
    )


def bert_inputs(hidden: int = 768, batch: int = 2, seq: int = 16, lengths=None, seed: int = 1) -> dict:
    """Random embeddings and a padding mask (``lengths`` per sequence; default random in [1, seq])."""
    rng = np.random.default_rng(seed)
    if lengths is None:
        lengths = rng.integers(1, seq + 1, size=batch)
    mask = (np.arange(seq)[None, :] < np.asarray(lengths)[:, None]).astype("int64")
    return {"input_embeds": rng.standard_normal((batch, seq, hidden)).astype("float32"),
            "attention_mask": mask}


def with_outputs(model: onnx.ModelProto, names) -> onnx.ModelProto:
    """A copy of ``model`` that also outputs the intermediate tensors ``names`` (for checks)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for n in names:
        m.graph.output.append(helper.make_empty_tensor_value_info(n))
    return m


_INTEGER_TYPES = frozenset({TensorProto.BOOL, TensorProto.INT8, TensorProto.INT16, TensorProto.INT32,
                            TensorProto.INT64, TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32,
                            TensorProto.UINT64})


def _subgraph_inputs(node: onnx.NodeProto) -> set[str]:
    """Names read by the nodes of ``node``'s subgraphs (If / Loop / Scan bodies), recursively."""
    names = set()
    for a in node.attribute:
        for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            for n in sub.node:
                names.update(n.input)
                names |= _subgraph_inputs(n)
    return names


def _element_types(model: onnx.ModelProto) -> dict[str, int] | None:
    """Element types of ``model``'s tensors by ONNX shape inference (0: unknown), ``None`` if it
    fails.  Inferred on a copy whose large initializers are graph inputs of the same type and
    shape: the weights' values decide no types, and copying them would cost seconds."""
    g = model.graph
    lite = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import,
                           functions=model.functions)
    lite.graph.node.extend(g.node)
    lite.graph.input.extend(g.input)
    lite.graph.output.extend(g.output)
    lite.graph.value_info.extend(g.value_info)
    lite.graph.sparse_initializer.extend(g.sparse_initializer)
    inputs = {i.name for i in g.input}
    for t in g.initializer:
        if math.prod(t.dims) <= 1024:
            lite.graph.initializer.append(t)
        elif t.name not in inputs:
            lite.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    try:
        graph = onnx.shape_inference.infer_shapes(lite).graph
    except (onnx.shape_inference.InferenceError, ValueError):
        return None
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in (*graph.input, *graph.output, *graph.value_info) if vi.type.HasField("tensor_type")}
    types.update((t.name, t.data_type) for t in g.initializer)
    return types


def _float32_islands(model: onnx.ModelProto) -> tuple[set[int], set[str]]:
    """The integer islands of ``model`` that :func:`to_float16` keeps in float32: (indices of
    their nodes in ``model.graph.node``, the names of their float32 tensors and constants).

    An island starts at a ``Cast(to=FLOAT)`` of an integer or bool tensor and takes every node that
    reads one of its float32 tensors, whose float32 outputs join it in turn.  It is kept when every
    float32 input of its nodes is its own tensor, an initializer or the output of a ``Constant`` /
    ``ConstantOfShape`` node, those constants are read only by kept islands, and each output of its
    nodes is float32 (inside the island) or integer / bool (an exit, e.g. ``Cast(to=INT64)``): no
    float32 tensor of it is a graph output, read by a subgraph, or of a type shape inference could
    not determine."""
    types = _element_types(model)
    if types is None:
        return set(), set()
    nodes = model.graph.node
    constants = {t.name for t in model.graph.initializer}
    constant_node = {n.output[0]: i for i, n in enumerate(nodes)
                     if n.op_type in ("Constant", "ConstantOfShape") and n.output}
    graph_outputs = {o.name for o in model.graph.output}
    readers: dict[str, set[int]] = {}

    parent: dict[int, int] = {}             # union-find over islands, named by a node of theirs

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    island_of: dict[str, int] = {}          # float32 tensor -> its island (any member, see root)
    members: dict[int, set[int]] = {}       # root -> nodes; emptied once rejected
    island_constants: dict[int, set[str]] = {}
    rejected: set[int] = set()
    for i, node in enumerate(nodes):
        inputs = [x for x in node.input if x]
        implicit = _subgraph_inputs(node)
        for x in (*inputs, *implicit):
            readers.setdefault(x, set()).add(i)
        touched = {root(island_of[x]) for x in (*inputs, *implicit) if x in island_of}
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        seed = (node.op_type == "Cast" and to == TensorProto.FLOAT and inputs
                and types.get(inputs[0]) in _INTEGER_TYPES)
        if touched:                         # a node reading several islands joins them
            r = max(touched, key=lambda t: len(members[t]))
            for t in touched - {r}:
                parent[t] = r
                members[r] |= members.pop(t)
                island_constants[r] |= island_constants.pop(t)
                if t in rejected:
                    rejected.add(r)
        elif seed:
            r = parent[i] = i
            members[r], island_constants[r] = set(), set()
        else:
            continue
        members[r].add(i)
        ok = not implicit.intersection(island_of)
        for x in inputs:
            if x not in island_of and types.get(x) == TensorProto.FLOAT:
                ok = ok and (x in constants or x in constant_node)
                island_constants[r].add(x)
            ok = ok and bool(types.get(x))  # 0 / missing: unknown element type
        for o in node.output:
            if not o:
                continue
            if types.get(o) == TensorProto.FLOAT:
                island_of[o] = r
                ok = ok and o not in graph_outputs
            else:
                ok = ok and types.get(o) in _INTEGER_TYPES
        if not ok:
            rejected.add(r)
        if r in rejected:                   # it converts as before: forget its nodes
            members[r].clear()
            island_constants[r].clear()

    kept = {r for r in members if r not in rejected}
    while True:                             # constants read outside the kept islands reject theirs
        kept_nodes = set().union(*(members[r] for r in kept))
        shared = {r for r in kept for c in island_constants[r]
                  if readers.get(c, set()) - kept_nodes or c in graph_outputs}
        if not shared:
            break
        kept -= shared
    keep_nodes, keep_tensors = set(), set()
    for r in kept:
        keep_nodes |= members[r]
        keep_tensors |= island_constants[r]
        keep_nodes.update(constant_node[c] for c in island_constants[r] if c in constant_node)
    keep_tensors.update(x for x, r in island_of.items() if root(r) in kept)
    return keep_nodes, keep_tensors


def to_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """A float16 copy of ``model``: float32 initializers, ``Constant`` / ``ConstantOfShape`` values,
    graph inputs/outputs and ``Cast(to=FLOAT)`` become float16 (integer inputs such as
    ``attention_mask`` stay as they are).  Values beyond float16's range are clamped to it (an
    exported mask's ``finfo(float32).min`` becomes -65504, not -inf, whose product with 0 is NaN).

    Integer islands stay float32 (see :func:`_float32_islands`): float arithmetic between a cast
    from and a cast back to integers, such as T5's relative-position buckets
    (``int64(log(d / 8) / log(16) * 8)``, which transformers computes in float32 on purpose).  In
    float16 such a result can land just below an integer and floor to the wrong bucket."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    keep_nodes, keep_tensors = _float32_islands(model)
    limit = float(np.finfo(np.float16).max)

    def half(t):
        arr = np.clip(numpy_helper.to_array(t), -limit, limit).astype(np.float16)
        return numpy_helper.from_array(arr, t.name)

    for i, t in enumerate(g.initializer):
        if t.data_type == TensorProto.FLOAT and t.name not in keep_tensors:
            g.initializer[i].CopyFrom(half(t))
    for i, node in enumerate(g.node):
        if node.op_type in ("Constant", "ConstantOfShape") and i not in keep_nodes:
            for a in node.attribute:
                if a.name == "value" and a.t.data_type == TensorProto.FLOAT:
                    a.t.CopyFrom(half(a.t))
                elif a.name in ("value_float", "value_floats"):   # -> a float16 tensor
                    values = np.array(a.f if a.name == "value_float" else list(a.floats), np.float32)
                    a.CopyFrom(onnx.helper.make_attribute("value", half(numpy_helper.from_array(values))))
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT and vi.name not in keep_tensors:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    for i, node in enumerate(g.node):
        for a in node.attribute:
            if a.name == "to" and a.i == TensorProto.FLOAT and i not in keep_nodes:
                a.i = TensorProto.FLOAT16
    onnx.checker.check_model(m)
    return m
