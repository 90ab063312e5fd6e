"""Argument checks of the public API: every bad argument of ``pit_tvm.sparse_matmul`` (at
construction and per call), ``op.index``, ``choose_micro_tile`` and ``find_pit_rules`` is a
TypeError (wrong kind of value) or ValueError (wrong value) naming the argument and what it
expects, raised before any build; the spellings a user may reasonably pass (numpy ints and
dtypes, ``"RxC"`` micro-tiles) are accepted and mean what they say."""
import ml_dtypes
import numpy as np
import pytest
import tvm

import pit_tvm
from pit_tvm.ops.matmul import SUPPORTED_DTYPES
from pit_tvm.tuning.choose import choose_micro_tile

K, N = 64, 32


@pytest.fixture(scope="module")
def op():
    return pit_tvm.sparse_matmul(K, N, "float32", micro_tile=(1, K), target="llvm")


@pytest.fixture(scope="module")
def ab():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((10, K)).astype("float32")
    a[rng.random((10, K)) < 0.5] = 0
    return a, rng.standard_normal((K, N)).astype("float32")


# -- construction ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(k=64.0), TypeError, r"K must be a positive int, got 64\.0 \(float\)"),
    (dict(k=64.5), TypeError, "K must be a positive int"),
    (dict(k=True), TypeError, r"K must be a positive int, got True \(bool\)"),
    (dict(k="64"), TypeError, "K must be a positive int"),
    (dict(k=None), TypeError, "K must be a positive int"),
    (dict(k=0), ValueError, "K must be a positive int, got 0"),
    (dict(n=-3), ValueError, "N must be a positive int, got -3"),
    (dict(n=np.float32(32)), TypeError, "N must be a positive int"),
    (dict(dtype="int8"), ValueError, "unsupported dtype 'int8': PIT matmul supports float32, float16, bfloat16"),
    (dict(dtype=np.float64), ValueError, "unsupported dtype 'float64'"),
    (dict(dtype=None), TypeError, "dtype must be a dtype name"),
    (dict(dtype=3), TypeError, "dtype must be a dtype name"),
    (dict(out_dtype="int32"), ValueError, "unsupported out_dtype 'int32': use one of float32, float16, bfloat16"),
    (dict(micro_tile=64), TypeError, r"micro_tile must be a pair of positive ints .* got 64 \(int\)"),
    (dict(micro_tile=None), TypeError, "micro_tile must be a pair of positive ints"),
    (dict(micro_tile=(1.5, 64)), TypeError, r"micro_tile must be a pair .* \(element types float, int\)"),
    (dict(micro_tile=(1, 64.0)), TypeError, "micro_tile must be a pair of positive ints"),
    (dict(micro_tile=(True, 64)), TypeError, "micro_tile must be a pair of positive ints"),
    (dict(micro_tile=(1, 2, 3)), ValueError, "micro_tile must be a pair .* got 3 values"),
    (dict(micro_tile="1 by 64"), ValueError, "'RxC' string"),
    (dict(micro_tile=(0, 4)), ValueError, "both sides must be positive"),
    (dict(micro_tile=(1, K + 1)), ValueError, r"does not fit the PIT axis K=64: its width 65 exceeds K"),
    (dict(target="foo"), ValueError, "unknown target 'foo'"),
    (dict(target=3), TypeError, "target must be a str, dict or tvm.target.Target"),
    (dict(target={"kind": "no-such-kind"}), ValueError, "not a valid TVM target"),
    (dict(target={"kind": "c"}), ValueError, "builds for 'llvm' or 'cuda' targets, not 'c'"),
    (dict(target="cuda:ampere"), ValueError, "target 'cuda:ampere' is not a valid TVM target.*ampere"),
    (dict(target="cuda:sm_new"), ValueError, "unknown CUDA arch 'sm_new'"),
    (dict(density_threshold=1.5), ValueError, "density_threshold must be in"),
    (dict(density_threshold=-0.1), ValueError, "density_threshold must be in"),
    (dict(density_threshold=float("nan")), ValueError, "density_threshold must be in"),
    (dict(density_threshold="0.5"), TypeError, "density_threshold must be a number in"),
    (dict(density_threshold=True), TypeError, "density_threshold must be a number in"),
    (dict(tuning_log=3), TypeError, "tuning_log must be a path"),
])
def test_constructor_errors_name_the_argument(kwargs, error, match):
    args = dict(k=K, n=N, dtype="float32", micro_tile=(1, 64), target="llvm")
    args.update(kwargs)
    with pytest.raises(error, match=match):
        pit_tvm.sparse_matmul(**args)


