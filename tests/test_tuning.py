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
import warnings
from pathlib import Path

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import s_tir
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture

from _helpers import rows_index
from pit_tvm.nvcc import check_cuda_compiles, find_nvcc
from pit_tvm.schedules.tensorcore import TensorCoreConfig, build
from pit_tvm.tuning import space as S
from pit_tvm.tuning.tune import best_record, load_best, log_dir, tune_matmul

K, N = 512, 256
TARGET = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


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
    ctx = ms.TuneContext(mod=func, target=sm90a, space_generator=S.space_generator("sm_90a", wgmma=True),
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
        S.pit_tc_space(sch)
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
    S.pit_tc_space(space)
    knob_trace = space.trace.simplified(remove_postproc=True)
    assert len(S._knob_insts(knob_trace)) == len(S.KNOBS)   # samples survive simplification
    post = S.ApplyPitTensorCore("sm_90")
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
    root = tmp_path_factory.mktemp("tuning_logs")
    path = tune_matmul(K, N, "float16", "cuda:sm_90", trials=8, work_dir=root, runner=FakeRunner(),
                       trials_per_iter=8, population_size=32, progress=False)
    return root, path


def test_tune_matmul_with_fake_runner(tuned_log):
    root, path = tuned_log
    assert path.parent.parent == root and path.name == f"matmul_k{K}_n{N}_float16"
    lines = (path / "database_tuning_record.json").read_text().splitlines()
    assert len(lines) == 8
    db = ms.database.JSONDatabase(work_dir=str(path))
    recs = db.get_all_tuning_records()
    cfgs = {S.config_from_trace(r.trace, r.workload.mod) for r in recs}
    assert len(cfgs) == 8                                      # 8 distinct kernels measured
    fastest = min(recs, key=lambda r: float(np.mean([float(x) for x in r.run_secs])))
    func = load_best(path, K, N, "float16", "cuda")
    assert _tuned_config(func) == S.config_from_trace(fastest.trace, fastest.workload.mod)


def test_sparse_matmul_tuning_log_hook(tuned_log):
    from pit_tvm.ops.matmul import sparse_matmul

    root, path = tuned_log
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
    ("llvm", (1, K), "the target is llvm"),
    ("cuda:sm_90", (32, 64), "untuned tiles kernel"),
    ("cuda", (32, 64), "untuned tiles kernel"),
])
def test_tuning_log_not_used_is_said(tuned_log, target, micro_tile, why):
    """a build that cannot use a tuning log says so (and builds), never drops it silently"""
    from pit_tvm.ops.matmul import sparse_matmul

    root, _ = tuned_log
    with pytest.warns(UserWarning, match=f"tuning log .* not used: .*{why}"):
        sparse_matmul(K, N, "float16", micro_tile=micro_tile, target=target, tuning_log=root)


def test_wgmma_log_drives_sm90a_builds(tmp_path):
    """a log of the wgmma space (sm_90a) gives a "cuda" build's rows kernel, and its tiers, the
    fastest record's config in place of the planned one"""
    from pit_tvm.nvcc import cuda_sources
    from pit_tvm.ops.matmul import MatmulPlan, sparse_matmul, tensor_core_kernel
    from pit_tvm.schedules.wgmma import ROWS_ATTR, WgmmaConfig
    from pit_tvm.tuning.tune import tuned_wgmma_config

    sm90a = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    _write_db(log_dir(K, N, "float16", tmp_path, gpu="test-gpu", kernel="wgmma"),
              [(_workload(), WgmmaConfig(256, 4), 3e-4, sm90a), (_workload(), WgmmaConfig(64, 5), 1e-4, sm90a)])
    plan = MatmulPlan(K, N, (1, K))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuned_wgmma_config(tmp_path, K, N, "float16") == WgmmaConfig(64, 5)
        kernel = tensor_core_kernel(plan, "float16", "float16", "cuda", tmp_path)
        op = sparse_matmul(K, N, "float16", micro_tile=(1, K), target="cuda", tuning_log=tmp_path)
    assert dict(kernel.attrs[ROWS_ATTR]) == {"block_n": 64, "stages": 5, "block_k": 64}
    assert dict(tensor_core_kernel(plan, "float16", "float16", "cuda").attrs[ROWS_ATTR])["block_n"] == 256
    assert "wgmma.mma_async.sync.aligned.m64n64k16" in "\n".join(cuda_sources(op.executable))
    # the mma.sync reader does not take the wgmma log
    with pytest.warns(UserWarning, match="no tuning log for matmul_k"):
        assert load_best(tmp_path, K, N, "float16", "cuda:sm_90") is None


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

    root, path = tuned_log
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


# ----------------------------------------------------------------------------- the shipped logs
SHIPPED = sorted(Path(__file__).resolve().parent.parent.glob("tuning_logs/*/matmul_k*_n*_*"))
#: the wgmma kernel's logs (sm_90a, the default "cuda" target)
SHIPPED_WGMMA = sorted(Path(__file__).resolve().parent.parent.glob("tuning_logs/*/wgmma_matmul_k*_n*_*"))


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
