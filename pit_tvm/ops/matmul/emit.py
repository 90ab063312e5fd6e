"""The PIT matmul and its dense twin as Relax: what the compiler emits for a model's matmul
(:func:`emit_pit_matmul`, :func:`emit_dense_matmul`) and what :class:`~.op.SparseMatmul` runs.

:func:`emit_pit_matmul` asks :mod:`.backends` for the kernels of its plan, then emits the index
build (or the one-pass strips index), the SRead compaction where one runs apart, the kernel
(and a rows kernel's few-rows tiers, a tiles kernel's dense fallback, each in place on C), and
the epilogue the kernel does not run as Relax ops.
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
from tvm import tirx

from pit_tvm.target import cuda_arch, is_gpu, make_target

from .backends import (TENSOR_CORE_DTYPES, KernelRequest, _cuda_dense_kernel, _say_if_log_unused,
                       _wgmma_rows_tiers, choose_kernels)
from .derived import dense_matmul_func
from .epilogue import Epilogue, emit_epilogue, is_row_scale, row_scaled_input, wgmma_epilogue_applies
from .plan import (MatmulPlan, effective_density_threshold, expected_rows, planned_density, tensor_core_plan,
                   validate)

#: what the CPU dense twin takes (fp32 accumulation; LLVM computes fp16 in fp32 too)
CPU_DENSE_DTYPES = ("float32", "float16")
#: Relax's ``kOpaque`` operator pattern (``op_pattern`` attr): FuseOps leaves the call alone
OPAQUE_OP_PATTERN = 8


def emit_pit_matmul(bb, a, b, *, micro_tile=(1, 64), target="llvm", out_dtype=None, density_threshold=0.9,
                    tuning_log=None, tensor_core_only=True, row_mask=None, bias=None, activation=None,
                    row_scale=None, residual=None, expected_density=None):
    """Emit the PIT matmul of ``a @ b`` into a Relax ``BlockBuilder``; return the result expr.

    ``a``: ``[..., K]`` (leading dims symbolic or static, flattened to M rows), ``b``: ``[K, N]``
    with static K, N. Emits ``call_tir`` of the index build (which applies the device-side dense
    fallback) and of the PIT kernel; no value is read on the host. ``tuning_log``:
    a MetaSchedule log whose best schedule the tensor-core kernel uses (``pit-tvm tune``).
    ``tensor_core_only`` (CUDA): raise ValueError when no tensor-core kernel fits (a model
    then keeps the dense dlight kernel); False takes the SIMT PIT kernel instead.
    ``row_mask``: for whole-row micro-tiles, a tensor with one value per row of ``a``
    (``a``'s leading shape + ``[1]``) that is zero wherever ``a``'s row is; the rows index is
    then built from it (M elements read instead of M x K, and the same call for every matmul
    the mask guards, so common-subexpression elimination builds it once).
    ``bias`` (``[N]``), ``activation`` (None, "relu", "gelu"), ``row_scale`` (``a``'s leading
    shape + ``[1]``), ``residual`` (the result's shape, after a bias alone): an epilogue
    ``act(a @ b + bias) * row_scale + residual``, in the kernel where it takes one (the wgmma
    rows kernel: rows the index skips get the value of a zero row, ``act(bias) * row_scale +
    residual``; the wgmma tiles kernels: a bias, then a residual), else as Relax ops after it.
    ``expected_density``: the fraction of a static M's rows the index is expected to list
    (default :data:`PIT_EXPECTED_DENSITY`); the CUDA rows kernel's tile width is planned for
    it (the count itself is only known on the device).  Measure it on a sample of the traffic.
    """
    from tvm import relax

    from pit_tvm.index import tile_index_func

    a_ty, b_ty = a.ty, b.ty
    if len(b_ty.shape) != 2 or not all(isinstance(d, tirx.IntImm) for d in b_ty.shape):
        raise ValueError(f"PIT matmul needs a 2-D B with static shape, got {b_ty.shape}")
    k, n = (int(d) for d in b_ty.shape)
    dtype = str(a_ty.dtype)
    validate(k, n, dtype, micro_tile)
    out_dtype = str(out_dtype or dtype)
    if int(a_ty.shape[-1]) != k:
        raise ValueError(f"A's last dimension {a_ty.shape[-1]} does not match B's K={k}")
    a2, m, lead = _as_rows(bb, a, k)
    plan = MatmulPlan(k, n, tuple(int(x) for x in micro_tile))
    tgt = make_target(target)
    _say_if_log_unused(tuning_log, plan, tgt)
    density = planned_density(expected_density)
    epilogue = Epilogue(bias, activation, row_scale, residual)
    # the wgmma tiles kernels' epilogue: a bias, then a residual (an FFN's fc2 and its skip)
    tiles_epilogue = epilogue.bias_and_residual()
    if not (is_gpu(tgt) and plan.kind != "rows" and tiles_epilogue is not None
            and tiles_epilogue.runs_in_wgmma(k, n, dtype, out_dtype, tgt, a_ty)):
        tiles_epilogue = None
    chosen = choose_kernels(KernelRequest(plan, dtype, out_dtype, tgt, tuning_log, rows=_static_rows(m),
                                          density=density, tiles_epilogue=tiles_epilogue,
                                          tensor_core_only=tensor_core_only))
    if chosen is None and plan.kind == "rows" and plan.micro_tile[0] == 1:
        padded = _padded_rows_shape(k, n, dtype, out_dtype, tgt, m, density)
        if padded is not None:
            # K, N fit no tensor-core tile: the kernel of the padded shape (B padded with zero
            # rows and columns at build time, A with zero columns per call), C sliced back to N
            k2, n2 = padded
            c = emit_pit_matmul(bb, _zero_padded(bb, a, [k2 - k]), _zero_padded(bb, b, [k2 - k, n2 - n]),
                                micro_tile=(1, k2), target=tgt, out_dtype=out_dtype,
                                density_threshold=density_threshold, tuning_log=tuning_log, row_mask=row_mask,
                                expected_density=expected_density)
            c = bb.emit(relax.op.strided_slice(c, axes=[len(a_ty.shape) - 1], begin=[0], end=[n]))
            return epilogue.emit_after(bb, c)
    if chosen is None:
        # In a model the dense alternative is dlight's kernel; the SIMT PIT kernel only wins
        # at extreme sparsity, so without a tensor-core kernel the matmul stays dense.
        raise ValueError(f"no tensor-core PIT kernel for {dtype} K={k} N={n} micro-tile "
                         f"{plan.micro_tile[0]}x{plan.micro_tile[1]} (needs fp16/bf16 and tile-aligned K, N)")
    if chosen.backend == "simt" and tensor_core_plan(plan) is not None and dtype in TENSOR_CORE_DTYPES:
        # (any K, N: the tensor-core kernels need them tile-aligned)
        warnings.warn(f"no tensor-core PIT kernel fits {dtype} K={k} N={n} (tile-aligned K, N "
                      f"needed): the SIMT kernel runs it, correct but slower", stacklevel=2)
    plan, kernel = chosen.plan, chosen.kernel        # (the index is built for the kernel's micro-tile)
    # where the epilogue runs in the kernel: the wgmma tiles kernels (a bias, a residual), the
    # wgmma rows kernel (the whole chain); else as Relax ops after it
    in_kernel = chosen.tiles_epilogue
    masks, scaled, few_rows_kernels = False, None, []
    if chosen.backend == "wgmma.rows":
        in_kernel = epilogue.runs_in_wgmma(k, n, dtype, out_dtype, tgt, a_ty)
        if in_kernel:
            # a row scale that is the index's row mask is zero on every row the index skips
            masks = row_scale is not None and row_mask is not None and row_scale.same_as(row_mask)
            # A = x * the index's row mask: the kernel reads x and scales its product's rows (the
            # row-scale parameter is that mask; a residual's kernel variants take no row scale)
            if (row_mask is not None and residual is None and (row_scale is None or masks)
                    and is_row_scale(row_mask, a_ty)):
                scaled = row_scaled_input(bb, a, a_ty, row_mask)
            if scaled is not None:
                a2, m, lead = _as_rows(bb, scaled[0], k)
        kernel, few_rows_kernels = _wgmma_rows_tiers(
            k, n, dtype, out_dtype, expected_rows(m, density), kernel,
            **(_wgmma_rows_epilogue(epilogue, masks, scaled is not None) if in_kernel else {}))
    density_threshold = effective_density_threshold(density_threshold, chosen.dense_on_full_index)
    mr, mc = plan.index_micro_tile
    groups, capacity = plan.index_sizes(m)
    tag = f"{mr}x{plan.micro_tile[1]}_k{k}_n{n}_{dtype}"

    dens_tag = "" if density_threshold is None else f"_d{int(round(float(density_threshold) * 1000))}"
    if row_mask is not None and plan.kind == "rows":
        index_gv, index_src = _row_mask_index(bb, row_mask, m, tgt, density_threshold, dens_tag)
    elif chosen.strips:
        index_gv = index_src = None     # the one-pass index (_emit_strips)
    else:
        index_gv = add_once(bb, f"pit_index_{tag}{dens_tag}", lambda: tile_index_func(
            k, (mr, mc), plan.index_group, dtype, tgt, density_threshold=density_threshold))
        index_src = a2
    # the micro-tile the index is built for (a tensor-core plan may cover a thinner one)
    # a static row count is part of the name: the kernel's tile width may depend on it
    name = (f"pit_kernel_{tag}" + (epilogue.tag if in_kernel else "")
            + ("_masked" if masks else "") + ("_ascale" if scaled is not None else "")
            + (f"_m{int(m)}" if isinstance(m, (int, tirx.IntImm)) and is_gpu(tgt) else ""))
    kernel_gv = bb.add_func(kernel.with_attr("pit.micro_tile", [int(x) for x in plan.micro_tile])
                            .with_attr("global_symbol", name), name)
    a_in = a2
    if chosen.strips:   # the index, and the SRead of thin micro-tiles, in one pass over A
        offsets, ids, a2 = _emit_strips(bb, a2, m, k, plan.micro_tile[1], dtype, density_threshold,
                                        f"{tag}{dens_tag}")
    else:
        index = _emit_index(bb, index_gv, index_src, groups, capacity)
        offsets, ids = bb.emit(relax.TupleGetItem(index, 0)), bb.emit(relax.TupleGetItem(index, 1))
    if chosen.compact is not None:   # SRead of thin micro-tiles as a kernel of its own
        compact_gv = add_once(bb, f"pit_compact_{tag}", lambda: chosen.compact)
        a2 = bb.emit(relax.call_tir(compact_gv, [a2, offsets, ids], relax.TensorType([m, k], dtype)))
    epilogue_args = (epilogue.kernel_args(bb, m, n, dtype, None if scaled is None else scaled[1])
                     if in_kernel else [])
    c = bb.emit(relax.call_tir(kernel_gv, [a2, b, offsets, ids] + epilogue_args, relax.TensorType([m, n], out_dtype)))
    for tier, few_rows_kernel in enumerate(few_rows_kernels):
        # a few-rows tier writes C in place when its row count skipped the kernels before it
        few_gv = add_once(bb, name.replace("pit_kernel_", f"pit_few_rows{tier}_"),
                           lambda few_rows_kernel=few_rows_kernel: few_rows_kernel)
        c = bb.emit(relax.call_tir_inplace(few_gv, [a2, b, offsets, ids] + epilogue_args + [c], [4 + len(epilogue_args)],
                                           relax.TensorType([m, n], out_dtype)))
    if chosen.dense_fallback is not None:
        # a full index (the device-side dense fallback, or a dense pattern): the tiles kernel
        # and the compaction skipped their work, the dense kernel writes C in place
        fallback_gv = add_once(bb, name.replace("pit_kernel_", "pit_dense_fallback_"), lambda: chosen.dense_fallback)
        c = bb.emit(relax.call_tir_inplace(fallback_gv, [a_in, b, offsets] + epilogue_args + [c],
                                           [3 + len(epilogue_args)], relax.TensorType([m, n], out_dtype)))
    c = _from_rows(bb, c, lead, n)
    return c if in_kernel else epilogue.emit_after(bb, c)


#: the multiples K and N are padded to, in this order, where no tensor-core rows kernel fits
#: them as they are (the wgmma tiles are 64 deep and 64-256 wide; mma.sync's 32 deep, 64-256 wide)
TENSOR_CORE_PADDINGS = ((64, 64), (64, 128), (64, 256))


def _padded_rows_shape(k, n, dtype, out_dtype, target, m, density):
    """``(K', N')``, the smallest padding of :data:`TENSOR_CORE_PADDINGS` for which a
    tensor-core kernel runs whole rows on CUDA, or None (not CUDA, not fp16 / bf16, none fits)."""
    if not is_gpu(target) or dtype not in TENSOR_CORE_DTYPES:
        return None
    for k_multiple, n_multiple in TENSOR_CORE_PADDINGS:
        k2, n2 = -(-k // k_multiple) * k_multiple, -(-n // n_multiple) * n_multiple
        request = KernelRequest(MatmulPlan(k2, n2, (1, k2)), dtype, out_dtype, target, rows=_static_rows(m),
                                density=density, tensor_core_only=True)
        if (k2, n2) != (k, n) and choose_kernels(request) is not None:
            return k2, n2
    return None


def _zero_padded(bb, x, trailing):
    """``x`` with zeros after its last ``len(trailing)`` dims (``trailing[i]`` more along each): a
    constant is padded now (a weight, at build time), any other tensor by a Relax ``pad``."""
    import tvm
    from tvm import relax

    widths = [(0, 0)] * (len(x.ty.shape) - len(trailing)) + [(0, int(t)) for t in trailing]
    if isinstance(x, tvm.ir.GenericConst):     # (bfloat16 through ml_dtypes)
        return relax.const(np.pad(x.value.numpy(), widths), str(x.ty.dtype))
    return bb.emit(relax.op.nn.pad(x, [w for pair in widths for w in pair]))


def _static_rows(m) -> int | None:
    """a static row count as an int, None for a symbolic one"""
    return int(m) if isinstance(m, (int, tirx.IntImm)) else None


def _wgmma_rows_epilogue(epilogue: Epilogue, masks: bool, scales_a: bool) -> dict:
    """the epilogue keywords of :func:`pit_tvm.schedules.wgmma.wgmma_row_gather_func` for
    ``epilogue`` in the kernel: ``masks``, its row scale is the index's row mask (zero on every
    row the index skips); ``scales_a``, the kernel scales A's rows (A = x * the row mask)."""
    flags = dict(bias=True, relu=epilogue.activation == "relu", gelu=epilogue.activation == "gelu",
                 row_scale=epilogue.row_scale is not None, row_scale_masks=masks,
                 residual=epilogue.residual is not None)
    return dict(flags, row_scale_a=True) if scales_a else flags


def emit_dense_matmul(bb, a, b, *, target="cuda", out_dtype=None, bias=None, activation=None, row_scale=None,
                      residual=None):
    """Emit ``a @ b`` on the dense kernel the PIT kernels are measured against into a Relax
    ``BlockBuilder``; return the result expr, or None when it does not apply (``b`` not a
    static 2-D tensor; on CUDA not fp16/bf16 or no tile config fits K, N): the caller keeps
    its matmul then.

    CUDA: the tensor-core kernel (:func:`pit_tvm.schedules.tensorcore.schedule_dense_matmul`,
    the PIT kernels' tiles); ``bias`` (a ``[N]`` tensor of ``a``'s dtype), ``activation``
    (None, "relu" or "gelu") and ``row_scale`` (``a``'s leading shape + ``[1]``, after the
    activation; needs a bias) and ``residual`` (the result's shape and dtype, after a bias
    alone) run in the kernel's epilogue; an epilogue the kernel does not take also returns
    None.  CPU: the PIT CPU kernel's dense twin (:func:`dense_matmul_func`), the epilogue as
    Relax ops after it (:func:`emit_epilogue`)."""
    from tvm import relax

    from pit_tvm.schedules.limits import IN_DTYPES, OUT_DTYPES

    target = make_target(target)
    kn = _weight_matmul_shape(a, b)
    if kn is None:
        return None
    k, n = kn
    if not is_gpu(target):
        return _emit_cpu_dense_matmul(bb, a, b, k, n, target, out_dtype, bias, activation, row_scale, residual)
    a_ty = a.ty
    dtype, out_dtype = str(a_ty.dtype), str(out_dtype or a_ty.dtype)
    if dtype not in IN_DTYPES or out_dtype not in OUT_DTYPES:
        return None
    if bias is not None:
        b_shape = getattr(bias.ty, "shape", None)
        if (str(getattr(bias.ty, "dtype", "")) != dtype or b_shape is None or len(b_shape) != 1
                or not isinstance(b_shape[0], tirx.IntImm) or int(b_shape[0]) != n):
            return None
    lead_dims = [a_ty.shape[i] for i in range(len(a_ty.shape) - 1)]
    rows = (functools.reduce(lambda x, y: x * y, (int(d) for d in lead_dims), 1)
            if all(isinstance(d, tirx.IntImm) for d in lead_dims) else None)
    if (row_scale is not None or residual is not None) and (bias is None or not wgmma_epilogue_applies(
            k, n, dtype, out_dtype, target, bias, activation, row_scale, residual, a_ty)):
        return None
    # A = x * s, s a row scale (the row_scale, or without one any [..., 1] tensor the kernel
    # takes): the kernel reads x and scales its product's rows, before the bias
    scaled = (row_scaled_input(bb, a, a_ty, row_scale) if bias is not None and residual is None else None)
    if scaled is not None and row_scale is None and not wgmma_epilogue_applies(
            k, n, dtype, out_dtype, target, bias, activation, scaled[1], None, a_ty):
        scaled = None
    kernel = _cuda_dense_kernel(k, n, dtype, out_dtype, bias is not None, activation,
                                cuda_arch(target), rows, row_scale is not None, residual is not None,
                                scaled is not None)
    if kernel is None:
        return None
    a2, m, lead = _as_rows(bb, a if scaled is None else scaled[0], k)
    epilogue = Epilogue(bias, activation, row_scale, residual)
    # rows is part of the name: the tile width may depend on it
    name = (f"tc_dense_matmul_k{k}_n{n}_{dtype}_{out_dtype}"
            f"{epilogue.tag}{'_ascale' if scaled is not None else ''}"
            f"{f'_m{rows}' if rows else ''}")
    gv = bb.add_func(kernel.with_attr("global_symbol", name), name)
    # (the row-scale parameter: the row scale, or the scale of A's rows; one tensor where both)
    args = [a2, b] + epilogue.kernel_args(bb, m, n, dtype, None if scaled is None else scaled[1])
    c = bb.emit(relax.call_tir(gv, args, relax.TensorType([m, n], out_dtype)))
    return _from_rows(bb, c, lead, n)


def _weight_matmul_shape(a, b):
    """``(K, N)`` when ``a @ b`` is ``[..., K] @ [K, N]`` with ``b`` a 2-D tensor of static
    shape and ``a``'s dtype (a layer's weight), K static; else None."""
    from tvm import relax

    a_ty, b_ty = a.ty, b.ty
    if not isinstance(a_ty, relax.TensorType) or not isinstance(b_ty, relax.TensorType):
        return None
    if a_ty.shape is None or b_ty.shape is None or len(b_ty.shape) != 2 or len(a_ty.shape) < 2:
        return None
    if not all(isinstance(d, tirx.IntImm) for d in b_ty.shape) or str(b_ty.dtype) != str(a_ty.dtype):
        return None
    k, n = (int(d) for d in b_ty.shape)
    last = a_ty.shape[-1]
    return (k, n) if isinstance(last, tirx.IntImm) and int(last) == k else None


def _emit_cpu_dense_matmul(bb, a, b, k, n, target, out_dtype, bias, activation, row_scale, residual):
    """:func:`emit_dense_matmul` on the CPU (``a @ b`` of :func:`_weight_matmul_shape` K, N):
    the dense twin of the PIT CPU schedule (the same loops without SRead / SWrite), so that PIT
    and PIT-off builds share the dense kernel (TVM leaves a CPU matmul as LegalizeOps'
    unscheduled loops)."""
    from tvm import relax

    dtype, out_dtype = str(a.ty.dtype), str(out_dtype or a.ty.dtype)
    if dtype not in CPU_DENSE_DTYPES or out_dtype not in CPU_DENSE_DTYPES:
        return None
    epilogue_dtypes = {str(x.ty.dtype) for x in (bias, row_scale, residual) if x is not None}
    if epilogue_dtypes - {out_dtype}:     # (the Relax ops after the kernel add in its dtype)
        return None
    name = f"cpu_dense_matmul_k{k}_n{n}_{dtype}_{out_dtype}"
    # (opaque to FuseOps: fused with the ops after it, the kernel's symbolic-M buffers meet
    # their static-shaped arguments and FuseTIR fails: "inconsistent buffers")
    func = dense_matmul_func(k, n, dtype, out_dtype, target).with_attrs(
        {"global_symbol": name, "op_pattern": OPAQUE_OP_PATTERN})
    gv = bb.add_func(func, name)
    a2, m, lead = _as_rows(bb, a, k)
    c = bb.emit(relax.call_tir(gv, [a2, b], relax.TensorType([m, n], out_dtype)))
    return emit_epilogue(bb, _from_rows(bb, c, lead, n), bias, activation, row_scale, residual)


def _as_rows(bb, a, k):
    """``a[..., k]`` as the 2-D ``[M, k]`` the kernels take: ``(a2, M, leading dims)``."""
    from tvm import relax

    lead = list(a.ty.shape)[:-1]
    m = tirx.const(1, "int64")
    for d in lead:
        m = m * (d if str(d.ty.dtype) == "int64" else tirx.Cast("int64", d))
    return (bb.emit(relax.op.reshape(a, [m, k])) if len(lead) != 1 else a), m, lead


def _from_rows(bb, c, lead, n):
    """The kernel's ``c[M, n]`` back in ``a``'s leading dims."""
    from tvm import relax

    return bb.emit(relax.op.reshape(c, lead + [n])) if len(lead) != 1 else c


def _row_mask_index(bb, row_mask, m, target, density_threshold, dens_tag):
    """(index PrimFunc, its ``[M, 1]`` input) listing the rows where ``row_mask`` is non-zero:
    the rows-index layout (one group: ``ids`` the listed rows, then the others) of a ``[M, K]``
    operand."""
    from tvm import relax

    from pit_tvm.index import tile_index_func
    from pit_tvm.index.tiles import SUPPORTED_DTYPES as INDEX_DTYPES

    mask = bb.emit(relax.op.reshape(row_mask, [m, 1]))
    dtype = str(mask.ty.dtype)
    if dtype not in INDEX_DTYPES:  # integer masks: float32 keeps every non-zero value non-zero
        mask, dtype = bb.emit(relax.op.astype(mask, "float32")), "float32"
    index_gv = add_once(bb, f"pit_row_index_{dtype}{dens_tag}", lambda: tile_index_func(
        1, (1, 1), "col", dtype, target, density_threshold=density_threshold))
    return index_gv, mask


def _emit_index(bb, index_gv, index_src, groups, capacity):
    """Call the index PrimFunc ``index_gv`` on ``index_src``: the ``(offsets, ids)`` tuple.  A
    one-group CUDA index (:func:`pit_tvm.index.index_state`) also takes its counter: a zero
    constant of the model, which the kernel uses and leaves zero (so the graph sees an input
    that does not change; a per-call ``R.zeros`` would be folded into such a constant by the
    build anyway).  Runs of one compiled model therefore must not overlap on two streams."""
    from tvm import relax

    from pit_tvm.index import index_state

    index_ty = [relax.TensorType([groups + 1], "int32"), relax.TensorType([capacity], "int32")]
    state = index_state(bb.get()[index_gv])
    counter = [] if state is None else [relax.const(np.zeros(*state), state[1])]
    return bb.emit(relax.call_tir(index_gv, [index_src] + counter, index_ty))


def _emit_strips(bb, a, m, k, mk, dtype, density_threshold, tag):
    """The one-pass index (+ A compaction) for ``(128, mk)`` micro-tiles: ``(offsets, ids, A
    for the tiles kernel)``.  Its per-strip counter must be zero: with a static row count a
    zero constant of the model, which the kernel leaves zero (as :func:`_emit_index`'s); with a
    symbolic one a zeroed tensor per call."""
    from tvm import relax

    from pit_tvm.schedules.wgmma_strips import (STATE_DTYPE, compacts, strip_list_func, strip_pack_func,
                                                strip_state_words)

    list_gv = add_once(bb, f"pit_strips_{tag}", lambda: strip_list_func(k, mk, dtype))
    pack_gv = add_once(bb, f"pit_index_{tag}", lambda: strip_pack_func(k, mk, density_threshold))
    groups = strip_state_words(m)                    # one counter per 128-row strip
    if isinstance(m, (int, tirx.IntImm)):
        state = relax.const(np.zeros(int(groups)), STATE_DTYPE)
    else:
        state = bb.emit(relax.op.zeros(relax.ShapeExpr([groups]), STATE_DTYPE))
    capacity = groups * (k // mk)
    outs = [relax.TensorType([groups], "int32"), relax.TensorType([capacity], "int32")]
    listed = bb.emit(relax.call_tir(list_gv, [a, state],
                                    outs + ([relax.TensorType([m, k], dtype)] if compacts(mk) else [])))
    index = bb.emit(relax.call_tir(pack_gv, [bb.emit(relax.TupleGetItem(listed, 0)),
                                             bb.emit(relax.TupleGetItem(listed, 1))],
                                   [relax.TensorType([groups + 1], "int32"), relax.TensorType([capacity], "int32")]))
    return (bb.emit(relax.TupleGetItem(index, 0)), bb.emit(relax.TupleGetItem(index, 1)),
            bb.emit(relax.TupleGetItem(listed, 2)) if compacts(mk) else a)


def add_once(bb, name, make):
    """The function ``name`` of the module being built: ``make()`` added on first use only (an
    index PrimFunc is fully named by its shape, dtype and threshold, and takes ~0.1 s to
    generate; a model asks for the same one for every matmul of a shape)."""
    mod = bb.get()
    if any(gv.name_hint == name for gv in mod.get_global_vars()):
        return mod.get_global_var(name)
    return bb.add_func(make().with_attr("global_symbol", name), name)


def strips_listing_producer(producer, strip_list):
    """The dense wgmma kernel ``producer`` (a PrimFunc) made to also do, in its epilogue, what
    the one-pass strips index ``strip_list`` (:func:`pit_tvm.schedules.wgmma_strips.strip_list_func`)
    does on its output C (:func:`pit_tvm.schedules.wgmma.wgmma_row_gather_func`'s ``strips_mk``);
    None when they do not fit together: not such kernels, C's columns not the index's K, or
    C's dtype not the index's."""
    from pit_tvm.schedules.wgmma import dense_kernel_args, wgmma_row_gather_func
    from pit_tvm.schedules.wgmma_strips import LIST_ATTR

    args = dense_kernel_args(producer)
    listing = strip_list.attrs[LIST_ATTR] if strip_list.attrs is not None and LIST_ATTR in strip_list.attrs else None
    if (args is None or listing is None or args["strips_mk"] or int(listing["k"]) != args["n"]
            or str(listing["dtype"]) != args["out_dtype"]):
        return None
    return wgmma_row_gather_func(**dict(args, strips_mk=int(listing["mk"])))

