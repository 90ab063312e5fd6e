"""Importing attention with a run-time mask (issue 36): ``softmax(Q K^T * scale + M) V`` and its
``Where`` form, M computed from graph inputs, lowered to block-sparse attention by
``compile_onnx``; checked against onnxruntime on small fixtures built with ``onnx.helper``."""
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import pit_tvm
from pit_tvm.errors import UserError

ort = pytest.importorskip("onnxruntime")

B, H, S, D, W = 2, 2, 80, 16, 6
HIDDEN = H * D


def _model(nodes, inputs, initializers=(), out_type=TensorProto.FLOAT, out_shape=(B, S, HIDDEN)):
    graph = helper.make_graph(nodes, "attention", inputs, [helper.make_tensor_value_info("out", out_type, out_shape)],
                              initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _heads(name, src, nodes):
    """``src [B, S, HIDDEN]`` -> ``name [B, H, S, D]``"""
    nodes += [helper.make_node("Reshape", [src, "heads_shape"], [name + "_r"]),
              helper.make_node("Transpose", [name + "_r"], [name], perm=[0, 2, 1, 3])]


def longformer_style_model(form="additive", dtype=np.float32):
    """x [B, S, HIDDEN] and global_flags [B, S] int32 -> self-attention whose mask allows the
    +-W window, the global rows and the global columns (computed from global_flags each call)."""
    rng = np.random.default_rng(0)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    band = np.abs(np.arange(S)[:, None] - np.arange(S)[None, :]) <= W
    inits = [numpy_helper.from_array((rng.standard_normal((HIDDEN, HIDDEN)) * 0.3).astype(dtype), n)
             for n in ("wq", "wk", "wv")]
    inits += [numpy_helper.from_array(np.array([B, S, H, D], np.int64), "heads_shape"),
              numpy_helper.from_array(np.array([B, S, HIDDEN], np.int64), "out_shape"),
              numpy_helper.from_array(band, "band"),
              numpy_helper.from_array(np.array(1 / np.sqrt(D), dtype), "scale"),
              numpy_helper.from_array(np.array(0, dtype), "zero"),
              numpy_helper.from_array(np.array(-10000, dtype), "masked"),
              numpy_helper.from_array(np.array([1], np.int64), "ax1"),
              numpy_helper.from_array(np.array([2], np.int64), "ax2")]
    nodes = [helper.make_node("MatMul", ["x", w], [n]) for w, n in (("wq", "q2"), ("wk", "k2"), ("wv", "v2"))]
    for n in ("q", "k", "v"):
        _heads(n, n + "2", nodes)
    nodes += [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Mul", ["qk", "scale"], ["scores"]),
        helper.make_node("Cast", ["global_flags"], ["g"], to=TensorProto.BOOL),
        helper.make_node("Unsqueeze", ["g", "ax1"], ["g_keys"]),       # [B, 1, S]
        helper.make_node("Unsqueeze", ["g", "ax2"], ["g_rows"]),       # [B, S, 1]
        helper.make_node("Or", ["band", "g_keys"], ["a1"]),
        helper.make_node("Or", ["a1", "g_rows"], ["allowed3"]),        # [B, S, S]
        helper.make_node("Unsqueeze", ["allowed3", "ax1"], ["allowed"]),  # [B, 1, S, S]
    ]
    if form == "additive":
        nodes += [helper.make_node("Where", ["allowed", "zero", "masked"], ["bias"]),
                  helper.make_node("Add", ["scores", "bias"], ["logits"])]
    elif form == "where":
        nodes += [helper.make_node("Where", ["allowed", "scores", "masked"], ["logits"])]
    else:   # where with the condition negated: True = disallowed
        nodes += [helper.make_node("Not", ["allowed"], ["disallowed"]),
                  helper.make_node("Where", ["disallowed", "masked", "scores"], ["logits"])]
    nodes += [helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "v"], ["ctx"]),
              helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ctx_t", "out_shape"], ["out"])]
    inputs = [helper.make_tensor_value_info("x", elem, [B, S, HIDDEN]),
              helper.make_tensor_value_info("global_flags", TensorProto.INT32, [B, S])]
    return _model(nodes, inputs, inits, out_type=elem)


