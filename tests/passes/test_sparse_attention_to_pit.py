"""``SparseAttentionToPIT`` (pit_tvm/passes/sparse_attention.py): ``softmax(where(mask, q kᵀ *
scale, -1e4)) v`` with a mask computed at run time becomes a block index built from the mask and
the block-sparse attention kernel reading only the listed key blocks; the decision is recorded
in ``main``'s ``pit.annotations``.  The two generated kernels are stubs of ``Expected`` (compared
by name and signature, :mod:`_ir_compare`); the rewritten module is also built on llvm and run
against numpy.  Where no fast kernel applies (the generic CUDA kernel on sm_80, the mask's input
not named) the attention stays dense and only the record is added."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from _ir_compare import assert_ir_equal
from pit_tvm.passes import SparseAttentionToPIT

B, H, S, D = 1, 2, 32, 16


@I.ir_module
class Before:
    @R.function
    def main(q: R.Tensor((1, 2, 32, 16), "float32"), k: R.Tensor((1, 2, 32, 16), "float32"),
             v: R.Tensor((1, 2, 32, 16), "float32"), allowed: R.Tensor((1, 1, 32, 32), "bool")):
        with R.dataflow():
            kt = R.permute_dims(k, axes=[0, 1, 3, 2])
            s = R.matmul(q, kt)
            scaled = R.multiply(s, R.const(0.25, "float32"))
            masked = R.where(allowed, scaled, R.const(-10000.0, "float32"))
            p = R.nn.softmax(masked, axis=-1)
            out = R.matmul(p, v)
            R.output(out)
        return out


PIT_REASON = ("softmax(q k^T * 0.25 + mask) v with the mask computed at run time from allowed: block-sparse "
              "attention (bool mask), block index built on the device every call")


@I.ir_module
class Expected:
    @T.prim_func(private=True)
    def pit_attention_index_mbool_kb64_float32_bool(q_h: T.handle, k_h: T.handle, m_h: T.handle, cnt_h: T.handle,
                                                    ids_h: T.handle, part_h: T.handle):
        b, h, hg, sq, sk, d = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        nq, nk = T.int64(), T.int64()
        Q = T.match_buffer(q_h, (b, h, sq, d), "float32")
        K = T.match_buffer(k_h, (b, h, sk, d), "float32")
        M = T.match_buffer(m_h, (b, hg, sq, sk), "bool")
        CNT = T.match_buffer(cnt_h, (b, hg, nq), "int32")
        IDS = T.match_buffer(ids_h, (b, hg, nq, nk), "int32")
        PART = T.match_buffer(part_h, (b, hg, nq, nk), "int32")
        T.evaluate(0)

    @T.prim_func(private=True)
    def pit_sparse_attention_generic_mbool_d16_kb64_float32_bool_scale0p25(
            q_h: T.handle, k_h: T.handle, v_h: T.handle, cnt_h: T.handle, ids_h: T.handle, part_h: T.handle,
            m_h: T.handle, o_h: T.handle):
        b, h, hg, mh, sq, sk, nq, nk = (T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64(),
                                        T.int64(), T.int64())
        Q = T.match_buffer(q_h, (b, h, sq, 16), "float32")
        K = T.match_buffer(k_h, (b, h, sk, 16), "float32")
        V = T.match_buffer(v_h, (b, h, sk, 16), "float32")
        CNT = T.match_buffer(cnt_h, (b, hg, nq), "int32")
        IDS = T.match_buffer(ids_h, (b, hg, nq, nk), "int32")
        PART = T.match_buffer(part_h, (b, hg, nq, nk), "int32")
        M = T.match_buffer(m_h, (b, mh, sq, sk), "bool")
        O = T.match_buffer(o_h, (b, h, sq, 16), "float32")
        T.evaluate(0)

    @R.function
    def main(q: R.Tensor((1, 2, 32, 16), "float32"), k: R.Tensor((1, 2, 32, 16), "float32"),
             v: R.Tensor((1, 2, 32, 16), "float32"), allowed: R.Tensor((1, 1, 32, 32), "bool")):
        R.func_attr({"pit.annotations": [{"reason": PIT_REASON, "source": "attention:allowed", "status": "pit",
                                          "tensor": "out"}]})
        cls = Expected
        with R.dataflow():
            lv = R.call_tir(cls.pit_attention_index_mbool_kb64_float32_bool, (q, k, allowed),
                            out_ty=[R.Tensor((1, 1, 1), "int32"), R.Tensor((1, 1, 1, 1), "int32"),
                                    R.Tensor((1, 1, 1, 1), "int32")])
            cnt = lv[0]
            ids = lv[1]
            part = lv[2]
            o = R.call_tir(cls.pit_sparse_attention_generic_mbool_d16_kb64_float32_bool_scale0p25,
                           (q, k, v, cnt, ids, part, allowed), out_ty=R.Tensor((1, 2, 32, 16), "float32"))
            out = o
            R.output(out)
        return out


def reference(q, k, v, allowed):
    """numpy: softmax over the allowed keys of q kᵀ / 4, times v (every row here allows a key)."""
    scores = np.where(allowed, q @ k.transpose(0, 1, 3, 2) * 0.25, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def test_run_time_mask_becomes_block_sparse_attention():
    after = SparseAttentionToPIT("llvm", mask_input="allowed")(Before)
    assert_ir_equal(after, Expected)

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, S, D)).astype("float32") for _ in range(3))
    allowed = rng.random((1, 1, S, S)) < 0.3
    allowed[..., np.arange(S), np.arange(S)] = True     # no empty row (the dense where() spreads those)
    vm = relax.VirtualMachine(tvm.compile(after, target="llvm"), tvm.cpu())
    got = vm["main"](*(tvm.runtime.tensor(x) for x in (q, k, v, allowed))).numpy()
    np.testing.assert_allclose(got, reference(q, k, v, allowed), rtol=1e-5, atol=1e-5)


def test_without_a_fast_kernel_attention_stays_dense_and_the_reason_is_recorded():
    with pytest.warns(UserWarning, match="'out'.*stays dense: no fast sparse kernel for cuda sm_80"):
        after = SparseAttentionToPIT("cuda:sm_80")(Before)
    records = [dict(r) for r in after["main"].attrs["pit.annotations"]]
    assert [(r["tensor"], r["source"], r["status"]) for r in records] == [("out", "attention:allowed", "dense")]
    expected = Before["main"].with_attr("pit.annotations", after["main"].attrs["pit.annotations"])
    tvm.ir.assert_structural_equal(after["main"], expected)
    assert [gv.name_hint for gv in after.get_global_vars()] == ["main"]
