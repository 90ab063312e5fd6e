"""PIT matmul: ``C = A @ B`` with A dynamically sparse, built from rules, index and SRead/SWrite.

The workload is an ordinary TensorIR matmul (fp32 accumulate into ``acc``, then a ``cast``
epilogue into C). PIT is applied to it by the primitives in :mod:`pit_tvm.schedules`:

* **rows** (micro-tile ``(mr, K)``: whole rows, ``mr`` rows each): the spatial axis ``i`` is
  permuted: SRead gathers the non-zero rows of A, SWrite scatters the result rows of C
  (zero rows of A give zero rows of C, filled first).
* **tiles** (micro-tile ``(mr, mk)`` with ``mk < K``: ``32x1`` along K, ``32x64`` blocks, ``1x64``):
  the reduction axis ``k`` is permuted per strip of ``mr`` rows: SRead gathers the non-zero
  micro-tiles of the strip from A and the matching rows of B; no scatter is needed.

The index is built on the device every call (:mod:`pit_tvm.index`); its count never leaves
the device: grids and loops are worst-case sized and the iterations past the count exit at
once (:func:`pit_tvm.schedules.sparse_access.lower_pit`). Above ``density_threshold`` of
non-zero micro-tiles the index kernel itself lists every micro-tile, so the same kernel runs
densely (decided on the device). On CUDA, fp16/bf16 plans use the tensor-core kernels
(:mod:`pit_tvm.schedules.tensorcore`, :mod:`pit_tvm.schedules.tensorcore_tiles`) where a
configuration fits, else the SIMT schedule.
"""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, replace

import numpy as np
import tvm
from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.schedules.sparse_access import PitIndex, sread, swrite
from pit_tvm.target import DEFAULT_CUDA_ARCH, build, device_for, is_gpu, make_target

# (the public op's argument checks and tensor conversions)
from pit_tvm._args import dtype_name, fraction, micro_tile_pair, positive_int
from pit_tvm.runtime.loader import DLPACK_CPU, dlpack_to_tvm, host_view, numpy_dtype

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


def matmul_workload(k: int, n: int, dtype: str, out_dtype: str, wide_extents: bool = False) -> tirx.PrimFunc:
    """The dense TensorIR matmul PIT is derived from (M symbolic).

    ``wide_extents``: K and N as int64 extents, like M.  The CUDA SIMT schedule needs them
    where its ``pad_einsum`` pads K (or some N, :func:`_with_extents_that_lower`): with int32
    K, N the padding predicate meets M's int64 loop and TVM's lowering fails ("mismatched
    types. int32 vs. int64").  Other shapes keep int32 (their CUDA unchanged)."""
    if wide_extents:
        k, n = T.int64(k), T.int64(n)

    @T.prim_func(s_tir=True)
    def matmul(a: T.handle, b: T.handle, c: T.handle):
        T.func_attr({"global_symbol": "matmul", "tirx.noalias": True})
        m = T.int64()
        A = T.match_buffer(a, (m, k), dtype)
        B = T.match_buffer(b, (k, n), dtype)
        C = T.match_buffer(c, (m, n), out_dtype)
        acc = T.sblock_alloc_buffer((m, n), "float32")
        for i, j, kk in T.grid(m, n, k):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                with T.init():
                    acc[vi, vj] = T.float32(0)
                acc[vi, vj] = acc[vi, vj] + T.Cast("float32", A[vi, vk]) * T.Cast("float32", B[vk, vj])
        for i, j in T.grid(m, n):
            with T.sblock("cast"):
                vi, vj = T.axis.remap("SS", [i, j])
                C[vi, vj] = T.Cast(out_dtype, acc[vi, vj])

    return matmul


@dataclass(frozen=True)
class MatmulPlan:
    """What PIT does for one (K, N, micro-tile): the index layout and the permuted axis."""

    k: int
    n: int
    micro_tile: tuple[int, int]

    @property
    def kind(self) -> str:
        return "rows" if self.micro_tile[1] >= self.k else "tiles"

    @property
    def index_group(self) -> str:
        # rows: one group listing tile-rows; tiles: per strip of mr rows, its non-zero k-tiles
        return "col" if self.kind == "rows" else "row"

    @property
    def index_micro_tile(self) -> tuple[int, int]:
        mr, mk = self.micro_tile
        return (mr, self.k) if self.kind == "rows" else (mr, mk)

    def index_sizes(self, m):
        """(groups, capacity) of the index for ``m`` rows; ``m`` an int or a TIR expression."""
        mr, mc = self.index_micro_tile
        tile_rows = (m + mr - 1) // mr
        tile_cols = (self.k + mc - 1) // mc
        groups = tile_cols if self.index_group == "col" else tile_rows
        return groups, tile_rows * tile_cols


def _validate(k, n, dtype, micro_tile):
    """Check the op's shape arguments, each error naming the argument: K and N positive ints
    (numpy ints too; floats and bools refused, never truncated), ``dtype`` one of
    :data:`SUPPORTED_DTYPES`, ``micro_tile`` a pair of positive ints (or ``"RxC"``) no wider
    than K.  Returns ``(mr, mk)``."""
    positive_int(k, "K")
    positive_int(n, "N")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: PIT matmul supports {', '.join(SUPPORTED_DTYPES)}")
    mr, mk = micro_tile_pair(micro_tile)
    if mk > k:
        raise ValueError(f"micro-tile {mr}x{mk} does not fit the PIT axis K={k}: its width {mk} exceeds K "
                         f"(whole rows are ({mr}, {k}))")
    return mr, mk


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


def _arch_of(target: tvm.target.Target) -> str:
    return str(target.attrs.get("arch", DEFAULT_CUDA_ARCH))


#: rows of the thinnest strip the tensor-core tiles kernel takes (one m16n8k16 tile)
TC_MIN_STRIP = 16


def tensor_core_plan(plan: MatmulPlan) -> MatmulPlan | None:
    """The plan a tensor-core kernel runs for ``plan``: itself, or for a tiles micro-tile
    thinner than an mma tile (e.g. 1x64) the ``16 x mk`` cover of it (a 16-row strip's
    k-tile is listed when any of its rows' micro-tiles is non-zero: more zeros computed,
    same result); None for whole rows of more than one row."""
    mr, mk = plan.micro_tile
    if plan.kind == "rows":
        return plan if mr == 1 else None
    if mr < TC_MIN_STRIP and TC_MIN_STRIP % mr == 0:
        return MatmulPlan(plan.k, plan.n, (TC_MIN_STRIP, mk))
    return plan


