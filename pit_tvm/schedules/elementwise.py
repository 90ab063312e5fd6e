"""dlight rule for elementwise (injective) kernels with static shapes: vectorised accesses.

dlight's ``Fallback`` binds the fused iteration space to 1024-thread CTAs with one element per
thread: every load and store is a scalar of 2 bytes for fp16, several times the HBM time of
a fused GELU (docs/design/measurements.md#dlight-rules).

This rule takes single-block injective functions whose block writes its output at exactly its
iteration variables (so the innermost iteration walks the output's contiguous axis) and whose
innermost extent is a multiple of ``VEC``::

    CTA  : THREADS threads                (blockIdx.x)
    thread: VEC consecutive output elements (threadIdx.x, vectorised inner loop)

Inputs read along the same axis become vector loads, so each such read must start on a ``VEC``
boundary (``A[..., w*64 + v]``: yes; a slice ``A[..., v + 1]``: no, the rule declines);
broadcast inputs stay scalar; a transposed input is gathered lane by lane.  Kernels that would
load or store ``bool`` vectors are declined: TVM's CUDA codegen types a ``bool`` x4 access
``ushort4``, an 8-byte access to 4 bytes at 4-byte offsets (``cudaErrorMisalignedAddress``, and
it writes past the output: the dynamo exports' ``attention_mask`` cast to bool, T5's mask).
So are selects (``where``) whose condition does not vary along the vector: TVM broadcasts the
condition to a ``bool`` x4 value it prints ``make_ushort4`` into a ``float4`` / ``half4``
variable, which nvcc rejects (Longformer's ``where(is_global[b, s], global, local)`` over heads).
Anything else returns None (``Fallback`` then applies).  Registered in
:func:`pit_tvm.target.cuda_schedule_rules` ahead of ``Fallback``.
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import DataType, sym, tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

from pit_tvm.schedules._dlight import dlight_blocks, is_static

#: elements per thread (half4 / float4: types the CUDA codegen has for every operation)
VEC = 4
THREADS = 256


def _has_vector_type(dtype) -> bool:
    """Whether CUDA code can load / store ``VEC`` lanes of ``dtype`` as one correctly sized
    vector: not ``bool`` (TVM prints a ``bool`` x4 access as ``ushort4``, twice its size) nor a
    sub-byte type."""
    return str(dtype) != "bool" and DataType(str(dtype)).bits % 8 == 0


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
        if (coef != 1 or not _has_vector_type(region.source.dtype)
                or not isinstance(shape[-1], tirx.IntImm) or int(shape[-1]) % VEC
                or not analyzer.can_prove(tirx.floormod(base, VEC) == 0)):
            return False
    return True


def _flat_reads_vectorise_aligned(block, inner, extent: int) -> bool:
    """The same question asked of each read's flattened (row-major) offset, with ``inner`` a
    vector's ``VEC * k + lane``: a read whose offset walks ``lane`` with stride 1 is loaded as a
    vector even where ``inner`` indexes an outer dim (``A[.., v, 0]`` of a ``[.., S, 1]``
    buffer: T5's bool mask), so its start must be ``VEC``-aligned and its dtype have a vector
    type; an offset that the analyzer cannot write as linear in ``lane`` is declined."""
    analyzer = sym.Analyzer()
    for iv in block.iter_vars:
        if not iv.var.same_as(inner):
            analyzer.bind(iv.var, iv.dom)
    dtype = str(inner.ty.dtype)
    k, lane = tirx.Var("k", dtype), tirx.Var("lane", dtype)
    analyzer.bind(k, tvm.ir.Range(0, extent // VEC))
    analyzer.bind(lane, tvm.ir.Range(0, VEC))
    analyzer.bind(inner, k * VEC + lane)     # simplify() substitutes it
    for region in block.reads:
        shape = region.source.shape
        if not region.region:
            continue                       # a 0-d buffer: broadcast
        if not is_static(shape):
            return False
        offset, stride = tirx.const(0, dtype), 1
        for dim, r in zip(reversed(shape), reversed(region.region)):
            index = r.min if str(r.min.ty.dtype) == dtype else tirx.Cast(dtype, r.min)
            offset, stride = offset + index * stride, stride * int(dim)
        offset = analyzer.simplify(offset)
        coef_base = sym.detect_linear_equation(offset, [lane])
        if len(coef_base) != 2 or not isinstance(coef_base[0], tirx.IntImm):
            return False
        if int(coef_base[0]) == 1 and (not _has_vector_type(region.source.dtype)
                                       or not analyzer.can_prove(tirx.floormod(coef_base[1], VEC) == 0)):
            return False
    return True


def _selects_vary_along(block, inner) -> bool:
    """Every select (``Select`` / ``if_then_else``) in the block's stored value has a condition
    that uses ``inner``: a condition constant along the vector is broadcast to a ``bool`` x4
    value whose CUDA declaration does not compile (``float4 v = make_ushort4(..)``)."""
    body = block.body
    if not isinstance(body, tirx.BufferStore):
        return False
    conditions = []

    def select_condition(node):
        if isinstance(node, tirx.Select):
            conditions.append(node.condition)
        elif str(getattr(node.op, "name", "")).endswith("if_then_else"):
            conditions.append(node.args[0])

    tvm_ffi.structural_walk(body.value, ((tirx.Select, tvm.ir.expr.Call), select_condition))
    return all(any(v.same_as(inner) for v in tirx.analysis.undefined_vars(c)) for c in conditions)


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
        if len(block.writes) != 1 or not _has_vector_type(block.writes[0].source.dtype):
            return None
        region = block.writes[0].region
        iters = [iv.var for iv in block.iter_vars]
        if len(region) != len(iters) or not all(
                isinstance(r.min, tirx.Var) and r.min.same_as(v) and int(r.extent) == 1
                for r, v in zip(region, iters)):
            return None
        extent = int(info.dom()[-1])
        if (extent % VEC or not _reads_vectorise_aligned(block, iters[-1])
                or not _flat_reads_vectorise_aligned(block, iters[-1], extent)
                or not _selects_vary_along(block, iters[-1])):
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
