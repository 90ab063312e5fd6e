"""MetaSchedule design space of the tensor-core PIT row-gather matmul.

Kept as one module: every knob set (mma.sync / wgmma; rows / tiles / grouped) is a
:class:`KnobSet` over the same trace machinery (the ``pit.tc.`` annotations,
:class:`ApplyPitKnobs`, :func:`config_from_trace`), looked up by workload name (``KNOBSETS``).

The kernel is :func:`pit_tvm.schedules.tensorcore.schedule_row_gather_matmul`; its knobs
(:class:`~pit_tvm.schedules.tensorcore.TensorCoreConfig`) are what MetaSchedule searches:

    block_m  in (32, 64, 128, 256)   thread block tile over the compacted rows p
    block_n  in (64, 128, 256)       thread block tile over N
    warp_m   in (32, 64)             warp tile (block_m / warp_m x block_n / warp_n warps)
    warp_n   in (32, 64)
    block_k  in (16, 32, 64)         K tile of one pipeline stage
    stages   in (1, 2, 3, 4)         software pipeline depth (cp.async multi-buffering)

How the knobs live in a MetaSchedule trace
------------------------------------------
Each knob is a ``SampleCategorical`` whose value is written, as a random variable, into an
annotation ``pit.tc.<knob>`` of the ``zero_fill`` block.  Everything that depends on the knob
values (``pad_einsum`` paddings, split factors, warp counts of the copy loops,
``storage_align``, pipeline annotations) takes plain ints, which a trace records as
literals: had the space function applied the schedule directly, MetaSchedule's evolutionary
search (which re-samples a design space by replaying its trace *with the decisions
cleared*, and mutates decisions of measured traces) would re-sample the knobs while
replaying the old literals.  So the schedule itself is applied by the postprocessor
:class:`ApplyPitKnobs`, after ``EnterPostproc``: it reads the (re-)sampled annotation
values and runs :func:`~pit_tvm.schedules.tensorcore.apply_row_gather_schedule`.
MetaSchedule replays traces with ``remove_postproc=True`` and re-runs the postprocs, so
every candidate is consistent with its decisions.

:func:`pit_space` (the ``ScheduleFn``) samples the knobs, annotates, calls
``enter_postproc`` and applies the schedule itself, so a design space it generates *is* the
scheduled kernel (for a valid knob combination picked from the schedule's random state);
:class:`ApplyPitKnobs` is a no-op on it (the annotations are gone).

Invalid combinations (too much shared memory, more than 1024 threads, tiles not dividing
K/N, ...) are rejected by the postprocessor (MetaSchedule counts them as failed samples and
draws again).  :class:`MutateKnob` moves one knob to another value (the stock mutators only
know tile sizes, unroll, parallel and thread bindings).

Not in the trace: :func:`~pit_tvm.schedules.tensorcore.add_early_exit` is an IR
post-process, not a schedule primitive; :class:`PitBuilder` (the builder) and
:func:`pit_tvm.tuning.tune.load_best` re-apply it.

The wgmma kernel (sm_90a)
-------------------------
The H100's kernel (:func:`pit_tvm.schedules.wgmma.wgmma_row_gather_func`) is written in TIRx,
not scheduled from the workload, so its knobs (:data:`WGMMA_KNOBS`: the tile width and the
ring depth of :class:`~pit_tvm.schedules.wgmma.WgmmaConfig`) are samples of the same kind,
annotated ``pit.wgmma.<knob>`` (:data:`WGMMA`), with no schedule after them: the postprocessor
:class:`ApplyPitKnobs` rejects combinations that do not fit, and :class:`PitBuilder` builds
the TIRx kernel of the annotated config in place of the workload.  The same search, cost
model, database and :class:`MutateKnob` serve both kernels; the XGBoost model, whose features
are read from the (here unscheduled) workload, ranks nothing for it, so the search is the
evolutionary one over a space of at most 16 configs.

The tiles kinds (micro-tiles along K)
-------------------------------------
The same two shapes serve micro-tiles ``(mr, mk)`` with ``mk < K``, whose workload is
:func:`tiles_tuning_workload` (:func:`~pit_tvm.schedules.tensorcore_tiles.tiles_gather_matmul_func`
at a static M): :data:`MMA_SYNC_TILES` samples the mma.sync tiles schedule's knobs
(:data:`TILES_KNOBS` of :class:`~pit_tvm.schedules.tensorcore_tiles.TilesConfig`, applied in the
trace by :func:`~pit_tvm.schedules.tensorcore_tiles.apply_tiles_schedule`; the builder re-applies
its IR post-process :func:`~pit_tvm.schedules.tensorcore_tiles.set_dynamic_k_extent`), and
:data:`WGMMA_TILES` the wgmma tiles kernel's (:data:`WGMMA_TILES_KNOBS`: tile width, ring
depth, whether a loader warpgroup feeds the K loop), built as TIRx in place of the workload.
Each kernel's knobs, where they are annotated, which configs fit a workload and how a
candidate is made from them are one :class:`KnobSet` (:data:`KNOBSETS`), so one space function
(:func:`pit_space`), one postprocessor (:class:`ApplyPitKnobs`) and one builder serve all four.
The knobs are ``SampleCategorical`` draws, not ``sample_perfect_tile`` splits: a tensor-core
tile must be a multiple of the mma / wgmma shape and fit shared memory, so the legal tiles are
a short list of powers of two (and 192), not any factorisation of the loop.
"""
from __future__ import annotations

