"""Fuzz of the public op API ``pit_tvm.sparse_matmul`` over what a user may pass, against numpy.

Inputs in every layout TVM does not take as it is (Fortran order, strided and reversed views,
data not 64-byte aligned) from every producer (numpy, a non-numpy DLPack producer, a TVM view
of such memory, a list; torch where installed), ``out=`` in the same layouts, shapes with
tails (M, K, N not multiples of the micro-tile; M = 0 and 1), all-zero and fully dense A,
NaN/Inf in A (they must propagate as in numpy: a NaN or Inf makes its micro-tile non-zero).
The ops are built once per (K, N, dtype, micro-tile) and cached (:func:`op_for`).
NaN/Inf in B are not fuzzed here: a skipped all-zero micro-tile of A contributes exactly 0
(its own tests decide that semantics).
"""
import numpy as np
import pytest
import tvm
import tvm_ffi
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pit_tvm
from pit_tvm.runtime.loader import numpy_dtype
from pit_tvm.runtime.loader import dlpack_to_tvm, host_view, tvm_takes_as_is

#: (K, N, dtype, micro-tile, out_dtype): whole rows (mr 1 and 2, K odd), tiles with tails along
#: K (100 = 64 + 36), small tiles, one column along K, fp16 into fp32
CONFIGS = [
    (64, 32, "float32", (1, 64), None),
    (100, 20, "float32", (32, 64), None),
    (33, 9, "float32", (2, 33), None),
    (48, 24, "float16", (4, 8), None),
    (40, 16, "bfloat16", (3, 1), None),
    (48, 24, "float16", (8, 16), "float32"),
]
_OPS = {}


def op_for(config):
    if config not in _OPS:
        k, n, dtype, micro_tile, out_dtype = config
        _OPS[config] = pit_tvm.sparse_matmul(k, n, dtype, micro_tile=micro_tile, target="llvm", out_dtype=out_dtype)
    return _OPS[config]


# -- layouts ----------------------------------------------------------------------------------
LAYOUTS = ("aligned", "misaligned", "fortran", "strided", "reversed")


def aligned_empty(shape, dtype, offset_bytes=0):
    """An uninitialised C-contiguous array whose data starts ``offset_bytes`` after a 64-byte
    boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + 64 + offset_bytes, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset_bytes
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def in_layout(x, layout, offset_elems=1):
    """``x``'s values in a new array of ``layout``: ``aligned`` (what TVM takes as it is),
    ``misaligned`` (C-contiguous, ``offset_elems`` elements past a 64-byte boundary),
    ``fortran``, ``strided`` (every 2nd row and 3rd column of a larger buffer), ``reversed``
    (negative strides)."""
    if layout == "aligned":
        out = aligned_empty(x.shape, x.dtype)
    elif layout == "misaligned":
        out = aligned_empty(x.shape, x.dtype, offset_elems * x.dtype.itemsize)
    elif layout == "fortran":
        out = np.empty(x.shape, x.dtype, order="F")
    elif layout == "strided":
        out = np.zeros((2 * x.shape[0] + 1, 3 * x.shape[1] + 2), x.dtype)[1::2, 2::3]
    elif layout == "reversed":
        out = np.empty(x.shape, x.dtype)[::-1, ::-1]
    else:
        raise ValueError(layout)
    out[...] = x
    return out


class DLPackProducer:
    """A DLPack tensor that is no numpy array (as jax / cupy / torch are to the op)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def produce(x, kind):
    """``x`` (a numpy array of some layout) as ``kind``: ``numpy``, ``dlpack`` (a non-numpy
    producer of the same memory), ``tvm_view`` (a TVM tensor over the same memory, as
    ``tvm_ffi.from_dlpack`` without checks makes), ``tvm`` (a fresh TVM tensor), ``list``."""
    if kind == "numpy":
        return x
    if kind == "dlpack":
        return DLPackProducer(x)
    if kind == "tvm_view":
        return tvm_ffi.from_dlpack(x)
    if kind == "tvm":
        return tvm.runtime.tensor(np.ascontiguousarray(x))
    if kind == "list":
        return x.tolist()
    raise ValueError(kind)


def host(c):
    return c.numpy() if isinstance(c, tvm.runtime.Tensor) else np.asarray(c)


