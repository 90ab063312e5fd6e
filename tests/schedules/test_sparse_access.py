"""SRead/SWrite primitives on blocks other than matmul, rule checks, and the atomic form."""
import numpy as np
import pytest
import tvm
from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.index import reference_tile_index
from pit_tvm.nvcc import check_cuda_compiles, find_nvcc
from pit_tvm.schedules.sparse_access import PitIndex, apply_pit_axis, lower_pit, sread, swrite
from pit_tvm.target import build


@T.prim_func(s_tir=True)
def relu_scale(a: T.handle, s: T.handle, c: T.handle):
    T.func_attr({"global_symbol": "relu_scale", "tirx.noalias": True})
    m = T.int64()
    A = T.match_buffer(a, (m, 24), "float32")
    S = T.match_buffer(s, (24,), "float32")
    C = T.match_buffer(c, (m, 24), "float32")
    for i, j in T.grid(m, 24):
        with T.sblock("relu_scale"):
            vi, vj = T.axis.remap("SS", [i, j])
            C[vi, vj] = T.max(A[vi, vj], T.float32(0)) * S[vj]


@T.prim_func(s_tir=True)
def row_sum(a: T.handle, c: T.handle):
    T.func_attr({"global_symbol": "row_sum", "tirx.noalias": True})
    m = T.int64()
    A = T.match_buffer(a, (m, 40), "float32")
    C = T.match_buffer(c, (m,), "float32")
    for i, k in T.grid(m, 40):
        with T.sblock("row_sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                C[vi] = T.float32(0)
            C[vi] = C[vi] + A[vi, vk]


@T.prim_func(s_tir=True)
def shifted(a: T.handle, c: T.handle):
    T.func_attr({"global_symbol": "shifted", "tirx.noalias": True})
    A = T.match_buffer(a, (33,), "float32")
    C = T.match_buffer(c, (32,), "float32")
    for i in range(32):
        with T.sblock("shifted"):
            vi = T.axis.remap("S", [i])
            C[vi] = A[vi + 1]


def schedule_of(func, name):
    sch = tvm.s_tir.Schedule(tvm.IRModule({name: func}))
    sch.work_on(name)
    return sch


def run_cpu(func, *arrays):
    ex = build(tvm.IRModule({"main": lower_pit(func, gpu=False)}), "llvm")
    dev = tvm.cpu()
    tensors = [tvm.runtime.tensor(x, dev) for x in arrays]
    ex["main"](*tensors)
    return tensors[-1].numpy()


def test_spatial_axis_on_elementwise_block():
    """Rows of an elementwise block: SRead of A and SWrite of C through a row index."""
    sch = schedule_of(relu_scale, "relu_scale")
    m = relu_scale.params[0].shape[0]
    index = PitIndex.create("rows", m, tirx.const(1, "int64"), micro=1)
    sch = apply_pit_axis(sch, "relu_scale", "vi", index)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((19, 24)).astype(np.float32)
    a[rng.random(19) < 0.6] = 0
    a[:, 3] = np.where(a[:, 3] > 0, a[:, 3], 0)
    s = rng.standard_normal(24).astype(np.float32)
    offsets, ids = reference_tile_index(a, (1, 24), "col")
    out = run_cpu(sch.mod["relu_scale"], a, s, offsets, ids, np.full((19, 24), 7, np.float32))
    np.testing.assert_allclose(out, np.maximum(a, 0) * s, rtol=1e-6)


def test_reduction_axis_grouped_by_rows():
    """A row sum walks only each row's non-zero 8-wide k tiles (SRead along the reduction)."""
    sch = schedule_of(row_sum, "row_sum")
    m = row_sum.params[0].shape[0]
    index = PitIndex.create("k", m * 5, m, micro=8, group_axis="vi", group_micro=1)
    sch = apply_pit_axis(sch, "row_sum", "vk", index)
    rng = np.random.default_rng(1)
    mask = rng.random((13, 5)) < 0.4
    a = (rng.standard_normal((13, 40)) * np.repeat(mask, 8, axis=1)).astype(np.float32)
    offsets, ids = reference_tile_index(a, (1, 8), "row")
    out = run_cpu(sch.mod["row_sum"], a, offsets, ids, np.zeros(13, np.float32))
    np.testing.assert_allclose(out, a.sum(1), rtol=1e-5, atol=1e-5)


def test_rejects_axis_that_is_not_pit():
    sch = schedule_of(shifted, "shifted")
    index = PitIndex.create("x", 32, tirx.const(1, "int64"), micro=1)
    with pytest.raises(ValueError, match="not a PIT axis"):
        sread(sch, "shifted", "A", "vi", index)


def test_bad_names():
    sch = schedule_of(relu_scale, "relu_scale")
    index = PitIndex.create("x", 8, tirx.const(1, "int64"), micro=1)
    with pytest.raises(ValueError, match="no iteration variable 'vz'"):
        sread(sch, "relu_scale", "A", "vz", index)
    with pytest.raises(ValueError, match="does not access a buffer named 'Q'"):
        sread(sch, "relu_scale", "Q", "vi", index)
    with pytest.raises(ValueError, match="unknown SWrite mode"):
        swrite(sch, "relu_scale", "C", "vi", index, mode="xor")
    with pytest.raises(ValueError, match="reduction axis"):
        swrite(schedule_of(row_sum, "row_sum"), "row_sum", "C", "vk", index)


def test_accumulate_mode_adds_into_output():
    """mode="accumulate": C[orig(p)] += block result (what split reductions need)."""
    sch = schedule_of(relu_scale, "relu_scale")
    m = relu_scale.params[0].shape[0]
    index = PitIndex.create("rows", m, tirx.const(1, "int64"), micro=1)
    sch = sread(sch, "relu_scale", "A", "vi", index)
    sch = swrite(sch, "relu_scale", "C", "vi", index, mode="accumulate")
    a = np.random.default_rng(2).standard_normal((9, 24)).astype(np.float32)
    s = np.ones(24, np.float32)
    offsets, ids = reference_tile_index(a, (1, 24), "col")
    out = run_cpu(sch.mod["relu_scale"], a, s, offsets, ids, np.zeros((9, 24), np.float32))
    np.testing.assert_allclose(out, np.maximum(a, 0), rtol=1e-6)


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
def test_atomic_add_swrite_compiles_for_cuda():
    """The atomic form (a permuted reduction split across thread blocks) emits atomicAdd."""
    sch = schedule_of(relu_scale, "relu_scale")
    m = relu_scale.params[0].shape[0]
    index = PitIndex.create("rows", m, tirx.const(1, "int64"), micro=1)
    sch = sread(sch, "relu_scale", "A", "vi", index)
    sch = swrite(sch, "relu_scale", "C", "vi", index, mode="atomic_add")
    for name in ("A_sread", "relu_scale", "C_swrite"):
        blk = sch.get_sblock(name)
        loops = sch.get_loops(blk)
        bx, tx = sch.split(sch.fuse(*loops), [None, 128])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    func = lower_pit(sch.mod["relu_scale"], gpu=True).with_attr("tirx.is_scheduled", True)
    ex = build(tvm.IRModule({"main": func}), "cuda")
    from pit_tvm.nvcc import cuda_sources

    assert "atomicAdd" in "\n".join(cuda_sources(ex))
    assert check_cuda_compiles(ex, archs=("sm_80", "sm_90")) >= 2
