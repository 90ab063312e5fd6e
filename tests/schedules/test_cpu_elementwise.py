"""The CPU pipeline's elementwise stage: ErfToFastErf (pit_tvm.passes.fast_erf) and
CPUElementwise (pit_tvm.schedules.cpu_elementwise), on BERT's FFN activation (bias, GELU's erf
form, a row mask) against numpy, and what the rule leaves."""
from __future__ import annotations

from math import erf

import numpy as np
import pytest
import tvm
from tvm import relax, topi

from pit_tvm.passes.fast_erf import ErfToFastErf
from pit_tvm.schedules.cpu_elementwise import MIN_ELEMENTS, CPUElementwise
from pit_tvm.target import build, make_target


def _gelu_module(shape, dtype="float32"):
    """``gelu(x + b) * mask`` in GELU's erf form, as the ONNX importer writes it."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    b = relax.Var("b", relax.TensorType([shape[-1]], dtype))
    mask = relax.Var("mask", relax.TensorType(list(shape[:-1]) + [1], dtype))
    f32 = lambda v: relax.const(v, dtype)  # noqa: E731
    with bb.function("main", [x, b, mask]):
        with bb.dataflow():
            h = bb.emit(relax.op.add(x, b))
            e = bb.emit(relax.op.erf(relax.op.multiply(h, f32(0.7071067811865476))))
            g = bb.emit(relax.op.multiply(relax.op.multiply(h, f32(0.5)), relax.op.add(e, f32(1.0))))
            out = bb.emit_output(relax.op.multiply(g, mask))
        bb.emit_func_output(out)
    return bb.get()


def _fused_prim_funcs(mod):
    seq = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                    relax.transform.FuseOps(), relax.transform.FuseTIR()])
    return {gv.name_hint: f for gv, f in seq(mod).functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


def test_fast_erf_rewrite_and_cpu_build_match_numpy():
    """The pass leaves no ``R.erf``; the CPU build (which runs it, then schedules the fused
    kernel parallel and vectorised) is within 1e-6 of float64 GELU, over inputs to +-10 and a
    row mask of zeros and ones."""
    shape = (2, 48, 256)
    mod = _gelu_module(shape)
    assert "R.erf" in mod["main"].script()
    rewritten = ErfToFastErf(mod)
    assert "R.erf" not in rewritten["main"].script() and "fast_erf" in rewritten.script()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 4).astype("float32")
    x[0, 0, :3] = [10.0, -10.0, 0.0]
    b = rng.standard_normal(shape[-1]).astype("float32")
    mask = rng.choice([0.0, 1.0], (*shape[:-1], 1)).astype("float32")
    ex = build(mod, "llvm")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](*(tvm.runtime.tensor(v) for v in (x, b, mask))).numpy()
    h = x.astype(np.float64) + b
    want = 0.5 * h * (1 + np.vectorize(erf)(h / np.sqrt(2))) * mask
    assert np.abs(got - want).max() <= 1e-6 * max(1.0, np.abs(h).max())


def test_fp16_erf_is_left_alone():
    """TOPI's fp16 fast_erf is 0.04 off erf: an fp16 ``R.erf`` stays."""
    assert "R.erf" in ErfToFastErf(_gelu_module((2, 48, 256), "float16"))["main"].script()


def test_elementwise_is_parallel_and_vectorised():
    """The fused activation kernel: one parallel loop, one vectorised loop of 16 lanes."""
    funcs = _fused_prim_funcs(ErfToFastErf(_gelu_module((2, 48, 256))))
    (name, func), = [(n, f) for n, f in funcs.items() if "fast_erf" in n]
    sch = CPUElementwise().apply(func, make_target("llvm"), False)
    assert sch is not None, name
    script = sch.mod.script()
    assert script.count("T.parallel") == 1 and script.count("T.vectorized(T.int64(16))") == 1


@pytest.mark.parametrize("case", ["symbolic", "reduction", "small", "cuda", "odd"])
def test_leaves_what_it_does_not_take(case):
    """A symbolic shape, a reduction, fewer than MIN_ELEMENTS elements, a CUDA target, and a
    size no multiple of 4: None."""
    tgt = make_target("llvm")
    if case == "symbolic":
        n = tvm.tirx.Var("n", "int64")
        x = tvm.te.placeholder((n, 256), name="x")
        func = tvm.te.create_prim_func([x, topi.nn.relu(x)])
    elif case == "reduction":
        x = tvm.te.placeholder((64, 256), name="x")
        func = tvm.te.create_prim_func([x, topi.sum(x, axis=1)])
    elif case == "small":
        x = tvm.te.placeholder((MIN_ELEMENTS // 64 - 1, 64), name="x")
        func = tvm.te.create_prim_func([x, topi.nn.relu(x)])
    elif case == "cuda":
        x = tvm.te.placeholder((64, 256), name="x")
        func = tvm.te.create_prim_func([x, topi.nn.relu(x)])
        tgt = make_target("cuda")
    else:
        x = tvm.te.placeholder((4099, 3), name="x")
        func = tvm.te.create_prim_func([x, topi.nn.relu(x)])
    assert CPUElementwise().apply(func, tgt, False) is None
