"""``pit-tvm demo``: correct against numpy, and its table times numpy beside the dense build and PIT
(the speedup columns are the ratios of the times printed)."""
from __future__ import annotations

import re

from pit_tvm.cli.main import main as cli_main


def ratio_printed(ratio, num, den) -> bool:
    """``ratio`` (printed to 2 decimals) is ``num / den`` of two times printed to 3 decimals"""
    lo, hi = (num - 5e-4) / (den + 5e-4), (num + 5e-4) / max(den - 5e-4, 1e-9)
    return lo - 5e-3 <= ratio <= hi + 5e-3


def test_demo_prints_numpy_dense_and_pit_times(capsys):
    code = cli_main(["demo", "--tokens", "64", "--d-model", "64", "--hidden", "256", "--repeat", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "correct vs numpy: yes" in out
    header = next(line for line in out.splitlines() if "dense (ms)" in line)
    assert header.split() == ["numpy", "(ms)", "dense", "(ms)", "PIT", "(ms)", "vs", "dense", "vs", "numpy"]
    rows = {}
    for label in ("second matmul (sparse A)", "whole MLP (first dense)"):
        line = next(line for line in out.splitlines() if line.startswith(label))
        numbers = [float(v) for v in re.findall(r"\d+\.\d+", line[len(label):])]
        assert len(numbers) == 5, line
        t_numpy, t_dense, t_pit, vs_dense, vs_numpy = numbers
        assert min(t_numpy, t_dense, t_pit) > 0
        assert ratio_printed(vs_dense, t_dense, t_pit) and ratio_printed(vs_numpy, t_numpy, t_pit), line
        rows[label] = numbers
    # the whole MLP is the second matmul plus the (dense) first one, on every side
    assert all(w >= s for w, s in zip(rows["whole MLP (first dense)"][:3], rows["second matmul (sparse A)"][:3]))
