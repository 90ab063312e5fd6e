"""MetaSchedule tuning of the tensor-core PIT row-gather matmul (XGBoost cost model).

Kept as one module: the search (:func:`tune_matmul`) and the readers of its logs
(:func:`best_record`, :func:`load_best`, :func:`tuned_config`) share the log layout
(:func:`log_dir`, workload keys, target matching), so writer and readers cannot drift apart.

    path = tune_matmul(4096, 4096, "float16", target="cuda:sm_90", trials=64)   # on a GPU box
    func = load_best(path, 4096, 4096, "float16", "cuda:sm_90")                 # scheduled PrimFunc
    tune_matmul(4096, 4096, "float16", target="cuda", trials=16)     # sm_90a: the wgmma kernel
    sparse_matmul(4096, 4096, "float16", (1, 4096), "cuda", tuning_log="tuning_logs")

Which kernel: a build for ``cuda`` (sm_90a) runs the wgmma kernel, so tuning for it searches
that kernel's knobs (tile width, ring depth; :data:`pit_tvm.tuning.space.WGMMA_KNOBS`) into
``wgmma_matmul_k{K}_n{N}_{dtype}/``; ``cuda:sm_90`` / ``cuda:sm_80`` builds run the mma.sync
schedule, whose space is :mod:`pit_tvm.tuning.space`'s (``matmul_k{K}_n{N}_{dtype}/``)
(:func:`tuned_kernel`).  A micro-tile along K (``micro_tile=(32, 64)``) tunes the tiles kernel
that runs it, into ``[wgmma_]matmul_{mr}x{mk}_k{K}_n{N}_{dtype}/`` with the kernel's strip
rows (:func:`kernel_micro_tile`: 128 for wgmma, at least 16 for mma.sync); its measured index
lists ``density`` of each strip's micro-tiles.  Before the search the planned config is
measured and committed (:func:`_measure_planned`).

Where the logs go
-----------------
``tune_matmul`` writes a MetaSchedule JSON database (``database_workload.json``,
``database_tuning_record.json``, ``logs/``) into
``<work_dir>/<gpu-name>/[wgmma_]matmul_k{K}_n{N}_{dtype}/`` (``work_dir`` defaults to
``tuning_logs`` in the current directory; ``gpu-name`` is the sanitised
``torch.cuda.get_device_name()`` or ``nvidia-smi`` name, ``unknown-gpu`` without either)
and returns that directory.  ``load_best`` and ``sparse_matmul(tuning_log=...)`` accept that
directory, or a root above it (``tuning_logs``: the current GPU's subdirectory is preferred,
then any GPU's).

What is tuned, what is measured
-------------------------------
The design space is :mod:`pit_tvm.tuning.space` (tile shape, K tile, pipeline stages of
:class:`~pit_tvm.schedules.tensorcore.TensorCoreConfig`).  MetaSchedule only measures static
shapes, so the tuning workload fixes ``M`` (``m``, default 4104: a ragged last row tile as at
run time) and lists *every* row (``offsets = [0, M]``, ``ids = arange(M)``: the runner's
``f_alloc_argument`` builds a valid index; MetaSchedule's random int32 fill would index out
of bounds).  The builder re-applies the early exit (:class:`space.PitBuilder`), so the
measured kernel is the one deployed.

From log to kernel (early exit)
-------------------------------
The database holds traces of the *static-M* workload.  ``add_early_exit`` (CTAs past the
count exit at once) is an IR post-process that no trace records: a trace replayed with
``compile_tir`` yields a kernel without it.  ``load_best`` therefore replays the best
record's trace (knob part) to read its :class:`TensorCoreConfig` back, checks that the whole
trace replays on its workload, and schedules the *symbolic-M* workload with
:func:`~pit_tvm.schedules.tensorcore.schedule_row_gather_matmul`, which re-applies the early
exit.  Anyone replaying a trace with ``compile_tir`` must call ``add_early_exit`` on the
result.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path

import tvm
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from pit_tvm.schedules.wgmma import WgmmaConfig
from pit_tvm.schedules.tensorcore import (
    IN_DTYPES,
    TensorCoreConfig,
    row_gather_matmul_func,
    split_plan,
    schedule_row_gather_matmul,
)
from pit_tvm.schedules.tensorcore_tiles import TilesConfig
from pit_tvm.target import make_target
from pit_tvm.tuning import space as _space
from pit_tvm.tuning._worker import alloc_pit_arguments, run_evaluator_cold_l2
from pit_tvm.tuning.builder import close_builder, default_builder

__all__ = [
    "tune_matmul",
    "load_best",
    "best_record",
    "BestRecord",
    "gpu_name",
    "log_dir",
    "resolve_log_dir",
    "alloc_pit_arguments",
    "tuned_rows_kernel",
    "tuned_config",
    "tuned_kernel",
    "kernel_micro_tile",
    "TILES_TUNE_DENSITY",
    "trim_log",
]

OP = "matmul"
DEFAULT_ROOT = "tuning_logs"
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
#: the fraction of a strip's micro-tiles the tiles kinds' measured index lists (the targets'
#: lowest sparsity, 50 %: most of a call's GEMM time)
TILES_TUNE_DENSITY = 0.5
#: run_secs of a failed build/run as MetaSchedule records it (1e10 s)
_FAILED_SECS = 1e9


# --------------------------------------------------------------------------------------
# Where
# --------------------------------------------------------------------------------------
def _sanitize(name: str) -> str:
    s = re.sub(r"[^a-z0-9._-]+", "-", name.strip().lower()).strip("-._")
    return s or "unknown-gpu"


def gpu_name() -> str:
    """Sanitised name of GPU 0 (``nvidia-h100-80gb-hbm3``), ``unknown-gpu`` if none is found."""
    try:
        import torch

        if torch.cuda.is_available():
            return _sanitize(torch.cuda.get_device_name(0))
    except Exception:  # noqa: BLE001 - torch missing or broken: try nvidia-smi
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            if out.returncode == 0 and out.stdout.strip():
                return _sanitize(out.stdout.strip().splitlines()[0])
        except Exception:  # noqa: BLE001
            pass
    return "unknown-gpu"


def is_rows(k: int, micro_tile) -> bool:
    """whether ``micro_tile`` (``(1, None)``: whole rows) is the rows kind (one row, all of K)"""
    mr, mk = micro_tile
    return int(mr) == 1 and (mk is None or int(mk) >= int(k))


def tuned_kernel(k: int, n: int, dtype: str, target, out_dtype: str | None = None,
                 micro_tile=(1, None)) -> str:
    """Which kernel a build for ``target`` runs for ``micro_tile``, so which space a log of it
    holds (a :data:`pit_tvm.tuning.space.KNOBSETS` name): whole rows ``"wgmma"`` on sm_90a
    where the wgmma kernel takes (K, N, dtypes), else ``"mma.sync"``; micro-tiles along K
    ``"wgmma.tiles"`` where the wgmma tiles kernel takes them, else ``"mma.sync.tiles"``"""
    from pit_tvm.schedules.wgmma import wgmma_applies, wgmma_tiles_applies

    arch = str(_space._arch_of(make_target(target)))
    out_dtype = out_dtype or dtype
    if is_rows(k, micro_tile):
        return "wgmma" if wgmma_applies(int(k), int(n), dtype, out_dtype, arch) else "mma.sync"
    return ("wgmma.tiles" if wgmma_tiles_applies(int(k), int(n), micro_tile, dtype, out_dtype, arch)
            else "mma.sync.tiles")


def kernel_micro_tile(kernel: str | None, k: int, n: int, micro_tile) -> tuple[int, int] | None:
    """The micro-tile the tiles ``kernel`` runs for a user's ``micro_tile`` (the tiles kinds'
    strips: 128 rows for wgmma, :func:`pit_tvm.ops.matmul.tensor_core_plan`'s cover for
    mma.sync); None for the rows kernels (and no kernel)."""
    from pit_tvm.ops.matmul import MatmulPlan, tensor_core_plan
    from pit_tvm.schedules.wgmma import BLOCK_M

    if not kernel or not kernel.endswith(".tiles"):
        return None
    mr, mk = (int(x) for x in micro_tile)
    if kernel == "wgmma.tiles":
        return BLOCK_M, mk
    return tensor_core_plan(MatmulPlan(int(k), int(n), (mr, mk))).micro_tile


def _leaf(k: int, n: int, dtype: str, kernel: str = "mma.sync", micro_tile=None) -> str:
    """``[wgmma_|cpu_]matmul[_{mr}x{mk}]_k{k}_n{n}_{dtype}``: the kernel's micro-tile for the tiles kinds"""
    tiles = "" if micro_tile is None else f"_{int(micro_tile[0])}x{int(micro_tile[1])}"
    prefix = "wgmma_" if kernel.startswith("wgmma") else "cpu_" if kernel == _space.CPU_KERNEL else ""
    return prefix + f"{OP}{tiles}_k{int(k)}_n{int(n)}_{dtype}"


