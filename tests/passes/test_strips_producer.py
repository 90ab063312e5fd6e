"""A tiles-kind PIT matmul's strips index built in its producer's epilogue
(``wgmma_row_gather_func(strips_mk=)``, :class:`pit_tvm.passes.ListStripsInProducer`).

CPU part: the pass's rewrite of the OPT FFN (fc1's kernel lists fc2's strips; no strips kernel
is left; a symbolic row count zeroes the state per call before the fused kernel), what it
leaves alone, and nvcc compiling the fused kernels.  GPU part (``@pytest.mark.gpu``, an
H100): the fused kernel's C against numpy and its index and compacted C against the one-pass
strips kernel run on that C, on two calls; the FFN against onnxruntime.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import tvm
import tvm_ffi

from pit_tvm.runtime.loader import numpy_dtype
from pit_tvm.testing import opt_ffn, opt_ffn_inputs, to_float16
from pit_tvm.compile import compile_onnx
from pit_tvm.nvcc import check_cuda_compiles, find_nvcc
from pit_tvm.passes.strips import ListStripsInProducer
from pit_tvm.schedules.wgmma import wgmma_row_gather_func
from pit_tvm.schedules.wgmma_strips import compacts, strip_list_func, strip_state_words
from pit_tvm.target import build

TARGET = "cuda:sm_90a"


def _lowered(model, shapes=None, auto=True):
    """compile_onnx's lowered module for CUDA (the build itself not run)."""
    from unittest import mock

    import pit_tvm.compile as compile_module

    with mock.patch.object(compile_module, "build", lambda mod, tgt, cuda_graph=False: None), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile_onnx(model, "cuda", shapes=shapes, auto=auto).lowered


@pytest.mark.parametrize("shapes", [{"x": [4, 100, 256]}, None])
def test_ffn_fc1_lists_fc2_strips(shapes):
    """fc1's dense kernel (bias + ReLU) writes fc2's strips index and compacted hidden; the
    strips kernel is gone; with symbolic batch and sequence the state is zeroed per call
    before fc1.  The PIT-off build has nothing to fuse."""
    model = to_float16(opt_ffn(256))
    text = _lowered(model, shapes)["main"].script()
    assert "pit_strips_" not in text
    fused = next(line for line in text.splitlines() if "_strips, (" in line)
    assert "tc_dense_matmul_k256_n1024_float16_float16_bias_relu" in fused
    assert fused.count("R.Tensor(") == 4        # C, counts, strip ids, compacted C
    assert ("R.zeros" in text) == (shapes is None)
    if shapes is None:
        assert text.index("R.zeros") < text.index("_strips, (")
    assert "_strips, (" not in _lowered(model, shapes, auto=False)["main"].script()


def test_pass_leaves_a_listing_whose_producer_does_not_fit():
    """``make`` returning None (here: always) leaves the module as it was."""
    mod = _lowered(to_float16(opt_ffn(256)), {"x": [2, 64, 256]})
    # undo the fusion by compiling without it: the lowered module with the pass not run
    from unittest import mock

    import pit_tvm.compile as compile_module

    with mock.patch.object(compile_module, "ListStripsInProducer", lambda: (lambda m: m)):
        unfused = _lowered(to_float16(opt_ffn(256)), {"x": [2, 64, 256]})
    assert "pit_strips_" in unfused["main"].script() and "pit_strips_" not in mod["main"].script()
    kept = ListStripsInProducer(make=lambda producer, listing: None)(unfused)
    assert tvm_ffi.structural_equal(kept["main"], unfused["main"])


@pytest.mark.parametrize("mk,out_dtype", [(1, "float16"), (8, "float16"), (2, "bfloat16")])
def test_fused_kernel_compiles(mk, out_dtype):
    f = wgmma_row_gather_func(512, 512, "float16", out_dtype, bias=True, relu=True, dense=True, strips_mk=mk)
    # a, b, bias, state, c, counts, strip_ids (, the compacted C for micro-tiles under 16 bytes)
    assert len(f.params) == (8 if compacts(mk) else 7)
    with pytest.raises(ValueError, match="strips_mk"):
        wgmma_row_gather_func(512, 512, "float16", "float32", bias=True, dense=True, strips_mk=mk)
    with pytest.raises(ValueError, match="strips_mk"):
        wgmma_row_gather_func(512, 512, "float16", "float16", strips_mk=3, dense=True)
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(build(tvm.IRModule({"main": f}), TARGET), archs=("sm_90a",)) >= 1


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------
def _producer_inputs(m, k, n, dead, seed, dtype="float16"):
    """x, w, bias of a ReLU layer where a ``dead`` fraction of the columns is zero in every row
    (a very negative bias) and the others about half the time"""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(numpy_dtype(dtype))
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(numpy_dtype(dtype))
    bias = np.where(rng.random(n) < dead, -100.0, 0.0).astype(numpy_dtype(dtype))
    return x, w, bias


