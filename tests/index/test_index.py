"""On-device sparse index (pit_tvm.index) against the numpy reference (llvm), CUDA builds
checked with nvcc, and GPU runs (skipped without a device)."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pit_tvm.runtime.loader import numpy_dtype
from pit_tvm.index import (
    IndexBuilder,
    build_tile_index,
    expert_index_func,
    reference_expert_index,
    reference_seqlen_row_index,
    reference_tile_index,
    seqlen_row_index_func,
    tile_grid,
    tile_index_func,
    tiles_from_index,
)
from pit_tvm.index._tile_kernels import flag_geometry
from pit_tvm.index.tiles import _tile_index_func
from pit_tvm.nvcc import check_cuda_compiles, cuda_sources, find_nvcc
from pit_tvm.target import build

MICRO_TILES = [(1, 64), (32, 1), (32, 64), (1, "cols"), (4, 4)]
DTYPES = ["float32", "float16", "bfloat16", "bool"]
SPARSITIES = [0.0, 0.5, 0.9, 1.0]
COLS = 150  # divisible by none of 64, 4 (and 150 % 32 != 0)
ROWS = [33, 131]  # do not divide 32 or 4


def _mt(mt, cols):
    return (mt[0], cols if mt[1] == "cols" else mt[1])


def make_data(rows, cols, micro_tile, sparsity, dtype, rng):
    """Tile-level sparsity: each micro-tile is zero with probability ``sparsity``; a non-zero
    tile gets a few non-zero elements at random positions (inside the tensor)."""
    mr, mc = micro_tile
    ntr, ntc = tile_grid(rows, cols, micro_tile)
    x = np.zeros((rows, cols), dtype=np.float32)
    keep = rng.random((ntr, ntc)) >= sparsity
    tr, tc = np.nonzero(keep)
    h, w = np.minimum(mr, rows - tr * mr), np.minimum(mc, cols - tc * mc)   # (edge tiles are partial)
    # one non-zero in every kept tile, a second one in about half of them (vectorised: the GPU
    # tests make 4096 x 4096 patterns of up to 262,144 tiles)
    for chosen in (np.ones(len(tr), bool), rng.random(len(tr)) < 0.5):
        n = int(chosen.sum())
        r = tr[chosen] * mr + (rng.random(n) * h[chosen]).astype(np.int64)
        c = tc[chosen] * mc + (rng.random(n) * w[chosen]).astype(np.int64)
        x[r, c] = rng.uniform(0.5, 2.0, n) * rng.choice([-1, 1], n)
    if dtype == "bool":
        return x != 0
    return x.astype(numpy_dtype(dtype))


def dense_data(rows, cols, dtype, rng):
    x = rng.uniform(0.5, 2.0, size=(rows, cols)).astype(np.float32)
    return np.ones((rows, cols), bool) if dtype == "bool" else x.astype(numpy_dtype(dtype))


def one_group_sorted(offsets, ids):
    """A one-group index with its listed and unlisted ids each sorted: the CUDA kernel lists them
    in the order its CTAs finish (the reference and the CPU build list them ascending)."""
    offsets, ids = np.asarray(offsets), np.array(ids)
    if len(offsets) == 2:
        n = int(offsets[1])
        ids[:n].sort()
        ids[n:].sort()
    return ids


def check_tile_index(data, micro_tile, group, offsets, ids, reference=None):
    ro, ri = reference if reference is not None else reference_tile_index(data, micro_tile, group)
    offsets, ids = offsets.numpy(), ids.numpy()
    assert offsets.dtype == np.int32 and ids.dtype == np.int32
    np.testing.assert_array_equal(offsets, ro)
    np.testing.assert_array_equal(one_group_sorted(offsets, ids), ri)
    return offsets, ids


# ----------------------------------------------------------------------------- tile index
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("micro_tile", MICRO_TILES, ids=lambda m: f"{m[0]}x{m[1]}")
@pytest.mark.parametrize("group", ["row", "col"])
def test_tile_index_matches_reference(group, micro_tile, dtype):
    rng = np.random.default_rng(hash((group, str(micro_tile), dtype)) % 2**32)
    mt = _mt(micro_tile, COLS)
    for rows in ROWS:
        cases = [make_data(rows, COLS, mt, s, dtype, rng) for s in SPARSITIES]
        cases.append(dense_data(rows, COLS, dtype, rng))
        for data in cases:
            offsets, ids = build_tile_index(data, mt, group)
            offsets, ids = check_tile_index(data, mt, group, offsets, ids)
            if not np.any(data != 0):  # 100% sparse: nothing listed (one group: all unlisted)
                one_group = group == "col" and mt[1] == COLS
                unlisted = np.arange(len(ids)) if one_group else np.full(len(ids), -1)
                assert offsets[-1] == 0 and np.all(ids == unlisted) and np.all(offsets == 0)


@pytest.mark.parametrize("micro_tile", MICRO_TILES + [(3, 7), (2, "cols"), (1, 1)], ids=lambda m: f"{m[0]}x{m[1]}")
@pytest.mark.parametrize("group", ["row", "col"])
def test_tile_index_cuda_structure_on_cpu(group, micro_tile):
    """The CUDA kernel structure (thread per column, shared-memory tile OR, block scans) run on
    the CPU with serial thread loops: checks the GPU algorithm without a GPU."""
    rng = np.random.default_rng(7)
    for cols in (COLS, 600):  # 600 > 256 threads: several column steps per thread for whole rows
        mt = _mt(micro_tile, cols)
        f = _tile_index_func(cols, mt, group, "float16", "llvm", emulate_gpu=True)
        b = IndexBuilder(f, "llvm")
        for rows in (0, 1, 45, 131) if cols == COLS else (1, 45):
            for s in (0.0, 0.5, 0.9, 1.0):
                data = make_data(rows, cols, mt, s, "float16", rng)
                check_tile_index(data, mt, group, *b(data))


@pytest.mark.parametrize("micro_tile,cols,group", [((1, "cols"), 2056, "row"), ((1, "cols"), 2056, "col"),
                                                   ((32, 64), 150, "row"), ((8, 64), 600, "row")],
                         ids=["rows-2056", "rows-2056-one-group", "32x64-150", "8x64-600"])
def test_early_exit_reads_the_rest(micro_tile, cols, group):
    """Tiles whose lanes read an eighth of their loads first (``FlagGeometry.early``): a tile whose
    only non-zero lies in that eighth, past it, at its last element or in a partial tile at the
    edge is listed; a zero tile is not (the CUDA structure run on the CPU, and the CPU kernel).
    Whole rows grouped by column are one group: the one-kernel listing (``list_units``)."""
    mt = _mt(micro_tile, cols)
    assert flag_geometry(cols, mt[0], mt[1], "float16").early > 0
    rng = np.random.default_rng(11)
    rows = 3 * mt[0] + 1
    ntr, ntc = tile_grid(rows, cols, mt)
    data = np.zeros((rows, cols), np.float16)
    for tr in range(ntr):
        for tc in range(ntc):
            h, w = min(mt[0], rows - tr * mt[0]), min(mt[1], cols - tc * mt[1])
            where = (tr + tc) % 4      # 0: zero tile, 1: first rows / columns, 2: anywhere, 3: last element
            if where == 1:
                data[tr * mt[0], tc * mt[1] + int(rng.integers(0, min(w, 2)))] = 1.5
            elif where == 2:
                data[tr * mt[0] + int(rng.integers(0, h)), tc * mt[1] + int(rng.integers(0, w))] = -0.75
            elif where == 3:
                data[tr * mt[0] + h - 1, tc * mt[1] + w - 1] = 2.0
    for emulate in (True, False):
        b = IndexBuilder(_tile_index_func(cols, mt, group, "float16", "llvm", emulate_gpu=emulate), "llvm")
        for x in (data, np.zeros_like(data)):
            check_tile_index(x, mt, group, *b(x))


def reference_with_fallback(data, micro_tile, group, threshold):
    """The reference index, or the dense one (every tile listed) above ``threshold``."""
    ro, ri = reference_tile_index(data, micro_tile, group)
    cap, groups = len(ri), len(ro) - 1
    if threshold is not None and cap and float(ro[-1]) > threshold * cap:
        per = cap // groups
        ro = (np.arange(groups + 1) * per).astype(np.int32)
        ri = (np.arange(cap) % per).astype(np.int32)
    return ro, ri


@pytest.mark.parametrize("emulate", [False, True], ids=["cpu", "cuda_structure"])
@pytest.mark.parametrize("micro_tile", [(1, 64), (32, 1), (1, "cols"), (3, 7)], ids=lambda m: f"{m[0]}x{m[1]}")
@pytest.mark.parametrize("group", ["row", "col"])
def test_density_threshold_fallback(group, micro_tile, emulate):
    """density_threshold folds the dense fallback into the index kernels."""
    rng = np.random.default_rng(21)
    cols = 600
    mt = _mt(micro_tile, cols)
    for thr in (0.0, 0.5, 1.0):
        f = _tile_index_func(cols, mt, group, "float16", "llvm", emulate_gpu=emulate, density_threshold=thr)
        b = IndexBuilder(f, "llvm")
        for rows in (0, 1, 70):
            for s in (0.0, 0.3, 0.9, 1.0):
                data = make_data(rows, cols, mt, s, "float16", rng)
                check_tile_index(data, mt, group, *b(data), reference_with_fallback(data, mt, group, thr))
    with pytest.raises(ValueError, match="density_threshold"):
        tile_index_func(cols, mt, group, "float16", "llvm", density_threshold=1.5)


def test_flag_geometry():
    """The CUDA flag pass uses 16-byte loads and warp-wide tiles for the benchmark shapes."""
    from pit_tvm.index._tile_kernels import flag_geometry

    g = flag_geometry(4096, 1, 4096, "float16")  # whole rows: a warp per row
    assert (g.vec, g.lp, g.ni, g.tpv) == (8, 32, 16, 1)
    g = flag_geometry(4096, 1, 64, "float16")  # 8 lanes per tile
    assert (g.vec, g.lp, g.ni, g.tpv) == (8, 8, 1, 1) and g.u > 1
    g = flag_geometry(4096, 32, 1, "float16")  # column tiles: 8 per lane, walking 32 rows
    assert (g.vec, g.lp, g.tpv) == (8, 1, 8)
    g = flag_geometry(150, 3, 7, "float32")  # odd shapes: scalar loads
    assert g.vec == 1
    for cols, mt, dt in [(4096, (32, 64), "float16"), (600, (1, 1), "float32"), (8192, (1, 8192), "bfloat16")]:
        g = flag_geometry(cols, *mt, dt)
        assert g.chc % g.fpb == 0 and g.fpb == g.upb * g.tpv


def test_tile_index_many_chunks():
    """More flags than one scan block covers (chunks > 256 threads): every level of the scan."""
    rng = np.random.default_rng(1)
    data = (rng.random((700, 500)) < 0.3).astype(np.float32)
    for group in ("row", "col"):
        check_tile_index(data, (1, 1), group, *build_tile_index(data, (1, 1), group))
    f = _tile_index_func(500, (1, 1), "row", "float32", "llvm", emulate_gpu=True)
    check_tile_index(data, (1, 1), "row", *IndexBuilder(f, "llvm")(data))


def test_tile_index_rows_fewer_than_micro_tile_and_zero_rows():
    f = tile_index_func(COLS, (32, 64), "row", "float32", "llvm")
    b = IndexBuilder(f, "llvm")
    for rows in (0, 1, 5):
        data = np.zeros((rows, COLS), np.float32)
        if rows:
            data[rows - 1, COLS - 1] = 1.0
        check_tile_index(data, (32, 64), "row", *b(data))
    fc = IndexBuilder(tile_index_func(COLS, (32, 64), "col", "float32", "llvm"), "llvm")
    offsets, ids = fc(np.zeros((0, COLS), np.float32))
    assert offsets.shape == (4,) and ids.shape == (0,)
    np.testing.assert_array_equal(offsets.numpy(), np.zeros(4, np.int32))


def test_negative_zero_and_nan():
    data = np.zeros((8, 8), np.float32)
    data[0, 0] = -0.0
    data[5, 5] = np.nan
    offsets, ids = build_tile_index(data, (4, 4), "row")
    np.testing.assert_array_equal(tiles_from_index(offsets, ids, "row"), [[1, 1]])


def test_layout_and_tiles_from_index():
    data = np.zeros((10, 10), np.float32)
    data[0, 9] = data[9, 0] = data[4, 4] = data[5, 5] = 1
    # 4x4 tiles: (0,2), (2,0), (1,1)
    offsets, ids = build_tile_index(data, (4, 4), "row")
    assert offsets.numpy().tolist() == [0, 1, 2, 3]
    assert ids.numpy().tolist() == [2, 1, 0] + [-1] * 6
    np.testing.assert_array_equal(tiles_from_index(offsets, ids, "row"), [[0, 2], [1, 1], [2, 0]])
    offsets, ids = build_tile_index(data, (4, 4), "col")
    assert offsets.numpy().tolist() == [0, 1, 2, 3]
    assert ids.numpy().tolist() == [2, 1, 0] + [-1] * 6
    np.testing.assert_array_equal(tiles_from_index(offsets, ids, "col"), [[2, 0], [1, 1], [0, 2]])
    ro, ri = reference_tile_index(data, (4, 4), "col")
    assert tiles_from_index(ro, ri, "col").tolist() == [[2, 0], [1, 1], [0, 2]]


def test_determinism():
    rng = np.random.default_rng(3)
    data = make_data(131, COLS, (4, 4), 0.5, "float16", rng)
    a = [x.numpy().tobytes() for x in build_tile_index(data, (4, 4), "col")]
    b = [x.numpy().tobytes() for x in build_tile_index(tvm.runtime.tensor(data), (4, 4), "col")]
    assert a == b
    f = _tile_index_func(COLS, (4, 4), "col", "float16", "llvm", emulate_gpu=True)
    c = [x.numpy().tobytes() for x in IndexBuilder(f, "llvm")(data)]
    assert a == c


def test_prim_func_contract():
    f = tile_index_func(COLS, (32, 64), "row", "float16", "llvm")
    assert "global_symbol" in f.attrs
    bufs = list(f.params)
    assert len(bufs) == 3
    data, offsets, ids = bufs
    assert str(data.dtype) == "float16" and int(data.shape[1]) == COLS
    assert isinstance(data.shape[0], tvm.tirx.Var)  # symbolic rows, a whole dim
    assert str(offsets.dtype) == "int32" and str(ids.dtype) == "int32"
    fc = tile_index_func(COLS, (32, 64), "row", "float16", "cuda")
    assert bool(fc.attrs["tirx.is_scheduled"])


def _relax_module(target):
    from tvm import relax, tirx

    f = tile_index_func(100, (4, 4), "row", "float32", target)
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 100), "float32"))
    with bb.function("main", [x]):
        gv = bb.add_func(f, "tile_index")
        g = (n + 3) // 4
        out = bb.emit(
            relax.call_tir(gv, [x], [relax.TensorType((g + 1,), "int32"), relax.TensorType((g * 25,), "int32")])
        )
        bb.emit_func_output(out)
    return build(bb.get(), target)


def test_embeds_in_relax_call_tir():
    from tvm import relax

    vm = relax.VirtualMachine(_relax_module("llvm"), tvm.cpu())
    data = make_data(37, 100, (4, 4), 0.7, "float32", np.random.default_rng(5))
    offsets, ids = vm["main"](tvm.runtime.tensor(data))
    check_tile_index(data, (4, 4), "row", offsets, ids)


# ----------------------------------------------------------------------------- seqlen / experts
@pytest.mark.parametrize("max_len", [1, 7, 128])
def test_seqlen_row_index(max_len):
    rng = np.random.default_rng(max_len)
    b = IndexBuilder(seqlen_row_index_func(max_len, "llvm"), "llvm")
    for B in (0, 1, 5, 40):
        for lengths in (
            rng.integers(-2, max_len + 3, size=B),
            np.zeros(B),
            np.full(B, max_len),
        ):
            lengths = lengths.astype(np.int32)
            rows, count = b(lengths)
            rr, rc = reference_seqlen_row_index(lengths, max_len)
            np.testing.assert_array_equal(rows.numpy(), rr)
            np.testing.assert_array_equal(count.numpy(), rc)
    # several chunks
    lengths = rng.integers(0, max_len + 1, size=3000).astype(np.int32)
    rows, count = b(lengths)
    rr, rc = reference_seqlen_row_index(lengths, max_len)
    np.testing.assert_array_equal(rows.numpy(), rr)
    np.testing.assert_array_equal(count.numpy(), rc)


@pytest.mark.parametrize("num_experts,top_k", [(1, 1), (8, 2), (5, 3)])
def test_expert_index(num_experts, top_k):
    rng = np.random.default_rng(num_experts * 10 + top_k)
    b = IndexBuilder(expert_index_func(num_experts, top_k, "llvm"), "llvm")
    for ntok in (0, 1, 17, 1000):
        ids = rng.integers(-1, num_experts + 1, size=(ntok, top_k)).astype(np.int32)
        if ntok:
            ids[0, 0] = 100
        offsets, asg = b(ids)
        ro, ra = reference_expert_index(ids, num_experts)
        np.testing.assert_array_equal(offsets.numpy(), ro)
        np.testing.assert_array_equal(asg.numpy(), ra)
    ids = np.full((9, top_k), num_experts - 1, np.int32)  # all to the last expert
    offsets, asg = b(ids)
    assert offsets.numpy().tolist() == [0] * num_experts + [9 * top_k]
    assert asg.numpy().tolist() == list(range(9 * top_k))


# ----------------------------------------------------------------------------- fuzz
_EXPERT_BUILDS = {}


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    num_experts=st.sampled_from([1, 3, 64, 129]),
    top_k=st.sampled_from([1, 2, 6]),
    ntok=st.integers(0, 700),
    skew=st.sampled_from([0.0, 1.5, 3.0]),
    invalid=st.sampled_from([0.0, 0.05, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_fuzz_expert_index(num_experts, top_k, ntok, skew, invalid, seed):
    """Balanced to one hot expert (Zipf exponent ``skew``), ids outside [0, E), and several
    assignments a thread (T * k past the 256 threads of an expert's block)."""
    rng = np.random.default_rng(seed)
    key = (num_experts, top_k)
    if key not in _EXPERT_BUILDS:
        _EXPERT_BUILDS[key] = IndexBuilder(expert_index_func(num_experts, top_k, "llvm"), "llvm")
    weights = 1.0 / np.arange(1, num_experts + 1) ** skew
    ids = rng.choice(num_experts, size=(ntok, top_k), p=weights / weights.sum()).astype(np.int32)
    bad = rng.random(ids.shape) < invalid
    ids[bad] = rng.choice([-7, -1, num_experts, num_experts + 40], size=int(bad.sum()))
    offsets, asg = _EXPERT_BUILDS[key](ids)
    ro, ra = reference_expert_index(ids, num_experts)
    np.testing.assert_array_equal(offsets.numpy(), ro)
    np.testing.assert_array_equal(asg.numpy(), ra)


_FUZZ_COLS = [1, 5, 64, 100]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    cols=st.sampled_from(_FUZZ_COLS),
    rows=st.integers(1, 90),
    mt=st.sampled_from([(1, 1), (2, 3), (4, 4), (1, 64), (8, 100)]),
    group=st.sampled_from(["row", "col"]),
    dtype=st.sampled_from(["float32", "bool"]),
    density=st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_fuzz_tile_index(cols, rows, mt, group, dtype, density, seed):
    mr, mc = min(mt[0], rows), min(mt[1], cols)
    rng = np.random.default_rng(seed)
    mask = rng.random((rows, cols)) < density
    data = mask if dtype == "bool" else (mask * rng.uniform(0.5, 2, size=mask.shape)).astype(np.float32)
    check_tile_index(data, (mr, mc), group, *build_tile_index(data, (mr, mc), group))


# ----------------------------------------------------------------------------- bad input
def test_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        tile_index_func(64, (1, 8), "row", "int32", "llvm")
    with pytest.raises(ValueError, match="dtype"):
        tile_index_func(64, (1, 8), "row", "float64", "llvm")
    with pytest.raises(ValueError, match="micro_tile"):
        tile_index_func(64, (0, 8), "row", "float32", "llvm")
    with pytest.raises(ValueError, match="micro_tile"):
        tile_index_func(64, (1, -8), "row", "float32", "llvm")
    with pytest.raises(ValueError, match="micro_tile"):
        tile_index_func(64, (4,), "row", "float32", "llvm")
    with pytest.raises(TypeError, match="micro_tile"):     # a float side is not truncated
        tile_index_func(64, (1.5, 8), "row", "float32", "llvm")
    with pytest.raises(ValueError, match="larger"):
        tile_index_func(64, (1, 65), "row", "float32", "llvm")
    with pytest.raises(ValueError, match="group"):
        tile_index_func(64, (1, 8), "diag", "float32", "llvm")
    with pytest.raises(ValueError, match="cols"):
        tile_index_func(0, (1, 8), "row", "float32", "llvm")
    with pytest.raises(ValueError, match="max_len"):
        seqlen_row_index_func(0, "llvm")
    with pytest.raises(ValueError, match="num_experts"):
        expert_index_func(0, 2, "llvm")
    with pytest.raises(ValueError, match="top_k"):
        expert_index_func(4, 0, "llvm")


def test_bad_call_inputs():
    x = np.ones((10, 64), np.float32)
    with pytest.raises(ValueError, match="larger"):
        build_tile_index(x, (11, 8))
    with pytest.raises(ValueError, match="2-D"):
        build_tile_index(np.ones((2, 3, 4), np.float32), (1, 1))
    with pytest.raises(ValueError, match="dtype"):
        build_tile_index(x.astype(np.int64), (1, 8))
    b = IndexBuilder(tile_index_func(64, (1, 8), "row", "float32", "llvm"), "llvm")
    with pytest.raises(ValueError, match="rank"):
        b(np.ones(64, np.float32))
    with pytest.raises(ValueError, match="axis 1"):
        b(np.ones((4, 63), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        b(np.ones((4, 64), np.float16))
    with pytest.raises(ValueError, match="input"):
        b(x, x)
    e = IndexBuilder(expert_index_func(4, 2, "llvm"), "llvm")
    with pytest.raises(ValueError, match="axis 1"):
        e(np.zeros((3, 3), np.int32))


# ----------------------------------------------------------------------------- CUDA
def _cuda_funcs():
    fs = [tile_index_func(COLS, _mt(mt, COLS), g, "float16", "cuda") for mt in MICRO_TILES for g in ("row", "col")]
    fs += [tile_index_func(600, mt, "row", dt, "cuda") for mt, dt in [((1, 600), "bfloat16"), ((3, 7), "bool"), ((2, 64), "float32")]]
    fs += [tile_index_func(4096, mt, g, "float16", "cuda", density_threshold=0.9)
           for mt, g in [((1, 4096), "col"), ((1, 64), "row"), ((32, 1), "row"), ((32, 64), "row"), ((32, 1), "col")]]
    fs += [seqlen_row_index_func(128, "cuda"), expert_index_func(8, 2, "cuda")]
    return fs


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")
def test_cuda_builds_compile_with_nvcc():
    for f in _cuda_funcs():
        name = str(f.attrs["global_symbol"])
        ex = build(tvm.IRModule({name: f}), "cuda")
        src = "\n".join(cuda_sources(ex))
        assert "threadIdx.x" in src and "blockIdx.x" in src and "__syncthreads" in src
        if "pit.index.state" in f.attrs:   # one group: flags and listing in one kernel, one
            # atomic add per CTA for its positions (declaration + definition)
            assert "atomicAdd" in src and src.count("__global__ void") == 2
        else:
            assert "atomic" not in src  # deterministic: flag + scan + compaction
        if name.startswith("pit_tile_index") and "_c4096_" in name and "pit.index.state" not in f.attrs:
            assert "uint4" in src  # 16-byte loads
            separate_count = "_col_" in name and "t32x1" in name  # column-major flat order
            if not separate_count:
                assert "__shfl_xor_sync" in src  # warp reductions of tiles / counts
            # flags(+counts) and compaction: 2 kernels (3 with a separate count kernel)
            assert src.count("__global__ void") <= 2 * (3 if separate_count else 2)
        assert check_cuda_compiles(ex, archs=("sm_80", "sm_90")) >= 2
    # embedded in a Relax module (call_tir): already scheduled, dlight leaves it alone
    assert check_cuda_compiles(_relax_module("cuda"), archs=("sm_80", "sm_90")) >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("group", ["row", "col"])
@pytest.mark.parametrize("micro_tile", MICRO_TILES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_gpu_tile_index(group, micro_tile):
    rng = np.random.default_rng(11)
    for dtype in DTYPES:
        mt = _mt(micro_tile, COLS)
        b = IndexBuilder(tile_index_func(COLS, mt, group, dtype, "cuda"), "cuda")
        for rows in (0, 1, 131, 4099):
            for s in SPARSITIES:
                data = make_data(rows, COLS, mt, s, dtype, rng)
                out1 = [o.numpy() for o in b(data)]
                out2 = b(data)
                check_tile_index(data, mt, group, *out2)
                assert np.array_equal(out1[0], out2[0].numpy())
                assert np.array_equal(one_group_sorted(*out1), one_group_sorted(out2[0].numpy(), out2[1].numpy()))
    big = (rng.random((4096, 4096)) < 0.001).astype(np.float16)
    b = IndexBuilder(tile_index_func(4096, (1, 64), group, "float16", "cuda"), "cuda")
    check_tile_index(big, (1, 64), group, *b(big))


@pytest.mark.gpu
def test_gpu_seqlen_and_experts():
    rng = np.random.default_rng(12)
    b = IndexBuilder(seqlen_row_index_func(128, "cuda"), "cuda")
    for B in (0, 3, 3000):
        lengths = rng.integers(-2, 131, size=B).astype(np.int32)
        rows, count = b(lengths)
        rr, rc = reference_seqlen_row_index(lengths, 128)
        np.testing.assert_array_equal(rows.numpy(), rr)
        np.testing.assert_array_equal(count.numpy(), rc)
    for num_experts, top_k in ((8, 2), (128, 1), (64, 6)):
        e = IndexBuilder(expert_index_func(num_experts, top_k, "cuda"), "cuda")
        for ntok in (0, 5, 4096, 5000):
            for hot in (False, True):   # balanced, or every other assignment to expert 1
                ids = rng.integers(-1, num_experts + 1, size=(ntok, top_k)).astype(np.int32)
                if hot:
                    ids[::2] = 1
                offsets, asg = e(ids)
                ro, ra = reference_expert_index(ids, num_experts)
                np.testing.assert_array_equal(offsets.numpy(), ro)
                np.testing.assert_array_equal(asg.numpy(), ra)


@pytest.mark.gpu
@pytest.mark.parametrize("micro_tile,group", [((1, 4096), "col"), ((1, 64), "row"), ((32, 1), "row"),
                                              ((32, 64), "row"), ((32, 1), "col")])
def test_gpu_bench_shapes_and_fallback(micro_tile, group):
    """The benchmark shapes (16-byte loads, fused counts) and the folded dense fallback on the GPU."""
    rng = np.random.default_rng(13)
    for thr in (None, 0.9):
        b = IndexBuilder(tile_index_func(4096, micro_tile, group, "float16", "cuda", density_threshold=thr), "cuda")
        for rows in (4096, 4000, 33):
            for s in (0.0, 0.5, 0.99, 1.0):
                data = make_data(rows, 4096, micro_tile, s, "float16", rng)
                ref = reference_with_fallback(data, micro_tile, group, thr)
                for _ in range(2):   # the one-group index's counters are zero again after a call
                    check_tile_index(data, micro_tile, group, *b(data), ref)


@pytest.mark.parametrize("layout", ["misaligned", "fortran", "strided"])
def test_build_tile_index_takes_tvm_views_of_any_layout(layout):
    """A TVM tensor the kernels cannot take as it is (a misaligned or strided DLPack view) is
    copied compactly first, not passed through (it crashed or was misread)."""
    import tvm_ffi

    from test_op_api_fuzz import in_layout

    rng = np.random.default_rng(3)
    data = (rng.random((40, 24)) * (rng.random((40, 1)) < 0.4)).astype(np.float32)
    view = tvm_ffi.from_dlpack(in_layout(data, layout))
    got = build_tile_index(view, (1, 24), "row")
    want = build_tile_index(data, (1, 24), "row")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w.numpy())