def tensor_core_kernel(plan: MatmulPlan, dtype: str, out_dtype: str, target, tuning_log=None,
                       rows_hint=None):
    """The tensor-core PIT kernel for ``plan`` on CUDA, or None (CPU, fp32, unsupported shape).

    ``tuning_log``: the best record of a MetaSchedule log (read every time: a log can grow
    during a process), for whole rows of the wgmma kernel's space on sm_90a and of the mma.sync
    schedule's elsewhere, for micro-tiles along K of the mma.sync tiles schedule's (the wgmma
    tiles kernel reads its log in :func:`_cuda_wgmma_tiles`); otherwise the default (planned)
    kernel, made once per (plan, dtypes, arch) in a process, so a model's layers of one shape
    share it.  ``rows_hint``: the rows
    expected per call (wgmma picks its tile width to fill the GPU, :func:`wgmma_config`)."""
    target = make_target(target)
    if not is_gpu(target):
        return None
    arch = _arch_of(target)
    if plan.kind == "rows":
        if plan.micro_tile[0] != 1:
            return None
        from pit_tvm.schedules.wgmma import wgmma_applies

        if wgmma_applies(plan.k, plan.n, dtype, out_dtype, arch):
            # sm_90a: the wgmma kernel, of the log's config (its wgmma_ space) or the planned one
            return _tuned_or_planned(
                lambda config: _cuda_rows_kernel(plan.k, plan.n, dtype, out_dtype, arch, rows_hint, config),
                tuning_log, plan, dtype, target, "wgmma")
        if tuning_log is not None and dtype in ("float16", "bfloat16"):
            from pit_tvm.tuning.tune import tuned_rows_kernel   # warns and falls back

            tuned = tuned_rows_kernel(tuning_log, plan.k, plan.n, dtype, out_dtype, target)
            if tuned is not None:
                return tuned
        return _cuda_rows_kernel(plan.k, plan.n, dtype, out_dtype, arch, rows_hint)
    if dtype not in ("float16", "bfloat16"):
        return None     # (no tensor-core tiles kernel: no log to read)
    return _tuned_or_planned(
        lambda config: _cuda_tiles_kernel(plan.k, plan.n, dtype, out_dtype, plan.micro_tile, arch, config),
        tuning_log, plan, dtype, target, "mma.sync.tiles")


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


def simt_matmul_func(plan: MatmulPlan, dtype: str, out_dtype: str, target) -> tirx.PrimFunc:
    """The PIT kernel derived from :func:`matmul_workload` by ``sread``/``swrite``, scheduled
    for the CPU or as a CUDA SIMT kernel (no tensor cores)."""
    if not (is_gpu(target) and plan.kind == "rows"):
        return _simt_matmul_func(plan, dtype, out_dtype, target, wide_extents=False)
    return _with_extents_that_lower(
        lambda wide: _simt_matmul_func(plan, dtype, out_dtype, target, wide_extents=wide), plan.k, plan.n, target)


def _simt_matmul_func(plan: MatmulPlan, dtype: str, out_dtype: str, target, wide_extents: bool):
    k, n = plan.k, plan.n
    mr, mk = plan.micro_tile
    func = matmul_workload(k, n, dtype, out_dtype, wide_extents=wide_extents)
    sch = tvm.s_tir.Schedule(tvm.IRModule({"matmul": func}))
    sch.work_on("matmul")
    m = func.params[0].shape[0]
    groups, capacity = plan.index_sizes(m)
    if plan.kind == "rows":
        index = PitIndex.create("pit", capacity, groups, micro=mr)
        sch = sread(sch, "matmul", "A", "vi", index)
        sch = swrite(sch, "cast", "C", "vi", index)
    else:
        index = PitIndex.create("pit", capacity, groups, micro=mk, group_axis="vi", group_micro=mr)
        a_name, b_name = "A", "B"
        if is_gpu(target) or mr > 1:
            # Pad rows to whole strips first (dlight's pad_einsum), so the kernel has
            # constant-size tiles and no predicate in its main loop (on the CPU: tile-sized
            # buffers, see pit_tvm.schedules.matmul._pad_rows_to_tile)
            from pit_tvm.schedules.matmul import tiles_padding

            mm = sch.get_sblock("matmul")
            sch.pad_einsum(mm, tiles_padding(plan))
            a_name, b_name = (sch.get(mm).reads[n].source.name for n in (0, 1))   # "A"/"A_pad", ...
        sch = sread(sch, "matmul", a_name, "vk", index)
        sch = sread(sch, "matmul", b_name, "vk", index)
    from pit_tvm.schedules.matmul import schedule_pit_matmul

    return schedule_pit_matmul(sch, plan, target)


def dense_matmul_func(k: int, n: int, dtype: str, out_dtype: str, target) -> tirx.PrimFunc:
    """The dense kernel with the same schedule (the fair baseline and the fallback)."""
    from pit_tvm.schedules.matmul import schedule_dense_matmul

    def make(wide):
        func = matmul_workload(k, n, dtype, out_dtype, wide_extents=wide)
        sch = tvm.s_tir.Schedule(tvm.IRModule({"matmul": func}))
        sch.work_on("matmul")
        return schedule_dense_matmul(sch, target)

    return _with_extents_that_lower(make, k, n, target) if is_gpu(target) else make(False)


def _with_extents_that_lower(make, k: int, n: int, target) -> tirx.PrimFunc:
    """``make(wide_extents)`` (the CUDA SIMT rows / dense kernel): int32 K, N where they lower,
    else int64 ones (:func:`matmul_workload`).  Padding K always needs int64; padding N alone
    only for some N (N = 1, 30, 63, 65 need it; 100, 130, 160 do not), so there the int32
    kernel is lowered first, and the kernels that built before keep their code."""
    from pit_tvm.schedules.matmul import GPU_BK, gpu_pads_k_or_n

    if not gpu_pads_k_or_n(k, n):
        return make(False)
    if k % GPU_BK == 0:
        func = make(False)
        if _lowers(func, target):
            return func
    return make(True)