def test_supported_dtypes_are_the_ones_listed():
    assert SUPPORTED_DTYPES == ("float32", "float16", "bfloat16")


def test_numpy_spellings_are_accepted(ab):
    """numpy ints for K and N, a numpy dtype, an ``"RxC"`` micro-tile and a numpy threshold
    build the op they name."""
    a, b = ab
    op = pit_tvm.sparse_matmul(np.int64(K), np.int32(N), np.float32, micro_tile="1x64",
                               density_threshold=np.float64(0.5), out_dtype=np.dtype("float32"))
    assert (op.k, op.n, op.dtype, op.out_dtype, op.micro_tile) == (K, N, "float32", "float32", (1, 64))
    assert type(op.k) is int and op.density_threshold == 0.5
    np.testing.assert_allclose(op(a, b), a @ b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("spelling, name", [(np.float16, "float16"), (ml_dtypes.bfloat16, "bfloat16"),
                                            (np.dtype("float32"), "float32"), ("float16", "float16")])
def test_dtype_spellings(spelling, name):
    from pit_tvm._args import dtype_name

    assert dtype_name(spelling) == name


@pytest.mark.parametrize("tile, want", [((32, 64), (32, 64)), ([1, 8], (1, 8)), (np.array([4, 2]), (4, 2)),
                                        ("32x1", (32, 1)), (" 2 X 4 ", (2, 4))])
def test_micro_tile_spellings(tile, want):
    from pit_tvm._args import micro_tile_pair

    assert micro_tile_pair(tile) == want


# -- per call -------------------------------------------------------------------------------------------
def test_a_errors(op, ab):
    a, b = ab
    with pytest.raises(ValueError, match=r"A must have shape \(M, 64\) \(2-D, K=64 columns\), got \(64,\)"):
        op(a[0], b)
    with pytest.raises(ValueError, match=r"A must have shape \(M, 64\).*got \(1, 10, 64\)"):
        op(a[None], b)
    with pytest.raises(ValueError, match=r"A must have shape \(M, 64\).*got \(10, 32\)"):
        op(a[:, :32], b)
    with pytest.raises(ValueError, match="A: dtype float64 given, float32 expected"):
        op(a.astype(np.float64), b)
    with pytest.raises(ValueError, match="A: dtype float16 given, float32 expected"):
        op(tvm.runtime.tensor(a.astype(np.float16)), b)
    with pytest.raises(TypeError, match="A must be a numpy array, a DLPack tensor"):
        op([["x"] * K], b)
    with pytest.raises(TypeError, match="got None"):
        op(None, b)


def test_b_errors(op, ab):
    a, b = ab
    with pytest.raises(ValueError, match=r"B must have shape \(64, 32\) \(K, N\), got \(32, 64\)"):
        op(a, np.ascontiguousarray(b.T))
    with pytest.raises(ValueError, match=r"B must have shape \(64, 32\).*got \(64,\)"):
        op(a, b[:, 0])
    with pytest.raises(ValueError, match="B: dtype float16 given, float32 expected"):
        op(a, b.astype(np.float16))


def test_out_errors(op, ab):
    a, b = ab
    with pytest.raises(ValueError, match=r"out must have shape \(10, 32\) \(A's rows, N\), got \(11, 32\)"):
        op(a, b, out=np.zeros((11, N), np.float32))
    with pytest.raises(ValueError, match=r"out must have shape \(10, 32\).*got \(32, 10\)"):
        op(a, b, out=tvm.runtime.empty((N, 10), "float32"))
    with pytest.raises(ValueError, match="out: dtype float64 given, float32 expected"):
        op(a, b, out=np.zeros((10, N), np.float64))
    with pytest.raises(ValueError, match="out: dtype float16 given, float32 expected"):
        op(a, b, out=tvm.runtime.empty((10, N), "float16"))
    read_only = np.zeros((10, N), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out is a read-only numpy array"):
        op(a, b, out=read_only)
    with pytest.raises(TypeError, match="out must be a numpy array, a TVM tensor or a DLPack tensor, got list"):
        op(a, b, out=[[0.0] * N] * 10)


def test_out_is_checked_before_the_op_runs(op, ab):
    """A bad out= leaves nothing half-done: the error comes before C is computed (a good out of
    the same call afterwards holds the result)."""
    a, b = ab
    out = np.full((10, N), np.nan, np.float32)
    with pytest.raises(ValueError):
        op(a, b[:, :N - 1], out=out)
    assert np.isnan(out).all()
    assert op(a, b, out=out) is out
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-4)


def test_index_errors(op, ab):
    a, _ = ab
    with pytest.raises(ValueError, match=r"A must have shape \(M, 64\)"):
        op.index(a[:, :10])
    with pytest.raises(ValueError, match="A: dtype float64 given"):
        op.index(a.astype(np.float64))


@pytest.mark.gpu
def test_tensor_on_another_device(op, ab):
    a, b = ab
    with pytest.raises(ValueError, match=r"A is on cuda.*the op runs on cpu"):
        op(tvm.runtime.tensor(a, tvm.cuda(0)), b)


# -- choose_micro_tile, find_pit_rules -----------------------------------------------------------------
MASK = np.zeros((16, 16), bool)
MASK[:4, :8] = True
TABLE = {(1, 8): {0.0: 0.0, 1.0: 1.0}, (4, 8): {0.0: 0.0, 1.0: 1.0}}


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(candidates=(4, 8)), TypeError, r"candidates must be a list of micro-tiles.*pass \[\(4, 8\)\]"),
    (dict(candidates=None), TypeError, "candidates must be a list of micro-tiles"),
    (dict(candidates=[(1.5, 8)]), TypeError, r"candidates\[0\] must be a pair of positive ints"),
    (dict(candidates=[(1, 8), (True, 8)]), TypeError, r"candidates\[1\] must be a pair of positive ints"),
    (dict(dense_time="1"), TypeError, "dense_time must be a number of seconds"),
    (dict(dense_time=True), TypeError, "dense_time must be a number of seconds"),
])
def test_choose_micro_tile_errors(kwargs, error, match):
    args = dict(candidates=[(1, 8), (4, 8)], latency=TABLE, dense_time=1.0)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        choose_micro_tile(MASK, **args)


def test_choose_micro_tile_reads_a_bfloat16_dlpack_sample():
    """numpy cannot import bfloat16 through DLPack; the sample is read through TVM instead."""
    sample = tvm.runtime.tensor(MASK.astype(ml_dtypes.bfloat16))
    got = choose_micro_tile(sample, [(1, 8), (4, 8)], TABLE, dense_time=1.0)
    want = choose_micro_tile(MASK, [(1, 8), (4, 8)], TABLE, dense_time=1.0)
    assert got == want and got.coverage[(4, 8)] == 32 / 256


def test_find_pit_rules_block_must_be_a_name():
    func = pit_tvm.ops.matmul.matmul_workload(8, 8, "float32", "float32")
    with pytest.raises(TypeError, match="block must be an sblock's name"):
        pit_tvm.find_pit_rules(func, block=3)
    with pytest.raises(ValueError, match="no sblock named 'nope'"):
        pit_tvm.find_pit_rules(func, block="nope")
    assert [r.axis for r in pit_tvm.find_pit_rules(func, block="matmul")["matmul"]] == ["vi", "vj", "vk"]
