"""Block-sparse attention's Hopper kernel (sm_90a, ``pit_tvm/schedules/hopper/sparse_attention.py``).

CPU part: bad arguments raise, the signature follows the contract (contracts/ATTENTION.md), the
kernel builds and nvcc / ptxas compile it for sm_90a without spills.  GPU part
(``@pytest.mark.gpu``, an H100): the kernel against the op's numpy reference over random block
masks (partial blocks, empty rows, all-masked blocks, tails), causal, additive masks, Longformer
and document patterns, head dims 64 / 128, key blocks 64 / 128, fp16 / bf16; and that it visits
only the listed key blocks and applies the predicate only in blocks flagged partial.  The index
comes from the numpy reference of the device index (the index kernel has its own tests).
"""
from __future__ import annotations

import functools
import math
import re

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st

from pit_tvm.runtime.loader import numpy_dtype
from pit_tvm.index.attention import reference_attention_block_index, reference_mask_bits
from pit_tvm.nvcc import check_cuda_compiles, cuda_sources, find_nvcc, ptxas_log
from pit_tvm.schedules.hopper.barriers import SCHEDULER_BARRIERS
from pit_tvm.ops.sparse_attention import QUERY_BLOCK, AttentionPattern, reference_sparse_attention
from pit_tvm.schedules.hopper.sparse_attention import block_sparse_attention_func, sparse_attention_smem_bytes
from pit_tvm.target import build

TARGET = "cuda:sm_90a"
BOOL = AttentionPattern(mask="bool")


# ------------------------------------------------------------------------------------ CPU
def test_defaults_are_the_measured_forms():
    """key block 64: pairs of blocks a step, overlapping, the deepest ring that fits (the fastest on
    the H200, docs/design/sparse_attention.md), a boolean mask's predicate from the index's packed
    mask (no mask tiles: pairs 4 deep at head dim 64, 3 at 128); at 128: warp-specialized, 2 deep; the
    loader's registers handed to the consumers in each"""
    def same(d, pattern, kb, **form):
        default = block_sparse_attention_func(d, pattern, "float16", kb)
        assert default.script() == block_sparse_attention_func(d, pattern, "float16", kb, p_in_registers=True,
                                                               warp_specialized=True, register_split=True,
                                                               **form).script()
        return default

    bool_pairs = same(64, BOOL, 64, overlap=True, stages=4, pair_blocks=True, mask_tiles=False, mask_bits=True,
                      turns=True, tma_kv=True)
    assert int(bool_pairs.attrs["pit.attention.key_tile"]) == 128 and bool(bool_pairs.attrs["pit.attention.mask_bits"])
    bool_128 = same(128, BOOL, 64, overlap=True, stages=3, pair_blocks=True, mask_tiles=False, mask_bits=True)
    assert int(bool_128.attrs["pit.attention.key_tile"]) == 128
    # (mask tiles asked for: pairs where a ring of 3 fits beside them, head dim 64; at 128 a block a step)
    assert int(block_sparse_attention_func(64, BOOL, "float16", 64, mask_tiles=True)
               .attrs["pit.attention.key_tile"]) == 128
    assert int(block_sparse_attention_func(128, BOOL, "float16", 64, mask_tiles=True)
               .attrs["pit.attention.key_tile"]) == 64
    same(64, BOOL, 128, overlap=False, stages=2, pair_blocks=False)
    # (a boolean mask read from global memory: a block a step)
    assert int(block_sparse_attention_func(64, BOOL, "float16", 64, mask_tiles=False, mask_bits=False)
               .attrs["pit.attention.key_tile"]) == 64
    for d, stages in ((64, 4), (128, 3)):
        f = same(d, AttentionPattern(causal=True, documents=True), 64, overlap=True, stages=stages, pair_blocks=True)
        assert int(f.attrs["pit.attention.key_block"]) == 64 and int(f.attrs["pit.attention.key_tile"]) == 128
    # (the warpgroups take turns but in Longformer's split tiles)
    split = AttentionPattern(window=256, global_tokens=True)
    assert (block_sparse_attention_func(64, split, "float16", 64, global_split=True).script()
            == block_sparse_attention_func(64, split, "float16", 64, global_split=True, overlap=True,
                                           turns=False).script())


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="head dims"):
        block_sparse_attention_func(96, BOOL, "float16")
    with pytest.raises(ValueError, match="float32"):
        block_sparse_attention_func(64, BOOL, "float32")
    with pytest.raises(ValueError, match="key_block"):
        block_sparse_attention_func(64, BOOL, "float16", 32)
    with pytest.raises(ValueError, match="shared memory"):
        block_sparse_attention_func(128, BOOL, "float16", 128, stages=4)
    for args, form in (((64, AttentionPattern(mask="additive"), "float16", 64), {}),
                       ((64, BOOL, "float16", 128), {}), ((64, BOOL, "float16", 64), {"mask_tiles": True}),
                       ((64, BOOL, "float16", 64), {"early_predicate": False})):
        with pytest.raises(ValueError, match="mask_bits"):
            block_sparse_attention_func(*args, mask_bits=True, **form)
    with pytest.raises(ValueError, match="stages"):
        block_sparse_attention_func(64, BOOL, "float16", 64, stages=1)
    assert sparse_attention_smem_bytes(128, 128, 2) <= 227 * 1024
    assert sparse_attention_smem_bytes(128, 64, 4, p_in_registers=True) <= 227 * 1024