import functools
import itertools
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import tvm
from tvm import s_tir, tirx
from tvm.script import tirx as T
from tvm.s_tir import meta_schedule as ms
from tvm.ir.utils import derived_object

from pit_tvm.schedules.wgmma import (
    WGMMA_ARCH,
    WgmmaConfig,
    tiles_ws_applies,
    wgmma_applies,
    wgmma_config,
    wgmma_row_gather_func,
    wgmma_tiles_applies,
    wgmma_tiles_config,
    wgmma_tiles_gather_func,
)
from pit_tvm.schedules.tensorcore import (
    TensorCoreConfig,
    _workload_params,
    add_early_exit,
    apply_row_gather_schedule,
    check_config,
    max_smem_bytes,
    row_gather_matmul_func,
    valid_configs,
)
from pit_tvm.schedules.tensorcore_tiles import (
    TilesConfig,
    apply_tiles_schedule,
    check_tiles_config,
    set_dynamic_k_extent,
    tiles_gather_matmul_func,
    tiles_workload_params,
    valid_tiles_configs,
)

__all__ = [
    "KNOBS",
    "WGMMA_KNOBS",
    "TILES_KNOBS",
    "WGMMA_TILES_KNOBS",
    "ANN_PREFIX",
    "KnobSet",
    "MMA_SYNC",
    "WGMMA",
    "MMA_SYNC_TILES",
    "WGMMA_TILES",
    "KNOBSETS",
    "knobset_of",
    "valid_wgmma_configs",
    "valid_tiles_knob_configs",
    "valid_wgmma_tiles_configs",
    "tuning_workload",
    "tiles_tuning_workload",
    "valid_knob_configs",
    "pit_space",
    "ApplyPitKnobs",
    "MutateKnob",
    "space_generator",
    "config_from_schedule",
    "config_from_trace",
    "knob_schedule",
    "prepare_candidate",
    "PitBuilder",
]

#: knob -> candidate values (the categorical supports)
KNOBS: "OrderedDict[str, tuple[int, ...]]" = OrderedDict(
    block_m=(32, 64, 128, 256),
    block_n=(64, 128, 256),
    warp_m=(32, 64),
    warp_n=(32, 64),
    block_k=(16, 32, 64),
    stages=(1, 2, 3, 4),
)
#: mild priors towards the configs that measured well on the H100 (128x128x32/64, s2-4)
_PRIORS = {
    "block_m": (0.15, 0.3, 0.4, 0.15),
    "block_n": (0.3, 0.45, 0.25),
    "warp_m": (0.4, 0.6),
    "warp_n": (0.4, 0.6),
    "block_k": (0.2, 0.45, 0.35),
    "stages": (0.1, 0.3, 0.35, 0.25),
}
ANN_PREFIX = "pit.tc."
#: the wgmma kernel's knobs (sm_90a); block_k stays 64 (32 measured slower, see WgmmaConfig)
WGMMA_KNOBS: "OrderedDict[str, tuple[int, ...]]" = OrderedDict(
    block_n=(64, 128, 192, 256),
    stages=(3, 4, 5, 6),
)
_WGMMA_PRIORS = {"block_n": (0.15, 0.25, 0.25, 0.35), "stages": (0.3, 0.4, 0.15, 0.15)}


#: the mma.sync tiles schedule's knobs (:class:`TilesConfig`; block_m is the micro-tile's mr)
TILES_KNOBS: "OrderedDict[str, tuple[int, ...]]" = OrderedDict(
    block_n=(64, 128, 256),
    block_k=(16, 32, 64),
    warp_m=(16, 32, 64),
    warp_n=(32, 64),
    stages=(1, 2, 3, 4),
)
_TILES_PRIORS = {
    "block_n": (0.2, 0.4, 0.4),
    "block_k": (0.25, 0.45, 0.3),
    "warp_m": (0.3, 0.5, 0.2),
    "warp_n": (0.45, 0.55),
    "stages": (0.1, 0.3, 0.35, 0.25),
}
#: the wgmma tiles kernel's knobs: tile width, ring depth, and ``tiles_ws`` (1: a loader
#: warpgroup feeds the K loop, A's K tile by TMA; only where :func:`tiles_ws_applies`)
WGMMA_TILES_KNOBS: "OrderedDict[str, tuple[int, ...]]" = OrderedDict(
    block_n=(64, 128, 192, 256),
    stages=(3, 4, 5, 6),
    tiles_ws=(0, 1),
)
_WGMMA_TILES_PRIORS = {**_WGMMA_PRIORS, "tiles_ws": (0.4, 0.6)}


