"""The CPU pipeline's row stage: ExpToVectorExp (pit_tvm.passes.vector_exp) against numpy's exp
(fp32 range, its ends and special values) and CPURowReduction (pit_tvm.schedules.
cpu_row_reduction) on softmax and layer norm against numpy, rows it takes and rows it leaves."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax, te

from pit_tvm.passes.vector_exp import ExpToVectorExp
from pit_tvm.schedules.cpu_row_reduction import VEC, CPURowReduction
from pit_tvm.target import build, make_target


def _vector_exp_kernel(n: int):
    x = te.placeholder((n,), "float32", name="x")
    y = te.compute((n,), lambda i: te.exp(x[i]), name="y")
    mod = ExpToVectorExp(tvm.IRModule({"main": te.create_prim_func([x, y])}))
    sch = tvm.s_tir.Schedule(mod)
    (loop,) = sch.get_loops(sch.get_sblock("y"))
    sch.vectorize(sch.split(loop, [None, 16])[1])
    assert "T.exp(" not in sch.mod.script()
    return tvm.compile(sch.mod, target=make_target("llvm"))["main"]


def test_vector_exp_matches_numpy_over_the_fp32_range():
    ends = [np.nan, np.inf, -np.inf, 0.0, -0.0, 88.72, 88.73, 89.0, -87.3, -103.9, -104.0, -110.0, 1e-8, -1e-8]
    x = np.concatenate([np.random.default_rng(0).uniform(-110, 90, 1 << 16), ends]).astype(np.float32)
    n = -(-len(x) // 16) * 16
    x = np.pad(x, (0, n - len(x)))
    got = tvm.runtime.empty((n,), "float32")
    _vector_exp_kernel(n)(tvm.runtime.tensor(x), got)
    with np.errstate(over="ignore"):
        got, want = got.numpy(), np.exp(x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want) & (want >= np.finfo(np.float32).tiny)
    rel = np.abs(got[finite].astype(np.float64) - want[finite]) / want[finite]
    assert rel.max() < 2.5e-7                                   # about 2 ulp
    sub = np.isfinite(want) & (want < np.finfo(np.float32).tiny)   # the subnormals and 0
    assert np.abs(got[sub] - want[sub]).max() <= 2 * np.finfo(np.float32).smallest_subnormal


def _row_module(shape, axis_len):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(shape) + [axis_len], "float32"))
    g = relax.Var("g", relax.TensorType([axis_len], "float32"))
    b = relax.Var("b", relax.TensorType([axis_len], "float32"))
    with bb.function("main", [x, g, b]):
        with bb.dataflow():
            s = bb.emit(relax.op.nn.softmax(x, axis=-1))
            n = bb.emit(relax.op.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-5))
            out = bb.emit_output(relax.Tuple([s, n]))
        bb.emit_func_output(out)
    return bb.get()


def _numpy_rows(x, g, b):
    e = np.exp(x - x.max(-1, keepdims=True))
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return e / e.sum(-1, keepdims=True), (x - mean) / np.sqrt(var + 1e-5) * g + b


@settings(max_examples=6, deadline=None)
@given(rows=st.sampled_from([(1,), (3,), (2, 5)]), axis_len=st.sampled_from([16, 48, 384, 30]),
       scale=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 2**16))
def test_softmax_and_layer_norm_match_numpy(rows, axis_len, scale, seed):
    """the row rule's schedule (rows of a multiple of VEC) and TVM's loops (30) alike"""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(list(rows) + [axis_len]) * scale).astype(np.float32)
    g, b = rng.standard_normal(axis_len).astype(np.float32), rng.standard_normal(axis_len).astype(np.float32)
    vm = relax.VirtualMachine(build(_row_module(rows, axis_len), "llvm"), tvm.cpu())
    soft, norm = vm["main"](*(tvm.runtime.tensor(a) for a in (x, g, b)))
    want_soft, want_norm = _numpy_rows(x.astype(np.float64), g, b)
    np.testing.assert_allclose(soft.numpy(), want_soft, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norm.numpy(), want_norm, rtol=1e-4, atol=1e-4)


def _legalized(mod):
    return {gv.name_hint: f for gv, f in relax.transform.LegalizeOps()(mod).functions_items()
            if isinstance(f, tvm.tirx.PrimFunc)}


@pytest.mark.parametrize("axis_len,scheduled", [(128, True), (30, False)])
def test_rule_takes_rows_of_whole_vectors(axis_len, scheduled):
    """rows of a multiple of VEC become parallel rows with VEC-lane partial sums; others are left"""
    target = make_target("llvm")
    for name, func in _legalized(_row_module((4,), axis_len)).items():
        sch = CPURowReduction().apply(func, target, False)
        assert (sch is not None) == scheduled, name
        if scheduled:
            script = sch.mod.script()
            assert "T.parallel" in script and f"T.vectorized(T.int64({VEC}))" in script


def test_exp_beside_bf16_buffers_keeps_libm_exp_and_is_right():
    """a PrimFunc that loads bf16 keeps libm's exp (TVM's bf16 legalisation broke the
    polynomial's Let bindings: every result was inf); one without bf16 gets the polynomial"""
    import ml_dtypes
    from tvm.script import tirx as T

    from pit_tvm.passes.vector_exp import ExpToVectorExp

    def exp_of(dtype):
        @T.prim_func(s_tir=True)
        def f(x: T.Buffer((64,), dtype), y: T.Buffer((64,), "float32")):
            for i in range(64):
                with T.sblock("e"):
                    vi = T.axis.remap("S", [i])
                    y[vi] = T.exp(T.Cast("float32", x[vi]))
        return f

    for dtype, np_dtype, rewritten in (("bfloat16", ml_dtypes.bfloat16, False), ("float16", np.float16, True)):
        mod = ExpToVectorExp(tvm.IRModule({"main": exp_of(dtype)}))
        assert ("exp_x" in mod["main"].script()) == rewritten
        x = np.linspace(-30, 30, 64).astype(np_dtype)
        y = tvm.runtime.tensor(np.zeros(64, "float32"))
        tvm.compile(mod, target="llvm")["main"](tvm.runtime.tensor(x), y)
        np.testing.assert_allclose(y.numpy(), np.exp(x.astype(np.float32)), rtol=1e-5)
