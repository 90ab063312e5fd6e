"""``SplitWholeTensorReductions`` (pit_tvm/passes/split_reductions.py): a reduction of a large
tensor to one value in two steps, rows first (TVM gives a reduction to one value one thread
block; a float16 T5 / Switch export's ``isinf(x).any()`` clamps were most of its time)."""
from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from pit_tvm.passes.split_reductions import SplitWholeTensorReductions, row_split
from pit_tvm.target import build


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((32, 128, 768), "float16"), y: R.Tensor((4, 768), "float32"),
             z: R.Tensor((1024, 8, 16), "float32")):
        with R.dataflow():
            inf = R.isinf(x)
            flags = R.astype(inf, "int64")
            count = R.sum(flags)                                   # T5's fp16 clamp: isinf(x).any()
            peak = R.max(x, axis=[0, 1, 2], keepdims=True)
            small = R.sum(y)                                       # 3,072 elements: left alone
            rows = R.mean(x, axis=[-1])                            # not every axis: left alone
            z_min = R.min(z)
            R.output(count, peak, small, rows, z_min)
        return (count, peak, small, rows, z_min)


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((32, 128, 768), "float16"), y: R.Tensor((4, 768), "float32"),
             z: R.Tensor((1024, 8, 16), "float32")):
        with R.dataflow():
            inf = R.isinf(x)
            flags = R.astype(inf, "int64")
            per_row = R.sum(flags, axis=[2])
            count = R.sum(per_row, axis=[0, 1])
            row_peak = R.max(x, axis=[2])
            whole = R.max(row_peak, axis=[0, 1])
            peak = R.reshape(whole, R.shape([1, 1, 1]))
            small = R.sum(y)
            rows = R.mean(x, axis=[-1])
            table = R.reshape(z, R.shape([128, 1024]))             # (one long row: the flat tensor's)
            z_rows = R.min(table, axis=[1])
            z_min = R.min(z_rows, axis=[0])
            R.output(count, peak, small, rows, z_min)
        return (count, peak, small, rows, z_min)


def test_whole_tensor_reductions_split_rows_first():
    tvm.ir.assert_structural_equal(SplitWholeTensorReductions(Before), Expected)


@pytest.mark.parametrize("shape, split", [((32, 128, 768), (4096, 768)), ((1024, 8, 16), (128, 1024)),
                                          ((1 << 16,), (64, 1024)), ((65536, 1), (64, 1024)), ((64, 32), None),
                                          ((1000, 67), None), ((1024, 8, 8), (64, 1024))])
def test_row_split(shape, split):
    """trailing dims up to 256 elements a row; one long row or no trailing product -> the
    flattened tensor's rows of 1024 / 512 / 256; under 65,536 elements or no divisor: no split"""
    assert row_split(shape) == split


@pytest.mark.parametrize("op", ["sum", "max", "min", "mean"])
def test_split_reductions_match_numpy_on_cpu(op):
    """the build (CPU pipeline, which holds the pass) against numpy, keepdims both ways"""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 64, 96)).astype("float32")
    reduce = getattr(R, op)

    @I.ir_module
    class Module:
        @R.function
        def main(a: R.Tensor((16, 64, 96), "float32")):
            with R.dataflow():
                whole = reduce(a)
                kept = reduce(a, axis=[0, 1, 2], keepdims=True)
                R.output(whole, kept)
            return (whole, kept)

    vm = tvm.relax.VirtualMachine(build(Module, "llvm"), tvm.cpu())
    whole, kept = vm["main"](tvm.runtime.tensor(x))
    expected = getattr(np, op)(x)
    np.testing.assert_allclose(whole.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert kept.numpy().shape == (1, 1, 1)
    np.testing.assert_allclose(kept.numpy().reshape(()), expected, rtol=1e-5, atol=1e-5)


def test_cuda_build_reduces_rows_in_many_blocks():
    """on CUDA the isinf count's first step (fused with isinf and the cast) is a row reduction over
    4,096 rows, not one thread block walking 3 M elements"""
    from pit_tvm.nvcc import cuda_sources  # noqa: PLC0415

    @I.ir_module
    class Count:
        @R.function
        def main(x: R.Tensor((32, 128, 768), "float16")):
            with R.dataflow():
                inf = R.isinf(x)
                flags = R.astype(inf, "int64")
                count = R.sum(flags)
                R.output(count)
            return count

    src = "\n".join(cuda_sources(build(Count, "cuda:sm_90a")))
    kernels = re.findall(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(', src)
    first = [k for k in kernels if "isinf" in k]
    assert first and all("sum" in k for k in first), kernels
    assert "blockIdx.x" in src[src.rindex(first[0]):], src[src.rindex(first[0]):][:800]
