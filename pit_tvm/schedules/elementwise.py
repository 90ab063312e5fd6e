"""dlight rule for elementwise (injective) kernels with static shapes: vectorised accesses.

dlight's ``Fallback`` binds the fused iteration space to 1024-thread CTAs with one element per
thread: every load and store is a scalar of 2 bytes for fp16.  On the H100 the BERT-base
encoder's fused GELU over [4096, 3072] fp16 took ~52 us per layer, ~3x its HBM time.

This rule takes single-block injective functions whose block writes its output at exactly its
iteration variables (so the innermost iteration walks the output's contiguous axis) and whose
innermost extent is a multiple of ``VEC``::

    CTA  : THREADS threads                (blockIdx.x)
    thread: VEC consecutive output elements (threadIdx.x, vectorised inner loop)

Inputs read along the same axis become vector loads, so each such read must start on a ``VEC``
boundary (``A[..., w*64 + v]``: yes; a slice ``A[..., v + 1]``: no, the rule declines);
broadcast inputs stay scalar; a transposed input is gathered lane by lane.  Anything else
returns None (``Fallback`` then applies).  Registered in :func:`pit_tvm.target.cuda_schedule_rules` ahead of ``Fallback``.
"""
from __future__ import annotations

from tvm import sym, tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

from pit_tvm.schedules._dlight import dlight_blocks, is_static

#: elements per thread (half4 / float4: types the CUDA codegen has for every operation)
VEC = 4
THREADS = 256


def _reads_vectorise_aligned(block, inner) -> bool:
    """Every read indexed by the innermost iteration variable ``inner`` in its last dimension
    walks it with stride 1 from a ``VEC``-aligned start (vector loads are not misaligned);
    reads that use ``inner`` elsewhere (transposes) or not at all are loaded lane by lane."""
    analyzer = sym.Analyzer()
    for region in block.reads:
        if not region.region:
            continue                       # a 0-d buffer (a scalar, e.g. T5's Pow exponent): broadcast
        if any(not isinstance(r.extent, tirx.IntImm) or int(r.extent) != 1 for r in region.region):
            return False
        last = region.region[-1].min
        if (isinstance(last, tirx.FloorMod) and isinstance(last.b, tirx.IntImm)
                and int(last.b.value) % VEC == 0):
            last = last.a      # (v + base) % c, c a multiple of VEC: a vector never wraps
        coef_base = sym.detect_linear_equation(last, [inner])
        if len(coef_base) != 2 or not isinstance(coef_base[0], tirx.IntImm):
            return False                   # non-linear in inner (e.g. inner % 6): decline
        coef, base = int(coef_base[0]), coef_base[1]
        if coef == 0:
            continue
        shape = region.source.shape
        if (coef != 1 or not isinstance(shape[-1], tirx.IntImm) or int(shape[-1]) % VEC
                or not analyzer.can_prove(tirx.floormod(base, VEC) == 0)):
            return False
    return True


class VectorizedElementwise(GPUScheduleRule):
    """``VEC`` contiguous elements per thread for static-shape injective kernels."""

    def apply(self, func, target, _tunable):  # noqa: D102 - see the module docstring
        found = dlight_blocks(func, target)
        if found is None or len(found[1]) != 1:
            return None
        sch, (info,) = found
        if not info.is_injective() or not is_static(info.dom()):
            return None
        block = sch.get(info.block_rv)
        if len(block.writes) != 1:
            return None
        region = block.writes[0].region
        iters = [iv.var for iv in block.iter_vars]
        if len(region) != len(iters) or not all(
                isinstance(r.min, tirx.Var) and r.min.same_as(v) and int(r.extent) == 1
                for r, v in zip(region, iters)):
            return None
        if int(info.dom()[-1]) % VEC or not _reads_vectorise_aligned(block, iters[-1]):
            return None
        loops = sch.get_loops(info.block_rv)
        if len(loops) != len(iters):
            return None
        fused = sch.fuse(*loops)
        bx, tx, vec = sch.split(fused, [None, THREADS, VEC])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(vec)
        return sch
