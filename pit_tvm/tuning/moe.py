"""Tuning the MoE op's grouped wgmma GEMM (sm_90a): tile width x ring depth, per mode and token count.

    path = tune_moe("gather", 768, 3072, 8, 1, "bfloat16", tokens=16, trials=16)   # on an H100
    moe_ffn(spec, 768, 3072, "bfloat16", target="cuda", tuning_log="tuning_logs")

The kernel is :func:`pit_tvm.schedules.hopper.grouped.wgmma_grouped_gemm_func`; its knobs are
:data:`pit_tvm.tuning.space.GROUPED_KNOBS` (``block_n`` x ``stages``), a :class:`KnobSet`
(``"wgmma.grouped"``) of the same machinery as the rows kernel's: the knobs are
``SampleCategorical`` annotations of a static-shape workload
(:func:`~pit_tvm.tuning.space.grouped_tuning_workload`: ``T = tokens``, ``P = T * top_k``), the
builder builds the TIRx kernel of the annotated config in its place, the planned config
(:func:`~pit_tvm.schedules.hopper.grouped.grouped_config` for the workload's T) is measured
first, and the runner fills the arguments with a *valid* index of a random routing
(:func:`pit_tvm.tuning._worker.alloc_moe_arguments`: balanced, or Zipf-skewed over the
experts), every timed run after an L2 flush.

Mode ``"glu"`` is a gated FFN's fc1 with both halves in one kernel (the kernel's mode ``"glu"``; the workload
takes W3 after W, the knobs are the widths whose halves are whole 64-column atoms).

The tiles depend on the token count (decode-size T wants narrow tiles and deep rings), so one
database per (mode, K, N, E, top_k, dtype) holds workloads of several T:
``<work_dir>/<gpu>/wgmma_moe_{mode}_k{K}_n{N}_e{E}_top{k}_{dtype}/``.  A build reads the
records of the T nearest its token count within its regime (decode: T <= 256; else many
tokens, the symbolic-T layer reading the largest tuned T): :func:`best_moe_record`.

Off sm_90a the op runs the generic TIR grouped GEMM (fixed 4 x 64 CPU tiles, 64 x 64 SIMT CUDA
tiles), which has no knobs: :func:`tune_moe` refuses other targets with a message saying so,
and the op ignores a tuning log there (:func:`pit_tvm.ops.moe.grouped_tile_config`).
"""
from __future__ import annotations

import functools
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import tvm
from tvm.s_tir import meta_schedule as ms

from pit_tvm.schedules.hopper.config import WGMMA_ARCH, WgmmaConfig
from pit_tvm.target import make_target
from pit_tvm.tuning import space as _space
from pit_tvm.tuning import tune as _tune
from pit_tvm.tuning._worker import MOE_ROUTINGS, alloc_moe_arguments, run_evaluator_cold_l2
from pit_tvm.tuning.builder import default_builder

__all__ = ["tune_moe", "best_moe_record", "tuned_moe_config", "moe_log_dir", "MoEBestRecord", "KERNEL",
           "DEFAULT_TOKENS", "MOE_ROUTINGS"]

#: the knob set's name (:data:`pit_tvm.tuning.space.KNOBSETS`)
KERNEL = "wgmma.grouped"
#: the token count a tune measures by default (many tokens: the symbolic-T layer's tiles)
DEFAULT_TOKENS = 4096
_MODES = ("gather", "scatter", "glu")


def _leaf(mode: str, k: int, n: int, num_experts: int, top_k: int, dtype: str) -> str:
    return f"wgmma_moe_{mode}_k{int(k)}_n{int(n)}_e{int(num_experts)}_top{int(top_k)}_{dtype}"


def moe_log_dir(mode: str, k: int, n: int, num_experts: int, top_k: int, dtype: str = "float16", work_dir=None,
                gpu: str | None = None) -> Path:
    """``<work_dir or tuning_logs>/<gpu>/wgmma_moe_{mode}_k{K}_n{N}_e{E}_top{k}_{dtype}``"""
    root = Path(work_dir) if work_dir is not None else Path(_tune.DEFAULT_ROOT)
    return root / (gpu or _tune.gpu_name()) / _leaf(mode, k, n, num_experts, top_k, dtype)


