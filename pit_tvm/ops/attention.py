"""The fused attention op for Relax graphs: ``softmax(q @ k^T * scale + mask) @ v`` as one
``call_tir`` of :func:`pit_tvm.schedules.attention.fused_attention_func` (sm_90a)."""
from __future__ import annotations

from tvm import relax, tirx

from pit_tvm.target import DEFAULT_CUDA_ARCH, is_gpu, make_target

__all__ = ["emit_fused_attention"]


def _static(shape):
    if shape is None or not all(isinstance(d, tirx.IntImm) for d in shape):
        return None
    return [int(d) for d in shape]


def emit_fused_attention(bb: relax.BlockBuilder, q, k, v, mask, scale: float, target="cuda",
                         packed=None, out_packed: bool = False, row_scale=None):
    """Emit the fused attention of ``q, k, v`` (``[B, H, S, D]``, static) with the additive
    ``mask`` (``[1 or B, 1, 1, S]``) into ``bb``; return the ``[B, H, S, D]`` result, or None
    when the kernel does not apply (not sm_90a, symbolic or unsupported sizes, dtypes): the
    caller keeps the unfused graph then.

    ``packed``: ``((Xq, oq), (Xk, ok), (Xv, ov))``, ``[B, S, W]`` tensors whose columns
    ``o + h * D ..`` are head h of q, k, v, read in their place (``q, k, v`` then only give
    the shapes); ``out_packed``: return ``[B, S, H * D]`` instead (heads merged);
    ``row_scale`` (with ``out_packed``): ``[B, S, 1]`` of the mask's dtype, multiplying each
    query row of that result."""
    from pit_tvm.schedules.attention import attention_applies, fused_attention_func

    target = make_target(target)
    if not is_gpu(target):
        return None
    arch = str(target.attrs.get("arch", DEFAULT_CUDA_ARCH))
    shapes = [_static(getattr(x.ty, "shape", None)) for x in (q, k, v, mask)]
    if any(s is None or len(s) != 4 for s in shapes):
        return None
    (bq, hq, sq, dq), k_shape, v_shape, (mb, m1, m2, ms) = shapes
    dtype = str(q.ty.dtype)
    if (k_shape != [bq, hq, sq, dq] or v_shape != [bq, hq, sq, dq] or (m1, m2, ms) != (1, 1, sq)
            or str(k.ty.dtype) != dtype or str(v.ty.dtype) != dtype
            or not str(mask.ty.dtype).startswith(("float", "bfloat"))
            or not attention_applies(bq, hq, sq, dq, dtype, mb, arch)):
        return None
    inputs, layout = [q, k, v], None
    if packed is not None:
        sources = [_static(getattr(x.ty, "shape", None)) for x, _ in packed]
        if not all(s is not None and len(s) == 3 and s[:2] == [bq, sq] and str(x.ty.dtype) == dtype
                   and o % 8 == 0 and s[2] % 8 == 0 and o + hq * dq <= s[2]
                   for s, (x, o) in zip(sources, packed)):
            return None
        inputs, layout = [x for x, _ in packed], tuple((s[2], int(o)) for s, (_, o) in zip(sources, packed))
    if row_scale is not None and (not out_packed or _static(getattr(row_scale.ty, "shape", None)) != [bq, sq, 1]
                                  or str(row_scale.ty.dtype) != str(mask.ty.dtype)):
        return None
    func = fused_attention_func(bq, hq, sq, dq, float(scale), dtype, str(mask.ty.dtype), mb,
                                packed=layout, out_packed=out_packed, row_scale=row_scale is not None)
    name = (f"fused_attention_b{bq}_h{hq}_s{sq}_d{dq}_{dtype}" + ("_packed" if layout else "")
            + ("_merged" if out_packed else "") + ("_rowscale" if row_scale is not None else ""))
    gv = bb.add_func(func.with_attr("global_symbol", name), name)
    out_shape = [bq, sq, hq * dq] if out_packed else [bq, hq, sq, dq]
    args = inputs + [mask] + ([row_scale] if row_scale is not None else [])
    return bb.emit(relax.call_tir(gv, args, relax.TensorType(out_shape, dtype)))