def _lowers(func: tirx.PrimFunc, target) -> bool:
    """Whether TVM's TIR pipeline for ``target`` lowers ``func`` (what :func:`build` runs
    before code generation); False on the int32 / int64 mismatch of a padded extent."""
    target = make_target(target)
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    mod = tvm.tirx.transform.BindTarget(target.with_host(tvm.target.Target("llvm")))(mod)
    try:
        tvm.tirx.get_default_tir_pipeline(target)[0](mod)
    except TypeError:
        return False
    return True


def _build_sparse_matmul(k, n, dtype, out_dtype, micro_tile, target, density_threshold,
                         tuning_log):
    """The executable of :class:`SparseMatmul`: a Relax ``main(a[M, k], b[k, n]) -> c`` made by
    :func:`emit_pit_matmul` (the graph the compiler emits for a model), plus the names of
    its index and kernel PrimFuncs."""
    from tvm import relax

    from pit_tvm.index import index_state

    bb = relax.BlockBuilder()
    m = tirx.Var("m", "int64")
    a = relax.Var("a", relax.TensorType([m, k], dtype))
    b = relax.Var("b", relax.TensorType([k, n], dtype))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            c = emit_pit_matmul(bb, a, b, micro_tile=micro_tile, target=target,
                                out_dtype=out_dtype, density_threshold=density_threshold,
                                tuning_log=tuning_log, tensor_core_only=False)
            out = bb.emit_output(c)
        bb.emit_func_output(out)
    mod = bb.get()
    names = {}
    for gv, func in mod.functions.items():
        for key, prefix in (("index", "pit_index_"), ("kernel", "pit_kernel_"), ("strips", "pit_strips_")):
            if gv.name_hint.startswith(prefix):
                names[key] = gv.name_hint
        if gv.name_hint.startswith("pit_kernel_"):
            names["micro_tile"] = tuple(int(x) for x in func.attrs["pit.micro_tile"])
        if gv.name_hint.startswith("pit_index_"):
            names["index_state"] = index_state(func)
    return build(mod, target), names


def _op_target(target) -> tvm.target.Target:
    """``target`` of :class:`SparseMatmul` as a Target: ``"llvm"``/``"cpu"``, ``"cuda"`` or
    ``"cuda:sm_XY"``, a dict or a Target, of kind llvm or cuda (with an ``sm_XY`` arch)."""
    from pit_tvm.target import arch_number

    try:
        tgt = make_target(target)
    except TypeError:
        raise
    except Exception as err:  # noqa: BLE001 - TVM's own error for a dict target or a CUDA arch
        if isinstance(target, str) and not target.startswith("cuda:"):
            raise                       # make_target's own "unknown target"
        raise ValueError(f"target {target!r} is not a valid TVM target: {err}") from None
    kind = tgt.kind.name
    if kind not in ("llvm", "cuda"):
        raise ValueError(f"target {target!r}: PIT matmul builds for 'llvm' or 'cuda' targets, not {kind!r}")
    if kind == "cuda" and arch_number(_arch_of(tgt)) < 0:
        raise ValueError(f"target {target!r}: unknown CUDA arch {_arch_of(tgt)!r}; "
                         "use e.g. 'cuda:sm_80' or 'cuda:sm_90a'")
    return tgt


