"""TensorIR building blocks of the on-device sparse index: loop strategies, the
flag -> chunked prefix-scan -> compaction pipeline and the expert lists.

Every index function is one PrimFunc made of a few kernels (one top-level loop nest each):

1. (tiles only) ``flags``: one pass over the data, an int8 flag per micro-tile, stored
   group-major (flat id ``f = g * P + p`` with ``P`` tiles per group).
2. ``chunk_count``: the flags are cut into chunks of ``CH = NT * K`` flat ids; one CUDA block
   per chunk sums its flags (coalesced reads, shared-memory tree reduction).
3. ``chunk_scan``: one block scans the chunk counts (each thread serially sums a contiguous
   run of ``ceil(NC / NT)`` counts, a Hillis-Steele scan over the ``NT`` partial sums in shared
   memory, then each thread writes its run's exclusive offsets) and writes the total.
4. ``compact``: one block per chunk again; each thread owns ``K`` consecutive flat ids,
   a block scan of the per-thread counts gives each thread its write position
   (chunk offset + exclusive prefix), then the thread writes its ids in ascending order and
   the ``-1`` tail.

The expert index is one kernel instead (``make_expert_lists``): one block per expert reads
every assignment, so no flag per (assignment, expert) pair is stored and no scan crosses
blocks.

No atomics, no host round trip: the output order is the flat order, so results are
deterministic byte for byte. The "schedule" is chosen when the kernels are generated
(:class:`LoopStrategy`): on CUDA the block/thread loops are bound to ``blockIdx.x`` /
``threadIdx.{x,y}`` and the per-block scratch lives in shared memory (TVM's thread-sync pass
inserts the ``__syncthreads``); on CPU the block loops are ``parallel`` and the "thread" loops
are serial, which executes the same phases in order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tvm.script import tirx as T

# CUDA block size and items per thread of the scan/compaction kernels.
NT = 256
K = 4
CH = NT * K
LOG_NT = 8
assert 1 << LOG_NT == NT
# the expert lists' block (one an expert) and the loads of a thread's run kept in flight
EXPERT_THREADS = 1024
RUN_UNROLL = 4


@dataclass(frozen=True)
class LoopStrategy:
    """How the generic kernels' loops are realised for one target (the schedule).

    ``gpu_layout``: use the CUDA kernel structure (thread-per-column flag kernel, shared
    scratch). With ``gpu=False`` and ``gpu_layout=True`` that structure runs on the CPU with
    serial "thread" loops: tests use it to check the CUDA algorithm without a GPU.
    """

    gpu: bool
    gpu_layout: bool = False

    def bx(self, n):
        """Grid loop: one iteration per CUDA block (parallel on CPU)."""
        if self.gpu:
            return T.thread_binding(n, thread="blockIdx.x")
        return T.parallel(n)

    def tx(self, n):
        """Thread loop inside a block (serial on CPU; phases run one after the other)."""
        if self.gpu:
            return T.thread_binding(n, thread="threadIdx.x")
        return T.serial(n)

    def ty(self, n):
        if self.gpu:
            return T.thread_binding(n, thread="threadIdx.y")
        return T.serial(n)

    @property
    def shared(self) -> str:
        return "shared" if self.gpu else "local"


def schedule_cpu(emulate_gpu: bool = False) -> LoopStrategy:
    return LoopStrategy(gpu=False, gpu_layout=emulate_gpu)


def schedule_cuda() -> LoopStrategy:
    return LoopStrategy(gpu=True, gpu_layout=True)


def num_chunks(nf):
    return (nf + (CH - 1)) // CH


def make_block_reduce(st: LoopStrategy, threads: int = NT):
    """``block_reduce(sA)``: ``sA[0] <- sum(sA[0:threads])`` by one CTA (a tree reduction; the
    syncs between its steps are inserted on CUDA); shared by every index pipeline."""
    TX = st.tx
    steps = threads.bit_length() - 1
    assert 1 << steps == threads

    @T.macro
    def block_reduce(sA):
        for step in T.unroll(steps):
            for tx in TX(threads):
                if tx < T.shift_right(threads // 2, step):
                    sA[tx] = sA[tx] + sA[tx + T.shift_right(threads // 2, step)]

    return block_reduce


def make_run_sums(st: LoopStrategy):
    """``run_sums(sA, n, add)``: each thread ``tx`` of one CTA sums its contiguous run of
    ``ceil(n / NT)`` of ``n`` items into ``sA[tx]`` (``add(acc, i)``, a macro, adds item ``i``
    to ``acc[0]``): the first phase of a run-wise scan (runs keep each thread's outputs in
    order); shared by every index pipeline."""
    TX = st.tx

    @T.macro
    def run_sums(sA, n, add):
        for tx in TX(NT):
            acc = T.alloc_buffer((1,), "int32", scope="local")
            acc[0] = 0
            for j in range((n + (NT - 1)) // NT):
                if tx * ((n + (NT - 1)) // NT) + j < n:
                    add(acc, tx * ((n + (NT - 1)) // NT) + j)
            sA[tx] = acc[0]

    return run_sums


def add_item(values):
    """``add(acc, i)`` for :func:`make_run_sums`: ``acc[0] += values[i]``"""
    @T.macro
    def add(acc, i):
        acc[0] = acc[0] + values[i]

    return add


def make_block_scan(st: LoopStrategy, threads: int = NT):
    """``block_scan(sA, sB)``: in-place inclusive scan of ``sA[0:threads]`` by one CTA
    (Hillis-Steele, ``sB`` is the double buffer); shared by every index pipeline."""
    TX = st.tx
    steps = threads.bit_length() - 1
    assert 1 << steps == threads

    @T.macro
    def block_scan(sA, sB):
        for step in T.unroll(steps):
            for tx in TX(threads):
                if tx >= T.shift_left(1, step):
                    sB[tx] = sA[tx] + sA[tx - T.shift_left(1, step)]
                else:
                    sB[tx] = sA[tx]
            for tx in TX(threads):
                sA[tx] = sB[tx]

    return block_scan


def make_pipeline(
    st: LoopStrategy,
    flag_fn: Callable,
    id_fn: Callable,
):
    """Return the ``chunk_count``, ``chunk_scan`` and ``compact`` macros.

    ``flag_fn(src, f)`` -> int32 0/1 flag of flat id ``f`` (``src`` a buffer or tuple of them);
    ``id_fn(f, P)`` -> the int value written to the id list for flat id ``f``.
    """
    BX, TX, SH = st.bx, st.tx, st.shared
    block_reduce = make_block_reduce(st)
    block_scan = make_block_scan(st)
    run_sums = make_run_sums(st)

    def flat_id(c, tx, k, coalesced):
        """thread ``tx``'s ``k``-th flat id of chunk ``c``: strided by NT (coalesced reads) or
        the thread's contiguous run of K (the compaction's order)"""
        return c * CH + k * NT + tx if coalesced else c * CH + tx * K + k

    @T.macro
    def thread_counts(src, NF, c, sA, coalesced):
        # sA[tx] = number of set flags among thread tx's K flat ids of chunk c
        for tx in TX(NT):
            acc = T.alloc_buffer((1,), "int32", scope="local")
            acc[0] = 0
            for k in range(K):
                if flat_id(c, tx, k, coalesced) < NF:
                    acc[0] = acc[0] + flag_fn(src, flat_id(c, tx, k, coalesced))
            sA[tx] = acc[0]

    @T.macro
    def chunk_count(src, NF, CNT):
        # CNT[c] = number of set flags among flat ids [c*CH, (c+1)*CH)
        for c in BX(T.max(num_chunks(NF), 1)):
            sA = T.alloc_buffer((NT,), "int32", scope=SH)
            thread_counts(src, NF, c, sA, True)
            block_reduce(sA)
            for tx in TX(NT):
                if tx == 0:
                    if c < num_chunks(NF):
                        CNT[c] = sA[0]

    @T.macro
    def chunk_scan(NF, CNT, COFF, TOT, tot_idx):
        # COFF = exclusive scan of CNT; TOT[tot_idx] = total. One block.
        for b in BX(1):
            sA = T.alloc_buffer((NT,), "int32", scope=SH)
            sB = T.alloc_buffer((NT,), "int32", scope=SH)
            run_sums(sA, num_chunks(NF), add_item(CNT))
            block_scan(sA, sB)
            for tx in TX(NT):
                run = T.alloc_buffer((1,), "int32", scope="local")
                run[0] = 0
                if tx > 0:
                    run[0] = sA[tx - 1]
                for j in range((num_chunks(NF) + (NT - 1)) // NT):
                    if tx * ((num_chunks(NF) + (NT - 1)) // NT) + j < num_chunks(NF):
                        COFF[tx * ((num_chunks(NF) + (NT - 1)) // NT) + j] = run[0]
                        run[0] = run[0] + CNT[tx * ((num_chunks(NF) + (NT - 1)) // NT) + j]
                if tx == NT - 1:
                    TOT[tot_idx] = sA[NT - 1]

    @T.macro
    def compact(src, NF, P, CAP, COFF, TOT, tot_idx, IDS):
        # IDS[pos] = id_fn(f) for set flags in flat order; IDS[total:CAP] = -1.
        for c in BX(T.max(num_chunks(NF), 1)):
            sA = T.alloc_buffer((NT,), "int32", scope=SH)
            sB = T.alloc_buffer((NT,), "int32", scope=SH)
            thread_counts(src, NF, c, sA, False)
            block_scan(sA, sB)
            for tx in TX(NT):
                pos = T.alloc_buffer((1,), "int32", scope="local")
                pos[0] = 0
                if c < num_chunks(NF):
                    pos[0] = COFF[c]
                if tx > 0:
                    pos[0] = pos[0] + sA[tx - 1]
                for k in range(K):
                    if c * CH + tx * K + k < NF:
                        if flag_fn(src, c * CH + tx * K + k) != 0:
                            IDS[pos[0]] = T.Cast("int32", id_fn(c * CH + tx * K + k, P))
                            pos[0] = pos[0] + 1
            for tx in TX(NT):
                for k in range(K):
                    if c * CH + k * NT + tx < CAP:
                        if c * CH + k * NT + tx >= T.Cast("int64", TOT[tot_idx]):
                            IDS[c * CH + k * NT + tx] = -1

    return chunk_count, chunk_scan, compact


def make_expert_lists(st: LoopStrategy, num_experts: int, expert_of: Callable):
    """Return the ``expert_lists(src, P, OFF, ASG)`` macro: the expert index in one kernel.

    ``expert_of(src, a)`` -> the int32 expert of flat assignment ``a`` (values outside
    ``[0, E)`` are not listed).  One CTA an expert ``e``: each of its ``EXPERT_THREADS`` threads
    reads its contiguous run of ``ceil(P / EXPERT_THREADS)`` assignments (``RUN_UNROLL`` loads
    in flight), counting those of expert ``e`` and those of a lower expert (``OFF[e]``, with
    the listed total in the high word of the same int64); a block scan of the first counts
    gives each thread its write position, so ``e``'s list is ascending.  Every assignment is
    read once a CTA (``E * P`` compares over ``E`` CTAs, not ``E * P`` flags through three
    kernels); CTA ``E - 1`` writes ``OFF[E]`` and the ``-1`` tail.
    """
    E = num_experts
    NTE = EXPERT_THREADS
    U = RUN_UNROLL
    BX, TX, SH = st.bx, st.tx, st.shared
    block_reduce = make_block_reduce(st, NTE)
    block_scan = make_block_scan(st, NTE)

    def run(P):
        return (P + (NTE - 1)) // NTE

    def listed_below(x, e):
        # 1 for an expert below e (the offset), 1 << 32 for any listed expert (the total)
        return (T.Select(T.And(x >= 0, x < e), T.int64(1), T.int64(0))
                + T.Select(T.And(x >= 0, x < E), T.int64(1 << 32), T.int64(0)))

    @T.macro
    def expert_lists(src, P, OFF, ASG):
        for e in BX(E):
            s_mine = T.alloc_buffer((NTE,), "int32", scope=SH)
            s_scan = T.alloc_buffer((NTE,), "int32", scope=SH)
            s_below = T.alloc_buffer((NTE,), "int64", scope=SH)
            for tx in TX(NTE):
                mine = T.alloc_buffer((1,), "int32", scope="local")
                below = T.alloc_buffer((1,), "int64", scope="local")
                mine[0] = 0
                below[0] = T.int64(0)
                for j0 in range((run(P) + (U - 1)) // U):
                    for j1 in T.unroll(U):
                        if T.And(j0 * U + j1 < run(P), tx * run(P) + j0 * U + j1 < P):
                            mine[0] = mine[0] + T.Select(
                                expert_of(src, tx * run(P) + j0 * U + j1) == e, 1, 0)
                            below[0] = below[0] + listed_below(expert_of(src, tx * run(P) + j0 * U + j1), e)
                s_mine[tx] = mine[0]
                s_below[tx] = below[0]
            block_reduce(s_below)
            block_scan(s_mine, s_scan)
            for tx in TX(NTE):
                # (shared values into registers first: a shared load inside a condition
                # breaks the CUDA sync planner)
                below = T.alloc_buffer((1,), "int64", scope="local")
                pos = T.alloc_buffer((1,), "int32", scope="local")
                below[0] = s_below[0]
                pos[0] = T.Cast("int32", T.bitwise_and(below[0], T.int64(0xFFFFFFFF)))
                if tx > 0:
                    pos[0] = pos[0] + s_mine[tx - 1]
                for j0 in range((run(P) + (U - 1)) // U):
                    for j1 in T.unroll(U):
                        if T.And(j0 * U + j1 < run(P), tx * run(P) + j0 * U + j1 < P):
                            if expert_of(src, tx * run(P) + j0 * U + j1) == e:
                                ASG[pos[0]] = T.Cast("int32", tx * run(P) + j0 * U + j1)
                                pos[0] = pos[0] + 1
                if tx == 0:
                    OFF[e] = T.Cast("int32", T.bitwise_and(below[0], T.int64(0xFFFFFFFF)))
                if e == E - 1:
                    if tx == 0:
                        OFF[E] = T.Cast("int32", T.shift_right(below[0], T.int64(32)))
                    for j in range(run(P)):
                        if j * NTE + tx < P:
                            if j * NTE + tx >= T.shift_right(below[0], T.int64(32)):
                                ASG[j * NTE + tx] = -1

    return expert_lists
