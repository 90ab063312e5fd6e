"""The block index of sparse attention, built on the device every call.

For each (batch ``b``, head group ``hg``, 128-query block ``qb``) it lists the key blocks of
``key_block`` rows that hold at least one allowed (query, key) pair, in ascending order:

* ``block_counts`` int32 ``[B, HG, QB]``: how many key blocks are listed;
* ``block_ids`` int32 ``[B, HG, QB, KB]``: the listed key block ids, tail ``-1``;
* ``block_partial`` int32 ``[B, HG, QB, KB]``: 1 where the listed block needs the element
  predicate (it holds a disallowed pair, or an additive mask value other than 0 on an allowed
  one), 0 for a full block (every pair allowed, nothing added); 0 in the tail.

``QB = ceil(Sq / 128)``, ``KB = ceil(Sk / key_block)``; ``HG`` is the mask's head dim (1 or H),
1 for a pattern without a mask.  Pairs outside ``[0, Sq) x [0, Sk)`` (the tails of the last
blocks) count neither as allowed nor as disallowed: the kernels bound-check them anyway.

A few kernels, no atomics, no host round trip (so deterministic byte for byte):

1. ``classify``, each block's class (0 empty, 1 partial, 2 full) into an int8 scratch. With a
   mask (or documents with a window): one CTA per (b, hg, qb, kb) block, its 256 threads evaluate
   :func:`pit_tvm.ops.sparse_attention.pattern_predicate` over the pairs: each thread owns a few
   consecutive keys and walks the query rows, reading the mask 16 bytes per load where a row is
   whole 16-byte vectors (entry by entry otherwise), and ORs two flags (some pair allowed, some
   pair needs the predicate); the CTA ORs the threads' flags through shared memory (32 threads
   an eighth each, then one thread the 32).  A
   boolean mask that is the whole pattern is tested four bytes at a time.
   Without one (window, global tokens, causal, documents): one CTA per query block and per key
   block reduces its positions' extremes (global / non-global positions, document ids), then one
   thread per (b, qb, kb) block decides its class from the two blocks' extremes.
2. ``compact``: one CTA per (b, hg, qb); each thread owns a contiguous run of key blocks, a
   block scan of the runs' counts gives each its write position, then it writes its ids,
   partial flags and the ``-1`` tail; thread 0 writes the count.
3. (``global_split`` only) ``list_global_rows``: one CTA per sequence lists its global positions
   the same way, and ``classify_global_tiles`` the global tiles' key blocks (head group 1)
   before ``compact``.

On the CPU the same kernels run with ``parallel`` CTAs and serial thread loops
(:mod:`pit_tvm.index._kernels`).
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.schedules.signature import without_params
from pit_tvm.target import is_gpu, make_target

from ._kernels import LOG_NT, NT, make_block_scan, make_run_sums, schedule_cpu, schedule_cuda

__all__ = ["attention_block_index_func", "reference_attention_block_index", "reference_mask_bits", "MASK_DTYPES",
           "MASK_BITS_KEYS"]

MASK_DTYPES = {"bool": ("bool",), "additive": ("float16", "bfloat16", "float32")}
#: keys a word of the packed boolean mask (``mask_bits``)
MASK_BITS_KEYS = 64
# classify's per-thread flags: some pair allowed, some pair needs the element predicate
_SOME_ALLOWED, _SOME_NEED_PREDICATE = 1, 2


def check_kernel_args(pattern, key_block, dtype, mask_dtype):
    """A ValueError naming the argument unless the kernels (the index and the generic
    attention kernel) take the key block, the q / k / v dtype and the mask's dtype."""
    from pit_tvm.ops.sparse_attention import ATTENTION_DTYPES, KEY_BLOCKS, QUERY_BLOCK

    if dtype not in ATTENTION_DTYPES:
        raise ValueError(f"sparse attention dtype must be one of {ATTENTION_DTYPES}, got {dtype!r}")
    if key_block not in KEY_BLOCKS:
        raise ValueError(f"key_block must be one of {KEY_BLOCKS}, got {key_block!r}")
    if pattern.mask is not None and mask_dtype not in MASK_DTYPES[pattern.mask]:
        raise ValueError(f"a {pattern.mask} mask must have dtype {' or '.join(MASK_DTYPES[pattern.mask])}, "
                         f"got {mask_dtype!r}")