class SparseMatmul:
    """``C = A @ B`` with A dynamically sparse; compiled once, the index built every call.

    Use :func:`sparse_matmul` to create one. ``op(a, b)`` takes numpy arrays and DLPack
    tensors (torch, TVM, jax, ...) of any layout and returns C of the same kind as ``a`` (one
    call of the Relax graph :func:`emit_pit_matmul` emits, C from the VM's pooled allocator);
    a DLPack tensor is used in place when C-contiguous and 64-byte aligned, else copied
    (numpy arrays always are).  ``op(a, b, out=c)`` copies that C into ``c`` (any layout);
    ``op.index(a)`` returns the device index ``(offsets, ids)`` for inspection
    (:func:`pit_tvm.index.tiles_from_index` decodes it) for ``op.kernel_plan``'s micro-tile.
    """

    def __init__(self, k, n, dtype="float16", micro_tile=(1, 64), target="llvm", out_dtype=None,
                 density_threshold=0.9, tuning_log=None):
        self.k, self.n = positive_int(k, "K"), positive_int(n, "N")
        self.dtype = dtype_name(dtype, "dtype")
        micro_tile = _validate(self.k, self.n, self.dtype, micro_tile)
        self.out_dtype = self.dtype if out_dtype is None else dtype_name(out_dtype, "out_dtype")
        if self.out_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"unsupported out_dtype {self.out_dtype!r}: use one of {', '.join(SUPPORTED_DTYPES)}")
        density_threshold = fraction(density_threshold, "density_threshold")
        if tuning_log is not None and not isinstance(tuning_log, (str, os.PathLike)):
            raise TypeError(f"tuning_log must be a path (str or os.PathLike) or None, got {type(tuning_log).__name__}")
        self.plan = MatmulPlan(self.k, self.n, micro_tile)
        self.micro_tile = self.plan.micro_tile
        self.target = _op_target(target)
        self.device = device_for(self.target)
        self.density_threshold = density_threshold
        self.executable, names = _build_sparse_matmul(
            self.k, self.n, self.dtype, self.out_dtype, self.micro_tile, self.target,
            density_threshold, tuning_log)
        # op(a, b): one call of the Relax function (index + kernels), whose index and C come
        # from the VM's pooled allocator: no cudaMalloc, and no cudaFree (which synchronises
        # the device) per call.  op(a, b, out=C) copies that C into out; op.index(a) calls
        # the index PrimFunc directly.
        self._main = None      # the VM needs the device: made on the first call
        # the index and kernel work on this plan's micro-tile: the requested one, or on CUDA
        # the tensor-core cover of a thinner one (tensor_core_plan)
        self.kernel_plan = MatmulPlan(self.k, self.n, names["micro_tile"])
        self._index = self.executable[names["index"]]
        self._workspace = {}   # row count -> (offsets, ids) for index()
        self._index_state_shape = names.get("index_state")   # a one-group CUDA index's counter
        self._index_state = None
        # the wgmma tiles kernel's index in one pass (pit_tvm.schedules.wgmma_strips): the
        # strips kernel (with the A compaction for thin micro-tiles), then the CSR pack
        self._strips = self.executable[names["strips"]] if "strips" in names else None

    # -- tensors in and out ---------------------------------------------------------
    def _as_tensor(self, x, name, shape_check):
        """``x`` as a TVM tensor on the op's device, checked (dtype, then shape, then device)
        before any copy to the device.  A numpy array (any layout) is copied; a DLPack tensor
        (TVM, torch, jax, cupy) is taken zero-copy where TVM can (C-contiguous, 64-byte
        aligned), else copied (:func:`pit_tvm.runtime.loader.dlpack_to_tvm`); anything else
        (a list) is read by numpy as the op's dtype."""
        if hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray):     # TVM, torch, ...
            t = dlpack_to_tvm(x, name)
        else:
            arr = self._as_array(x, name)
            self._check_dtype(arr.dtype, name, self.dtype)
            shape_check(arr.shape)
            return tvm.runtime.tensor(np.ascontiguousarray(arr), self.device)
        self._check_dtype(t.dtype, name, self.dtype)
        shape_check(tuple(int(s) for s in t.shape))
        self._check_device(t, name)
        return t

    def _as_array(self, x, name):
        if x is None:
            raise TypeError(f"{name} must be a numpy array, a DLPack tensor (torch, TVM, ...) or a nested "
                            "sequence of numbers, got None")
        if isinstance(x, np.ndarray) or hasattr(x, "dtype"):
            return np.asarray(x)
        try:            # (a list, a scalar: no dtype of its own)
            return np.asarray(x, dtype=numpy_dtype(self.dtype))
        except (TypeError, ValueError) as err:
            raise TypeError(f"{name} must be a numpy array, a DLPack tensor (torch, TVM, ...) or a nested "
                            f"sequence of numbers, got {type(x).__name__} ({err})") from None

    @staticmethod
    def _check_dtype(dtype, name, want):
        if str(dtype) == want:          # (TVM and numpy dtypes print as their names)
            return
        have = dtype_name(dtype)
        if have != want:
            raise ValueError(f"{name}: dtype {have} given, {want} expected")

    def _check_device(self, t, name):
        dev = t.device
        if (dev.dlpack_device_type(), dev.index) != (self.device.dlpack_device_type(), self.device.index):
            raise ValueError(f"{name} is on {dev}, the op runs on {self.device}")

    def _as_out(self, out, m):
        """Where ``out`` is written, checked against C (``(m, N)``, ``out_dtype``) before the op
        runs: a TVM tensor over contiguous memory (``copyfrom``: TVM copies into memory of any
        alignment), a numpy array (assigned: any layout), or a strided torch tensor on a GPU
        (``copy_``).  C itself comes from the VM's allocator: ``out=`` costs one copy."""
        if isinstance(out, np.ndarray):
            self._check_dtype(out.dtype, "out", self.out_dtype)
            self._check_out_shape(out.shape, m)
            if not out.flags.writeable:
                raise ValueError("out is a read-only numpy array")
            return out
        if not hasattr(out, "__dlpack__"):
            raise TypeError(f"out must be a numpy array, a TVM tensor or a DLPack tensor, got {type(out).__name__}")
        import tvm_ffi

        try:    # a view of out's memory as it is (any strides, any alignment): it is written, not read
            view = out if isinstance(out, tvm.runtime.Tensor) else tvm_ffi.from_dlpack(out)
        except Exception as err:  # noqa: BLE001 - the producer's own refusal (read-only, needs grad)
            raise TypeError(f"out: TVM cannot take this {type(out).__name__} through DLPack: {err}") from err
        self._check_dtype(view.dtype, "out", self.out_dtype)
        self._check_out_shape(tuple(int(s) for s in view.shape), m)
        self._check_device(view, "out")
        if view.is_contiguous():
            return view
        if view.device.dlpack_device_type() == DLPACK_CPU:
            return host_view(view)
        if callable(getattr(out, "copy_", None)) and type(out).__module__.startswith("torch"):
            return out
        raise ValueError(f"out is a non-contiguous tensor on {view.device} (strides {tuple(view.strides)}): "
                         "TVM writes only contiguous device memory; pass a contiguous one")

    def _check_out_shape(self, shape, m):
        if tuple(shape) != (m, self.n):
            raise ValueError(f"out must have shape ({m}, {self.n}) (A's rows, N), got {tuple(shape)}")

    @staticmethod
    def _write_out(dest, c):
        if isinstance(dest, tvm.runtime.Tensor):
            dest.copyfrom(c)
        elif isinstance(dest, np.ndarray):
            dest[...] = c.numpy()
        else:   # a strided torch tensor on a GPU
            import torch

            dest.copy_(torch.from_dlpack(c))

    def _check_a(self, shape):
        if len(shape) != 2 or shape[1] != self.k:
            raise ValueError(f"A must have shape (M, {self.k}) (2-D, K={self.k} columns), got {tuple(shape)}")

    def _check_b(self, shape):
        if tuple(shape) != (self.k, self.n):
            raise ValueError(f"B must have shape ({self.k}, {self.n}) (K, N), got {tuple(shape)}")

    WORKSPACE_SLOTS = 8

    def _index_buffers(self, m):
        """The index buffers for ``m`` rows, allocated once per row count and reused: a device
        allocation (and its free, which synchronises) per call would sit on the hot path."""
        if m in self._workspace:
            return self._workspace[m]
        groups, capacity = self.kernel_plan.index_sizes(m)
        buffers = (tvm.runtime.empty((groups + 1,), "int32", self.device),
                   tvm.runtime.empty((capacity,), "int32", self.device))
        if len(self._workspace) >= self.WORKSPACE_SLOTS:
            self._workspace.pop(next(iter(self._workspace)))
        self._workspace[m] = buffers
        return buffers

    def _strips_buffers(self, m):
        """``(state, counts, strip ids[, compacted A])`` of the one-pass index for ``m`` rows,
        allocated once per row count (the state zeroed once: the kernel leaves it zero)"""
        from pit_tvm.schedules.wgmma_strips import compacts, strip_state_words

        key = ("strips", m)
        if key not in self._workspace:
            groups = strip_state_words(m)
            capacity = self.kernel_plan.index_sizes(m)[1]
            self._workspace[key] = (
                (tvm.runtime.tensor(np.zeros(groups), self.device), tvm.runtime.empty((groups,), "int32", self.device),
                 tvm.runtime.empty((capacity,), "int32", self.device))
                + ((tvm.runtime.empty((m, self.k), self.dtype, self.device),)
                   if compacts(self.kernel_plan.micro_tile[1]) else ()))
        return self._workspace[key]

    def index(self, a):
        """Build the index of ``a`` on the device: ``(offsets, ids)``, CSR by group.

        The buffers are the op's workspace for this row count: the next call overwrites them.
        """
        a_t = self._as_tensor(a, "A", self._check_a)
        offsets, ids = self._index_buffers(int(a_t.shape[0]))
        if self._strips is not None:
            state, counts, strip_ids, *ac = self._strips_buffers(int(a_t.shape[0]))
            self._strips(a_t, state, counts, strip_ids, *ac)
            self._index(counts, strip_ids, offsets, ids)
        elif self._index_state_shape is None:
            self._index(a_t, offsets, ids)
        else:
            if self._index_state is None:   # zeroed once: the index leaves its counter zero
                self._index_state = tvm.runtime.tensor(np.zeros(*self._index_state_shape), self.device)
            self._index(a_t, self._index_state, offsets, ids)
        return offsets, ids

    def __call__(self, a, b, out=None):
        """``C = a @ b``: C of ``a``'s kind (a TVM tensor for a TVM tensor, torch for torch,
        else numpy), or written into ``out`` (any layout, see :meth:`_as_out`) and ``out``
        returned."""
        a_t = self._as_tensor(a, "A", self._check_a)
        b_t = self._as_tensor(b, "B", self._check_b)
        m = int(a_t.shape[0])
        dest = None if out is None else self._as_out(out, m)
        if self._main is None:
            from tvm import relax

            self._main = relax.VirtualMachine(self.executable, self.device)["main"]
        # one path for every call: the graph may run more kernels than index + matmul (the
        # A compaction of micro-tiles under 16 bytes wide, before the wgmma tiles kernel)
        c = self._main(a_t, b_t)
        if dest is not None:
            self._write_out(dest, c)
            return out
        if isinstance(a, tvm.runtime.Tensor):
            return c
        if type(a).__module__.startswith("torch"):
            import torch

            return torch.from_dlpack(c)
        return c.numpy()


