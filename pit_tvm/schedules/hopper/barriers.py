"""Named barriers (``bar.sync`` / ``bar.arrive`` ids) of the Hopper kernels, and thread exit.

Barrier 0 is ``__syncthreads`` (every thread of the CTA that has not exited).  A kernel whose
CTA has a warpgroup outside the tile's work (a few-rows tier's store warpgroup) syncs the tile's
threads on :data:`CONSUMERS_BARRIER` instead, and hands the store warpgroup the end of the K
loop on :data:`STORE_READY_BARRIER`.
"""
from __future__ import annotations

from tvm.script import tirx as T

#: ``__syncthreads``: the whole CTA
CTA_BARRIER = 0
#: the two consumer warpgroups (the tile's 256 threads) without the store warpgroup
CONSUMERS_BARRIER = 1
#: consumers arrive once their K loop is done; the store warpgroup waits on it, then stores
STORE_READY_BARRIER = 2
#: warpgroup g of a kernel whose warpgroups sync apart (block-sparse attention's P tile) uses
#: ``WARPGROUP_BARRIERS + g``
WARPGROUP_BARRIERS = 3
#: consumer warpgroup g of block-sparse attention issues its wgmma in turn (FA3's scheduler barrier):
#: it syncs on ``SCHEDULER_BARRIERS + g`` before, and arrives on the other's after
SCHEDULER_BARRIERS = 5


def named_barrier_sync(barrier: int, threads: int):
    """``bar.sync barrier, threads`` (an expression to evaluate)"""
    return T.ptx["bar.sync"](T.uint32(barrier), T.uint32(threads))


def named_barrier_arrive(barrier: int, threads: int):
    """``bar.arrive barrier, threads``: count this thread in without waiting"""
    return T.ptx["bar.arrive"](T.uint32(barrier), T.uint32(threads))


def exit_thread():
    """PTX ``exit``: the calling thread ends (CTA barriers then wait only for the others)"""
    return T.cuda.func_call("pit_exit_thread", source_code=(
        "__forceinline__ __device__ void pit_exit_thread() { asm volatile(\"exit;\" ::: \"memory\"); }"))