def attention_block_index_func(pattern, key_block: int, dtype: str, target, mask_dtype: str | None = None,
                               global_split: bool = False, mask_bits: bool = False) -> tirx.PrimFunc:
    """PrimFunc ``(q[B, H, Sq, d], k[B, H, Sk, d], <mask, global_flags, doc_ids as the pattern
    has them>, block_counts, block_ids, block_partial[, global_rows, global_count])`` building the
    block index (q and k give the sizes only; they are not read).  B, H, Sq, Sk, d and the mask's
    head dim are symbolic.

    ``global_split`` (window + global tokens, :func:`~pit_tvm.ops.sparse_attention.splits_global_rows`):
    the index of the Hopper kernel that takes the global tokens apart.  It has two head groups:
    group 0 lists for each query block the key blocks of the window alone (partial where a pair is
    outside the window for a non-global query, or in different documents, or the block holds a
    global key: those are read from the gathered blocks instead); group 1 for each *global tile*
    (128 of the sequence's global rows, in order) the key blocks it attends to (every one without
    documents; with them those whose document ids meet the tile's, full where all are one id).
    Two more outputs list each sequence's global tokens: ``global_rows`` int32 ``[B, S]``
    (ascending, tail ``-1``) and ``global_count`` int32 ``[B]``.

    ``mask_bits`` (a boolean mask, key block 64): one more output, the mask packed 64 keys a word,
    ``mask_bits`` uint64 ``[B, HG, KB, Sq]``: bit ``j`` of row ``q``'s word of key block ``kb`` is entry
    ``(q, 64 kb + j)`` (0 past Sk), written while the mask is read for the classes (the Hopper kernel's
    predicate reads a partial block's 128 rows as 1 KB of bits, not 8 KB of bytes).  Key block
    major, so that a block's CTA writes its rows' words as one contiguous run (whole sectors)."""
    from pit_tvm.ops.sparse_attention import (QUERY_BLOCK, pattern_params_dropped, pattern_predicate,
                                              pattern_signature_buffers, sequence_lengths, splits_global_rows)

    check_kernel_args(pattern, key_block, dtype, mask_dtype)
    if mask_bits and (pattern.mask != "bool" or key_block != MASK_BITS_KEYS):
        raise ValueError(f"mask_bits packs a boolean mask for key block {MASK_BITS_KEYS}, got {pattern.tag}, "
                         f"key block {key_block}")
    if global_split and not splits_global_rows(pattern):
        raise ValueError(f"global_split takes a window + global tokens pattern without a mask or causal, "
                         f"got {pattern.tag}")
    target = make_target(target)
    st = schedule_cuda() if is_gpu(target) else schedule_cpu()
    BX, TX, SH = st.bx, st.tx, st.shared
    QBL, KBL = QUERY_BLOCK, key_block
    mask_is_additive = pattern.mask == "additive"
    block_scan = make_block_scan(st)
    run_sums = make_run_sums(st)

    # --- classify_pairs: each thread owns VEC consecutive keys of the block (a fixed column) and
    # walks the query rows ROWS_PER_PASS apart; VEC entries are 16 bytes of a mask row.  A boolean
    # mask is read through an int8 view (CUDA code has no bool vectors), or as uint32 words.
    mask_load_dtype = None if pattern.mask is None else ("int8" if pattern.mask == "bool" else mask_dtype)
    VEC = 1 if pattern.mask is None else 16 * 8 // tvm.DataType(mask_load_dtype).bits
    THREADS_PER_ROW = KBL // VEC
    ROWS_PER_PASS = NT // THREADS_PER_ROW
    PASSES = QBL // ROWS_PER_PASS
    pass_loop = T.unroll if PASSES <= 16 else T.serial
    # whole-vector passes are loaded LOADS_AHEAD at a time before any is tested, so that their
    # loads are in flight together
    LOADS_AHEAD = min(PASSES, 4)
    mask_is_whole_pattern = pattern.mask is not None and not (
        pattern.causal or pattern.window is not None or pattern.documents)
    test_words = pattern.mask == "bool" and mask_is_whole_pattern
    # the block id's parts: int32 on CUDA (a grid index is below 2**31), int64 on the CPU
    block_id_dtype = "int32" if st.gpu else "int64"

    def pair_flags(bufs, value, b, hg, q, k):
        """int32 classify flags of one in-bounds pair whose mask entry (as loaded; None without
        a mask) is ``value``"""
        mask_value = value
        if pattern.mask == "bool":
            mask_value = value != T.int8(0)
        ok = pattern_predicate(pattern, bufs, b, hg, q, k, mask_value=mask_value)
        bad = T.Not(ok)
        if mask_is_additive and mask_is_whole_pattern:
            bad = value != tirx.const(0, mask_dtype)   # (a disallowed value is <= -1e4 or NaN)
        elif mask_is_additive:
            bad = T.Or(bad, value != tirx.const(0, mask_dtype))
        return (T.Select(ok, T.int32(_SOME_ALLOWED), T.int32(0))
                | T.Select(bad, T.int32(_SOME_NEED_PREDICATE), T.int32(0)))

    def word_flags(word):
        """classify flags of four boolean mask entries (the bytes of a uint32 word) when the mask
        is the whole pattern: allowed if a byte is non-zero, needs the predicate if one is zero
        (the exact has-a-zero-byte test ``(w - 0x01010101) & ~w & 0x80808080``)"""
        has_zero = (word - tirx.const(0x01010101, "uint32")) & (~word) & tirx.const(0x80808080, "uint32")
        return (T.Select(word != tirx.const(0, "uint32"), T.int32(_SOME_ALLOWED), T.int32(0))
                | T.Select(has_zero != tirx.const(0, "uint32"), T.int32(_SOME_NEED_PREDICATE), T.int32(0)))

    def word_bits(words, i):
        """(``mask_bits``) the 16 entries of words ``words[i, 0..3]`` (4 boolean bytes each, 0 or 1) as
        bits: a word times 0x00204081 holds its byte e at bit 21 + e (byte e's copies land at
        8 e + 7 c: no two terms share a bit, so nothing carries), four ops a word"""
        bits = T.uint32(0)
        for j in range(4):
            bits = bits | T.shift_left(T.bitwise_and(T.shift_right(words[i, j] * T.uint32(0x00204081), T.uint32(21)),
                                                     T.uint32(0xF)), T.uint32(4 * j))
        return T.Cast("uint16", bits)

    def entry_bits(entry_allowed):
        """(``mask_bits``) 16 entries as bits, ``entry_allowed(j)`` the j-th (bool)"""
        bits = T.uint16(0)
        for j in range(VEC):
            bits = bits | T.shift_left(T.Cast("uint16", entry_allowed(j)), T.uint16(j))
        return bits

    def bits_at(batch, group, row, col, HG, Sq, KB, rows_on):
        """(``mask_bits``) the 16-bit word of the thread's keys ``col[0] ..`` in row ``row[0] + rows_on``"""
        return ((((batch[0] * HG + group[0]) * KB + col[0] // KBL) * Sq + row[0] + rows_on) * 4
                + col[0] % KBL // 16)

    def block_class(flags):
        """int8 class of a block from the OR of its threads' flags"""
        return T.Select(T.bitwise_and(flags, _SOME_ALLOWED) == 0, T.int8(0),
                        T.Select(T.bitwise_and(flags, _SOME_NEED_PREDICATE) != 0, T.int8(1), T.int8(2)))

    def as_block_id(x):
        return T.Cast(block_id_dtype, x)

    @T.macro
    def classify_pairs(bufs, FL, EX, BITS, B, HG, Sq, Sk, QB, KB):
        """(``EX``, the extremes' scratch, unused: the signature of ``classify_extremes``; ``BITS``:
        ``mask_bits``' output, written as 16-bit words, one a thread's 16 keys of a row)"""
        if mask_bits:
            bits16 = T.decl_buffer((B * HG * Sq * KB * 4,), "uint16", data=BITS.data)
        if pattern.mask is not None:
            mask_entries = T.decl_buffer((B * HG * Sq * Sk,), mask_load_dtype, data=bufs[0].data)
            # whole 16-byte vectors (read where Sk % VEC == 0), indexed by vector: the flat index is
            # visibly a multiple of VEC, which the CUDA code generator needs to emit a wide load
            if test_words:
                mask_words = T.decl_buffer((B * HG * Sq * (Sk // VEC), 4), "uint32", data=bufs[0].data)
            else:
                mask_vectors = T.decl_buffer((B * HG * Sq * (Sk // VEC), VEC), mask_load_dtype,
                                             data=bufs[0].data)
        for blk in BX(B * HG * QB * KB):
            # the CTA's OR of its threads' flags: each thread's flags into its own shared word, then
            # 32 threads OR a strided eighth each, then thread 0 the 32 (every phase reads what the
            # one before wrote: the barriers between them are TVM's)
            thread_flags = T.alloc_buffer((NT,), "int32", scope=SH)
            lane_flags = T.alloc_buffer((32,), "int32", scope=SH)
            for tx in TX(NT):
                flags = T.alloc_buffer((1,), "int32", scope="local")
                # the thread's batch, head group, first query row, first key and first mask entry
                # (or vector) read, in registers: computed once, not again in each branch below
                batch = T.alloc_buffer((1,), "int64", scope="local")
                group = T.alloc_buffer((1,), "int64", scope="local")
                row = T.alloc_buffer((1,), "int64", scope="local")
                col = T.alloc_buffer((1,), "int64", scope="local")
                first = T.alloc_buffer((1,), "int64", scope="local")
                block_id = T.bind(as_block_id(blk))
                batch[0] = T.Cast("int64", T.truncdiv(block_id, as_block_id(HG * QB * KB)))
                group[0] = T.Cast("int64", T.truncmod(T.truncdiv(block_id, as_block_id(QB * KB)), as_block_id(HG)))
                row[0] = (T.Cast("int64", T.truncmod(T.truncdiv(block_id, as_block_id(KB)), as_block_id(QB))) * QBL
                          + tx // THREADS_PER_ROW)
                col[0] = T.Cast("int64", T.truncmod(block_id, as_block_id(KB))) * KBL + tx % THREADS_PER_ROW * VEC
                flags[0] = 0
                if pattern.mask is not None:
                    if Sk % VEC == 0:     # rows start 16-byte aligned: whole vectors, in or out
                        first[0] = ((batch[0] * HG + group[0]) * Sq + row[0]) * (Sk // VEC) + col[0] // VEC
                        if col[0] < Sk:
                            if test_words:
                                words = T.alloc_buffer((LOADS_AHEAD, 4), "uint32", scope="local")
                                for g in T.serial(PASSES // LOADS_AHEAD):
                                    for i in T.unroll(LOADS_AHEAD):
                                        if row[0] + (g * LOADS_AHEAD + i) * ROWS_PER_PASS < Sq:
                                            for j in T.vectorized(4):
                                                words[i, j] = mask_words[
                                                    first[0] + (g * LOADS_AHEAD + i) * ROWS_PER_PASS * (Sk // VEC), j]
                                    for i in T.unroll(LOADS_AHEAD):
                                        if row[0] + (g * LOADS_AHEAD + i) * ROWS_PER_PASS < Sq:
                                            for j in T.unroll(4):
                                                flags[0] = flags[0] | word_flags(words[i, j])
                                            if mask_bits:
                                                bits16[bits_at(batch, group, row, col, HG, Sq, KB,
                                                               (g * LOADS_AHEAD + i) * ROWS_PER_PASS)] = word_bits(words, i)
                            else:
                                entries = T.alloc_buffer((LOADS_AHEAD, VEC), mask_load_dtype, scope="local")
                                for g in T.serial(PASSES // LOADS_AHEAD):
                                    for i in T.unroll(LOADS_AHEAD):
                                        if row[0] + (g * LOADS_AHEAD + i) * ROWS_PER_PASS < Sq:
                                            for j in T.vectorized(VEC):
                                                entries[i, j] = mask_vectors[
                                                    first[0] + (g * LOADS_AHEAD + i) * ROWS_PER_PASS * (Sk // VEC), j]
                                    for i in T.unroll(LOADS_AHEAD):
                                        if row[0] + (g * LOADS_AHEAD + i) * ROWS_PER_PASS < Sq:
                                            for j in T.unroll(VEC):
                                                flags[0] = flags[0] | pair_flags(
                                                    bufs, entries[i, j], batch[0], group[0],
                                                    row[0] + (g * LOADS_AHEAD + i) * ROWS_PER_PASS, col[0] + j)
                                            if mask_bits:
                                                bits16[bits_at(batch, group, row, col, HG, Sq, KB,
                                                               (g * LOADS_AHEAD + i) * ROWS_PER_PASS)] = entry_bits(
                                                    lambda j: entries[i, j] != T.int8(0))
                        elif mask_bits:     # (the chunk past Sk: its bits are 0)
                            for i in pass_loop(PASSES):
                                if row[0] + i * ROWS_PER_PASS < Sq:
                                    bits16[bits_at(batch, group, row, col, HG, Sq, KB, i * ROWS_PER_PASS)] = T.uint16(0)
                    else:
                        first[0] = ((batch[0] * HG + group[0]) * Sq + row[0]) * Sk + col[0]
                        for i in pass_loop(PASSES):
                            for j in T.unroll(VEC):
                                if row[0] + i * ROWS_PER_PASS < Sq and col[0] + j < Sk:
                                    flags[0] = flags[0] | pair_flags(
                                        bufs, mask_entries[first[0] + i * ROWS_PER_PASS * Sk + j], batch[0],
                                        group[0], row[0] + i * ROWS_PER_PASS, col[0] + j)
                            if mask_bits:
                                if row[0] + i * ROWS_PER_PASS < Sq:
                                    bits16[bits_at(batch, group, row, col, HG, Sq, KB, i * ROWS_PER_PASS)] = entry_bits(
                                        lambda j: T.And(col[0] + j < Sk, mask_entries[
                                            first[0] + i * ROWS_PER_PASS * Sk + T.min(j, Sk - 1 - col[0])] != T.int8(0)))
                else:
                    for i in pass_loop(PASSES):
                        if row[0] + i * ROWS_PER_PASS < Sq and col[0] < Sk:
                            flags[0] = flags[0] | pair_flags(bufs, None, batch[0], group[0], row[0] + i * ROWS_PER_PASS,
                                                             col[0])
                thread_flags[tx] = flags[0]
            for tx in TX(NT):
                if tx < 32:
                    eighth = T.alloc_buffer((1,), "int32", scope="local")
                    eighth[0] = 0
                    for j in T.unroll(NT // 32):
                        eighth[0] = eighth[0] | thread_flags[j * 32 + tx]
                    lane_flags[tx] = eighth[0]
            for tx in TX(NT):
                if tx == 0:
                    found = T.alloc_buffer((1,), "int32", scope="local")
                    found[0] = 0
                    for j in T.unroll(32):
                        found[0] = found[0] | lane_flags[j]
                    FL[blk] = block_class(found[0])

    # --- window / global tokens / causal / documents without a mask: decided per block from the
    # position extremes of its query block and of its key block (exact, see
    # _block_class_by_extremes), each position block's reduced once (not once a pair of blocks)
    has_global = pattern.global_tokens
    has_docs = pattern.documents
    BIG = 1 << 30
    INT_MAX, INT_MIN = 2**31 - 1, -(2**31)
    N_EXTREMES = 6      # a position block's max / min global, min / max non-global, min / max doc id

    def doc_of(bufs, b, pos):
        return bufs[len(bufs) - 1][b, pos]      # (doc_ids comes last)

    def is_global(bufs, b, pos):
        if has_global:
            return bufs[0][b, pos] != 0
        return tirx.const(False, "bool")

    @T.macro
    def block_reduce_to(sA, op_min):
        for step in T.unroll(LOG_NT):
            for tx in TX(NT):
                if tx < T.shift_right(NT // 2, step):
                    if op_min:
                        sA[tx] = T.min(sA[tx], sA[tx + T.shift_right(NT // 2, step)])
                    else:
                        sA[tx] = T.max(sA[tx], sA[tx + T.shift_right(NT // 2, step)])

    def block_start(p, QB):
        """the first position of position block ``p``: query block ``p`` (p < QB), else key block p - QB"""
        return T.if_then_else(p < QB, p * QBL, (p - QB) * KBL)

    def block_end(p, QB, Sq, Sk):
        """one past the last in-bounds position of position block ``p``"""
        return T.if_then_else(p < QB, T.min((p + 1) * QBL, Sq), T.min((p - QB + 1) * KBL, Sk))

    @T.macro
    def position_extremes(bufs, EX, B, Sq, Sk, QB, KB):
        """EX[b, p, :] for each query block and key block p of sequence b (one CTA each)"""
        for blk in BX(B * (QB + KB)):
            e0 = T.alloc_buffer((NT,), "int32", scope=SH)
            e1 = T.alloc_buffer((NT,), "int32", scope=SH)
            e2 = T.alloc_buffer((NT,), "int32", scope=SH)
            e3 = T.alloc_buffer((NT,), "int32", scope=SH)
            e4 = T.alloc_buffer((NT,), "int32", scope=SH)
            e5 = T.alloc_buffer((NT,), "int32", scope=SH)
            for tx in TX(NT):
                e0[tx] = -1
                e1[tx] = BIG
                e2[tx] = BIG
                e3[tx] = -1
                e4[tx] = INT_MAX
                e5[tx] = INT_MIN
                if block_start(blk % (QB + KB), QB) + tx < block_end(blk % (QB + KB), QB, Sq, Sk):
                    if has_docs:
                        e4[tx] = doc_of(bufs, blk // (QB + KB), block_start(blk % (QB + KB), QB) + tx)
                        e5[tx] = doc_of(bufs, blk // (QB + KB), block_start(blk % (QB + KB), QB) + tx)
                    if is_global(bufs, blk // (QB + KB), block_start(blk % (QB + KB), QB) + tx):
                        e0[tx] = T.Cast("int32", block_start(blk % (QB + KB), QB) + tx)
                        e1[tx] = T.Cast("int32", block_start(blk % (QB + KB), QB) + tx)
                    else:
                        e2[tx] = T.Cast("int32", block_start(blk % (QB + KB), QB) + tx)
                        e3[tx] = T.Cast("int32", block_start(blk % (QB + KB), QB) + tx)
            if has_global:
                block_reduce_to(e0, False)
                block_reduce_to(e1, True)
            block_reduce_to(e2, True)
            block_reduce_to(e3, False)
            if has_docs:
                block_reduce_to(e4, True)
                block_reduce_to(e5, False)
            for tx in TX(NT):
                if tx == 0:
                    EX[blk * N_EXTREMES] = e0[0]
                    EX[blk * N_EXTREMES + 1] = e1[0]
                    EX[blk * N_EXTREMES + 2] = e2[0]
                    EX[blk * N_EXTREMES + 3] = e3[0]
                    EX[blk * N_EXTREMES + 4] = e4[0]
                    EX[blk * N_EXTREMES + 5] = e5[0]

    @T.macro
    def classify_extremes(bufs, FL, EX, BITS, B, HG, Sq, Sk, QB, KB):
        position_extremes(bufs, EX, B, Sq, Sk, QB, KB)
        # one thread a (b, query block, key block): its class from the two blocks' extremes
        for c in BX((B * QB * KB + (NT - 1)) // NT):
            for tx in TX(NT):
                if c * NT + tx < B * QB * KB:
                    # e: 0 max global q, 1 min / 2 max non-global q, 3 min global k, 4 min / 5 max
                    # non-global k; 6 min / 7 max doc id of the queries, 8 / 9 of the keys
                    e = T.alloc_buffer((10,), "int32", scope="local")
                    e[0] = EX[((c * NT + tx) // (QB * KB) * (QB + KB) + (c * NT + tx) // KB % QB) * N_EXTREMES]
                    e[1] = EX[((c * NT + tx) // (QB * KB) * (QB + KB) + (c * NT + tx) // KB % QB) * N_EXTREMES + 2]
                    e[2] = EX[((c * NT + tx) // (QB * KB) * (QB + KB) + (c * NT + tx) // KB % QB) * N_EXTREMES + 3]
                    e[6] = EX[((c * NT + tx) // (QB * KB) * (QB + KB) + (c * NT + tx) // KB % QB) * N_EXTREMES + 4]
                    e[7] = EX[((c * NT + tx) // (QB * KB) * (QB + KB) + (c * NT + tx) // KB % QB) * N_EXTREMES + 5]
                    e[3] = EX[((c * NT + tx) // (QB * KB) * (QB + KB) + QB + (c * NT + tx) % KB) * N_EXTREMES + 1]
                    e[4] = EX[((c * NT + tx) // (QB * KB) * (QB + KB) + QB + (c * NT + tx) % KB) * N_EXTREMES + 2]
                    e[5] = EX[((c * NT + tx) // (QB * KB) * (QB + KB) + QB + (c * NT + tx) % KB) * N_EXTREMES + 3]
                    e[8] = EX[((c * NT + tx) // (QB * KB) * (QB + KB) + QB + (c * NT + tx) % KB) * N_EXTREMES + 4]
                    e[9] = EX[((c * NT + tx) // (QB * KB) * (QB + KB) + QB + (c * NT + tx) % KB) * N_EXTREMES + 5]
                    # (the split's window tiles are its head group 0 of 2: skip each sequence's group 1)
                    FL[c * NT + tx + (c * NT + tx) // (QB * KB) * (QB * KB) * (HG - 1)] = _block_class_by_extremes(
                        pattern, e, T.Cast("int32", (c * NT + tx) // KB % QB * QBL),
                        T.Cast("int32", T.min((c * NT + tx) // KB % QB * QBL + (QBL - 1), Sq - 1)),
                        T.Cast("int32", (c * NT + tx) % KB * KBL),
                        T.Cast("int32", T.min((c * NT + tx) % KB * KBL + (KBL - 1), Sk - 1)), global_split)

    # (documents with a window: the AND of two "some pair allowed" tests would over-list; the
    # split's window blocks take it: its padding-as-documents over-lists only a boundary's blocks)
    by_extremes = pattern.mask is None and not (pattern.documents and pattern.window is not None and not global_split)
    classify = classify_extremes if by_extremes else classify_pairs

    def count_if(at, is_listed):
        """``add(acc, i)`` for run_sums: count item ``i`` if listed"""
        @T.macro
        def add(acc, i):
            if is_listed(at, i):
                acc[0] = acc[0] + 1

        return add

    @T.macro
    def list_in_order(n, at, is_listed, put, put_tail, put_count):
        """one CTA lists the items ``i < n`` where ``is_listed(at, i)``, in ascending order:
        ``put(at, pos, i)`` for each, ``put_tail(at, pos)`` for the positions past the last and
        ``put_count(at, total)`` once (``at``: the CTA's output coordinates; a run-wise block scan
        gives each thread its first position)"""
        sA = T.alloc_buffer((NT,), "int32", scope=SH)
        sB = T.alloc_buffer((NT,), "int32", scope=SH)
        run_sums(sA, n, count_if(at, is_listed))
        block_scan(sA, sB)
        for tx in TX(NT):
            pos = T.alloc_buffer((1,), "int32", scope="local")
            pos[0] = 0
            if tx > 0:
                pos[0] = sA[tx - 1]
            for j in range((n + (NT - 1)) // NT):
                if tx * ((n + (NT - 1)) // NT) + j < n:
                    if is_listed(at, tx * ((n + (NT - 1)) // NT) + j):
                        put(at, pos[0], tx * ((n + (NT - 1)) // NT) + j)
                        pos[0] = pos[0] + 1
            if tx == 0:
                put_count(at, sA[NT - 1])
        for tx in TX(NT):
            total = T.alloc_buffer((1,), "int32", scope="local")
            total[0] = sA[NT - 1]
            for j in range((n + (NT - 1)) // NT):
                if j * NT + tx < n:
                    if j * NT + tx >= T.Cast("int64", total[0]):
                        put_tail(at, j * NT + tx)

    # the block lists: ``at`` = (flags FL, its offset, CNT, IDS, PART, b, hg, qb)
    def block_listed(at, j):
        return at[0][at[1] + j] != T.int8(0)

    @T.macro
    def put_block(at, pos, j):
        at[3][at[5], at[6], at[7], pos] = T.Cast("int32", j)
        at[4][at[5], at[6], at[7], pos] = T.Select(at[0][at[1] + j] == T.int8(1), T.int32(1), T.int32(0))

    @T.macro
    def put_no_block(at, pos):
        at[3][at[5], at[6], at[7], pos] = -1
        at[4][at[5], at[6], at[7], pos] = 0

    @T.macro
    def put_block_count(at, total):
        at[2][at[5], at[6], at[7]] = total

    @T.macro
    def compact(FL, CNT, IDS, PART, B, HG, QB, KB):
        for g in BX(B * HG * QB):
            list_in_order(KB, (FL, g * KB, CNT, IDS, PART, g // (HG * QB), g // QB % HG, g % QB), block_listed,
                          put_block, put_no_block, put_block_count)

    # the global rows: ``at`` = (global flags, ROWS, GCNT, b)
    def row_is_global(at, i):
        return at[0][at[3], i] != 0

    @T.macro
    def put_row(at, pos, i):
        at[1][at[3], pos] = T.Cast("int32", i)

    @T.macro
    def put_no_row(at, pos):
        at[1][at[3], pos] = -1

    @T.macro
    def put_row_count(at, total):
        at[2][at[3]] = total

    @T.macro
    def list_global_rows(flags, ROWS, GCNT, B, S):
        """per sequence, the positions of its global tokens in ascending order, and their count"""
        for b in BX(B):
            list_in_order(S, (flags, ROWS, GCNT, b), row_is_global, put_row, put_no_row, put_row_count)

    @T.macro
    def classify_global_tiles(docs, ROWS, GCNT, FL, EX, B, S, QB, KB):
        """(``global_split``) head group 1's classes: global tile ``t`` of sequence ``b`` (its global
        rows ``ROWS[b, 128 t ..]``) against key block ``kb``: empty past the count; with documents
        from the tile's and the block's doc id ranges (as :func:`_block_class_by_extremes`); else
        full (the kernel bounds the tail block's keys)"""
        for blk in BX(B * QB):
            lo = T.alloc_buffer((NT,), "int32", scope=SH)
            hi = T.alloc_buffer((NT,), "int32", scope=SH)
            for tx in TX(NT):
                lo[tx] = INT_MAX
                hi[tx] = INT_MIN
                if has_docs:
                    if tx < QBL:
                        if blk % QB * QBL + tx < T.Cast("int64", GCNT[blk // QB]):
                            lo[tx] = docs[blk // QB, ROWS[blk // QB, blk % QB * QBL + tx]]
                            hi[tx] = docs[blk // QB, ROWS[blk // QB, blk % QB * QBL + tx]]
            if has_docs:
                block_reduce_to(lo, True)
                block_reduce_to(hi, False)
            for tx in TX(NT):
                for j in range((KB + (NT - 1)) // NT):
                    if j * NT + tx < KB:
                        # (key block kb = j NT + tx: its min / max doc id, the position extremes 4, 5)
                        key_lo = EX[(blk // QB * (QB + KB) + QB + j * NT + tx) * N_EXTREMES + 4]
                        key_hi = EX[(blk // QB * (QB + KB) + QB + j * NT + tx) * N_EXTREMES + 5]
                        at = ((blk // QB * 2 + 1) * QB + blk % QB) * KB + j * NT + tx
                        if blk % QB * QBL >= T.Cast("int64", GCNT[blk // QB]):
                            FL[at] = T.int8(0)
                        elif has_docs:
                            FL[at] = T.Select(T.max(lo[0], key_lo) <= T.min(hi[0], key_hi), T.Select(
                                T.And(lo[0] == hi[0], T.And(key_lo == lo[0], key_hi == lo[0])), T.int8(2), T.int8(1)),
                                T.int8(0))
                        else:
                            FL[at] = T.int8(2)

    mdt = mask_dtype or "bool"

    def extremes_size(B, QB, KB):
        """the position blocks' extremes scratch (one int32 where the pattern has a mask)"""
        return T.max(B * (QB + KB) * N_EXTREMES, 1) if by_extremes else 1

    def qb_of(Sq):
        return (Sq + (QBL - 1)) // QBL

    def kb_of(Sk):
        return (Sk + (KBL - 1)) // KBL

    def groups(HG):
        """the index's head groups: the mask's head dim, 1 without a mask; with ``global_split`` 2
        (the window tiles, the global tiles)"""
        if global_split:
            return 2
        return HG if pattern.mask is not None else 1

    @T.prim_func(s_tir=True)
    def index(q: T.handle, k: T.handle, m: T.handle, x: T.handle, y: T.handle, c: T.handle, i: T.handle,
              p: T.handle, mb: T.handle, gr: T.handle, gc: T.handle):
        T.func_attr({"tirx.noalias": True})
        B, H, Sq, Sk, S, D, HG = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Lq, Lk = T.meta_var(sequence_lengths(pattern, Sq, Sk, S))
        G = T.meta_var(groups(HG))
        Q = T.match_buffer(q, (B, H, Lq, D), dtype)
        K = T.match_buffer(k, (B, H, Lk, D), dtype)
        M = T.match_buffer(m, (B, HG, Lq, Lk), mdt)
        X = T.match_buffer(x, (B, Lq), "int32")
        Y = T.match_buffer(y, (B, Lq), "int32")
        CNT = T.match_buffer(c, (B, G, qb_of(Lq)), "int32")
        IDS = T.match_buffer(i, (B, G, qb_of(Lq), kb_of(Lk)), "int32")
        PART = T.match_buffer(p, (B, G, qb_of(Lq), kb_of(Lk)), "int32")
        BITS = T.match_buffer(mb, (B, G, kb_of(Lk), Lq), "uint64")
        GROWS = T.match_buffer(gr, (B, Lq), "int32")
        GCNT = T.match_buffer(gc, (B,), "int32")
        FL = T.sblock_alloc_buffer((T.max(B * G * qb_of(Lq) * kb_of(Lk), 1),), "int8")
        EX = T.sblock_alloc_buffer((extremes_size(B, qb_of(Lq), kb_of(Lk)),), "int32")
        classify(pattern_signature_buffers(pattern, M, X, Y), FL, EX, BITS, B, G, Lq, Lk, qb_of(Lq), kb_of(Lk))
        if global_split:
            list_global_rows(X, GROWS, GCNT, B, Lq)
            classify_global_tiles(Y, GROWS, GCNT, FL, EX, B, Lq, qb_of(Lq), kb_of(Lk))
        compact(FL, CNT, IDS, PART, B, G, qb_of(Lq), kb_of(Lk))

    dropped = (pattern_params_dropped(pattern) + (() if global_split else ("gr", "gc"))
               + (() if mask_bits else ("mb",)))
    func = without_params(index, ("q", "k", "m", "x", "y", "c", "i", "p", "mb", "gr", "gc"), dropped)
    name = (f"pit_attention_index_{pattern.tag}_kb{key_block}_{dtype}" + (f"_{mdt}" if pattern.mask else "")
            + ("_gsplit" if global_split else "") + ("_bits" if mask_bits else ""))
    func = func.with_attr("global_symbol", name).with_attr("pit.index.num_inputs", 2 + len(pattern.inputs))
    if is_gpu(target):
        func = func.with_attr("tirx.is_scheduled", True)
    return func


def _block_class_by_extremes(pattern, e, q0, q1, k0, k1, global_split=False):
    """int8 class (0 empty, 1 partial, 2 full) of the block of queries ``[q0, q1]`` x keys
    ``[k0, k1]`` (both in bounds) for causal / window / global tokens, from ``e``: the max global
    query, the min / max non-global query, the min global key, the min / max non-global key
    (-1 / 2**30 where there is none).

    allowed = causal_ok AND (|q - k| <= w OR g[k] OR g[q]), so "any pair allowed" is the OR of
    three interval tests (a window pair: ``q - k`` in ``[lo, w]`` meets ``[q0 - k1, q1 - k0]``,
    ``lo`` 0 when causal else -w; a global key at or before the last query; a global query at or
    after the first key) and "every pair allowed" needs every key at or before every query
    (causal) and every non-global pair inside the window.

    Documents (without a window, or with ``global_split``; ``e[6:10]`` the min / max doc id of the
    queries and of the keys):
    some pair shares a document when the two id ranges meet (causal: a key block inside the
    query block holds the diagonal; one before it needs the ranges to meet), exact for
    non-decreasing ids (packed sequences); for other ids a listed block may hold no allowed
    pair (partial: the kernels skip its pairs), and no block with an allowed pair is ever left
    out.  Every pair shares one when all four ids are equal (exact for any ids).

    ``global_split``: the window's blocks alone (the global rows and keys are the kernel's
    gathered tiles): listed where a pair is in the window (and the blocks' documents meet), full
    where no key is global and every non-global query's pairs are in the window (and in one
    document)."""
    big = 1 << 30
    true = tirx.const(True, "bool")
    any_ok = true if not pattern.causal else k0 <= q1
    all_ok = true if not pattern.causal else k1 <= q0
    if pattern.documents:    # (no window, or the split's window blocks: see the caller)
        shared = T.max(e[6], e[8]) <= T.min(e[7], e[9])
        if pattern.causal:   # a key block inside the query block holds the diagonal (k, k)
            shared = T.Or(T.And(k0 >= q0, k0 <= q1), T.And(k1 < q0, shared))
        any_ok = T.And(any_ok, shared)
        all_ok = T.And(all_ok, T.And(T.And(e[6] == e[7], e[8] == e[9]), e[6] == e[8]))
    if pattern.window is not None:
        w = T.int32(pattern.window)
        lo = T.int32(0) if pattern.causal else -w
        near = T.max(q0 - k1, lo) <= T.min(q1 - k0, w)
        if pattern.global_tokens and not global_split:
            key_global = e[3] <= q1 if pattern.causal else e[3] < big
            row_global = e[0] >= k0 if pattern.causal else e[0] >= 0
            near = T.Or(near, T.Or(key_global, row_global))
        any_ok = T.And(any_ok, near)
        in_window = T.max(e[2] - e[4], e[5] - e[1]) <= w
        all_ok = T.And(all_ok, T.Or(T.Or(e[1] == big, e[4] == big), in_window))
        if global_split:
            all_ok = T.And(all_ok, e[3] == big)
    return T.Select(any_ok, T.Select(all_ok, T.int8(2), T.int8(1)), T.int8(0))


def _global_tile_classes(g, doc_ids, Sk, QB, KB, key_block):
    """(listed, partial) ``[B, 1, QB, KB]`` of the global tiles (128 global rows each, in order)
    against the key blocks: without documents every block of a tile with rows, full; with them
    listed where the tile's and the block's document id ranges meet, full where both hold one
    and the same id (the index's rule: a range test, a superset of the blocks with an allowed pair)"""
    from pit_tvm.ops.sparse_attention import QUERY_BLOCK

    B = g.shape[0]
    listed = np.zeros((B, 1, QB, KB), bool)
    partial = np.zeros((B, 1, QB, KB), bool)
    for b in range(B):
        rows = np.nonzero(g[b])[0]
        for t in range(-(-len(rows) // QUERY_BLOCK)):
            if doc_ids is None:
                listed[b, 0, t] = True
                continue
            tile_docs = np.asarray(doc_ids)[b, rows[t * QUERY_BLOCK:(t + 1) * QUERY_BLOCK]]
            for kb in range(KB):
                key_docs = np.asarray(doc_ids)[b, kb * key_block:min((kb + 1) * key_block, Sk)]
                listed[b, 0, t, kb] = max(tile_docs.min(), key_docs.min()) <= min(tile_docs.max(), key_docs.max())
                partial[b, 0, t, kb] = not (tile_docs.min() == tile_docs.max() == key_docs.min() == key_docs.max())
    return listed, partial


def reference_mask_bits(mask) -> np.ndarray:
    """numpy reference of the index's ``mask_bits``: a boolean mask ``[B, HG, Sq, Sk]`` packed
    :data:`MASK_BITS_KEYS` keys a little-endian uint64 word, ``[B, HG, ceil(Sk / 64), Sq]``, 0 past Sk"""
    mask = np.asarray(mask, bool)
    sk = mask.shape[-1]
    words = -(-sk // MASK_BITS_KEYS)
    padded = np.zeros(mask.shape[:-1] + (words * MASK_BITS_KEYS,), bool)
    padded[..., :sk] = mask
    packed = np.packbits(padded, axis=-1, bitorder="little").view("<u8").reshape(mask.shape[:-1] + (words,))
    return np.ascontiguousarray(np.swapaxes(packed, -1, -2))


def reference_attention_block_index(pattern, q_shape, k_shape, key_block: int, *, mask=None, global_flags=None,
                                    doc_ids=None, global_split=False, mask_bits=False):
    """numpy reference of :func:`attention_block_index_func`: ``(counts, ids, partial)``, and with
    ``global_split`` (head group 0 the window tiles, 1 the global tiles) also ``(global_rows,
    global_count)``, with ``mask_bits`` also the packed mask (:func:`reference_mask_bits`)."""
    from pit_tvm.ops.sparse_attention import QUERY_BLOCK, reference_allowed

    B, H, Sq, _ = q_shape
    Sk = k_shape[2]
    if global_split:
        # the window's pairs (in one document); a pair needs the predicate where its key is global
        # (read from the gathered blocks), or for a non-global query it is outside the window, or
        # the two are in different documents (the kernel's index decides documents from the blocks'
        # id ranges: equal to this for non-decreasing ids)
        g = np.asarray(global_flags) != 0
        near = np.abs(np.arange(Sq)[:, None] - np.arange(Sk)[None, :]) <= pattern.window
        same_doc = np.ones((B, 1, Sq, Sk), bool)
        if pattern.documents:
            d = np.asarray(doc_ids)
            same_doc = (d[:, :Sq, None] == d[:, None, :Sk])[:, None]
        allowed = near[None, None] & same_doc
        needs = g[:, None, None, :Sk] | (~g[:, None, :Sq, None] & ~near[None, None]) | ~same_doc
    else:
        allowed = reference_allowed(pattern, B, H, Sq, Sk, mask=mask, global_flags=global_flags, doc_ids=doc_ids)
        needs = ~allowed
    if pattern.mask == "additive":
        needs = needs | (np.asarray(mask).astype(np.float32) != 0)
    HG = allowed.shape[1] if pattern.mask is None else np.asarray(mask).shape[1]
    allowed = np.broadcast_to(allowed, (B, HG, Sq, Sk))
    needs = np.broadcast_to(needs, (B, HG, Sq, Sk))
    QB, KB = -(-Sq // QUERY_BLOCK), -(-Sk // key_block)
    pad = ((0, 0), (0, 0), (0, QB * QUERY_BLOCK - Sq), (0, KB * key_block - Sk))
    a = np.pad(allowed, pad).reshape(B, HG, QB, QUERY_BLOCK, KB, key_block).any(axis=(3, 5))
    n = np.pad(needs, pad).reshape(B, HG, QB, QUERY_BLOCK, KB, key_block).any(axis=(3, 5))
    if global_split:    # head group 1: the global tiles
        ga, gn = _global_tile_classes(g, doc_ids if pattern.documents else None, Sk, QB, KB, key_block)
        a, n = np.concatenate([a, ga], axis=1), np.concatenate([n, gn], axis=1)
        HG = 2
    counts = a.sum(axis=-1).astype(np.int32)
    ids = np.full((B, HG, QB, KB), -1, np.int32)
    partial = np.zeros((B, HG, QB, KB), np.int32)
    for idx in np.ndindex(B, HG, QB):
        listed = np.nonzero(a[idx])[0]
        ids[idx][: len(listed)] = listed
        partial[idx][: len(listed)] = n[idx][listed]
    if mask_bits:
        return counts, ids, partial, reference_mask_bits(mask)
    if not global_split:
        return counts, ids, partial
    rows = np.full((B, Sq), -1, np.int32)
    for b in range(B):
        found = np.nonzero(g[b])[0]
        rows[b, : len(found)] = found
    return counts, ids, partial, rows, g.sum(axis=1).astype(np.int32)