def sparse_matmul(k, n, dtype="float16", micro_tile=(1, 64), target="llvm", out_dtype=None,
                  density_threshold=0.9, tuning_log=None) -> SparseMatmul:
    """Compile the PIT matmul ``C[M, n] = A[M, k] @ B[k, n]`` (M varies per call).

    ``micro_tile=(mr, mk)``: ``(1, k)`` whole rows (SRead+SWrite along M), ``(32, 1)`` along K,
    ``(32, 64)`` blocks (SRead along K per strip). ``density_threshold``: above this fraction of
    non-zero micro-tiles the kernel runs densely (decided on the device); None disables.
    On CUDA, fp16/bf16 use the tensor-core kernels where a tile config fits K, N
    (:mod:`pit_tvm.schedules.tensorcore` for rows, with a split-K path for few rows;
    :mod:`pit_tvm.schedules.tensorcore_tiles` for tiles, thin ones as their 16-row cover);
    ``tuning_log`` picks the tuned config of the tensor-core kernel (``pit-tvm tune``).

    K and N are ints (numpy ints too), ``dtype``/``out_dtype`` names or numpy / torch dtypes
    of ``float32``, ``float16``, ``bfloat16``, ``micro_tile`` a pair of ints or ``"RxC"``;
    ``target`` ``"llvm"``, ``"cuda"``, ``"cuda:sm_XY"`` or a dict / Target of those kinds.
    Anything else is a TypeError or ValueError naming the argument, before any build.

    Any K, N build: where no tensor-core tile fits, the SIMT kernel runs fp16/bf16 (a warning
    says so).  A micro-tile the index skips (all zero) contributes exactly 0 to C whatever B
    holds (NaN / Inf in B's rows there do not reach C, as they would in numpy's ``a @ b``), on
    both sides of ``density_threshold``, except for the wgmma tiles kernels (``cuda``, micro-tiles
    along K), whose dense fallback above it multiplies every micro-tile (docs/guide/semantics.md).
    """
    return SparseMatmul(k, n, dtype, micro_tile, target, out_dtype, density_threshold, tuning_log)


