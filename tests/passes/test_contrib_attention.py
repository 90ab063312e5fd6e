"""The contrib attention converters of ``import_onnx`` (pit_tvm/passes/contrib_attention.py): an
ONNX graph of one ``com.microsoft.LongformerAttention`` node (Before) imports as the two
projections and two block-sparse attention calls (local rows: window +-2 and the global keys;
global rows: the global projections), each an index kernel built from the run-time ``global``
flags and padding and an attention kernel, and the output taking the global rows from the
second call and zeroing the padding rows (Expected, ``main`` compared structurally).  The four
generated kernels are stubs (compared by name and signature, :mod:`_ir_compare`).  The imported
module is also run on llvm against the operator's numpy reference.

``com.microsoft.SparseAttention`` imports as dense attention under a mask built from the CSR
block layouts (its block-sparse lowering is SparseAttentionToPIT's, tests/passes/
test_sparse_attention_to_pit.py); its numerics against onnxruntime are
tests/passes/test_sparse_attention_import.py's, its model-level Longformer tests
tests/passes/test_longformer.py's."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
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
         "out": "lv43"}     # (the converter's output binding keeps no ONNX name)


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
            rows_global = R.expand_dims(is_global, axis=[1, 3])
            rows_pad = R.expand_dims(pad, axis=[1, 3])
            out = R.where(rows_pad, R.const(0.0, "float32"), R.where(rows_global, glob, local))
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
