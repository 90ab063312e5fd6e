"""The tiles kind's one-pass index (+ A compaction) (pit_tvm.schedules.wgmma_strips) on sm_90a.

CPU part: when it applies, the graph emit_pit_matmul builds with it (a static row count: a zero
constant counter; a symbolic one: a zeroed counter per call), and nvcc compiles it.  GPU part (``@pytest.mark.gpu``, an H100): the
index against the numpy reference (per strip, as sets: the CTAs place their micro-tiles in the
order they finish), the compacted A against A's listed columns, a second call on the same
(left zero) state, and the whole matmul against float32 numpy.
"""
from __future__ import annotations

import numpy as np
import pytest
import tvm

from pit_tvm.index import reference_tile_index
from pit_tvm.nvcc import check_cuda_compiles, cuda_sources, find_nvcc
from pit_tvm.schedules.wgmma_strips import (compacts, strip_list_func, strip_pack_func, strip_state_words,
                                            strips_apply)
from pit_tvm.target import build
from test_tensorcore_tiles import make_inputs as tiles_inputs

TARGET = "cuda:sm_90a"


def test_strips_apply():
    assert strips_apply(8192, 1, "float16") and strips_apply(512, 4, "bfloat16") and strips_apply(512, 64, "float16")
    assert compacts(1) and compacts(4) and not compacts(8) and not compacts(64)
    assert not strips_apply(512, 128, "float16")          # wider than the CTA's 64 columns
    assert not strips_apply(576, 3, "float16")            # mk not dividing the CTA's 64 columns
    assert not strips_apply(520, 1, "float16")            # K not a multiple of 64
    assert not strips_apply(512, 1, "float32")
    with pytest.raises(ValueError, match="K % 64"):
        strip_list_func(520, 1)


