"""dlight rule for softmax / layer norm over short static rows: one warp per row, several rows per CTA.

dlight's ``GeneralReduction`` gives each row a CTA of 256 threads. For attention's softmax
(rows of ``seq`` <= a few hundred elements, ``batch * heads * seq`` rows) half the threads idle, a
CTA does a few hundred bytes of work, and the reduction goes through shared memory: a BERT-base
softmax ran an order of magnitude over its HBM time (docs/design/measurements.md#dlight-rules).

This rule takes the same functions (reduction blocks over the trailing axes, then an injective
block over the same row) when every extent is static and a row has at most
``MAX_ROW`` elements, and maps::

    CTA            : ROWS rows                    (blockIdx.x)
    warp (ty)      : one row                      (threadIdx.y)
    lane (tx)      : columns tx, tx+32, ...       (threadIdx.x; coalesced, warp-shuffle reductions)

Each reduction block is computed at the CTA (its ``ROWS`` rows on ``ty``, the row on ``tx``),
its row results kept in registers (``local``): TVM's warp all-reduce ends with a shuffle that gives
every lane the row's result. Not in shared memory: there lane 0 stores the result and the other
lanes of its warp read it with no barrier between (TVM's ``ThreadSync`` takes the same index
``[threadIdx.y]`` for the same thread), and nvcc (fp32, sm_90a) issues their loads before lane 0's
store, so 31 of 32 lanes normalised with a stale mean and variance (NaN or wrong scale).
Anything else returns None, so the next rule (``GeneralReduction``) applies. Registered ahead of
it in :func:`pit_tvm.target.cuda_schedule_rules`.
"""
from __future__ import annotations

from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

from pit_tvm.schedules._dlight import dlight_blocks, is_static

WARP = 32
MAX_ROW = 4096
ROWS_PER_CTA = (8, 4, 2, 1)
UNROLL = 64
#: where a row's reduction results live: one register per lane (see the module docstring)
REDUCTION_SCOPE = "local"


def _prod(extents) -> int:
    out = 1
    for e in extents:
        out *= int(e)
    return out


class RowReduction(GPUScheduleRule):
    """Warp-per-row schedule for multi-block row reductions (softmax, layer norm) with static shapes."""

    def apply(self, func, target, _tunable):  # noqa: D102 - see the module docstring
        found = dlight_blocks(func, target)
        if found is None or len(found[1]) < 2:
            return None
        sch, infos = found
        kind = infos[0].dom_kind()
        n_s = len(kind) - len(kind.lstrip("S"))
        if n_s in (0, len(kind)) or kind[n_s:] != "R" * (len(kind) - n_s):  # no reduction: not ours
            return None
        if any(info.dom_kind() != kind for info in infos[:-1]):
            return None
        last = infos[-1]
        if last.dom_kind() != "S" * len(kind) or not is_static(last.dom()):
            return None
        if any(not is_static(info.dom()) for info in infos[:-1]):
            return None
        # the last block must walk the same rows as the reductions, then the same columns
        if [int(d) for d in last.dom()[:n_s]] != [int(d) for d in infos[0].dom()[:n_s]]:
            return None
        row_len = _prod(last.dom()[n_s:])
        if row_len > MAX_ROW or _prod(infos[0].dom()[n_s:]) > MAX_ROW:
            return None
        loops = sch.get_loops(last.block_rv)
        if len(loops) != len(kind):
            return None
        inner_rows = int(last.dom()[n_s - 1])
        rows_per_cta = next(r for r in ROWS_PER_CTA if inner_rows % r == 0)

        # split the innermost row axis (not the fused rows): block bindings stay affine for compute_at
        row_o, ty = sch.split(loops[n_s - 1], [None, rows_per_cta])
        col = sch.fuse(*loops[n_s:])
        bx = sch.fuse(*loops[:n_s - 1], row_o)
        col_o, tx = sch.split(col, [None, WARP])
        sch.reorder(bx, ty, col_o, tx)
        sch.bind(bx, "blockIdx.x")
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.annotate(col_o, "pragma_auto_unroll_max_step", UNROLL)
        sch.annotate(col_o, "pragma_unroll_explicit", 1)

        n_r = len(kind) - n_s
        for info in reversed(infos[:-1]):
            block = info.block_rv
            for i, _ in enumerate(sch.get(block).writes):
                sch.set_scope(block, buffer_index=i, storage_scope=REDUCTION_SCOPE)
            sch.compute_at(block, bx, preserve_unit_loops=True)
            block_loops = sch.get_loops(block)[1:]          # under bx: the CTA's rows, then the row
            r_ty = sch.fuse(*block_loops[:-n_r])
            r_o, r_tx = sch.split(sch.fuse(*block_loops[-n_r:]), [None, WARP])
            sch.reorder(r_ty, r_tx, r_o)
            sch.bind(r_ty, "threadIdx.y")
            sch.bind(r_tx, "threadIdx.x")
            sch.annotate(r_o, "pragma_auto_unroll_max_step", UNROLL)
            sch.annotate(r_o, "pragma_unroll_explicit", 1)
        return sch
