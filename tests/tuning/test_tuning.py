"""MetaSchedule tuning of the tensor-core PIT kernel (pit_tvm.tuning.space / .tune).

CPU: the design space (sampled kernels build for sm_90 and pass nvcc; re-sampled traces stay
consistent with their knobs; the workload is never written in place), the knob mutator, a
hand-written JSON database round trip, corrupt/foreign records, an end-to-end ``tune_matmul``
with a fake runner (real LocalBuilder, xgb cost model, evolutionary search), the
``sparse_matmul(tuning_log=)`` hook and the CLI.  GPU (``@pytest.mark.gpu``): 8 real trials,
the tuned kernel against numpy.
"""
from __future__ import annotations

import json
import random
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import s_tir
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture

from pit_tvm.testing import expand, rows_index, tile_pattern
from pit_tvm.nvcc import check_cuda_compiles, find_nvcc
from pit_tvm.schedules.tensorcore import TensorCoreConfig, build
from pit_tvm.tuning import space as S
from pit_tvm.tuning.tune import best_record, load_best, log_dir, tune_matmul

K, N = 512, 256
TARGET = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
SM90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
TILES_MICRO_TILE = (32, 64)


def _workload(k=K, n=N, dtype="float16", m=S.DEFAULT_TUNE_M):
    return S.tuning_workload(k, n, dtype, dtype, m)


def _knobs(trace):
    return [int(trace.get_decision(i)) for i in S._knob_insts(trace)]


# ---------------------------------------------------------------------------------------
# design space
# ---------------------------------------------------------------------------------------
def test_wgmma_design_space_builds_the_tirx_kernel():
    """sm_90a: the space samples the wgmma kernel's knobs (nothing scheduled), a candidate is
    the TIRx kernel of that config, its CUDA compiles; an unfit config is refused"""
    from pit_tvm.schedules.wgmma import ROWS_ATTR, WgmmaConfig

    func = _workload()
    sm90a = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    ctx = ms.TuneContext(mod=func, target=sm90a, space_generator=S.space_generator("sm_90a", kernel="wgmma"),
                         task_name="pit", rand_state=7)
    (space,) = ctx.generate_design_space()
    cfg = S.config_from_trace(space.trace, func, S.WGMMA)
    assert cfg in S.valid_wgmma_configs(K, N, "float16", "float16")
    assert {c.block_n for c in S.valid_wgmma_configs(K, N, "float16", "float16")} == {64, 128, 256}  # N=256
    candidate = S.prepare_candidate(space.mod)["main"]
    assert dict(candidate.attrs[ROWS_ATTR]) == {"block_n": cfg.block_n, "stages": cfg.stages, "block_k": 64}
    ex = build(candidate, sm90a)
    assert "wgmma.mma_async" in "\n".join(m.inspect_source("cuda") for m in ex.mod.imports)
    sch = S.knob_schedule(func, WgmmaConfig(128, 4))
    assert S.config_from_trace(sch.trace, func, S.WGMMA) == WgmmaConfig(128, 4)
    with pytest.raises(ValueError, match="does not fit"):
        S.knob_schedule(func, WgmmaConfig(192, 4))          # 192 does not divide N = 256
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(ex, archs=("sm_90a",)) >= 1


def test_design_space_is_the_scheduled_kernel_and_builds():
    func = _workload()
    ctx = ms.TuneContext(mod=func, target=TARGET, space_generator=S.space_generator("sm_90"),
                         task_name="pit", rand_state=7)
    (space,) = ctx.generate_design_space()
    cfg = S.config_from_trace(space.trace, func)
    assert cfg in S.valid_knob_configs(K, N, "float16", "float16")
    ex = build(S.prepare_candidate(space.mod)["main"], TARGET)
    src = "\n".join(m.inspect_source("cuda") for m in ex.mod.imports)
    assert "mma.sync.aligned.m16n8k16" in src and "ldmatrix" in src
    assert "OFF_ptr[1]" in src   # the early exit / SWrite guard read the count on the device
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(ex, archs=("sm_90",)) >= 1


def test_space_fn_seeds_give_different_valid_kernels_that_build():
    func = _workload()
    mod = tvm.IRModule({"main": func})
    h0 = tvm_ffi.structural_hash(func)
    configs = {}
    for seed in range(1, 13):
        sch = s_tir.Schedule(mod, seed=seed)
        S.pit_space(sch)
        configs[S.config_from_trace(sch.trace, func)] = sch
    assert len(configs) >= 4
    # the unscheduled workload is never written in place (TVM 0.27 copy-on-write slip, see
    # space.KNOB_BLOCK)
    assert tvm_ffi.structural_hash(func) == h0
    picked = sorted(configs, key=lambda c: (c.stages, c.block_m, c.block_n))
    for cfg in (picked[0], picked[-1]):        # a 1-stage and a deep-pipeline kernel
        sch = configs[cfg]
        ex = build(S.prepare_candidate(sch.mod)["main"], TARGET)
        src = "\n".join(m.inspect_source("cuda") for m in ex.mod.imports)
        assert ("cp.async" in src) == (cfg.stages > 1), cfg
        if find_nvcc() is not None:
            assert check_cuda_compiles(ex, archs=("sm_90",)) >= 1


