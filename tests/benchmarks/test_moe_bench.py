"""CPU checks of benchmarks/moe.py (it runs on a GPU with torch): the case grid, the roofline
arithmetic and the results page from synthetic rows (torch is not needed for these)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the repo's benchmarks/
import moe as B  # noqa: E402


def test_case_grids():
    default = B.cases()
    assert {c["dtype"] for c in default} == {"bfloat16"}
    assert {(c["layer"], c["E"], c["T"]) for c in default} >= {("switch", 64, 4096), ("mixtral", 8, 16),
                                                               ("finegrained", 64, 4096)}
    assert any(c["skew"] for c in default)
    full = B.cases(full=True, dtypes=("bfloat16", "float16"))
    # switch 4 E x 3 T, mixtral 3 T, fine-grained 2 T; each balanced and skewed; two dtypes
    assert len(full) == (12 + 3 + 2) * 2 * 2
    assert all(c["d"] % 64 == 0 and c["f"] % 64 == 0 for c in full)      # the Hopper kernel's tiles


def test_roofline_arithmetic():
    case = dict(B.LAYERS["mixtral"], T=16, E=8, dtype="bfloat16")
    flops = B.layer_flops(case)
    assert flops == 2 * 16 * 2 * 4096 * 14336 * 3
    weights, total = B.floor_bytes(case, active_experts=5)
    assert weights == 5 * 4096 * 14336 * 3 * 2 and total == weights + 2 * 16 * 4096 * 2
    roof, floor = B.roofline_ms(case, 5, tflops=800.0, gbps=3000.0)
    assert floor == pytest.approx(weights / 3e9)
    assert roof == pytest.approx(max(flops / 800e9, total / 3e9))      # decode: the bytes bound


def test_results_page_checks_the_targets():
    env = {"device": "GPU X", "date": "2026-11-28", "torch": "2.9", "tvm": "0.27", "cublas_tflops": 700.0,
           "copy_gbps": 3000.0, "command": "python benchmarks/moe.py"}
    base = dict(layer="switch", E=64, T=4096, d=768, f=3072, top_k=1, activation="relu", dtype="bfloat16")

    def rows(name, pit_ms, peer_ms, index_ms=0.01):
        case = dict(base, case=name, weight_floor_ms=0.1)
        return [dict(case, method="pit", median_ms=pit_ms, vs_grouped_mm=peer_ms / pit_ms, vs_roofline=pit_ms / 0.2,
                     pit_index_ms=index_ms, pit_device_ms=pit_ms * 0.9, max_row_rel_err=1e-3, correct=True),
                dict(case, method="torch_grouped_mm", median_ms=peer_ms),
                dict(case, method="roofline", median_ms=0.2)]

    page = B.render_page(env, rows("switch E64 T4096", 0.25, 0.6) + rows("switch E64 T4096 zipf", 0.5, 0.7))
    assert "| switch E64 T4096 | bfloat16 | 0.250 |" in page
    assert ">= 2x grouped_mm: met" in page and "<= 1.5x roofline: met" in page
    assert "skewed within 1.3x of balanced (2.00x): **not met**" in page


def test_tuning_log_reaches_the_op(tmp_path):
    """``--tuning-log``: the op the benchmark builds reads that log (its tiles; the log itself is
    read at the op's build, tests/ops/test_moe.py)"""
    cfg = B.parse_args(["--only", "switch", "--tuning-log", str(tmp_path)])
    assert cfg.tuning_log == str(tmp_path)
    assert B._pit_op("switch", 8, "bfloat16", cfg.tuning_log).tuning_log == str(tmp_path)
    assert B._pit_op("switch", 8, "bfloat16").tuning_log is None