@dataclass(frozen=True)
class KnobSet:
    """One kernel's knobs as MetaSchedule samples, and what a candidate of them is.

    ``knobs`` / ``priors``: the categorical supports and their priors; ``prefix``: the
    annotation prefix that carries the values on the workload's block ``knob_block``;
    ``config_cls``: the config dataclass the knobs are fields of; ``workload``: the
    ``pit.workload`` prefix of the workloads it tunes; ``valid(workload, arch)``: the
    configs that fit one; ``planned(workload, arch)``: the config a build takes without a
    log.  A kernel scheduled from its workload has ``schedule(sch, config, arch)`` (applied
    in the trace by :class:`ApplyPitKnobs`) and ``finish(func)`` (its IR post-process,
    re-applied by the builder); a TIRx kernel has ``kernel(workload, config)``, built in
    place of the workload."""

    name: str
    knobs: "OrderedDict[str, tuple[int, ...]]"
    priors: dict
    prefix: str
    config_cls: type
    knob_block: str
    workload: str
    valid: Callable
    planned: Callable
    schedule: Callable | None = None
    finish: Callable | None = None
    kernel: Callable | None = None

    def config_of(self, annotations):
        """the config of ``annotations`` (a block's), None where they lack a knob"""
        if not all(self.prefix + name in annotations for name in self.knobs):
            return None
        return _config(self.config_cls, {name: int(annotations[self.prefix + name]) for name in self.knobs})

    def decision(self, config, name) -> int:
        """the index of ``config``'s value of knob ``name`` in its support"""
        value = int(getattr(config, name))
        if value not in self.knobs[name]:
            raise ValueError(f"{config}: {name}={value} is not one of the {self.name} knob's {self.knobs[name]}")
        return self.knobs[name].index(value)


#: the block that carries the knob annotations.  Not ``matmul``: in TVM 0.27 an ``annotate``
#: on a block of the gather_matmul subtree followed by the first ``split`` of the zero-fill
#: loops writes *in place* into the unscheduled PrimFunc the schedule was created from (a
#: copy-on-write slip of ScheduleState::Replace), which would corrupt MetaSchedule's task
#: module for every later candidate.  ``zero_fill`` is the first block the schedule touches,
#: so annotating it is safe (``tests/tuning/test_tuning.py`` checks the workload stays intact).
KNOB_BLOCK = "zero_fill"
#: the tiles workload's: ``store`` keeps its annotations through the schedule and leaves the
#: workload intact (``matmul`` loses them to ``blockize``; the root block is written in place)
TILES_KNOB_BLOCK = "store"
#: the tuning workload's rows when none is given: not a multiple of 16, so ``pad_einsum``
#: pads the last row tile exactly as for a runtime M (a static M that is a multiple of
#: block_m would leave nothing to pad, and the schedule expects the padded blocks)
DEFAULT_TUNE_M = 4096 + 8
ROWS_WORKLOAD = "row_gather_matmul_"
TILES_WORKLOAD = "tiles_gather_matmul_"


def _arch_of(target) -> str:
    if target is None:
        return "sm_90"
    arch = target.attrs.get("arch") if hasattr(target, "attrs") else None
    return str(arch) if arch else "sm_90"


def _arch_of_str(arch: str) -> str:
    return str(arch).rstrip("a")


def workload_tag(func: tirx.PrimFunc) -> str:
    """the ``pit.workload`` attribute of a tuning workload ('' where it has none)"""
    return str(func.attrs["pit.workload"]) if func.attrs is not None and "pit.workload" in func.attrs else ""


def _static_m(func: tirx.PrimFunc, m: int) -> tirx.PrimFunc:
    """``func`` with A's row count fixed to ``m``"""
    if int(m) <= 0:
        raise ValueError(f"tuning M must be positive, got {m}")
    a = func.params[0]
    buf = tirx.decl_buffer((tirx.const(int(m), "int64"), a.ty.shape[1]), str(a.ty.dtype), "A")
    return func.specialize({a: buf}).with_attr("global_symbol", "main")


def tuning_workload(k: int, n: int, dtype: str = "float16", out_dtype: str | None = None,
                    m: int = DEFAULT_TUNE_M) -> tirx.PrimFunc:
    """:func:`row_gather_matmul_func` with the row count fixed to ``m`` (MetaSchedule measures
    static shapes only).  ``m`` must not be a multiple of 16 (see ``DEFAULT_TUNE_M``)."""
    if int(m) % 16 == 0:
        raise ValueError(f"tuning M={m} must not be a multiple of 16 (the schedule pads the "
                         "last row tile; try M + 8)")
    return _static_m(row_gather_matmul_func(k, n, dtype, out_dtype or dtype), m)


def tiles_tuning_workload(k: int, n: int, micro_tile, dtype: str = "float16", out_dtype: str | None = None,
                          m: int = DEFAULT_TUNE_M, a_compact: bool = False) -> tirx.PrimFunc:
    """:func:`tiles_gather_matmul_func` of the kernel's micro-tile ``(mr, mk)`` with the row
    count fixed to ``m`` (the last strip ragged by default, as at run time)."""
    return _static_m(tiles_gather_matmul_func(k, n, micro_tile, dtype, out_dtype or dtype, a_compact=a_compact), m)


@functools.lru_cache(maxsize=None)
def valid_knob_configs(k: int, n: int, in_dtype: str, out_dtype: str,
                       arch: str = "sm_90") -> tuple[TensorCoreConfig, ...]:
    """Every knob combination of :data:`KNOBS` that fits a (K, N) problem."""
    return _product(KNOBS, TensorCoreConfig,
                    lambda cfg: check_config(k, n, in_dtype, cfg, max_smem_bytes(arch), out_dtype))


