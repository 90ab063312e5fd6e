"""The full / empty mbarrier ring between a loader (producer) and consumer warpgroups.

A ``stages``-deep ring of shared-memory slots has two mbarriers a slot in one ``uint64``
buffer: ``full[s]`` (``bars[s]``) completes when the slot's loads have landed (TMA bytes
counted by ``expect_tx``, cp.async arrivals by ``arrive_on_copies``), ``empty[s]``
(``bars[stages + s]``) when every consumer warpgroup released it.  K tile ``kt`` uses slot
``kt % stages``; the phase parity of its n-th use is ``n % 2``::

    producer, K tile kt:  acquire(kt)  (wait empty, but for the first pass)
                          expect_tx(full[s], bytes); TMA ... full[s];  cp.async ...; arrive_on_copies(full[s])
    consumer, K tile q:   wait_full(q); compute; release(q)  (slot of q - 1, once its wgmma retired)
"""
from __future__ import annotations

from tvm.script import tirx as T


class MbarrierRing:
    """The ring's mbarriers for ``stages`` slots (``bars``: a shared ``uint64`` buffer of
    ``2 * stages``) and its producer / consumer steps as ``T.macro`` s."""

    def __init__(self, stages: int):
        self.stages = stages
        self.init = _init(stages)
        self.acquire = _acquire(stages)
        self.wait_full = _wait_full(stages)
        self.release = _release(stages)
        self.expect_tx = expect_tx
        self.arrive_on_copies = arrive_on_copies

    def full(self, bars, slot):
        """slot's ``full`` mbarrier (the address TMA completes on)"""
        return bars.ptr_to([slot])

    def empty(self, bars, slot):
        """slot's ``empty`` mbarrier"""
        return bars.ptr_to([self.stages + slot])


def _init(stages):
    @T.macro
    def init(bars, full_arrivals, empty_arrivals):
        """(one thread) every slot's ``full`` waits for ``full_arrivals`` arrivals (and the TMA
        bytes expected), its ``empty`` for ``empty_arrivals`` (the consumer warpgroups)"""
        for s in T.unroll(stages):
            T.ptx.mbarrier.init.shared.b64(bars.ptr_to([s]), T.uint32(full_arrivals))
            T.ptx.mbarrier.init.shared.b64(bars.ptr_to([stages + s]), T.uint32(empty_arrivals))

    return init


def _acquire(stages):
    @T.macro
    def acquire(bars, s, kt):
        """producer: wait until the consumers released slot ``s`` (K tile ``kt - stages``); the
        first pass over the ring does not wait"""
        if kt >= stages:
            T.cuda.mbarrier_wait(bars.ptr_to([stages + s]), (kt // stages + 1) % 2)

    return acquire


@T.macro
def expect_tx(bars, s, nbytes):
    """producer (one thread): arrive on slot ``s``'s ``full`` and expect ``nbytes`` of TMA loads"""
    T.ptx.mbarrier.arrive.expect_tx.shared.b64(bars.ptr_to([s]), T.uint32(nbytes))


@T.macro
def arrive_on_copies(bars, s):
    """producer (each copying thread): arrive on slot ``s``'s ``full`` once this thread's
    cp.async so far have landed"""
    T.ptx["cp.async.mbarrier.arrive.noinc.shared.b64"](bars.ptr_to([s]))


def _wait_full(stages):
    @T.macro
    def wait_full(bars, slot, q):
        """consumer: wait until K tile ``q``'s slot has filled"""
        T.cuda.mbarrier_wait(bars.ptr_to([slot]), (q // stages) % 2)

    return wait_full


def _release(stages):
    @T.macro
    def release(bars, q, tid):
        """consumer warpgroup (its first thread): release the slot of K tile ``q - 1``, whose
        wgmma has retired"""
        if q > 0:
            if tid % 128 == 0:
                T.ptx.mbarrier.arrive.shared.b64(bars.ptr_to([stages + (q - 1) % stages]), T.uint32(1))

    return release
