"""The rows kind and the dense GEMM on the H100 (sm_90a): whole rows of A listed by an index
(dense: every row), one 128 x block_n tile of C a CTA, the rows' few-rows tiers on persistent
CTAs.  Checks the arguments, builds the body of :mod:`.gemm_body` and lowers it.

Workload (dense: no ``offsets`` / ``ids``, ``ids[p] = p``, ``count = M``)::

    wgmma_row_gather(A[M, K], B[K, N], offsets: int32[2], ids: int32[M], [bias: N,] C[M, N])
    count = offsets[1]                 # read on the device only
    C[ids[p], :] = epilogue(A[ids[p], :] @ B)   for p < count    (fp32 accumulation)
    C[ids[p], :] = epilogue(0)                  for count <= p < M

The unlisted rows are zeroed by the CTA whose p-tile holds them, so there is no separate
zero-fill launch.  Tiles: 128 x block_n (two consumer warpgroups of m64), 64-deep K tiles in a
``stages``-deep ring; warp-specialized (a TMA / cp.async loader warpgroup) but for the few-rows
tiers, 32-deep K tiles and an fp32 residual.
"""
from __future__ import annotations

import functools

from tvm import tirx

from pit_tvm.schedules.hopper.config import BLOCK_K, DENSE_ATTR, MAX_SMEM_BYTES, ROWS_ATTR, TARGET, WgmmaConfig
from pit_tvm.schedules.hopper.gemm_body import gemm_kernel
from pit_tvm.schedules.hopper.lowering import lower_tirx
from pit_tvm.schedules.hopper.planner import wgmma_config
from pit_tvm.schedules.limits import IN_DTYPES, OUT_DTYPES, dtype_bytes

__all__ = ["wgmma_row_gather_func", "dense_kernel_args"]