def log_dir(k: int, n: int, dtype: str = "float16", work_dir=None, gpu: str | None = None,
            kernel: str = "mma.sync", micro_tile=None) -> Path:
    """``<work_dir or tuning_logs>/<gpu>/[wgmma_]matmul[_{mr}x{mk}]_k{k}_n{n}_{dtype}`` (the
    kernel's micro-tile, :func:`kernel_micro_tile`, for the tiles kinds)."""
    root = Path(work_dir) if work_dir is not None else Path(DEFAULT_ROOT)
    return root / (gpu or gpu_name()) / _leaf(k, n, dtype, kernel, micro_tile)


def _is_db_dir(p: Path) -> bool:
    return (p / "database_tuning_record.json").is_file() and (p / "database_workload.json").is_file()


def resolve_log_dir(path, k: int, n: int, dtype: str = "float16", kernel: str = "mma.sync",
                    micro_tile=None) -> Path | None:
    """The database directory for (k, n, dtype, kernel, the kernel's micro-tile) given a
    database directory or a log root."""
    return resolve_leaf(path, _leaf(k, n, dtype, kernel, micro_tile))


def resolve_leaf(path, leaf: str) -> Path | None:
    """The database directory ``leaf`` given a database directory or a log root (the current
    GPU's subdirectory preferred, then any GPU's)."""
    p = Path(path)
    if _is_db_dir(p):
        return p
    for cand in (p / leaf, p / gpu_name() / leaf):
        if _is_db_dir(cand):
            return cand
    if p.is_dir():
        others = sorted(c for c in p.glob(f"*/{leaf}") if _is_db_dir(c))
        if others:
            if len(others) > 1:
                warnings.warn(f"tuning logs for {leaf} from several GPUs under {p}; using "
                              f"{others[0]}", stacklevel=3)
            return others[0]
    return None


