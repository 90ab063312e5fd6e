"""Which PIT matmul backend each target and micro-tile takes (pit_tvm.ops.matmul.backends), and
that the graph emit_pit_matmul builds passes each kernel exactly its parameters.  Build-free:
the kernels are made, not compiled."""
from __future__ import annotations

import warnings

import pytest
import tvm
from tvm import relax, tirx

from pit_tvm.ops.matmul import BACKENDS, KernelRequest, MatmulPlan, choose_kernels, emit_pit_matmul
from pit_tvm.target import make_target


@pytest.mark.parametrize("target, micro_tile, dtype, backend, index_micro_tile", [
    ("cuda", (1, 512), "float16", "wgmma.rows", (1, 512)),
    ("cuda", (32, 64), "float16", "wgmma.tiles", (128, 64)),
    ("cuda:sm_80", (1, 512), "bfloat16", "mma.sync.rows", (1, 512)),
    ("cuda:sm_80", (1, 64), "float16", "mma.sync.tiles", (16, 64)),
    ("cuda", (1, 512), "float32", "simt", (1, 512)),
    ("llvm", (32, 64), "float32", "cpu", (32, 64)),
])
def test_first_backend_that_applies(target, micro_tile, dtype, backend, index_micro_tile):
    """the documented order (docs/design/matmul_backends.md): wgmma on sm_90a, mma.sync on
    sm_80 (thin tiles as their 16-row cover), SIMT for the rest of CUDA, the CPU schedule"""
    request = KernelRequest(MatmulPlan(512, 256, micro_tile), dtype, dtype, make_target(target))
    chosen = choose_kernels(request)
    assert chosen.backend == backend
    assert chosen.plan.micro_tile == index_micro_tile
    assert isinstance(chosen.kernel, tirx.PrimFunc)
    # every backend before the chosen one declines the request
    names = [b.name for b in BACKENDS]
    for earlier in BACKENDS[:names.index(backend)]:
        assert earlier.apply(request) is None, earlier.name


def test_model_matmul_without_tensor_core_kernel_takes_none():
    """a model's matmul (tensor_core_only) never takes the SIMT kernel: no backend applies"""
    request = KernelRequest(MatmulPlan(512, 256, (1, 512)), "float32", "float32", make_target("cuda"),
                            tensor_core_only=True)
    assert choose_kernels(request) is None


def _call_arities(mod: tvm.IRModule):
    """(kernel name, arguments given incl. the output, parameters) of every call_tir in main"""
    out = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.name in ("relax.call_tir", "relax.call_tir_inplace"):
            gv, args = expr.args[0], expr.args[1]
            func = mod[gv]
            outputs = 0 if expr.op.name == "relax.call_tir_inplace" else (
                len(expr.ty.fields) if isinstance(expr.ty, relax.TupleType) else 1)
            out.append((gv.name_hint, len(args.fields) + outputs, len(func.params)))

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return out


@pytest.mark.parametrize("micro_tile, activation", [((4, 256), None), ((1, 256), "relu")])
def test_simt_kernel_gets_no_epilogue_arguments(micro_tile, activation):
    """on sm_90a a bias the SIMT kernel does not take (whole rows of several rows, or fp32) runs
    after it as a Relax op, and every kernel is called with exactly its parameters"""
    dtype = "float16" if micro_tile[0] > 1 else "float32"
    bb = relax.BlockBuilder()
    m = tirx.Var("m", "int64")
    a = relax.Var("a", relax.TensorType([m, 256], dtype))
    b = relax.Var("b", relax.TensorType([256, 128], dtype))
    bias = relax.Var("bias", relax.TensorType([128], dtype))
    with bb.function("main", [a, b, bias]):
        with bb.dataflow():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                c = emit_pit_matmul(bb, a, b, micro_tile=micro_tile, target="cuda", tensor_core_only=False,
                                    bias=bias, activation=activation)
            out = bb.emit_output(c)
        bb.emit_func_output(out)
    mod = bb.get()
    calls = _call_arities(mod)
    assert any(name.startswith("pit_kernel_") for name, _, _ in calls)
    for name, given, params in calls:
        assert given == params, (name, given, params)
    ops = []
    relax.analysis.post_order_visit(mod["main"].body,
                                    lambda e: ops.append(e.op.name) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    assert "relax.add" in ops


@pytest.mark.parametrize("k, n, padded, dtype", [(32, 32, (64, 64), "float16"), (96, 40, (128, 64), "float16"),
                                                  (32, 32, (64, 64), "bfloat16")])
def test_model_matmul_of_untiled_k_n_runs_the_tensor_core_kernel_of_the_padded_shape(k, n, padded, dtype):
    """a model's fp16 / bf16 matmul whose K, N fit no tensor-core tile (a tiny transformers config's
    32 x 32) runs the wgmma rows kernel of K, N padded to its tiles: B padded with zeros at build
    time (a constant of the padded shape), A padded per call, C sliced back to N, the bias after"""
    import numpy as np  # noqa: PLC0415

    from pit_tvm.runtime.loader import numpy_dtype  # noqa: PLC0415

    bb = relax.BlockBuilder()
    m = tirx.Var("m", "int64")
    a = relax.Var("a", relax.TensorType([m, k], dtype))
    bias = relax.Var("bias", relax.TensorType([n], dtype))
    weight = np.random.default_rng(0).standard_normal((k, n)).astype(numpy_dtype(dtype))
    with bb.function("main", [a, bias]):
        with bb.dataflow():
            c = emit_pit_matmul(bb, a, relax.const(weight, dtype), micro_tile=(1, k), target="cuda", bias=bias)
            out = bb.emit_output(c)
        bb.emit_func_output(out)
    mod = bb.get()
    assert int(out.ty.shape[1]) == n
    kernels = [name for name, _, _ in _call_arities(mod) if name.startswith("pit_kernel_")]
    assert kernels and all(f"_k{padded[0]}_n{padded[1]}_" in name for name in kernels), kernels
    constants, ops = [], []

    def visit(e):
        if isinstance(e, tvm.ir.GenericConst):
            constants.append(e.value.numpy())
        elif isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
            ops.append(e.op.name)

    relax.analysis.post_order_visit(mod["main"].body, visit)
    padded_weight = next(w for w in constants if w.shape == padded)
    np.testing.assert_array_equal(padded_weight[:k, :n], weight)
    assert not padded_weight[k:].any() and not padded_weight[:, n:].any()
    assert {"relax.nn.pad", "relax.strided_slice", "relax.add"} <= set(ops)
