"""Tuning the MoE op's grouped wgmma GEMM (pit_tvm.tuning.moe, ``pit-tvm tune --op moe``).

CPU: the knob space (the configs the kernel takes, the planned one among them, a design space
whose candidate is the TIRx kernel of its knobs), the runner's arguments (a valid expert
index of a balanced / Zipf routing), a hand-written database read back per token regime and
into the op's kernels, a whole ``tune_moe`` with a fake builder and runner (real search and
database), the CLI, and the CPU case (no knobs: an error saying so).  GPU
(``@pytest.mark.gpu``): a few real trials, the op reading the database, against numpy.
"""
from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture

from pit_tvm.schedules.hopper.config import WgmmaConfig
from pit_tvm.schedules.hopper.grouped import GROUPED_ATTR, glu_config, grouped_config
from pit_tvm.tuning import space as S
from pit_tvm.tuning._worker import alloc_moe_arguments, moe_routing_index
from pit_tvm.tuning.moe import best_moe_record, moe_log_dir, tune_moe, tuned_moe_config

SM90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
E, TOP_K, D, F = 8, 2, 256, 192


# ---------------------------------------------------------------------------------------
# the space
# ---------------------------------------------------------------------------------------
def test_grouped_space_is_the_configs_the_kernel_takes():
    """every block_n x stages the kernel takes for (K, N), and nothing else; the planned
    configs (decode and many tokens) are in it; the design space's candidate is the TIRx
    kernel of its sampled knobs"""
    from pit_tvm.schedules.hopper.grouped import check_grouped_config

    for mode, k, n in (("gather", D, F), ("scatter", F, D), ("glu", D, F)):
        glu = mode == "glu"
        valid = S.valid_grouped_configs(mode, k, n, E, TOP_K, "float16", "float16")
        for bn in S.GROUPED_KNOBS["block_n"]:
            for stages in S.GROUPED_KNOBS["stages"]:
                cfg = WgmmaConfig(bn, stages)
                try:
                    check_grouped_config(mode, k, n, E, TOP_K, "float16", "float16", cfg)
                    fits = True
                except ValueError:
                    fits = False
                assert (cfg in valid) == fits
        assert all((2 if glu else 1) * n % c.block_n == 0 for c in valid) and len({c.block_n for c in valid}) >= 2 - glu
        for tokens in (16, 4096):
            workload = S.grouped_tuning_workload(mode, k, n, E, TOP_K, tokens)
            assert S.grouped_workload_params(workload) == (mode, k, n, E, TOP_K, tokens, "float16", "float16")
            planned = S.WGMMA_GROUPED.planned(workload, "sm_90a")
            assert planned == (glu_config if glu else grouped_config)(n, E, TOP_K, tokens) and planned in valid
    # K not a multiple of 64: no config
    assert S.valid_grouped_configs("gather", 100, 192, E, TOP_K, "float16", "float16") == ()

    workload = S.grouped_tuning_workload("scatter", F, D, E, TOP_K, 16)
    ctx = ms.TuneContext(mod=workload, target=SM90A, space_generator=S.space_generator("sm_90a", kernel="wgmma.grouped"),
                         task_name="pit", rand_state=3)
    (space,) = ctx.generate_design_space()
    cfg = S.config_from_trace(space.trace, workload, S.WGMMA_GROUPED)
    kernel = S.prepare_candidate(space.mod)["main"]
    assert dict(kernel.attrs[GROUPED_ATTR]) == {"mode": "scatter", "num_experts": E, "top_k": TOP_K,
                                               "block_n": cfg.block_n, "stages": cfg.stages, "gate": False,
                                               "glu": False}
    # the workload's parameters are the kernel's (the runner allocates them for the kernel)
    assert len(kernel.params) == len(workload.params) == 6
    # glu: x, assignments, offsets, w1, w3, h; its candidate is the glu kernel
    workload = S.grouped_tuning_workload("glu", D, F, E, TOP_K, 4096)
    sch = S.knob_schedule(workload, glu_config(F, E, TOP_K, 4096), "sm_90a")
    kernel = S.prepare_candidate(sch.mod)["main"]
    assert kernel.attrs[GROUPED_ATTR]["glu"] and len(kernel.params) == len(workload.params) == 6


