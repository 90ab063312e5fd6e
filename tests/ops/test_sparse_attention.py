"""Block-sparse attention with a run-time pattern (issue 36): the op against the numpy fp64
reference over random masks, each pattern description against its dense mask, the block
index against its numpy reference, bad input, CUDA builds checked by nvcc, GPU numerics."""
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import pit_tvm
from pit_tvm.index.attention import reference_attention_block_index
from pit_tvm.nvcc import check_cuda_compiles, find_nvcc
from pit_tvm.ops.sparse_attention import (
    MASK_THRESHOLD,
    AttentionPattern,
    reference_allowed,
    reference_sparse_attention,
)

_OPS = {}


def _op(head_dim, pattern, dtype="float32", target="llvm", **kw):
    """One build per (head dim, pattern, dtype, target): B, H and S are symbolic."""
    key = (head_dim, pattern, dtype, target, tuple(sorted(kw.items())))
    if key not in _OPS:
        _OPS[key] = pit_tvm.sparse_attention(head_dim, pattern, dtype=dtype, target=target, **kw)
    return _OPS[key]


def _qkv(rng, B, H, Sq, Sk, D, dtype=np.float32):
    return (rng.standard_normal((B, H, Sq, D)).astype(dtype), rng.standard_normal((B, H, Sk, D)).astype(dtype),
            rng.standard_normal((B, H, Sk, D)).astype(dtype))


def _random_mask(rng, B, HG, Sq, Sk, density, dead_blocks):
    """bool mask: ``density`` of the pairs allowed, whole 64 x 64 blocks dead at ``dead_blocks``
    rate, every 7th row empty and (when there are any) row 0 full"""
    allowed = rng.random((B, HG, Sq, Sk)) < density
    qb, kb = -(-Sq // 64), -(-Sk // 64)
    dead = np.repeat(np.repeat(rng.random((B, HG, qb, kb)) < dead_blocks, 64, axis=2), 64, axis=3)
    allowed &= ~dead[:, :, :Sq, :Sk]
    allowed[:, :, ::7, :] = False
    allowed[:, :, 0, :] = True
    return allowed


def _check(out, ref, dtype):
    tol = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}[dtype]
    np.testing.assert_allclose(np.asarray(out, dtype=np.float64), ref, atol=tol, rtol=tol)


SIZES = st.sampled_from([1, 7, 64, 65, 128, 129, 200])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["bool", "additive", "bool+causal"]), B=st.integers(1, 2), H=st.integers(1, 2),
       Sq=SIZES, Sk=SIZES, per_head=st.booleans(), density=st.sampled_from([0.0, 0.02, 0.3, 1.0]),
       dead=st.sampled_from([0.0, 0.5]), seed=st.integers(0, 2**16))
def test_mask_op_matches_reference(kind, B, H, Sq, Sk, per_head, density, dead, seed):
    rng = np.random.default_rng(seed)
    pattern = AttentionPattern(mask="bool" if kind.startswith("bool") else "additive", causal=kind.endswith("causal"))
    q, k, v = _qkv(rng, B, H, Sq, Sk, 16)
    allowed = _random_mask(rng, B, H if per_head else 1, Sq, Sk, density, dead)
    if pattern.mask == "bool":
        mask = allowed
    else:   # disallowed: -inf or a large negative finite value; allowed: a bias (or 0)
        bias = np.where(rng.random(allowed.shape) < 0.5, 0.0, rng.standard_normal(allowed.shape))
        off = np.where(rng.random(allowed.shape) < 0.5, -np.inf, MASK_THRESHOLD)
        mask = np.where(allowed, bias, off).astype(np.float32)
    out = _op(16, pattern)(q, k, v, mask=mask)
    ref = reference_sparse_attention(q, k, v, pattern, mask=mask)
    _check(out, ref, "float32")
    # the index lists exactly the blocks of the reference, deterministically
    op = _op(16, pattern)
    first = [x.numpy() for x in op.index(q, k, mask=mask)]
    want = reference_attention_block_index(pattern, q.shape, k.shape, op.key_block, mask=mask)
    for got, exp, name in zip(first, want, ("counts", "ids", "partial")):
        np.testing.assert_array_equal(got, exp, err_msg=name)
    again = [x.numpy() for x in op.index(q, k, mask=mask)]
    for a, b in zip(first, again):
        assert a.tobytes() == b.tobytes()