def _graph(m, k, n, micro_tile, out_dtype="float16"):
    from tvm import relax

    from pit_tvm.ops.matmul import emit_pit_matmul

    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType([m, k], "float16"))
    b = relax.Var("b", relax.TensorType([k, n], "float16"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(emit_pit_matmul(bb, a, b, micro_tile=micro_tile, target="cuda",
                                                 out_dtype=out_dtype))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("m", [1000, "symbolic"])
def test_one_pass_graph(m):
    """The strips kernel (one atomic add per CTA, the compaction for micro-tiles under 16 bytes)
    and the CSR pack replace the index and compaction kernels; with a symbolic row count the
    counter is zeroed per call.  nvcc compiles the op."""
    rows = tvm.tirx.Var("m", "int64") if m == "symbolic" else m
    text = _graph(rows, 512, 256, (32, 1))["main"].script()
    assert "pit_strips_" in text and "pit_compact_" not in text and "call_tir_inplace" in text
    assert text.index("pit_strips_") < text.index("pit_index_") < text.index("pit_kernel_")
    assert ("R.zeros" in text) == (m == "symbolic")
    wide = _graph(rows, 512, 256, (32, 64))["main"].script()
    strips_line = next(line for line in wide.splitlines() if "pit_strips_" in line)
    assert ", 512), dtype=\"float16\")]" not in strips_line     # read in place: no A out of the pass
    ex = build(_graph(rows, 512, 256, (32, 1)), "cuda")
    src = "\n".join(cuda_sources(ex))
    assert src.count("atomicAdd") == 1
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(ex, archs=("sm_90a",)) >= 1


def test_micro_tiles_across_ctas_keep_the_compaction_kernel():
    """mk not dividing the one pass's 64 columns (here 6): the index kernels, then the A
    compaction kernel of its own; nvcc compiles the op."""
    text = _graph(1000, 384, 256, (32, 6))["main"].script()
    assert "pit_compact_" in text and "pit_strips_" not in text
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(build(_graph(1000, 384, 256, (32, 6)), "cuda"), archs=("sm_90a",)) >= 1


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------
def _run_strips(a, mk, threshold, state=None):
    dev = tvm.cuda(0)
    m, k = a.shape
    g, mkt = strip_state_words(m), k // mk
    lister = build(tvm.IRModule({"main": strip_list_func(k, mk)}), TARGET)["main"]
    packer = build(tvm.IRModule({"main": strip_pack_func(k, mk, threshold)}), TARGET)["main"]
    state = state or tvm.runtime.tensor(np.zeros(g, np.float64), dev)
    cnt = tvm.runtime.empty((g,), "int32", dev)
    sids = tvm.runtime.empty((g * mkt,), "int32", dev)
    ac = tvm.runtime.tensor(np.full((m, k), np.nan, a.dtype), dev)   # unwritten columns stay NaN
    off = tvm.runtime.empty((g + 1,), "int32", dev)
    ids = tvm.runtime.empty((g * mkt,), "int32", dev)
    lister(tvm.runtime.tensor(a, dev), state, cnt, sids, *([ac] if compacts(mk) else []))
    packer(cnt, sids, off, ids)
    return off.numpy(), ids.numpy(), ac.numpy(), state


@pytest.mark.gpu
@pytest.mark.parametrize("m,mk,sparsity,threshold", [
    (1000, 1, 0.9, 0.9), (1000, 2, 0.5, None), (4096, 1, 0.99, 0.9), (300, 4, 0.9, None),
    (100, 1, 0.0, None), (1000, 1, 1.0, 0.9), (1000, 1, 0.0, 0.9), (1000, 8, 0.9, 0.9), (4096, 64, 0.5, 0.9),
    (4096, 64, 0.0, 0.9)])
def test_gpu_strip_index_and_compaction(m, mk, sparsity, threshold):
    k = 1024
    a, _, _, _ = tiles_inputs(m, k, 16, (32, mk), sparsity, "float16", seed=m + mk)
    ref_off, ref_ids = reference_tile_index(a.astype(np.float32), (128, mk), "row")
    g, mkt = strip_state_words(m), k // mk
    state = None
    for _ in range(2):       # the second call on the state the first one left (zero)
        off, ids, ac, state = _run_strips(a, mk, threshold, state)
        assert not state.numpy().any()
        if threshold is not None and ref_off[-1] > threshold * g * mkt:
            np.testing.assert_array_equal(off, np.arange(g + 1) * mkt)       # the dense fallback
            np.testing.assert_array_equal(ids, np.tile(np.arange(mkt), g))
            continue
        np.testing.assert_array_equal(off, ref_off)
        assert (ids[off[-1]:] == -1).all()
        for s in range(g):
            listed = ids[off[s]:off[s + 1]]
            np.testing.assert_array_equal(np.sort(listed), ref_ids[ref_off[s]:ref_off[s + 1]])
            if not compacts(mk):
                continue
            rows = slice(128 * s, min(128 * s + 128, m))
            cols = (listed[:, None] * mk + np.arange(mk)).ravel()
            np.testing.assert_array_equal(ac[rows, :cols.size], a[rows][:, cols])
            pad = -(-cols.size // 8) * 8                # zeros up to the next 16-byte chunk
            assert (ac[rows, cols.size:pad] == 0).all()


@pytest.mark.gpu
def test_gpu_strip_index_reads_the_rest_of_a_block():
    """mk = 64, one micro-tile a CTA: a block's rows past 32 are read only when its first 32 rows
    are zero.  Blocks whose one non-zero lies in the first 32 rows, past them, in the last row of
    the partial strip, or nowhere, are listed exactly when they hold it."""
    m, k = 1000, 1024
    a = np.zeros((m, k), np.float16)
    rng = np.random.default_rng(5)
    for g in range(-(-m // 128)):
        for c in range(k // 64):
            rows = min(128, m - 128 * g)
            where = (g + c) % 4          # 0: zero, 1: first 32 rows, 2: past them, 3: the block's last row
            r = {1: int(rng.integers(0, 32)), 2: int(rng.integers(32, rows)), 3: rows - 1}.get(where)
            if r is not None:
                a[128 * g + r, 64 * c + int(rng.integers(0, 64))] = 1.5
    ref_off, ref_ids = reference_tile_index(a.astype(np.float32), (128, 64), "row")
    off, ids, _, state = _run_strips(a, 64, None, None)
    np.testing.assert_array_equal(off, ref_off)
    for s in range(len(off) - 1):
        np.testing.assert_array_equal(np.sort(ids[off[s]:off[s + 1]]), ref_ids[ref_off[s]:ref_off[s + 1]])
    assert not state.numpy().any()


@pytest.mark.gpu
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("micro_tile", [(32, 1), (128, 2), (32, 64)])
def test_gpu_static_matmul(micro_tile, sparsity):
    """The op graph with a static row count (one-pass index (+ compaction), tiles kernel, dense
    fallback) against float32 numpy, M not a multiple of 128, two calls; the symbolic graph
    (a zeroed counter per call) is the op's, tested in test_wgmma.py."""
    from tvm import relax

    m, k, n = 1000, 512, 256
    a, b, _, _ = tiles_inputs(m, k, n, micro_tile, sparsity, "float16", seed=int(sparsity * 100))
    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(build(_graph(m, k, n, micro_tile, "float32"), "cuda"), dev)
    ref = a.astype(np.float32) @ b.astype(np.float32)
    for _ in range(2):
        got = vm["main"](tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev)).numpy()
        np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * max(np.abs(ref).max(), 1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("sparsity", [0.0, 0.9])
def test_gpu_compaction_kernel_path(sparsity):
    """(32, 6) micro-tiles (not dividing 64: index kernels + the A compaction kernel) through the
    op, against float32 numpy."""
    import pit_tvm

    m, k, n = 1000, 384, 256
    a, b, _, _ = tiles_inputs(m, k, n, (32, 6), sparsity, "float16", seed=7)
    op = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=(32, 6), target="cuda", out_dtype="float32")
    dev = tvm.cuda(0)
    got = op(tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev)).numpy()
    ref = a.astype(np.float32) @ b.astype(np.float32)
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * max(np.abs(ref).max(), 1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("micro_tile", [(32, 1), (32, 64)])
def test_gpu_op_index(micro_tile):
    """SparseMatmul.index runs the one pass (the strips kernel, then the pack) on the op's
    workspace: the CSR index of the reference, each strip's ids as a set, on two calls."""
    import pit_tvm

    m, k = 1000, 512
    a, _, _, _ = tiles_inputs(m, k, 16, micro_tile, 0.9, "float16", seed=5)
    op = pit_tvm.sparse_matmul(k, 256, "float16", micro_tile=micro_tile, target="cuda")
    ref_off, ref_ids = reference_tile_index(a.astype(np.float32), op.kernel_plan.micro_tile, "row")
    for _ in range(2):
        off, ids = (x.numpy() for x in op.index(tvm.runtime.tensor(a, tvm.cuda(0))))
        np.testing.assert_array_equal(off, ref_off)
        for s in range(len(off) - 1):
            np.testing.assert_array_equal(np.sort(ids[off[s]:off[s + 1]]), ref_ids[ref_off[s]:ref_off[s + 1]])
