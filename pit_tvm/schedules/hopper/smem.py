"""Shared-memory layouts of the Hopper kernels: the swizzles wgmma's matrix descriptors and TMA
read and write, the descriptors' layout codes, and TMA tensor maps of a row-major operand.

128-byte swizzle: 16-byte chunk ``c`` of row ``r`` (8 chunks a row) lives at ``c ^ (r % 8)``;
the 64-byte swizzle (4 chunks a row) at ``c ^ ((r / 2) % 4)``.  TMA writes the swizzle it is
given from the shared-memory address, so a TMA box and a cp.async chunk land alike.
"""
from __future__ import annotations

from tvm.script import tirx as T

from pit_tvm.schedules.limits import dtype_bytes

#: wgmma's operand type names
PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}
#: ``encode_matrix_descriptor``'s codes for the 128- and 64-byte swizzles
SWIZZLE_128B = 3
SWIZZLE_64B = 2
#: TMA's 2-D tile load, completing on an mbarrier's transaction count
TMA_LOAD_2D = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
#: CUtensorMapSwizzle / CUtensorMapL2promotion codes
TMA_SWIZZLE_128B = 3
TMA_L2_PROMOTION_128B = 2


def swizzle_128b(chunk, row):
    """the 16-byte slot of ``chunk`` in a 128-byte-swizzled row ``row`` (8 chunks a row)"""
    return T.bitwise_xor(chunk, row % 8)


def swizzle_64b(chunk, row):
    """the 16-byte slot of ``chunk`` in a 64-byte-swizzled row ``row`` (4 chunks a row)"""
    return T.bitwise_xor(chunk, (row // 2) % 4)


def tma_map_encoder(dtype: str):
    """The host ``T.macro`` ``encode(tmap, data, cols, rows, box_cols, box_rows)``: the TMA
    descriptor of a row-major ``[rows, cols]`` operand of ``dtype``, boxes of box_rows x
    box_cols, 128-byte swizzle."""

    @T.macro
    def encode_tma_map(tmap, data, cols, rows, box_cols, box_rows):
        T.tensormap_encode_tiled(tmap, data, cols, rows, cols * dtype_bytes(dtype), box_cols, box_rows, 1, 1,
                                 descriptor_dtype=dtype, rank=2, interleave=0, swizzle=TMA_SWIZZLE_128B,
                                 l2_promotion=TMA_L2_PROMOTION_128B, oob_fill=0, force_cu_dtype=-1)

    return encode_tma_map


def k_major_strides(row_elems: int) -> tuple[int, int]:
    """wgmma descriptor (LBO, SBO) in 16-byte units of a K-major 2-byte operand whose swizzled
    rows hold ``row_elems`` elements: 8-row groups ``8 * row bytes`` apart (SBO); LBO unused"""
    return 1, 8 * row_elems * 2 // 16


def mn_major_strides(k_rows: int) -> tuple[int, int]:
    """wgmma descriptor (LBO, SBO) in 16-byte units of an MN-major 2-byte operand of ``k_rows``
    rows in 64-column atoms, 128-byte swizzle: atoms ``k_rows * 128`` B apart (LBO), 8-row
    groups 1024 B apart (SBO)"""
    return k_rows * 128 // 16, 1024 // 16
