"""The few-rows tiers' store warpgroup: a rows kernel's tier runs on :data:`.planner.SMS`
persistent CTAs, each computing at most one tile of the listed rows; a third warpgroup of each
CTA then stores C's rows past those tiles (all unlisted: ``epilogue(0)``, + the residual),
whole rows of 16-byte chunks, the row ids of :data:`.config.STORE_BATCH` rows loaded ahead.

Barriers: the consumers arrive on :data:`.barriers.STORE_READY_BARRIER` once their K loop is
done; the store warpgroup waits on it, so C's stores do not slow a K loop that streams B."""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.schedules.hopper.config import BLOCK_M, STORE_BATCH, STORER_THREADS
from pit_tvm.schedules.hopper.epilogue import Epilogue
from pit_tvm.schedules.hopper.planner import SMS


class UnlistedRowStorer:
    """``store_unlisted(cta, lane, m, OFF, IDS, BIAS, RS, RES, C, z_id, z_val, z_res)`` for a
    tier with epilogue ``ep`` and N = ``n``; ``count_of(OFF, m)`` reads the listed row count.
    Its thread's registers: ``z_id`` (two batches of row ids), ``z_val`` (a chunk's values) and
    ``z_res`` (a row's residual chunks, :attr:`STORE_CHUNKS` of them)."""

    def __init__(self, ep: Epilogue, n: int, count_of):
        BM = BLOCK_M
        C_VEC = ep.vec
        residual, unlisted_nonzero = ep.residual, ep.unlisted_nonzero
        plus_residual, unlisted = ep.plus_residual, ep.unlisted
        zero_out = tirx.const(0, ep.out_dtype)
        ROW_CHUNKS = n // C_VEC                                  # 16-byte chunks of a row of C
        self.STORE_CHUNKS = STORE_CHUNKS = (ROW_CHUNKS + STORER_THREADS - 1) // STORER_THREADS   # a store thread's

        @T.macro
        def store_unlisted(cta, lane, m, OFF, IDS, BIAS, RS, RES, C, z_id, z_val, z_res):
            """a few-rows tier's store warpgroup (``lane`` = tid - THREADS): C's rows past the listed
            rows' tiles, p >= P = 128 ceil(count / 128), all unlisted: ``C[ids[p]] = epilogue(0)``
            (+ the residual), once the CTA's K loop is done.  CTA c takes p = P + c + SMS i, a row at
            a time, 16-byte chunks lane + 128 h of it; the ids of STORE_BATCH rows at a time."""
            pz = (count_of(OFF, m) + BM - 1) // BM * BM
            mine = (T.max(m - pz - cta, 0) + SMS - 1) // SMS       # this CTA's rows
            if mine > 0:           # (no ids to read where C has no rows here, M = 0 included)
                for j in T.unroll(STORE_BATCH):
                    z_id[STORE_BATCH + j] = IDS[T.min(pz + cta + SMS * j, m - 1)]
            for b in T.serial((mine + STORE_BATCH - 1) // STORE_BATCH):
                for j in T.unroll(STORE_BATCH):
                    z_id[j] = z_id[STORE_BATCH + j]
                    z_id[STORE_BATCH + j] = IDS[T.min(pz + cta + SMS * (STORE_BATCH * (b + 1) + j), m - 1)]
                for j in T.unroll(STORE_BATCH):
                    if STORE_BATCH * b + j < mine:
                        if residual:       # (the row's chunks loaded before its first store)
                            for h in T.unroll(STORE_CHUNKS):
                                if lane + STORER_THREADS * h < ROW_CHUNKS:
                                    for e in T.vectorized(C_VEC):
                                        z_res[h * C_VEC + e] = RES[T.Cast("int64", z_id[j]),
                                                                   (lane + STORER_THREADS * h) * C_VEC + e]
                        for h in T.unroll(STORE_CHUNKS):
                            if lane + STORER_THREADS * h < ROW_CHUNKS:
                                if unlisted_nonzero:
                                    for e in T.unroll(C_VEC):
                                        z_val[e] = plus_residual(unlisted(
                                            BIAS, RS, T.Cast("int64", z_id[j]),
                                            (lane + STORER_THREADS * h) * C_VEC + e), z_res, h, e)
                                    for e in T.vectorized(C_VEC):
                                        C[T.Cast("int64", z_id[j]), (lane + STORER_THREADS * h) * C_VEC + e] = z_val[e]
                                else:      # no bias, or a row scale that is zero wherever the index skips a row
                                    for e in T.vectorized(C_VEC):
                                        C[T.Cast("int64", z_id[j]), (lane + STORER_THREADS * h) * C_VEC + e] = zero_out

        self.store_unlisted = store_unlisted
