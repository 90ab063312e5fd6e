"""MetaSchedule design space of the tensor-core PIT row-gather matmul.

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
:class:`ApplyPitTensorCore`, after ``EnterPostproc``: it reads the (re-)sampled annotation
values and runs :func:`~pit_tvm.schedules.tensorcore.apply_row_gather_schedule`.
MetaSchedule replays traces with ``remove_postproc=True`` and re-runs the postprocs, so
every candidate is consistent with its decisions.

:func:`pit_tc_space` (the ``ScheduleFn``) samples the knobs, annotates, calls
``enter_postproc`` and applies the schedule itself, so a design space it generates *is* the
scheduled kernel (for a valid knob combination picked from the schedule's random state);
:class:`ApplyPitTensorCore` is a no-op on it (the annotations are gone).

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
:class:`CheckWgmmaKnobs` rejects combinations that do not fit, and :class:`PitBuilder` builds
the TIRx kernel of the annotated config in place of the workload.  The same search, cost
model, database and :class:`MutateKnob` serve both kernels; the XGBoost model, whose features
are read from the (here unscheduled) workload, ranks nothing for it, so the search is the
evolutionary one over a space of at most 16 configs.
"""
from __future__ import annotations

import functools
import itertools
import random
from collections import OrderedDict
from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import meta_schedule as ms
from tvm.ir.utils import derived_object

from pit_tvm.schedules.wgmma import WGMMA_ARCH, WgmmaConfig, wgmma_applies, wgmma_row_gather_func
from pit_tvm.schedules.tensorcore import (
    TensorCoreConfig,
    _workload_params,
    add_early_exit,
    apply_row_gather_schedule,
    check_config,
    max_smem_bytes,
    row_gather_matmul_func,
)