# --------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------
class _TextBar:
    """Stand-in for tqdm where it is not installed: one line per MetaSchedule iteration."""

    def __init__(self, total, desc, disable=False, **_):
        self.n, self.total, self.desc, self.disable, self.post = 0, total, desc, disable, {}

    def update(self, k):
        self.n += k
        if not self.disable:
            print(f"{self.desc}: {self.n}/{self.total} trials {self.post}", flush=True)

    def set_postfix(self, post):
        self.post = dict(post)

    def close(self):
        pass


def _progress_bar(**kw):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _TextBar(**kw)
    return tqdm(**kw)


@derived_object
class _Progress(ms.measure_callback.PyMeasureCallback):
    """tqdm bar advanced by the measured candidates of each MetaSchedule iteration."""

    def __init__(self, bar, servers=None) -> None:
        super().__init__()
        self.bar = bar
        self.best = math.inf
        self.failed = 0
        self.servers = servers      # () -> str: the servers in use (RPC), or None

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        for b, r in zip(builder_results, runner_results):
            secs = [float(x) for x in (r.run_secs or [])]
            if b.error_msg is not None or r.error_msg is not None or not secs:
                self.failed += 1
                continue
            mean = sum(secs) / len(secs)
            if mean < _FAILED_SECS:
                self.best = min(self.best, mean)
        post = {"failed": self.failed}
        if self.best < math.inf:
            post["best_us"] = f"{self.best * 1e6:.1f}"
        if self.servers is not None:
            try:
                post["servers"] = self.servers()
            except Exception as err:  # noqa: BLE001 - the bar never stops the search
                post["servers"] = f"? ({type(err).__name__})"
        self.bar.set_postfix(post)
        self.bar.update(len(measure_candidates))


def _ensure_worker_path() -> None:
    """Builder/runner workers are fresh processes that unpickle our functions by reference:
    put the project on their PYTHONPATH."""
    pp = os.environ.get("PYTHONPATH", "")
    if _PROJECT_ROOT not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (_PROJECT_ROOT, pp) if x)