def padding_mask_model(expanded: bool = False):
    """q, k, v [B, H, S, D] and attention_mask [B, S] (1 token, 0 padding) -> the BERT-style key
    padding bias [B, 1, 1, S]; ``expanded``: broadcast to [B, 1, S, S] first, as transformers'
    mask utilities do (the bias still does not change along the queries)."""
    inits = [numpy_helper.from_array(np.array(0.25, np.float32), "scale"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(-10000.0, np.float32), "big"),
             numpy_helper.from_array(np.array([1, 2], np.int64), "axes"),
             numpy_helper.from_array(np.array([B, 1, S, S], np.int64), "full")]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"]),
             helper.make_node("Mul", ["qk", "scale"], ["scores"]),
             helper.make_node("Cast", ["attention_mask"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("Sub", ["one", "mf"], ["pad"]),
             helper.make_node("Mul", ["pad", "big"], ["bias2"]),
             helper.make_node("Unsqueeze", ["bias2", "axes"], ["bias1"]),
             helper.make_node("Expand", ["bias1", "full"], ["bias"]) if expanded
             else helper.make_node("Identity", ["bias1"], ["bias"]),
             helper.make_node("Add", ["scores", "bias"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
             helper.make_node("MatMul", ["probs", "v"], ["out"])]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, H, S, D]) for n in ("q", "k", "v")]
    inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [B, S]))
    return _model(nodes, inputs, inits, out_shape=(B, H, S, D))


