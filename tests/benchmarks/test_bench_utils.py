"""CPU-only parts of benchmarks/gpu_matmul.py and benchmarks/render_results.py (no GPU, no torch)."""
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = str(Path(__file__).resolve().parents[2] / "benchmarks")  # the repo's benchmarks/
sys.path.insert(0, BENCH)

import gpu_matmul as gm  # noqa: E402
import render_results as rr  # noqa: E402


def test_micro_tile_for():
    assert gm.micro_tile_for("row", 4096) == (1, 4096)
    assert gm.micro_tile_for("1x64", 4096) == (1, 64)
    assert gm.micro_tile_for("32x1", 4096) == (32, 1)
    assert gm.micro_tile_for("32X64", 4096) == (32, 64)
    with pytest.raises(ValueError, match="unknown pattern"):
        gm.micro_tile_for("rows", 64)
    with pytest.raises(ValueError, match="does not fit"):
        gm.micro_tile_for("1x128", 64)


@pytest.mark.parametrize("micro_tile", [(1, 64), (32, 1), (32, 64), (1, 256)])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.95, 0.99, 1.0])
def test_tile_pattern_exact_count_and_expand(micro_tile, sparsity):
    m = k = 256
    rng = np.random.default_rng(0)
    grid = gm.tile_pattern(m, k, micro_tile, sparsity, rng)
    mr, mk = micro_tile
    assert grid.shape == (m // mr, k // mk) and grid.dtype == bool
    assert grid.sum() == round((1 - sparsity) * grid.size)
    full = gm.expand(grid, micro_tile, (m, k))
    assert full.shape == (m, k)
    assert full.mean() == pytest.approx(grid.mean())
    # every micro-tile of the expanded mask is all-ones or all-zeros, as the grid says
    blocks = full.reshape(m // mr, mr, k // mk, mk)
    assert (blocks.all(axis=(1, 3)) == grid).all() and (blocks.any(axis=(1, 3)) == grid).all()


def test_tile_pattern_edges_and_randomness():
    g = gm.tile_pattern(70, 100, (32, 64), 0.5, np.random.default_rng(1))
    assert g.shape == (3, 2) and g.sum() == 3
    assert gm.expand(g, (32, 64), (70, 100)).shape == (70, 100)
    a = gm.tile_pattern(256, 256, (1, 64), 0.5, np.random.default_rng(1))
    b = gm.tile_pattern(256, 256, (1, 64), 0.5, np.random.default_rng(2))
    assert not (a == b).all()
    with pytest.raises(ValueError, match="sparsity"):
        gm.tile_pattern(8, 8, (1, 1), 1.5, np.random.default_rng(0))


def test_roofline_math():
    # 4096^3 fp16: A, B, C are 32 MiB each -> 96 MiB; at 3000 GB/s = 33.55 us
    r = gm.roofline(0.01, 0.18, 4096, 4096, 4096, 3000.0)
    assert r["bytes"] == 3 * 2 * 4096 * 4096 == 96 * 2**20
    assert r["memory_ms"] == pytest.approx(96 * 2**20 / 3e12 * 1e3)
    assert r["compute_ms"] == pytest.approx(0.0018)
    assert r["ms"] == r["memory_ms"]                       # memory-bound at 99% sparsity
    dense = gm.roofline(1.0, 0.18, 4096, 4096, 4096, 3000.0)
    assert dense["ms"] == pytest.approx(0.18)              # compute-bound when dense
    half = gm.roofline(0.5, 0.18, 4096, 4096, 4096, 3000.0)
    assert half["ms"] == pytest.approx(0.09)
    # non-square: bytes = 2 (MK + KN + MN)
    assert gm.roofline(1, 1, 2, 3, 5, 1.0)["bytes"] == 2 * (6 + 15 + 10)


def test_copy_bandwidth():
    # 256 MiB copied in 0.18 ms: 2 * 268435456 B / 0.18e-3 s
    assert gm.copy_bandwidth_GBps(256 * 2**20, 0.18) == pytest.approx(2 * 268435456 / 0.18e-3 / 1e9)


def test_bsr_blocksize():
    assert gm.bsr_blocksize((1, 4096), 4096, 4096, 4096) == 64
    assert gm.bsr_blocksize((1, 64), 4096, 4096, 4096) == 64
    assert gm.bsr_blocksize((32, 64), 4096, 4096, 4096) == 64
    assert gm.bsr_blocksize((32, 1), 4096, 4096, 4096) == 32
    assert gm.bsr_blocksize((128, 128), 4096, 4096, 4096) == 128      # a valid square micro-tile is kept
    assert gm.bsr_blocksize((32, 64), 4096, 4096, 96) == 32           # N % 64 != 0
    assert gm.bsr_blocksize((12, 12), 48, 48, 48) == 16


def test_short_error():
    assert gm.short_error(RuntimeError("\nCUDA out of memory.\nmore")) == "error: RuntimeError: CUDA out of memory."
    assert gm.short_error(ValueError()) == "error: ValueError: "


def fake_rows():
    rows = []
    for pattern, mt in (("row", "1x64"), ("32x64", "32x64")):
        for s in (0.0, 0.9):
            base = {"size": 64, "pattern": pattern, "micro_tile": mt, "sparsity": s, "density": 1 - s}
            rows.append(dict(base, method="cublas", ms=0.2, max_rel_err=1e-4, error=None))
            rows.append(dict(base, method="pit_total", ms=0.4 if s == 0 else 0.05, max_rel_err=2e-4, error=None))
            rows.append(dict(base, method="pit_index", ms=0.01, max_rel_err=None, error=None))
            rows.append(dict(base, method="torch_csr", ms=None, max_rel_err=None,
                             error="error: RuntimeError: boom | pipe"))
            rows.append(dict(base, method="roofline", ms=0.2 * (1 - s) + 0.001, max_rel_err=None, error=None))
            rows.append(dict(base, method="torch_bsr_matmul_only", ms=1.5, max_rel_err=3e-4, error=None))
            if pattern == "row":
                rows.append(dict(base, method="torch_gather_mm_scatter", ms=0.1, max_rel_err=0.0, error=None))
    return rows


ENV = {"device": "Fake GPU", "tvm": "0.27.0", "torch": "2.11", "triton": "3.6.0", "date": "2026-11-22",
       "command": "python3 benchmarks/gpu_matmul.py --sizes 64", "shape": "M=K=N=64", "timing": "do_bench",
       "copy_bandwidth_GBps": 3012.4, "bsr_blocksize": {"64 row": 64}}


def table(md, heading):
    """{sparsity: {column: cell}} of the first table under the heading containing ``heading``."""
    lines = md.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("####") and heading in x)
    head = lines[at + 2]
    cols = [c.strip() for c in head.strip("|").split("|")]
    out = {}
    for x in lines[at + 4:]:
        if not x.startswith("|"):
            break
        cells = [c.strip() for c in x.strip("|").split("|")]
        out[float(cells[0])] = dict(zip(cols[1:], cells[1:]))
    return out


def test_render_table():
    md = rr.render(ENV, fake_rows())
    assert "Fake GPU" in md and "torch 2.11" in md and "triton 3.6.0" in md and "2026-11-22" in md
    assert "`python3 benchmarks/gpu_matmul.py --sizes 64`" in md
    assert "3012 GB/s" in md
    assert "#### M=K=N=64, pattern row (micro-tile 1x64)" in md
    # row pattern, s=0.9: cuBLAS 200 us, PIT 50 us (4.00x), index shows no speedup, CSR an error note
    row = table(md, "pattern row (micro-tile 1x64)")
    assert row[0.9]["cuBLAS dense"] == "200 µs"
    assert row[0.9]["PIT total"] == "50 µs (4.00×)"
    assert row[0.0]["PIT total"] == "400 µs (0.50×)"
    assert row[0.9]["PIT index"] == "10 µs"
    assert row[0.9]["torch CSR (cuSPARSE)"] == "error [1]"
    assert row[0.9]["roofline"] == "21 µs (9.52×)"
    assert row[0.9]["torch gather→mm→scatter"] == "100 µs (2.00×)"
    blk = table(md, "pattern 32x64 (micro-tile 32x64)")
    assert "torch gather→mm→scatter" not in blk[0.9] and blk[0.9]["torch CSR (cuSPARSE)"] == "error [1]"
    # one note per distinct error, naming every place it happened; its pipe stays outside the tables
    assert md.count("error: RuntimeError: boom | pipe") == 1
    note = next(x for x in md.splitlines() if "boom" in x)
    assert note.startswith("1. ") and note.count("torch CSR (cuSPARSE), 64") == 4
    # second section, correctness and slow numbers in ms
    assert "Without the per-call work" in md and "1.50 ms" in md
    assert "| 64 | row | 1.0e-04 | 2.0e-04 |" in md
    assert "## Methods" in md and "`bsr_blocksize`" in md


def test_render_targets():
    """The targets table: PIT total over the roofline against each micro-tile's target, the
    fastest peer that pays its per-call work, the index over one read of A."""
    rows = fake_rows()
    base = {"size": 64, "pattern": "32x64", "micro_tile": "32x64", "sparsity": 0.9, "max_rel_err": None,
            "error": None}
    rows.append(dict(base, method="read_a", ms=0.008))
    rows.append(dict(base, sparsity=0.0, method="pit_kernel", ms=0.25))
    md = rr.render(ENV, rows)
    lines = {tuple(c.strip() for c in x.strip("|").split("|")[:3]): [c.strip() for c in x.strip("|").split("|")[3:]]
             for x in md[md.index("## Against the issue's targets"):].splitlines()[5:] if x.startswith("| 64")}
    # row, s=0.9: roofline 21 us / PIT 50 us = 0.42 < 0.8; torch gather (100 us) is the fastest peer
    assert lines[("64", "row", "0.9")] == ["0.42 (**not met**)", "torch gather→mm→scatter 100 µs", "yes", "—"]
    # 32x64, s=0.9: 0.42 against its 0.6; cuBLAS the fastest peer; index 10 us / read 8 us = 1.25 <= 1.3
    assert lines[("64", "32x64", "0.9")] == ["0.42 (**not met**)", "cuBLAS dense 200 µs", "yes", "1.25 (met)"]
    # sparsity 0: the kernel against cuBLAS (200 / 250 us = 0.80, met); behind a peer is no target there
    assert lines[("64", "32x64", "0")] == ["kernel 0.80× cuBLAS (met)", "cuBLAS dense 200 µs", "no", "—"]
    assert lines[("64", "row", "0")][0] == "—"      # (no PIT kernel row)


def test_render_legacy_baseline_and_cli(tmp_path):
    legacy = {"environment": {"device": "H", "date": "d", "shape": "M=K=N=4096 float16"},
              "rows": [{"kind": "row 1xK", "sparsity": 0.9, "pit_total_ms": 1.5, "pit_index_ms": 0.5,
                        "cublas_ms": 0.15, "torch_gather_mm_scatter_ms": 0.3, "pit_speedup_vs_cublas": 0.1,
                        "max_rel_err": 3e-4},
                       {"kind": "block 32x64", "sparsity": 0.9, "pit_total_ms": 0.3, "pit_index_ms": 0.1,
                        "cublas_ms": 0.15, "torch_gather_mm_scatter_ms": 0.3, "pit_speedup_vs_cublas": 0.5,
                        "max_rel_err": 2e-4}]}
    p = tmp_path / "old.json"
    p.write_text(json.dumps(legacy))
    env, rows = rr.load(str(p))
    assert {r["method"] for r in rows} == {"pit_total", "pit_index", "pit_kernel", "cublas",
                                           "torch_gather_mm_scatter"}
    kern = next(r for r in rows if r["method"] == "pit_kernel" and r["pattern"] == "row")
    assert kern["ms"] == pytest.approx(1.0) and kern["micro_tile"] == "1x4096"
    assert "c89d560" in env["command"]
    out = tmp_path / "page.md"
    rr.main([str(p), "-o", str(out)])
    text = out.read_text()
    assert "pattern row (micro-tile 1x4096)" in text and "1.50 ms (0.10×)" in text
    assert "old.json" in text


def test_repository_page_is_rendered_from_its_json():
    """docs/gpu_matmul.md is exactly what render_results.py makes of the JSON it names."""
    root = os.path.dirname(BENCH)
    page = os.path.join(root, "docs", "gpu_matmul.md")
    text = open(page).read()
    import re

    src = re.search(r"generated by benchmarks/render_results.py from (\S+);", text).group(1)
    json_path = os.path.normpath(os.path.join(root, "docs", src))
    env, rows = rr.load(json_path)
    png = os.path.splitext(json_path)[0] + ".png"
    expect = rr.render(env, rows, src, os.path.relpath(png, os.path.join(root, "docs")) if os.path.exists(png) else None)
    assert text == expect


def test_facet_plot_writes_png(tmp_path, monkeypatch):
    import common

    monkeypatch.setenv("OUT", str(tmp_path))
    rows = rr.add_speedups(fake_rows())
    env = dict(ENV)
    json_path, png_path = common.write_results("bench_test", env, rows, gm.facet_plot(rows, env))
    assert os.path.getsize(png_path) > 1000
    assert json.load(open(json_path))["rows"][0]["method"] == "cublas"


def test_methods_cover_what_the_benchmark_records():
    src = open(os.path.join(BENCH, "gpu_matmul.py")).read()
    import re

    recorded = set(re.findall(r'record\("([a-z_]+)"', src)) | set(re.findall(r'"(triton_gather_[a-z_]+)"', src))
    assert recorded <= set(rr.METHODS), recorded - set(rr.METHODS)
    assert set(rr.PLOTTED) <= set(rr.METHODS)


@pytest.mark.parametrize("sparsity", [0.0, 0.6, 1.0])
def test_row_sparse_inputs_use_the_device_rows_index_layout(sparsity):
    """The probes' hand-built index equals the device index kernel's reference layout (listed
    rows, then the unlisted ones: the rows kernel zeroes C[ids[count:]])."""
    from common import row_sparse_inputs
    from pit_tvm.index import reference_tile_index

    a, _, off, ids = row_sparse_inputs(37, 16, 8, sparsity, np.random.default_rng(1))
    ref_off, ref_ids = reference_tile_index(a, (1, 16), "col")
    np.testing.assert_array_equal(off, ref_off)
    np.testing.assert_array_equal(ids, ref_ids)