def reference(a, b, out_dtype):
    """numpy's ``a @ b`` in float64 of the (already rounded) inputs, rounded to ``out_dtype``."""
    with np.errstate(invalid="ignore", over="ignore"):
        ref = a.astype(np.float64) @ b.astype(np.float64)
        return ref.astype(numpy_dtype(out_dtype)).astype(np.float64)


def assert_matches(got, a, b, out_dtype):
    ref = reference(a, b, out_dtype)
    got = host(got).astype(np.float64)
    assert got.shape == ref.shape
    half = out_dtype != "float32"
    tol = (2e-2 if half else 1e-5) * np.sqrt(a.shape[1])
    # equal NaN / Inf positions (equal_nan), finite values within the accumulation's rounding
    np.testing.assert_allclose(got, ref, rtol=2e-2 if half else 1e-5, atol=tol, equal_nan=True)


def sparse_a(rng, m, k, micro_tile, mode, density, dtype):
    """A of ``m x k``: ``zero``, ``dense``, ``tiles`` (whole micro-tiles non-zero with
    probability ``density``) or ``elements`` (single elements)."""
    a = rng.standard_normal((m, k))
    if mode == "zero":
        a[...] = 0
    elif mode == "tiles":
        mr, mk = micro_tile
        keep = rng.random((-(-m // mr), -(-k // mk))) < density
        a *= np.kron(keep, np.ones((mr, mk)))[:m, :k]
    elif mode == "elements":
        a *= rng.random((m, k)) < density
    return a.astype(numpy_dtype(dtype))


# -- the conversion helper on its own ------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_dlpack_to_tvm_copies_only_what_tvm_cannot_take(layout, dtype):
    x = np.arange(7 * 13, dtype=dtype).reshape(7, 13)
    view = in_layout(x, layout, offset_elems=3)
    t = dlpack_to_tvm(DLPackProducer(view), "x")
    assert tvm_takes_as_is(t) and t.shape == (7, 13) and str(t.dtype) == dtype
    np.testing.assert_array_equal(t.numpy(), x)
    shares = t.data_ptr() == view.ctypes.data
    assert shares == (layout == "aligned")          # zero-copy exactly where TVM takes it
    lenient = tvm_ffi.from_dlpack(view)             # a TVM tensor TVM's kernels cannot take
    assert tvm_takes_as_is(lenient) == (layout == "aligned")
    np.testing.assert_array_equal(dlpack_to_tvm(lenient).numpy(), x)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_view_reads_and_writes_any_strides(layout):
    x = np.arange(5 * 6, dtype="float32").reshape(5, 6)
    view = in_layout(x, layout)
    alias = host_view(tvm_ffi.from_dlpack(view))
    np.testing.assert_array_equal(alias, x)
    alias[...] = -x
    np.testing.assert_array_equal(view, -x)


@pytest.mark.parametrize("offset_bytes", [0, 4])
def test_empty_tensor_of_any_strides(offset_bytes):
    """An empty tensor is contiguous to DLPack whatever its strides, but a compiled TVM
    function checks them (numpy gives an empty Fortran array the strides (4, 0)): it becomes a
    fresh compact one, aligned or not."""
    config = CONFIGS[0]
    k, n = config[:2]
    memory = aligned_empty((k,), np.float32, offset_bytes)
    empty = np.lib.stride_tricks.as_strided(memory, (0, k), (4, 0))
    t = dlpack_to_tvm(DLPackProducer(empty))
    assert t.shape == (0, k) and tvm_takes_as_is(tvm.runtime.empty((1, k), "float32")) and t.strides == (k, 1)
    b = np.ones((k, n), np.float32)
    assert host(op_for(config)(DLPackProducer(empty), b)).shape == (0, n)


# -- the fuzz ---------------------------------------------------------------------------------------
SPECIALS = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.floats(0, 1, exclude_max=True),
                              st.sampled_from([np.nan, np.inf, -np.inf])), max_size=3)


@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=st.sampled_from(CONFIGS), m=st.sampled_from([0, 1, 2, 5, 31, 33, 70]),
       mode=st.sampled_from(["zero", "dense", "tiles", "elements"]), density=st.floats(0, 1),
       seed=st.integers(0, 2**32 - 1), specials=SPECIALS,
       a_layout=st.sampled_from(LAYOUTS), b_layout=st.sampled_from(LAYOUTS),
       a_kind=st.sampled_from(["numpy", "dlpack", "tvm_view", "tvm", "list"]),
       b_kind=st.sampled_from(["numpy", "dlpack", "tvm_view", "tvm"]),
       out_kind=st.sampled_from([None, "numpy", "dlpack", "tvm_view", "tvm"]),
       out_layout=st.sampled_from(LAYOUTS), offset=st.integers(1, 7))
