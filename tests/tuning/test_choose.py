"""choose_micro_tile: coverage by hand on small masks, latency tables, dense fallback, ties, errors."""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import pit_tvm
from pit_tvm.tuning.choose import (LatencyModel, TileChoice, choose_micro_tile, coverage, interpolate,
                                   latency_model_from_results, tile_mask)

# 4x8 mask, 11 non-zeros:
#   row 0: 1 1 0 0 | 0 0 0 0
#   row 1: 0 0 0 0 | 0 0 0 1
#   row 2: 0 0 0 0 | 0 0 0 0
#   row 3: 1 1 1 1 | 1 1 1 1
MASK = np.zeros((4, 8), bool)
MASK[0, :2] = True
MASK[1, 7] = True
MASK[3, :] = True


@pytest.mark.parametrize("tile,nonzero_tiles,total_tiles", [
    ((1, 1), 11, 32),      # the element density
    ((1, 8), 3, 4),        # rows 0, 1, 3
    ((4, 1), 8, 8),        # every column has a non-zero
    ((2, 4), 4, 4),        # rows 0-1: cols 0-3 (row 0), 4-7 ([1, 7]); rows 2-3: both halves (row 3)
    ((4, 8), 1, 1),
    ((2, 2), 6, 8),        # rows 0-1: cols 0-1 and 6-7; rows 2-3: all four
])
def test_coverage_by_hand(tile, nonzero_tiles, total_tiles):
    assert MASK.sum() == 11  # 2 + 1 + 8
    assert tile_mask(MASK, tile).sum() == nonzero_tiles
    assert tile_mask(MASK, tile).size == total_tiles
    assert coverage(MASK, tile) == pytest.approx(nonzero_tiles / total_tiles)


def test_coverage_accepts_values_and_clips_edge_tiles():
    vals = MASK * np.arange(1, 33, dtype=np.float32).reshape(4, 8)
    assert coverage(vals, (1, 8)) == coverage(MASK, (1, 8)) == 0.75
    # 3 rows, 2-row tiles: rows 0-1 non-zero -> one full tile (area 2 of 3), not 1 of 2 tiles
    m = np.array([[1], [1], [0]], bool)
    assert coverage(m, (2, 1)) == pytest.approx(2 / 3)
    m = np.array([[0], [0], [1]], bool)
    assert coverage(m, (2, 1)) == pytest.approx(1 / 3)
    # 1x8 mask, 3-wide tiles: the last tile column is 2 wide
    m = np.zeros((1, 8), bool)
    m[0, 7] = True
    assert coverage(m, (1, 3)) == pytest.approx(2 / 8)


def table(times_at_full, floor=0.0):
    """Linear-in-density latency tables: t(d) = floor + d * time_at_full."""
    return {t: {0.0: floor, 1.0: floor + v} for t, v in times_at_full.items()}


def test_choice_and_fields():
    c = choose_micro_tile(MASK, [(1, 8), (4, 1), (2, 2)], table({(1, 8): 4.0, (4, 1): 1.0, (2, 2): 2.0}),
                          dense_time=3.0)
    assert isinstance(c, TileChoice)
    assert c.coverage == {(1, 8): 0.75, (4, 1): 1.0, (2, 2): 0.75}
    assert c.predicted == pytest.approx({(1, 8): 3.0, (4, 1): 1.0, (2, 2): 1.5})
    assert c.choice == (4, 1) and not c.is_dense
    assert c.predicted_time == 1.0 and c.speedup() == pytest.approx(3.0)
    assert c.density == pytest.approx(11 / 32)


def test_dense_fallback():
    c = choose_micro_tile(MASK, [(1, 8), (2, 2)], table({(1, 8): 4.0, (2, 2): 4.0}), dense_time=2.9)
    assert c.choice == "dense" and c.is_dense
    assert c.predicted_time == 2.9 and c.speedup() == 1.0
    # an all-ones sample: every tile covers everything; a sparse kernel with overhead loses
    full = np.ones((64, 64), bool)
    c = choose_micro_tile(full, ["32x1", "1x64"], table({(32, 1): 1.0, (1, 64): 1.0}, floor=0.1), dense_time=1.0)
    assert c.choice == "dense"
    assert set(c.coverage.values()) == {1.0}


