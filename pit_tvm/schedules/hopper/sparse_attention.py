"""Block-sparse attention on the H100 (sm_90a): a FlashAttention-style online-softmax kernel
that reads only the key blocks a per-call device index lists (PIT's SRead along the key axis).

Workload (``q``: ``[B, H, Sq, D]``, ``k, v``: ``[B, H, Sk, D]``, fp16 or bf16, D 64 or 128)::

    o[b, h, q] = sum_k softmax_k(q . k * scale + mask(b, h, q, k)) v[b, h, k]   over allowed k

with ``allowed(b, h, q, k)`` the pattern's element predicate (a mask tensor, causal, a window,
global tokens, documents: :func:`pit_tvm.ops.sparse_attention.pattern_predicate`).  A row with
no allowed key gives 0.  The softmax's sum and the P V product do not depend on the keys'
order, so a query block may visit only its listed key blocks, in any order.

Index (built on the device every call, ``pit_tvm/index/``): per ``(b, head group hg, 128-query
block qb)`` ``block_counts[b, hg, qb]`` listed key blocks of ``key_block`` keys,
``block_ids[b, hg, qb, j]`` their ids and ``block_partial[b, hg, qb, j]`` (1: the listed block
has a disallowed entry or a non-zero additive bias, so the element predicate is applied in
it; 0: every entry allowed, nothing added); for a boolean mask (``mask_bits``, the default) also
the mask packed 64 keys a word, ``mask_bits[b, hg, kb, q]``.
``hg = min(h, HG - 1)`` (HG: the mask's head dim, 1 or H; 1 without a mask).

One CTA per (128-query block, head, batch); B, H, Sq, Sk, HG and the mask's head dim symbolic
(with ``global_split``, Longformer's window + global tokens: global tiles of gathered global rows
first, then the window tiles; :class:`QueryTile`).  The default form: a loader warpgroup and 2
consumer warpgroups (384 threads, one CTA an SM; the loader hands registers to the consumers,
``register_split``).  A step takes a key tile of KT keys: one listed block (KT = KB), or
(``pair_blocks``, key block 64; the default with the loader's registers handed over, but with staged
mask tiles at head dim 128) two listed blocks side by side (KT = 128, the second the empty block
past an odd count)::

    loader warpgroup (128 threads, cp.async; then it exits):
        SRead Q_s[128, D] (rows past Sq zero-filled)                       -> Q mbarrier
        for step j (blocks of (b, hg, qb) listed j, or 2j and 2j + 1; ids via block_ids: SRead)
            wait empty[j % STAGES]; SRead K_s, V_s[KT, D] of the step's blocks (keys past Sk zero-filled)
            (mask_tiles: a boolean mask's partial or tail block's [128, KB] mask tile too, bytes past
             Sk zero-filled; by default the predicate reads the packed mask's words instead)
            -> full[j % STAGES]                                     (ring.py's MbarrierRing)
    consumer warpgroup g (queries 64g .. 64g+63), step j once full[j % STAGES]:
        (turns: wait for the other warpgroup's issue of step j - 1)
        S_j[64, KT]  = Q_s[64g:] K_s^T               D/16  x wgmma m64nKTk16 (K_s: B, K-major)
        O_acc[64, D] += P_{j-1} V_s(j-1)              KT/16 x wgmma m64nDk16, P: register A
        (turns: hand the issue to the other warpgroup)
        (both in flight) partial or tail block: the predicate as bits (allowed_bits), block by block
        (S_j in) partial or tail block (the empty block among them): S = allowed ? S + bias / scale : -inf
                 m_new = max(m, rowmax S); alpha = 2^((m - m_new) c); P_j = 2^(S c - m_new c)
                 l = l alpha + rowsum P_j               (unscaled scores, c = scale log2 e)
        (P_{j-1} V in) release slot j-1; O_acc *= alpha; pack P_j (f16x2 / bf16x2 pairs)
    SWrite O_acc / l (0 where l = 0) -> staged tile [128, D + 8] over the ring -> 16 B stores

The other forms (``p_in_registers``, ``warp_specialized``, ``overlap`` off): every thread
copies through cp.async groups with a CTA barrier a block, P through a shared-memory tile
(wgmma's descriptor A, 64-key column tiles, swizzled), no overlap of a block's softmax with
the previous block's P V.

Shared memory (elements): Q 128 x D, P 128 x KB (P through shared memory only), then the ring
of ``stages`` slots of K and V (KT x D each), then (``mask_tiles``) a mask tile a slot (128 rows of
KB + 16 bytes); every tile is stored as 64-column tiles of
128-byte-swizzled rows (:func:`~.smem.swizzle_128b`), the layout the wgmma descriptors read.
Design notes and measurements: docs/design/sparse_attention.md, "Kernel".
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.index.attention import MASK_BITS_KEYS
from pit_tvm.ops.sparse_attention import (KEY_BLOCKS, QUERY_BLOCK, mask_head, pattern_predicate, pattern_score_bias,
                                          splits_global_rows)
from pit_tvm.schedules.hopper.barriers import (CONSUMERS_BARRIER, SCHEDULER_BARRIERS, WARPGROUP_BARRIERS,
                                               exit_thread, named_barrier_arrive, named_barrier_sync)
from pit_tvm.schedules.hopper.config import (CONSUMER_REGISTERS, CONSUMER_WARPGROUPS, LOADER_REGISTERS, LOADER_THREADS,
                                             STAGING_CONSUMER_REGISTERS, STAGING_LOADER_REGISTERS, TARGET, THREADS)
from pit_tvm.schedules.hopper.lowering import lower_tirx
from pit_tvm.schedules.hopper.operands import Unpacked
from pit_tvm.schedules.hopper.ring import MbarrierRing
from pit_tvm.schedules.hopper.smem import (PTX_TYPE, SWIZZLE_128B, TMA_LOAD_2D, k_major_strides, mn_major_strides,
                                           swizzle_128b, tma_map_encoder)
from pit_tvm.schedules.limits import IN_DTYPES, dtype_bytes, max_smem_bytes
from pit_tvm.schedules.signature import without_params

__all__ = ["HEAD_DIMS", "block_sparse_attention_func", "sparse_attention_smem_bytes"]

# a CTA computes one of the index's QUERY_BLOCK (128) query blocks: 2 warpgroups x wgmma M=64
HEAD_DIMS = (64, 128)
ATOM = 64                      # columns of one 128-byte swizzle atom of fp16 / bf16
#: a masked score: finite, so that ``masked - row max`` never makes a NaN
MASKED = -3.0e38
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class ConsumerRegisters(Unpacked):
    """A consumer thread's registers (local arrays): the scores S and output O_acc fragments,
    its two rows' running max and sum, the rescale factor, the block's row max, the wgmma
    descriptors, P packed as wgmma's register A, the block's element predicate as bits"""

    acc_s: Any
    acc_o: Any
    row_max: Any
    row_sum: Any
    alpha: Any
    m_new: Any
    desc_a: Any
    desc_b: Any
    p_regs: Any
    allowed_bits: Any


class QueryTile:
    """A CTA's work (a Python-side view of its coordinates, building the kernel's expressions):
    which 128 query rows it loads and writes, which key blocks it visits, and each score's
    element predicate.

    Without ``global_split``: query block ``qb`` of ``(b, h)``, the listed key blocks of
    ``(b, hg, qb)``.  With it (window + global tokens): a *global tile* ``tq`` takes the global
    rows ``global_rows[b, 128 tq:]`` (gathered) against the key blocks the index lists for it
    (head group 1: every block, or with documents those in the rows' documents); a *window tile*
    takes query block ``tq``, its listed window blocks (head group 0) and then the gathered
    blocks of the global keys (block id ``KBT + c``: keys ``global_rows[b, KB c:]``), and writes
    its non-global rows only."""

    def __init__(self, pattern, KB, b, h, hg, tq, Sq, Sk, buffers, COUNTS, IDS, PARTIAL, *, glob=None, GROWS=None,
                 gcount=None):
        self.pattern, self.KB, self.b, self.h, self.hg, self.tq = pattern, KB, b, h, hg, tq
        self.Sq, self.Sk, self.buffers = Sq, Sk, buffers
        self.COUNTS, self.IDS, self.PARTIAL = COUNTS, IDS, PARTIAL
        self.split = glob is not None
        self.glob, self.GROWS, self.gcount = glob, GROWS, gcount
        self.KBT = (Sk + (KB - 1)) // KB            # key blocks of the sequence (gathered ids follow)

    # -- the key blocks visited ------------------------------------------------------
    def _group(self):
        """the tile's head group of the index: with the split 1 for a global tile, 0 for a window tile"""
        if not self.split:
            return self.hg
        return T.if_then_else(self.glob, 1, 0)

    def listed(self):
        """the index's count of listed key blocks"""
        return self.COUNTS[self.b, self._group(), self.tq]

    def count(self, listed):
        """the key blocks this CTA visits (``listed``: :meth:`listed`, read once; a window tile's
        gathered global key blocks follow its listed ones)"""
        if not self.split:
            return listed
        return T.if_then_else(self.glob, listed, listed + (self.gcount + (self.KB - 1)) // self.KB)

    def block(self, j, listed):
        """the id of the j-th visited key block"""
        if not self.split:
            return self.IDS[self.b, self.hg, self.tq, j]
        return T.if_then_else(j < listed, self.IDS[self.b, self._group(), self.tq, j], self.KBT + (j - listed))

    def partial(self, j, listed):
        """whether the j-th visited block needs the element predicate (the tail block needs it anyway)"""
        if not self.split:
            return self.PARTIAL[self.b, self.hg, self.tq, j]
        return T.if_then_else(j < listed, self.PARTIAL[self.b, self._group(), self.tq, j], 1)

    # -- rows read and written -------------------------------------------------------
    def _global_row(self, i):
        return T.max(self.GROWS[self.b, T.min(i, self.Sq - 1)], 0)

    def query_pos(self, r):
        """row ``r``'s place in the tile's rows (the sequence's, or the global rows' list)"""
        return self.tq * QUERY_BLOCK + r

    def query_src(self, pos):
        """the sequence position of the row at ``pos`` (clamped: a valid address past the last)"""
        if not self.split:
            return T.min(pos, self.Sq - 1)
        return T.if_then_else(self.glob, self._global_row(pos), T.min(pos, self.Sq - 1))

    def query_ok(self, pos):
        """whether the row at ``pos`` is one to compute"""
        if not self.split:
            return pos < self.Sq
        return T.if_then_else(self.glob, pos < self.gcount, pos < self.Sq)

    def out_row(self, r):
        """the sequence position row ``r``'s result goes to"""
        if not self.split:
            return self.query_pos(r)
        return self.query_src(self.query_pos(r))

    def out_ok(self, r):
        """whether row ``r``'s result is written: a window tile leaves the global rows to theirs"""
        if not self.split:
            return self.query_ok(self.query_pos(r))
        flags = self.buffers["global_flags"]
        pos = self.query_pos(r)
        return T.if_then_else(self.glob, pos < self.gcount,
                              T.And(pos < self.Sq, flags[self.b, T.min(pos, self.Sq - 1)] == 0))

    def key_pos(self, kblk, r):
        """row ``r`` of key block ``kblk``: its place among the sequence's keys, then the gathered ones"""
        return kblk * self.KB + r

    def key_src(self, kblk, key):
        """the sequence position of the key at ``key`` (:meth:`key_pos`; clamped)"""
        if not self.split:
            return T.min(key, self.Sk - 1)
        return T.if_then_else(kblk >= self.KBT, self._global_row(key - self.KBT * self.KB), T.min(key, self.Sk - 1))

    def key_ok(self, kblk, key):
        """whether the key at ``key`` is one (not past Sk, nor past the global keys; none of
        ``EMPTY_BLOCK``'s)"""
        if not self.split:
            return key < self.Sk
        return T.if_then_else(kblk >= self.KBT, key - self.KBT * self.KB < self.gcount, key < self.Sk)

    # -- the element predicate -------------------------------------------------------
    def needs_predicate(self, partial, kblk):
        """a partial block, or the tail block (keys past Sk; every gathered block; ``EMPTY_BLOCK``)"""
        return T.Or(partial != 0, (kblk + 1) * self.KB > self.Sk)

    def keys_only(self, kblk):
        """whether every key of block ``kblk`` is allowed for every row of this tile (a global
        tile's rows, a gathered block's keys) but for the keys' bounds and documents: the predicate
        is then :meth:`keys_allowed`"""
        return T.Or(self.glob, kblk >= self.KBT)

    def _same_document(self, query, key_c):
        if not self.pattern.documents:
            return tirx.const(True, "bool")
        docs = self.buffers["doc_ids"]
        return docs[self.b, query] == docs[self.b, key_c]

    def keys_allowed(self, kblk, query, key, key_c):
        """the predicate in a :meth:`keys_only` block: the key is one (:meth:`key_ok`) and in the
        query's document"""
        return T.And(self.key_ok(kblk, key), self._same_document(query, key_c))

    def allowed(self, kblk, query, key, key_c, staged=None):
        """is the key at ``key`` (position ``key_c``) allowed for the query row at position ``query``
        (``staged``: the mask's entry there from a staged mask tile, which is 0 past Sk, so the
        key's bound is in it; else read from the mask, and the key tested against Sk)"""
        if staged is not None:
            return pattern_predicate(self.pattern, self.buffers, self.b, self.h, query, key_c, staged)
        if not self.split:
            return T.And(key < self.Sk, pattern_predicate(self.pattern, self.buffers, self.b, self.h, query, key_c))
        w = self.pattern.window
        flags = self.buffers["global_flags"]
        # (a window block: :meth:`keys_only` is false) its global keys are read from the gathered blocks
        return T.And(T.And(key < self.Sk, T.And(T.And(key_c <= query + w, query <= key_c + w),
                                                flags[self.b, key_c] == 0)), self._same_document(query, key_c))

    def mask_offset(self, query, kblk):
        """(int64) the flat offset in the mask of query position ``query``'s entry for the first key
        of block ``kblk``"""
        mask = self.buffers["mask"]
        return (((T.Cast("int64", self.b) * mask.shape[1] + mask_head(mask, self.h)) * mask.shape[2]
                 + T.Cast("int64", query)) * mask.shape[3] + T.Cast("int64", kblk) * self.KB)

    def score_bias(self, query, key_c):
        return pattern_score_bias(self.pattern, self.buffers, self.b, self.h, query, key_c)


#: bytes of padding after each row of a staged mask tile (its rows then start in other banks)
MASK_ROW_PAD = 16
#: the id of a block with no keys (past every sequence's and gathered keys: nothing loaded, every score
#: masked): the second of a pair where a CTA's visited blocks are odd
EMPTY_BLOCK = 1 << 20


class KeyTile:
    """The key blocks of one step of a consumer warpgroup (a Python-side view): ``pair`` listed
    blocks of ``KB`` keys gathered side by side into one tile of ``pair * KB`` keys (PIT's SRead
    of micro-tiles into a dense tile), each with its partial flag"""

    def __init__(self, ids, partials, KB):
        self.ids, self.partials, self.KB = list(ids), list(partials), KB

    def block_of(self, col):
        """the block id of the tile's key column ``col``"""
        if len(self.ids) == 1:
            return self.ids[0]
        return T.if_then_else(col < self.KB, self.ids[0], self.ids[1])

    def needs_predicate(self, tile, part=None):
        """whether block ``part`` of the tile (any block: None) needs the element predicate"""
        if part is not None:
            return tile.needs_predicate(self.partials[part], self.ids[part])
        need = tile.needs_predicate(self.partials[0], self.ids[0])
        for kblk, partial in zip(self.ids[1:], self.partials[1:]):
            need = T.Or(need, tile.needs_predicate(partial, kblk))
        return need

    def empty(self, part):
        """whether block ``part`` of the tile is ``EMPTY_BLOCK``"""
        return self.ids[part] == EMPTY_BLOCK


def sparse_attention_smem_bytes(head_dim: int, key_block: int, stages: int, p_in_registers: bool = False,
                                mask_tiles: bool = False, pair: int = 1) -> int:
    """dynamic shared memory of :func:`block_sparse_attention_func`'s kernel: Q, P (unless in
    registers), the K / V ring of ``pair`` key blocks a slot, a boolean mask tile a ring slot
    (``mask_tiles``)"""
    keys = key_block * pair
    p_tile = 0 if p_in_registers else QUERY_BLOCK * keys
    masks = stages * QUERY_BLOCK * pair * (key_block + MASK_ROW_PAD) if mask_tiles else 0
    return (QUERY_BLOCK * head_dim + p_tile + stages * 2 * keys * head_dim) * 2 + masks


def _check(head_dim, in_dtype, key_block, stages, p_in_registers, mask_tiles, pair=1):
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"block-sparse attention's Hopper kernel takes head dims {HEAD_DIMS}, got {head_dim}")
    if in_dtype not in IN_DTYPES:
        raise ValueError(f"block-sparse attention's Hopper kernel takes {IN_DTYPES}, got {in_dtype}")
    if key_block not in KEY_BLOCKS:
        raise ValueError(f"key_block must be one of {KEY_BLOCKS}, got {key_block}")
    if stages < 2:
        raise ValueError(f"the K / V ring needs at least 2 stages, got {stages}")
    smem = sparse_attention_smem_bytes(head_dim, key_block, stages, p_in_registers, mask_tiles, pair)
    if smem > max_smem_bytes("sm_90a"):
        raise ValueError(f"head dim {head_dim}, key block {key_block}" + (" in pairs" if pair > 1 else "")
                         + f" and {stages} stages need {smem} bytes of shared memory, over the H100's "
                         f"{max_smem_bytes('sm_90a')}")


@functools.lru_cache(maxsize=64)
def block_sparse_attention_func(head_dim: int, pattern, in_dtype: str = "float16", key_block: int = 64, *,
                                scale: float | None = None, mask_dtype: str | None = None,
                                stages: int | None = None, p_in_registers: bool = True,
                                warp_specialized: bool = True, overlap: bool | None = None,
                                global_split: bool = False, early_predicate: bool | None = None,
                                mask_tiles: bool | None = None, prefetch_index: bool | None = None,
                                register_split: bool | None = None, pair_blocks: bool | None = None,
                                turns: bool | None = None, tma_kv: bool | None = None,
                                mask_bits: bool | None = None) -> tirx.PrimFunc:
    """The lowered PrimFunc ``(q, k, v, block_counts, block_ids, block_partial, [mask],
    [global_flags], [doc_ids], [global_rows, global_count], [mask_bits], o)`` (module docstring) for
    ``pattern`` (an ``AttentionPattern``).

    ``scale``: the scores' factor (default ``1 / sqrt(head_dim)``); ``mask_dtype``: the mask tensor's
    dtype (default ``bool`` for a boolean mask, ``in_dtype`` for an additive one);
    The kernel's form (docs/design/sparse_attention.md, "Kernel"; the defaults measured fastest):
    ``p_in_registers``: P V takes P from registers (wgmma's register-A form: the scores'
    accumulator fragment is the A fragment), not through shared memory; ``warp_specialized``: a
    loader warpgroup fills the ring (``ring.py``'s full / empty mbarriers), so that the consumer
    warpgroups run apart (needs ``p_in_registers``); ``overlap`` (with ``warp_specialized``, key
    block 64; default: where it applies): a block's softmax runs while the previous block's
    P V is in flight (not by default at head dim 128 with ``global_split``); ``stages``: K / V
    blocks in the ring (default 4 with ``overlap``, else 2).
    An additive mask's values are added in partial blocks only: the index marks a block full
    only where every entry is allowed with bias 0.  ``global_split`` (window + global tokens,
    :func:`~pit_tvm.ops.sparse_attention.splits_global_rows`): the global rows and keys as their
    own gathered tiles and blocks (:class:`QueryTile`; the index built with the same flag).
    ``early_predicate`` (default: at key block 64, but not for the split with documents): a
    partial block's element predicate is evaluated (as bits) while its Q K^T is in flight, not
    after (not for an additive mask, whose bias is read with it).  ``mask_tiles`` (default: with a
    boolean mask, the loader warpgroup and the early predicate where ``mask_bits`` is off): the loader stages a partial
    block's [128, KB] mask tile in shared memory beside its K / V (16-byte cp.async, any Sk; zero
    past Sk, so the predicate tests no bound), so the predicate reads shared memory, not scattered
    bytes of global memory.  ``prefetch_index`` (default: with ``global_split``): the loader and
    the warp-specialized consumers read the next listed block's index entry (id, partial flag) an
    iteration ahead, so its latency is not in front of the block's work.
    ``register_split`` (default: with ``warp_specialized``): launched one CTA an SM, the loader
    warpgroup hands registers to the consumers (``setmaxnreg``: ``LOADER_REGISTERS`` /
    ``CONSUMER_REGISTERS`` a thread instead of 168 for all), which lets ``overlap`` hold a step of
    128 keys (``pair_blocks``; key block 128 where asked for).
    ``turns`` (with ``overlap``; default: with it, but not with ``global_split``): the two
    consumer warpgroups issue their wgmma in turn (FA3's scheduler barrier), so that one's
    softmax runs while the other's tensor-core work does.
    ``tma_kv`` (default: warp-specialized without ``global_split``, the only forms it takes): the
    loader's first thread loads each listed block's K and V by TMA (64 x 64 boxes of a 2-D map
    over ``[B H Sk, D]``, 128-byte swizzle) instead of 128 threads' cp.async; keys past Sk read the
    next head's rows or TMA's zeros, masked like any key past Sk; the empty block's boxes lie past
    the map (zeros).
    ``pair_blocks`` (key block 64, warp-specialized; default: with ``register_split``, and with a
    boolean mask where its mask tiles leave room for a ring of 3, i.e. the overlap: head dim 64): a
    consumer step takes two listed blocks, which the loader gathers side by side into one 128-key
    tile of the ring (the index stays at key block 64): one m64n128 Q K^T and 8 k16 steps of P V a
    step, half the steps' fixed work.
    ``mask_bits`` (a boolean mask, key block 64, the early predicate; default: with the loader
    warpgroup and its registers handed over, unless mask tiles are asked for): the kernel takes the
    index's packed mask (``mask_bits`` uint64 ``[B, MH, ceil(Sk / 64), Sq]``, after the pattern's
    inputs) and a partial block's predicate reads its rows' 64-bit words, not the mask's bytes; no
    mask tiles then, so the pairs keep a ring of 4 at head dim 64 and 3 at 128.
    Raises ValueError where the kernel does not apply."""
    D, KB = int(head_dim), int(key_block)
    if register_split is None:
        register_split = bool(warp_specialized)
    if early_predicate is None:
        # (at key block 128 a thread's 64 predicate bits, loaded ahead, spill at head dim 128; a pair
        # of blocks of 64 takes them block by block; the split's document terms, loaded ahead, spill
        # at both head dims)
        early_predicate = KB == 64 and not (global_split and pattern.documents)
    early_predicate = bool(early_predicate) and pattern.mask != "additive"
    if mask_bits is None:
        # (faster than mask tiles at both head dims, and at 128 the pairs' 3-deep ring fits beside no
        # mask tiles: design notes, "The packed mask")
        mask_bits = (pattern.mask == "bool" and KB == MASK_BITS_KEYS and early_predicate and bool(warp_specialized)
                     and bool(register_split) and not mask_tiles)
    mask_bits = bool(mask_bits)
    if mask_bits and (pattern.mask != "bool" or KB != MASK_BITS_KEYS or not early_predicate or mask_tiles):
        raise ValueError(f"mask_bits takes a boolean mask, key block {MASK_BITS_KEYS} (the index's packed words), "
                         f"the early predicate and no mask tiles")
    if mask_tiles is None:
        mask_tiles = bool(warp_specialized) and early_predicate and pattern.mask == "bool" and not mask_bits
    if pair_blocks is None:
        # (a boolean mask: with the packed mask, or with staged mask tiles where a ring of 3 pair
        # slots fits beside them, i.e. the pairs keep the overlap: head dim 64; at 128 the pairs
        # would run a 2-deep ring without overlap)
        pair_blocks = (KB == 64 and bool(warp_specialized) and bool(register_split)
                       and (pattern.mask != "bool" or mask_bits or (bool(mask_tiles) and sparse_attention_smem_bytes(
                           D, KB, 3, bool(p_in_registers), True, 2) <= max_smem_bytes("sm_90a"))))
    pair_blocks = bool(pair_blocks)
    PAIR = 2 if pair_blocks else 1
    if pair_blocks and not (KB == 64 and warp_specialized):
        raise ValueError("pair_blocks takes key_block 64 and warp_specialized")
    KT = KB * PAIR                 # keys of a step's tile

    def fits(n):
        return sparse_attention_smem_bytes(D, KB, n, p_in_registers, bool(mask_tiles), PAIR) <= max_smem_bytes("sm_90a")

    if overlap is None:
        # (at head dim 128 the global tiles' extra state makes the overlapping form spill in 168
        # registers; a pair's second score block needs the consumers' registers of ``register_split``;
        # at key block 128 the late predicate spills there; the overlap releases a slot one block
        # late, so it needs a ring of 3)
        overlap = (bool(warp_specialized) and KB == 64 and (PAIR == 1 or bool(register_split)) and fits(3)
                   and not (global_split and D == 128 and not register_split))
    if stages is None:
        stages = max(n for n in (2, 3, 4) if fits(n)) if overlap else 2
    if turns is None:
        # (measured faster with the block masks and documents, slower in Longformer's split tiles:
        # design notes, "Turns")
        turns = bool(overlap) and not global_split
    turns = bool(turns)
    if turns and not overlap:
        raise ValueError("turns needs overlap (the consumer loop whose wgmma issue points it orders)")
    if tma_kv is None:
        # (measured faster at both head dims, with and without mask tiles: design notes, "K and V by TMA")
        tma_kv = bool(warp_specialized) and not global_split
    tma_kv = bool(tma_kv)
    if tma_kv and (global_split or not warp_specialized):
        raise ValueError("tma_kv takes the warp-specialized loader and no global_split (whose gathered key "
                         "blocks are rows, not a box)")
    if prefetch_index is None:
        # (measured: Longformer's split tiles 1.7-1.9x faster with it, the block masks 1-3 % slower)
        prefetch_index = bool(global_split)
    if mask_tiles and not (warp_specialized and early_predicate and pattern.mask == "bool"):
        raise ValueError("mask_tiles takes a boolean mask, warp_specialized and the early predicate")
    _check(D, in_dtype, KB, int(stages), bool(p_in_registers), bool(mask_tiles), PAIR)
    if global_split and not splits_global_rows(pattern):
        raise ValueError(f"global_split takes a window + global tokens pattern without a mask or causal, "
                         f"got {pattern.tag}")
    if warp_specialized and not p_in_registers:
        raise ValueError("warp_specialized needs p_in_registers (the consumer warpgroups share no P tile barrier)")
    if overlap and not warp_specialized:
        raise ValueError("overlap needs warp_specialized (the all-threads loop syncs the CTA every block)")
    if register_split and not warp_specialized:
        raise ValueError("register_split needs warp_specialized (a loader warpgroup to take registers from)")
    if overlap and KT != 64 and not register_split:
        raise ValueError("overlap takes key_block 64 without register_split (at 128 the second block's scores "
                         "spill in 168 registers)")
    STAGES = int(stages)
    SCALE2 = (1.0 / math.sqrt(D) if scale is None else float(scale)) * LOG2E
    if not SCALE2 > 0:
        # (the running max is taken over the unscaled scores: the order of s and of s * scale agree)
        raise ValueError(f"the Hopper kernel takes a positive score scale, got {scale}")
    BIAS_RAW = LOG2E / SCALE2      # an additive mask's value in units of the unscaled scores
    additive = pattern.mask == "additive"
    if mask_dtype is None:
        mask_dtype = "bool" if pattern.mask == "bool" else in_dtype
    QB = QUERY_BLOCK
    ROW_CHUNKS = D // 8            # 16-byte chunks per row of Q / K / V / O
    ACC_S = KT // 2                # fp32 scores per thread: m64 x nKT over 128 threads
    ACC_O = D // 2
    Q_OFF = 0
    P_OFF = Q_OFF + QB * D         # P (not p_in_registers): KT / 64 column tiles of [128 rows x 64 keys]
    RING_OFF = P_OFF + (0 if p_in_registers else QB * KT)
    SLOT = 2 * KT * D              # a ring slot: the tile's K rows, then its V rows
    O_ROW = D + 8                  # staged O pitch (16 bytes of padding against bank conflicts)
    SMEM_BYTES = sparse_attention_smem_bytes(D, KB, STAGES, p_in_registers, mask_tiles, PAIR)
    SMEM_ELEMS = SMEM_BYTES // dtype_bytes(in_dtype)
    MASK_OFF = (RING_OFF + STAGES * SLOT) * dtype_bytes(in_dtype)   # (bytes) the staged mask tiles
    MASK_PITCH = KB + MASK_ROW_PAD  # a block's part of a staged mask row
    MASK_ROW = PAIR * MASK_PITCH    # a staged mask row: the tile's blocks' parts side by side
    MASK_CHUNKS = KB // 16          # 16-byte chunks per row of a block's mask
    t = PTX_TYPE[in_dtype]
    wgmma_s = f"wgmma.mma_async.sync.aligned.m64n{KT}k16.f32.{t}.{t}"
    wgmma_o = f"wgmma.mma_async.sync.aligned.m64n{D}k16.f32.{t}.{t}"
    pack_pair = f"cvt.rn.{t}x2.f32"             # (hi, lo) fp32 -> one b32 of two halves
    KM_LBO, KM_SBO = k_major_strides(ATOM)      # K-major rows of 128 B (Q, K, P)
    V_LBO, V_SBO = mn_major_strides(KT)         # V as MN-major B: 64-column atoms of KT rows
    LAUNCH_THREADS = THREADS + (LOADER_THREADS if warp_specialized else 0)
    LOADER_REGS, CONSUMER_REGS = ((STAGING_LOADER_REGISTERS, STAGING_CONSUMER_REGISTERS) if mask_tiles
                                  else (LOADER_REGISTERS, CONSUMER_REGISTERS))
    KV_TX_BYTES = PAIR * 2 * KB * D * dtype_bytes(in_dtype)     # (tma_kv) a step's K and V boxes
    # every loader thread copies by cp.async (K and V, or the mask tiles) and arrives on full[s] when
    # its copies land; with tma_kv the TMA thread arrives once more, with the bytes it expects
    THREAD_COPIES = mask_tiles or not tma_kv
    FULL_ARRIVALS = int(tma_kv) + (LOADER_THREADS if THREAD_COPIES else 0)
    ring = MbarrierRing(STAGES)
    masked = tirx.const(MASKED, "float32")
    full = T.uint32(0xFFFFFFFF)

    def tiled(rows, r, ch):
        """element offset of 16-byte chunk ``ch`` of row ``r`` in a [rows x D] tile stored as
        64-column tiles of 128-byte-swizzled rows"""
        return (ch // 8) * (rows * ATOM) + r * ATOM + swizzle_128b(ch % 8, r) * 8

    def k_step(rows, kk):
        """16-byte units from a K-major operand's descriptor to its k16 step ``kk``"""
        return T.Cast("uint64", ((kk // 4) * rows * ATOM + (kk % 4) * 16) // 8)

    def copy16(dst, src, read, nbytes=16):
        """16-byte cp.async (to wrap in ``T.evaluate``) of ``nbytes`` read from ``src`` (the rest
        zero-filled); nothing read where ``read`` is false"""
        return T.ptx["cp.async.cg.shared.global"](dst, src, 16, T.Cast("uint32", T.if_then_else(read, nbytes, 0)))

    def reduce4(op, values):
        """``op`` over ``values`` as four interleaved chains, then a tree of the four: n / 4 + 2
        dependent steps, not n, and four live partial results"""
        chains = list(values[:4])
        for n, v in enumerate(values[4:]):
            chains[n % 4] = op(chains[n % 4], v)
        while len(chains) > 1:
            chains = [op(chains[i], chains[i + 1]) if i + 1 < len(chains) else chains[i]
                      for i in range(0, len(chains), 2)]
        return chains[0]

    def quad_max(x):
        x = T.max(x, T.cuda.__shfl_xor_sync(full, x, 1, 32))
        return T.max(x, T.cuda.__shfl_xor_sync(full, x, 2, 32))

    def quad_sum(x):
        x = x + T.cuda.__shfl_xor_sync(full, x, 1, 32)
        return x + T.cuda.__shfl_xor_sync(full, x, 2, 32)

    @T.macro
    def load_q(Q, tile, smem, t, threads):
        """SRead: the tile's 128 rows of Q by ``threads`` copying threads (rows past its last
        zero-filled, not read)"""
        for c in T.unroll(QB * ROW_CHUNKS // threads):
            r = (t + threads * c) // ROW_CHUNKS
            ch = (t + threads * c) % ROW_CHUNKS
            query = tile.query_pos(r)
            T.evaluate(copy16(smem.ptr_to([Q_OFF + tiled(QB, r, ch)]),
                              Q.ptr_to([tile.b, tile.h, tile.query_src(query), ch * 8]), tile.query_ok(query)))

    @T.macro
    def load_block(K, V, tile, smem, slot, keys, t, threads):
        """SRead: the KT rows of K and V of the key tile ``keys`` (its blocks side by side) into
        ring slot ``slot`` by ``threads`` copying threads (keys past Sk zero-filled, not read)"""
        for c in T.unroll(KT * ROW_CHUNKS // threads):
            r = (t + threads * c) // ROW_CHUNKS
            ch = (t + threads * c) % ROW_CHUNKS
            kblk = keys.block_of(threads * c // ROW_CHUNKS)     # (a step's rows lie in one block)
            key = tile.key_pos(kblk, r % KB)
            src_key = tile.key_src(kblk, key)
            T.evaluate(copy16(smem.ptr_to([RING_OFF + slot * SLOT + tiled(KT, r, ch)]),
                              K.ptr_to([tile.b, tile.h, src_key, ch * 8]), tile.key_ok(kblk, key)))
            T.evaluate(copy16(smem.ptr_to([RING_OFF + slot * SLOT + KT * D + tiled(KT, r, ch)]),
                              V.ptr_to([tile.b, tile.h, src_key, ch * 8]), tile.key_ok(kblk, key)))

    @T.macro
    def tma_part(tile, smem, bars, slot, keys, part, maps, B, H):
        """:func:`tma_block`'s boxes of block ``part`` of the key tile"""
        map_k, map_v = maps
        row = T.if_then_else(keys.empty(part), B * H * tile.Sk,
                             (tile.b * H + tile.h) * tile.Sk + keys.ids[part] * KB)
        for atom in T.unroll(D // ATOM):
            k_box = RING_OFF + slot * SLOT + atom * (KT * ATOM) + part * KB * ATOM     # (V's: KT x D further)
            T.ptx[TMA_LOAD_2D](smem.ptr_to([k_box]), T.address_of(map_k), atom * ATOM, row, ring.full(bars, slot))
            T.ptx[TMA_LOAD_2D](smem.ptr_to([k_box + KT * D]), T.address_of(map_v), atom * ATOM, row,
                                ring.full(bars, slot))

    @T.macro
    def tma_block(tile, smem, bars, slot, keys, maps, B, H):
        """SRead by TMA (one thread): the K and V rows of the key tile ``keys`` (its blocks side by
        side) into ring slot ``slot``, D / 64 boxes of 64 x KB a block and operand, their bytes
        counted on the slot's ``full`` mbarrier; the empty block's boxes from past the map (zeros)"""
        ring.expect_tx(bars, slot, KV_TX_BYTES)
        tma_part(tile, smem, bars, slot, keys, 0, maps, B, H)
        if PAIR == 2:
            tma_part(tile, smem, bars, slot, keys, 1, maps, B, H)

    def staged_entry(staged, tile, part, row, query, key):
        """the staged mask tile's entry (bool) at ``row`` of the tile (query position ``query``) and
        ``key`` of the key tile's block ``part`` (``load_mask_tile``); ``staged``: ``(mask_s, slot)``,
        None where nothing is staged (then None)"""
        if staged is None:
            return None
        mask_s, slot = staged
        # (a block starts KB keys in, a multiple of 16: the row's offset % 16 is its first block's)
        shift = T.Cast("int32", tile.mask_offset(query, 0) % 16)
        return mask_s[MASK_OFF + slot * QB * MASK_ROW + row * MASK_ROW + part * MASK_PITCH + shift + key] != T.uint8(0)

    @T.macro
    def load_mask_tile(tile, mask_s, slot, keys, t, threads):
        """SRead: the [128, KT] boolean mask tile of the key tile ``keys`` (the tile's query rows)
        into ring slot ``slot``'s mask tile by ``threads`` copying threads: for each block of the
        tile, row r's KB entries as the KB / 16 + 1 aligned 16-byte chunks around them (any Sk; the
        chunk past them only where they start off a 16-byte boundary), at ``MASK_ROW`` r + the
        block's ``MASK_PITCH``; entry k of the row at that + (its offset % 16) + k
        (``staged_entry``).  Rows past the last and each row's bytes past its end (keys >= Sk: the
        predicate's bound, ``QueryTile.allowed``) zero-filled, not read"""
        mask = tile.buffers["mask"]
        for c in T.unroll(QB * (MASK_CHUNKS + 1) // threads):
            r = (t + threads * c) // (MASK_CHUNKS + 1)
            ch = (t + threads * c) % (MASK_CHUNKS + 1)
            query = tile.query_pos(r)
            row = tile.mask_offset(tile.query_src(query), 0)       # (the block adds KB keys: 16 | KB)
            for part in T.unroll(PAIR):
                kblk = keys.block_of(part * KB)
                start = row - row % 16 + T.Cast("int64", kblk) * KB + ch * 16
                # the row's bytes from the chunk's start on (row + Sk - start, in 32 bits)
                left = T.Cast("int32", row % 16) + tile.Sk - kblk * KB - ch * 16
                # (flat offsets: the mask read as one array, every source address 16-byte aligned; a
                # chunk reads up to its row's end, the rest zero-filled; one past it reads nothing,
                # from the mask's start)
                T.evaluate(copy16(mask_s.ptr_to([MASK_OFF + slot * QB * MASK_ROW + r * MASK_ROW
                                                 + part * MASK_PITCH + ch * 16]),
                                  mask.ptr_to([0, 0, 0, T.if_then_else(left > 0, start, T.int64(0))]),
                                  T.And(tile.query_ok(query), T.Or(ch < MASK_CHUNKS, row % 16 != 0)),
                                  T.max(T.min(left, 16), 0)))

    @T.macro
    def issue_qk(slot, smem, tid, r):
        """S = Q K^T, this warpgroup's 64 queries against the block in ring slot ``slot``: D/16
        wgmma, one commit group (not waited for); the first overwrites S (scale-d false)"""
        acc_s, acc_o, row_max, row_sum, alpha, m_new, desc_a, desc_b, p_regs, allowed_bits = r.unpacked()
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_a[0]), smem.ptr_to([Q_OFF + tid // 128 * 64 * ATOM]),
                                              KM_LBO, KM_SBO, SWIZZLE_128B)
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b[0]), smem.ptr_to([RING_OFF + slot * SLOT]),
                                              KM_LBO, KM_SBO, SWIZZLE_128B)
        T.ptx.wgmma.fence.sync.aligned()
        for kk in T.unroll(D // 16):
            T.ptx[wgmma_s](*[acc_s[i] for i in range(ACC_S)],
                           desc_a[0] + k_step(QB, kk), desc_b[0] + k_step(KT, kk), kk > 0, 1, 1, 0, 0)
        T.ptx.wgmma.commit_group.sync.aligned()

    @T.macro
    def collect_bits(keys, part, tile, pairwise, tid, r, staged=None):
        """allowed_bits = the element predicate of this thread's scores of block ``part`` of the
        key tile ``keys`` (its columns ``KB part ..``; score ``4c + 2i + e`` of column block c:
        word ``c / 8``, bit ``4 (c % 8) + 2i + e``; KB / 64 words a block), pair by pair
        (``pairwise``) or the keys' bounds only (:meth:`QueryTile.keys_only`); ``staged``:
        ``(mask_s, slot)``, the tile's mask tile staged by the loader"""
        acc_s, acc_o, row_max, row_sum, alpha, m_new, desc_a, desc_b, p_regs, allowed_bits = r.unpacked()
        w = (tid % 128) // 32
        lane = tid % 32
        kblk = keys.ids[part]
        for i in T.unroll(KB // 64):
            allowed_bits[part * (KB // 64) + i] = T.uint32(0)
        if mask_bits:
            # the packed mask's words of this thread's two rows in the block (64 keys a word)
            row_words = T.alloc_local([2], "uint64")
            bits = tile.buffers["mask_bits"]
            for i in T.unroll(2):
                row_words[i] = bits[tile.b, mask_head(bits, tile.h), kblk,
                                    tile.query_src(tile.query_pos(tid // 128 * 64 + w * 16 + lane // 4 + 8 * i))]
        # thread (w, lane) holds rows 16w + lane/4 (+8) of the warpgroup's 64 and keys
        # 8nb + 2(lane%4) (+1) of the block in acc_s[4c + 2i + e], c = part KB / 8 + nb
        for nb in T.unroll(KB // 8):
            for i in T.unroll(2):
                for e in T.unroll(2):
                    c = part * (KB // 8) + nb
                    query = tile.query_src(tile.query_pos(tid // 128 * 64 + w * 16 + lane // 4 + 8 * i))
                    key = tile.key_pos(kblk, nb * 8 + (lane % 4) * 2 + e)
                    key_c = tile.key_src(kblk, key)
                    if mask_bits:      # (0 past Sk: the key's bound is in it)
                        allowed_bits[c // 8] = allowed_bits[c // 8] | T.shift_left(
                            T.Cast("uint32", tile.allowed(kblk, query, key, key_c, T.bitwise_and(T.shift_right(
                                row_words[i], T.Cast("uint64", nb * 8 + (lane % 4) * 2 + e)), T.uint64(1)) != T.uint64(0))),
                            T.uint32(c % 8 * 4 + i * 2 + e))
                    elif pairwise:
                        allowed_bits[c // 8] = allowed_bits[c // 8] | T.shift_left(
                            T.Cast("uint32", tile.allowed(kblk, query, key, key_c, staged_entry(
                                staged, tile, part, tid // 128 * 64 + w * 16 + lane // 4 + 8 * i, query,
                                nb * 8 + (lane % 4) * 2 + e))),
                            T.uint32(c % 8 * 4 + i * 2 + e))
                    else:
                        allowed_bits[c // 8] = allowed_bits[c // 8] | T.shift_left(
                            T.Cast("uint32", tile.keys_allowed(kblk, query, key, key_c)),
                            T.uint32(c % 8 * 4 + i * 2 + e))

    @T.macro
    def by_block_kind(step, keys, part, tile, tid, r):
        """``step(keys, part, tile, pairwise, tid, r)`` with ``pairwise`` false where every key of
        block ``part`` of the key tile ``keys`` is allowed for every row of the tile
        (:meth:`QueryTile.keys_only`: a uniform branch, so each form is its own unrolled loop)"""
        if tile.split:
            if tile.keys_only(keys.ids[part]):
                step(keys, part, tile, False, tid, r)
            else:
                step(keys, part, tile, True, tid, r)
        else:
            step(keys, part, tile, True, tid, r)

    @T.macro
    def block_bits(keys, part, slot, mask_s, tile, tid, r):
        """:func:`predicate_bits` of block ``part`` of the tile (none set for the empty block)"""
        acc_s, acc_o, row_max, row_sum, alpha, m_new, desc_a, desc_b, p_regs, allowed_bits = r.unpacked()
        if keys.needs_predicate(tile, part):
            if keys.empty(part):
                for i in T.unroll(KB // 64):
                    allowed_bits[part * (KB // 64) + i] = T.uint32(0)
            elif mask_tiles:
                collect_bits(keys, part, tile, True, tid, r, (mask_s, slot))
            else:
                by_block_kind(collect_bits, keys, part, tile, tid, r)

    @T.macro
    def predicate_bits(keys, slot, mask_s, tile, tid, r):
        """the element predicate of the key tile ``keys`` (of each block partial or the tail block;
        the empty block needs none) as allowed_bits, issued while its Q K^T is in flight: its loads
        and index arithmetic overlap the tensor cores (an additive mask's predicate and bias stay in
        ``mask_scores``); from ring slot ``slot``'s staged mask tile where the loader staged it"""
        if early_predicate:
            block_bits(keys, 0, slot, mask_s, tile, tid, r)
            if PAIR == 2:
                block_bits(keys, 1, slot, mask_s, tile, tid, r)

    @T.macro
    def mask_scores(keys, part, tile, pairwise, tid, r):
        """S = allowed ? S + bias / scale : masked, for block ``part`` of the key tile ``keys`` (the
        scores stay unscaled: :func:`softmax_step` scales them in its exp2): from allowed_bits, else
        the predicate (``pairwise``, or the keys' bounds) and an additive mask's bias pair by pair"""
        acc_s, acc_o, row_max, row_sum, alpha, m_new, desc_a, desc_b, p_regs, allowed_bits = r.unpacked()
        w = (tid % 128) // 32
        lane = tid % 32
        kblk = keys.ids[part]
        for nb in T.unroll(KB // 8):
            for i in T.unroll(2):
                for e in T.unroll(2):
                    c = part * (KB // 8) + nb
                    score = acc_s[c * 4 + i * 2 + e]
                    if early_predicate:
                        acc_s[c * 4 + i * 2 + e] = T.Select(
                            T.bitwise_and(T.shift_right(allowed_bits[c // 8], T.uint32(c % 8 * 4 + i * 2 + e)),
                                          T.uint32(1)) != T.uint32(0), T.max(score, masked), masked)
                    else:
                        query = tile.query_src(tile.query_pos(tid // 128 * 64 + w * 16 + lane // 4 + 8 * i))
                        key = tile.key_pos(kblk, nb * 8 + (lane % 4) * 2 + e)
                        key_c = tile.key_src(kblk, key)
                        if additive:
                            score = score + T.float32(BIAS_RAW) * tile.score_bias(query, key_c)
                        if pairwise:
                            acc_s[c * 4 + i * 2 + e] = T.Select(tile.allowed(kblk, query, key, key_c),
                                                                T.max(score, masked), masked)
                        else:
                            acc_s[c * 4 + i * 2 + e] = T.Select(tile.keys_allowed(kblk, query, key, key_c),
                                                                T.max(score, masked), masked)

    @T.macro
    def block_scores(keys, part, tile, tid, r):
        """the (unscaled) scores of block ``part`` of the key tile ``keys``: the element predicate
        where the block is partial or the tail block (:func:`predicate_bits` ran before), which
        masks every score of the empty block (its keys lie past every sequence: the tail test
        holds, and no key is in bounds); a full block's as they came (one branch a block and no
        write in the full block's arm: design notes, "Instruction count")"""
        acc_s, acc_o, row_max, row_sum, alpha, m_new, desc_a, desc_b, p_regs, allowed_bits = r.unpacked()
        if keys.needs_predicate(tile, part):
            if early_predicate:
                mask_scores(keys, part, tile, True, tid, r)       # (from the bits: pairwise unused)
            else:
                by_block_kind(mask_scores, keys, part, tile, tid, r)

    @T.macro
    def softmax_step(keys, tile, tid, r):
        """the scores of the key tile ``keys`` (:func:`block_scores` of each block) -> P = 2^((S -
        running max) scale log2 e) in acc_s (one FFMA and an exp2 a score), the running max (of the
        unscaled scores) and sum, and ``alpha``, the factor O_acc takes before the tile's P V"""
        acc_s, acc_o, row_max, row_sum, alpha, m_new, desc_a, desc_b, p_regs, allowed_bits = r.unpacked()
        block_scores(keys, 0, tile, tid, r)
        if PAIR == 2:
            block_scores(keys, 1, tile, tid, r)
        # online softmax: new running max (unscaled), the old terms' factor, P (log2 domain); a
        # row's max and sum over its KT / 4 scores of this thread as four chains, not one
        for i in T.unroll(2):
            row = [acc_s[nb * 4 + i * 2 + e] for nb in range(KT // 8) for e in range(2)]
            m_new[0] = quad_max(T.max(row_max[i], reduce4(T.max, row)))
            # every key so far masked: subtract 0, so that masked scores give 2^(-3e38 scale) = 0
            m_use = T.Select(m_new[0] <= masked, T.float32(0), m_new[0])
            alpha[i] = T.exp2((row_max[i] - m_use) * T.float32(SCALE2))
            row_max[i] = m_new[0]
            m_scaled = m_use * T.float32(SCALE2)
            for nb in T.unroll(KT // 8):
                for e in T.unroll(2):
                    acc_s[nb * 4 + i * 2 + e] = T.exp2(acc_s[nb * 4 + i * 2 + e] * T.float32(SCALE2) - m_scaled)
            row_sum[i] = row_sum[i] * alpha[i] + reduce4(lambda a, b: a + b, row)

    @T.macro
    def rescale_o(r):
        """O_acc *= alpha (its rows'), before the block's P V adds to it"""
        acc_s, acc_o, row_max, row_sum, alpha, m_new, desc_a, desc_b, p_regs, allowed_bits = r.unpacked()
        for nb in T.unroll(D // 8):
            for i in T.unroll(2):
                for e in T.unroll(2):
                    acc_o[nb * 4 + i * 2 + e] = acc_o[nb * 4 + i * 2 + e] * alpha[i]

    @T.macro
    def pack_p(r):
        """P as wgmma's register A: k16 step kk takes the scores of keys 16kk .. 16kk+15, rows r
        and r+8 (accumulator column blocks 2kk, 2kk+1), as four f16x2 / bf16x2 pairs"""
        acc_s, acc_o, row_max, row_sum, alpha, m_new, desc_a, desc_b, p_regs, allowed_bits = r.unpacked()
        for kk in T.unroll(KT // 16):
            for a in T.unroll(4):
                T.ptx[pack_pair](p_regs[kk * 4 + a], acc_s[(2 * kk + a // 2) * 4 + (a % 2) * 2 + 1],
                                 acc_s[(2 * kk + a // 2) * 4 + (a % 2) * 2])

    @T.macro
    def issue_pv(slot, smem, tid, r):
        """O_acc += P V for the key tile in ring slot ``slot``: KT/16 wgmma, one commit group (not
        waited for); P from registers (``pack_p``), or first written to shared memory"""
        acc_s, acc_o, row_max, row_sum, alpha, m_new, desc_a, desc_b, p_regs, allowed_bits = r.unpacked()
        wg = tid // 128
        if p_in_registers:
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b[0]),
                                                  smem.ptr_to([RING_OFF + slot * SLOT + KT * D]),
                                                  V_LBO, V_SBO, SWIZZLE_128B)
            T.ptx.wgmma.fence.sync.aligned()
            for kk in T.unroll(KT // 16):
                T.ptx[wgmma_o](*[acc_o[i] for i in range(ACC_O)], *[p_regs[kk * 4 + a] for a in range(4)],
                               desc_b[0] + T.Cast("uint64", kk * 16 * ATOM // 8), True, 1, 1, 1)
        else:
            # P (unnormalised) as wgmma's A in shared memory, this warpgroup's 64 rows
            w = (tid % 128) // 32
            lane = tid % 32
            for nb in T.unroll(KT // 8):
                for i in T.unroll(2):
                    for e in T.vectorized(2):
                        smem[P_OFF + tiled(QB, wg * 64 + w * 16 + lane // 4 + 8 * i, nb)
                             + (lane % 4) * 2 + e] = T.Cast(in_dtype, acc_s[nb * 4 + i * 2 + e])
            T.ptx["fence.proxy.async.shared::cta"]()
            T.evaluate(named_barrier_sync(WARPGROUP_BARRIERS + wg, 128))
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_a[0]), smem.ptr_to([P_OFF + wg * 64 * ATOM]),
                                                  KM_LBO, KM_SBO, SWIZZLE_128B)
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b[0]),
                                                  smem.ptr_to([RING_OFF + slot * SLOT + KT * D]),
                                                  V_LBO, V_SBO, SWIZZLE_128B)
            T.ptx.wgmma.fence.sync.aligned()
            for kk in T.unroll(KT // 16):
                T.ptx[wgmma_o](*[acc_o[i] for i in range(ACC_O)],
                               desc_a[0] + k_step(QB, kk), desc_b[0] + T.Cast("uint64", kk * 16 * ATOM // 8),
                               True, 1, 1, 0, 1)
        T.ptx.wgmma.commit_group.sync.aligned()

    @T.macro
    def attend(keys, slot, tile, smem, mask_s, tid, r):
        """a consumer warpgroup's step on the key tile ``keys`` in ring slot ``slot``, in order:
        its 64 queries' scores, the online softmax, ``O_acc += P V``"""
        issue_qk(slot, smem, tid, r)
        predicate_bits(keys, slot, mask_s, tile, tid, r)
        T.ptx.wgmma.wait_group.sync.aligned(0)
        softmax_step(keys, tile, tid, r)
        rescale_o(r)
        if p_in_registers:
            pack_p(r)
        issue_pv(slot, smem, tid, r)
        T.ptx.wgmma.wait_group.sync.aligned(0)

    class VisitedBlocks:
        """the key tile of step j of a CTA (``PAIR`` visited blocks, the empty block past the
        ``count`` visited ones): ids and partial flags read from the index where used, or
        (``prefetch_index``) a step ahead into ``visit`` (``first_visit`` before the loop,
        ``next_visit`` at the top of step j; ``visit[h]`` step j's block h, ``visit[PAIR + h]``
        step j + 1's), each entry packed as ``2 id + partial``, so the index's loads run while the
        step works, not in front of it"""

        def __init__(self, visit, tile, listed, count):
            self.visit, self.tile, self.listed, self.count = visit, tile, listed, count
            self.steps = (count + (PAIR - 1)) // PAIR

        def _block(self, n):
            if PAIR == 1:
                return self.tile.block(n, self.listed)
            return T.if_then_else(n < self.count, self.tile.block(n, self.listed), EMPTY_BLOCK)

        def _partial(self, n):
            if PAIR == 1:
                return self.tile.partial(n, self.listed)
            return T.if_then_else(n < self.count, self.tile.partial(n, self.listed), 1)

        def entry(self, j, h):
            n = j * PAIR + h
            return self._block(n) * 2 + T.Cast("int32", self._partial(n) != 0)

        def keys(self, j):
            if prefetch_index:
                return KeyTile([T.shift_right(self.visit[h], 1) for h in range(PAIR)],
                               [T.bitwise_and(self.visit[h], 1) for h in range(PAIR)], KB)
            return KeyTile([self._block(j * PAIR + h) for h in range(PAIR)],
                           [self._partial(j * PAIR + h) for h in range(PAIR)], KB)

    @T.macro
    def first_visit(blocks):
        """(``prefetch_index``) step 0's entries into ``visit[PAIR:]``"""
        if prefetch_index:
            if blocks.count > 0:
                for h in T.unroll(PAIR):
                    blocks.visit[PAIR + h] = blocks.entry(0, h)

    @T.macro
    def next_visit(blocks, j):
        """(``prefetch_index``) step j's entries, read a step ago, into ``visit[:PAIR]``, step
        j + 1's read now into ``visit[PAIR:]``"""
        if prefetch_index:
            for h in T.unroll(PAIR):
                blocks.visit[h] = blocks.visit[PAIR + h]
            if j + 1 < blocks.steps:
                for h in T.unroll(PAIR):
                    blocks.visit[PAIR + h] = blocks.entry(j + 1, h)

    @T.macro
    def first_turn(tid):
        """(``turns``) warpgroup 0 issues first: warpgroup 1 arrives on its barrier once before the loop"""
        if turns:
            if tid >= 128:
                T.evaluate(named_barrier_arrive(SCHEDULER_BARRIERS, THREADS))

    @T.macro
    def my_turn(tid):
        """(``turns``) wait until the other consumer warpgroup has issued its wgmma of this turn"""
        if turns:
            if tid < 128:
                T.evaluate(named_barrier_sync(SCHEDULER_BARRIERS, THREADS))
            else:
                T.evaluate(named_barrier_sync(SCHEDULER_BARRIERS + 1, THREADS))

    @T.macro
    def end_turn(tid, last):
        """(``turns``) hand the turn to the other consumer warpgroup (warpgroup 1's last turn hands
        nothing: every arrival on a barrier is then matched by a sync)"""
        if turns:
            if tid < 128:
                T.evaluate(named_barrier_arrive(SCHEDULER_BARRIERS + 1, THREADS))
            elif not last:
                T.evaluate(named_barrier_arrive(SCHEDULER_BARRIERS, THREADS))

    def consumers_sync():
        """the barrier of the two consumer warpgroups (the loader warpgroup, where there is one,
        takes no part)"""
        return named_barrier_sync(CONSUMERS_BARRIER, THREADS) if warp_specialized else T.cuda.cta_sync()

    @T.macro
    def store_o(O, tile, smem, tid, r):
        """SWrite: O_acc / l (0 for a row without an allowed key) -> the staged [128, D + 8]
        tile over the ring (every consumer is done with it) -> 16-byte stores of the tile's rows"""
        acc_s, acc_o, row_max, row_sum, alpha, m_new, desc_a, desc_b, p_regs, allowed_bits = r.unpacked()
        w = (tid % 128) // 32
        lane = tid % 32
        T.evaluate(consumers_sync())
        for i in T.unroll(2):
            row_sum[i] = quad_sum(row_sum[i])
        for nb in T.unroll(D // 8):
            for i in T.unroll(2):
                for e in T.vectorized(2):
                    smem[RING_OFF + (tid // 128 * 64 + w * 16 + lane // 4 + 8 * i) * O_ROW + nb * 8
                         + (lane % 4) * 2 + e] = T.Cast(in_dtype, T.if_then_else(
                             row_sum[i] > T.float32(0), acc_o[nb * 4 + i * 2 + e] / row_sum[i], T.float32(0)))
        T.evaluate(consumers_sync())
        for c in T.unroll(QB * ROW_CHUNKS // THREADS):
            row = (tid + THREADS * c) // ROW_CHUNKS
            ch = (tid + THREADS * c) % ROW_CHUNKS
            if tile.out_ok(row):
                for e in T.vectorized(8):
                    O[tile.b, tile.h, tile.out_row(row), ch * 8 + e] = smem[RING_OFF + row * O_ROW + ch * 8 + e]

    @T.macro
    def device_body(Q, K, V, COUNTS, IDS, PARTIAL, buffers, GROWS, GCOUNT, O, B, H, HG, Sq, Sk, maps):
        T.device_entry()
        if register_split:
            # (setmaxnreg needs the registers at entry known: one CTA an SM)
            T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        if global_split:
            # tile z: the global tiles (one a 128 global rows, at most ceil(Sq / 128)) first, so that
            # their long rows (every key block) start early (CTAs start in x, y, z order), then
            # the window tiles
            h, b, z = T.cta_id([H, B, 2 * ((Sq + QB - 1) // QB)])
            tid = T.thread_id([LAUNCH_THREADS])
            glob = z < (Sq + QB - 1) // QB
            tq = T.if_then_else(glob, z, z - (Sq + QB - 1) // QB)
            gcount = GCOUNT[b]
            if T.And(glob, tq * QB >= gcount):
                T.evaluate(exit_thread())       # (no global rows for this tile: the whole CTA)
            tile = T.meta_var(QueryTile(pattern, KB, b, h, 0, tq, Sq, Sk, buffers, COUNTS, IDS, PARTIAL, glob=glob,
                                        GROWS=GROWS, gcount=gcount))
        else:
            qb, h, b = T.cta_id([(Sq + QB - 1) // QB, H, B])
            tid = T.thread_id([LAUNCH_THREADS])
            hg = T.min(h, HG - 1)
            tile = T.meta_var(QueryTile(pattern, KB, b, h, hg, qb, Sq, Sk, buffers, COUNTS, IDS, PARTIAL))
        smem = T.alloc_buffer([SMEM_ELEMS], in_dtype, scope="shared.dyn", align=1024)
        mask_s = T.decl_buffer([SMEM_BYTES], "uint8", data=smem.data)     # (bytes: the staged mask tiles)
        bars = T.alloc_buffer([2 * STAGES + 1 if warp_specialized else 1], "uint64", scope="shared", align=8)
        acc_s = T.alloc_local([ACC_S], "float32")
        acc_o = T.alloc_local([ACC_O], "float32")
        row_max = T.alloc_local([2], "float32")    # running max (of the unscaled scores) of rows i = 0, 1
        row_sum = T.alloc_local([2], "float32")    # this thread's part of the running sum
        alpha = T.alloc_local([2], "float32")
        m_new = T.alloc_local([1], "float32")
        desc_a = T.alloc_local([1], "uint64")
        desc_b = T.alloc_local([1], "uint64")
        p_regs = T.alloc_local([KT // 4 if p_in_registers else 1], "uint32")   # P as wgmma's register A
        allowed_bits = T.alloc_local([ACC_S // 32], "uint32")    # the predicate: word nb / 8, bit 4(nb % 8) + 2i + e
        visit = T.alloc_local([2 * PAIR], "int32")   # (prefetch_index) entries of this step's blocks and the next's
        r = T.meta_var(ConsumerRegisters(acc_s, acc_o, row_max, row_sum, alpha, m_new, desc_a, desc_b, p_regs,
                                         allowed_bits))
        if global_split:
            listed = tile.listed()          # (the index's; the gathered key blocks follow them)
            count = tile.count(listed)
        else:
            count = tile.listed()
            listed = T.meta_var(count)
        blocks = T.meta_var(VisitedBlocks(visit, tile, listed, count))
        for i in T.unroll(ACC_O):
            acc_o[i] = T.float32(0)
        for i in T.unroll(2):
            row_max[i] = masked
            row_sum[i] = T.float32(0)
        if warp_specialized:
            # full[s] (bars[s]): the loader's 128 threads' copies of the slot landed; empty[s]
            # (bars[STAGES + s]): both consumer warpgroups are done with it; bars[2 STAGES]: Q
            if tid == 0:
                ring.init(bars, FULL_ARRIVALS, CONSUMER_WARPGROUPS)
                T.ptx.mbarrier.init.shared.b64(bars.ptr_to([2 * STAGES]), T.uint32(LOADER_THREADS))
            T.cuda.cta_sync()
            if tid >= THREADS:
                # the loader warpgroup: Q, then each step's key tile once its slot is free
                if register_split:
                    T.ptx["setmaxnreg.dec.sync.aligned.u32"](LOADER_REGS)
                load_q(Q, tile, smem, tid - THREADS, LOADER_THREADS)
                T.ptx["cp.async.mbarrier.arrive.noinc.shared.b64"](bars.ptr_to([2 * STAGES]))
                first_visit(blocks)
                if not THREAD_COPIES:
                    if tid > THREADS:
                        T.evaluate(exit_thread())       # (one thread loads K and V; no mask tiles to copy)
                for j in T.serial(blocks.steps):
                    next_visit(blocks, j)
                    ring.acquire(bars, j % STAGES, j)
                    if tma_kv:
                        if tid == THREADS:
                            tma_block(tile, smem, bars, j % STAGES, blocks.keys(j), maps, B, H)
                    else:
                        load_block(K, V, tile, smem, j % STAGES, blocks.keys(j), tid - THREADS, LOADER_THREADS)
                    if mask_tiles:
                        if blocks.keys(j).needs_predicate(tile):
                            load_mask_tile(tile, mask_s, j % STAGES, blocks.keys(j), tid - THREADS, LOADER_THREADS)
                    if THREAD_COPIES:
                        ring.arrive_on_copies(bars, j % STAGES)
                T.evaluate(exit_thread())
            if register_split:
                T.ptx["setmaxnreg.inc.sync.aligned.u32"](CONSUMER_REGS)
            T.cuda.mbarrier_wait(bars.ptr_to([2 * STAGES]), 0)
            if overlap:
                # step j's scores and softmax while step j-1's P V runs (FA3's intra-warpgroup
                # overlap): S_j's wgmma, then P_{j-1} V's; the softmax once S_j is in; O_acc's
                # rescale and P_j's packing once P_{j-1} V retired (it reads both)
                if count > 0:
                    first_turn(tid)
                    first_visit(blocks)
                    next_visit(blocks, 0)
                    ring.wait_full(bars, 0, 0)
                    T.ptx["fence.proxy.async.shared::cta"]()
                    my_turn(tid)
                    issue_qk(0, smem, tid, r)
                    end_turn(tid, False)
                    predicate_bits(blocks.keys(0), 0, mask_s, tile, tid, r)
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    softmax_step(blocks.keys(0), tile, tid, r)
                    pack_p(r)
                    for j in T.serial(1, blocks.steps):
                        next_visit(blocks, j)
                        ring.wait_full(bars, j % STAGES, j)
                        T.ptx["fence.proxy.async.shared::cta"]()
                        my_turn(tid)
                        issue_qk(j % STAGES, smem, tid, r)
                        issue_pv((j - 1) % STAGES, smem, tid, r)
                        end_turn(tid, False)
                        predicate_bits(blocks.keys(j), j % STAGES, mask_s, tile, tid, r)
                        T.ptx.wgmma.wait_group.sync.aligned(1)          # S_j is in
                        softmax_step(blocks.keys(j), tile, tid, r)
                        T.ptx.wgmma.wait_group.sync.aligned(0)          # P_{j-1} V retired
                        ring.release(bars, j, tid)      # (the slot of step j-1: release takes q - 1)
                        rescale_o(r)
                        pack_p(r)
                    my_turn(tid)
                    issue_pv((blocks.steps - 1) % STAGES, smem, tid, r)
                    end_turn(tid, True)
                    T.ptx.wgmma.wait_group.sync.aligned(0)
            else:
                first_visit(blocks)
                for j in T.serial(blocks.steps):
                    next_visit(blocks, j)
                    ring.wait_full(bars, j % STAGES, j)
                    # (cp.async wrote through the generic proxy; wgmma reads through the async one)
                    T.ptx["fence.proxy.async.shared::cta"]()
                    attend(blocks.keys(j), j % STAGES, tile, smem, mask_s, tid, r)
                    ring.release(bars, j + 1, tid)      # (the slot of step j: release takes q - 1)
        else:
            # every thread copies: Q, then the first STAGES - 1 listed blocks, one group each
            # (empty groups past the count)
            load_q(Q, tile, smem, tid, THREADS)
            T.ptx["cp.async.commit_group"]()
            for j in T.unroll(STAGES - 1):
                if j < count:
                    load_block(K, V, tile, smem, j, KeyTile([tile.block(j, listed)], [0], KB), tid, THREADS)
                T.ptx["cp.async.commit_group"]()
            for j in T.serial(count):
                # block j landed (this thread's copies, then everyone's); every warpgroup is
                # past block j-1's wgmma, so its slot may be refilled
                T.ptx["cp.async.wait_group"](STAGES - 2)
                T.ptx["fence.proxy.async.shared::cta"]()
                T.cuda.cta_sync()
                if j + STAGES - 1 < count:
                    load_block(K, V, tile, smem, (j + STAGES - 1) % STAGES,
                               KeyTile([tile.block(j + STAGES - 1, listed)], [0], KB), tid, THREADS)
                T.ptx["cp.async.commit_group"]()
                attend(KeyTile([tile.block(j, listed)], [tile.partial(j, listed)], KB), j % STAGES, tile, smem, mask_s,
                       tid, r)
            T.ptx["cp.async.wait_group"](0)
        store_o(O, tile, smem, tid, r)

    encode_tma_map = tma_map_encoder(in_dtype)

    @T.macro
    def body(Q, K, V, COUNTS, IDS, PARTIAL, buffers, GROWS, GCOUNT, O, B, H, HG, Sq, Sk):
        if tma_kv:
            # (host) the TMA descriptors of K and V as [B H Sk, D], boxes of 64 x KB, 128-byte swizzle
            map_k: T.let[T.TensorMap()] = T.tvm_stack_alloca("tensormap", 1)
            encode_tma_map(map_k, K.data, D, B * H * Sk, ATOM, KB)
            map_v: T.let[T.TensorMap()] = T.tvm_stack_alloca("tensormap", 1)
            encode_tma_map(map_v, V.data, D, B * H * Sk, ATOM, KB)
            device_body(Q, K, V, COUNTS, IDS, PARTIAL, buffers, GROWS, GCOUNT, O, B, H, HG, Sq, Sk, (map_k, map_v))
        else:
            device_body(Q, K, V, COUNTS, IDS, PARTIAL, buffers, GROWS, GCOUNT, O, B, H, HG, Sq, Sk, None)

    func = _signature(body, D, KB, in_dtype, mask_dtype, pattern, global_split, mask_bits)
    name = (f"pit_sparse_attention_hopper_{pattern.tag}_d{D}_kb{KB}_{in_dtype}"
            + (f"_{mask_dtype}" if pattern.mask else "") + ("_gsplit" if global_split else "")
            + ("_bits" if mask_bits else ""))
    return (lower_tirx(func, TARGET).with_attr("global_symbol", name).with_attr("pit.attention.key_block", KB)
            .with_attr("pit.attention.global_split", bool(global_split)).with_attr("pit.attention.key_tile", KT)
            .with_attr("pit.attention.mask_bits", mask_bits))


def _signature(body, D, KB, in_dtype, mask_dtype, pattern, global_split, mask_bits=False):
    """The PrimFunc around ``body`` with the contract's parameters: ``q, k, v, block_counts,
    block_ids, block_partial``, the pattern's run-time inputs (``mask, global_flags, doc_ids``
    as present), with ``global_split`` the index's ``global_rows, global_count``, with
    ``mask_bits`` the index's packed mask, then ``o``.  B, H, Sq,
    Sk and the head dims of the mask (MH) and the index (HG)
    symbolic; with global tokens or documents (``[B, S]`` inputs) Sq = Sk = S
    (:func:`~pit_tvm.ops.sparse_attention.sequence_lengths`)."""
    from pit_tvm.ops.sparse_attention import sequence_lengths

    inputs = pattern.inputs

    def pattern_buffers(B, MH, Sq, Sk, mask, flags, docs, bits):
        """the pattern's run-time inputs by name (the predicate's ``buffers``), and the packed mask"""
        extra = {}
        if "mask" in inputs:
            extra["mask"] = T.match_buffer(mask, (B, MH, Sq, Sk), mask_dtype)
        if mask_bits:
            extra["mask_bits"] = T.match_buffer(bits, (B, MH, blocks(Sk, MASK_BITS_KEYS), Sq), "uint64")
        if "global_flags" in inputs:
            extra["global_flags"] = T.match_buffer(flags, (B, Sk), "int32")
        if "doc_ids" in inputs:
            extra["doc_ids"] = T.match_buffer(docs, (B, Sk), "int32")
        return extra

    def global_rows(B, Sq, rows, nrows):
        """the index's global rows and their count (``global_split``), else None, None"""
        if not global_split:
            return None, None
        return T.match_buffer(rows, (B, Sq), "int32"), T.match_buffer(nrows, (B,), "int32")

    def blocks(n, size):
        return (n + (size - 1)) // size

    @T.macro
    def with_lengths(q, k, v, counts, ids, partial, mask, flags, docs, rows, nrows, bits, o, B, H, HG, MH, Sq, Sk):
        body(T.match_buffer(q, (B, H, Sq, D), in_dtype), T.match_buffer(k, (B, H, Sk, D), in_dtype),
             T.match_buffer(v, (B, H, Sk, D), in_dtype),
             T.match_buffer(counts, (B, HG, blocks(Sq, QUERY_BLOCK)), "int32"),
             T.match_buffer(ids, (B, HG, blocks(Sq, QUERY_BLOCK), blocks(Sk, KB)), "int32"),
             T.match_buffer(partial, (B, HG, blocks(Sq, QUERY_BLOCK), blocks(Sk, KB)), "int32"),
             pattern_buffers(B, MH, Sq, Sk, mask, flags, docs, bits),
             *global_rows(B, Sq, rows, nrows),
             T.match_buffer(o, (B, H, Sq, D), in_dtype),
             T.Cast("int32", B), T.Cast("int32", H), T.Cast("int32", HG), T.Cast("int32", Sq), T.Cast("int32", Sk))

    @T.prim_func(s_tir=False)
    def kernel(q: T.handle, k: T.handle, v: T.handle, counts: T.handle, ids: T.handle, partial: T.handle,
               mask: T.handle, flags: T.handle, docs: T.handle, rows: T.handle, nrows: T.handle, bits: T.handle,
               o: T.handle):
        B, H, HG, MH, Sq, Sk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        with_lengths(q, k, v, counts, ids, partial, mask, flags, docs, rows, nrows, bits, o, B, H, HG, MH,
                     *sequence_lengths(pattern, Sq, Sk, Sq))

    names = ("q", "k", "v", "block_counts", "block_ids", "block_partial", "mask", "global_flags", "doc_ids",
             "global_rows", "global_count", "mask_bits", "o")
    dropped = {"mask", "global_flags", "doc_ids"} - set(inputs)
    dropped |= set() if global_split else {"global_rows", "global_count"}
    return without_params(kernel, names, dropped if mask_bits else dropped | {"mask_bits"})