def tune_matmul(k: int, n: int, dtype: str = "float16", target="cuda", trials: int = 512,
                work_dir=None, micro_tile=(1, None), *, m: int = _space.DEFAULT_TUNE_M,
                out_dtype: str | None = None, density: float = TILES_TUNE_DENSITY,
                trials_per_iter: int = 32, population_size: int = 128, seed: int = 1,
                builder=None, runner=None, number: int = 5, repeat: int = 3,
                progress: bool = True, servers=None) -> Path:
    """Tune the tensor-core PIT kernel of ``C[M, n] = A[M, k] @ B[k, n]`` for ``micro_tile``
    (``(1, None)``: whole rows; ``(mr, mk)`` with ``mk < k``: micro-tiles along K) with
    MetaSchedule + XGBoost; return the database directory.

    ``trials``: measured candidates in all (the search may stop earlier when the space is
    exhausted); ``trials_per_iter``: candidates per MetaSchedule iteration (the cost model is
    refit between iterations).  ``density`` (tiles kinds): the fraction of each strip's
    micro-tiles the measured index lists (the rows kernels are measured with every row
    listed).  Every candidate is timed ``number x repeat`` times, each run after an L2 flush
    (:func:`~pit_tvm.tuning._worker.run_evaluator_cold_l2`: in the op the index kernels run
    between two GEMMs).  ``builder``/``runner`` override the pooled builder
    (:mod:`pit_tvm.tuning.builder`) / LocalRunner (an ``RPCRunner``: :func:`pit_tvm.tuning.rpc.rpc_runner`, or a fake runner in tests);
    ``servers`` (``() -> str``) puts the servers in use on the progress bar.  Re-running with
    the same directory resumes: measured records seed the evolutionary search.

    ``target="llvm"`` tunes the rows workload on the CPU in a small space
    (:func:`pit_tvm.tuning.space.cpu_space`, into ``<work_dir>/cpu/cpu_matmul_k{K}_n{N}_{dtype}/``):
    tuning through CPU RPC servers, without a GPU; CPU builds do not read its logs.
    """
    if dtype not in IN_DTYPES:
        raise ValueError(f"the tensor-core kernel takes {IN_DTYPES}, got {dtype!r}")
    mr, mk = micro_tile
    if int(mr) <= 0 or (mk is not None and (int(mk) <= 0 or int(k) % int(mk))):
        raise ValueError(f"micro-tile {micro_tile} must be positive with its width dividing K={k}")
    if (mk is None or int(mk) >= int(k)) and int(mr) != 1:
        raise NotImplementedError(f"whole-row micro-tiles of more than one row are not tunable, got {micro_tile}")
    if not 0.0 < float(density) < 1.0:
        raise ValueError(f"density must be in (0, 1) (a full index runs the dense kernel), got {density}")
    tgt = make_target(target)
    if tgt.kind.name == "llvm":
        return _tune_cpu(k, n, dtype, tgt, trials, work_dir, micro_tile, m=m, out_dtype=out_dtype,
                         trials_per_iter=trials_per_iter, population_size=population_size, seed=seed,
                         builder=builder, runner=runner, number=number, repeat=repeat,
                         progress=progress, servers=servers)
    if tgt.kind.name != "cuda":
        raise ValueError(f"tune_matmul tunes the CUDA tensor-core kernel (or, on llvm, the CPU rows "
                         f"workload), got target {tgt}")
    arch = _space._arch_of(tgt)
    out_dtype = out_dtype or dtype
    kernel = tuned_kernel(k, n, dtype, tgt, out_dtype, micro_tile)
    kernel_tile = kernel_micro_tile(kernel, k, n, micro_tile)
    if kernel_tile is None:
        workload = _space.tuning_workload(int(k), int(n), dtype, out_dtype, m)
    else:
        from pit_tvm.schedules.tensorcore_tiles import SUPPORTED_MR, needs_compact_a

        if kernel_tile[0] not in SUPPORTED_MR:
            raise ValueError(f"micro-tile {micro_tile}: the tensor-core tiles kernels take strips of "
                             f"{SUPPORTED_MR} rows (or fewer rows dividing 16)")
        a_compact = kernel == "mma.sync.tiles" and needs_compact_a(kernel_tile, dtype)
        workload = _space.tiles_tuning_workload(int(k), int(n), kernel_tile, dtype, out_dtype, m, a_compact)
    if not _space.KNOBSETS[kernel].valid(workload, arch):
        raise ValueError(f"no {kernel} config fits K={k}, N={n}, micro-tile {micro_tile} ({dtype})")
    if runner is None and not tvm.cuda(0).exist:
        raise ValueError("tuning measures every candidate on this machine's GPU, and it has no CUDA device: "
                         "run it on the GPU machine (or pass runner=, e.g. an RPCRunner)")
    db_dir = log_dir(k, n, dtype, work_dir, kernel=kernel, micro_tile=kernel_tile)
    db_dir.mkdir(parents=True, exist_ok=True)

    _ensure_worker_path()
    cores = os.cpu_count() or 1
    if builder is None:
        builder = default_builder(cores)
    builder = _space.PitBuilder(builder)  # early exit + is_scheduled, in this process
    if runner is None:
        runner = ms.runner.LocalRunner(
            timeout_sec=120,
            evaluator_config=ms.runner.EvaluatorConfig(
                number=number, repeat=repeat, min_repeat_ms=0,
                enable_cpu_cache_flush=False),
            f_alloc_argument=functools.partial(alloc_pit_arguments, density=float(density)),
            f_run_evaluator=run_evaluator_cold_l2)
    database = ms.database.JSONDatabase(work_dir=str(db_dir))
    strategy = _strategy(population_size, trials_per_iter)

    _measure_planned(workload, _space.KNOBSETS[kernel], arch, tgt, builder, runner, database)
    _search(workload, tgt, db_dir, trials, trials_per_iter, builder, runner, database,
            _space.space_generator(arch, kernel), strategy, cores, seed, progress, servers)
    return db_dir