@pytest.mark.parametrize("pattern,inputs", [
    (AttentionPattern(causal=True), ()),
    (BOOL, ("bool",)),
    (AttentionPattern(mask="additive", window=64, global_tokens=True, documents=True),
     ("float16", "int32", "int32")),
])
def test_signature(pattern, inputs):
    """``q, k, v, block_counts, block_ids, block_partial, <mask, global_flags, doc_ids>, o``:
    the index int32 with ceil(Sq / 128) query blocks and ceil(Sk / key_block) key blocks."""
    f = block_sparse_attention_func(64, pattern, "float16", 128)
    bufs = [p.ty for p in f.params]             # a TIRx parameter carries its buffer type
    assert [b.dtype for b in bufs] == ["float16"] * 3 + ["int32"] * 3 + list(inputs) + ["float16"]
    assert [len(b.shape) for b in bufs[:6]] == [4, 4, 4, 3, 4, 4]
    sq, sk = bufs[0].shape[2], bufs[1].shape[2]
    tvm.ir.assert_structural_equal(bufs[3].shape[2], (sq + 127) // 128)
    tvm.ir.assert_structural_equal(bufs[4].shape[3], (sk + 127) // 128)
    # a [B, S] input (global tokens, documents) ties the query and key lengths
    assert (sq.same_as(sk)) == bool(pattern.global_tokens or pattern.documents)


def test_signature_with_global_split():
    """``global_split`` adds the index's ``global_rows [B, S]`` and ``global_count [B]`` after the
    pattern's inputs; it takes window + global tokens only"""
    f = block_sparse_attention_func(64, AttentionPattern(window=8, global_tokens=True), "float16", 64,
                                    global_split=True)
    bufs = [p.ty for p in f.params]
    assert [b.dtype for b in bufs] == ["float16"] * 3 + ["int32"] * 6 + ["float16"]
    assert [len(b.shape) for b in bufs[6:9]] == [2, 2, 1]
    with pytest.raises(ValueError, match="global_split"):
        block_sparse_attention_func(64, AttentionPattern(window=8, global_tokens=True, causal=True), "float16", 64,
                                    global_split=True)


#: the kernel's forms: P through shared memory (all threads copy), P in registers, P in
#: registers with a loader warpgroup filling the ring, and that with a block's softmax
#: overlapping the previous block's P V; "pair": two blocks of 64 a step (also with a boolean
#: mask at head dim 128, where it is not the default); "single": a block a step (the default
#: form otherwise); "cp_async": K and V copied by the loader's threads, not by TMA (as in the split
#: tiles); "bits": a boolean mask's predicate from the index's packed mask (the default); "mask_tiles":
#: from mask tiles the loader stages (the default before it); "default": the defaults
#: (test_defaults_are_the_measured_forms)
VARIANTS = {"p_smem": {"p_in_registers": False, "warp_specialized": False},
            "p_regs": {"p_in_registers": True, "warp_specialized": False},
            "ws": {"p_in_registers": True, "warp_specialized": True, "overlap": False},
            "ws_overlap": {"p_in_registers": True, "warp_specialized": True, "overlap": True, "stages": 3},
            "pair": {"pair_blocks": True},
            "single": {"pair_blocks": False},
            "cp_async": {"tma_kv": False},
            "bits": {"mask_bits": True},
            "mask_tiles": {"mask_tiles": True},
            "default": {}}


@pytest.mark.parametrize("pattern,head_dim,key_block,dtype,variant", [
    (BOOL, 64, 64, "float16", "p_smem"),
    (BOOL, 128, 64, "bfloat16", "p_smem"),
    (AttentionPattern(causal=True), 64, 128, "float16", "p_smem"),
    (AttentionPattern(mask="additive", causal=True), 128, 128, "float16", "p_smem"),
    (AttentionPattern(window=256, global_tokens=True), 64, 64, "bfloat16", "p_smem"),
    (AttentionPattern(documents=True, causal=True), 128, 64, "bfloat16", "p_regs"),
    (BOOL, 128, 128, "float16", "ws"),
    (AttentionPattern(window=256, global_tokens=True), 64, 128, "float16", "ws"),
    (AttentionPattern(mask="additive", causal=True), 128, 64, "bfloat16", "ws_overlap"),
    (AttentionPattern(window=64, global_tokens=True), 128, 64, "float16", "default"),
    (AttentionPattern(mask="bool", causal=True), 64, 64, "bfloat16", "default"),
    (AttentionPattern(documents=True, causal=True), 128, 64, "float16", "default"),
    (AttentionPattern(mask="additive"), 64, 64, "bfloat16", "default"),
    (AttentionPattern(window=128), 128, 64, "bfloat16", "pair"),
    (BOOL, 64, 64, "float16", "cp_async"),
    (BOOL, 128, 64, "bfloat16", "cp_async"),
    (AttentionPattern(documents=True, causal=True), 128, 64, "float16", "cp_async"),
    (AttentionPattern(mask="additive"), 64, 128, "float16", "cp_async"),
])
def test_cuda_compiles_without_spills(pattern, head_dim, key_block, dtype, variant):
    _compiles_without_spills(pattern, head_dim, key_block, dtype, variant)


@pytest.mark.parametrize("head_dim,dtype,variant", [
    (64, "float16", "default"), (64, "bfloat16", "default"), (128, "float16", "default"),
    (128, "bfloat16", "default"), (64, "bfloat16", "single"), (128, "float16", "pair")])
def test_boolean_mask_compiles_without_spills(head_dim, dtype, variant):
    """a boolean mask with its staged mask tiles (the loader's 72 registers, the consumers' 216): the
    defaults (two blocks a step at head dim 64, one at 128) and the other of each"""
    _compiles_without_spills(BOOL, head_dim, 64, dtype, variant)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("head_dim,variant", [(64, "default"), (128, "default"), (64, "p_smem")])
def test_global_split_compiles_without_spills(head_dim, variant, documents):
    """the form that takes Longformer's global tokens apart (gathered query tiles and key blocks),
    also with documents (a padded batch)"""
    _compiles_without_spills(AttentionPattern(window=256, global_tokens=True, documents=documents), head_dim, 64,
                             "float16", variant, global_split=True)


@pytest.mark.parametrize("pattern", [BOOL, AttentionPattern(window=64, global_tokens=True)], ids=lambda p: p.tag)
def test_late_predicate_form_compiles_without_spills(pattern):
    """``early_predicate=False``: a partial block's predicate evaluated after Q K^T's wait (the
    form the default was measured against)"""
    _compiles_without_spills(pattern, 64, 64, "float16", "default", early_predicate=False,
                             global_split=pattern.global_tokens)


def _compiles_without_spills(pattern, head_dim, key_block, dtype, variant, **form):
    """wgmma for Q K^T (n = key block) and P V (n = head dim; P from shared memory or from
    registers), the K / V ring by cp.async (a loader warpgroup's, with the ring's mbarriers);
    ptxas keeps the wgmma asynchronous (no C7515) and spills nothing."""
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    f = block_sparse_attention_func(head_dim, pattern, dtype, key_block, **form, **VARIANTS[variant])
    src = cuda_sources(build(tvm.IRModule({"main": f}), TARGET))[0]
    key_tile = int(f.attrs["pit.attention.key_tile"])        # (key_block, or two blocks of 64 a step)
    assert key_tile in (key_block, 2 * key_block)
    assert f"m64n{key_tile}k16" in src and f"m64n{head_dim}k16" in src
    assert "cp_async" in src and "exp2f" in src
    assert ("wgmma_" + ("f16" if dtype == "float16" else "bf16") + "_rs_" in src) == (variant != "p_smem")
    assert ("mbarrier_arrive_noinc" in src) == (variant not in ("p_smem", "p_regs"))
    log = ptxas_log(src, "sm_90a")
    assert "0 bytes spill stores" in log and "C7515" not in log, log[-2000:]


def test_form_arguments_checked():
    with pytest.raises(ValueError, match="p_in_registers"):
        block_sparse_attention_func(64, BOOL, "float16", 64, p_in_registers=False)
    with pytest.raises(ValueError, match="warp_specialized"):
        block_sparse_attention_func(64, BOOL, "float16", 64, warp_specialized=False, overlap=True)
    with pytest.raises(ValueError, match="key_block 64"):
        block_sparse_attention_func(64, BOOL, "float16", 128, register_split=False, **VARIANTS["ws_overlap"])
    with pytest.raises(ValueError, match="pair_blocks"):
        block_sparse_attention_func(64, BOOL, "float16", 128, pair_blocks=True)
    with pytest.raises(ValueError, match="pair_blocks"):
        block_sparse_attention_func(64, BOOL, "float16", 64, pair_blocks=True, **VARIANTS["p_regs"])
    with pytest.raises(ValueError, match="register_split"):
        block_sparse_attention_func(64, BOOL, "float16", 64, register_split=True, **VARIANTS["p_regs"])
    with pytest.raises(ValueError, match="mask_tiles"):       # staged mask tiles: a boolean mask only
        block_sparse_attention_func(64, AttentionPattern(window=64), "float16", 64, mask_tiles=True)
    with pytest.raises(ValueError, match="tma_kv takes"):
        block_sparse_attention_func(64, AttentionPattern(window=64, global_tokens=True), "float16", 64,
                                    global_split=True, tma_kv=True)
    with pytest.raises(ValueError, match="turns needs overlap"):
        block_sparse_attention_func(64, BOOL, "float16", 64, turns=True, **VARIANTS["ws"])
    # (the running max is taken over the unscaled scores; the op then takes the generic kernel)
    with pytest.raises(ValueError, match="positive score scale"):
        block_sparse_attention_func(64, BOOL, "float16", 64, scale=-0.125)


@pytest.mark.parametrize("pattern", [BOOL, AttentionPattern(causal=True)], ids=lambda p: p.tag)
def test_tma_kv_loads_keys_and_values_by_tma(pattern):
    """``tma_kv``: K and V by TMA boxes (two a block and operand at head dim 64, the pair's two
    blocks), the K / V cp.async gone; without mask tiles (a boolean mask's predicate reads the
    packed mask by default) the loader's other threads exit after Q, with them they stay"""
    def source(**form):
        return cuda_sources(build(tvm.IRModule({"main": block_sparse_attention_func(64, pattern, "float16", 64,
                                                                                    **form)}), TARGET))[0]

    src, plain = source(), source(tma_kv=False)
    calls = [line for line in src.splitlines() if "cp_async_bulk_tensor" in line and "__device__" not in line]
    assert len(calls) == 4 and "expect_tx" in src
    copies = "cp_async_cg_src_size"
    assert 0 < src.count(copies) < plain.count(copies)
    assert src.count("pit_exit_thread();") > plain.count("pit_exit_thread();")
    if pattern.mask == "bool":
        staged, staged_plain = source(mask_tiles=True), source(mask_tiles=True, tma_kv=False)
        assert staged.count("pit_exit_thread();") == staged_plain.count("pit_exit_thread();")


def test_warpgroups_issue_their_wgmma_in_turn():
    """``turns`` (the overlapping form's default): each consumer warpgroup syncs on its scheduler
    barrier before its wgmma and arrives on the other's after; off, no scheduler barrier"""
    def scheduler_barriers(**form):
        src = cuda_sources(build(tvm.IRModule({"main": block_sparse_attention_func(64, BOOL, "float16", 64, **form)}),
                                 TARGET))[0]
        return {int(b) for b in re.findall(r"bar_(?:sync|arrive)\w*\(\(uint\)(\d+)", src)} & turn_barriers

    turn_barriers = {SCHEDULER_BARRIERS, SCHEDULER_BARRIERS + 1}
    assert scheduler_barriers() == turn_barriers
    assert scheduler_barriers(turns=False) == set()


@pytest.mark.parametrize("where", ["mask_tiles", "global", "packed"])
def test_where_the_boolean_mask_is_read(where):
    """The loader copies a partial block's mask tile (cp.async, bytes) and the predicate reads it from
    shared memory (``mask_tiles``); or the consumers read the mask's bytes in global memory; or (the
    default) they read the index's packed mask, 64-bit words, and not the mask itself"""
    form = {"mask_tiles": {"mask_tiles": True}, "global": {"mask_tiles": False, "mask_bits": False},
            "packed": {}}[where]
    f = block_sparse_attention_func(64, BOOL, "float16", 64, **form)
    src = cuda_sources(build(tvm.IRModule({"main": f}), TARGET))[0]
    assert ("((uchar*)smem_ptr)[" in src) == (where == "mask_tiles")
    mask = re.search(r"bool\* __restrict__ (\w+)", src)
    direct_reads = [line for line in src.splitlines() if mask and f"{mask.group(1)}[" in line and "cp_async" not in line]
    assert (len(direct_reads) > 0) == (where == "global")
    words = re.search(r"uint64_t\* __restrict__ (\w+)", src)
    assert (words is not None and f"{words.group(1)}[" in src) == (where == "packed")


def test_op_takes_the_kernel_on_sm90a():
    """``sparse_attention`` for an sm_90a target builds with this kernel (the index kernel
    before it) and nvcc compiles the module for sm_90a; head dim 96 falls back to the generic
    kernel with a warning."""
    import pit_tvm

    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    op = pit_tvm.sparse_attention(64, AttentionPattern(mask="bool", causal=True), dtype="float16", target="cuda")
    assert op.kernel_name.startswith("pit_sparse_attention_hopper_")
    assert check_cuda_compiles(op.executable, archs=("sm_90a",)) >= 1
    with pytest.warns(UserWarning, match="sm_90a kernel does not apply"):
        op = pit_tvm.sparse_attention(96, BOOL, dtype="float16", target="cuda")
    assert op.kernel_name.startswith("pit_sparse_attention_generic")
    with pytest.warns(UserWarning, match="positive score scale"):      # (the running max of unscaled scores)
        op = pit_tvm.sparse_attention(64, BOOL, dtype="float16", target="cuda", scale=-0.125)
    assert op.kernel_name.startswith("pit_sparse_attention_generic")


# ------------------------------------------------------------------------------------ GPU
def _inputs(rng, b, h, sq, sk, d, dtype):
    npd = numpy_dtype(dtype)
    q = rng.standard_normal((b, h, sq, d)).astype(np.float32).astype(npd)
    k = rng.standard_normal((b, h, sk, d)).astype(np.float32).astype(npd)
    v = rng.standard_normal((b, h, sk, d)).astype(np.float32).astype(npd)
    return q, k, v


def _block_mask(rng, b, mh, sq, sk, key_block, density=0.4, partial=0.5, empty=True):
    """a boolean mask of random key blocks per query block: each listed block full or (with
    probability ``partial``) random elements; (``empty``) some query rows with no allowed key, one
    query block with nothing allowed"""
    qbn, kbn = -(-sq // QUERY_BLOCK), -(-sk // key_block)
    blocks = rng.random((b, mh, qbn, kbn)) < density
    mask = np.repeat(np.repeat(blocks, QUERY_BLOCK, 2), key_block, 3)[:, :, :sq, :sk].copy()
    elements = rng.random(mask.shape) < 0.5
    partial_blocks = np.repeat(np.repeat(rng.random(blocks.shape) < partial, QUERY_BLOCK, 2), key_block, 3)
    mask &= np.where(partial_blocks[:, :, :sq, :sk], elements, True)
    if empty:
        mask[:, :, 3::17] = False                   # rows with no allowed key
        mask[0, :, :QUERY_BLOCK] = False            # a query block with nothing listed
    return mask


def _run(pattern, q, k, v, head_dim, key_block, dtype, index=None, variant="p_smem", global_split=False, **inputs):
    """the kernel's output for (q, k, v) and the pattern's inputs, with the index of the numpy
    reference unless ``index`` is given"""
    f, mask_bits = _built(pattern, head_dim, key_block, dtype, variant, global_split)
    index = index or reference_attention_block_index(pattern, q.shape, k.shape, key_block, global_split=global_split,
                                                     **inputs)
    if mask_bits:     # (the kernel reads the index's packed mask)
        index = tuple(index[:3]) + (reference_mask_bits(inputs["mask"]),)
    dev = tvm.cuda(0)
    out = tvm.runtime.tensor(np.full(q.shape, 7, np.float32).astype(q.dtype), dev)
    args = [q, k, v, *index[:3]] + [inputs[n] for n in pattern.inputs] + list(index[3:])
    f(*(tvm.runtime.tensor(np.ascontiguousarray(x), dev) for x in args), out)
    return out.numpy().astype(np.float32)


@functools.lru_cache(maxsize=None)
def _built(pattern, head_dim, key_block, dtype, variant, global_split=False):
    if variant == "pair" and key_block != 64:
        pytest.skip("pair_blocks takes key block 64")
    if variant == "cp_async" and global_split:
        pytest.skip("the split loads by cp.async in every form (its gathered key blocks are rows)")
    if variant in ("bits", "mask_tiles") and (pattern.mask != "bool" or key_block != 64):
        pytest.skip(f"{variant} takes a boolean mask and key block 64")
    try:
        f = block_sparse_attention_func(head_dim, pattern, dtype, key_block, global_split=global_split,
                                        **VARIANTS[variant])
    except ValueError as err:
        if "shared memory" not in str(err):
            raise
        pytest.skip(str(err))
    return build(tvm.IRModule({"main": f}), TARGET)["main"], bool(f.attrs["pit.attention.mask_bits"])


def _check(got, ref, dtype):
    tol = 1e-2 if dtype == "float16" else 3e-2
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dim,key_block", [(64, 64), (64, 128), (128, 64), (128, 128)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sq,sk,mask_heads", [(384, 384, 1), (300, 200, 3)])
def test_gpu_random_block_mask(head_dim, key_block, dtype, sq, sk, mask_heads, variant):
    """random block masks (full and partial blocks, empty rows, an empty query block), tails
    on both axes, one mask for all heads or one a head; every form of the kernel"""
    b, h = 2, 3
    rng = np.random.default_rng(head_dim + key_block + sq + mask_heads)
    q, k, v = _inputs(rng, b, h, sq, sk, head_dim, dtype)
    mask = _block_mask(rng, b, mask_heads, sq, sk, key_block)
    got = _run(BOOL, q, k, v, head_dim, key_block, dtype, variant=variant, mask=mask)
    _check(got, reference_sparse_attention(q, k, v, BOOL, mask=mask), dtype)
    assert np.all(got[:, :, 3::17] == 0)             # rows with no allowed key give 0


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["default", "ws", "single"])
@pytest.mark.parametrize("b,mask_heads,sq,sk", [(2, 1, 5, 7), (1, 1, 130, 77), (2, 3, 129, 203)])
def test_gpu_mask_tiles_at_the_end_of_the_mask(b, mask_heads, sq, sk, variant):
    """masks whose size is not a multiple of 16 bytes, every listed block partial: the staged mask
    tiles' last chunks (the bytes up to the mask's end, read from 16-byte aligned addresses)"""
    h = 3
    rng = np.random.default_rng(sq + sk)
    q, k, v = _inputs(rng, b, h, sq, sk, 64, "float16")
    mask = _block_mask(rng, b, mask_heads, sq, sk, 64, density=1.0, partial=1.0)
    assert mask.size % 16 != 0
    got = _run(BOOL, q, k, v, 64, 64, "float16", variant=variant, mask=mask)
    _check(got, reference_sparse_attention(q, k, v, BOOL, mask=mask), "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["pair", "single"])
@pytest.mark.parametrize("head_dim,dtype", [(64, "float16"), (128, "bfloat16")])
@pytest.mark.parametrize("b,mask_heads,sq,sk", [(2, 3, 300, 300), (1, 1, 4096 + 17, 4096 + 17), (2, 1, 333, 4096 + 17)])
@pytest.mark.parametrize("partial", [0.0, 0.5])
def test_gpu_boolean_mask_key_tails(b, mask_heads, sq, sk, partial, head_dim, dtype, variant):
    """boolean masks (staged mask tiles) whose key length is off 16 and 64: the tail block's staged
    bytes past Sk read as masked (zero-filled up to each row's end), also where the index lists it
    full (``partial`` 0: no row without an allowed key, so blocks are full); per-head and shared
    masks, rows past Sq, odd block counts (a pair's empty half), two blocks a step or one"""
    h = 3
    rng = np.random.default_rng(sq + sk + head_dim + int(partial * 10))
    q, k, v = _inputs(rng, b, h, sq, sk, head_dim, dtype)
    mask = _block_mask(rng, b, mask_heads, sq, sk, 64, density=0.5, partial=partial, empty=partial > 0)
    got = _run(BOOL, q, k, v, head_dim, 64, dtype, variant=variant, mask=mask)
    _check(got, reference_sparse_attention(q, k, v, BOOL, mask=mask), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dim,key_block,seq", [(64, 64, 333), (128, 128, 512), (128, 64, 130)])
def test_gpu_causal(head_dim, key_block, seq, variant):
    pattern = AttentionPattern(causal=True)
    rng = np.random.default_rng(seq)
    q, k, v = _inputs(rng, 2, 2, seq, seq, head_dim, "float16")
    _check(_run(pattern, q, k, v, head_dim, key_block, "float16", variant=variant),
           reference_sparse_attention(q, k, v, pattern), "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dim,key_block", [(64, 64), (128, 128)])
def test_gpu_additive_mask(head_dim, key_block, variant):
    """an additive mask: finite biases on allowed keys (added in partial blocks), -inf and
    -1e4 entries (disallowed), zero blocks (full: nothing added), causal on top"""
    pattern = AttentionPattern(mask="additive", causal=True)
    b, h, s = 2, 2, 320
    rng = np.random.default_rng(head_dim)
    q, k, v = _inputs(rng, b, h, s, s, head_dim, "float16")
    keep = _block_mask(rng, b, 1, s, s, key_block, density=0.7)
    bias = np.where(rng.random(keep.shape) < 0.3, rng.standard_normal(keep.shape) * 2, 0.0)
    bias[:, :, :, key_block:2 * key_block] = 0.0     # a column of blocks without bias
    mask = np.where(keep, bias, np.where(rng.random(keep.shape) < 0.5, -np.inf, -1e4)).astype(np.float16)
    got = _run(pattern, q, k, v, head_dim, key_block, "float16", variant=variant, mask=mask)
    _check(got, reference_sparse_attention(q, k, v, pattern, mask=mask), "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_longformer_and_documents(head_dim, variant):
    """window + global tokens drawn per call; packed documents, causal"""
    b, h, s, key_block = 2, 2, 700, 64
    rng = np.random.default_rng(head_dim + 1)
    q, k, v = _inputs(rng, b, h, s, s, head_dim, "bfloat16")
    longformer = AttentionPattern(window=96, global_tokens=True)
    flags = (rng.random((b, s)) < 0.02).astype(np.int32)
    got = _run(longformer, q, k, v, head_dim, key_block, "bfloat16", variant=variant, global_flags=flags)
    _check(got, reference_sparse_attention(q, k, v, longformer, global_flags=flags), "bfloat16")
    documents = AttentionPattern(causal=True, documents=True)
    docs = np.stack([np.repeat(np.arange(6), np.diff(np.r_[0, np.sort(rng.choice(np.arange(1, s), 5, False)), s]))
                     for _ in range(b)]).astype(np.int32)
    got = _run(documents, q, k, v, head_dim, key_block, "bfloat16", variant=variant, doc_ids=docs)
    _check(got, reference_sparse_attention(q, k, v, documents, doc_ids=docs), "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dim,key_block", [(64, 64), (128, 64), (64, 128)])
@pytest.mark.parametrize("global_fraction", [0.0, 0.02, 0.3])
def test_gpu_global_tokens_taken_apart(head_dim, key_block, global_fraction, variant):
    """window + global tokens with ``global_split``: the global rows as gathered query tiles against
    every key (0, 1 or several tiles a sequence), the global keys as gathered key blocks (one or
    several), the window blocks without them; tails on both axes"""
    b, h, s = 2, 3, 700
    rng = np.random.default_rng(head_dim + key_block + int(global_fraction * 100))
    q, k, v = _inputs(rng, b, h, s, s, head_dim, "float16")
    pattern = AttentionPattern(window=96, global_tokens=True)
    flags = (rng.random((b, s)) < global_fraction).astype(np.int32)
    flags[1, -1] = 1                                 # the last position global (the key tail)
    got = _run(pattern, q, k, v, head_dim, key_block, "float16", variant=variant, global_split=True,
               global_flags=flags)
    _check(got, reference_sparse_attention(q, k, v, pattern, global_flags=flags), "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["default", "p_smem", "ws"])
@pytest.mark.parametrize("head_dim,key_block", [(64, 64), (128, 64), (64, 128)])
@pytest.mark.parametrize("documents", ["padding", "random"])
def test_gpu_global_tokens_taken_apart_with_documents(head_dim, key_block, documents, variant):
    """window + global tokens + documents with ``global_split``: a padded batch (document 1 the
    padded tail, as the Longformer import passes it; one sequence unpadded) and random document
    ids; the global tiles and the gathered global keys keep to the query's document"""
    b, h, s = 2, 3, 700
    rng = np.random.default_rng(head_dim + key_block + len(documents))
    q, k, v = _inputs(rng, b, h, s, s, head_dim, "float16")
    pattern = AttentionPattern(window=96, global_tokens=True, documents=True)
    flags = (rng.random((b, s)) < 0.05).astype(np.int32)
    if documents == "padding":
        docs = (np.arange(s)[None, :] >= np.array([[s], [s - 170]])).astype(np.int32)
        flags[1, -3] = 1                             # a global padding token: attends to the padding only
    else:
        docs = rng.integers(0, 3, (b, s)).astype(np.int32)
    got = _run(pattern, q, k, v, head_dim, key_block, "float16", variant=variant, global_split=True,
               global_flags=flags, doc_ids=docs)
    _check(got, reference_sparse_attention(q, k, v, pattern, global_flags=flags, doc_ids=docs), "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_reads_only_the_index(variant):
    """The kernel visits the listed key blocks only, and applies the predicate only in blocks
    flagged partial: with a listed block dropped from the index, the result is the reference
    with that block's keys masked; with a partial block flagged full, the reference with the
    block's entries all allowed."""
    b, h, s, d, kb = 1, 2, 256, 64, 64
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, b, h, s, s, d, "float16")
    mask = np.ones((b, 1, s, s), bool)
    mask[:, :, :, 2 * kb:3 * kb] = rng.random((b, 1, s, kb)) < 0.5     # key block 2 partial
    dropped = mask.copy()
    dropped[:, :, :QUERY_BLOCK, kb:2 * kb] = False                      # block 1 of query block 0
    index = reference_attention_block_index(BOOL, q.shape, k.shape, kb, mask=dropped)
    got = _run(BOOL, q, k, v, d, kb, "float16", index=index, variant=variant, mask=mask)
    _check(got, reference_sparse_attention(q, k, v, BOOL, mask=dropped), "float16")
    counts, ids, partial = reference_attention_block_index(BOOL, q.shape, k.shape, kb, mask=mask)
    assert partial[0, 0, 0, 2] == 1
    partial[:, :, 1, 2] = 0                                             # query block 1: "full"
    got = _run(BOOL, q, k, v, d, kb, "float16", index=(counts, ids, partial), variant=variant, mask=mask)
    trusted = mask.copy()
    trusted[:, :, QUERY_BLOCK:, 2 * kb:3 * kb] = True
    _check(got, reference_sparse_attention(q, k, v, BOOL, mask=trusted), "float16")


@pytest.mark.gpu
@settings(max_examples=24, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 3), sq=st.integers(1, 600), sk=st.integers(1, 600),
       density=st.floats(0.0, 1.0), seed=st.integers(0, 2**16), variant=st.sampled_from(list(VARIANTS)))
def test_gpu_fuzz_shapes(b, h, sq, sk, density, seed, variant):
    """any B, H, Sq, Sk (one build a form: they are symbolic) and block density"""
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, b, h, sq, sk, 64, "float16")
    mask = _block_mask(rng, b, 1, sq, sk, 64, density=density)
    got = _run(BOOL, q, k, v, 64, 64, "float16", variant=variant, mask=mask)
    _check(got, reference_sparse_attention(q, k, v, BOOL, mask=mask), "float16")


def test_scale_default_is_inverse_sqrt_head_dim():
    """the default scale is 1 / sqrt(d) (the reference's): both builds take the same constant"""
    a = block_sparse_attention_func(128, BOOL, "float16", 64).script()
    b = block_sparse_attention_func(128, BOOL, "float16", 64, scale=1 / math.sqrt(128)).script()
    assert a == b
