"""dlight rule for small static fp16 matmuls on tensor cores (attention's batched matmuls).

dlight's ``Matmul`` puts an fp16 matmul on tensor cores (``MatmulTensorization``, wmma) only
when every non-batch extent is above 64; BERT's attention matmuls, ``[b, h, 128, 64] x
[b, h, 64, 128]`` and ``[b, h, 128, 128] x [b, h, 128, 64]``, have a 64 and so ran on CUDA
cores (docs/design/measurements.md#dlight-rules).

This rule hands static-shape fp16 matmuls whose output rows, columns and reduction are each
at least one wmma tile (16) to ``MatmulTensorization`` itself, which pads them to its CTA
tile (128 x 128 x 64).  Anything else returns None, and ``Matmul`` sees it next.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.s_tir.dlight.gpu.matmul import Matmul, MatmulTensorization, get_reduction_blocks

from pit_tvm.schedules._dlight import is_static
from pit_tvm.target import sm_version

#: the wmma tile: a smaller output or reduction extent is not worth a tensor-core tile
MIN_EXTENT = 16


class SmallMatmulTensorization(GPUScheduleRule):
    """``MatmulTensorization`` for the static fp16 matmuls ``Matmul`` keeps on CUDA cores."""

    def apply(self, func, target, tunable):  # noqa: D102 - see the module docstring
        if not isinstance(func, tirx.PrimFunc) or sm_version(target) < 70:
            return None
        sch = s_tir.Schedule(func)
        blocks = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
        if not blocks or len(blocks) != 1:
            return None
        block = sch.get(blocks[0])
        if len(block.reads) != 2 or len(block.writes) != 1:
            return None
        if any(str(r.source.dtype) != "float16" for r in block.reads):
            return None
        out_shape = list(block.writes[0].source.shape)
        reduction = [iv.dom.extent for iv in block.iter_vars if iv.iter_type == iv.CommReduce]
        if len(out_shape) < 2 or len(reduction) != 1 or not is_static(out_shape + reduction):
            return None
        if any(int(e) < MIN_EXTENT for e in out_shape[-2:] + reduction):
            return None
        return MatmulTensorization().apply(func, target, tunable)


class NumericArchMatmul(Matmul):
    """dlight's ``Matmul``, shown the CUDA arch without its feature suffix (``sm_90a`` ->
    ``sm_90``): dlight parses ``sm_90a`` as -1 and would then never try tensor cores (e.g. for
    matmuls with a symbolic extent, which :class:`SmallMatmulTensorization` leaves to it).
    The schedule it builds does not depend on the suffix."""

    def apply(self, func, target, tunable):  # noqa: D102
        version = sm_version(target)
        if version >= 0 and str(target.attrs["arch"]) != f"sm_{version}":
            target = tvm.target.Target({**target.export(), "arch": f"sm_{version}"})
        return super().apply(func, target, tunable)