@functools.lru_cache(maxsize=64)
def wgmma_row_gather_func(k: int, n: int, in_dtype: str = "float16", out_dtype: str = "float16",
                          bias: bool = False, relu: bool = False, dense: bool = False,
                          config: WgmmaConfig | None = None, gelu: bool = False,
                          row_scale: bool = False, row_scale_masks: bool = False,
                          residual: bool = False, rows_above: int = 0, rows_upto: int = 0,
                          row_scale_a: bool = False, strips_mk: int = 0) -> tirx.PrimFunc:
    """The lowered wgmma row-gather (or, ``dense=True``, plain) matmul PrimFunc; ``M`` is a
    symbolic int64, K and N compile-time.  Epilogue: ``bias`` (a ``[N]`` parameter), then
    ``relu`` or ``gelu`` (erf form), then ``row_scale`` (a ``[M]`` parameter after the bias,
    of the input dtype, multiplying row i: a padding mask).  ``row_scale_masks``: the row scale
    is zero on every row the index skips (it is the mask the index was built from), so those
    rows are stored as zeros.  Raises ValueError when the shape or dtypes do not fit (see
    :func:`.planner.wgmma_applies`).  ``residual`` (with a bias only): a ``[M, N]`` parameter of the
    output dtype added last, in the output dtype (a transformer's skip connection).
    ``row_scale_a`` (with a bias): the row-scale parameter ``s`` multiplies A's rows, before
    the bias (``A`` is given unscaled: ``act(s * (a @ b) + bias)`` for ``act((s * a) @ b +
    bias)``, then ``* s`` with ``row_scale`` too): a GEMM on a padding-masked input without
    the masking kernel.

    The tiers of :func:`.planner.wgmma_few_rows_tiers`, each writing all of C when it runs and nothing
    otherwise: ``rows_above=F`` runs when the index lists more than F rows, ``rows_upto=F``
    when it lists at most F (on :data:`.planner.SMS` persistent CTAs), both for ``rows_above < count <=
    rows_upto``.

    ``strips_mk`` (dense, fp16/bf16 out): the epilogue also builds the one-pass strips index of
    C (:func:`pit_tvm.schedules.wgmma_strips.strip_list_func` on C, for ``(128, strips_mk)``
    micro-tiles) from the staged tile, so a PIT matmul consuming C need not read it again:
    the function takes the strips' ``state`` after the epilogue's inputs and writes ``counts``,
    ``strip_ids`` (and, for micro-tiles under 16 bytes, the compacted ``ac``) after ``c``.
    Dense kernels carry :data:`DENSE_ATTR`, the arguments that rebuild them."""
    if rows_upto and rows_above >= rows_upto:
        raise ValueError(f"a tier runs for rows_above < count <= rows_upto: no rows between "
                         f"{rows_above} and {rows_upto}")
    if dense and (rows_above or rows_upto):
        raise ValueError("a dense kernel has no row tiers (it lists every row)")
    if relu and gelu:
        raise ValueError("relu and gelu are alternatives")
    if row_scale and not bias:
        raise ValueError("row_scale comes with a bias (the kernel variants that take it)")
    if row_scale_a and not bias:
        raise ValueError("row_scale_a comes with a bias (the kernel variants that take it)")
    if residual and (not bias or relu or gelu or row_scale or row_scale_a):
        raise ValueError("residual comes with a bias alone (the kernel variants that take it)")
    config = config or wgmma_config(n)
    if (config is None or k % BLOCK_K or n % config.block_n or config.block_n % 64
            or config.block_k not in (32, 64)):
        raise ValueError(f"wgmma tiles need K % {BLOCK_K} == 0 and N % block_n == 0 "
                         f"(block_n a multiple of 64, block_k 32 or 64), got K={k}, N={n}, {config}")
    if in_dtype not in IN_DTYPES or out_dtype not in OUT_DTYPES:
        raise ValueError(f"wgmma takes {IN_DTYPES} in and {OUT_DTYPES} out, got {in_dtype} -> {out_dtype}")
    if config.stages < 3 or config.smem_bytes(out_dtype) > MAX_SMEM_BYTES:
        raise ValueError(f"{config} needs >= 3 stages and at most {MAX_SMEM_BYTES} B of shared memory")
    if strips_mk and (not dense or dtype_bytes(out_dtype) != 2 or 64 % int(strips_mk)):
        raise ValueError(f"strips_mk lists a dense kernel's fp16/bf16 C in micro-tiles dividing 64 columns, "
                         f"got strips_mk={strips_mk}, dense={dense}, {out_dtype}")
    act = "relu" if relu else ("gelu" if gelu else None)
    func = gemm_kernel(int(k), int(n), in_dtype, out_dtype, bool(bias), act, "dense" if dense else "rows",
                       config, row_scale=bool(row_scale), row_scale_masks=bool(row_scale_masks),
                       residual=bool(residual), rows_above=int(rows_above), rows_upto=int(rows_upto),
                       row_scale_a=bool(row_scale_a), strips_mk=int(strips_mk))
    func = lower_tirx(func, TARGET)
    if dense:
        return func.with_attr(DENSE_ATTR, {
            "k": int(k), "n": int(n), "in_dtype": in_dtype, "out_dtype": out_dtype, "bias": bool(bias),
            "relu": bool(relu), "gelu": bool(gelu), "row_scale": bool(row_scale), "residual": bool(residual),
            "row_scale_a": bool(row_scale_a), "block_n": config.block_n, "stages": config.stages,
            "block_k": config.block_k, "strips_mk": int(strips_mk)})
    # (the op layer looks for it: the rows kernel may be split into the row-count tiers, planned
    # from this config)
    return func.with_attr(ROWS_ATTR, {"block_n": config.block_n, "stages": config.stages, "block_k": config.block_k})


def dense_kernel_args(func) -> dict | None:
    """The keyword arguments of :func:`wgmma_row_gather_func` that rebuild the dense kernel
    ``func`` (``config`` a :class:`WgmmaConfig`), or None for any other PrimFunc."""
    attrs = func.attrs
    if attrs is None or DENSE_ATTR not in attrs:
        return None
    args = {key: (str(v) if key.endswith("dtype") else int(v)) for key, v in attrs[DENSE_ATTR].items()}
    config = WgmmaConfig(args.pop("block_n"), args.pop("stages"), args.pop("block_k"))
    flags = ("bias", "relu", "gelu", "row_scale", "residual", "row_scale_a")
    return dict(args, **{f: bool(args[f]) for f in flags}, config=config, dense=True)