def test_fuzz_sparse_matmul_matches_numpy(config, m, mode, density, seed, specials, a_layout, b_layout,
                                          a_kind, b_kind, out_kind, out_layout, offset):
    k, n, dtype, micro_tile, out_dtype = config
    out_dtype = out_dtype or dtype
    op = op_for(config)
    rng = np.random.default_rng(seed)
    a = sparse_a(rng, m, k, micro_tile, mode, density, dtype)
    for fr, fc, value in specials if m else ():
        a[int(fr * m), int(fc * k)] = value
    b = rng.standard_normal((k, n)).astype(numpy_dtype(dtype))
    if dtype == "bfloat16":     # numpy cannot export bfloat16 through DLPack
        a_kind = "numpy" if a_kind in ("dlpack", "tvm_view") else a_kind
        b_kind = "numpy" if b_kind in ("dlpack", "tvm_view") else b_kind
    if out_dtype == "bfloat16" and out_kind in ("dlpack", "tvm_view"):
        out_kind = "numpy"
    if a_kind == "list" and m == 0:
        a_kind = "numpy"        # ([] has no K)
    a_view, b_view = in_layout(a, a_layout, offset), in_layout(b, b_layout, offset)
    a_in, b_in = produce(a_view, a_kind), produce(b_view, b_kind)

    if out_kind is None:
        c = op(a_in, b_in)
        assert isinstance(c, tvm.runtime.Tensor) == (a_kind in ("tvm", "tvm_view"))
    else:
        out_np = in_layout(np.full((m, n), 7, numpy_dtype(out_dtype)), out_layout, offset)
        out = (tvm.runtime.empty((m, n), out_dtype) if out_kind == "tvm" else produce(out_np, out_kind))
        assert op(a_in, b_in, out=out) is out
        c = out if out_kind == "tvm" else out_np     # (dlpack / tvm_view: out_np's memory was written)
    assert_matches(c, a, b, out_dtype)
    # the op leaves its inputs as they were
    for view, x in ((a_view, a), (b_view, b)):      # (in float32: bfloat16 NaN compares unequal)
        np.testing.assert_array_equal(view.astype(np.float32), x.astype(np.float32))

    # op.index reads A of any layout as the contiguous copy
    offsets, ids = (x.numpy() for x in op.index(a_in))
    want_offsets, want_ids = (x.numpy() for x in op.index(np.ascontiguousarray(a)))
    np.testing.assert_array_equal(offsets, want_offsets)
    for g in range(len(offsets) - 1):
        assert sorted(ids[offsets[g]:offsets[g + 1]]) == sorted(want_ids[want_offsets[g]:want_offsets[g + 1]])


def test_nan_in_a_propagates_to_its_row_as_in_numpy():
    """A NaN (or Inf) in A is a non-zero: its micro-tile is computed, C's row is NaN (Inf) where
    numpy's is, also when the rest of A is zero (every other micro-tile skipped)."""
    for config in (CONFIGS[0], CONFIGS[1]):
        k, n, dtype, micro_tile, _ = config
        op = op_for(config)
        b = np.random.default_rng(0).standard_normal((k, n)).astype(dtype)
        a = np.zeros((40, k), dtype)
        a[3, 5], a[17, k - 1], a[39, 0] = np.nan, np.inf, -np.inf
        got = op(a, b)
        with np.errstate(invalid="ignore"):
            ref = a @ b
        assert np.isnan(got[3]).all() and np.array_equal(np.isnan(got), np.isnan(ref))
        np.testing.assert_array_equal(got[np.isfinite(ref)], 0)
        np.testing.assert_array_equal(got[np.isinf(ref)], ref[np.isinf(ref)])