def _check_target(target):
    tgt = make_target(target)
    if tgt.kind.name != "cuda" or str(_space._arch_of(tgt)) != WGMMA_ARCH:
        raise ValueError(f"the MoE grouped GEMM has knobs only in its Hopper wgmma kernel (sm_90a, target 'cuda'); "
                         f"on {tgt.kind.name}{'' if tgt.kind.name != 'cuda' else ' ' + str(_space._arch_of(tgt))} "
                         "the op runs the generic TIR kernel, whose tiles are fixed: nothing to tune")
    return tgt


def tune_moe(mode: str, k: int, n: int, num_experts: int, top_k: int = 1, dtype: str = "float16",
             tokens: int = DEFAULT_TOKENS, target="cuda", trials: int = 24, work_dir=None, *,
             routing: str = "balanced", zipf_a: float = 1.2, out_dtype: str | None = None,
             trials_per_iter: int = 8, population_size: int = 32, seed: int = 1, builder=None, runner=None,
             number: int = 5, repeat: int = 3, progress: bool = True, servers=None) -> Path:
    """Tune the grouped GEMM of ``mode`` (``"gather"``: fc1, ``K = d, N = f``; ``"scatter"``:
    fc2, ``K = f, N = d``; ``"glu"``: a gated FFN's fc1 with both halves in one kernel, ``K = d,
    N = f``) for ``num_experts`` experts, ``top_k`` and ``tokens`` tokens routed by
    ``routing`` (``"balanced"`` or ``"zipf"``, weight ``(e + 1) ** -zipf_a``); return the database
    directory.  The space has at most 24 configs, so a few dozen trials cover it.
    ``builder``/``runner``: as :func:`pit_tvm.tuning.tune.tune_matmul`'s (an RPC runner needs
    :func:`~pit_tvm.tuning._worker.rpc_alloc_moe_arguments`: :func:`pit_tvm.tuning.rpc.rpc_runner`'s
    ``f_alloc_argument``)."""
    if mode not in _MODES:
        raise ValueError(f"mode must be 'gather' (fc1), 'scatter' (fc2) or 'glu' (a gated fc1), got {mode!r}")
    if routing not in MOE_ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(MOE_ROUTINGS)}, got {routing!r}")
    for name, v in (("k", k), ("n", n), ("num_experts", num_experts), ("top_k", top_k), ("tokens", tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
    tgt = _check_target(target)
    out_dtype = out_dtype or dtype
    workload = _space.grouped_tuning_workload(mode, k, n, num_experts, top_k, tokens, dtype, out_dtype)
    knobset = _space.KNOBSETS[KERNEL]
    if not knobset.valid(workload, WGMMA_ARCH):
        raise ValueError(f"the grouped wgmma kernel does not take {mode} K={k}, N={n}, E={num_experts} "
                         f"({dtype} -> {out_dtype}): K must be a multiple of 64, N of 64, E <= 256, fp16/bf16")
    if runner is None and not tvm.cuda(0).exist:
        raise ValueError("tuning measures every candidate on this machine's GPU, and it has no CUDA device: "
                         "run it on the GPU machine (or pass runner=, e.g. an RPCRunner)")
    db_dir = moe_log_dir(mode, k, n, num_experts, top_k, dtype, work_dir)
    db_dir.mkdir(parents=True, exist_ok=True)
    _tune._ensure_worker_path()
    cores = os.cpu_count() or 1
    if builder is None:
        builder = default_builder(cores)
    builder = _space.PitBuilder(builder)        # the TIRx kernel of the annotated config
    if runner is None:
        runner = ms.runner.LocalRunner(
            timeout_sec=120,
            evaluator_config=ms.runner.EvaluatorConfig(number=number, repeat=repeat, min_repeat_ms=0,
                                                       enable_cpu_cache_flush=False),
            f_alloc_argument=functools.partial(alloc_moe_arguments, mode=mode, top_k=int(top_k), routing=routing,
                                               zipf_a=float(zipf_a)),
            f_run_evaluator=run_evaluator_cold_l2)
    database = ms.database.JSONDatabase(work_dir=str(db_dir))
    _tune._measure_planned(workload, knobset, WGMMA_ARCH, tgt, builder, runner, database)
    _tune._search(workload, tgt, db_dir, trials, trials_per_iter, builder, runner, database,
                  _space.space_generator(WGMMA_ARCH, KERNEL), _tune._strategy(population_size, trials_per_iter),
                  cores, seed, progress, servers)
    return db_dir


# --------------------------------------------------------------------------------------
# Reading the log
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoEBestRecord:
    config: WgmmaConfig
    run_secs: float        # mean measured latency of the tuning workload
    tokens: int            # T of the tuning workload
    log_dir: Path
    target: str


def _decode(tokens) -> bool:
    from pit_tvm.ops.moe import DECODE_TOKENS

    return tokens is not None and int(tokens) <= DECODE_TOKENS


def _records(db_dir: Path, mode, k, n, num_experts, top_k, dtype, tgt):
    """``(tokens, mean secs, lineno, record)`` of the measured records of this grouped GEMM on
    ``tgt``'s arch; foreign and broken lines are counted and said"""
    want = re.compile(rf"^{_space.GROUPED_WORKLOAD}{mode}_k{k}_n{n}_e{num_experts}_top{top_k}_t(\d+)_{dtype}_")
    decoded, bad = _tune.decoded_records(db_dir)
    out, foreign = [], 0
    for lineno, rec in decoded:
        mt = want.match(_space.workload_tag(rec.workload.mod["main"]))
        if not mt or rec.target is None or not _tune._same_target(rec.target, tgt):
            foreign += 1
            continue
        secs = [float(x) for x in (rec.run_secs or [])]
        if secs and all(math.isfinite(s) and 0 < s < _tune._FAILED_SECS for s in secs):
            out.append((int(mt.group(1)), sum(secs) / len(secs), lineno, rec))
    if bad:
        warnings.warn(f"{db_dir}: skipped {bad} tuning record(s) that do not decode", stacklevel=3)
    if foreign:
        warnings.warn(f"{db_dir}: skipped {foreign} record(s) of another workload or target than the {mode} "
                      f"GEMM K={k} N={n} E={num_experts} top_k={top_k} {dtype} on {tgt}", stacklevel=3)
    return out


def best_moe_record(work_dir, mode: str, k: int, n: int, num_experts: int, top_k: int, dtype: str = "float16",
                    target="cuda", tokens: int | None = None, max_tries: int = 16) -> MoEBestRecord | None:
    """The fastest replayable record for a build of ``tokens`` tokens (None: a symbolic T,
    many tokens): among the tuned token counts of the build's regime (decode, T <= 256, or
    not), the one nearest ``tokens`` in log scale (the largest for None); None (with a
    warning) where the log has none."""
    tgt = make_target(target)
    leaf = _leaf(mode, k, n, num_experts, top_k, dtype)
    db_dir = _tune.resolve_leaf(work_dir, leaf)
    if db_dir is None:
        warnings.warn(f"no tuning log for {leaf} under {work_dir}", stacklevel=2)
        return None
    records = [r for r in _records(db_dir, mode, k, n, num_experts, top_k, dtype, tgt)
               if _decode(r[0]) == _decode(tokens)]
    if not records:
        return None
    tuned = {r[0] for r in records}
    at = max(tuned) if tokens is None else min(tuned, key=lambda t: (abs(math.log2(t) - math.log2(max(int(tokens), 1))), -t))
    knobset = _space.KNOBSETS[KERNEL]
    for secs, lineno, rec in sorted((r[1], r[2], r[3]) for r in records if r[0] == at)[:max_tries]:
        try:
            cfg = _space.config_from_trace(rec.trace, rec.workload.mod, knobset)
            if cfg not in knobset.valid(rec.workload.mod["main"], WGMMA_ARCH):
                raise ValueError(f"{cfg} does not fit")
        except Exception as err:  # noqa: BLE001
            warnings.warn(f"database_tuning_record.json:{lineno}: trace does not replay ({type(err).__name__}); "
                          "skipped", stacklevel=2)
            continue
        return MoEBestRecord(cfg, secs, at, db_dir, str(tgt))
    return None


def tuned_moe_config(tuning_log, mode: str, k: int, n: int, num_experts: int, top_k: int, dtype: str, target,
                     tokens: int | None = None) -> WgmmaConfig | None:
    """The op's hook (:func:`pit_tvm.ops.moe.grouped_tile_config`): :func:`best_moe_record`'s
    config, or None with a warning (the op then takes the planned tiles); a broken log never
    breaks a build."""
    leaf = _leaf(mode, k, n, num_experts, top_k, dtype)
    regime = "decode-size (T <= 256)" if _decode(tokens) else "many-token"
    best = _tune._from_log(lambda: best_moe_record(tuning_log, mode, k, n, num_experts, top_k, dtype, target, tokens),
                           tuning_log, f"no valid tuned {regime} config for {leaf} in {tuning_log}; "
                           "using the planned tiles")
    return None if best is None else best.config