def test_empty_rows_and_fully_masked_input_give_zero():
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 1, 2, 70, 90, 16)
    mask = np.zeros((1, 1, 70, 90), bool)
    mask[0, 0, 5, 80] = True
    out = _op(16, AttentionPattern(mask="bool"))(q, k, v, mask=mask)
    assert np.all(out[:, :, np.arange(70) != 5] == 0)
    np.testing.assert_allclose(out[:, :, 5], v[:, :, 80], rtol=1e-6)


DESCRIPTIONS = [
    AttentionPattern(causal=True),
    AttentionPattern(window=9),
    AttentionPattern(window=9, causal=True),
    AttentionPattern(window=20, global_tokens=True),
    AttentionPattern(documents=True),
    AttentionPattern(documents=True, causal=True),
    AttentionPattern(window=20, global_tokens=True, documents=True),
    AttentionPattern(mask="bool", window=20, global_tokens=True),
]


@pytest.mark.parametrize("pattern", DESCRIPTIONS, ids=lambda p: p.tag)
def test_description_matches_its_dense_mask(pattern):
    rng = np.random.default_rng(7)
    B, H, S, D = 2, 2, 150, 16
    q, k, v = _qkv(rng, B, H, S, S, D)
    runtime = {}
    if pattern.global_tokens:
        runtime["global_flags"] = (rng.random((B, S)) < 0.03).astype(np.int32)
    if pattern.documents:   # packed documents of random lengths, one of them empty
        runtime["doc_ids"] = np.sort(rng.integers(0, 5, (B, S)), axis=1).astype(np.int32)
    if pattern.mask:
        runtime["mask"] = rng.random((B, 1, S, S)) < 0.5
    out = _op(D, pattern)(q, k, v, **runtime)
    dense = reference_allowed(pattern, B, H, S, S, **runtime)
    as_mask = _op(D, AttentionPattern(mask="bool"))(q, k, v, mask=dense)
    _check(out, reference_sparse_attention(q, k, v, pattern, **runtime), "float32")
    _check(out, reference_sparse_attention(q, k, v, AttentionPattern(mask="bool"), mask=dense), "float32")
    np.testing.assert_allclose(out, as_mask, atol=2e-6)
    # the index of the description equals the index of its dense mask
    counts, ids, partial = (x.numpy() for x in _op(D, pattern).index(q, k, **runtime))
    want = reference_attention_block_index(pattern, q.shape, k.shape, _op(D, pattern).key_block, **runtime)
    for got, exp in zip((counts, ids, partial), want):
        np.testing.assert_array_equal(got, exp)


def test_description_semantics():
    """window, global rows / columns, documents and causal on a tiny case, checked by hand."""
    p = AttentionPattern(window=1, global_tokens=True)
    g = np.array([[0, 0, 0, 1, 0, 0]])
    a = reference_allowed(p, 1, 1, 6, 6, global_flags=g)[0, 0]
    assert a[3].all() and a[:, 3].all()           # global row and column
    assert a[0, 1] and not a[0, 2] and a[5, 4] and not a[5, 2]
    d = reference_allowed(AttentionPattern(documents=True, causal=True), 1, 1, 4, 4,
                          doc_ids=np.array([[0, 0, 1, 1]]))[0, 0]
    np.testing.assert_array_equal(d, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]])


@pytest.mark.parametrize("dtype,head_dim", [("float16", 64), ("bfloat16", 128), ("float16", 128), ("float32", 24)])
def test_dtypes_and_head_dims(dtype, head_dim):
    import ml_dtypes

    np_dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    rng = np.random.default_rng(11)
    pattern = AttentionPattern(window=40, global_tokens=True, causal=True)
    q, k, v = _qkv(rng, 1, 2, 190, 190, head_dim, np_dtype)
    g = (rng.random((1, 190)) < 0.05).astype(np.int32)
    out = _op(head_dim, pattern, dtype)(q, k, v, global_flags=g)
    assert out.dtype == np_dtype
    _check(out, reference_sparse_attention(q, k, v, pattern, global_flags=g), dtype)