@pytest.mark.gpu
@pytest.mark.parametrize("m,mk,dead,in_dtype,out_dtype", [
    (1000, 1, 0.9, "float16", "float16"), (300, 2, 0.5, "float16", "float16"), (1000, 8, 0.9, "float16", "float16"),
    (4096, 64, 0.9, "float16", "float16"), (1000, 1, 0.0, "float16", "float16"), (1000, 4, 1.0, "float16", "float16"),
    (129, 1, 0.9, "float16", "float16"), (64, 32, 0.5, "float16", "float16"), (500, 1, 0.9, "bfloat16", "bfloat16"),
    (500, 2, 0.9, "float16", "bfloat16")])
def test_gpu_fused_listing_matches_the_strips_kernel(m, mk, dead, in_dtype, out_dtype):
    k, n = 256, 1024
    dev = tvm.cuda(0)
    x, w, bias = _producer_inputs(m, k, n, dead, m + mk, in_dtype)
    fused = build(tvm.IRModule({"main": wgmma_row_gather_func(k, n, in_dtype, out_dtype, bias=True, relu=True,
                                                               dense=True, strips_mk=mk)}), TARGET)["main"]
    lister = build(tvm.IRModule({"main": strip_list_func(n, mk, out_dtype)}), TARGET)["main"]
    g, mkt = strip_state_words(m), n // mk
    ref_c = np.maximum(x.astype(np.float32) @ w.astype(np.float32) + bias.astype(np.float32), 0)
    state = tvm.runtime.tensor(np.zeros(g, np.float64), dev)
    for _ in range(2):             # the second call on the state the first one left (zero)
        outs = [tvm.runtime.empty((m, n), out_dtype, dev), tvm.runtime.empty((g,), "int32", dev),
                tvm.runtime.empty((g * mkt,), "int32", dev)]
        outs += [tvm.runtime.tensor(np.full((m, n), np.nan, numpy_dtype(out_dtype)), dev)] if compacts(mk) else []
        fused(*[tvm.runtime.tensor(v, dev) for v in (x, w, bias)], state, *outs)
        assert not state.numpy().any()
        c, cnt, sids = (o.numpy() for o in outs[:3])
        np.testing.assert_allclose(c.astype(np.float32), ref_c, rtol=3e-2, atol=3e-2 * max(ref_c.max(), 1.0))
        # the strips kernel on the same C lists the same micro-tiles
        ref = [tvm.runtime.empty((g,), "int32", dev), tvm.runtime.empty((g * mkt,), "int32", dev)]
        ref += [tvm.runtime.empty((m, n), out_dtype, dev)] if compacts(mk) else []
        lister(outs[0], tvm.runtime.tensor(np.zeros(g, np.float64), dev), *ref)
        np.testing.assert_array_equal(cnt, ref[0].numpy())
        for s in range(g):
            listed = sids[s * mkt:s * mkt + cnt[s]]
            np.testing.assert_array_equal(np.sort(listed), np.sort(ref[1].numpy()[s * mkt:s * mkt + cnt[s]]))
            if not compacts(mk):
                continue
            rows = slice(128 * s, min(128 * s + 128, m))
            cols = (listed[:, None] * mk + np.arange(mk)).ravel()
            np.testing.assert_array_equal(outs[3].numpy()[rows, :cols.size], c[rows][:, cols])
            pad = -(-cols.size // 8) * 8                # zeros up to the next 16-byte chunk
            assert (outs[3].numpy()[rows, cols.size:pad] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("shapes", [{"x": [4, 100, 256]}, None])
def test_gpu_ffn_with_fused_listing_matches_onnxruntime(shapes):
    ort = pytest.importorskip("onnxruntime")
    model = to_float16(opt_ffn(256))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = compile_onnx(model, "cuda", shapes=shapes)
    assert "_strips, (" in cm.lowered["main"].script()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch, seq in ((4, 100),) if shapes else ((4, 100), (1, 7), (3, 128)):
        inputs = {"x": opt_ffn_inputs(256, batch=batch, seq=seq)["x"].astype("float16")}
        ref = session.run(None, inputs)[0].astype(np.float32)
        for _ in range(2):
            got = cm.run(inputs)[0].astype(np.float32)
            np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


def test_two_ffn_blocks_each_list_in_their_producer():
    """Two fc1 -> fc2 pairs of the same shapes (built with the op layer): each fc1 call lists
    its own fc2's strips, the two fused calls share one kernel, and no strips kernel is left."""
    from tvm import relax

    from pit_tvm.ops.matmul import emit_dense_matmul, emit_pit_matmul
    from pit_tvm.passes.lower import DropUnusedPrimFuncs

    rng = np.random.default_rng(0)

    def const(*shape):
        return relax.const(rng.standard_normal(shape).astype("float16"))

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([300, 256], "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            h = x
            for _ in range(2):
                hidden = emit_dense_matmul(bb, h, const(256, 1024), target="cuda", bias=const(1024),
                                           activation="relu")
                h = emit_pit_matmul(bb, hidden, const(1024, 256), micro_tile=(32, 1), target="cuda",
                                    bias=const(256), residual=h)
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    mod = bb.get()
    assert mod["main"].script().count("pit_strips_") == 2
    fused = DropUnusedPrimFuncs(ListStripsInProducer()(mod))
    text = fused["main"].script()
    assert "pit_strips_" not in text and text.count("_strips, (") == 2
    assert [gv.name_hint for gv in fused.get_global_vars()].count(
        "tc_dense_matmul_k256_n1024_float16_float16_bias_relu_m300_strips") == 1