def _strategy(population_size: int, trials_per_iter: int):
    return ms.search_strategy.EvolutionarySearch(
        population_size=population_size,
        init_measured_ratio=0.2,
        init_min_unmeasured=min(population_size, max(16, trials_per_iter)),
        genetic_num_iters=3,
        genetic_mutate_prob=0.85,
        genetic_max_fail_count=10,
        eps_greedy=0.05)


def _detach_unnamed_log_handlers() -> None:
    """MetaSchedule's ``create_loggers`` lists its logger's handlers by name and fails on an
    unnamed one, which pytest attaches to every non-propagating logger (as that logger is after
    a first tune): a second tune in one test process failed.  Detach them; the ``dictConfig``
    that follows replaces that logger's handlers anyway."""
    logger = logging.getLogger("tvm.s_tir.meta_schedule")
    for handler in list(logger.handlers):
        if handler.get_name() is None:
            logger.removeHandler(handler)


def _search(workload, tgt, db_dir, trials, trials_per_iter, builder, runner, database, space,
            strategy, cores, seed, progress, servers) -> None:
    """``ms.tune_tir`` with the XGBoost cost model and the progress bar"""
    _detach_unnamed_log_handlers()
    bar = _progress_bar(total=int(trials), desc=f"tune {db_dir.name}", unit="trial",
                        disable=not progress)
    callbacks = list(ms.measure_callback.MeasureCallback.create("default")) + [_Progress(bar, servers)]
    try:
        ms.tune_tir(
            mod=tvm.IRModule({"main": workload}),
            target=tgt,
            work_dir=str(db_dir),
            max_trials_global=int(trials),
            num_trials_per_iter=min(int(trials_per_iter), int(trials)),
            builder=builder,
            runner=runner,
            database=database,
            cost_model="xgb",
            measure_callbacks=callbacks,
            space=space,
            strategy=strategy,
            num_tuning_cores=cores,
            seed=int(seed),
        )
    finally:
        bar.close()
        close_builder(builder)


def _tune_cpu(k, n, dtype, tgt, trials, work_dir, micro_tile, *, m, out_dtype, trials_per_iter,
              population_size, seed, builder, runner, number, repeat, progress, servers) -> Path:
    """:func:`tune_matmul` on llvm: the rows workload in :func:`pit_tvm.tuning.space.cpu_space`"""
    if not is_rows(k, micro_tile):
        raise NotImplementedError(f"on llvm only whole-row micro-tiles are tunable, got {micro_tile}")
    workload = _space.tuning_workload(int(k), int(n), dtype, out_dtype or dtype, m)
    db_dir = log_dir(k, n, dtype, work_dir, gpu=_space.CPU_KERNEL, kernel=_space.CPU_KERNEL)
    db_dir.mkdir(parents=True, exist_ok=True)
    _ensure_worker_path()
    cores = os.cpu_count() or 1
    if builder is None:
        builder = default_builder(cores)
    if runner is None:
        runner = ms.runner.LocalRunner(
            timeout_sec=120,
            evaluator_config=ms.runner.EvaluatorConfig(number=number, repeat=repeat, min_repeat_ms=0,
                                                       enable_cpu_cache_flush=False),
            f_alloc_argument=alloc_pit_arguments, f_run_evaluator=run_evaluator_cold_l2)
    database = ms.database.JSONDatabase(work_dir=str(db_dir))
    _search(workload, tgt, db_dir, trials, trials_per_iter, builder, runner, database,
            _space.cpu_space_generator(), _strategy(population_size, trials_per_iter), cores, seed,
            progress, servers)
    return db_dir