def test_resampled_traces_are_consistent_with_their_knobs():
    """What the evolutionary search does: replay the design space with its decisions cleared
    (remove_postproc), run the postprocs; every valid sample is the kernel of its knobs."""
    func = _workload()
    mod = tvm.IRModule({"main": func})
    space = s_tir.Schedule(mod, seed=3)
    S.pit_space(space)
    knob_trace = space.trace.simplified(remove_postproc=True)
    assert len(S._knob_insts(knob_trace)) == len(S.KNOBS)   # samples survive simplification
    post = S.ApplyPitKnobs("mma.sync", "sm_90")
    seen, ok = set(), 0
    for seed in range(1, 25):
        sch = s_tir.Schedule(mod, seed=seed)
        s_tir.Trace(knob_trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
        cfg = S.config_from_schedule(sch)
        sch.enter_postproc()
        valid = cfg in S.valid_knob_configs(K, N, "float16", "float16")
        assert post.apply(sch) == valid, cfg
        if not valid:
            continue
        ok += 1
        seen.add(cfg)
        ref = S.knob_schedule(func, cfg)
        assert tvm_ffi.structural_equal(sch.mod, ref.mod), cfg
    assert ok >= 3 and len(seen) >= 3


@pytest.mark.parametrize("kernel, micro_tile, arch", [
    ("wgmma.tiles", (128, 64), "sm_90a"),          # loader warpgroup or not: a knob
    ("wgmma.tiles", (128, 1), "sm_90a"),           # A compacted by its own kernel first
    ("mma.sync.tiles", (32, 64), "sm_90"),
    ("mma.sync.tiles", (32, 1), "sm_80"),          # the workload's A_compact kernel
])
def test_tiles_design_spaces_build(kernel, micro_tile, arch):
    """The tiles kinds' spaces: seeds give different valid configs of the kernel's knobs, the
    workload is never written in place, a candidate is the kernel of its config (the wgmma
    TIRx kernel; the mma.sync schedule with its dynamic K loop), and its CUDA compiles"""
    from pit_tvm.schedules.tensorcore_tiles import DYN_K_ATTR, needs_compact_a

    knobset = S.KNOBSETS[kernel]
    a_compact = kernel == "mma.sync.tiles" and needs_compact_a(micro_tile, "float16")
    func = S.tiles_tuning_workload(K, N, micro_tile, "float16", "float16", a_compact=a_compact)
    mod = tvm.IRModule({"main": func})
    h0 = tvm_ffi.structural_hash(func)
    valid = knobset.valid(func, arch)
    configs = {}
    for seed in range(1, 9):
        sch = s_tir.Schedule(mod, seed=seed)
        S.pit_space(sch, knobset, arch)
        configs[S.config_from_trace(sch.trace, func, knobset)] = sch
    assert len(configs) >= 3 and set(configs) <= set(valid)
    assert tvm_ffi.structural_hash(func) == h0
    if kernel == "wgmma.tiles":
        assert {c.tiles_ws for c in valid} == ({False, True} if micro_tile[1] % 64 == 0 else {False})
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    cfg = sorted(configs, key=repr)[0]
    candidate = S.prepare_candidate(configs[cfg].mod)["main"]
    ex = build(candidate, target)
    src = ex.mod.imports[0].inspect_source("cuda")
    if kernel == "wgmma.tiles":
        from pit_tvm.schedules.wgmma import wgmma_tiles_gather_func

        assert candidate.same_as(wgmma_tiles_gather_func(K, N, micro_tile[1], "float16", "float16", config=cfg))
        assert "wgmma.mma_async" in src
    else:
        assert "mma.sync.aligned.m16n8k16" in src and "pit_k_steps" in candidate.script()
        # the K loop's dynamic extent is the builder's post-process, not in the trace
        assert DYN_K_ATTR in str(S.knob_schedule(func, cfg, arch).mod)
        assert "pit_k_steps" not in S.knob_schedule(func, cfg, arch).mod.script()
    # wgmma: 192 does not divide N; mma.sync: a 64-row warp tile in a 32-row strip
    unfit = replace(cfg, block_n=192) if kernel == "wgmma.tiles" else replace(cfg, warp_m=64)
    with pytest.raises(ValueError, match="does not fit"):
        S.knob_schedule(func, unfit, arch)
    if kernel == "mma.sync.tiles":
        with pytest.raises(ValueError, match="block_n=192 is not one of"):
            S.knob_schedule(func, replace(cfg, block_n=192), arch)
    if find_nvcc() is not None:
        assert check_cuda_compiles(ex, archs=(arch,)) >= 1


def test_tiles_resampled_traces_are_the_kernels_of_their_knobs():
    """the mma.sync tiles space as the evolutionary search replays it: every valid sample is
    exactly the kernel of its knobs, an unfit one a failed sample"""
    knobset = S.MMA_SYNC_TILES
    func = S.tiles_tuning_workload(K, N, TILES_MICRO_TILE, "float16", "float16")
    mod = tvm.IRModule({"main": func})
    space = s_tir.Schedule(mod, seed=3)
    S.pit_space(space, knobset)
    knob_trace = space.trace.simplified(remove_postproc=True)
    assert len(S._knob_insts(knob_trace)) == len(S.TILES_KNOBS)
    post = S.ApplyPitKnobs("mma.sync.tiles", "sm_90")
    seen, failed = set(), 0
    for seed in range(1, 25):
        sch = s_tir.Schedule(mod, seed=seed)
        s_tir.Trace(knob_trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
        cfg = S.config_from_schedule(sch, knobset)
        sch.enter_postproc()
        valid = cfg in knobset.valid(func, "sm_90")
        assert post.apply(sch) == valid, cfg
        if not valid:
            failed += 1
            continue
        seen.add(cfg)
        assert tvm_ffi.structural_equal(sch.mod, S.knob_schedule(func, cfg).mod), cfg
    assert len(seen) >= 3 and failed >= 1


def test_tiles_runner_arguments_are_a_valid_index():
    """the runner's arguments for a tiles workload: each strip lists round(density * KT) distinct
    columns in ascending order, the unused tail is -1 (a random int32 fill would read out of bounds)"""
    from pit_tvm.tuning._worker import alloc_pit_arguments

    func = S.tiles_tuning_workload(K, N, TILES_MICRO_TILE, "float16", "float16", m=1000)
    infos = ms.arg_info.ArgInfo.from_prim_func(func)
    (args,) = alloc_pit_arguments(tvm.cpu(), [i.as_json() for i in infos], 1, density=0.25)
    offsets, ids = args[2].numpy(), args[3].numpy()
    strips, kt = -(-1000 // 32), K // 64
    assert offsets.shape == (strips + 1,) and ids.shape == (strips * kt,)
    count = 2                                                   # round(0.25 * 8)
    assert (np.diff(offsets) == count).all() and offsets[0] == 0
    listed = ids[: offsets[-1]].reshape(strips, count)
    assert (np.diff(listed, axis=1) > 0).all() and listed.min() >= 0 and listed.max() < kt
    assert (ids[offsets[-1]:] == -1).all()
    assert len({tuple(r) for r in listed}) > 1                 # not the same columns in every strip
    rows = alloc_pit_arguments(tvm.cpu(), [i.as_json() for i in ms.arg_info.ArgInfo.from_prim_func(_workload(m=1000))], 1)
    assert rows[0][2].numpy().tolist() == [0, 1000] and (rows[0][3].numpy() == np.arange(1000)).all()


def test_cold_l2_evaluator_flushes_before_every_run(monkeypatch):
    """the runner's evaluator times number x repeat single runs, each after a flush (checked on
    the CPU: the same time_evaluator path, f_preproc and all)"""
    from tvm.s_tir.meta_schedule.runner import EvaluatorConfig
    from tvm.script import tirx as T

    from pit_tvm.tuning import _worker as W

    @T.prim_func
    def add_one(a: T.Buffer((1024,), "float32"), b: T.Buffer((1024,), "float32")):
        for i in range(1024):
            b[i] = a[i] + T.float32(1)

    flushed = []
    flush = W._flush_l2

    def counted(*args):
        flushed.append(1)
        flush(*args)

    monkeypatch.setattr(W, "_flush_l2", counted)
    monkeypatch.setattr(W, "_FLUSH_BYTES", 1 << 22)
    monkeypatch.setattr(W, "_FLUSH", {})
    ex = tvm.compile(tvm.IRModule({"main": add_one}), target="llvm")
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(np.arange(1024, dtype="float32"), dev), tvm.runtime.empty((1024,), "float32", dev)]
    costs = W.run_evaluator_cold_l2(ex.mod, dev, EvaluatorConfig(number=2, repeat=3), [args])
    assert len(costs) == 6 and all(c > 0 for c in costs) and len(flushed) == 6
    np.testing.assert_array_equal(args[1].numpy(), np.arange(1024) + 1)


def test_mutator_moves_one_knob():
    func = _workload()
    sch = S.knob_schedule(func, TensorCoreConfig(block_k=32, stages=3))
    before = _knobs(sch.trace)
    mut = S.MutateKnob(seed=5)
    moved = 0
    for _ in range(10):
        new = mut.apply(sch.trace)
        after = _knobs(new)
        assert sum(a != b for a, b in zip(before, after)) == 1
        moved += 1
        S.config_from_trace(new, func)   # replays
    assert moved == 10


# ---------------------------------------------------------------------------------------
# database
# ---------------------------------------------------------------------------------------
CFG_FAST = TensorCoreConfig(block_m=128, block_n=128, block_k=32, warp_m=64, warp_n=64, stages=3)
CFG_MID = TensorCoreConfig(block_m=64, block_n=128, block_k=32, warp_m=32, warp_n=64, stages=4)
CFG_SLOW = TensorCoreConfig(block_m=64, block_n=64, block_k=32, warp_m=32, warp_n=32, stages=1)


def _commit(db, workload, cfg, secs, target=TARGET):
    wl = db.commit_workload(tvm.IRModule({"main": workload}))
    sch = S.knob_schedule(workload, cfg)
    rec = ms.database.TuningRecord(
        sch.trace, wl, run_secs=[float(secs)] * 3, target=target,
        args_info=ms.arg_info.ArgInfo.from_prim_func(workload))
    db.commit_tuning_record(rec)


def _write_db(path: Path, entries):
    path.mkdir(parents=True, exist_ok=True)
    db = ms.database.JSONDatabase(work_dir=str(path))
    for workload, cfg, secs, *tgt in entries:
        _commit(db, workload, cfg, secs, *tgt)
    return path


def _tuned_config(func) -> TensorCoreConfig:
    return TensorCoreConfig(**json.loads(str(func.attrs["pit.tuned"]))["config"])


def test_database_round_trip(tmp_path):
    wl = _workload()
    db_dir = _write_db(log_dir(K, N, "float16", tmp_path, gpu="test-gpu"),
                       [(wl, CFG_SLOW, 3e-4), (wl, CFG_FAST, 1e-4), (wl, CFG_MID, 2e-4)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # a clean log warns about nothing
        best = best_record(db_dir, K, N, "float16", "cuda")
        func = load_best(db_dir, K, N, "float16", "cuda")
        # the log root resolves too
        assert load_best(tmp_path, K, N, "float16", "cuda") is not None
    assert best.config == CFG_FAST and best.run_secs == pytest.approx(1e-4)
    assert best.m == S.DEFAULT_TUNE_M
    assert _tuned_config(func) == CFG_FAST
    # the symbolic-M kernel with the early exit re-applied
    assert not isinstance(func.params[0].ty.shape[0], tvm.tirx.IntImm)
    text = func.script()
    assert "tvm_thread_invariant" in text and "pit.early_exit_block_m" not in text
    ex = build(func, TARGET)
    src = "\n".join(m.inspect_source("cuda") for m in ex.mod.imports)
    assert "mma.sync" in src


def test_corrupt_and_foreign_records_are_skipped(tmp_path):
    wl = _workload()
    other = _workload(k=256)                                   # another workload
    db_dir = _write_db(tmp_path / "db", [
        (wl, CFG_SLOW, 3e-4), (wl, CFG_MID, 2e-4),
        (other, CFG_FAST, 1e-6),                               # faster, other workload
        (wl, CFG_FAST, 2e-6, tvm.target.Target({"kind": "cuda", "arch": "sm_80"})),  # other target
        (wl, CFG_FAST, 5e-6, tvm.target.Target({"kind": "llvm", "num-cores": 1})),
    ])
    recs = db_dir / "database_tuning_record.json"
    wls = db_dir / "database_workload.json"
    lines = recs.read_text().splitlines()
    # a record of `wl` whose trace does not replay (GetSBlock of a block that does not
    # exist), and the fastest of all
    bad_trace = json.loads(lines[0])
    assert bad_trace[1][0][0][0][0] == "GetSBlock"
    bad_trace[1][0][0][0][2][0] = "no_such_block"
    bad_trace[1][1] = [1e-7]
    with open(recs, "a") as f:
        f.write("this is not json\n")
        f.write('[0, ["truncated record"\n')
        f.write(json.dumps([99, lines[0][1:]]) + "\n")          # unknown workload index
        f.write(json.dumps(bad_trace) + "\n")
        no_knobs = json.loads(lines[0])
        no_knobs[1][0], no_knobs[1][1] = [[], []], [1e-9]      # an empty trace, the fastest
        f.write(json.dumps(no_knobs) + "\n")
    with open(wls, "a") as f:
        f.write("{garbage\n")
    with pytest.warns(UserWarning) as rec:
        func = load_best(db_dir, K, N, "float16", "cuda")
    msgs = "\n".join(str(w.message) for w in rec)
    assert "malformed" in msgs
    assert "another workload" in msgs
    assert "another target" in msgs
    assert "do not decode or replay" in msgs                   # the bad GetSBlock
    assert "does not replay" in msgs                           # the empty trace (no knobs)
    assert func is not None and _tuned_config(func) == CFG_MID


def test_trim_log_keeps_the_fastest_records(tmp_path):
    """a shipped log keeps its N fastest measured records (file order kept), no failed one, and
    its best record is the same"""
    from pit_tvm.tuning.tune import trim_log

    wl = _workload()
    configs = S.valid_knob_configs(K, N, "float16", "float16")[:5]
    secs = [3e-4, 1e-4, 1e10, 2e-4, 5e-4]                          # 1e10: a failed build
    db_dir = _write_db(tmp_path / "db", [(wl, c, t) for c, t in zip(configs, secs)])
    best = best_record(db_dir, K, N, "float16", "cuda:sm_90").config
    assert trim_log(db_dir, 2) == 3
    records = ms.database.JSONDatabase(work_dir=str(db_dir)).get_all_tuning_records()
    assert [S.config_from_trace(r.trace, r.workload.mod) for r in records] == [configs[1], configs[3]]
    assert best_record(db_dir, K, N, "float16", "cuda:sm_90").config == best == configs[1]


def test_load_best_without_valid_records(tmp_path):
    with pytest.warns(UserWarning, match="no tuning log"):
        assert load_best(tmp_path, K, N, "float16", "cuda") is None
    db_dir = tmp_path / "db"
    db_dir.mkdir()
    (db_dir / "database_workload.json").write_text("garbage\n")
    (db_dir / "database_tuning_record.json").write_text("[0, 1]\n")
    with pytest.warns(UserWarning):
        assert load_best(db_dir, K, N, "float16", "cuda") is None


# ---------------------------------------------------------------------------------------
# tune_matmul end to end (fake runner), the sparse_matmul hook, the CLI
# ---------------------------------------------------------------------------------------
@derived_object
class FakeRunner(ms.runner.PyRunner):
    """Deterministic fake latencies: no GPU here.  Everything else is real (LocalBuilder,
    xgb, evolutionary search, JSON database)."""

    def __init__(self, seed=0):
        super().__init__()
        self.rng = random.Random(seed)

    def run(self, runner_inputs):
        return [LocalRunnerFuture(res=[self.rng.uniform(1e-4, 1e-3)]) for _ in runner_inputs]


@pytest.fixture(scope="module")
def tuned_log(tmp_path_factory):
    """(log root, the rows log, {tiles kernel: its log}): every tune in one fixture (MetaSchedule's
    loggers cannot be set up again in a later test of one process)"""
    root = tmp_path_factory.mktemp("tuning_logs")
    kw = dict(work_dir=root, runner=FakeRunner(), population_size=32, progress=False)
    path = tune_matmul(K, N, "float16", "cuda:sm_90", trials=8, trials_per_iter=8, **kw)
    tiles = {"wgmma.tiles": tune_matmul(K, N, "float16", "cuda", trials=6, trials_per_iter=6,
                                        micro_tile=TILES_MICRO_TILE, **kw),
             "mma.sync.tiles": tune_matmul(K, N, "float16", "cuda:sm_90", trials=6, trials_per_iter=6,
                                           micro_tile=TILES_MICRO_TILE, **kw)}
    return root, path, tiles


def test_tune_matmul_with_fake_runner(tuned_log):
    root, path, _ = tuned_log
    assert path.parent.parent == root and path.name == f"matmul_k{K}_n{N}_float16"
    lines = (path / "database_tuning_record.json").read_text().splitlines()
    # the planned config, then 8 trials (7 where the search's parallel sampling ran short of
    # unmeasured kernels: it is not deterministic across runs)
    assert 8 <= len(lines) <= 9
    db = ms.database.JSONDatabase(work_dir=str(path))
    recs = db.get_all_tuning_records()
    cfgs = {S.config_from_trace(r.trace, r.workload.mod) for r in recs}
    assert len(cfgs) >= len(lines) - 1       # distinct kernels (the search may measure the plan again)
    assert S.MMA_SYNC.planned(recs[0].workload.mod["main"], "sm_90") in cfgs
    fastest = min(recs, key=lambda r: float(np.mean([float(x) for x in r.run_secs])))
    func = load_best(path, K, N, "float16", "cuda")
    assert _tuned_config(func) == S.config_from_trace(fastest.trace, fastest.workload.mod)


def test_sparse_matmul_tuning_log_hook(tuned_log):
    from pit_tvm.ops.matmul import sparse_matmul

    root, path, _ = tuned_log
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op = sparse_matmul(K, N, "float16", micro_tile=(1, K), target="cuda:sm_90", tuning_log=root)
    # the log is of the mma.sync space: sm_90a (the default "cuda") runs wgmma, whose log it lacks
    with pytest.warns(UserWarning, match="no tuning log for wgmma_matmul"):
        op_wgmma = sparse_matmul(K, N, "float16", micro_tile=(1, K), target="cuda", tuning_log=root)
    from pit_tvm.nvcc import cuda_sources

    assert "mma.sync" in "\n".join(cuda_sources(op.executable))
    assert "wgmma.mma_async" in "\n".join(cuda_sources(op_wgmma.executable))
    with pytest.warns(UserWarning) as rec:
        sparse_matmul(K, N, "float16", micro_tile=(1, K), target="cuda:sm_90",
                      tuning_log=root / "missing")
    msgs = [str(w.message) for w in rec]
    assert any("no tuning log" in m for m in msgs) and any("untuned" in m for m in msgs)


@pytest.mark.parametrize("target, micro_tile, why", [
    ("llvm", (1, K), "tuning log .* not used: .*the target is llvm"),
    ("cuda:sm_90", (4, K), "tuning log .* not used: .*runs the SIMT kernel"),
    # the rows kernel's database holds no tiles kernel: the planned tiles config is said
    ("cuda:sm_90", (32, 64), "no valid tuned config for matmul_32x64_k512_n256_float16 .*planned tiles config"),
    ("cuda", (32, 64), "no valid tuned config for wgmma_matmul_128x64_k512_n256_float16 .*planned tiles config"),
])
def test_tuning_log_not_used_is_said(tuned_log, target, micro_tile, why):
    """a build that cannot use a tuning log says so (and builds), never drops it silently"""
    from pit_tvm.ops.matmul import sparse_matmul

    root, rows_log, _ = tuned_log
    with pytest.warns(UserWarning, match=why):
        sparse_matmul(K, N, "float16", micro_tile=micro_tile, target=target,
                      tuning_log=rows_log if micro_tile[1] < K else root)


def test_wgmma_log_drives_sm90a_builds(tmp_path):
    """a log of the wgmma space (sm_90a) gives a "cuda" build's rows kernel, and its tiers, the
    fastest record's config in place of the planned one"""
    from pit_tvm.nvcc import cuda_sources
    from pit_tvm.ops.matmul import MatmulPlan, sparse_matmul, tensor_core_kernel
    from pit_tvm.schedules.wgmma import ROWS_ATTR, WgmmaConfig
    from pit_tvm.tuning.tune import tuned_config

    sm90a = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    _write_db(log_dir(K, N, "float16", tmp_path, gpu="test-gpu", kernel="wgmma"),
              [(_workload(), WgmmaConfig(256, 4), 3e-4, sm90a), (_workload(), WgmmaConfig(64, 5), 1e-4, sm90a)])
    plan = MatmulPlan(K, N, (1, K))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuned_config(tmp_path, K, N, "float16", "cuda", "wgmma") == WgmmaConfig(64, 5)
        kernel = tensor_core_kernel(plan, "float16", "float16", "cuda", tmp_path)
        op = sparse_matmul(K, N, "float16", micro_tile=(1, K), target="cuda", tuning_log=tmp_path)
    assert dict(kernel.attrs[ROWS_ATTR]) == {"block_n": 64, "stages": 5, "block_k": 64}
    assert dict(tensor_core_kernel(plan, "float16", "float16", "cuda").attrs[ROWS_ATTR])["block_n"] == 256
    assert "wgmma.mma_async.sync.aligned.m64n64k16" in "\n".join(cuda_sources(op.executable))
    # the mma.sync reader does not take the wgmma log
    with pytest.warns(UserWarning, match="no tuning log for matmul_k"):
        assert load_best(tmp_path, K, N, "float16", "cuda:sm_90") is None


def test_wgmma_config_that_does_not_build_falls_back_to_the_planned_wgmma_kernel(tmp_path, monkeypatch):
    """on sm_90a a tuned wgmma config that does not build here is said, and the build takes the
    planned wgmma kernel: never the mma.sync schedule of another log under the same root"""
    import pit_tvm.ops.matmul as M
    import pit_tvm.ops.matmul.backends as backends
    from pit_tvm.schedules.wgmma import ROWS_ATTR, WgmmaConfig

    sm90a = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    _write_db(log_dir(K, N, "float16", tmp_path, gpu="test-gpu", kernel="wgmma"),
              [(_workload(), WgmmaConfig(64, 5), 1e-4, sm90a)])
    _write_db(log_dir(K, N, "float16", tmp_path, gpu="test-gpu"),
              [(_workload(), S.valid_knob_configs(K, N, "float16", "float16")[0], 1e-4)])
    rows_kernel = M._cuda_rows_kernel

    def tuned_does_not_build(*args):
        if args[-1] is not None:
            raise ValueError("tuned for another output dtype")
        return rows_kernel(*args)

    monkeypatch.setattr(backends, "_cuda_rows_kernel", tuned_does_not_build)
    with pytest.warns(UserWarning, match="its config .*block_n=64.* does not build here"):
        kernel = M.tensor_core_kernel(M.MatmulPlan(K, N, (1, K)), "float16", "float16", "cuda", tmp_path)
    assert dict(kernel.attrs[ROWS_ATTR])["block_n"] == 256          # the planned wgmma kernel


def test_tiles_log_of_sm80_drives_sm80_builds(tmp_path):
    """an mma.sync tiles log of cuda:sm_80 records is read by a cuda:sm_80 build of that
    micro-tile (the build's target, not sm_90a's, decides which records are foreign)"""
    from pit_tvm.ops.matmul import MatmulPlan, _cuda_tiles_kernel, tensor_core_kernel
    from pit_tvm.schedules.tensorcore_tiles import TilesConfig

    sm80 = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    workload = S.tiles_tuning_workload(K, N, TILES_MICRO_TILE, "float16", "float16")
    cfg = TilesConfig(block_n=64, block_k=32, warp_m=32, warp_n=32, stages=2)
    assert cfg in S.MMA_SYNC_TILES.valid(workload, "sm_80") and cfg != S.MMA_SYNC_TILES.planned(workload, "sm_80")
    _write_db(log_dir(K, N, "float16", tmp_path, gpu="test-gpu", kernel="mma.sync.tiles", micro_tile=TILES_MICRO_TILE),
              [(workload, cfg, 1e-4, sm80)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        built = tensor_core_kernel(MatmulPlan(K, N, TILES_MICRO_TILE), "float16", "float16", "cuda:sm_80", tmp_path)
    assert tvm_ffi.structural_equal(built, _cuda_tiles_kernel(K, N, "float16", "float16", TILES_MICRO_TILE,
                                                              "sm_80", cfg))


def test_tuning_log_of_sm80_drives_sm80_builds(tmp_path):
    """a log of cuda:sm_80 records is read for a cuda:sm_80 build (not skipped as another
    target's): the kernel built carries the log's fastest config; an sm_90 build skips them"""
    from pit_tvm.ops.matmul import MatmulPlan, sparse_matmul, tensor_core_kernel

    wl, sm80 = _workload(), tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    _write_db(log_dir(K, N, "float16", tmp_path, gpu="test-gpu"),
              [(wl, CFG_SLOW, 3e-4, sm80), (wl, CFG_FAST, 1e-4, sm80)])
    plan = MatmulPlan(K, N, (1, K))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        func = tensor_core_kernel(plan, "float16", "float16", "cuda:sm_80", tmp_path)
        sparse_matmul(K, N, "float16", micro_tile=(1, K), target="cuda:sm_80", tuning_log=tmp_path)
    assert _tuned_config(func) == CFG_FAST
    with pytest.warns(UserWarning, match="another target"):
        untuned = tensor_core_kernel(plan, "float16", "float16", "cuda:sm_90", tmp_path)
    assert "pit.tuned" not in untuned.attrs


def test_compile_onnx_and_cli_compile_read_the_tuning_log(tmp_path, capsys):
    """``compile_onnx(..., tuning_log=)`` and ``pit-tvm compile --tuning-log`` build a model's
    whole-row PIT matmul of the log's shape from the log's fastest record"""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    import pit_tvm
    from pit_tvm.cli.main import main

    rng = np.random.default_rng(0)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["hidden"]),
         helper.make_node("MatMul", ["hidden", "w2"], ["y"])], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", N])],
        [numpy_helper.from_array(rng.standard_normal((64, K)).astype("float16"), "w1"),
         numpy_helper.from_array(rng.standard_normal((K, N)).astype("float16"), "w2")]),
        opset_imports=[helper.make_opsetid("", 17)])
    sm80 = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    _write_db(log_dir(K, N, "float16", tmp_path / "logs", gpu="test-gpu"),
              [(_workload(), CFG_SLOW, 3e-4, sm80), (_workload(), CFG_FAST, 1e-4, sm80)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        cm = pit_tvm.compile_onnx(model, "cuda:sm_80", sparse={"hidden": (1, K)}, tuning_log=tmp_path / "logs")
    tuned = [f for f in cm.lowered.functions.values() if f.attrs is not None and "pit.tuned" in f.attrs]
    assert len(tuned) == 1 and _tuned_config(tuned[0]) == CFG_FAST
    onnx.save(model, tmp_path / "m.onnx")
    assert main(["compile", str(tmp_path / "m.onnx"), "--target", "cuda", "--sparse", f"hidden:1x{K}",
                 "--tuning-log", str(tmp_path / "logs"), "-o", str(tmp_path / "m.so")]) == 0
    # (sm_90a runs wgmma: the CLI says the log is not used)
    assert "tuning log" in capsys.readouterr().err


def test_cli_tune(tuned_log, monkeypatch, capsys):
    import pit_tvm.tuning.tune as tune_mod
    from pit_tvm.cli.main import main

    root, path, _ = tuned_log
    calls = {}

    def fake_tune(k, n, dtype, **kw):
        calls.update(k=k, n=n, dtype=dtype, **kw)
        return path

    monkeypatch.setattr(tune_mod, "tune_matmul", fake_tune)
    rc = main(["tune", "--op", "matmul", "--k", str(K), "--n", str(N), "--dtype", "float16",
               "--target", "cuda", "--trials", "8", "--work-dir", str(root)])
    out = capsys.readouterr().out
    assert rc == 0
    assert calls["trials"] == 8 and calls["work_dir"] == str(root) and calls["k"] == K
    assert "best:" in out and " us " in out and str(path) in out


def test_cli_tune_micro_tile(tuned_log, monkeypatch, capsys):
    """``--micro-tile`` / ``--density`` reach tune_matmul, the best tiles config is printed; a
    malformed micro-tile is an error naming it"""
    import pit_tvm.tuning.tune as tune_mod
    from pit_tvm.cli.main import main

    root, _, tiles = tuned_log
    calls = {}

    def fake_tune(k, n, dtype, **kw):
        calls.update(kw)
        return tiles["mma.sync.tiles"]

    monkeypatch.setattr(tune_mod, "tune_matmul", fake_tune)
    rc = main(["tune", "--k", str(K), "--n", str(N), "--target", "cuda:sm_90", "--micro-tile", "32x64",
               "--density", "0.25", "--work-dir", str(root)])
    out = capsys.readouterr().out
    assert rc == 0 and calls["micro_tile"] == (32, 64) and calls["density"] == 0.25
    assert "25% of each strip's micro-tiles listed" in out and "K step" in out
    rc = main(["tune", "--k", str(K), "--n", str(N), "--micro-tile", "32by64"])
    assert rc == 2 and "--micro-tile '32by64'" in capsys.readouterr().err


@pytest.mark.parametrize("kernel, target", [("wgmma.tiles", "cuda"), ("mma.sync.tiles", "cuda:sm_90")])
def test_tiles_logs_drive_builds(tuned_log, tmp_path, kernel, target):
    """A tiles kind's log gives the builds of its target the fastest record's config: the
    wgmma tiles kernel (sm_90a: 1x64 and 32x64 both run its 128x64 strips) or the mma.sync
    tiles schedule (sm_90).  The tuned log (fake latencies) is read as measured; a record of
    another config made fastest changes the kernel built."""
    import shutil

    from pit_tvm.ops.matmul import MatmulPlan, _cuda_tiles_kernel, _cuda_wgmma_tiles, sparse_matmul, tensor_core_kernel
    from pit_tvm.schedules.wgmma import wgmma_tiles_config, wgmma_tiles_gather_func

    root, _, tiles = tuned_log
    path = tiles[kernel]
    strip = 128 if kernel == "wgmma.tiles" else TILES_MICRO_TILE[0]
    assert path.name == ("wgmma_" if kernel == "wgmma.tiles" else "") + f"matmul_{strip}x64_k{K}_n{N}_float16"
    recs = ms.database.JSONDatabase(work_dir=str(path)).get_all_tuning_records()
    assert 6 <= len(recs) <= 7                                 # the planned config, then up to 6 trials
    knobset = S.KNOBSETS[kernel]
    assert knobset.planned(recs[0].workload.mod["main"], "sm_90") in \
        {S.config_from_trace(r.trace, r.workload.mod, knobset) for r in recs}
    fastest = min(recs, key=lambda r: float(np.mean([float(x) for x in r.run_secs])))
    assert best_record(root, K, N, "float16", target, micro_tile=TILES_MICRO_TILE).config == \
        S.config_from_trace(fastest.trace, fastest.workload.mod, knobset)

    def built(log, micro_tile=TILES_MICRO_TILE):
        if kernel == "wgmma.tiles":
            return _cuda_wgmma_tiles(MatmulPlan(K, N, micro_tile), "float16", "float16", "sm_90a", tuning_log=log).kernel
        return tensor_core_kernel(MatmulPlan(K, N, micro_tile), "float16", "float16", target, log)

    def kernel_of(cfg):
        if kernel == "wgmma.tiles":
            return wgmma_tiles_gather_func(K, N, 64, "float16", "float16", config=cfg)
        return _cuda_tiles_kernel(K, N, "float16", "float16", TILES_MICRO_TILE, "sm_90", cfg)

    # another config, made the fastest record of a copy of the log
    workload = fastest.workload.mod["main"]
    planned = (wgmma_tiles_config(N, 64) if kernel == "wgmma.tiles"
               else S.valid_tiles_knob_configs(K, N, TILES_MICRO_TILE, "float16", "float16", False)[0])
    other = next(c for c in knobset.valid(workload, "sm_90") if c != planned)
    log = shutil.copytree(path, tmp_path / "logs" / "test-gpu" / path.name)
    _commit(ms.database.JSONDatabase(work_dir=str(log)), workload, other, 1e-7,
            SM90A if kernel == "wgmma.tiles" else TARGET)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # a log it can read is read without a word
        for micro_tile in (TILES_MICRO_TILE, (1, 64)) if kernel == "wgmma.tiles" else (TILES_MICRO_TILE,):
            assert tvm_ffi.structural_equal(built(tmp_path / "logs", micro_tile), kernel_of(other))
        assert not tvm_ffi.structural_equal(built(tmp_path / "logs"), kernel_of(planned))
        sparse_matmul(K, N, "float16", micro_tile=TILES_MICRO_TILE, target=target, tuning_log=tmp_path / "logs")


def test_cli_tune_without_a_gpu_is_an_error_up_front(tmp_path, capsys):
    """no CUDA device to measure on: an error saying so, before any trial or log directory"""
    from pit_tvm.cli.main import main

    if tvm.cuda(0).exist:
        pytest.skip("this machine has a GPU")
    rc = main(["tune", "--k", str(K), "--n", str(N), "--trials", "8", "--work-dir", str(tmp_path / "logs"),
               "--no-progress"])
    assert rc == 2 and "has no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_tune_8_trials_and_numerics(tmp_path):
    """Real trials of both spaces (in one test: MetaSchedule's loggers are set up once a
    process): the mma.sync schedule for cuda:sm_90 and the wgmma kernel for "cuda" (sm_90a),
    each tuned kernel against numpy"""
    from pit_tvm.ops.matmul import MatmulPlan, sparse_matmul, tensor_core_kernel
    from pit_tvm.schedules.wgmma import ROWS_ATTR

    k, n, m = 1024, 1024, 1000
    path = tune_matmul(k, n, "float16", "cuda:sm_90", trials=8, work_dir=tmp_path, trials_per_iter=8,
                       population_size=32)
    best = best_record(path, k, n, "float16", "cuda:sm_90")
    assert best is not None and 0 < best.run_secs < 1e-2
    func = load_best(path, k, n, "float16", "cuda:sm_90", out_dtype="float32")
    ex = build(func, "cuda")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    nz = rng.random(m) >= 0.6
    a[~nz] = 0
    b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    offsets, ids = rows_index(nz)
    rows = ids[: offsets[1]]
    a16, b16 = a.astype(np.float16), b.astype(np.float16)
    dev = tvm.cuda(0)
    c = tvm.runtime.tensor(np.full((m, n), np.nan, np.float32), dev)
    ex["main"](*(tvm.runtime.tensor(x, dev) for x in (a16, b16, offsets, ids)), c)
    ref = np.zeros((m, n), np.float32)
    ref[rows] = a16[rows].astype(np.float32) @ b16.astype(np.float32)
    got = c.numpy()
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())

    wg_path = tune_matmul(k, n, "float16", "cuda", trials=6, work_dir=tmp_path, trials_per_iter=6,
                          population_size=16)
    assert wg_path.name == f"wgmma_matmul_k{k}_n{n}_float16"
    best = best_record(tmp_path, k, n, "float16", "cuda")
    assert best is not None and 0 < best.run_secs < 1e-2
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        kernel = tensor_core_kernel(MatmulPlan(k, n, (1, k)), "float16", "float16", "cuda", tmp_path)
        op = sparse_matmul(k, n, "float16", micro_tile=(1, k), target="cuda", tuning_log=tmp_path)
    assert dict(kernel.attrs[ROWS_ATTR])["block_n"] == best.config.block_n
    np.testing.assert_allclose(op(a16, b16).astype(np.float32), ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
    # the tiles kinds: the wgmma tiles kernel ("cuda") and the mma.sync tiles schedule (cuda:sm_90)
    for target, micro_tile in (("cuda", (32, 64)), ("cuda:sm_90", (32, 1))):
        path = tune_matmul(k, n, "float16", target, trials=4, work_dir=tmp_path, micro_tile=micro_tile,
                           trials_per_iter=4, population_size=16, density=0.3)
        best = best_record(tmp_path, k, n, "float16", target, micro_tile=micro_tile)
        assert best is not None and 0 < best.run_secs < 1e-2, path
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            op = sparse_matmul(k, n, "float16", micro_tile=micro_tile, target=target, tuning_log=tmp_path)
        _check_tiles_op(op, k, n, micro_tile, rng, f"{path.name} {best.config}")


def _check_tiles_op(op, k, n, micro_tile, rng, what, m=520):
    """``op`` against a float32 reference on micro-tile patterns of the benchmark sparsities, and
    none listed, over a row count no strip divides"""
    b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16)
    for sparsity in (0.0, 0.5, 0.9, 0.99, 1.0):
        a = rng.standard_normal((m, k)).astype(np.float16)
        a[~expand(tile_pattern(m, k, micro_tile, sparsity, rng), micro_tile, (m, k))] = 0
        ref = a.astype(np.float32) @ b.astype(np.float32)
        np.testing.assert_allclose(op(a, b).astype(np.float32), ref, rtol=2e-2,
                                   atol=2e-2 * max(np.abs(ref).max(), 1.0), err_msg=f"{what} sparsity {sparsity}")


# ----------------------------------------------------------------------------- the shipped logs
SHIPPED = sorted(Path(__file__).resolve().parents[2].glob("tuning_logs/*/matmul_k*_n*_*"))
#: the wgmma kernel's logs (sm_90a, the default "cuda" target)
SHIPPED_WGMMA = sorted(Path(__file__).resolve().parents[2].glob("tuning_logs/*/wgmma_matmul_k*_n*_*"))


#: the tiles kinds' logs: wgmma_matmul_128xC_... (sm_90a), matmul_RxC_... (mma.sync)
SHIPPED_TILES = sorted(Path(__file__).resolve().parents[2].glob("tuning_logs/*/*matmul_*x*_k*_n*_*"))


def _tiles_log(log):
    """(kernel, kernel micro-tile, K, N, dtype, target) of a shipped tiles log"""
    import re

    mr, mk, k, n, dtype = re.search(r"matmul_(\d+)x(\d+)_k(\d+)_n(\d+)_(\w+)$", log.name).groups()
    wgmma = log.name.startswith("wgmma_")
    return ("wgmma.tiles" if wgmma else "mma.sync.tiles", (int(mr), int(mk)), int(k), int(n), dtype,
            "cuda" if wgmma else "cuda:sm_90")


@pytest.mark.parametrize("log", SHIPPED_TILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_tiles_logs_give_a_config_that_compiles(log):
    """Every tiles database the repo ships is read without a warning by a build of its target
    and micro-tile, whose tiles kernel is the record's config and compiles to device code."""
    from pit_tvm.nvcc import check_cuda_compiles, find_nvcc
    from pit_tvm.ops.matmul import MatmulPlan, _cuda_wgmma_tiles, tensor_core_kernel
    from pit_tvm.target import build as build_func

    kernel, micro_tile, k, n, dtype, target = _tiles_log(log)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        best = best_record(log.parent.parent, k, n, dtype, target, micro_tile=micro_tile)
        plan = MatmulPlan(k, n, micro_tile)
        built = (_cuda_wgmma_tiles(plan, dtype, dtype, "sm_90a", tuning_log=log.parent.parent).kernel
                 if kernel == "wgmma.tiles" else tensor_core_kernel(plan, dtype, dtype, target, log.parent.parent))
    workload = S.tiles_tuning_workload(k, n, micro_tile, dtype, dtype)
    assert best.log_dir == log and best.config in S.KNOBSETS[kernel].valid(workload, "sm_90")
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    arch = "sm_90a" if kernel == "wgmma.tiles" else "sm_90"
    assert check_cuda_compiles(build_func(tvm.IRModule({"main": built}), target), archs=(arch,)) >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("log", SHIPPED_TILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_gpu_shipped_tiles_logs_numerics(log):
    """The op a shipped tiles log is for, at the benchmark's micro-tiles it serves, against a
    float32 reference"""
    from pit_tvm.ops.matmul import sparse_matmul

    kernel, (mr, mk), k, n, dtype, target = _tiles_log(log)
    rng = np.random.default_rng(0)
    # the wgmma 128-row strips serve the benchmark's 32 x mk and (mk = 64) 1 x 64 micro-tiles
    for micro_tile in [(32, mk)] + [(1, mk)] * (mk == 64) if kernel == "wgmma.tiles" else [(mr, mk)]:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            op = sparse_matmul(k, n, dtype, micro_tile=micro_tile, target=target, tuning_log=str(log.parent.parent))
        _check_tiles_op(op, k, n, micro_tile, rng, f"{log.name} {micro_tile}")


def _shape_of(log):
    import re

    k, n, dtype = re.search(r"matmul_k(\d+)_n(\d+)_(\w+)$", log.name).groups()
    return int(k), int(n), dtype


@pytest.mark.parametrize("log", SHIPPED_WGMMA, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_wgmma_logs_give_a_config_that_compiles(log):
    """Every wgmma database the repo ships is read without a warning by a "cuda" build of its
    shape, whose rows kernel takes the record's config and compiles to sm_90a device code."""
    from pit_tvm.nvcc import check_cuda_compiles, find_nvcc
    from pit_tvm.ops.matmul import MatmulPlan, tensor_core_kernel
    from pit_tvm.schedules.wgmma import ROWS_ATTR
    from pit_tvm.target import build as build_func

    k, n, dtype = _shape_of(log)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        best = best_record(log.parent.parent, k, n, dtype, "cuda")
        kernel = tensor_core_kernel(MatmulPlan(k, n, (1, k)), dtype, dtype, "cuda", str(log.parent.parent))
    assert best.config in S.valid_wgmma_configs(k, n, dtype, dtype)
    assert dict(kernel.attrs[ROWS_ATTR])["block_n"] == best.config.block_n
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(build_func(tvm.IRModule({"main": kernel}), "cuda"), archs=("sm_90a",)) >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("log", SHIPPED_WGMMA, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_gpu_shipped_wgmma_logs_numerics(log):
    """The op a shipped wgmma log is for (a "cuda" sparse_matmul), every benchmark sparsity and
    none listed, a row count no tile divides, against a float32 reference"""
    from pit_tvm.ops.matmul import sparse_matmul

    k, n, dtype = _shape_of(log)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        op = sparse_matmul(k, n, dtype, micro_tile=(1, k), target="cuda", tuning_log=str(log.parent.parent))
    rng = np.random.default_rng(0)
    b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16)
    for sparsity in (0.0, 0.5, 0.9, 0.95, 0.99, 1.0):
        a = rng.standard_normal((520, k)).astype(np.float16)
        a[rng.random(520) < sparsity] = 0
        ref = a.astype(np.float32) @ b.astype(np.float32)
        np.testing.assert_allclose(op(a, b).astype(np.float32), ref, rtol=2e-2,
                                   atol=2e-2 * max(np.abs(ref).max(), 1.0), err_msg=f"sparsity {sparsity}")


@pytest.mark.parametrize("log", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_logs_build_for_sm80_and_sm90(log):
    """Every database the repo ships yields a tuned kernel that compiles to device code."""
    import re

    from pit_tvm.nvcc import check_cuda_compiles, find_nvcc
    from pit_tvm.target import build
    from pit_tvm.tuning.tune import load_best

    k, n, dtype = re.match(r"matmul_k(\d+)_n(\d+)_(\w+)$", log.name).groups()
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no corrupt or foreign record in a shipped log
        func = load_best(str(log), int(k), int(n), dtype, "cuda")
    assert func is not None
    ex = build(func, "cuda")
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(ex, archs=("sm_80", "sm_90")) >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("log", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_gpu_shipped_logs_numerics(log):
    """Every shipped tuned kernel, in the op it is shipped for (a cuda:sm_90 sparse_matmul), at
    every sparsity of the benchmark and none-listed, over a row count no tile divides, against
    a float32 reference"""
    import re

    from pit_tvm.ops.matmul import MatmulPlan, sparse_matmul, tensor_core_kernel

    k, n, dtype = re.match(r"matmul_k(\d+)_n(\d+)_(\w+)$", log.name).groups()
    k, n = int(k), int(n)
    root = str(log.parent.parent)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)     # read, not skipped
        op = sparse_matmul(k, n, dtype, micro_tile=(1, k), target="cuda:sm_90", tuning_log=root)
        tuned = tensor_core_kernel(MatmulPlan(k, n, (1, k)), dtype, dtype, "cuda:sm_90", root)
    assert "pit.tuned" in tuned.attrs
    rng = np.random.default_rng(0)
    m = 520
    b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16)
    for sparsity in (0.0, 0.5, 0.9, 0.95, 0.99, 1.0):
        a = rng.standard_normal((m, k)).astype(np.float16)
        a[rng.random(m) < sparsity] = 0
        ref = a.astype(np.float32) @ b.astype(np.float32)
        got = op(a, b).astype(np.float32)
        np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * max(np.abs(ref).max(), 1.0),
                                   err_msg=f"sparsity {sparsity}")


def test_tune_matmul_tunes_the_kernel_of_its_target(tmp_path, monkeypatch):
    """"cuda" (sm_90a) tunes the wgmma kernel's space into a wgmma_ log, cuda:sm_90 the mma.sync
    schedule's (the search itself is stubbed out: MetaSchedule's loggers cannot be set up again
    in a later test of one process)"""
    import pit_tvm.tuning.tune as tune_mod

    seen = []

    def no_search(**kwargs):
        seen.append((kwargs["work_dir"], kwargs["space"]))

    monkeypatch.setattr(tune_mod.ms, "tune_tir", no_search)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for target in ("cuda", "cuda:sm_90"):
            tune_matmul(K, N, "float16", target, trials=1, work_dir=tmp_path, runner=FakeRunner(), progress=False)
    (wg_dir, wg_space), (mma_dir, mma_space) = seen
    assert Path(wg_dir).name == f"wgmma_matmul_k{K}_n{N}_float16" and Path(mma_dir).name == f"matmul_k{K}_n{N}_float16"
    for space, knobset in ((wg_space, S.WGMMA), (mma_space, S.MMA_SYNC)):
        ctx = ms.TuneContext(mod=_workload(), target=TARGET, space_generator=space, task_name="pit", rand_state=3)
        (sch,) = ctx.generate_design_space()
        S.config_from_trace(sch.trace, _workload(), knobset)       # the samples of that space
