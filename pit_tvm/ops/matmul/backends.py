"""Which kernel runs a PIT matmul on which target: one ordered list of backends, the first
that applies wins (dlight's rule list is the model: a backend's ``apply`` returns None where
it does not apply).

=================  =============================================================================
backend            runs
=================  =============================================================================
``wgmma.tiles``    sm_90a (the default ``cuda``): micro-tiles along K whose rows divide 128,
                   fp16 / bf16, K and N fitting its tiles (:mod:`pit_tvm.schedules.wgmma`)
``wgmma.rows``     sm_90a: whole rows of one row, fp16 / bf16, K and N fitting its tiles
``mma.sync.rows``  CUDA sm_80 / sm_86 / sm_89 / sm_90 (and sm_90a where wgmma does not fit):
                   whole rows of one row, fp16 / bf16, tile-aligned K and N
                   (:mod:`pit_tvm.schedules.tensorcore`)
``mma.sync.tiles`` the same GPUs, micro-tiles along K (thinner than 16 rows: their 16-row cover),
                   fp16 / bf16, tile-aligned K and N (:mod:`pit_tvm.schedules.tensorcore_tiles`)
``simt``           CUDA, the rest (fp32, whole rows of several rows, K / N no tile fits):
                   SRead / SWrite derived on the workload (:mod:`.derived`); not for a model's
                   matmul, which keeps its dense kernel instead (``tensor_core_only``)
``cpu``            ``llvm``: SRead / SWrite derived on the workload, the CPU schedule
=================  =============================================================================

The dense twins (:func:`_cuda_dense_kernel`) follow the same order: wgmma on sm_90a, mma.sync
elsewhere on CUDA, the CPU schedule's dense twin on ``llvm``.  docs/design/matmul_backends.md
says where each backend's SRead / SWrite come from.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable

import tvm
from tvm import tirx

from pit_tvm.target import cuda_arch, is_gpu, make_target

from .derived import simt_matmul_func
from .epilogue import Epilogue
from .plan import PIT_EXPECTED_DENSITY, MatmulPlan, expected_rows, tensor_core_plan

#: input dtypes of the tensor-core kernels
TENSOR_CORE_DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class KernelRequest:
    """What a backend is asked for: the kernel of one PIT matmul.

    ``rows``: a static row count (None: symbolic); ``density``: the fraction of those rows the
    index is expected to list (the rows kernels plan their tile width for it);
    ``tiles_epilogue``: the bias (and residual) the wgmma tiles kernels are asked to run;
    ``tensor_core_only``: no SIMT kernel on CUDA; ``exact_micro_tile``: no 16-row cover of a
    thin micro-tile (the index is then built for exactly ``plan``'s micro-tile)."""

    plan: MatmulPlan
    dtype: str
    out_dtype: str
    target: tvm.target.Target
    tuning_log: Any = None
    rows: int | None = None
    density: float = PIT_EXPECTED_DENSITY
    tiles_epilogue: Epilogue | None = None
    tensor_core_only: bool = False
    exact_micro_tile: bool = False

    @property
    def arch(self) -> str:
        return cuda_arch(self.target)

    @property
    def tensor_core_dtype(self) -> bool:
        return is_gpu(self.target) and self.dtype in TENSOR_CORE_DTYPES


@dataclass(frozen=True)
class MatmulKernels:
    """The kernels of one PIT matmul, as a backend chose them.

    ``plan``: the plan the index is built for (a kernel may cover a thinner micro-tile);
    ``compact``: the SRead of thin micro-tiles as a kernel of its own; ``dense_fallback``: the
    dense kernel run in place on a full index; ``strips``: the index (and the compaction) in
    one pass over A (:mod:`pit_tvm.schedules.wgmma_strips`); ``tiles_epilogue``: the kernels
    run the request's ``tiles_epilogue``; ``dense_on_full_index``: a full index (above the
    density threshold) runs a dense kernel, so the index applies the threshold."""

    backend: str
    plan: MatmulPlan
    kernel: tirx.PrimFunc
    compact: tirx.PrimFunc | None = None
    dense_fallback: tirx.PrimFunc | None = None
    strips: bool = False
    tiles_epilogue: bool = False
    dense_on_full_index: bool = False


@dataclass(frozen=True)
class Backend:
    """One way of running a PIT matmul: ``apply(request)`` its kernels, or None."""

    name: str
    apply: Callable[[KernelRequest], "MatmulKernels | None"]


def _wgmma_tiles_backend(req: KernelRequest):
    if not is_gpu(req.target):
        return None
    epilogue = req.tiles_epilogue
    return _cuda_wgmma_tiles(req.plan, req.dtype, req.out_dtype, req.arch, expected_rows(req.rows, 1),
                             bias=epilogue is not None, residual=epilogue is not None and epilogue.residual is not None,
                             tuning_log=req.tuning_log)


def _wgmma_rows_backend(req: KernelRequest):
    from pit_tvm.schedules.wgmma import wgmma_applies

    plan = req.plan
    if not (is_gpu(req.target) and plan.kind == "rows" and plan.micro_tile[0] == 1
            and wgmma_applies(plan.k, plan.n, req.dtype, req.out_dtype, req.arch)):
        return None
    hint = expected_rows(req.rows, req.density)
    # the wgmma kernel of the log's config (its wgmma_ space) or the planned one
    kernel = _tuned_or_planned(
        lambda config: _cuda_rows_kernel(plan.k, plan.n, req.dtype, req.out_dtype, req.arch, hint, config),
        req.tuning_log, plan, req.dtype, req.target, "wgmma")
    return MatmulKernels("wgmma.rows", plan, kernel)


def _mma_sync_rows_backend(req: KernelRequest):
    plan = req.plan
    if not (req.tensor_core_dtype and plan.kind == "rows" and plan.micro_tile[0] == 1):
        return None
    kernel = None
    if req.tuning_log is not None:
        from pit_tvm.tuning.tune import tuned_rows_kernel   # warns and falls back

        kernel = tuned_rows_kernel(req.tuning_log, plan.k, plan.n, req.dtype, req.out_dtype, req.target)
    if kernel is None:
        kernel = _cuda_rows_kernel(plan.k, plan.n, req.dtype, req.out_dtype, req.arch,
                                   expected_rows(req.rows, req.density))
    return None if kernel is None else MatmulKernels("mma.sync.rows", plan, kernel)


def _mma_sync_tiles_backend(req: KernelRequest):
    if not (req.tensor_core_dtype and req.plan.kind == "tiles"):
        return None
    plan = req.plan if req.exact_micro_tile else tensor_core_plan(req.plan)
    kernel = _tuned_or_planned(
        lambda config: _cuda_tiles_kernel(plan.k, plan.n, req.dtype, req.out_dtype, plan.micro_tile, req.arch,
                                          config),
        req.tuning_log, plan, req.dtype, req.target, "mma.sync.tiles")
    return None if kernel is None else MatmulKernels("mma.sync.tiles", plan, kernel)


def _simt_backend(req: KernelRequest):
    if not is_gpu(req.target) or req.tensor_core_only:
        return None
    return MatmulKernels("simt", req.plan, simt_matmul_func(req.plan, req.dtype, req.out_dtype, req.target))


def _cpu_backend(req: KernelRequest):
    if is_gpu(req.target):
        return None
    return MatmulKernels("cpu", req.plan, simt_matmul_func(req.plan, req.dtype, req.out_dtype, req.target))


#: every PIT matmul backend, in the order they are tried (the table of this module's docstring)
BACKENDS = (
    Backend("wgmma.tiles", _wgmma_tiles_backend),
    Backend("wgmma.rows", _wgmma_rows_backend),
    Backend("mma.sync.rows", _mma_sync_rows_backend),
    Backend("mma.sync.tiles", _mma_sync_tiles_backend),
    Backend("simt", _simt_backend),
    Backend("cpu", _cpu_backend),
)
#: the backends of :func:`tensor_core_kernel`: one kernel for exactly the plan, no index work
#: of its own (the wgmma tiles kernels come with their own index passes)
TENSOR_CORE_BACKENDS = ("wgmma.rows", "mma.sync.rows", "mma.sync.tiles")


def choose_kernels(request: KernelRequest, backends=None) -> MatmulKernels | None:
    """The kernels of the first backend (of :data:`BACKENDS`, or of those named in
    ``backends``) that applies to ``request``; None where none does (CUDA with
    ``tensor_core_only`` and no tensor-core kernel)."""
    for backend in BACKENDS:
        if backends is not None and backend.name not in backends:
            continue
        kernels = backend.apply(request)
        if kernels is not None:
            return kernels
    return None


@functools.lru_cache(maxsize=64)
def _cuda_rows_kernel(k: int, n: int, dtype: str, out_dtype: str, arch: str, rows_hint=None,
                      config=None):
    """The tensor-core PIT kernel for whole-row micro-tiles on CUDA, or None when it does not
    apply (fp32, or K/N not multiples of any candidate tile: the SIMT kernel is used then).
    On sm_90a it is the wgmma kernel (:mod:`pit_tvm.schedules.wgmma`) where K and N fit its
    tiles, of ``config`` (a tuned one) or the one planned for ``rows_hint``; else the untuned
    mma.sync schedule."""
    if dtype not in ("float16", "bfloat16"):
        return None
    from pit_tvm.schedules.wgmma import wgmma_applies, wgmma_config, wgmma_row_gather_func

    if wgmma_applies(k, n, dtype, out_dtype, arch):
        return wgmma_row_gather_func(k, n, dtype, out_dtype, config=config or wgmma_config(n, rows_hint))
    from pit_tvm.schedules.tensorcore import (row_gather_matmul_func, schedule_row_gather_matmul,
                                              split_plan, valid_configs)

    configs = valid_configs(k, n, dtype, arch)
    if not configs:
        return None
    split_k, split_rows = split_plan(k, n, configs[0], dtype, arch)
    return schedule_row_gather_matmul(
        row_gather_matmul_func(k, n, dtype, out_dtype, split_k=split_k, split_rows=split_rows),
        configs[0], arch)


@functools.lru_cache(maxsize=64)
def _cuda_tiles_kernel(k: int, n: int, dtype: str, out_dtype: str, micro_tile, arch: str, config=None):
    """The tensor-core PIT kernel for (mr, mk) micro-tiles with mk < K on CUDA, of ``config``
    (a tuned :class:`~pit_tvm.schedules.tensorcore_tiles.TilesConfig`) or the first candidate
    that fits; None when none applies (fp32, mr not in 16/32/64/128, K/N not multiples of any
    candidate tile: the SIMT kernel is used then)."""
    if dtype not in ("float16", "bfloat16"):
        return None
    from pit_tvm.schedules.tensorcore_tiles import (needs_compact_a, schedule_tiles_gather_matmul,
                                                    tiles_gather_matmul_func,
                                                    valid_tiles_configs)

    a_compact = needs_compact_a(micro_tile, dtype)
    if config is None:
        configs = valid_tiles_configs(k, n, micro_tile, dtype, arch, a_compact=a_compact)
        if not configs:
            return None
        config = configs[0]
    return schedule_tiles_gather_matmul(
        tiles_gather_matmul_func(k, n, micro_tile, dtype, out_dtype, a_compact=a_compact), config, arch)


def tensor_core_kernel(plan: MatmulPlan, dtype: str, out_dtype: str, target, tuning_log=None,
                       rows_hint=None):
    """The tensor-core PIT kernel for ``plan`` on CUDA, or None (CPU, fp32, unsupported shape).

    ``tuning_log``: the best record of a MetaSchedule log (read every time: a log can grow
    during a process), for whole rows of the wgmma kernel's space on sm_90a and of the mma.sync
    schedule's elsewhere, for micro-tiles along K of the mma.sync tiles schedule's (the wgmma
    tiles kernel reads its log in :func:`_cuda_wgmma_tiles`); otherwise the default (planned)
    kernel, made once per (plan, dtypes, arch) in a process, so a model's layers of one shape
    share it.  ``rows_hint``: the rows expected per call (wgmma picks its tile width to fill
    the GPU, :func:`pit_tvm.schedules.wgmma.wgmma_config`).  The first of
    :data:`TENSOR_CORE_BACKENDS` that applies, for exactly ``plan``'s micro-tile."""
    request = KernelRequest(plan, dtype, out_dtype, make_target(target), tuning_log, rows=rows_hint,
                            density=1.0, exact_micro_tile=True)
    kernels = choose_kernels(request, TENSOR_CORE_BACKENDS)
    return None if kernels is None else kernels.kernel


def _tuned_or_planned(make, tuning_log, plan: MatmulPlan, dtype: str, target, kernel: str):
    """``make(config)`` of the best config of ``tuning_log`` for ``kernel`` (a
    :data:`pit_tvm.tuning.space.KNOBSETS` name), else ``make(None)`` (the planned kernel): a
    log without one, or a tuned config that does not build here (tuned for another output
    dtype, say), is said, never fatal."""
    if tuning_log is None:
        return make(None)
    from pit_tvm.tuning.tune import tuned_config   # warns where the log has none

    tuned = tuned_config(tuning_log, plan.k, plan.n, dtype, target, kernel, plan.micro_tile)
    if tuned is not None:
        try:
            return make(tuned)
        except ValueError as err:
            warnings.warn(f"tuning log {tuning_log} not used: its config {tuned} does not build here ({err})",
                          stacklevel=3)
    return make(None)


def _say_if_log_unused(tuning_log, plan: MatmulPlan, target) -> None:
    """A tuning log the build of ``plan`` for ``target`` cannot read is said, not dropped
    silently: the logs hold CUDA tensor-core kernels."""
    if tuning_log is None:
        return
    if not is_gpu(target):
        why = f"tuning logs hold CUDA kernels, the target is {target.kind.name}"
    elif plan.kind == "rows" and plan.micro_tile[0] != 1:
        why = f"micro-tile {plan.micro_tile} (whole rows of several rows) runs the SIMT kernel"
    else:
        return
    warnings.warn(f"tuning log {tuning_log} not used: {why}", stacklevel=3)


def pit_matmul_func(k: int, n: int, dtype: str, out_dtype: str, micro_tile, target,
                    tuning_log=None) -> tirx.PrimFunc:
    """The PIT kernel for exactly ``micro_tile``, scheduled for ``target``: the tensor-core
    kernel where one applies, else the SRead/SWrite schedule (:func:`simt_matmul_func`).
    (:func:`emit_pit_matmul` may instead cover a thin micro-tile, see :func:`tensor_core_plan`.)

    Signature: ``(A[M,K], B[K,N], offsets, ids, C[M,N])`` with the index layout of
    :func:`pit_tvm.index.tile_index_func` for :class:`MatmulPlan` ``.index_group``/``.index_micro_tile``.
    """
    plan = MatmulPlan(k, n, tuple(int(x) for x in micro_tile))
    _say_if_log_unused(tuning_log, plan, make_target(target))
    tensor_core = tensor_core_kernel(plan, dtype, out_dtype, target, tuning_log)
    if tensor_core is not None:
        return tensor_core
    return simt_matmul_func(plan, dtype, out_dtype, target)


def _wgmma_rows(kernel) -> bool:
    """whether ``kernel`` is the wgmma rows kernel (not an mma.sync schedule)"""
    from pit_tvm.schedules.wgmma import ROWS_ATTR

    return kernel is not None and kernel.attrs is not None and ROWS_ATTR in kernel.attrs


def _wgmma_rows_tiers(k, n, dtype, out_dtype, rows_hint, kernel, **epilogue):
    """The wgmma rows kernels of ``kernel``'s config (:func:`_cuda_rows_kernel`'s) with the
    epilogue: ``(kernel, [])``, or the many-rows kernel and the few-rows tiers of
    :func:`pit_tvm.schedules.wgmma.wgmma_few_rows_tiers` ``(kernel, [tier kernel, ...])``, to run
    in that order on one C (each writes C only for its counts)."""
    from pit_tvm.schedules.wgmma import ROWS_ATTR, WgmmaConfig, wgmma_few_rows_tiers, wgmma_row_gather_func

    config = WgmmaConfig(**{key: int(v) for key, v in kernel.attrs[ROWS_ATTR].items()})
    tiers = wgmma_few_rows_tiers(n, config, out_dtype, rows_hint)
    if not tiers:
        return wgmma_row_gather_func(k, n, dtype, out_dtype, config=config, **epilogue), []
    bounds = [rows for rows, _ in tiers] + [0]
    return (wgmma_row_gather_func(k, n, dtype, out_dtype, config=config, rows_above=bounds[0], **epilogue),
            [wgmma_row_gather_func(k, n, dtype, out_dtype, config=few_config, rows_upto=few_rows,
                                   rows_above=below, **epilogue)
             for (few_rows, few_config), below in zip(tiers, bounds[1:])])


def _cuda_wgmma_tiles(plan: MatmulPlan, dtype: str, out_dtype: str, arch: str, rows_hint=None,
                      bias: bool = False, residual: bool = False, tuning_log=None) -> MatmulKernels | None:
    """The ``wgmma.tiles`` kernels (sm_90a, micro-tiles along K with rows dividing 128), or None:
    the plan covered by 128-row strips, the tiles kernel, the A-compaction kernel (None where
    the one-pass strips index compacts A itself, or no compaction is needed) and the dense
    fallback kernel (None: the warp-specialized tiles kernel runs a full index itself).
    ``bias`` / ``residual``: both GEMM kernels run that epilogue.  ``tuning_log``: the tiles of
    its best ``wgmma.tiles`` record (the loader warpgroup only where this epilogue takes it),
    else the planned ones."""
    from pit_tvm.schedules.wgmma import (BLOCK_M, needs_compaction, tiles_ws_applies,
                                         wgmma_compact_a_func,
                                         wgmma_dense_fallback_func, wgmma_tiles_applies, wgmma_tiles_config,
                                         wgmma_tiles_gather_func)
    from pit_tvm.schedules.wgmma_strips import strips_apply

    if plan.kind == "rows" or not wgmma_tiles_applies(plan.k, plan.n, plan.micro_tile, dtype,
                                                       out_dtype, arch):
        return None
    mk = plan.micro_tile[1]

    def gemm_kernels(tuned):
        """the tiles kernel and its dense fallback (None: the warp-specialized kernel runs it) of
        ``tuned`` (its loader warpgroup where this epilogue takes it), or of the planned config"""
        config = (wgmma_tiles_config(plan.n, mk, rows_hint, out_dtype, residual) if tuned is None else
                  replace(tuned, tiles_ws=tuned.tiles_ws and tiles_ws_applies(mk, tuned.block_n, out_dtype, residual)))
        return (wgmma_tiles_gather_func(plan.k, plan.n, mk, dtype, out_dtype, config=config, bias=bias,
                                        residual=residual),
                None if config.tiles_ws else wgmma_dense_fallback_func(plan.k, plan.n, mk, dtype, out_dtype,
                                                                       config=config, bias=bias, residual=residual))

    kernel, dense_fallback = _tuned_or_planned(gemm_kernels, tuning_log, plan, dtype, f"cuda:{arch}", "wgmma.tiles")
    strips = strips_apply(plan.k, mk, dtype)
    compact = wgmma_compact_a_func(plan.k, mk, dtype) if needs_compaction(mk, dtype) and not strips else None
    return MatmulKernels("wgmma.tiles", MatmulPlan(plan.k, plan.n, (BLOCK_M, mk)), kernel, compact, dense_fallback,
                         strips, tiles_epilogue=bias, dense_on_full_index=True)


@functools.lru_cache(maxsize=64)
def _cuda_dense_kernel(k: int, n: int, dtype: str, out_dtype: str, bias: bool, activation, arch: str,
                       rows_hint=None, row_scale: bool = False, residual: bool = False,
                       row_scale_a: bool = False):
    """The tensor-core dense kernel for (K, N) (with the bias / activation / row-scale
    epilogue), or None when no tile config fits; made once per shape in a process.  wgmma on
    sm_90a where it fits (the mma.sync kernels take a bias and ReLU only)."""
    from pit_tvm.schedules.wgmma import wgmma_applies, wgmma_config, wgmma_row_gather_func

    relu = activation == "relu"
    if wgmma_applies(k, n, dtype, out_dtype, arch):
        return wgmma_row_gather_func(k, n, dtype, out_dtype, bias=bias, relu=relu, dense=True,
                                     config=wgmma_config(n, rows_hint), gelu=activation == "gelu",
                                     row_scale=row_scale, residual=residual, row_scale_a=row_scale_a)
    if activation not in (None, "relu") or row_scale or residual or row_scale_a:
        return None
    # (imported only here: the mma.sync schedules parse TVM's tensor intrinsics, ~14 s)
    from pit_tvm.schedules.tensorcore import dense_matmul_func, schedule_dense_matmul, valid_configs

    configs = valid_configs(k, n, dtype, arch)
    if not configs:
        return None
    return schedule_dense_matmul(dense_matmul_func(k, n, dtype, out_dtype, bias=bias, relu=relu),
                                 configs[0], arch)