def test_read_only_and_broadcast_numpy_inputs():
    """numpy arrays TVM's DLPack import refuses (read-only, broadcast) are copied like any other."""
    op = op_for(CONFIGS[0])
    k, n = CONFIGS[0][:2]
    rng = np.random.default_rng(1)
    row = rng.standard_normal(k).astype("float32")
    a = np.broadcast_to(row, (6, k))
    b = rng.standard_normal((k, n)).astype("float32")
    b.flags.writeable = False
    assert_matches(op(a, b), np.ascontiguousarray(a), b, "float32")


# -- torch, where installed ---------------------------------------------------------------------------
def torch_layouts(torch, x):
    """``x`` (a torch tensor) in the layouts users make: ``.t()`` of the transposed copy,
    ``[::2]`` of a doubled tensor, a row slice (data not 64-byte aligned), ``expand`` (stride 0,
    for a tensor of one repeated row), ``from_numpy`` of a misaligned array."""
    doubled = torch.zeros((2 * x.shape[0], x.shape[1]), dtype=x.dtype)
    doubled[::2] = x
    sliced = torch.zeros((x.shape[0] + 1, x.shape[1]), dtype=x.dtype)
    sliced[1:] = x
    raw = aligned_empty((x.numel(),), np.uint16 if x.dtype == torch.bfloat16 else x.numpy().dtype, x.element_size())
    numpy_backed = torch.from_numpy(raw.reshape(tuple(x.shape)))
    numpy_backed.copy_(x.view(torch.uint16) if x.dtype == torch.bfloat16 else x)
    if x.dtype == torch.bfloat16:
        numpy_backed = numpy_backed.view(torch.bfloat16)
    return {"t": x.t().contiguous().t(), "step": doubled[::2], "row_slice": sliced[1:], "from_numpy": numpy_backed}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_layouts(dtype):
    torch = pytest.importorskip("torch")
    config = CONFIGS[0] if dtype == "float32" else CONFIGS[4]
    k, n, _, micro_tile, _ = config
    op = op_for(config)
    tdtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(12, k, generator=gen).to(tdtype)
    a[torch.rand(12, k, generator=gen) < 0.6] = 0
    b = torch.randn(k, n, generator=gen).to(tdtype)
    ref_a, ref_b = (x.float().numpy().astype(numpy_dtype(dtype)) for x in (a, b))
    layouts_a, layouts_b = torch_layouts(torch, a), torch_layouts(torch, b)
    for name, a_in in layouts_a.items():
        got = op(a_in, layouts_b[name])
        assert isinstance(got, torch.Tensor) and got.dtype == tdtype
        assert_matches(got.float().numpy(), ref_a, ref_b, dtype)
    expanded = a[:1].expand(5, k)
    assert_matches(op(expanded, b).float().numpy(), ref_a[[0] * 5], ref_b, dtype)
    for name, out in torch_layouts(torch, torch.full((12, n), 7.0, dtype=tdtype)).items():
        assert op(a, b, out=out) is out, name
        assert_matches(out.float().numpy(), ref_a, ref_b, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("micro_tile", [(1, 256), (32, 64)])
def test_cuda_torch_layouts(micro_tile):
    """On a GPU: strided torch tensors are made contiguous by torch (``.contiguous()``), a
    misaligned row slice copied by TVM, a strided ``out=`` written by ``copy_``."""
    torch = pytest.importorskip("torch")
    op = pit_tvm.sparse_matmul(256, 128, "float16", micro_tile=micro_tile, target="cuda")
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 256, generator=gen).half()
    a[torch.rand(64, 256, generator=gen) < 0.7] = 0
    b = torch.randn(256, 128, generator=gen).half()
    ref = (a.float() @ b.float()).numpy()
    a, b = a.cuda(), b.cuda()
    sliced = torch.zeros((65, 256), dtype=a.dtype, device="cuda")
    sliced[1:] = a
    for a_in, b_in in ((a.t().contiguous().t(), b.t().contiguous().t()), (sliced[1:], b)):
        got = op(a_in, b_in)
        assert got.is_cuda
        np.testing.assert_allclose(got.float().cpu().numpy(), ref, rtol=2e-2, atol=0.5)
    out = torch.zeros((128, 64), dtype=a.dtype, device="cuda").t()
    assert op(a, b, out=out) is out
    np.testing.assert_allclose(out.float().cpu().numpy(), ref, rtol=2e-2, atol=0.5)