__all__ = [
    "KNOBS",
    "WGMMA_KNOBS",
    "ANN_PREFIX",
    "KnobSet",
    "MMA_SYNC",
    "WGMMA",
    "KNOBSETS",
    "valid_wgmma_configs",
    "pit_wgmma_space",
    "CheckWgmmaKnobs",
    "tuning_workload",
    "valid_knob_configs",
    "pit_tc_space",
    "ApplyPitTensorCore",
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


@dataclass(frozen=True)
class KnobSet:
    """One kernel's knobs as MetaSchedule samples: their supports and priors, the annotation
    prefix that carries their values on :data:`KNOB_BLOCK`, the config class they make."""

    knobs: "OrderedDict[str, tuple[int, ...]]"
    priors: dict
    prefix: str
    config_cls: type

    def config_of(self, annotations):
        """the config of ``annotations`` (a block's), None where they lack a knob"""
        if not all(self.prefix + name in annotations for name in self.knobs):
            return None
        return self.config_cls(**{name: int(annotations[self.prefix + name]) for name in self.knobs})


#: the mma.sync schedule's knobs (sm_80 / sm_90)
MMA_SYNC = KnobSet(KNOBS, _PRIORS, ANN_PREFIX, TensorCoreConfig)
#: the wgmma kernel's knobs (sm_90a)
WGMMA = KnobSet(WGMMA_KNOBS, _WGMMA_PRIORS, "pit.wgmma.", WgmmaConfig)
#: each kernel's knobs by its name (:func:`pit_tvm.tuning.tune.tuned_kernel`)
KNOBSETS = {"mma.sync": MMA_SYNC, "wgmma": WGMMA}
#: the block that carries the knob annotations.  Not ``matmul``: in TVM 0.27 an ``annotate``
#: on a block of the gather_matmul subtree followed by the first ``split`` of the zero-fill
#: loops writes *in place* into the unscheduled PrimFunc the schedule was created from (a
#: copy-on-write slip of ScheduleState::Replace), which would corrupt MetaSchedule's task
#: module for every later candidate.  ``zero_fill`` is the first block the schedule touches,
#: so annotating it is safe (``tests/test_tuning.py`` checks the workload stays intact).
KNOB_BLOCK = "zero_fill"
#: the tuning workload's rows when none is given: not a multiple of 16, so ``pad_einsum``
#: pads the last row tile exactly as for a runtime M (a static M that is a multiple of
#: block_m would leave nothing to pad, and the schedule expects the padded blocks)
DEFAULT_TUNE_M = 4096 + 8


def _arch_of(target) -> str:
    if target is None:
        return "sm_90"
    arch = target.attrs.get("arch") if hasattr(target, "attrs") else None
    return str(arch) if arch else "sm_90"


def tuning_workload(k: int, n: int, dtype: str = "float16", out_dtype: str | None = None,
                    m: int = DEFAULT_TUNE_M) -> tirx.PrimFunc:
    """:func:`row_gather_matmul_func` with the row count fixed to ``m`` (MetaSchedule measures
    static shapes only).  ``m`` must not be a multiple of 16 (see ``DEFAULT_TUNE_M``)."""
    if int(m) % 16 == 0:
        raise ValueError(f"tuning M={m} must not be a multiple of 16 (the schedule pads the "
                         "last row tile; try M + 8)")
    func = row_gather_matmul_func(k, n, dtype, out_dtype or dtype)
    a = func.params[0]
    buf = tirx.decl_buffer((tirx.const(int(m), "int64"), int(k)), dtype, "A")
    func = func.specialize({a: buf})
    return func.with_attr("global_symbol", "main")


@functools.lru_cache(maxsize=None)
def valid_knob_configs(k: int, n: int, in_dtype: str, out_dtype: str,
                       arch: str = "sm_90") -> tuple[TensorCoreConfig, ...]:
    """Every knob combination of :data:`KNOBS` that fits a (K, N) problem."""
    out = []
    for values in itertools.product(*KNOBS.values()):
        cfg = TensorCoreConfig(**dict(zip(KNOBS, values)))
        try:
            check_config(k, n, in_dtype, cfg, max_smem_bytes(arch), out_dtype)
        except ValueError:
            continue
        out.append(cfg)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def valid_wgmma_configs(k: int, n: int, in_dtype: str, out_dtype: str) -> tuple[WgmmaConfig, ...]:
    """Every :data:`WGMMA_KNOBS` combination the wgmma rows kernel takes for (K, N): the tile
    width dividing N, the ring within shared memory."""
    if not wgmma_applies(k, n, in_dtype, out_dtype, WGMMA_ARCH):
        return ()
    out = []
    for values in itertools.product(*WGMMA_KNOBS.values()):
        cfg = WgmmaConfig(**dict(zip(WGMMA_KNOBS, values)))
        if n % cfg.block_n == 0 and cfg.smem_bytes(out_dtype) <= max_smem_bytes(WGMMA_ARCH):
            out.append(cfg)
    return tuple(out)


def config_from_schedule(sch: s_tir.Schedule, knobset: KnobSet = MMA_SYNC):
    """The knob values annotated on the ``zero_fill`` block of ``sch`` (None if absent)."""
    try:
        block = sch.get(sch.get_sblock(KNOB_BLOCK, func_name="main"))
    except Exception:  # noqa: BLE001 - block gone (already scheduled) or not our workload
        return None
    return knobset.config_of(block.annotations)


def config_from_trace(trace, workload: tirx.PrimFunc | tvm.IRModule, knobset: KnobSet | None = MMA_SYNC):
    """Replay the knob part of ``trace`` (``remove_postproc=True``) on ``workload`` and read
    the knob values of ``knobset`` back (None: of whichever kernel's knobs it carries).  Raises
    when the trace does not replay or carries no such knobs."""
    mod = workload if isinstance(workload, tvm.IRModule) else tvm.IRModule({"main": workload})
    sch = s_tir.Schedule(mod)
    trace.apply_to_schedule(sch, remove_postproc=True)
    for candidate in [knobset] if knobset is not None else KNOBSETS.values():
        cfg = config_from_schedule(sch, candidate)
        if cfg is not None:
            return cfg
    raise ValueError(f"the trace carries no {knobset.prefix if knobset else 'pit.*.'}* knob annotations")


def _sample_knobs(sch: s_tir.Schedule, decisions, knobset: KnobSet = MMA_SYNC):
    block = sch.get_sblock(KNOB_BLOCK, func_name="main")
    for name, cands in knobset.knobs.items():
        decision = None if decisions is None else cands.index(getattr(decisions, name))
        rv = sch.sample_categorical(list(cands), list(knobset.priors[name]), decision=decision)
        sch.annotate(block, knobset.prefix + name, rv)


def _apply_annotated(sch: s_tir.Schedule, arch: str) -> bool:
    """Schedule ``sch`` with the config of its knob annotations; False when invalid."""
    cfg = config_from_schedule(sch)
    if cfg is None:
        return True  # nothing to do: already scheduled (a design space from pit_tc_space)
    k, n, in_dtype, out_dtype, _ = _workload_params(sch.mod["main"])
    try:
        check_config(k, n, in_dtype, cfg, max_smem_bytes(arch), out_dtype)
    except ValueError:
        return False
    block = sch.get_sblock(KNOB_BLOCK, func_name="main")
    for name in KNOBS:
        sch.unannotate(block, ANN_PREFIX + name)
    try:
        apply_row_gather_schedule(sch, cfg, _arch_of_str(arch))
    except Exception:  # noqa: BLE001 - ValueError, TVMError: a failed candidate
        return False
    return True


def _arch_of_str(arch: str) -> str:
    return str(arch).rstrip("a")


def pit_tc_space(sch: s_tir.Schedule, arch: str = "sm_90") -> s_tir.Schedule:
    """``ScheduleFn`` body: sample the knobs into annotations, ``enter_postproc``, schedule.

    The knob values of this design space are one valid combination drawn from the
    schedule's random state (``sch.fork_seed()``), so different seeds give different
    kernels; the search re-samples them from the categoricals (see the module docstring).
    """
    sch.work_on("main")
    k, n, in_dtype, out_dtype, _ = _workload_params(sch.mod["main"])
    valid = valid_knob_configs(k, n, in_dtype, out_dtype, _arch_of_str(arch))
    if not valid:
        raise ValueError(f"no tensor-core config fits K={k}, N={n}, {in_dtype}")
    cfg = random.Random(sch.fork_seed()).choice(valid)
    _sample_knobs(sch, cfg)
    sch.enter_postproc()
    if not _apply_annotated(sch, arch):  # cannot happen for a config of `valid`
        raise ValueError(f"config {cfg} failed to schedule")
    return sch


def pit_wgmma_space(sch: s_tir.Schedule) -> s_tir.Schedule:
    """``ScheduleFn`` body of the wgmma kernel: sample its knobs (one valid config drawn from
    the schedule's random state) into annotations and ``enter_postproc``; nothing is scheduled
    (:class:`PitBuilder` builds the TIRx kernel of the annotated config)."""
    sch.work_on("main")
    k, n, in_dtype, out_dtype, _ = _workload_params(sch.mod["main"])
    valid = valid_wgmma_configs(k, n, in_dtype, out_dtype)
    if not valid:
        raise ValueError(f"no wgmma config fits K={k}, N={n}, {in_dtype} -> {out_dtype}")
    _sample_knobs(sch, random.Random(sch.fork_seed()).choice(valid), WGMMA)
    sch.enter_postproc()
    return sch


def _wgmma_fits(sch: s_tir.Schedule) -> bool:
    """whether the wgmma knobs annotated on ``sch`` are a config of :func:`valid_wgmma_configs`"""
    cfg = config_from_schedule(sch, WGMMA)
    k, n, in_dtype, out_dtype, _ = _workload_params(sch.mod["main"])
    return cfg is not None and cfg in valid_wgmma_configs(k, n, in_dtype, out_dtype)


def knob_schedule(workload: tirx.PrimFunc, config, arch: str = "sm_90", seed: int = 1) -> s_tir.Schedule:
    """A traced schedule of ``workload`` exactly as the search produces it for ``config``
    (knob samples with these decisions, ``EnterPostproc``, the mma.sync schedule; for a
    :class:`WgmmaConfig` the samples alone): its ``trace`` is a valid database record trace.
    Raises ValueError for a config that does not fit."""
    wgmma = isinstance(config, WgmmaConfig)
    sch = s_tir.Schedule(tvm.IRModule({"main": workload}), seed=seed)
    sch.work_on("main")
    _sample_knobs(sch, config, KNOBSETS["wgmma" if wgmma else "mma.sync"])
    sch.enter_postproc()
    if not (_wgmma_fits(sch) if wgmma else _apply_annotated(sch, arch)):
        raise ValueError(f"config {config} does not fit the workload")
    return sch


@derived_object
class ApplyPitTensorCore(ms.postproc.PyPostproc):
    """Postprocessor: apply the tensor-core schedule with the sampled knob values."""

    def __init__(self, arch: str | None = None) -> None:
        super().__init__()
        self.arch = arch

    def _initialize_with_tune_context(self, context) -> None:
        if self.arch is None:
            self.arch = _arch_of(context.target)

    def apply(self, sch: s_tir.Schedule) -> bool:
        try:
            return _apply_annotated(sch, self.arch or "sm_90")
        except Exception:  # noqa: BLE001 - a failed candidate, never a crash of the search
            return False

    def clone(self):
        return ApplyPitTensorCore(self.arch)


@derived_object
class CheckWgmmaKnobs(ms.postproc.PyPostproc):
    """Postprocessor of the wgmma space: a sampled knob combination that does not fit (the
    tile width not dividing N, the ring over shared memory) is a failed sample."""

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch: s_tir.Schedule) -> bool:
        try:
            return _wgmma_fits(sch)
        except Exception:  # noqa: BLE001 - a failed candidate, never a crash of the search
            return False

    def clone(self):
        return CheckWgmmaKnobs()


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


