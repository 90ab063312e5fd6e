"""CPU smoke test of benchmarks/models.py at tiny sizes: JSON structure and correctness fields."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the repo's benchmarks/
import models as M  # noqa: E402

TINY = ["--device", "cpu", "--ffn-d", "64", "--ffn-hidden", "256", "--ffn-batch", "2", "--ffn-seq", "16",
        "--layers", "2", "--hidden", "64", "--heads", "4", "--batch", "2", "--seq", "16", "--min-len", "4",
        "--repeat", "2", "--ffn-tiles", "8x1"]
FIELDS = {"workload", "method", "dtype", "device", "shape", "median_ms", "speedup_vs_pit_off",
          "occupancy_mean", "occupancy", "max_abs_err", "max_rel_err", "correct", "error"}


def test_tile_occupancy():
    a = np.zeros((4, 8), "float32")
    a[0, 0] = 1.0  # one (2, 4) tile of four non-zero
    assert M.tile_occupancy(a, (2, 4)) == 0.25
    assert M.tile_occupancy(a, (1, 64)) == 0.25  # tile wider than K: whole rows
    assert M.tile_occupancy(a.reshape(2, 2, 8), (1, 1)) == 1 / 32
    assert M.tile_occupancy(np.ones((3, 5)), (2, 2)) == 1.0  # ragged edges padded


def test_models_benchmark_cpu_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    env, rows = M.main(TINY)
    data = json.loads((tmp_path / "models_cpu.json").read_text())
    assert (tmp_path / "models_cpu.png").exists()
    assert data["environment"]["config"]["layers"] == 2 and data["environment"]["device"].startswith("CPU")
    got = {(r["workload"], r["method"]): r for r in data["rows"]}
    assert set(got) == {("opt_ffn", m) for m in ("tvm_pit", "tvm_pit_8x1", "tvm_pit_off", "onnxruntime")} | {
        ("bert", m) for m in ("tvm_pit", "tvm_pit_off", "onnxruntime")}
    for key, r in got.items():
        assert FIELDS <= set(r), key
        assert r["error"] is None, (key, r["error"])
        assert r["dtype"] == "float32" and r["device"] == "cpu"
        assert r["median_ms"] > 0 and r["speedup_vs_pit_off"] > 0
        assert r["correct"] is True and r["max_rel_err"] <= 1e-3 and r["max_abs_err"] >= 0, key
    assert got[("opt_ffn", "tvm_pit_off")]["speedup_vs_pit_off"] == 1.0
    assert M.wrong_outputs(rows) == []
    assert M.wrong_outputs([dict(rows[0], correct=False)]) == [f"{rows[0]['workload']}/{rows[0]['method']}"]
    # per layer: Q/K/V (one combined matmul), attention output, FFN in, FFN out
    assert got[("bert", "tvm_pit")]["pit_matmuls"] == 8 and got[("bert", "tvm_pit_off")]["pit_matmuls"] == 0
    assert got[("opt_ffn", "tvm_pit_8x1")]["micro_tiles"] == ["8x1"]
    # padding: every masked matmul's operand has exactly the real-token rows non-zero
    wl = next(w for w in M.make_workloads(M.parse_args(TINY), ("bert",)))
    real = float(wl["inputs"]["attention_mask"].mean())
    occ = got[("bert", "tvm_pit")]["occupancy"]
    assert len(occ) == 8 and all(abs(v - real) < 1e-9 for v in occ.values())
    assert got[("bert", "onnxruntime")]["occupancy"] == occ  # shown beside every row
    ffn_occ = got[("opt_ffn", "tvm_pit_8x1")]["occupancy"]["hidden"]
    assert 0.0 < ffn_occ < got[("opt_ffn", "tvm_pit")]["occupancy"]["hidden"] <= 1.0


def test_torch_peers_match_onnxruntime_on_cpu():
    torch = pytest.importorskip("torch")
    cfg = M.parse_args(TINY + ["--batch", "3"])
    for wl in M.make_workloads(cfg):
        ref = M.ort_session(wl["model"]).run(None, wl["inputs"])[0]
        x = torch.from_numpy(wl["inputs"][next(iter(wl["inputs"]))])
        if wl["name"] == "opt_ffn":
            outs = [M.torch_ffn(wl["model"], torch.float32, "cpu")(x)]
        else:
            mask = torch.from_numpy(wl["inputs"]["attention_mask"])
            padded = M.torch_bert_padded(wl["model"], cfg.layers, cfg.heads, torch.float32, "cpu")
            varlen, _ = M.torch_bert_varlen(wl["model"], cfg.layers, cfg.heads, torch.float32, "cpu")
            outs = [padded(x, mask), varlen(x, mask)]
        for out in outs:
            assert M.errors(out.numpy(), ref, wl["valid"])["max_rel_err"] < 1e-5