# ---------------------------------------------------------------------------------------
# the runner's arguments
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("routing", ["balanced", "zipf"])
@pytest.mark.parametrize("mode", ["gather", "scatter", "glu"])
def test_runner_arguments_are_a_valid_index(mode, routing):
    """the arguments of the tuning workload: the index is the op's device index of a routing
    of k distinct experts a token (grouped by expert, ascending within one, offsets[E] = P),
    Zipf skewed towards the low experts; every repetition its own routing"""
    tokens = 300
    workload = S.grouped_tuning_workload(mode, F if mode == "scatter" else D, D if mode == "scatter" else F, E,
                                         TOP_K, tokens)
    infos = [info.as_json() for info in ms.arg_info.ArgInfo.from_prim_func(workload)]   # (as the runner passes them)
    args = alloc_moe_arguments(tvm.cpu(), infos, 2, mode=mode, top_k=TOP_K, routing=routing)
    assert len(args) == 2
    P = tokens * TOP_K
    counts = np.zeros(E)
    for rep, rep_args in enumerate(args):
        assert [tuple(a.shape) for a in rep_args] == [tuple(int(s) for s in i[2]) for i in infos]
        assignments, offsets = rep_args[1].numpy(), rep_args[2].numpy()
        ids, want_offsets, want_assignments = moe_routing_index(tokens, E, TOP_K, routing, seed=rep)
        assert all(len(set(row)) == TOP_K for row in ids)                 # k distinct experts a token
        np.testing.assert_array_equal(offsets, want_offsets)
        np.testing.assert_array_equal(assignments, want_assignments)
        assert offsets[0] == 0 and offsets[-1] == P and np.all(np.diff(offsets) >= 0)
        assert sorted(assignments) == list(range(P))                      # every assignment once
        flat = ids.reshape(-1)
        for e in range(E):
            group = assignments[offsets[e]:offsets[e + 1]]
            assert np.all(flat[group] == e) and np.all(np.diff(group) > 0)
        counts += np.diff(offsets)
        if mode == "scatter":
            rw = rep_args[4].numpy()
            assert rw.dtype == np.float32 and np.all((rw > 0) & (rw <= 1))
        if mode == "glu":     # both weights scaled by 1 / sqrt(K), so that the halves' product stays O(1)
            assert all(abs(float(rep_args[i].numpy().astype(np.float32).std()) * np.sqrt(D) - 1) < 0.1 for i in (3, 4))
    assert not np.array_equal(args[0][1].numpy(), args[1][1].numpy())     # a routing a repetition
    if routing == "zipf":
        assert counts[0] > 2 * counts.mean() and counts[0] > 3 * counts[-1]
    else:
        assert counts.max() < 1.5 * counts.mean()


# ---------------------------------------------------------------------------------------
# the database
# ---------------------------------------------------------------------------------------
def _commit(db, workload, cfg, secs, target=SM90A):
    entry = db.commit_workload(tvm.IRModule({"main": workload}))
    sch = S.knob_schedule(workload, cfg, "sm_90a")
    db.commit_tuning_record(ms.database.TuningRecord(sch.trace, entry, run_secs=[float(secs)] * 3, target=target,
                                                     args_info=ms.arg_info.ArgInfo.from_prim_func(workload)))


def _write_log(root, mode, k, n, entries):
    path = moe_log_dir(mode, k, n, E, TOP_K, "float16", root, gpu="test-gpu")
    path.mkdir(parents=True, exist_ok=True)
    db = ms.database.JSONDatabase(work_dir=str(path))
    for tokens, cfg, secs, *target in entries:
        _commit(db, S.grouped_tuning_workload(mode, k, n, E, TOP_K, tokens), cfg, secs, *target)
    return path