def space_generator(arch: str | None = None, wgmma: bool = False) -> ms.space_generator.ScheduleFn:
    """The ``space=`` of ``ms.tune_tir``: :func:`pit_tc_space` + :class:`ApplyPitTensorCore`
    + :class:`MutateKnob`; ``wgmma``: :func:`pit_wgmma_space` + :class:`CheckWgmmaKnobs` +
    :class:`MutateKnob`."""
    arch = arch or "sm_90"
    if wgmma:
        return ms.space_generator.ScheduleFn(pit_wgmma_space, sch_rules=[], postprocs=[CheckWgmmaKnobs()],
                                             mutator_probs={MutateKnob(): 1.0})
    return ms.space_generator.ScheduleFn(
        functools.partial(pit_tc_space, arch=arch),
        sch_rules=[],
        postprocs=[ApplyPitTensorCore(arch)],
        mutator_probs={MutateKnob(): 1.0},
    )


def prepare_candidate(mod: tvm.IRModule) -> tvm.IRModule:
    """What a measured candidate needs besides its trace: the early exit (an IR post-process,
    :func:`~pit_tvm.schedules.tensorcore.add_early_exit`) and ``tirx.is_scheduled``; for the
    wgmma space, the TIRx kernel of the annotated config in place of the workload."""
    cfg = config_from_schedule(s_tir.Schedule(mod), WGMMA)
    if cfg is not None:
        k, n, in_dtype, out_dtype, bias = _workload_params(mod["main"])
        return tvm.IRModule({"main": wgmma_row_gather_func(k, n, in_dtype, out_dtype, bias=bias, config=cfg)})
    func = add_early_exit(mod["main"]).with_attr("tirx.is_scheduled", True)
    return tvm.IRModule({"main": func})


@derived_object
class PitBuilder(ms.builder.PyBuilder):
    """Builder wrapper: :func:`prepare_candidate` in this process, then the inner builder
    (a ``LocalBuilder`` with ``f_build=pit_tvm.tuning._worker.build_module``)."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    def build(self, build_inputs):
        prepared = [ms.builder.BuilderInput(prepare_candidate(b.mod), b.target, b.params)
                    for b in build_inputs]
        return self.inner.build(prepared)