def _measure_planned(workload, knobset, arch, target, builder, runner, database) -> None:
    """Measure the planned config (what a build takes without a log) before the search and
    commit it, unless the database holds it already: the search starts from it, and a log's
    best record is never slower than the plan on the tuning workload.  (The evolutionary
    search re-samples its population at random, which need not contain the plan: 32-trial
    searches of the mma.sync tiles schedule's 92 configs did not sample it, H100.)"""
    planned = knobset.planned(workload, arch)
    if planned not in knobset.valid(workload, arch):
        return
    mod = tvm.IRModule({"main": workload})
    entry = database.commit_workload(mod)
    for rec in database.get_all_tuning_records():
        try:
            if (tvm_ffi.structural_equal(rec.workload.mod, mod)
                    and _space.config_from_trace(rec.trace, rec.workload.mod, knobset) == planned):
                return
        except Exception:  # noqa: BLE001 - another space's record
            continue
    sch = _space.knob_schedule(workload, planned, arch)
    args_info = ms.arg_info.ArgInfo.from_entry_func(sch.mod, remove_preproc=True)
    (built,) = builder.build([ms.builder.BuilderInput(sch.mod, target)])
    if built.error_msg is not None:
        warnings.warn(f"the planned config {planned} did not build: {built.error_msg[-300:]}", stacklevel=3)
        return
    (result,) = [f.result() for f in runner.run([ms.runner.RunnerInput(built.artifact_path, target.kind.name,
                                                                       args_info)])]
    if result.error_msg is not None or not result.run_secs:
        warnings.warn(f"the planned config {planned} did not run: {str(result.error_msg)[-300:]}", stacklevel=3)
        return
    database.commit_tuning_record(ms.database.TuningRecord(sch.trace, entry, result.run_secs, target, args_info))


# --------------------------------------------------------------------------------------
# Reading the log
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BestRecord:
    config: TensorCoreConfig | WgmmaConfig | TilesConfig    # (the kernel of the log's target, tuned_kernel)
    run_secs: float            # mean measured latency of the tuning workload (M = m)
    m: int                     # rows of the tuning workload
    log_dir: Path
    target: str


_WORKLOAD_RE = re.compile(r"^(?:row_gather_matmul|tiles_gather_matmul_(\d+)x(\d+))_k(\d+)_n(\d+)_([a-z0-9]+)_([a-z0-9]+)"
                          r"(?:_acompact)?$")


def _read_lines(path: Path, what: str):
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except ValueError:
                warnings.warn(f"{path.name}:{lineno}: skipping a malformed {what} line",
                              stacklevel=4)