def test_additive_mask_in_half_precision_and_explicit_scale():
    rng = np.random.default_rng(5)
    pattern = AttentionPattern(mask="additive")
    q, k, v = _qkv(rng, 2, 2, 80, 80, 64, np.float16)
    mask = np.where(rng.random((2, 2, 80, 80)) < 0.6, np.float16(-65504), np.float16(0)).astype(np.float16)
    out = _op(64, pattern, "float16", scale=0.3)(q, k, v, mask=mask)
    _check(out, reference_sparse_attention(q, k, v, pattern, mask=mask, scale=0.3), "float16")


def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, 1, 1, 33, 33, 16)
    out = _op(16, AttentionPattern(causal=True))(*(torch.from_numpy(x) for x in (q, k, v)))
    assert isinstance(out, torch.Tensor)
    _check(out.numpy(), reference_sparse_attention(q, k, v, AttentionPattern(causal=True)), "float32")


def test_bad_input_is_a_clear_error():
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 2, 3, 40, 40, 16)
    op = _op(16, AttentionPattern(mask="bool"))
    with pytest.raises(ValueError, match="does not broadcast"):
        op(q, k, v, mask=np.ones((2, 2, 40, 40), bool))          # 2 head groups for 3 heads
    with pytest.raises(ValueError, match="does not broadcast"):
        op(q, k, v, mask=np.ones((2, 1, 40, 39), bool))
    with pytest.raises(ValueError, match="rank 4"):
        op(q, k, v, mask=np.ones((40, 40), bool))
    with pytest.raises(ValueError, match="dtype float32 given, bool expected"):
        op(q, k, v, mask=np.ones((2, 1, 40, 40), np.float32))
    with pytest.raises(ValueError, match="head dim 32"):
        op(*_qkv(rng, 2, 3, 40, 40, 32), mask=np.ones((2, 1, 40, 40), bool))
    with pytest.raises(ValueError, match="does not take it"):
        op(q, k, v, mask=np.ones((2, 1, 40, 40), bool), global_flags=np.zeros((2, 40), np.int32))
    with pytest.raises(TypeError, match="mask is required"):
        op(q, k, v)
    with pytest.raises(ValueError, match=r"must have shape \(2, 40\)"):
        _op(16, AttentionPattern(documents=True))(q, k, v, doc_ids=np.zeros((2, 41), np.int32))
    with pytest.raises(ValueError, match="window"):
        AttentionPattern(window=-1)
    with pytest.raises(ValueError, match="mask must be None"):
        AttentionPattern(mask="float")
    with pytest.raises(ValueError, match="key_block"):
        pit_tvm.sparse_attention(16, causal=True, dtype="float32", key_block=32)
    with pytest.raises(ValueError, match="unsupported dtype"):
        pit_tvm.sparse_attention(16, causal=True, dtype="int8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AttentionPattern(global_tokens=True)
    assert any("widens nothing" in str(w.message) for w in caught)


CUDA_CASES = [
    (128, AttentionPattern(mask="additive"), "bfloat16", "bfloat16"),
    (64, AttentionPattern(window=256, global_tokens=True, causal=True), "float16", None),
    (128, AttentionPattern(documents=True, causal=True), "float16", None),
]


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")
def test_cuda_builds_compile_with_nvcc():
    """The generic kernel and the index for CUDA (sm_80: the generic path) go through nvcc."""
    for head_dim, pattern, dtype, mask_dtype in CUDA_CASES:
        op = pit_tvm.sparse_attention(head_dim, pattern, dtype=dtype, target="cuda:sm_80", mask_dtype=mask_dtype)
        assert op.kernel_name.startswith("pit_sparse_attention_generic")
        assert check_cuda_compiles(op.executable, archs=("sm_80", "sm_90")) >= 2


# --------------------------------------------------------------------------- GPU (lead runs)
GPU_PATTERNS = [AttentionPattern(mask="bool"), AttentionPattern(mask="additive"), AttentionPattern(causal=True),
                AttentionPattern(mask="bool", causal=True), *DESCRIPTIONS]


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["cuda", "cuda:sm_90"], ids=["sm90a", "generic"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("pattern", GPU_PATTERNS, ids=lambda p: p.tag)
def test_gpu_every_pattern_against_fp32_reference(pattern, head_dim, target):
    rng = np.random.default_rng(13)
    B, H, S = 2, 3, 1000
    q, k, v = _qkv(rng, B, H, S, S, head_dim, np.float16)
    runtime = {}
    if pattern.mask == "bool":
        runtime["mask"] = _random_mask(rng, B, H, S, S, 0.2, 0.5)
    elif pattern.mask == "additive":
        runtime["mask"] = np.where(_random_mask(rng, B, 1, S, S, 0.2, 0.5), 0, -np.inf).astype(np.float16)
    if pattern.global_tokens:
        runtime["global_flags"] = (rng.random((B, S)) < 0.01).astype(np.int32)
    if pattern.documents:
        runtime["doc_ids"] = np.sort(rng.integers(0, 6, (B, S)), axis=1).astype(np.int32)
    op = pit_tvm.sparse_attention(head_dim, pattern, dtype="float16", target=target)
    out = op(q, k, v, **runtime)
    _check(out, reference_sparse_attention(q, k, v, pattern, **runtime), "float16")


_INDEXES = {}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern=st.sampled_from([AttentionPattern(causal=True), AttentionPattern(window=63),
                                AttentionPattern(window=1, causal=True, global_tokens=True),
                                AttentionPattern(window=130, global_tokens=True),
                                AttentionPattern(documents=True, causal=True)]),
       key_block=st.sampled_from([64, 128]), B=st.integers(1, 2), S=st.sampled_from([1, 5, 127, 128, 129, 300]),
       Sk=st.sampled_from([1, 64, 129, 300]), density=st.sampled_from([0.0, 0.01, 0.2, 1.0]), seed=st.integers(0, 2**16))
def test_description_index_from_block_extremes_is_exact(pattern, key_block, B, S, Sk, density, seed):
    """Window / global / causal blocks are classified from the blocks' position extremes (not pair by
    pair): the index equals the pair-by-pair numpy reference, Sq != Sk included (causal, window)."""
    from pit_tvm.index import IndexBuilder
    from pit_tvm.index.attention import attention_block_index_func

    key = (pattern, key_block)
    if key not in _INDEXES:
        _INDEXES[key] = IndexBuilder(attention_block_index_func(pattern, key_block, "float32", "llvm"), "llvm")
    rng = np.random.default_rng(seed)
    sk = S if pattern.global_tokens else Sk
    q, k = np.zeros((B, 1, S, 2), np.float32), np.zeros((B, 1, sk, 2), np.float32)
    runtime = {"global_flags": (rng.random((B, S)) < density).astype(np.int32)} if pattern.global_tokens else {}
    if pattern.documents:   # packed sequences: non-decreasing ids (documents of random lengths)
        runtime = {"doc_ids": np.cumsum(rng.random((B, S)) < density, axis=1).astype(np.int32)}
        q = k = np.zeros((B, 1, S, 2), np.float32)
    got = [x.numpy() for x in _INDEXES[key](q, k, *runtime.values())]
    want = reference_attention_block_index(pattern, q.shape, k.shape, key_block, **runtime)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def _sorted_doc_ids(rng, B, S, documents):
    """``[B, S]`` non-decreasing document ids: ``"padding"`` (0 for the tokens, 1 for a padded
    tail, as the Longformer import passes it), ``"packed"`` (a few documents of random lengths)"""
    if documents == "padding":
        return (np.arange(S)[None, :] >= rng.integers(0, S + 1, (B, 1))).astype(np.int32)
    return np.sort(rng.integers(0, 4, (B, S)), axis=1).astype(np.int32)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=st.sampled_from([0, 63, 130, 5000]), key_block=st.sampled_from([64, 128]), B=st.integers(1, 2),
       S=st.sampled_from([1, 5, 127, 128, 129, 300, 700]), density=st.sampled_from([0.0, 0.01, 0.2, 1.0]),
       documents=st.sampled_from([None, "padding", "packed"]), seed=st.integers(0, 2**16))
