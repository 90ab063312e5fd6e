"""``FuseAttention`` (pit_tvm/passes/attention.py): on CUDA (sm_90a) the chain
``softmax(q @ permute(k) * scale + mask) @ v`` becomes one call of the fused-attention kernel;
CPU targets and sizes the kernel does not take keep the graph.

The expected kernel is the one :func:`pit_tvm.schedules.attention.fused_attention_func`
generates for these sizes, compared in full (its numerics are tests/passes/test_attention.py's GPU
tests).  Applying the pass needs no GPU."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from _ir_compare import assert_ir_equal
from pit_tvm.passes import FuseAttention
from pit_tvm.schedules.attention import fused_attention_func

KERNEL = "fused_attention_b2_h2_s128_d64_float16"


@I.ir_module
class Before:
    """Two heads of 128 tokens x 64, an additive [B, 1, 1, S] mask, scale 1/8."""

    @R.function
    def main(q: R.Tensor((2, 2, 128, 64), "float16"), k: R.Tensor((2, 2, 128, 64), "float16"),
             v: R.Tensor((2, 2, 128, 64), "float16"),
             mask: R.Tensor((2, 1, 1, 128), "float16")) -> R.Tensor((2, 2, 128, 64), "float16"):
        with R.dataflow():
            kt = R.permute_dims(k, [0, 1, 3, 2])
            scores = R.matmul(q, kt)
            scaled = R.multiply(scores, R.const(0.125, "float16"))
            logits = R.add(scaled, mask)
            probs = R.nn.softmax(logits, axis=-1)
            o = R.matmul(probs, v)
            R.output(o)
        return o


@I.ir_module
class Expected:
    @T.prim_func(private=True)
    def fused_attention_b2_h2_s128_d64_float16(q: T.handle, k: T.handle, v: T.handle, mask: T.handle,
                                               o: T.handle):
        T.evaluate(0)       # replaced by the generated kernel in the test

    @R.function
    def main(q: R.Tensor((2, 2, 128, 64), "float16"), k: R.Tensor((2, 2, 128, 64), "float16"),
             v: R.Tensor((2, 2, 128, 64), "float16"),
             mask: R.Tensor((2, 1, 1, 128), "float16")) -> R.Tensor((2, 2, 128, 64), "float16"):
        cls = Expected
        with R.dataflow():
            fused = R.call_tir(cls.fused_attention_b2_h2_s128_d64_float16, (q, k, v, mask),
                               out_ty=R.Tensor((2, 2, 128, 64), "float16"))
            o = fused
            R.output(o)
        return o


def test_attention_chain_becomes_one_kernel():
    after = FuseAttention("cuda")(Before)
    expected = Expected.clone()
    kernel = fused_attention_func(2, 2, 128, 64, 0.125, "float16", "float16", 2)
    expected[expected.get_global_var(KERNEL)] = kernel.with_attr("global_symbol", KERNEL)
    assert_ir_equal(after, expected)


@I.ir_module
class PackedBefore:
    """Q, K and V as head splits of one [B, S, 3 H D] projection, the result's heads merged back
    to [B, S, H D] (BERT after CombineParallelMatmuls)."""

    @R.function
    def main(qkv: R.Tensor((2, 128, 384), "float16"),
             mask: R.Tensor((2, 1, 1, 128), "float16")) -> R.Tensor((2, 128, 128), "float16"):
        with R.dataflow():
            qs = R.strided_slice(qkv, (2,), (0,), (128,))
            qh = R.reshape(qs, R.shape([2, 128, 2, 64]))
            q = R.permute_dims(qh, [0, 2, 1, 3])
            ks = R.strided_slice(qkv, (2,), (128,), (256,))
            kh = R.reshape(ks, R.shape([2, 128, 2, 64]))
            k = R.permute_dims(kh, [0, 2, 1, 3])
            vs = R.strided_slice(qkv, (2,), (256,), (384,))
            vh = R.reshape(vs, R.shape([2, 128, 2, 64]))
            v = R.permute_dims(vh, [0, 2, 1, 3])
            kt = R.permute_dims(k, [0, 1, 3, 2])
            scores = R.matmul(q, kt)
            scaled = R.multiply(R.const(0.125, "float16"), scores)
            logits = R.add(mask, scaled)
            probs = R.nn.softmax(logits, axis=-1)
            o = R.matmul(probs, v)
            ot = R.permute_dims(o, [0, 2, 1, 3])
            merged = R.reshape(ot, R.shape([2, 128, 128]))
            R.output(merged)
        return merged


@I.ir_module
class PackedExpected:
    @T.prim_func(private=True)
    def fused_attention_b2_h2_s128_d64_float16_packed_merged(q: T.handle, k: T.handle, v: T.handle,
                                                             mask: T.handle, o: T.handle):
        T.evaluate(0)       # replaced by the generated kernel in the test

    @R.function
    def main(qkv: R.Tensor((2, 128, 384), "float16"),
             mask: R.Tensor((2, 1, 1, 128), "float16")) -> R.Tensor((2, 128, 128), "float16"):
        cls = PackedExpected
        with R.dataflow():
            fused = R.call_tir(cls.fused_attention_b2_h2_s128_d64_float16_packed_merged, (qkv, qkv, qkv, mask),
                               out_ty=R.Tensor((2, 128, 128), "float16"))
            merged = fused
            R.output(merged)
        return merged


def test_packed_heads_are_read_in_place_and_written_merged():
    """The kernel reads q, k and v at their columns of the projection (0, 128, 256) and writes
    the merged heads: no slice, head transpose or merge is left (operands of the scale and the
    mask in the other order, which the pattern also takes)."""
    name = "fused_attention_b2_h2_s128_d64_float16_packed_merged"
    expected = PackedExpected.clone()
    kernel = fused_attention_func(2, 2, 128, 64, 0.125, "float16", "float16", 2,
                                  packed=((384, 0), (384, 128), (384, 256)), out_packed=True)
    expected[expected.get_global_var(name)] = kernel.with_attr("global_symbol", name)
    assert_ir_equal(FuseAttention("cuda")(PackedBefore), expected)


@pytest.mark.parametrize("target", ["llvm", "cuda:sm_80"])
def test_targets_without_the_kernel_are_left_alone(target):
    """CPU targets, and GPUs without wgmma: the graph is kept as it is."""
    tvm.ir.assert_structural_equal(FuseAttention(target)(Before), Before)


def test_sizes_the_kernel_does_not_take_are_left_alone():
    """96 tokens (the kernel takes 128 or 256): the graph is kept as it is."""
    @I.ir_module
    class Short:
        @R.function
        def main(q: R.Tensor((2, 2, 96, 64), "float16"), k: R.Tensor((2, 2, 96, 64), "float16"),
                 v: R.Tensor((2, 2, 96, 64), "float16"),
                 mask: R.Tensor((2, 1, 1, 96), "float16")) -> R.Tensor((2, 2, 96, 64), "float16"):
            with R.dataflow():
                kt = R.permute_dims(k, [0, 1, 3, 2])
                scores = R.matmul(q, kt)
                scaled = R.multiply(scores, R.const(0.125, "float16"))
                logits = R.add(scaled, mask)
                probs = R.nn.softmax(logits, axis=-1)
                o = R.matmul(probs, v)
                R.output(o)
            return o

    tvm.ir.assert_structural_equal(FuseAttention("cuda")(Short), Short)


@I.ir_module
class ExportedBefore:
    """Attention as ``torch.onnx`` exports the ``transformers`` BERT's SDPA (after
    CombineParallelMatmuls): the scale's square root on q and on K's rows transposed
    ``[0, 2, 3, 1]``, a ``[B, 1, S, S]`` mask ``where`` of the padding mask broadcast through
    ``logical_and`` with an all-true constant, the NaN guard after the softmax, and a no-op
    reshape before the heads merge."""

    @R.function
    def main(qkv: R.Tensor((2, 128, 384), "float16"), keep: R.Tensor((2, 1, 1, 128), "bool"),
             ones: R.Tensor((1, 1, 128, 128), "bool")) -> R.Tensor((2, 128, 128), "float16"):
        with R.dataflow():
            both = R.logical_and(ones, keep)
            cond = R.broadcast_to(both, R.shape([2, 1, 128, 128]))
            qs = R.strided_slice(qkv, (2,), (0,), (128,))
            qh = R.reshape(qs, R.shape([2, 128, 2, 64]))
            q = R.permute_dims(qh, [0, 2, 1, 3])
            ks = R.strided_slice(qkv, (2,), (128,), (256,))
            kh = R.reshape(ks, R.shape([2, 128, 2, 64]))
            vs = R.strided_slice(qkv, (2,), (256,), (384,))
            vh = R.reshape(vs, R.shape([2, 128, 2, 64]))
            v = R.permute_dims(vh, [0, 2, 1, 3])
            kt = R.permute_dims(kh, [0, 2, 3, 1])
            qscaled = R.multiply(q, R.const(0.3535, "float16"))
            kscaled = R.multiply(kt, R.const(0.3535, "float16"))
            scores = R.matmul(qscaled, kscaled)
            mask = R.where(cond, R.const(0.0, "float16"), R.const(-65504.0, "float16"))
            logits = R.add(scores, mask)
            soft = R.nn.softmax(logits, axis=-1)
            nan = R.isnan(soft)
            probs = R.where(nan, R.const(0.0, "float16"), soft)
            o = R.matmul(probs, v)
            o4 = R.reshape(o, R.shape([2, 2, 128, 64]))
            ot = R.permute_dims(o4, [0, 2, 1, 3])
            merged = R.reshape(ot, R.shape([2, 128, 128]))
            R.output(merged)
        return merged


@I.ir_module
class ExportedExpected:
    @T.prim_func(private=True)
    def fused_attention_b2_h2_s128_d64_float16_packed_merged(q: T.handle, k: T.handle, v: T.handle,
                                                             mask: T.handle, o: T.handle):
        T.evaluate(0)       # replaced by the generated kernel in the test

    @R.function
    def main(qkv: R.Tensor((2, 128, 384), "float16"), keep: R.Tensor((2, 1, 1, 128), "bool"),
             ones: R.Tensor((1, 1, 128, 128), "bool")) -> R.Tensor((2, 128, 128), "float16"):
        cls = ExportedExpected
        with R.dataflow():
            mask = R.where(keep, R.const(0.0, "float16"), R.const(-65504.0, "float16"))
            fused = R.call_tir(cls.fused_attention_b2_h2_s128_d64_float16_packed_merged, (qkv, qkv, qkv, mask),
                               out_ty=R.Tensor((2, 128, 128), "float16"))
            merged = fused
            R.output(merged)
        return merged


def _all_true_ones(mod):
    return tvm.relax.transform.BindParams("main", {"ones": np.ones((1, 1, 128, 128), bool)})(mod)


def test_exported_sdpa_attention_becomes_one_kernel():
    """The kernel's scale is the product of the two square roots, its mask the [B, 1, 1, S]
    ``where`` of the padding mask; the NaN guard, the transposes and the [B, 1, S, S] mask go."""
    name = "fused_attention_b2_h2_s128_d64_float16_packed_merged"
    root = float(np.float16(0.3535))
    expected = _all_true_ones(ExportedExpected).clone()
    kernel = fused_attention_func(2, 2, 128, 64, root * root, "float16", "float16", 2,
                                  packed=((384, 0), (384, 128), (384, 256)), out_packed=True)
    expected[expected.get_global_var(name)] = kernel.with_attr("global_symbol", name)
    assert_ir_equal(FuseAttention("cuda")(_all_true_ones(ExportedBefore)), expected)


def test_exported_attention_with_a_mask_that_is_not_all_true_is_left_alone():
    """``logical_and`` with a constant that is not all true (a causal mask) is no key mask:
    the graph is kept."""
    causal = np.tril(np.ones((128, 128), bool))[None, None]
    before = tvm.relax.transform.BindParams("main", {"ones": causal})(ExportedBefore)
    tvm.ir.assert_structural_equal(FuseAttention("cuda")(before), before)