def _workload_key(workload) -> tuple | None:
    funcs = [f for _, f in workload.mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    func = funcs[0] if len(funcs) == 1 else None
    if func is None or func.attrs is None or "pit.workload" not in func.attrs:
        return None
    mt = _WORKLOAD_RE.match(str(func.attrs["pit.workload"]))
    if not mt:
        return None
    micro_tile = None if mt.group(1) is None else (int(mt.group(1)), int(mt.group(2)))
    return int(mt.group(3)), int(mt.group(4)), mt.group(5), micro_tile


def _same_target(rec_target, tgt) -> bool:
    if rec_target.kind.name != tgt.kind.name:
        return False
    a, b = _space._arch_of(rec_target), _space._arch_of(tgt)
    return _space._arch_of_str(a) == _space._arch_of_str(b)


def decoded_records(db_dir: Path) -> tuple[list, int]:
    """``([(lineno, TuningRecord)], undecodable)`` of a JSON database directory: each record
    with its workload, lines that do not decode counted (a bad workload line is said)."""
    workloads = {}
    for lineno, obj in _read_lines(db_dir / "database_workload.json", "workload"):
        try:
            workloads[len(workloads)] = ms.database.Workload.from_json(obj)
        except Exception:  # noqa: BLE001
            warnings.warn(f"database_workload.json:{lineno}: skipping an undecodable workload",
                          stacklevel=4)
            workloads[len(workloads)] = None
    decoded, bad = [], 0
    for lineno, obj in _read_lines(db_dir / "database_tuning_record.json", "tuning record"):
        try:
            wl = workloads.get(int(obj[0]))
            if wl is None:
                raise ValueError("unknown workload index")
            decoded.append((lineno, ms.database.TuningRecord.from_json(obj[1], wl)))
        except Exception:  # noqa: BLE001
            bad += 1
    return decoded, bad


def _candidates(db_dir: Path, k, n, dtype, tgt, micro_tiles=(None,)):
    """Valid-looking records for (k, n, dtype) and one of the kernel micro-tiles
    ``micro_tiles`` (None: the rows kernels') on ``tgt``, best first; warns on the rest."""
    decoded, bad = decoded_records(db_dir)
    foreign_wl, foreign_tgt, failed = 0, 0, 0
    recs = []
    for lineno, rec in decoded:
        key = _workload_key(rec.workload)
        if key is None or key[:3] != (int(k), int(n), dtype) or key[3] not in micro_tiles:
            foreign_wl += 1
            continue
        if rec.target is None or not _same_target(rec.target, tgt):
            foreign_tgt += 1
            continue
        secs = [float(x) for x in (rec.run_secs or [])]
        if not secs or not all(math.isfinite(s) and 0 < s < _FAILED_SECS for s in secs):
            failed += 1       # a failed build/run: normal in a log, not a warning
            continue
        recs.append((sum(secs) / len(secs), lineno, rec))
    if bad:
        warnings.warn(f"{db_dir}: skipped {bad} tuning record(s) that do not decode or replay "
                      "on their workload", stacklevel=3)
    if foreign_wl:
        what = " or ".join("row_gather_matmul" if t is None else f"tiles_gather_matmul {t[0]}x{t[1]}"
                           for t in micro_tiles)
        warnings.warn(f"{db_dir}: skipped {foreign_wl} record(s) of another workload "
                      f"(not {what} K={k} N={n} {dtype})", stacklevel=3)
    if foreign_tgt:
        warnings.warn(f"{db_dir}: skipped {foreign_tgt} record(s) for another target than "
                      f"{tgt}", stacklevel=3)
    recs.sort(key=lambda x: (x[0], x[1]))
    return recs


def best_record(work_dir, k: int, n: int, dtype: str = "float16", target="cuda",
                max_tries: int = 16, kernel: str | None = None, micro_tile=(1, None)) -> BestRecord | None:
    """The fastest record of the log whose trace replays, as a :class:`BestRecord`: of
    ``kernel``'s space (a :data:`pit_tvm.tuning.space.KNOBSETS` name) for ``micro_tile``.
    Without it, a log root is read for the kernel a build for ``target`` runs
    (:func:`tuned_kernel`), and a database directory for the space its records are of."""
    tgt = make_target(target)
    if kernel is None and not _is_db_dir(Path(work_dir)):
        kernel = tuned_kernel(k, n, dtype, tgt, micro_tile=micro_tile)
    rows = is_rows(k, micro_tile)
    kernels = [kernel] if kernel else [name for name in _space.KNOBSETS if name.endswith(".tiles") != rows]
    tiles = {kernel_micro_tile(name, k, n, micro_tile) for name in kernels}
    db_dir = resolve_log_dir(work_dir, k, n, dtype, kernel or "mma.sync", kernel_micro_tile(kernel, k, n, micro_tile))
    if db_dir is None:      # (a database directory resolves for any kernel: here ``kernel`` is known)
        warnings.warn(f"no tuning log for {_leaf(k, n, dtype, kernel, kernel_micro_tile(kernel, k, n, micro_tile))} "
                      f"under {work_dir}", stacklevel=2)
        return None
    arch = _space._arch_of(tgt)
    for secs, lineno, rec in _candidates(db_dir, k, n, dtype, tgt, tiles)[:max_tries]:
        try:
            func = rec.workload.mod["main"]
            cfg = _space.config_from_trace(rec.trace, rec.workload.mod, _space.KNOBSETS.get(kernel))
            # the whole trace (knobs + postproc schedule) must replay on its workload too
            sch = tvm.s_tir.Schedule(rec.workload.mod)
            rec.trace.apply_to_schedule(sch, remove_postproc=False)
            if cfg not in _space.knobset_of(cfg, func).valid(func, arch):
                raise ValueError(f"{cfg} does not fit K={k}, N={n}")
            m = int(func.params[0].ty.shape[0])
        except Exception as err:  # noqa: BLE001
            warnings.warn(f"database_tuning_record.json:{lineno}: trace does not replay "
                          f"({type(err).__name__}: {str(err).strip().splitlines()[-1][:200] if str(err).strip() else ''}); skipped",
                          stacklevel=2)
            continue
        return BestRecord(cfg, secs, m, db_dir, str(tgt))
    return None


def load_best(work_dir, k: int, n: int, dtype: str = "float16", target="cuda",
              out_dtype: str | None = None, bias: bool = False, relu: bool = False):
    """The best tuned kernel as a scheduled (symbolic-M) PrimFunc, early exit included;
    None (with a warning) when the log holds no valid record for (k, n, dtype, target).

    Corrupt or foreign lines/records are skipped with a ``warnings.warn``, never fatal.
    The kernel's signature is :func:`row_gather_matmul_func`'s (``out_dtype`` defaults to
    ``dtype``; the tuned tile config does not depend on it).
    """
    best = best_record(work_dir, k, n, dtype, target, kernel="mma.sync")
    if best is None:
        return None
    arch = _space._arch_of_str(_space._arch_of(make_target(target)))
    # the tuned tile config also drives the split-K path for few rows (tuned at one M)
    split_k, split_rows = split_plan(k, n, best.config, dtype, arch)
    func = row_gather_matmul_func(k, n, dtype, out_dtype or dtype, bias=bias, relu=relu,
                                  split_k=split_k, split_rows=split_rows)
    try:
        sched = schedule_row_gather_matmul(func, best.config, arch)
    except Exception as err:  # noqa: BLE001
        warnings.warn(f"tuned config {best.config} does not schedule: {err}", stacklevel=2)
        return None
    return sched.with_attr("pit.tuned", json.dumps(
        {"config": best.config.as_dict(), "run_secs": best.run_secs, "tune_m": best.m,
         "log": str(best.log_dir)}))


def trim_log(db_dir, keep: int = 16) -> int:
    """Keep the ``keep`` fastest measured records of a database (file order kept), drop the rest
    and the failed ones; return how many were dropped.  For the logs the repo ships: a build
    reads only the fastest, a resumed search seeds from the best, and the whole working tree
    (logs included) travels with every GPU call under a size limit."""
    path = Path(db_dir) / "database_tuning_record.json"
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def mean_secs(line):
        secs = [float(x) for x in (json.loads(line)[1][1] or [])]
        ok = secs and all(math.isfinite(x) and 0 < x < _FAILED_SECS for x in secs)
        return sum(secs) / len(secs) if ok else math.inf

    times = [mean_secs(line) for line in lines]
    kept = set(sorted((i for i, t in enumerate(times) if t < math.inf), key=lambda i: times[i])[:int(keep)])
    path.write_text("".join(line + "\n" for i, line in enumerate(lines) if i in kept), encoding="utf-8")
    return len(lines) - len(kept)


def _from_log(read, tuning_log, missing: str):
    """``read()`` for a build, which a log never breaks: what reading it warned is said at the
    build's caller, an error is a warning, and nothing valid says ``missing`` (what the build
    takes instead); None then."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            found = read()
        except Exception as err:  # noqa: BLE001 - a broken log never breaks compilation
            warnings.warn(f"reading tuning log {tuning_log} failed: {err}", stacklevel=2)
            found = None
    for w in caught:  # attributed to the caller of the hook
        warnings.warn(w.message, w.category, stacklevel=4)
    if found is None:
        warnings.warn(missing, stacklevel=4)
    return found


def tuned_config(tuning_log, k: int, n: int, dtype: str, target, kernel: str, micro_tile=(1, None)):
    """``sparse_matmul(..., tuning_log=...)``'s hook for the kernels a build makes from a config
    (``"wgmma"``, ``"wgmma.tiles"``: a :class:`WgmmaConfig`; ``"mma.sync.tiles"``: a
    :class:`TilesConfig`): the config of the log's best record of ``kernel`` for the build's
    ``target`` and the user's ``micro_tile``, or None with a warning (the caller then takes
    the planned config)."""
    leaf = _leaf(k, n, dtype, kernel, kernel_micro_tile(kernel, k, n, micro_tile))
    best = _from_log(lambda: best_record(tuning_log, k, n, dtype, target, kernel=kernel, micro_tile=micro_tile),
                     tuning_log, f"no valid tuned config for {leaf} in {tuning_log}; using the planned "
                     f"{'tiles' if kernel.endswith('.tiles') else kernel} config")
    return None if best is None else best.config


def tuned_rows_kernel(tuning_log, k: int, n: int, dtype: str, out_dtype: str | None = None,
                      target="cuda"):
    """``sparse_matmul(..., tuning_log=...)``'s hook (whole-row micro-tiles, fp16/bf16, CUDA):
    :func:`load_best`, or None with a warning (the caller then uses the untuned kernel)."""
    return _from_log(lambda: load_best(tuning_log, k, n, dtype, target, out_dtype=out_dtype), tuning_log,
                     f"no valid tuned schedule for {_leaf(k, n, dtype)} in {tuning_log}; "
                     "using the untuned tensor-core kernel")