class DenseMatmul:
    """The dense kernel with the PIT schedule's structure: the fair baseline."""

    def __init__(self, k, n, dtype="float16", target="llvm", out_dtype=None):
        self.k, self.n, self.dtype = int(k), int(n), str(dtype)
        self.out_dtype = str(out_dtype or dtype)
        self.target = make_target(target)
        self.device = device_for(self.target)
        func = dense_matmul_func(self.k, self.n, self.dtype, self.out_dtype, self.target)
        self.executable = build(tvm.IRModule({"dense_matmul": func.with_attr("global_symbol", "dense_matmul")}),
                                self.target)
        self._kernel = self.executable["dense_matmul"]

    def __call__(self, a, b, out=None):
        a_t = a if isinstance(a, tvm.runtime.Tensor) else tvm.runtime.tensor(np.asarray(a), self.device)
        b_t = b if isinstance(b, tvm.runtime.Tensor) else tvm.runtime.tensor(np.asarray(b), self.device)
        c = out if out is not None else tvm.runtime.empty((int(a_t.shape[0]), self.n), self.out_dtype, self.device)
        self._kernel(a_t, b_t, c)
        return c if (out is not None or isinstance(a, tvm.runtime.Tensor)) else c.numpy()


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
    _validate(k, n, dtype, micro_tile)
    out_dtype = str(out_dtype or dtype)
    if int(a_ty.shape[-1]) != k:
        raise ValueError(f"A's last dimension {a_ty.shape[-1]} does not match B's K={k}")
    a2, m, lead = _as_rows(bb, a, k)
    plan = MatmulPlan(k, n, tuple(int(x) for x in micro_tile))
    tgt = make_target(target)
    _say_if_log_unused(tuning_log, plan, tgt)
    density = planned_density(expected_density)
    compact = dense_fallback = wgmma_tiles = None
    strips = False      # the wgmma tiles kernel's index (and compaction) in one pass over A
    # the wgmma tiles kernels' epilogue: a bias, then a residual (an FFN's fc2 and its skip)
    tiles_fused = (is_gpu(tgt) and plan.kind != "rows" and bias is not None and activation is None
                   and row_scale is None
                   and _wgmma_epilogue_applies(k, n, dtype, out_dtype, tgt, bias, None, None, residual, a_ty))
    if is_gpu(tgt):
        kernel = None
        tc_plan = tensor_core_plan(plan)
        # (tiles: every 128-row strip has a CTA, so the tile width plans for all rows)
        wgmma_tiles = _cuda_wgmma_tiles(plan, dtype, out_dtype, _arch_of(tgt), _rows_hint(m, 1),
                                        bias=tiles_fused, residual=tiles_fused and residual is not None,
                                        tuning_log=tuning_log)
        tiles_fused = tiles_fused and wgmma_tiles is not None
        if wgmma_tiles is not None:
            plan, kernel, compact, dense_fallback, strips = wgmma_tiles
        elif tc_plan is not None:
            kernel = tensor_core_kernel(tc_plan, dtype, out_dtype, tgt, tuning_log, _rows_hint(m, density))
            if kernel is not None:
                plan = tc_plan            # the index is built for the kernel's micro-tile
        if kernel is None and not tensor_core_only:
            if tc_plan is not None and dtype in ("float16", "bfloat16"):
                # (any K, N: the tensor-core kernels need them tile-aligned)
                warnings.warn(f"no tensor-core PIT kernel fits {dtype} K={k} N={n} (tile-aligned K, N "
                              f"needed): the SIMT kernel runs it, correct but slower", stacklevel=2)
            kernel = simt_matmul_func(plan, dtype, out_dtype, tgt)
        if kernel is None:
            # In a model the dense alternative is dlight's kernel; the SIMT PIT kernel only wins
            # at extreme sparsity, so without a tensor-core kernel the matmul stays dense.
            raise ValueError(f"no tensor-core PIT kernel for {dtype} K={k} N={n} micro-tile "
                             f"{plan.micro_tile[0]}x{plan.micro_tile[1]} (needs fp16/bf16 and tile-aligned K, N)")
    else:
        kernel = simt_matmul_func(plan, dtype, out_dtype, tgt)
    masks = False
    fused = (bias is not None and plan.kind == "rows" and is_gpu(tgt)
             and _wgmma_epilogue_applies(k, n, dtype, out_dtype, tgt, bias, activation, row_scale, residual, a_ty))
    # the epilogue runs in the kernel (rows: bias, activation, row scale, residual; tiles: bias,
    # residual); the two are exclusive
    in_kernel = fused or tiles_fused
    few_rows_kernels, epilogue, scaled = [], {}, None
    if is_gpu(tgt) and plan.kind == "rows" and _wgmma_rows(kernel):
        # a row scale that is the index's row mask is zero on every row the index skips
        masks = fused and row_scale is not None and row_mask is not None and row_scale.same_as(row_mask)
        epilogue = (dict(bias=True, relu=activation == "relu", gelu=activation == "gelu",
                         row_scale=row_scale is not None, row_scale_masks=masks, residual=residual is not None)
                    if fused else {})
        # A = x * the index's row mask: the kernel reads x and scales its product's rows (the
        # row-scale parameter is that mask; a residual's kernel variants take no row scale)
        scaled = (_row_scaled_input(bb, a, a_ty, row_mask)
                  if fused and row_mask is not None and residual is None and (row_scale is None or masks)
                  and is_row_scale(row_mask, a_ty) else None)
        if scaled is not None:
            a2, m, lead = _as_rows(bb, scaled[0], k)
            epilogue["row_scale_a"] = True
        kernel, few_rows_kernels = _wgmma_rows_tiers(k, n, dtype, out_dtype, _rows_hint(m, density), kernel,
                                                     **epilogue)
    density_threshold = effective_density_threshold(density_threshold, wgmma_tiles is not None)
    mr, mc = plan.index_micro_tile
    groups, capacity = plan.index_sizes(m)
    tag = f"{mr}x{plan.micro_tile[1]}_k{k}_n{n}_{dtype}"

    dens_tag = "" if density_threshold is None else f"_d{int(round(float(density_threshold) * 1000))}"
    if row_mask is not None and plan.kind == "rows":
        index_gv, index_src = _row_mask_index(bb, row_mask, m, tgt, density_threshold, dens_tag)
    elif strips:
        index_gv = index_src = None     # the one-pass index (_emit_strips)
    else:
        index_gv = _add_once(bb, f"pit_index_{tag}{dens_tag}", lambda: tile_index_func(
            k, (mr, mc), plan.index_group, dtype, tgt, density_threshold=density_threshold))
        index_src = a2
    # the micro-tile the index is built for (a tensor-core plan may cover a thinner one)
    # a static row count is part of the name: the kernel's tile width may depend on it
    name = (f"pit_kernel_{tag}" + (_epilogue_tag(bias, activation, row_scale, residual) if in_kernel else "")
            + ("_masked" if masks else "") + ("_ascale" if epilogue.get("row_scale_a") else "")
            + (f"_m{int(m)}" if isinstance(m, (int, tirx.IntImm)) and is_gpu(tgt) else ""))
    kernel_gv = bb.add_func(kernel.with_attr("pit.micro_tile", [int(x) for x in plan.micro_tile])
                            .with_attr("global_symbol", name), name)
    a_in = a2
    if strips:   # the index, and the SRead of thin micro-tiles, in one pass over A
        offsets, ids, a2 = _emit_strips(bb, a2, m, k, plan.micro_tile[1], dtype, density_threshold,
                                        f"{tag}{dens_tag}")
    else:
        index = _emit_index(bb, index_gv, index_src, groups, capacity)
        offsets, ids = bb.emit(relax.TupleGetItem(index, 0)), bb.emit(relax.TupleGetItem(index, 1))
    if compact is not None:   # SRead of thin micro-tiles as a kernel of its own
        compact_gv = _add_once(bb, f"pit_compact_{tag}", lambda: compact)
        a2 = bb.emit(relax.call_tir(compact_gv, [a2, offsets, ids], relax.TensorType([m, k], dtype)))
    epilogue_args = ([bias] + _row_scale_arg(bb, row_scale if scaled is None else scaled[1], m, dtype)
                     + _residual_arg(bb, residual, m, n) if in_kernel else [])
    c = bb.emit(relax.call_tir(kernel_gv, [a2, b, offsets, ids] + epilogue_args, relax.TensorType([m, n], out_dtype)))
    for tier, few_rows_kernel in enumerate(few_rows_kernels):
        # a few-rows tier writes C in place when its row count skipped the kernels before it
        few_gv = _add_once(bb, name.replace("pit_kernel_", f"pit_few_rows{tier}_"),
                           lambda few_rows_kernel=few_rows_kernel: few_rows_kernel)
        c = bb.emit(relax.call_tir_inplace(few_gv, [a2, b, offsets, ids] + epilogue_args + [c], [4 + len(epilogue_args)],
                                           relax.TensorType([m, n], out_dtype)))
    if dense_fallback is not None:
        # a full index (the device-side dense fallback, or a dense pattern): the tiles kernel
        # and the compaction skipped their work, the dense kernel writes C in place
        fallback_gv = _add_once(bb, name.replace("pit_kernel_", "pit_dense_fallback_"), lambda: dense_fallback)
        c = bb.emit(relax.call_tir_inplace(fallback_gv, [a_in, b, offsets] + epilogue_args + [c],
                                           [3 + len(epilogue_args)], relax.TensorType([m, n], out_dtype)))
    c = _from_rows(bb, c, lead, n)
    return c if in_kernel else emit_epilogue(bb, c, bias, activation, row_scale, residual)


