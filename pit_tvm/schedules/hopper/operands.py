"""What a GEMM tile works on, as two named groups the tile ``T.macro`` takes instead of one
parameter each: the kernel's global buffers (:class:`TileOperands`) and a thread's registers
(:class:`TileRegisters`).  Bound in the kernel body with ``T.meta_var`` and unpacked in the
macro by :meth:`unpacked`, so no buffer is bound (and renamed) a second time."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tvm.script import tirx as T


class Unpacked:
    """a group of macro operands bound once with ``T.meta_var`` (a base of such dataclasses)"""

    def unpacked(self):
        """the fields, to unpack in a ``T.macro`` (as meta values: no buffer is renamed)"""
        return tuple(T.meta_var(getattr(self, f.name)) for f in fields(self))


@dataclass(frozen=True)
class TileOperands(Unpacked):
    """A GEMM tile's global buffers (those its variant does not take go unused): A, B, the
    index (``OFF``: offsets, ``IDS``: ids), the epilogue's bias, row scale and residual, C, and
    a strips listing's state, counts, strip ids and compacted C; a gated grouped GEMM's second
    weight (W3) and its bias"""

    A: Any
    B: Any
    OFF: Any
    IDS: Any
    BIAS: Any
    RS: Any
    RES: Any
    C: Any
    ST: Any
    CNT: Any
    SIDS: Any
    AC: Any
    B3: Any
    BIAS3: Any


@dataclass(frozen=True)
class TileRegisters(Unpacked):
    """A GEMM thread's registers (local arrays): the accumulators; the A rows it copies and C
    rows it stores; its fragment rows' scales; its residual chunks; the tiles kind's A columns
    and B rows of this K tile and the next; the wgmma descriptors; a strips listing's values"""

    acc: Any
    a_row: Any
    c_row: Any
    rs_val: Any
    res_v: Any
    a_col: Any
    b_row_id: Any
    a_col_next: Any
    b_row_next: Any
    desc_a: Any
    desc_b: Any
    orw: Any
    ballot: Any
    sloc: Any
    old: Any
