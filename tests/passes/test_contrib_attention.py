"""The contrib attention converters of ``import_onnx`` (pit_tvm/passes/contrib_attention.py): an
ONNX graph of one ``com.microsoft.LongformerAttention`` node (Before) imports as the two
projections and two block-sparse attention calls (local rows: window +-2 and the global keys;
global rows: the global projections), each an index kernel built from the run-time ``global``
flags and padding and an attention kernel, and the output taking the global rows from the
second call and zeroing the padding rows (Expected, ``main`` compared structurally).  The four
generated kernels are stubs (compared by name and signature, :mod:`_ir_compare`).  The imported
module is also run on llvm against the operator's numpy reference.

A ``com.microsoft.SparseAttention`` node (grouped-query, two block rows) imports as attention
under a mask computed from the CSR block layout, the causal mask and the key lengths (Expected
``main``; its constants are parameters bound in the test), run on llvm against numpy.  Its
block-sparse lowering is SparseAttentionToPIT's (test_sparse_attention_to_pit.py); the model-level
tests are test_sparse_attention_import.py's (against onnxruntime) and test_longformer.py's."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from _ir_compare import assert_ir_equal
from pit_tvm.passes import import_onnx
from pit_tvm.passes.contrib_attention import reference_longformer_attention
from test_longformer import longformer_model

NH, WINDOW, HIDDEN, B, S = 2, 2, 8, 1, 8
RECORD = {"reason": "com.microsoft.LongformerAttention: window +-2 and global tokens per call, padding from the mask: "
                    "block-sparse attention (local and global projections, block index built on the device every "
                    "call)", "source": "attention:global,mask", "status": "pit", "tensor": "out"}
NAMES = {**{n: n for n in ("bias", "global", "global_bias", "global_weight", "input", "mask", "weight")},
         "out": "lv49"}     # (the converter's output binding keeps no ONNX name)


@I.ir_module
class Expected:
    I.module_attrs({"pit.import_annotations": [RECORD], "pit.onnx_names": NAMES})

    @T.prim_func(private=True)
    def pit_attention_index_nomask_w2_g_d_kb64_float32(q: T.handle, k: T.handle, flags_h: T.handle, docs_h: T.handle,
                                                       cnt_h: T.handle, ids_h: T.handle, part_h: T.handle):
        b, s, nq, nk = T.int64(), T.int64(), T.int64(), T.int64()
        flags = T.match_buffer(flags_h, (b, s), "int32")
        docs = T.match_buffer(docs_h, (b, s), "int32")
        cnt = T.match_buffer(cnt_h, (b, 1, nq), "int32")
        ids = T.match_buffer(ids_h, (b, 1, nq, nk), "int32")
        part = T.match_buffer(part_h, (b, 1, nq, nk), "int32")
        T.evaluate(0)

    @T.prim_func(private=True)
    def pit_attention_index_nomask_w0_g_d_kb64_float32(q: T.handle, k: T.handle, flags_h: T.handle, docs_h: T.handle,
                                                       cnt_h: T.handle, ids_h: T.handle, part_h: T.handle):
        b, s, nq, nk = T.int64(), T.int64(), T.int64(), T.int64()
        flags = T.match_buffer(flags_h, (b, s), "int32")
        docs = T.match_buffer(docs_h, (b, s), "int32")
        cnt = T.match_buffer(cnt_h, (b, 1, nq), "int32")
        ids = T.match_buffer(ids_h, (b, 1, nq, nk), "int32")
        part = T.match_buffer(part_h, (b, 1, nq, nk), "int32")
        T.evaluate(0)

    @T.prim_func(private=True)
    def pit_sparse_attention_generic_nomask_w2_g_d_d4_kb64_float32_scale0p5(
            q_h: T.handle, k_h: T.handle, v_h: T.handle, cnt: T.handle, ids: T.handle, part: T.handle,
            flags_h: T.handle, docs_h: T.handle, o_h: T.handle):
        b, h, s = T.int64(), T.int64(), T.int64()
        q = T.match_buffer(q_h, (b, h, s, 4), "float32")
        k = T.match_buffer(k_h, (b, h, s, 4), "float32")
        v = T.match_buffer(v_h, (b, h, s, 4), "float32")
        flags = T.match_buffer(flags_h, (b, s), "int32")
        docs = T.match_buffer(docs_h, (b, s), "int32")
        o = T.match_buffer(o_h, (b, h, s, 4), "float32")
        T.evaluate(0)

    @T.prim_func(private=True)
    def pit_sparse_attention_generic_nomask_w0_g_d_d4_kb64_float32_scale0p5(
            q_h: T.handle, k_h: T.handle, v_h: T.handle, cnt: T.handle, ids: T.handle, part: T.handle,
            flags_h: T.handle, docs_h: T.handle, o_h: T.handle):
        b, h, s = T.int64(), T.int64(), T.int64()
        q = T.match_buffer(q_h, (b, h, s, 4), "float32")
        k = T.match_buffer(k_h, (b, h, s, 4), "float32")
        v = T.match_buffer(v_h, (b, h, s, 4), "float32")
        flags = T.match_buffer(flags_h, (b, s), "int32")
        docs = T.match_buffer(docs_h, (b, s), "int32")
        o = T.match_buffer(o_h, (b, h, s, 4), "float32")
        T.evaluate(0)

    @R.function
    def main(input: R.Tensor((1, 8, 8), "float32"), weight: R.Tensor((8, 24), "float32"),
             bias: R.Tensor((24,), "float32"), mask: R.Tensor((1, 8), "float32"),
             global_weight: R.Tensor((8, 24), "float32"), global_bias: R.Tensor((24,), "float32"),
             global_: R.Tensor((1, 8), "int32")) -> R.Tensor((1, 8, 8), "float32"):
        R.func_attr({"num_input": 7})
        cls = Expected
        with R.dataflow():
            # the local projection, q k v as [B, NH, S, d]
            qkv = R.add(R.matmul(input, weight), bias)
            parts = R.split(qkv, indices_or_sections=3, axis=2)
            q = R.permute_dims(R.reshape(parts[0], R.shape([1, 8, 2, 4])), axes=[0, 2, 1, 3])
            k = R.permute_dims(R.reshape(parts[1], R.shape([1, 8, 2, 4])), axes=[0, 2, 1, 3])
            v = R.permute_dims(R.reshape(parts[2], R.shape([1, 8, 2, 4])), axes=[0, 2, 1, 3])
            # the global projection
            gqkv = R.add(R.matmul(input, global_weight), global_bias)
            gparts = R.split(gqkv, indices_or_sections=3, axis=2)
            gq = R.permute_dims(R.reshape(gparts[0], R.shape([1, 8, 2, 4])), axes=[0, 2, 1, 3])
            gk = R.permute_dims(R.reshape(gparts[1], R.shape([1, 8, 2, 4])), axes=[0, 2, 1, 3])
            gv = R.permute_dims(R.reshape(gparts[2], R.shape([1, 8, 2, 4])), axes=[0, 2, 1, 3])
            pad = R.less(R.astype(mask, "float32"), R.const(0.0, "float32"))
            is_global = R.not_equal(global_, R.const(0, "int32"))
            doc_ids = R.astype(pad, "int32")
            # local rows: the window and the global keys
            index = R.call_tir(cls.pit_attention_index_nomask_w2_g_d_kb64_float32, (q, k, global_, doc_ids),
                               out_ty=[R.Tensor((1, 1, 1), "int32"), R.Tensor((1, 1, 1, 1), "int32"),
                                       R.Tensor((1, 1, 1, 1), "int32")])
            cnt = index[0]
            ids = index[1]
            part = index[2]
            local = R.call_tir(cls.pit_sparse_attention_generic_nomask_w2_g_d_d4_kb64_float32_scale0p5,
                               (q, k, v, cnt, ids, part, global_, doc_ids), out_ty=R.Tensor((1, 2, 8, 4), "float32"))
            # global rows: every key
            gindex = R.call_tir(cls.pit_attention_index_nomask_w0_g_d_kb64_float32, (gq, gk, global_, doc_ids),
                                out_ty=[R.Tensor((1, 1, 1), "int32"), R.Tensor((1, 1, 1, 1), "int32"),
                                        R.Tensor((1, 1, 1, 1), "int32")])
            gcnt = gindex[0]
            gids = gindex[1]
            gpart = gindex[2]
            glob = R.call_tir(cls.pit_sparse_attention_generic_nomask_w0_g_d_d4_kb64_float32_scale0p5,
                              (gq, gk, gv, gcnt, gids, gpart, global_, doc_ids),
                              out_ty=R.Tensor((1, 2, 8, 4), "float32"))
            # the rows' choice as 0 / 1 factors: global rows take glob, padded rows zero
            rows_global = R.astype(R.expand_dims(is_global, axis=[1, 3]), "float32")
            rows_real = R.astype(R.expand_dims(R.logical_not(pad), axis=[1, 3]), "float32")
            out = R.multiply(R.add(R.multiply(glob, rows_global),
                                   R.multiply(local, R.subtract(R.const(1.0, "float32"), rows_global))), rows_real)
            result = R.reshape(R.permute_dims(out, axes=[0, 2, 1, 3]), R.shape([1, 8, 8]))
            gv_out = result
            R.output(gv_out)
        return gv_out


def _model():
    return longformer_model(hidden=HIDDEN, num_heads=NH, window=WINDOW, batch=B, sequence=S)


def _feeds(seed):
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) * 0.3).astype("float32")    # noqa: E731
    mask = np.zeros((B, S), "float32")
    mask[:, -2:] = -10000.0                                     # two padding tokens
    flags = np.zeros((B, S), "int32")
    flags[:, 1] = 1                                             # one global token
    return {"input": w(B, S, HIDDEN) / 0.3, "weight": w(HIDDEN, 3 * HIDDEN), "bias": w(3 * HIDDEN),
            "mask": mask, "global_weight": w(HIDDEN, 3 * HIDDEN), "global_bias": w(3 * HIDDEN), "global": flags}


def _run(mod, feeds):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(v) for v in feeds.values())).numpy()


def _reference(feeds):
    return reference_longformer_attention(*feeds.values(), NH, WINDOW)


def test_longformer_attention_imports_as_two_block_sparse_attentions():
    mod = import_onnx(_model(), target="llvm")
    assert_ir_equal(mod, Expected)
    feeds = _feeds(0)
    np.testing.assert_allclose(_run(mod, feeds), _reference(feeds), atol=2e-5, rtol=0)


def test_longformer_attention_with_sparse_attention_off_imports_dense():
    """``sparse_attention=False``: the same computation with dense [B, 1, S, S] masks, no kernel
    generated, the decision recorded as dense."""
    mod = import_onnx(_model(), target="llvm", sparse_attention=False)
    assert [gv.name_hint for gv in mod.get_global_vars()] == ["main"]
    (record,) = [dict(r) for r in mod.attrs["pit.import_annotations"]]
    assert record["status"] == "dense" and "sparse_attention=False" in record["reason"]
    feeds = _feeds(1)
    np.testing.assert_allclose(_run(mod, feeds), _reference(feeds), atol=2e-5, rtol=0)


def test_unsupported_longformer_operands_are_named():
    with pytest.raises(ValueError, match="window=-1"):
        import_onnx(longformer_model(hidden=HIDDEN, num_heads=NH, window=-1, batch=B, sequence=S), target="llvm")


# --------------------------------------------------------------------------- com.microsoft.SparseAttention
SB, SS, SNH, SKVH, SD, BLOCK, NNZ = 1, 4, 2, 1, 4, 2, 3


def sparse_attention_model():
    """one com.microsoft.SparseAttention node: 2 query heads sharing 1 key / value head, blocks of
    2 tokens, one block layout, a KV cache as long as the sequence"""
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [("query", f, [SB, SS, SNH * SD]), ("key", f, [SB, SS, SKVH * SD]), ("value", f, [SB, SS, SKVH * SD]),
              ("past_key", f, [SB, SKVH, SS, SD]), ("past_value", f, [SB, SKVH, SS, SD]),
              ("block_row_indices", i32, [1, SS // BLOCK + 1]), ("block_col_indices", i32, [1, NNZ]),
              ("total_sequence_length", i32, [1]), ("key_total_sequence_lengths", i32, [SB])]
    node = helper.make_node("SparseAttention", [n for n, _, _ in inputs], ["out", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=SNH, kv_num_heads=SKVH, sparse_block_size=BLOCK)
    outputs = [("out", f, [SB, SS, SNH * SD]), ("present_key", f, [SB, SKVH, SS, SD]),
               ("present_value", f, [SB, SKVH, SS, SD])]
    graph = helper.make_graph([node], "sparse_attention", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


SPARSE_NAMES = {n: n for n in ("block_col_indices", "block_row_indices", "key", "key_total_sequence_lengths",
                               "past_key", "past_value", "query", "total_sequence_length", "value")}
SPARSE_NAMES["out"] = "lv37"


@I.ir_module
class ExpectedSparse:
    I.module_attrs({"pit.onnx_names": SPARSE_NAMES})

    @R.function
    def main(query: R.Tensor((1, 4, 8), "float32"), key: R.Tensor((1, 4, 4), "float32"),
             value: R.Tensor((1, 4, 4), "float32"), past_key: R.Tensor((1, 1, 4, 4), "float32"),
             past_value: R.Tensor((1, 1, 4, 4), "float32"), block_row_indices: R.Tensor((1, 3), "int32"),
             block_col_indices: R.Tensor((1, 3), "int32"), total_sequence_length: R.Tensor((1,), "int32"),
             key_total_sequence_lengths: R.Tensor((1,), "int32"),
             row_start_at: R.Tensor((2,), "int32"), row_end_at: R.Tensor((2,), "int32"),
             slot: R.Tensor((1, 1, 3), "int32"), key_block: R.Tensor((1, 1, 2, 1), "int32"),
             layout_of_head: R.Tensor((2,), "int32"), block_of_pos: R.Tensor((4,), "int32"),
             key_pos: R.Tensor((1, 1, 1, 4), "int32"), causal: R.Tensor((4, 4), "bool")):
        R.func_attr({"num_input": 9})
        with R.dataflow():
            q = R.permute_dims(R.reshape(query, R.shape([1, 4, 2, 4])), axes=[0, 2, 1, 3])
            k = R.permute_dims(R.reshape(key, R.shape([1, 4, 1, 4])), axes=[0, 2, 1, 3])
            v = R.permute_dims(R.reshape(value, R.shape([1, 4, 1, 4])), axes=[0, 2, 1, 3])
            k2 = R.repeat(k, repeats=2, axis=1)
            v2 = R.repeat(v, repeats=2, axis=1)
            scores = R.multiply(R.matmul(q, R.permute_dims(k2, axes=[0, 1, 3, 2])), R.const(0.5, "float32"))
            # listed[l, r, c]: block column c among block row r's CSR entries
            start = R.take(block_row_indices, row_start_at, axis=1, mode="fast")
            end = R.take(block_row_indices, row_end_at, axis=1, mode="fast")
            in_row = R.logical_and(R.greater_equal(slot, R.expand_dims(start, axis=[2])),
                                   R.less(slot, R.expand_dims(end, axis=[2])))
            hit = R.logical_and(R.expand_dims(in_row, axis=[2]),
                                R.equal(R.expand_dims(R.expand_dims(block_col_indices, axis=[1]), axis=[1]), key_block))
            listed = R.greater(R.max(R.astype(hit, "int32"), axis=[3]), R.const(0, "int32"))
            per_head = R.take(listed, layout_of_head, axis=0, mode="fast")
            elem = R.take(R.take(per_head, block_of_pos, axis=1, mode="fast"), block_of_pos, axis=2, mode="fast")
            key_ok = R.less(key_pos, R.reshape(key_total_sequence_lengths, R.shape([1, 1, 1, 1])))
            allowed = R.logical_and(R.logical_and(elem, causal), key_ok)
            probs = R.nn.softmax(R.where(allowed, scores, R.const(-1.0e30, "float32")), axis=-1)
            ctx = R.matmul(probs, v2)
            out = R.reshape(R.permute_dims(ctx, axes=[0, 2, 1, 3]), R.shape([1, 4, 8]))
            gv = (out, k, v)
            R.output(gv)
        return gv


SPARSE_CONSTANTS = {
    # (relax.const keeps the converter's int64 index arrays as int32)
    "row_start_at": np.arange(2, dtype=np.int32), "row_end_at": np.arange(1, 3, dtype=np.int32),
    "slot": np.arange(NNZ, dtype=np.int32).reshape(1, 1, NNZ),
    "key_block": np.arange(2, dtype=np.int32).reshape(1, 1, 2, 1),
    "layout_of_head": np.zeros(2, np.int32), "block_of_pos": np.arange(SS, dtype=np.int32) // BLOCK,
    "key_pos": np.arange(SS, dtype=np.int32).reshape(1, 1, 1, SS), "causal": np.tril(np.ones((SS, SS), bool))}


def test_sparse_attention_imports_as_attention_under_the_block_layout_mask():
    mod = import_onnx(sparse_attention_model(), target="llvm")
    assert_ir_equal(mod, relax.transform.BindParams("main", SPARSE_CONSTANTS)(ExpectedSparse))

    rng = np.random.default_rng(2)
    q = rng.standard_normal((SB, SS, SNH * SD)).astype("float32")
    k, v = (rng.standard_normal((SB, SS, SKVH * SD)).astype("float32") for _ in range(2))
    past = np.zeros((SB, SKVH, SS, SD), "float32")
    rows, cols = np.array([[0, 1, 2]], "int32"), np.array([[0, 1, -1]], "int32")   # block row r lists block r only
    lengths = np.array([3], "int32")                                                # the 4th key is not there yet
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    out, present_k, present_v = vm["main"](*(tvm.runtime.tensor(a) for a in (
        q, k, v, past, past, rows, cols, np.array([SS], "int32"), lengths)))
    # numpy: query i sees key j when j's block is i's (the layout), j <= i and j < 3; heads share the kv head
    i, j = np.arange(SS)[:, None], np.arange(SS)[None, :]
    allowed = (i // BLOCK == j // BLOCK) & (j <= i) & (j < 3)
    qh = q.reshape(SS, SNH, SD).transpose(1, 0, 2)
    kh, vh = k.reshape(SS, SD), v.reshape(SS, SD)
    scores = np.where(allowed, qh @ kh.T * 0.5, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = ((p / p.sum(-1, keepdims=True)) @ vh).transpose(1, 0, 2).reshape(SB, SS, SNH * SD)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(present_k.numpy()[0, 0], kh)
    np.testing.assert_array_equal(present_v.numpy()[0, 0], vh)
