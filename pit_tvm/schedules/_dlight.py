"""What pit_tvm's dlight rules (:mod:`.row_reduction`, :mod:`.elementwise`,
:mod:`.cpu_batched_matmul`, :mod:`.cpu_elementwise`) share: the blocks of a PrimFunc as dlight's analysis sees them, and
the static-shape test."""
from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial


def dlight_blocks(func, target, kind: str = "cuda", inline: bool = True):
    """``(schedule, block infos)`` of ``func`` after dlight's normalisation and (``inline``)
    inlining of contiguous spatial producers, or None when ``func`` is not a PrimFunc for a
    target of ``kind`` ("cuda", "llvm") or has no analysable blocks."""
    if not isinstance(func, tirx.PrimFunc) or target.kind.name != kind:
        return None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos and inline:
        infos = try_inline_contiguous_spatial(sch, infos)
    return (sch, infos) if infos else None


def is_static(extents) -> bool:
    return all(isinstance(e, (int, tirx.IntImm)) for e in extents)