def _ort(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def _global_flags(rng):
    g = (rng.random((B, S)) < 0.05).astype(np.int32)
    g[:, 0] = 1
    return g


@pytest.mark.parametrize("form", ["additive", "where", "where_not"])
def test_window_and_global_mask_lowered_and_matches_onnxruntime(form):
    model = longformer_style_model(form)
    compiled = pit_tvm.compile_onnx(model)
    notes = [n for n in compiled.annotations if n["source"].startswith("attention:")]
    assert [n["status"] for n in notes] == ["pit"], compiled.annotations
    assert notes[0]["source"] == "attention:global_flags" and notes[0]["tensor"] == "ctx"
    assert "pit_attention_index" in compiled.lowered.script()       # the block index runs in the graph
    rng = np.random.default_rng(1)
    for _ in range(2):                                              # the global tokens change per call
        feeds = {"x": rng.standard_normal((B, S, HIDDEN)).astype(np.float32), "global_flags": _global_flags(rng)}
        np.testing.assert_allclose(compiled.run(feeds)[0], _ort(model, feeds), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("expanded", [False, True], ids=["b11s", "expanded_b1ss"])
def test_key_padding_mask_taken_only_when_named(expanded):
    """a key-padding mask stays with the dense attention unless its input is named, also where
    it is broadcast over the queries (transformers' [B, 1, S, S])"""
    model = padding_mask_model(expanded)
    rng = np.random.default_rng(2)
    feeds = {n: rng.standard_normal((B, H, S, D)).astype(np.float32) for n in ("q", "k", "v")}
    lengths = np.array([S - 13, 9])
    feeds["attention_mask"] = (np.arange(S)[None, :] < lengths[:, None]).astype(np.int64)
    want = _ort(model, feeds)
    default = pit_tvm.compile_onnx(model)
    assert not any(n["source"].startswith("attention:") for n in default.annotations)
    np.testing.assert_allclose(default.run(feeds)[0], want, atol=2e-5, rtol=2e-5)
    named = pit_tvm.compile_onnx(model, sparse_attention="attention_mask")
    notes = [n for n in named.annotations if n["source"] == "attention:attention_mask"]
    assert [n["status"] for n in notes] == ["pit"]
    np.testing.assert_allclose(named.run(feeds)[0], want, atol=2e-5, rtol=2e-5)
    off = pit_tvm.compile_onnx(model, sparse_attention=False)
    assert not any(n["source"].startswith("attention:") for n in off.annotations)


def test_unsupported_attention_stays_dense_with_a_warning():
    model = longformer_style_model("additive", dtype=np.float64)
    with pytest.warns(UserWarning, match="stays dense: .*dtype float64"):
        compiled = pit_tvm.compile_onnx(model)
    notes = [n for n in compiled.annotations if n["source"].startswith("attention:")]
    assert [n["status"] for n in notes] == ["dense"]
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((B, S, HIDDEN)), "global_flags": _global_flags(rng)}
    np.testing.assert_allclose(compiled.run(feeds)[0], _ort(model, feeds), atol=1e-9, rtol=1e-9)


def test_unknown_mask_input_is_a_user_error():
    with pytest.raises(UserError, match="unknown input 'nope'"):
        pit_tvm.compile_onnx(padding_mask_model(), sparse_attention="nope")
    with pytest.raises(TypeError, match="sparse_attention="):
        pit_tvm.compile_onnx(padding_mask_model(), sparse_attention=3)


@pytest.mark.skipif(__import__("pit_tvm.nvcc", fromlist=["find_nvcc"]).find_nvcc() is None, reason="nvcc not found")
def test_imported_model_builds_for_cuda():
    from pit_tvm.nvcc import check_cuda_compiles

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # (named: without a fast kernel for sm_80 the attention would stay dense)
        compiled = pit_tvm.compile_onnx(longformer_style_model("where"), target="cuda:sm_80",
                                        sparse_attention="global_flags")
    assert any(n["status"] == "pit" and n["source"] == "attention:global_flags" for n in compiled.annotations)
    assert check_cuda_compiles(compiled.executable, archs=("sm_80",)) >= 1


def test_cuda_without_a_fast_kernel_keeps_the_dense_attention_unless_named():
    """the generic CUDA kernel is a correct fallback, slower than the dense attention: an
    unnamed mask on a target without the sm_90a kernel (an arch, a head dim or a dtype it does
    not take) stays dense with a warning; the CPU kernel and the sm_90a one are taken"""
    from pit_tvm.ops.sparse_attention import fast_kernel_applies
    from pit_tvm.passes import SparseAttentionToPIT, import_onnx
    from pit_tvm.target import make_target

    assert fast_kernel_applies(make_target("llvm"), 40, "float32")
    assert fast_kernel_applies(make_target("cuda"), 64, "float16")
    assert not fast_kernel_applies(make_target("cuda"), 64, "float32")
    assert not fast_kernel_applies(make_target("cuda"), 40, "float16")
    assert not fast_kernel_applies(make_target("cuda:sm_80"), 64, "float16")
    mod = import_onnx(longformer_style_model("where"))
    with pytest.warns(UserWarning, match="stays dense: no fast sparse kernel for cuda sm_80"):
        lowered = SparseAttentionToPIT("cuda:sm_80")(mod)
    assert "pit_attention_index" not in lowered.script()
    named = SparseAttentionToPIT("cuda:sm_80", mask_input="global_flags")(mod)
    assert "pit_attention_index" in named.script()


# --------------------------------------------------------------------------- contrib operators
CB, CS, NH, KVH, CD, BS, MAXC = 2, 40, 4, 2, 16, 16, 64


def contrib_sparse_attention_model(elem=TensorProto.FLOAT, **attrs):
    inputs = [helper.make_tensor_value_info("query", elem, [CB, CS, NH * CD]),
              helper.make_tensor_value_info("key", elem, [CB, CS, KVH * CD]),
              helper.make_tensor_value_info("value", elem, [CB, CS, KVH * CD]),
              helper.make_tensor_value_info("past_key", elem, [CB, KVH, MAXC, CD]),
              helper.make_tensor_value_info("past_value", elem, [CB, KVH, MAXC, CD]),
              helper.make_tensor_value_info("block_row_indices", TensorProto.INT32, [2, MAXC // BS + 1]),
              helper.make_tensor_value_info("block_col_indices", TensorProto.INT32, [2, 10]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("key_total_sequence_lengths", TensorProto.INT32, [CB])]
    node = helper.make_node("SparseAttention", [i.name for i in inputs], ["out", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=NH, kv_num_heads=KVH, sparse_block_size=BS, **attrs)
    outputs = [helper.make_tensor_value_info("out", elem, [CB, CS, NH * CD]),
               helper.make_tensor_value_info("present_key", elem, [CB, KVH, MAXC, CD]),
               helper.make_tensor_value_info("present_value", elem, [CB, KVH, MAXC, CD])]
    graph = helper.make_graph([node], "sparse_attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def _block_layouts(rng):
    """two causal block layouts as CSR (row pointers, column ids padded with -1)"""
    blocks = MAXC // BS
    dense = [np.tril(rng.random((blocks, blocks)) < 0.5) | np.eye(blocks, dtype=bool) for _ in range(2)]
    rows = np.stack([np.concatenate([[0], np.cumsum(d.sum(1))]) for d in dense]).astype(np.int32)
    cols = np.full((2, 10), -1, np.int32)
    for i, d in enumerate(dense):
        listed = np.nonzero(d)[1]
        cols[i, :len(listed)] = listed
    return rows, cols


def _ort_sparse_attention(model, feeds):
    """onnxruntime's CPU kernel (it wants past and present in one buffer: I/O binding)"""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    io = sess.io_binding()
    io.bind_output("out")
    caches, buffers = {}, {}
    for name, value in feeds.items():
        if name.startswith("past_"):
            buffers[name] = value.copy()        # (the OrtValue views this memory: keep it alive)
            caches[name] = ort.OrtValue.ortvalue_from_numpy(buffers[name])
            io.bind_ortvalue_input(name, caches[name])
            io.bind_ortvalue_output(name.replace("past_", "present_"), caches[name])
        else:
            io.bind_cpu_input(name, value)
    sess.run_with_iobinding(io)
    out = io.copy_outputs_to_cpu()[0]
    return out, buffers["past_key"].copy(), buffers["past_value"].copy()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_contrib_sparse_attention_matches_onnxruntime(dtype):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model = contrib_sparse_attention_model(elem)
    compiled = pit_tvm.compile_onnx(model)
    notes = [n for n in compiled.annotations if n["source"].startswith("attention:")]
    assert [n["status"] for n in notes] == ["pit"], compiled.annotations
    assert "block_col_indices" in notes[0]["source"] and "key_total_sequence_lengths" in notes[0]["source"]
    rng = np.random.default_rng(4)
    for _ in range(2):                  # the layouts change per call (prompt: every key length is CS)
        lengths = [CS, CS]
        rows, cols = _block_layouts(rng)
        feeds = {"query": rng.standard_normal((CB, CS, NH * CD)).astype(dtype),
                 "key": rng.standard_normal((CB, CS, KVH * CD)).astype(dtype),
                 "value": rng.standard_normal((CB, CS, KVH * CD)).astype(dtype),
                 "past_key": rng.standard_normal((CB, KVH, MAXC, CD)).astype(dtype),
                 "past_value": rng.standard_normal((CB, KVH, MAXC, CD)).astype(dtype),
                 "block_row_indices": rows, "block_col_indices": cols,
                 "total_sequence_length": np.array([CS], np.int32),
                 "key_total_sequence_lengths": np.array(lengths, np.int32)}
        out, present_k, present_v = compiled.run(feeds)
        want, want_k, want_v = _ort_sparse_attention(model, feeds)
        tol = 2e-5 if dtype == np.float32 else 3e-3
        np.testing.assert_allclose(out, want, atol=tol, rtol=tol)
        np.testing.assert_array_equal(present_k[:, :, :CS], want_k[:, :, :CS])
        np.testing.assert_array_equal(present_v[:, :, :CS], want_v[:, :, :CS])


def test_contrib_sparse_attention_unsupported_forms_are_named():
    with pytest.raises(ValueError, match="do_rotary=1 is not supported"):
        pit_tvm.compile_onnx(contrib_sparse_attention_model(do_rotary=1))


def test_real_gpt2_export_attention_lowered_and_matches_onnxruntime():
    """A transformers GPT-2 export (tests/data/transformers): its causal + padding mask is computed
    from the attention_mask input, so both layers' attentions run as block-sparse attention."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data" / "transformers" / "gpt2.onnx"
    shapes = {"input_ids": [2, 16], "attention_mask": [2, 16]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = pit_tvm.compile_onnx(str(path), shapes=shapes)
    notes = [n for n in compiled.annotations if n["source"] == "attention:attention_mask"]
    assert [n["status"] for n in notes] == ["pit", "pit"]
    mask = (np.arange(16)[None, :] < np.array([16, 9])[:, None]).astype(np.int64)
    feeds = {"input_ids": np.random.default_rng(0).integers(3, 100, (2, 16)).astype(np.int64) * mask,
             "attention_mask": mask}
    got = compiled.run(feeds)[0]
    want = _ort(onnx.load(str(path)), feeds)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-5 * np.abs(want[real]).max(), rtol=0)


@pytest.mark.parametrize("name", ["bert", "minilm", "minilm_dynamo"])
def test_real_encoder_padding_mask_stays_dense_unless_named(name):
    """A transformers encoder export's mask is key padding only (an all-True [S, S] base mask
    and-ed with attention_mask, broadcast over the queries): the dense attention keeps it by
    default; named, it runs block-sparse; both match onnxruntime on the real tokens."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data" / "transformers" / f"{name}.onnx"
    shapes = {"input_ids": [2, 16], "attention_mask": [2, 16]}
    mask = (np.arange(16)[None, :] < np.array([16, 9])[:, None]).astype(np.int64)
    feeds = {"input_ids": np.random.default_rng(0).integers(3, 100, (2, 16)).astype(np.int64) * mask,
             "attention_mask": mask}
    names = {i.name for i in onnx.load(str(path)).graph.input}
    feeds = {k: v for k, v in feeds.items() if k in names}
    want = _ort(onnx.load(str(path)), feeds)
    real = mask.astype(bool)
    for named, status in ((None, None), ("attention_mask", "pit")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = pit_tvm.compile_onnx(str(path), shapes={k: shapes[k] for k in feeds},
                                            sparse_attention=named)
        statuses = {n["status"] for n in compiled.annotations if n["source"].startswith("attention:")}
        assert statuses == ({status} if status else set()), compiled.annotations
        got = compiled.run(feeds)[0]
        np.testing.assert_allclose(got[real], want[real], atol=1e-5 * np.abs(want[real]).max(), rtol=0)


def test_named_mask_input_that_no_attention_reads_is_said():
    """sparse_attention= naming an input that no recognised attention's mask is computed from
    (here the global-token model's x) is not silently ignored: a warning names it"""
    with pytest.warns(UserWarning, match="sparse_attention='x': no attention of the form"):
        compiled = pit_tvm.compile_onnx(longformer_style_model("additive"), sparse_attention="x")
    assert not any(n["source"].startswith("attention:") for n in compiled.annotations)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["additive", "where"])
def test_gpu_imported_model_matches_onnxruntime(form):
    model = longformer_style_model(form)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = pit_tvm.compile_onnx(model, target="cuda", sparse_attention="global_flags")  # fp32: named
    assert any(n["status"] == "pit" for n in compiled.annotations if n["source"].startswith("attention:"))
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((B, S, HIDDEN)).astype(np.float32), "global_flags": _global_flags(rng)}
    np.testing.assert_allclose(compiled.run(feeds)[0], _ort(model, feeds), atol=1e-4, rtol=1e-4)


def test_cli_sparse_attention_option(tmp_path, capsys):
    from pit_tvm.cli.main import main as cli_main

    path = tmp_path / "model.onnx"
    onnx.save(padding_mask_model(), str(path))
    assert cli_main(["compile", str(path), "--sparse-attention", "attention_mask", "-o", str(tmp_path / "a.so")]) == 0
    assert "source=attention:attention_mask" in capsys.readouterr().out
    onnx.save(longformer_style_model(), str(path))
    assert cli_main(["compile", str(path), "--sparse-attention", "off", "-o", str(tmp_path / "b.so")]) == 0
    assert "attention:" not in capsys.readouterr().out