def effective_density_threshold(density_threshold, dense_kernel_takes_full_index: bool):
    """The density threshold the index applies: ``density_threshold`` only where a dense kernel
    runs a full index (the wgmma tiles kernels on sm_90a: TMA loads, or a dense kernel in
    place), else None.  Elsewhere (whole rows on every target, the CPU, the mma.sync and SIMT
    tiles kernels) the kernel gathers through the index whatever it lists, so listing every
    micro-tile would only compute the zero ones, and would make a NaN / Inf in B reach C through
    them (0 * NaN) above the threshold only: off, a skipped micro-tile contributes exactly 0 at
    every density (docs/guide/semantics.md)."""
    return density_threshold if dense_kernel_takes_full_index else None


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


def _wgmma_epilogue_applies(k, n, dtype, out_dtype, target, bias, activation, row_scale, residual,
                            a_ty) -> bool:
    """Whether the wgmma kernel runs this epilogue (sm_90a, its shapes and dtypes, a ``[N]``
    bias of the input dtype, a row scale over ``a``'s rows, a residual after a bias alone)."""
    from pit_tvm.schedules.wgmma import wgmma_applies

    b_shape = getattr(bias.ty, "shape", None)
    return (wgmma_applies(k, n, dtype, out_dtype, _arch_of(target)) and str(bias.ty.dtype) == dtype
            and b_shape is not None and len(b_shape) == 1 and isinstance(b_shape[0], tirx.IntImm)
            and int(b_shape[0]) == n and (row_scale is None or is_row_scale(row_scale, a_ty))
            and (residual is None or (activation is None and row_scale is None
                                      and _is_residual(residual, a_ty, n, out_dtype))))


#: the fraction of a PIT matmul's rows a tile-width choice plans for by default (the count is
#: only known on the device; a rows index is there because rows are expected to be missing);
#: ``expected_density`` of emit_pit_matmul / compile_onnx replaces it
PIT_EXPECTED_DENSITY = 0.5


def planned_density(value) -> float:
    """``value`` (a fraction of rows in (0, 1]) or the default; ValueError naming it otherwise"""
    if value is None:
        return PIT_EXPECTED_DENSITY
    density = float(value)
    if not 0.0 < density <= 1.0:
        raise ValueError(f"expected_density is a fraction of rows in (0, 1], got {value!r}")
    return density


def _rows_hint(m, fraction: float):
    """``fraction`` of a static row count, or None for a symbolic one."""
    return max(1, int(int(m) * fraction)) if isinstance(m, (int, tirx.IntImm)) else None