def test_database_round_trip_by_token_regime_and_the_op_reads_it(tmp_path):
    """a log of several token counts: a build reads the records of the tuned T nearest its
    token count within its regime (decode T <= 256, or many tokens; a symbolic T the largest),
    the fastest there; the op's kernels take those tiles; a log without the regime says so
    and the planned tiles are taken"""
    from pit_tvm.ops.moe import MoESpec, grouped_tile_config, moe_ffn

    _write_log(tmp_path, "gather", D, F, [
        (16, WgmmaConfig(64, 8), 2e-5), (16, WgmmaConfig(64, 5), 1e-5),           # decode: 64x5 fastest
        (128, WgmmaConfig(192, 3), 1e-6),                                         # decode, another T
        (4096, WgmmaConfig(192, 4), 3e-4), (4096, WgmmaConfig(64, 6), 2e-4),      # many: 64x6 fastest
        (4096, WgmmaConfig(64, 3), 1e-9, tvm.target.Target({"kind": "cuda", "arch": "sm_80"})),  # another arch
    ])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert best_moe_record(tmp_path, "gather", D, F, E, TOP_K, tokens=8).config == WgmmaConfig(64, 5)
        assert best_moe_record(tmp_path, "gather", D, F, E, TOP_K, tokens=16).tokens == 16
        assert best_moe_record(tmp_path, "gather", D, F, E, TOP_K, tokens=100).config == WgmmaConfig(192, 3)
        assert best_moe_record(tmp_path, "gather", D, F, E, TOP_K, tokens=None).config == WgmmaConfig(64, 6)
        assert best_moe_record(tmp_path, "gather", D, F, E, TOP_K, tokens=300).tokens == 4096
    assert all("another workload or target" in str(w.message) for w in caught)   # the sm_80 record
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert grouped_tile_config("gather", D, F, E, TOP_K, "float16", "cuda", 16, tmp_path) == WgmmaConfig(64, 5)
        op = moe_ffn(MoESpec(E, TOP_K), D, F, "float16", target="cuda", tuning_log=tmp_path)
        assert op.tiles(16)[0] == WgmmaConfig(64, 5) and op.tiles(None)[0] == WgmmaConfig(64, 6)
        names = [gv.name_hint for gv in op.module(tokens=16).get_global_vars()]
    assert any(n.startswith("wgmma_grouped_gather") and n.endswith("_bn64s5") for n in names)
    # fc2 has no log: said, and the planned tiles
    with pytest.warns(UserWarning) as said:
        assert tuned_moe_config(tmp_path, "scatter", F, D, E, TOP_K, "float16", "cuda", None) is None
    assert any("no tuning log for wgmma_moe_scatter" in str(w.message) for w in said)
    assert op.tiles(None)[1] == grouped_config(D, E, TOP_K, None)
    # only decode records: a many-token build takes the planned tiles, saying so
    _write_log(tmp_path / "decode_only", "scatter", F, D, [(16, WgmmaConfig(64, 4), 1e-5)])
    with pytest.warns(UserWarning, match="no valid tuned many-token config .*planned tiles"):
        assert tuned_moe_config(tmp_path / "decode_only", "scatter", F, D, E, TOP_K, "float16", "cuda", 4096) is None
    # a gated layer's glu kernel reads its own records (mode "glu"), at decode size and for many tokens
    _write_log(tmp_path, "glu", D, F, [(16, WgmmaConfig(128, 6), 1e-5), (4096, WgmmaConfig(128, 3), 1e-4)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gated = moe_ffn(MoESpec(E, TOP_K, activation="swiglu"), D, F, "float16", target="cuda", tuning_log=tmp_path)
        assert gated.tiles(16)[0] == WgmmaConfig(128, 6)
        # many tokens: the tuned glu tile stores 64 columns of H, as many as the tuned plain one: taken
        assert gated.tiles(None)[0] == WgmmaConfig(128, 3)
        assert any(gv.name_hint.endswith("_glu_bn128s6") for gv in gated.module((False, False, True, False),
                                                                                   tokens=16).get_global_vars())
    # off sm_90a the generic kernel has no tiles: the log is not read
    assert grouped_tile_config("gather", D, F, E, TOP_K, "float16", "cuda:sm_90", 16, tmp_path) is None
    assert grouped_tile_config("gather", D, F, E, TOP_K, "float32", "llvm", 16, tmp_path) is None


# ---------------------------------------------------------------------------------------
# tune_moe end to end (fake builder and runner), the CLI, the CPU case
# ---------------------------------------------------------------------------------------
@derived_object
class FakeRunner(ms.runner.PyRunner):
    """Deterministic fake latencies (no GPU here)"""

    def __init__(self, seed=0):
        super().__init__()
        self.rng = random.Random(seed)

    def run(self, runner_inputs):
        return [LocalRunnerFuture(res=[self.rng.uniform(1e-5, 1e-4)]) for _ in runner_inputs]


@derived_object
class FakeBuilder(ms.builder.PyBuilder):
    """Records what it is given to build (the prepared candidates) instead of running nvcc"""

    def __init__(self, work_dir):
        super().__init__()
        self.kernels = []
        self.work_dir = work_dir

    def build(self, build_inputs):
        out = []
        for b in build_inputs:
            self.kernels.append(b.mod["main"])
            artifact = self.work_dir / f"candidate{len(self.kernels)}" / "fake.so"   # (removed after its run)
            artifact.parent.mkdir(parents=True)
            artifact.write_bytes(b"")
            out.append(ms.builder.BuilderResult(str(artifact), None))
        return out


def test_tune_moe_with_fake_builder_and_runner(tmp_path):
    """the search over the grouped knobs writes a database of the planned config and the
    sampled ones, every candidate built as the grouped TIRx kernel of its knobs; its fastest
    record is what the op reads"""
    builder = FakeBuilder(tmp_path / "artifacts")
    path = tune_moe("gather", D, F, E, TOP_K, "float16", tokens=64, target="cuda", trials=6, work_dir=tmp_path,
                    trials_per_iter=6, population_size=16, builder=builder, runner=FakeRunner(), progress=False)
    assert path == moe_log_dir("gather", D, F, E, TOP_K, "float16", tmp_path)
    recs = ms.database.JSONDatabase(work_dir=str(path)).get_all_tuning_records()
    assert 4 <= len(recs) <= 7                      # the plan, then up to 6 trials (fewer: the space is small)
    cfgs = [S.config_from_trace(r.trace, r.workload.mod, S.WGMMA_GROUPED) for r in recs]
    assert grouped_config(F, E, TOP_K, 64) in cfgs                 # the planned config, measured first
    assert builder.kernels and all(GROUPED_ATTR in k.attrs for k in builder.kernels)
    assert {(int(k.attrs[GROUPED_ATTR]["block_n"]), int(k.attrs[GROUPED_ATTR]["stages"])) for k in builder.kernels} \
        == {(c.block_n, c.stages) for c in cfgs}
    fastest = min(zip(recs, cfgs), key=lambda rc: np.mean([float(x) for x in rc[0].run_secs]))[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuned_moe_config(tmp_path, "gather", D, F, E, TOP_K, "float16", "cuda", 64) == fastest


def test_cli_tune_moe(tmp_path, monkeypatch, capsys):
    """``--op moe`` tunes fc1 (K=d, N=f) and fc2 (K=f, N=d) with the layer's options and
    prints each best config (``--mode glu``: a gated fc1's both halves, K=d, N=f); missing or
    foreign options, and the CPU, are errors naming them"""
    import pit_tvm.tuning.moe as tune_moe_mod
    from pit_tvm.cli.main import main

    logs = {mode: _write_log(tmp_path, mode, k, n, [(32, WgmmaConfig(128 if mode == "glu" else 64, 7), 1e-5)])
            for mode, k, n in (("gather", D, F), ("scatter", F, D), ("glu", D, F))}
    calls = []

    def fake_tune(mode, k, n, experts, top_k, dtype, tokens, **kw):
        calls.append((mode, k, n, experts, top_k, dtype, tokens, kw["routing"], kw["trials"]))
        return logs[mode]

    monkeypatch.setattr(tune_moe_mod, "tune_moe", fake_tune)
    rc = main(["tune", "--op", "moe", "--d", str(D), "--f", str(F), "--experts", str(E), "--top-k", str(TOP_K),
               "--tokens", "32", "--routing", "zipf", "--trials", "5", "--work-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert calls == [("gather", D, F, E, TOP_K, "float16", 32, "zipf", 5), ("scatter", F, D, E, TOP_K, "float16", 32, "zipf", 5)]
    assert out.count("ring of 7") == 2 and "at T=32" in out and str(logs["scatter"]) in out
    calls.clear()
    assert main(["tune", "--op", "moe", "--d", str(D), "--f", str(F), "--experts", str(E), "--top-k", str(TOP_K),
                 "--tokens", "32", "--mode", "glu", "--work-dir", str(tmp_path), "--no-progress"]) == 0
    assert calls == [("glu", D, F, E, TOP_K, "float16", 32, "balanced", 24)] and str(logs["glu"]) in capsys.readouterr().out
    for argv, why in ((["--d", str(D), "--experts", "8"], "needs --f"),
                      (["--d", str(D), "--f", str(F), "--experts", "8", "--k", "64"], "--k is an option of --op matmul"),
                      (["--d", str(D), "--f", str(F), "--experts", "8", "--target", "llvm"], "no knobs on the CPU")):
        assert main(["tune", "--op", "moe"] + argv) == 2
        assert why in capsys.readouterr().err
    assert main(["tune", "--op", "matmul", "--k", "64"]) == 2 and "needs --k K and --n N" in capsys.readouterr().err


def test_tune_moe_refuses_targets_without_knobs(tmp_path):
    """the CPU and pre-Hopper CUDA run the generic kernel (fixed tiles): an error saying so,
    before any log directory"""
    for target in ("llvm", "cuda:sm_90"):
        with pytest.raises(ValueError, match="generic TIR kernel, whose tiles are fixed"):
            tune_moe("gather", D, F, E, TOP_K, tokens=64, target=target, work_dir=tmp_path, runner=FakeRunner())
    with pytest.raises(ValueError, match="K must be a multiple of 64"):
        tune_moe("gather", 100, F, E, TOP_K, tokens=64, work_dir=tmp_path, runner=FakeRunner())
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_tune_moe_and_the_op_uses_the_log(tmp_path):
    """a few real trials of both modes at a decode-size T (Zipf routing), then the op built
    with the log runs the tuned tiles and matches numpy"""
    from pit_tvm.ops.moe import MoESpec, moe_ffn, reference_moe

    d, f, tokens = 256, 512, 32
    paths = {mode: tune_moe(mode, k, n, E, TOP_K, "float16", tokens=tokens, trials=6, work_dir=tmp_path,
                            routing="zipf", trials_per_iter=6, progress=False)
             for mode, k, n in (("gather", d, f), ("scatter", f, d))}
    tuned = tuple(best_moe_record(paths[mode], mode, k, n, E, TOP_K, "float16", "cuda", tokens).config
                  for mode, k, n in (("gather", d, f), ("scatter", f, d)))
    spec = MoESpec(E, TOP_K, activation="gelu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op = moe_ffn(spec, d, f, "float16", target="cuda", tuning_log=tmp_path)
        assert op.tiles(tokens) == tuned
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, d)).astype(np.float16)
    router = rng.standard_normal((tokens, E)).astype(np.float16)
    w1 = (rng.standard_normal((E, d, f)) / np.sqrt(d)).astype(np.float16)
    w2 = (rng.standard_normal((E, f, d)) / np.sqrt(f)).astype(np.float16)
    y = op(x, router, w1, w2)
    ref = reference_moe(x.astype(np.float32), router.astype(np.float32), w1.astype(np.float32),
                        w2.astype(np.float32), spec)
    np.testing.assert_allclose(y.astype(np.float32), ref, rtol=3e-2, atol=3e-2)
