"""``HalfReductionsInFloat32`` (pit_tvm/passes/half_reductions.py): mean / sum / variance / softmax
of a float16 or bfloat16 tensor computed in float32 (TVM's legalization accumulates in the
tensor's dtype; T5's RMS norm in float16 drifted the Switch encoder away from PyTorch)."""
from __future__ import annotations

import re

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from pit_tvm.nvcc import cuda_sources
from pit_tvm.passes.half_reductions import HalfReductionsInFloat32
from pit_tvm.target import build


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((4, 768), "float16"), y: R.Tensor((4, 768), "float32")):
        with R.dataflow():
            square = R.multiply(x, x)
            variance = R.mean(square, axis=[-1], keepdims=True)     # T5's RMS norm
            p = R.nn.softmax(x, axis=-1)
            total = R.sum(y, axis=[-1], keepdims=True)               # float32: left alone
            R.output(variance, p, total)
        return (variance, p, total)


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((4, 768), "float16"), y: R.Tensor((4, 768), "float32")):
        with R.dataflow():
            square = R.multiply(x, x)
            wide = R.astype(square, "float32")
            mean = R.mean(wide, axis=[-1], keepdims=True)
            variance = R.astype(mean, "float16")
            wide_x = R.astype(x, "float32")
            softmax = R.nn.softmax(wide_x, axis=-1)
            p = R.astype(softmax, "float16")
            total = R.sum(y, axis=[-1], keepdims=True)
            R.output(variance, p, total)
        return (variance, p, total)


def test_half_reductions_become_float32_reductions():
    tvm.ir.assert_structural_equal(HalfReductionsInFloat32(Before), Expected)


def _mean_of_squares(dtype: str):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 4096), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.mean(relax.op.multiply(x, x), axis=[-1], keepdims=True))
        bb.emit_func_output(out)
    return bb.get()


def test_float16_mean_accumulates_in_float32_on_the_cpu():
    """the CPU build (the pass is in its pipeline) of the RMS norm's variance of 4096 values near 1:
    within half an ulp of the float32 mean of the same float16 squares (accumulated in float16,
    as TVM's legalization does without the pass, the sum stalls once its ulp outgrows the addends:
    an error of several percent)"""
    rng = np.random.default_rng(0)
    x = (1.0 + 0.1 * rng.standard_normal((8, 4096))).astype(np.float16)
    want = (x * x).astype(np.float32).mean(axis=-1, keepdims=True)
    dev = tvm.cpu()
    vm = relax.VirtualMachine(build(_mean_of_squares("float16"), "llvm"), dev)
    got = vm["main"](tvm.runtime.tensor(x, dev)).numpy().astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=2 ** -11)
    stalled = np.float16(0)                          # what a float16 running sum reaches
    for v in (x[0].astype(np.float32) ** 2).astype(np.float16):
        stalled = np.float16(stalled + v)
    assert abs(float(stalled) / 4096 - want[0, 0]) > 0.01


def test_cuda_build_accumulates_in_float():
    """on CUDA the mean's kernel sums in float (its reduction buffers: half without the pass) and
    the bfloat16 mean is widened the same way"""
    src = "\n".join(cuda_sources(build(_mean_of_squares("float16"), "cuda:sm_90a")))
    kernel = src[[m.start() for m in re.finditer(r"mean\w*_kernel\(", src)][-1]:]
    assert re.search(r"float \w*red_rf_local\w*\[", kernel), kernel[:600]
    assert not re.search(r"half \w*red_rf_local\w*\[", kernel)
    bf16 = HalfReductionsInFloat32(_mean_of_squares("bfloat16")).script()
    assert 'R.astype(lv, dtype="float32")' in bf16 and 'dtype="bfloat16"' in bf16, bf16


@I.ir_module
class AttentionProducts:
    @R.function
    def main(q: R.Tensor((2, 4, 64, 32), "float16"), k: R.Tensor((2, 4, 32, 64), "float16"),
             v: R.Tensor((2, 4, 64, 32), "float16"), w: R.Tensor((32, 8), "float32")):
        with R.dataflow():
            scores = R.matmul(q, k)                                  # T5's Q K^T, no fused kernel
            out = R.matmul(scores, v)
            wide = R.matmul(R.astype(out, "float32"), w)             # float32: left alone
            R.output(out, wide)
        return (out, wide)


@I.ir_module
class AttentionProductsInFloat:
    @R.function
    def main(q: R.Tensor((2, 4, 64, 32), "float16"), k: R.Tensor((2, 4, 32, 64), "float16"),
             v: R.Tensor((2, 4, 64, 32), "float16"), w: R.Tensor((32, 8), "float32")):
        with R.dataflow():
            product = R.matmul(q, k, out_dtype="float32")
            scores = R.astype(product, "float16")
            product_v = R.matmul(scores, v, out_dtype="float32")
            out = R.astype(product_v, "float16")
            out32 = R.astype(out, "float32")
            wide = R.matmul(out32, w)
            R.output(out, wide)
        return (out, wide)


def test_half_matmuls_accumulate_in_float32():
    tvm.ir.assert_structural_equal(HalfReductionsInFloat32(AttentionProducts), AttentionProductsInFloat)


def test_cuda_half_matmul_accumulator_is_float():
    """on CUDA the batched half matmul's tensor-core accumulator is float (half without the pass)"""
    src = "\n".join(cuda_sources(build(AttentionProducts, "cuda:sm_90a")))
    accumulators = re.findall(r"wmma::accumulator, \d+, \d+, \d+, (\w+)>", src)
    assert accumulators and set(accumulators) == {"float"}, accumulators


def test_cpu_half_matmul_matches_float_accumulation():
    """the CPU build of a half P V (128 keys of probabilities near 1/128) against numpy's float32
    product of the same half operands, rounded to half"""
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(s).astype(np.float16) for s in ((2, 4, 64, 32), (2, 4, 32, 64), (2, 4, 64, 32))]
    w = rng.standard_normal((32, 8)).astype(np.float32)
    dev = tvm.cpu()
    vm = relax.VirtualMachine(build(AttentionProducts, "llvm"), dev)
    out, _ = vm["main"](*[tvm.runtime.tensor(x, dev) for x in (*inputs, w)])
    scores = (inputs[0].astype(np.float32) @ inputs[1].astype(np.float32)).astype(np.float16)
    want = (scores.astype(np.float32) @ inputs[2].astype(np.float32)).astype(np.float16)
    np.testing.assert_allclose(out.numpy().astype(np.float32), want.astype(np.float32), rtol=2 ** -10, atol=2 ** -10)