@functools.lru_cache(maxsize=None)
def valid_tiles_knob_configs(k: int, n: int, micro_tile, in_dtype: str, out_dtype: str, a_compact: bool,
                             arch: str = "sm_90") -> tuple[TilesConfig, ...]:
    """Every :data:`TILES_KNOBS` combination the mma.sync tiles schedule takes for (K, N, micro-tile)."""
    return _product(TILES_KNOBS, TilesConfig,
                    lambda cfg: check_tiles_config(k, n, micro_tile, in_dtype, cfg, max_smem_bytes(arch),
                                                   out_dtype, a_compact))


@functools.lru_cache(maxsize=None)
def valid_wgmma_configs(k: int, n: int, in_dtype: str, out_dtype: str) -> tuple[WgmmaConfig, ...]:
    """Every :data:`WGMMA_KNOBS` combination the wgmma rows kernel takes for (K, N): the tile
    width dividing N, the ring within shared memory."""
    if not wgmma_applies(k, n, in_dtype, out_dtype, WGMMA_ARCH):
        return ()
    return _product(WGMMA_KNOBS, WgmmaConfig, lambda cfg: _check_wgmma_fit(n, cfg, out_dtype))


@functools.lru_cache(maxsize=None)
def valid_wgmma_tiles_configs(k: int, n: int, mk: int, in_dtype: str, out_dtype: str) -> tuple[WgmmaConfig, ...]:
    """Every :data:`WGMMA_TILES_KNOBS` combination the wgmma tiles kernel takes for (K, N) and
    ``(128, mk)`` micro-tiles: as :func:`valid_wgmma_configs`, the loader warpgroup only where
    :func:`tiles_ws_applies` (the tuning workload has no residual)."""
    if not wgmma_tiles_applies(k, n, (128, mk), in_dtype, out_dtype, WGMMA_ARCH):
        return ()

    def check(cfg):
        _check_wgmma_fit(n, cfg, out_dtype)
        if cfg.tiles_ws and not tiles_ws_applies(mk, cfg.block_n, out_dtype, False):
            raise ValueError("no loader warpgroup for these tiles")

    return _product(WGMMA_TILES_KNOBS, WgmmaConfig, check)


def _check_wgmma_fit(n: int, cfg: WgmmaConfig, out_dtype: str) -> None:
    if n % cfg.block_n or cfg.smem_bytes(out_dtype) > max_smem_bytes(WGMMA_ARCH):
        raise ValueError(f"{cfg} does not fit N={n} or shared memory")


def _config(config_cls: type, values: dict):
    """``config_cls`` of knob ``values``, each as its field's type (a flag as a bool)"""
    default = config_cls()
    return config_cls(**{name: type(getattr(default, name))(value) for name, value in values.items()})


def _product(knobs, config_cls, check) -> tuple:
    """the configs of every combination of ``knobs`` that ``check`` does not raise ValueError on"""
    out = []
    for values in itertools.product(*knobs.values()):
        cfg = _config(config_cls, dict(zip(knobs, values)))
        try:
            check(cfg)
        except ValueError:
            continue
        out.append(cfg)
    return tuple(out)


# each knob set's workload readers: (workload, arch) -> the configs that fit it
def _valid_rows(func, arch):
    k, n, in_dtype, out_dtype, _ = _workload_params(func)
    return valid_knob_configs(k, n, in_dtype, out_dtype, _arch_of_str(arch))


def _valid_wgmma_rows(func, arch):
    k, n, in_dtype, out_dtype, _ = _workload_params(func)
    return valid_wgmma_configs(k, n, in_dtype, out_dtype)


def _valid_tiles(func, arch):
    k, n, in_dtype, out_dtype, micro_tile, a_compact = tiles_workload_params(func)
    return valid_tiles_knob_configs(k, n, micro_tile, in_dtype, out_dtype, a_compact, _arch_of_str(arch))


def _valid_wgmma_tiles(func, arch):
    k, n, in_dtype, out_dtype, (mr, mk), _ = tiles_workload_params(func)
    return valid_wgmma_tiles_configs(k, n, mk, in_dtype, out_dtype) if mr == 128 else ()


def _planned_rows(func, arch):
    k, n, in_dtype, _, _ = _workload_params(func)
    return valid_configs(k, n, in_dtype, _arch_of_str(arch))[0]


def _planned_wgmma_rows(func, arch):
    return wgmma_config(_workload_params(func)[1])


def _planned_tiles(func, arch):
    k, n, in_dtype, _, micro_tile, a_compact = tiles_workload_params(func)
    return valid_tiles_configs(k, n, micro_tile, in_dtype, _arch_of_str(arch), a_compact=a_compact)[0]


def _planned_wgmma_tiles(func, arch):
    _, n, _, out_dtype, (_, mk), _ = tiles_workload_params(func)
    return wgmma_tiles_config(n, mk, out_dtype=out_dtype)


def _wgmma_rows_kernel(func, cfg):
    k, n, in_dtype, out_dtype, bias = _workload_params(func)
    return wgmma_row_gather_func(k, n, in_dtype, out_dtype, bias=bias, config=cfg)


def _wgmma_tiles_kernel(func, cfg):
    k, n, in_dtype, out_dtype, (_, mk), _ = tiles_workload_params(func)
    return wgmma_tiles_gather_func(k, n, mk, in_dtype, out_dtype, config=cfg)


