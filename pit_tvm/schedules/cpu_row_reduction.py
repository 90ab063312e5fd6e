"""dlight rule for the CPU: row reductions with static shapes (softmax, layer norm and what is
fused with them), which no TVM 0.27 CPU rule schedules.

Why: LegalizeOps leaves softmax and layer norm as serial scalar loops over whole tensors, each
stage writing a full-size intermediate (attention's softmax over 16 x 12 x 128 x 128 scores
was one serial pass per stage).  The rule takes a function whose blocks all share the same
leading "row" dimensions, each block either reducing over one last axis, spanning it, or
being a per-row scalar, and maps::

    parallel rows                          (the output's leading dims, fused)
      per reduction:  acc[VEC] over the row in VEC-lane chunks (rfactor), then the VEC lanes
      per row-wide stage:  vectorised over the row
      per-row scalars (mean, ...)

so every intermediate is one row (or one scalar) per task and the reductions are vectorised
without reassociating beyond VEC partial sums.  Anything else returns None.
"""
from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

from pit_tvm.schedules._dlight import dlight_blocks, is_static

#: partial sums per reduction (16 fp32 = one AVX-512 register)
VEC = 16


def _row_shape(info, rows: int):
    """The block's leading ``rows`` extents, or None when its iteration space is not
    ``rows`` spatial dims, then at most one more (spatial or reduction)."""
    kind, dom = info.dom_kind(), info.dom()
    if len(kind) not in (rows, rows + 1) or kind[:rows] != "S" * rows or not is_static(dom):
        return None
    return [int(e) for e in dom[:rows]]


class CPURowReduction(CPUScheduleRule):
    """Row-parallel, vectorised schedule for static row reductions (softmax, layer norm)."""

    def apply(self, func, target, _tunable):  # noqa: D102 - see the module docstring
        # each stage once per row first (inlined, softmax's exp ran twice: for the sum and the
        # normalisation), then with dlight's inlining of spatial stages
        for inline in (False, True):
            found = dlight_blocks(func, target, "llvm", inline=inline)
            sch = _schedule(*found) if found is not None else None
            if sch is not None:
                return sch
        return None


def _schedule(sch, infos):
    """The row schedule of ``infos``' blocks, or None where they are not row stages alike."""
    if len(infos) < 2 or not any("R" in info.dom_kind() for info in infos):
        return None
    out = infos[-1]
    rows = len(out.dom_kind()) - 1
    if rows < 1 or out.dom_kind() != "S" * (rows + 1):
        return None
    shape = _row_shape(out, rows)
    if shape is None or any(_row_shape(info, rows) != shape for info in infos):
        return None
    try:
        blocks = [info.block_rv for info in infos]
        reductions = [info.block_rv for info in infos if "R" in info.dom_kind()]
        partials = []
        for block in reductions:
            k = sch.get_loops(block)[-1]
            extent = int(sch.get(k).extent)
            if extent % VEC:
                return None
            _, lanes = sch.split(k, [None, VEC])
            partials.append((sch.rfactor(lanes, rows), block))
        row = sch.fuse(*sch.get_loops(out.block_rv)[:rows])
        sch.parallel(row)
        order = [b for block in blocks for b in ([p for p, r in partials if r.same_as(block)] + [block])]
        for block in reversed(order[:-1]):
            sch.compute_at(block, row)
        for block in order:
            inner = sch.get_loops(block)[1:]
            if not inner:
                continue
            if any(p.same_as(block) for p, _ in partials):
                # compute_at made the loops in block-var order (lanes, chunks): chunks outside
                if len(inner) > 1 and sch.get(block).iter_vars[-1].iter_type != tirx.IterVar.DataPar:
                    sch.reorder(inner[-1], inner[-2])
                    inner = sch.get_loops(block)[1:]
                sch.vectorize(inner[-1])           # the VEC partial sums
                init = sch.decompose_reduction(block, inner[0])
                sch.vectorize(sch.get_loops(init)[-1])
            elif all(iv.iter_type == tirx.IterVar.DataPar for iv in sch.get(block).iter_vars):
                sch.vectorize(inner[-1])
    except s_tir.ScheduleError:
        return None
    return sch