def test_ties():
    lat = table({(1, 8): 4.0, (2, 2): 4.0})           # both cover 0.75 of MASK -> 3.0 s each
    assert choose_micro_tile(MASK, [(1, 8), (2, 2)], lat, dense_time=10).choice == (1, 8)
    assert choose_micro_tile(MASK, [(2, 2), (1, 8)], lat, dense_time=10).choice == (2, 2)
    # equal to the dense time is not a win
    assert choose_micro_tile(MASK, [(1, 8)], lat, dense_time=3.0).choice == "dense"


def test_callable_latency_and_strings():
    seen = []

    def lat(tile, d):
        seen.append((tile, d))
        return d * tile[0]

    c = choose_micro_tile(MASK, ["1x8", (4, 1)], lat, dense_time=1.0)
    assert seen == [((1, 8), 0.75), ((4, 1), 1.0)]
    assert c.choice == (1, 8)


def test_interpolation_rules():
    pts = {1.0: 10.0, 0.5: 5.0, 0.1: 2.0}
    assert interpolate(pts, 0.3) == pytest.approx(3.5)
    assert interpolate(pts, 0.05) == 2.0              # floor below the table
    assert interpolate(pts, 1.0) == 10.0
    assert interpolate({0.5: 5.0, 0.9: 9.0}, 1.0) == pytest.approx(10.0)   # last segment extended
    assert interpolate({0.5: 5.0}, 0.7) == 5.0
    # PIT's step rule: the entry at the smallest density >= d
    assert interpolate(pts, 0.3, step=True) == 5.0
    assert interpolate(pts, 0.5, step=True) == 5.0
    assert interpolate(pts, 0.05, step=True) == 2.0
    c = choose_micro_tile(MASK, [(1, 8)], {(1, 8): pts}, dense_time=100, step=True)
    assert c.predicted[(1, 8)] == 10.0                 # 0.75 -> the 1.0 entry


def test_errors():
    lat = table({(1, 8): 1.0})
    with pytest.raises(ValueError, match="empty"):
        choose_micro_tile(MASK, [], lat, dense_time=1)
    with pytest.raises(ValueError, match="larger than the sample"):
        choose_micro_tile(MASK, [(8, 1)], lat, dense_time=1)
    with pytest.raises(ValueError, match="larger than the sample"):
        coverage(MASK, (1, 9))
    with pytest.raises(ValueError, match="2-D"):
        choose_micro_tile(np.ones((2, 2, 2)), [(1, 1)], lat, dense_time=1)
    with pytest.raises(ValueError, match="2-D"):
        choose_micro_tile(np.ones(8), [(1, 1)], lat, dense_time=1)
    with pytest.raises(ValueError, match="empty"):
        choose_micro_tile(np.ones((0, 4)), [(1, 1)], lat, dense_time=1)
    with pytest.raises(ValueError, match="positive"):
        choose_micro_tile(MASK, [(0, 4)], lat, dense_time=1)
    with pytest.raises(ValueError, match="pair"):
        choose_micro_tile(MASK, [(1, 2, 3)], lat, dense_time=1)
    with pytest.raises(ValueError, match="repeat"):
        choose_micro_tile(MASK, [(1, 8), "1x8"], lat, dense_time=1)
    with pytest.raises(ValueError, match="dense_time"):
        choose_micro_tile(MASK, [(1, 8)], lat)
    with pytest.raises(ValueError, match="dense_time"):
        choose_micro_tile(MASK, [(1, 8)], lat, dense_time=0)
    with pytest.raises(KeyError, match="2x2"):
        choose_micro_tile(MASK, [(2, 2)], lat, dense_time=1)
    with pytest.raises(ValueError, match="gave"):
        choose_micro_tile(MASK, [(1, 8)], lambda t, d: float("nan"), dense_time=1)
    with pytest.raises(TypeError, match="latency"):
        choose_micro_tile(MASK, [(1, 8)], 3.0, dense_time=1)