#: the mma.sync rows schedule's knobs (sm_80 / sm_90)
MMA_SYNC = KnobSet("mma.sync", KNOBS, _PRIORS, ANN_PREFIX, TensorCoreConfig, KNOB_BLOCK, ROWS_WORKLOAD,
                   _valid_rows, _planned_rows, schedule=apply_row_gather_schedule,
                   finish=add_early_exit)
#: the wgmma rows kernel's knobs (sm_90a)
WGMMA = KnobSet("wgmma", WGMMA_KNOBS, _WGMMA_PRIORS, "pit.wgmma.", WgmmaConfig, KNOB_BLOCK, ROWS_WORKLOAD,
                _valid_wgmma_rows, _planned_wgmma_rows, kernel=_wgmma_rows_kernel)
#: the mma.sync tiles schedule's knobs (sm_80 / sm_90)
MMA_SYNC_TILES = KnobSet("mma.sync.tiles", TILES_KNOBS, _TILES_PRIORS, "pit.tc_tiles.", TilesConfig,
                         TILES_KNOB_BLOCK, TILES_WORKLOAD, _valid_tiles, _planned_tiles,
                         schedule=apply_tiles_schedule,
                         finish=set_dynamic_k_extent)
#: the wgmma tiles kernel's knobs (sm_90a)
WGMMA_TILES = KnobSet("wgmma.tiles", WGMMA_TILES_KNOBS, _WGMMA_TILES_PRIORS, "pit.wgmma_tiles.",
                      WgmmaConfig, TILES_KNOB_BLOCK, TILES_WORKLOAD, _valid_wgmma_tiles,
                      _planned_wgmma_tiles, kernel=_wgmma_tiles_kernel)
# --------------------------------------------------------------------------------------
# the MoE grouped GEMM (sm_90a): :func:`pit_tvm.schedules.hopper.grouped.wgmma_grouped_gemm_func`
# --------------------------------------------------------------------------------------
#: the grouped wgmma kernel's knobs: the tile width and the ring depth, up to the few-rows
#: tier's 8 stages (decode-size T: :func:`~pit_tvm.schedules.hopper.grouped.grouped_config`)
GROUPED_KNOBS: "OrderedDict[str, tuple[int, ...]]" = OrderedDict(
    block_n=(64, 128, 192, 256),
    stages=(3, 4, 5, 6, 7, 8),
)
_GROUPED_PRIORS = {"block_n": (0.3, 0.25, 0.15, 0.3), "stages": (0.15, 0.25, 0.15, 0.15, 0.1, 0.2)}
GROUPED_WORKLOAD = "grouped_gemm_"
#: the grouped workload's first block (no schedule follows the annotation: a TIRx kernel)
GROUPED_KNOB_BLOCK = "expert_of"
_GROUPED_RE = r"^grouped_gemm_(gather|scatter|glu)_k(\d+)_n(\d+)_e(\d+)_top(\d+)_t(\d+)_([a-z0-9]+)_([a-z0-9]+)$"