def test_index_with_global_tokens_taken_apart_is_exact(window, key_block, B, S, density, documents, seed):
    """``global_split`` (the Hopper kernel's window + global tokens, with or without documents):
    the window's blocks, partial where a key is global, a non-global query's pair is outside the
    window or the pair spans two documents, and each sequence's global rows (ascending, tail -1)
    and count, equal to the numpy reference (for non-decreasing document ids)"""
    from pit_tvm.index import IndexBuilder
    from pit_tvm.index.attention import attention_block_index_func

    pattern = AttentionPattern(window=window, global_tokens=True, documents=documents is not None)
    key = (pattern, key_block, "split")
    if key not in _INDEXES:
        _INDEXES[key] = IndexBuilder(attention_block_index_func(pattern, key_block, "float16", "llvm",
                                                                global_split=True), "llvm")
    rng = np.random.default_rng(seed)
    q = np.zeros((B, 1, S, 2), np.float16)
    flags = (rng.random((B, S)) < density).astype(np.int32)
    docs = _sorted_doc_ids(rng, B, S, documents) if documents else None
    got = [x.numpy() for x in _INDEXES[key](q, q, flags, *([docs] if documents else []))]
    want = reference_attention_block_index(pattern, q.shape, q.shape, key_block, global_flags=flags, doc_ids=docs,
                                           global_split=True)
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_many_global_tokens_against_fp32_reference(head_dim):
    """sm_90a takes window + global tokens apart: with 30 % global tokens (several gathered query
    tiles and key blocks a sequence) and with none, the op (device index + kernel) is exact"""
    rng = np.random.default_rng(head_dim)
    B, H, S = 2, 3, 1000
    q, k, v = _qkv(rng, B, H, S, S, head_dim, np.float16)
    pattern = AttentionPattern(window=50, global_tokens=True)
    op = pit_tvm.sparse_attention(head_dim, pattern, dtype="float16", target="cuda")
    assert op.global_split
    for fraction in (0.3, 0.0):
        flags = (rng.random((B, S)) < fraction).astype(np.int32)
        out = op(q, k, v, global_flags=flags)
        _check(out, reference_sparse_attention(q, k, v, pattern, global_flags=flags), "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_padded_global_tokens_against_fp32_reference(head_dim):
    """a padded batch of window + global tokens (the padding as documents, as the Longformer import
    passes it) takes the global tokens apart too: the op (device index + kernel) is exact with a
    padded tail, with none, and with random document ids"""
    rng = np.random.default_rng(head_dim + 1)
    B, H, S = 2, 3, 1000
    q, k, v = _qkv(rng, B, H, S, S, head_dim, np.float16)
    pattern = AttentionPattern(window=50, global_tokens=True, documents=True)
    op = pit_tvm.sparse_attention(head_dim, pattern, dtype="float16", target="cuda")
    assert op.global_split
    flags = (rng.random((B, S)) < 0.03).astype(np.int32)
    for docs in (np.arange(S)[None, :] >= np.array([[S - 300], [S - 1]]), np.zeros((B, S)),
                 rng.integers(0, 4, (B, S))):
        docs = docs.astype(np.int32)
        out = op(q, k, v, global_flags=flags, doc_ids=docs)
        _check(out, reference_sparse_attention(q, k, v, pattern, global_flags=flags, doc_ids=docs), "float16")


# (pattern, key block, mask dtype): the mask-only boolean pattern takes the word test, the others
# evaluate each entry; rows of Sk % 16 (bool) / 8 (half) / 4 (fp32) == 0 entries are read in
# 16-byte vectors, the others entry by entry
MASK_INDEX_CASES = [(AttentionPattern(mask="bool"), 64, "bool"),
                    (AttentionPattern(mask="bool", causal=True), 128, "bool"),
                    (AttentionPattern(mask="additive"), 64, "float16"),
                    (AttentionPattern(mask="additive"), 128, "bfloat16"),
                    (AttentionPattern(mask="additive", causal=True), 64, "float32")]


def _block_structured_mask(rng, shape, key_block, density):
    """bool mask whose (128 x key_block) blocks are each empty, full or (mostly) random at ``density``"""
    B, HG, Sq, Sk = shape
    kind = rng.choice(3, (B, HG, -(-Sq // 128), -(-Sk // key_block)), p=[0.2, 0.6, 0.2])
    kind = np.repeat(np.repeat(kind, 128, axis=2), key_block, axis=3)[:, :, :Sq, :Sk]
    return (kind == 2) | ((kind == 1) & (rng.random(shape) < density))


@pytest.mark.parametrize("case", range(len(MASK_INDEX_CASES)),
                         ids=[f"{p.tag}-kb{kb}-{dt}" for p, kb, dt in MASK_INDEX_CASES])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), HG=st.sampled_from([1, 3]), Sq=st.sampled_from([1, 100, 128, 257]),
       Sk=st.sampled_from([4, 16, 60, 64, 136, 192, 200, 257]), density=st.sampled_from([0.01, 0.5, 0.99]),
       seed=st.integers(0, 2**16))
@example(B=1, HG=3, Sq=257, Sk=192, density=0.5, seed=1)      # whole vectors, several head groups
@example(B=2, HG=1, Sq=257, Sk=200, density=0.5, seed=2)      # a tail (whole vectors for fp32 / fp16)
@example(B=1, HG=3, Sq=100, Sk=257, density=0.5, seed=3)      # entry by entry
def test_mask_index_is_exact_for_every_mask_dtype_and_row_length(case, B, HG, Sq, Sk, density, seed):
    """The block index of a mask (one or several head groups) equals the numpy reference for
    each mask dtype and key block, row lengths that are and are not whole 16-byte vectors."""
    from pit_tvm.index import IndexBuilder
    from pit_tvm.index.attention import attention_block_index_func
    from pit_tvm.runtime.loader import numpy_dtype

    pattern, key_block, mask_dtype = MASK_INDEX_CASES[case]
    key = (pattern, key_block, mask_dtype)
    if key not in _INDEXES:
        _INDEXES[key] = IndexBuilder(attention_block_index_func(pattern, key_block, "float32", "llvm",
                                                                mask_dtype=mask_dtype), "llvm")
    rng = np.random.default_rng(seed)
    allowed = _block_structured_mask(rng, (B, HG, Sq, Sk), key_block, density)
    if mask_dtype == "bool":
        mask = allowed
    else:   # allowed: 0 or a bias; disallowed: -inf or the threshold itself
        bias = np.where(rng.random(allowed.shape) < 0.9, 0.0, 0.25)
        mask = np.where(allowed, bias, np.where(rng.random(allowed.shape) < 0.5, -np.inf, MASK_THRESHOLD))
        mask = mask.astype(numpy_dtype(mask_dtype))
    q, k = np.zeros((B, 2, Sq, 2), np.float32), np.zeros((B, 2, Sk, 2), np.float32)
    got = [x.numpy() for x in _INDEXES[key](q, k, mask)]
    want = reference_attention_block_index(pattern, q.shape, k.shape, key_block, mask=mask)
    for g, w, name in zip(got, want, ("counts", "ids", "partial")):
        np.testing.assert_array_equal(g, w, err_msg=name)


_BITS_INDEXES = {}


@pytest.mark.parametrize("causal", [False, True], ids=["mask", "mask-causal"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), HG=st.sampled_from([1, 3]), Sq=st.sampled_from([1, 100, 128, 257]),
       Sk=st.sampled_from([4, 16, 60, 64, 136, 192, 200, 257]), density=st.sampled_from([0.01, 0.5, 0.99]),
       seed=st.integers(0, 2**16))
@example(B=1, HG=3, Sq=257, Sk=192, density=0.5, seed=1)      # whole words / vectors, head groups
@example(B=2, HG=1, Sq=100, Sk=257, density=0.5, seed=2)      # entry by entry
def test_mask_bits_are_the_packed_mask(causal, B, HG, Sq, Sk, density, seed):
    """``mask_bits``: the index packs the boolean mask 64 keys a word (0 past Sk) in each of its
    read paths (4-byte words, 16-byte vectors, entry by entry), beside the same block index."""
    import tvm

    from pit_tvm.index.attention import attention_block_index_func
    from pit_tvm.target import build

    pattern = AttentionPattern(mask="bool", causal=causal)
    if pattern not in _BITS_INDEXES:
        func = attention_block_index_func(pattern, 64, "float32", "llvm", mask_dtype="bool", mask_bits=True)
        _BITS_INDEXES[pattern] = build(tvm.IRModule({"main": func}), "llvm")["main"]
    rng = np.random.default_rng(seed)
    mask = _block_structured_mask(rng, (B, HG, Sq, Sk), 64, density)
    q, k = np.zeros((B, 2, Sq, 2), np.float32), np.zeros((B, 2, Sk, 2), np.float32)
    want = reference_attention_block_index(pattern, q.shape, k.shape, 64, mask=mask, mask_bits=True)
    rows = np.ascontiguousarray(np.swapaxes(want[3], -1, -2))       # [B, HG, Sq, words]
    assert np.array_equal(np.unpackbits(rows.view(np.uint8), axis=-1, bitorder="little")[..., :Sk], mask)
    dev = tvm.cpu()
    got = [tvm.runtime.empty(w.shape, str(w.dtype), dev) for w in want]
    _BITS_INDEXES[pattern](*(tvm.runtime.tensor(x, dev) for x in (q, k, mask)), *got)
    for g, w, name in zip(got, want, ("counts", "ids", "partial", "mask_bits")):
        np.testing.assert_array_equal(g.numpy(), w, err_msg=name)


def test_mask_bits_bad_arguments_raise():
    from pit_tvm.index.attention import attention_block_index_func

    for pattern, key_block in ((AttentionPattern(mask="additive"), 64), (AttentionPattern(mask="bool"), 128),
                               (AttentionPattern(causal=True), 64)):
        with pytest.raises(ValueError, match="mask_bits"):
            attention_block_index_func(pattern, key_block, "float16", "llvm",
                                       mask_dtype={"additive": "float16", "bool": "bool"}.get(pattern.mask),
                                       mask_bits=True)


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")
def test_cuda_mask_index_reads_16_byte_vectors():
    """On CUDA the index reads a mask row 16 bytes per load (whole-vector rows) and nvcc compiles it."""
    import re

    import tvm

    from pit_tvm.index.attention import attention_block_index_func
    from pit_tvm.nvcc import cuda_sources, nvcc_compile
    from pit_tvm.target import build

    for pattern, key_block, mask_dtype in MASK_INDEX_CASES[:3]:
        func = attention_block_index_func(pattern, key_block, "float16", "cuda", mask_dtype=mask_dtype)
        (source,) = cuda_sources(build(tvm.IRModule({"index": func}), "cuda"))
        assert re.search(r"\*\((uint4|int4|float4)\*\)\(mask_(words|vectors)_ptr", source), pattern.tag
        nvcc_compile(source, "sm_90a")
    for causal in (False, True):     # with the packed mask
        func = attention_block_index_func(AttentionPattern(mask="bool", causal=causal), 64, "float16", "cuda",
                                          mask_dtype="bool", mask_bits=True)
        nvcc_compile(cuda_sources(build(tvm.IRModule({"index": func}), "cuda"))[0], "sm_90a")


def test_unsorted_document_ids_list_a_superset_and_the_result_is_exact():
    """With doc ids that are not non-decreasing the index may list blocks without an allowed pair
    (marked partial), never leave one out; the op's result is exact either way."""
    rng = np.random.default_rng(9)
    pattern = AttentionPattern(documents=True)
    q, k, v = _qkv(rng, 2, 1, 300, 300, 16)
    doc_ids = rng.integers(0, 3, (2, 300)).astype(np.int32)
    op = _op(16, pattern)
    counts, ids, partial = (x.numpy() for x in op.index(q, k, doc_ids=doc_ids))
    want_counts, want_ids, _ = reference_attention_block_index(pattern, q.shape, k.shape, op.key_block,
                                                               doc_ids=doc_ids)
    for idx in np.ndindex(*counts.shape):
        listed = ids[idx][:counts[idx]]
        assert set(want_ids[idx][:want_counts[idx]]) <= set(listed)
        extra = ~np.isin(listed, want_ids[idx][:want_counts[idx]])
        assert np.all(partial[idx][:counts[idx]][extra] == 1)
    _check(op(q, k, v, doc_ids=doc_ids), reference_sparse_attention(q, k, v, pattern, doc_ids=doc_ids), "float32")