def test_default_model_from_results_layouts(tmp_path):
    wide = {"environment": {"shape": "M=K=N=64 float16"},
            "rows": [{"kind": "row 1xK", "sparsity": s, "pit_total_ms": 1 - s + 0.1, "cublas_ms": 0.5}
                     for s in (0.0, 0.5, 0.9)]
            + [{"kind": "block 32x64", "sparsity": s, "pit_total_ms": 2 * (1 - s), "cublas_ms": 0.7}
               for s in (0.0, 0.9)]}
    m = latency_model_from_results(wide)
    assert set(m.table) == {(1, 64), (32, 64)}
    assert m.dense_time == pytest.approx(0.5e-3)
    assert m((1, 64), 0.5) == pytest.approx(0.6e-3)
    long = {"rows": [{"size": 64, "micro_tile": "32x1", "sparsity": 0.9, "density": 0.1, "method": "pit_total",
                      "ms": 0.2},
                     {"size": 64, "micro_tile": "32x1", "sparsity": 0.0, "density": 1.0, "method": "pit_total",
                      "ms": 1.0},
                     {"size": 64, "micro_tile": "32x1", "sparsity": 0.0, "density": 1.0, "method": "cublas",
                      "ms": 0.4},
                     {"size": 64, "micro_tile": "32x1", "sparsity": 0.9, "density": 0.1, "method": "pit_total",
                      "ms": None, "error": "error: boom"},
                     {"size": 128, "micro_tile": "32x1", "sparsity": 0.0, "density": 1.0, "method": "cublas",
                      "ms": 9.0}]}
    p = tmp_path / "r.json"
    p.write_text(json.dumps(long))
    m = latency_model_from_results(str(p))
    assert m.table == {(32, 1): {0.1: 0.2e-3, 1.0: 1.0e-3}} and m.dense_time == pytest.approx(0.4e-3)
    mask = np.zeros((64, 64), bool)
    mask[:32, :6] = True                          # 32x1 coverage = 6*32/4096
    c = choose_micro_tile(mask, [(32, 1)], m)
    assert c.choice == (32, 1)
    with pytest.raises(ValueError, match="no PIT timings"):
        latency_model_from_results({"rows": [{"method": "cublas", "ms": 1.0, "micro_tile": "1x1", "sparsity": 0}]})


def test_repository_results_and_public_name():
    assert pit_tvm.choose_micro_tile is choose_micro_tile
    m = latency_model_from_results()              # docs/results, measured on the H100
    assert isinstance(m, LatencyModel) and m.dense_time > 0 and m.table
    tile = sorted(m.table)[0]
    assert m(tile, 1.0) > 0


@pytest.mark.parametrize("k, size", [(1024, 4096), (4096, 4096), (8192, 8192), (16384, 8192)])
def test_default_model_nearest_size_and_whole_rows_of_any_k(k, size):
    """the default model is the measured benchmark nearest the sample's K, and a whole-row
    candidate (1, K) of any K reads its whole-row times (the README's call for K != 4096)"""
    from pit_tvm.tuning.choose import default_latency_model

    model = default_latency_model(k)
    assert model.row_k == size and (1, size) in model.table
    mask = np.zeros((512, k), bool)
    mask[::10] = True                            # 10 % of the rows, each dense: rows cover 0.1
    c = pit_tvm.choose_micro_tile(mask, [(1, k), (32, 64)])
    assert c.coverage[(1, k)] == pytest.approx(52 / 512) and c.coverage[(32, 64)] == 1.0
    assert c.predicted[(1, k)] == pytest.approx(model((1, size), c.coverage[(1, k)]))
    assert c.dense_time == model.dense_time and c.choice == (1, k)


@st.composite
def masks(draw):
    rows = draw(st.integers(1, 24))
    cols = draw(st.integers(1, 24))
    return draw(hnp.arrays(bool, (rows, cols), elements=st.booleans()))


@settings(max_examples=200, deadline=None)
@given(masks(), st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3))
def test_coverage_bounds_and_refinement(mask, r, c, fr, fc):
    """d <= d_cov(fine) <= d_cov(coarse) when the fine tile divides the coarse one; d_cov(1x1) = d."""
    fine, coarse = (r, c), (r * fr, c * fc)
    m, k = mask.shape
    d = mask.mean()
    assert coverage(mask, (1, 1)) == pytest.approx(d)
    if fine[0] <= m and fine[1] <= k:
        cf = coverage(mask, fine)
        assert d - 1e-12 <= cf <= 1.0 + 1e-12
        if coarse[0] <= m and coarse[1] <= k:
            assert cf <= coverage(mask, coarse) + 1e-12
        if not mask.any():
            assert cf == 0.0