def _cuda_wgmma_tiles(plan: MatmulPlan, dtype: str, out_dtype: str, arch: str, rows_hint=None,
                      bias: bool = False, residual: bool = False, tuning_log=None):
    """On sm_90a, for micro-tiles along K with rows dividing 128: ``(plan covered by 128-row
    strips, the wgmma tiles kernel, the A-compaction kernel or None, the dense fallback
    kernel or None (the warp-specialized tiles kernel runs a full index itself), whether the
    index is the one pass of :mod:`pit_tvm.schedules.wgmma_strips`)`` (which compacts A
    itself); else None.  ``bias`` / ``residual``: both GEMM kernels run that
    epilogue.  ``tuning_log``: the tiles of its best ``wgmma.tiles`` record (the loader
    warpgroup only where this epilogue takes it), else the planned ones."""
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
    return MatmulPlan(plan.k, plan.n, (BLOCK_M, mk)), kernel, compact, dense_fallback, strips


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
    index_gv = _add_once(bb, f"pit_row_index_{dtype}{dens_tag}", lambda: tile_index_func(
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

    list_gv = _add_once(bb, f"pit_strips_{tag}", lambda: strip_list_func(k, mk, dtype))
    pack_gv = _add_once(bb, f"pit_index_{tag}", lambda: strip_pack_func(k, mk, density_threshold))
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


def _add_once(bb, name, make):
    """The function ``name`` of the module being built: ``make()`` added on first use only (an
    index PrimFunc is fully named by its shape, dtype and threshold, and takes ~0.1 s to
    generate; a model asks for the same one for every matmul of a shape)."""
    mod = bb.get()
    if any(gv.name_hint == name for gv in mod.get_global_vars()):
        return mod.get_global_var(name)
    return bb.add_func(make().with_attr("global_symbol", name), name)


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
    if (row_scale is not None or residual is not None) and (bias is None or not _wgmma_epilogue_applies(
            k, n, dtype, out_dtype, target, bias, activation, row_scale, residual, a_ty)):
        return None
    # A = x * s, s a row scale (the row_scale, or without one any [..., 1] tensor the kernel
    # takes): the kernel reads x and scales its product's rows, before the bias
    scaled = (_row_scaled_input(bb, a, a_ty, row_scale) if bias is not None and residual is None else None)
    if scaled is not None and row_scale is None and not _wgmma_epilogue_applies(
            k, n, dtype, out_dtype, target, bias, activation, scaled[1], None, a_ty):
        scaled = None
    kernel = _cuda_dense_kernel(k, n, dtype, out_dtype, bias is not None, activation,
                                _arch_of(target), rows, row_scale is not None, residual is not None,
                                scaled is not None)
    if kernel is None:
        return None
    a2, m, lead = _as_rows(bb, a if scaled is None else scaled[0], k)
    # rows is part of the name: the tile width may depend on it
    name = (f"tc_dense_matmul_k{k}_n{n}_{dtype}_{out_dtype}"
            f"{_epilogue_tag(bias, activation, row_scale, residual)}{'_ascale' if scaled is not None else ''}"
            f"{f'_m{rows}' if rows else ''}")
    gv = bb.add_func(kernel.with_attr("global_symbol", name), name)
    # (the row-scale parameter: the row scale, or the scale of A's rows; one tensor where both)
    args = ([a2, b] + ([bias] if bias is not None else [])
            + _row_scale_arg(bb, row_scale if scaled is None else scaled[1], m, dtype)
            + _residual_arg(bb, residual, m, n))
    c = bb.emit(relax.call_tir(gv, args, relax.TensorType([m, n], out_dtype)))
    return _from_rows(bb, c, lead, n)


#: what the CPU dense twin takes (fp32 accumulation; LLVM computes fp16 in fp32 too)
CPU_DENSE_DTYPES = ("float32", "float16")
#: Relax's ``kOpaque`` operator pattern (``op_pattern`` attr): FuseOps leaves the call alone
OPAQUE_OP_PATTERN = 8


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


def _row_scaled_input(bb, a, a_ty, scale=None):
    """``(x, s)`` when ``a`` is bound to ``multiply(x, s)`` (either order) with ``s`` a row scale
    of ``a`` (:func:`is_row_scale`; ``scale`` itself where given) and ``x`` of ``a``'s shape and
    dtype: a kernel can read x and scale its product's rows instead (``row_scale_a``), so the
    multiply need not run.  Else None."""
    from tvm import relax

    value = bb.lookup_binding(a) if isinstance(a, relax.Var) else None
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.multiply"):
        return None
    for x, s in (value.args, value.args[::-1]):
        if ((s.same_as(scale) if scale is not None else is_row_scale(s, a_ty))
                and isinstance(getattr(x, "ty", None), relax.TensorType) and str(x.ty.dtype) == str(a_ty.dtype)
                and x.ty.shape is not None and same_dims(x.ty.shape, a_ty.shape)):
            return x, s
    return None


def _epilogue_tag(bias, activation, row_scale, residual=None) -> str:
    return (f"{'_bias' if bias is not None else ''}{f'_{activation}' if activation else ''}"
            f"{'_rowscale' if row_scale is not None else ''}{'_residual' if residual is not None else ''}")


def same_dims(xs, ys) -> bool:
    """two (static or symbolic) shapes are the same, dim by dim"""
    import tvm_ffi

    return (xs is not None and ys is not None and len(xs) == len(ys)
            and all(tvm_ffi.structural_equal(x, y) for x, y in zip(xs, ys)))


def _is_residual(residual, a_ty, n, out_dtype) -> bool:
    """``residual`` is the result's shape (``a``'s leading shape + ``[N]``) in ``out_dtype``."""
    shape = getattr(residual.ty, "shape", None)
    return (shape is not None and a_ty.shape is not None and len(shape) == len(a_ty.shape)
            and str(residual.ty.dtype) == out_dtype and isinstance(shape[-1], tirx.IntImm) and int(shape[-1]) == n
            and same_dims(list(shape)[:-1], list(a_ty.shape)[:-1]))


def _residual_arg(bb, residual, m, n) -> list:
    from tvm import relax

    return [] if residual is None else [bb.emit(relax.op.reshape(residual, [m, n]))]


def is_row_scale(row_scale, a_ty) -> bool:
    """``row_scale`` is ``a``'s leading shape + ``[1]`` (one value per row of ``a``)."""
    shape = getattr(row_scale.ty, "shape", None)
    if (shape is None or a_ty.shape is None or len(shape) != len(a_ty.shape)
            or not isinstance(shape[-1], tirx.IntImm) or int(shape[-1]) != 1):
        return False
    return same_dims(list(shape)[:-1], list(a_ty.shape)[:-1])


def _row_scale_arg(bb, row_scale, m, dtype) -> list:
    """The kernel's ``[M]`` row-scale argument (reshaped, and cast to the kernel's input dtype)."""
    from tvm import relax

    if row_scale is None:
        return []
    rs = bb.emit(relax.op.reshape(row_scale, [m]))
    if str(rs.ty.dtype) != dtype:
        rs = bb.emit(relax.op.astype(rs, dtype))
    return [rs]


def emit_epilogue(bb, c, bias=None, activation=None, row_scale=None, residual=None):
    """The epilogue chain as Relax ops after ``c`` (where no kernel runs it): ``c + bias``, the
    activation (GELU in its erf form), ``* row_scale``, ``+ residual``."""
    from tvm import relax

    dtype = str(c.ty.dtype)
    if bias is not None:
        c = bb.emit(relax.op.add(c, bias))
    if activation == "relu":
        c = bb.emit(relax.op.nn.relu(c))
    elif activation == "gelu":
        half, one, inv_sqrt2 = (relax.const(v, dtype) for v in (0.5, 1.0, 0.7071067811865476))
        c = bb.emit(relax.op.multiply(relax.op.multiply(c, half),
                                      relax.op.add(one, relax.op.erf(relax.op.multiply(c, inv_sqrt2)))))
    elif activation is not None:
        raise ValueError(f"unknown activation {activation!r}: use None, 'relu' or 'gelu'")
    if row_scale is not None:
        c = bb.emit(relax.op.multiply(c, row_scale))
    if residual is not None:
        c = bb.emit(relax.op.add(c, residual))
    return c


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