def grouped_tuning_workload(mode: str, k: int, n: int, num_experts: int, top_k: int, tokens: int,
                            dtype: str = "float16", out_dtype: str | None = None) -> tirx.PrimFunc:
    """The MoE grouped GEMM's tuning workload: the kernel's parameters (gather ``X[T, K],
    assignments[P], offsets[E+1], W[E, K, N], H[P, N]``; scatter ``H[P, K], assignments[P],
    offsets[E+1], W[E, K, N], route_weight[P], Y[P, N]``; glu, both halves of a gated fc1,
    gather's with a second weight ``W3[E, K, N]`` after W) with ``T = tokens`` and
    ``P = tokens * top_k`` static (MetaSchedule measures static shapes).  Its body (each
    position's expert from the offsets, then the gathered GEMM) carries the knob annotations
    and the cost model's features; it is never built: the candidate is the TIRx kernel of the
    annotated config (:func:`prepare_candidate`).  No bias, no activation: the tiles do not
    depend on the epilogue.  (glu's body reads W and W3 in one product: the loads of both
    halves for the features, not the function the kernel computes.)"""
    out_dtype = out_dtype or dtype
    E, K, N, TK, NT = int(num_experts), int(k), int(n), int(top_k), int(tokens)
    if min(E, K, N, TK, NT) <= 0 or mode not in ("gather", "scatter", "glu"):
        raise ValueError(f"grouped tuning workload: mode gather/scatter/glu and positive sizes, got {mode!r}, "
                         f"K={k}, N={n}, E={num_experts}, top_k={top_k}, tokens={tokens}")
    P = NT * TK
    rows = P if mode == "scatter" else NT

    gather = mode != "scatter"

    @T.macro
    def body(A, ASG, OFF, W, RW, C, W3=None):
        EXP = T.alloc_buffer((P,), "int32")
        for p, e in T.grid(P, E):
            with T.sblock("expert_of"):
                vp, ve = T.axis.remap("SR", [p, e])
                with T.init():
                    EXP[vp] = 0
                EXP[vp] = EXP[vp] + T.Select(OFF[ve + 1] <= vp, 1, 0)
        for p, j, kk in T.grid(P, N, K):
            with T.sblock("matmul"):
                vp, vj, vk = T.axis.remap("SSR", [p, j, kk])
                with T.init():
                    C[vp, vj] = T.Cast(out_dtype, 0)
                C[vp, vj] = C[vp, vj] + T.Cast(out_dtype, (RW[vp] if not gather else T.float32(1)) * T.Cast(
                    "float32", A[ASG[vp] // TK if gather else vp, vk]) * T.Cast("float32", W[EXP[vp], vk, vj])
                    * (T.Cast("float32", W3[EXP[vp], vk, vj]) if W3 is not None else T.float32(1)))

    if mode == "glu":     # (each prim_func is parsed where it is defined: only the mode's)
        @T.prim_func(s_tir=True)
        def glu_workload(a: T.handle, s: T.handle, o: T.handle, w: T.handle, w3: T.handle, c: T.handle):
            A = T.match_buffer(a, (rows, K), dtype)
            ASG = T.match_buffer(s, (P,), "int32")
            OFF = T.match_buffer(o, (E + 1,), "int32")
            W = T.match_buffer(w, (E, K, N), dtype)
            W3 = T.match_buffer(w3, (E, K, N), dtype)
            C = T.match_buffer(c, (P, N), out_dtype)
            body(A, ASG, OFF, W, None, C, W3)

        func = glu_workload
    elif gather:
        @T.prim_func(s_tir=True)
        def gather_workload(a: T.handle, s: T.handle, o: T.handle, w: T.handle, c: T.handle):
            A = T.match_buffer(a, (rows, K), dtype)
            ASG = T.match_buffer(s, (P,), "int32")
            OFF = T.match_buffer(o, (E + 1,), "int32")
            W = T.match_buffer(w, (E, K, N), dtype)
            C = T.match_buffer(c, (P, N), out_dtype)
            body(A, ASG, OFF, W, None, C)

        func = gather_workload
    else:
        @T.prim_func(s_tir=True)
        def scatter_workload(a: T.handle, s: T.handle, o: T.handle, w: T.handle, r: T.handle, c: T.handle):
            A = T.match_buffer(a, (rows, K), dtype)
            ASG = T.match_buffer(s, (P,), "int32")
            OFF = T.match_buffer(o, (E + 1,), "int32")
            W = T.match_buffer(w, (E, K, N), dtype)
            RW = T.match_buffer(r, (P,), "float32")
            C = T.match_buffer(c, (P, N), out_dtype)
            body(A, ASG, OFF, W, RW, C)

        func = scatter_workload
    tag = f"{GROUPED_WORKLOAD}{mode}_k{K}_n{N}_e{E}_top{TK}_t{NT}_{dtype}_{out_dtype}"
    return func.with_attrs({"global_symbol": "main", "pit.workload": tag, "tirx.noalias": True})


def grouped_workload_params(func: tirx.PrimFunc):
    """``(mode, K, N, E, top_k, tokens, in_dtype, out_dtype)`` of a :func:`grouped_tuning_workload`"""
    import re

    mt = re.match(_GROUPED_RE, workload_tag(func))
    if not mt:
        raise ValueError(f"not a grouped GEMM tuning workload: {workload_tag(func) or '?'}")
    mode, *sizes, in_dtype, out_dtype = mt.groups()
    return (mode, *(int(v) for v in sizes), in_dtype, out_dtype)


@functools.lru_cache(maxsize=None)
def valid_grouped_configs(mode: str, k: int, n: int, num_experts: int, top_k: int, in_dtype: str,
                          out_dtype: str) -> tuple[WgmmaConfig, ...]:
    """Every :data:`GROUPED_KNOBS` combination the grouped wgmma kernel takes (its checks,
    :func:`~pit_tvm.schedules.hopper.grouped.check_grouped_config`)"""
    from pit_tvm.schedules.hopper.grouped import check_grouped_config

    return _product(GROUPED_KNOBS, WgmmaConfig,
                    lambda cfg: check_grouped_config(mode, k, n, num_experts, top_k, in_dtype, out_dtype, cfg))


def _valid_grouped(func, arch):
    mode, k, n, e, top_k, _, in_dtype, out_dtype = grouped_workload_params(func)
    return valid_grouped_configs(mode, k, n, e, top_k, in_dtype, out_dtype)


def _planned_grouped(func, arch):
    from pit_tvm.schedules.hopper.grouped import planned_config

    mode, _, n, e, top_k, tokens, _, _ = grouped_workload_params(func)
    return planned_config(mode, n, e, top_k, tokens)


def _grouped_kernel(func, cfg):
    from pit_tvm.schedules.hopper.grouped import wgmma_grouped_gemm_func

    mode, k, n, e, top_k, _, in_dtype, out_dtype = grouped_workload_params(func)
    return wgmma_grouped_gemm_func(mode, k, n, e, top_k, in_dtype, out_dtype, False, None, cfg).with_attr(
        "global_symbol", "main")


#: the MoE grouped wgmma kernel's knobs (sm_90a)
WGMMA_GROUPED = KnobSet("wgmma.grouped", GROUPED_KNOBS, _GROUPED_PRIORS, "pit.wgmma_grouped.", WgmmaConfig,
                        GROUPED_KNOB_BLOCK, GROUPED_WORKLOAD, _valid_grouped, _planned_grouped,
                        kernel=_grouped_kernel)
#: each kernel's knobs by its name (:func:`pit_tvm.tuning.tune.tuned_kernel`)
KNOBSETS = {ks.name: ks for ks in (MMA_SYNC, WGMMA, MMA_SYNC_TILES, WGMMA_TILES, WGMMA_GROUPED)}


def knobset_of(config, workload: tirx.PrimFunc) -> KnobSet:
    """the knob set whose configs ``config`` is of, for ``workload``'s kind"""
    tag = workload_tag(workload)
    for ks in KNOBSETS.values():
        if tag.startswith(ks.workload) and isinstance(config, ks.config_cls):
            return ks
    raise ValueError(f"no knob set for {type(config).__name__} on workload {tag or '?'}")


def config_from_schedule(sch: s_tir.Schedule, knobset: KnobSet = MMA_SYNC):
    """The knob values of ``knobset`` annotated on its block of ``sch`` (None if absent)."""
    try:
        block = sch.get(sch.get_sblock(knobset.knob_block, func_name="main"))
    except Exception:  # noqa: BLE001 - block gone (already scheduled) or not our workload
        return None
    return knobset.config_of(block.annotations)


def _annotated(sch: s_tir.Schedule, knobsets=None):
    """(knob set, config) of the knobs annotated on ``sch`` (of ``knobsets``, default all), or
    (None, None)"""
    for ks in knobsets or KNOBSETS.values():
        cfg = config_from_schedule(sch, ks)
        if cfg is not None:
            return ks, cfg
    return None, None


def config_from_trace(trace, workload: tirx.PrimFunc | tvm.IRModule, knobset: KnobSet | None = MMA_SYNC):
    """Replay the knob part of ``trace`` (``remove_postproc=True``) on ``workload`` and read
    the knob values of ``knobset`` back (None: of whichever kernel's knobs it carries).  Raises
    when the trace does not replay or carries no such knobs."""
    mod = workload if isinstance(workload, tvm.IRModule) else tvm.IRModule({"main": workload})
    sch = s_tir.Schedule(mod)
    trace.apply_to_schedule(sch, remove_postproc=True)
    _, cfg = _annotated(sch, None if knobset is None else [knobset])
    if cfg is None:
        raise ValueError(f"the trace carries no {knobset.prefix if knobset else 'pit.*.'}* knob annotations")
    return cfg


def _sample_knobs(sch: s_tir.Schedule, decisions, knobset: KnobSet):
    block = sch.get_sblock(knobset.knob_block, func_name="main")
    for name, cands in knobset.knobs.items():
        decision = None if decisions is None else knobset.decision(decisions, name)
        rv = sch.sample_categorical(list(cands), list(knobset.priors[name]), decision=decision)
        sch.annotate(block, knobset.prefix + name, rv)


def _apply_annotated(sch: s_tir.Schedule, knobset: KnobSet, arch: str) -> bool:
    """Make ``sch`` the candidate of its knob annotations: check the config fits, and for a
    scheduled kernel apply its schedule (the annotations go); False when it does not fit."""
    cfg = config_from_schedule(sch, knobset)
    if cfg is None:
        return True  # nothing to do: already scheduled (a design space from pit_space)
    if cfg not in knobset.valid(sch.mod["main"], arch):
        return False
    if knobset.schedule is None:
        return True  # a TIRx kernel: PitBuilder builds the annotated config
    block = sch.get_sblock(knobset.knob_block, func_name="main")
    for name in knobset.knobs:
        sch.unannotate(block, knobset.prefix + name)
    try:
        knobset.schedule(sch, cfg, _arch_of_str(arch))
    except Exception:  # noqa: BLE001 - ValueError, TVMError: a failed candidate
        return False
    return True


def pit_space(sch: s_tir.Schedule, knobset: KnobSet = MMA_SYNC, arch: str = "sm_90") -> s_tir.Schedule:
    """``ScheduleFn`` body: sample ``knobset``'s knobs into annotations, ``enter_postproc``,
    and make the candidate (schedule it, or leave the TIRx kernel to the builder).

    The knob values of this design space are one valid combination drawn from the
    schedule's random state (``sch.fork_seed()``), so different seeds give different
    kernels; the search re-samples them from the categoricals (see the module docstring).
    """
    sch.work_on("main")
    valid = knobset.valid(sch.mod["main"], arch)
    if not valid:
        raise ValueError(f"no {knobset.name} config fits the workload {workload_tag(sch.mod['main'])}")
    cfg = random.Random(sch.fork_seed()).choice(valid)
    _sample_knobs(sch, cfg, knobset)
    sch.enter_postproc()
    if not _apply_annotated(sch, knobset, arch):  # cannot happen for a config of `valid`
        raise ValueError(f"config {cfg} failed to schedule")
    return sch


def knob_schedule(workload: tirx.PrimFunc, config, arch: str = "sm_90", seed: int = 1) -> s_tir.Schedule:
    """A traced schedule of ``workload`` exactly as the search produces it for ``config``
    (knob samples with these decisions, ``EnterPostproc``, the candidate; :func:`knobset_of`
    the config and workload): its ``trace`` is a valid database record trace.  Raises
    ValueError for a config that does not fit."""
    knobset = knobset_of(config, workload)
    sch = s_tir.Schedule(tvm.IRModule({"main": workload}), seed=seed)
    sch.work_on("main")
    _sample_knobs(sch, config, knobset)
    sch.enter_postproc()
    if not _apply_annotated(sch, knobset, arch):
        raise ValueError(f"config {config} does not fit the workload")
    return sch


@derived_object
class ApplyPitKnobs(ms.postproc.PyPostproc):
    """Postprocessor: make the candidate of the sampled knob values (:func:`_apply_annotated`);
    a combination that does not fit is a failed sample."""

    def __init__(self, kernel: str = "mma.sync", arch: str | None = None) -> None:
        super().__init__()
        self.kernel = kernel
        self.arch = arch

    def _initialize_with_tune_context(self, context) -> None:
        if self.arch is None:
            self.arch = _arch_of(context.target)

    def apply(self, sch: s_tir.Schedule) -> bool:
        try:
            return _apply_annotated(sch, KNOBSETS[self.kernel], self.arch or "sm_90")
        except Exception:  # noqa: BLE001 - a failed candidate, never a crash of the search
            return False

    def clone(self):
        return ApplyPitKnobs(self.kernel, self.arch)


def _knob_insts(trace):
    out = []
    for inst in trace.insts:
        if inst.kind.name == "EnterPostproc":
            break
        if inst.kind.name == "SampleCategorical":
            out.append(inst)
    return out


@derived_object
class MutateKnob(ms.mutator.PyMutator):
    """Mutator: move one sampled knob (a ``SampleCategorical``) to a different value."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, trace, rand_state=None):
        insts = _knob_insts(trace)
        if not insts:
            return None
        rng = random.Random((int(rand_state or 0) * 1000003) ^ self._rng.getrandbits(62))
        inst = rng.choice(insts)
        n_cands = len(inst.attrs[0])
        old = trace.get_decision(inst)
        old = -1 if old is None else int(old)
        choices = [i for i in range(n_cands) if i != old]
        if not choices:
            return None
        new = rng.choice(choices)
        return trace.with_decision(inst, int(new), remove_postproc=True)

    def clone(self):
        return MutateKnob(self._rng.getrandbits(31))


def space_generator(arch: str | None = None, kernel: str = "mma.sync") -> ms.space_generator.ScheduleFn:
    """The ``space=`` of ``ms.tune_tir`` for ``kernel`` (a :data:`KNOBSETS` name):
    :func:`pit_space` + :class:`ApplyPitKnobs` + :class:`MutateKnob`."""
    arch = arch or "sm_90"
    return ms.space_generator.ScheduleFn(functools.partial(pit_space, knobset=KNOBSETS[kernel], arch=arch),
                                         sch_rules=[], postprocs=[ApplyPitKnobs(kernel, arch)],
                                         mutator_probs={MutateKnob(): 1.0})


def prepare_candidate(mod: tvm.IRModule) -> tvm.IRModule:
    """What a measured candidate needs besides its trace: for a TIRx kernel's knobs, that
    kernel of the annotated config in place of the workload; for a scheduled one its IR
    post-process (:func:`~pit_tvm.schedules.tensorcore.add_early_exit`,
    :func:`~pit_tvm.schedules.tensorcore_tiles.set_dynamic_k_extent`) and ``tirx.is_scheduled``."""
    func = mod["main"]
    knobset, cfg = _annotated(s_tir.Schedule(mod), [ks for ks in KNOBSETS.values() if ks.kernel is not None])
    if cfg is not None:
        return tvm.IRModule({"main": knobset.kernel(func, cfg)})
    tag = workload_tag(func)
    finish = next(ks.finish for ks in KNOBSETS.values() if ks.finish is not None and tag.startswith(ks.workload))
    return tvm.IRModule({"main": finish(func).with_attr("tirx.is_scheduled", True)})


@derived_object
class PitBuilder(ms.builder.PyBuilder):
    """Builder wrapper: :func:`prepare_candidate` in this process, then the inner builder
    (:func:`pit_tvm.tuning.builder.default_builder`, or one given)."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    def build(self, build_inputs):
        prepared = [ms.builder.BuilderInput(prepare_candidate(b.mod), b.target, b.params)
                    for b in build_inputs]
        return self.inner.build(prepared)


# --------------------------------------------------------------------------------------
# CPU (llvm): a small space of the rows workload, to tune through RPC servers without a GPU
# --------------------------------------------------------------------------------------
#: the ``kernel`` name of the CPU space (:func:`cpu_space_generator`)
CPU_KERNEL = "cpu"


def cpu_space(sch: s_tir.Schedule) -> s_tir.Schedule:
    """The rows workload (:func:`tuning_workload`, which builds as is on llvm) with its
    ``matmul`` block's N and K loops tiled by sampled factors, the N tile innermost.  Two
    perfect-tile decisions (mutated by ``MutateTileSize``): a space of a few dozen kernels
    for a small shape, which is what tuning on CPU RPC servers (tests, trying the setup
    without a GPU) needs; builds for llvm do not read its logs."""
    mm = sch.get_sblock("matmul")
    p, j, kk = sch.get_loops(mm)[-3:]
    jo, ji = sch.split(j, sch.sample_perfect_tile(j, n=2, max_innermost_factor=64))
    ko, ki = sch.split(kk, sch.sample_perfect_tile(kk, n=2, max_innermost_factor=64))
    sch.reorder(p, jo, ko, ki, ji)
    return sch


def cpu_space_generator() -> ms.space_generator.ScheduleFn:
    """The ``space=`` of ``ms.tune_tir`` for :data:`CPU_KERNEL`"""
    return ms.space_generator.ScheduleFn(cpu_space, sch_rules=[], postprocs=[],
                                         mutator_probs={ms.mutator.MutateTileSize(): 1.0})
