"""Micro-tile choice from a sample of the sparsity pattern (PIT §2.2: coverage + tile DB + dense fallback).

PIT picks, per operator and pattern, the micro-tile whose predicted latency is smallest:

1. **Coverage.** For each candidate micro-tile ``(mr, mk)`` the sample's mask is convolved with an
   all-ones ``mr x mk`` kernel of stride ``(mr, mk)`` (``cover_sim.py::sim()`` in the PIT artifact).
   A micro-tile is computed when any element in it is non-zero, so the density PIT actually
   computes is ``d_cov >= d`` (``d`` = the sample's element density). Here that convolution is a
   strided reshape + ``any``; ``d_cov`` is the area of the non-zero micro-tiles over the sample's
   area (edge tiles clipped to the sample), which equals the fraction of non-zero micro-tiles
   when the tile divides the sample.
2. **Latency model.** ``latency(micro_tile, d_cov) -> seconds``: a callable, or a tile database
   ``{micro_tile: {density: seconds}}`` interpolated in density (PIT's ``stile_db.csv``). The
   default model is read from a measured benchmark JSON (``docs/results/gpu_matmul*.json``): the
   one whose M = K = N is nearest the sample's K, its times those of that shape (the choice
   rests on their ratios to its dense time); a whole-row candidate ``(1, K)`` reads its rows.
3. **Dense fallback.** When no candidate is strictly faster than the dense time, the choice is
   ``"dense"``. Ties between candidates go to the one listed first.

    >>> import numpy as np
    >>> mask = np.zeros((64, 128), bool); mask[:32, :64] = True
    >>> c = choose_micro_tile(mask, [(32, 64), (1, 128)], {(32, 64): {0.0: 0.0, 1.0: 4.0},
    ...                                                    (1, 128): {0.0: 0.0, 1.0: 2.0}}, dense_time=1.5)
    >>> c.choice, c.coverage[(32, 64)], c.coverage[(1, 128)]
    ((32, 64), 0.25, 0.5)
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence, Union

import numpy as np

from pit_tvm._args import is_int, micro_tile_pair

MicroTile = tuple[int, int]
LatencyTable = Mapping[MicroTile, Mapping[float, float]]
Latency = Union[Callable[[MicroTile, float], float], LatencyTable, "LatencyModel"]

DEFAULT_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                               "docs", "results")
#: the measured benchmarks the default model reads, by their M = K = N
DEFAULT_RESULT_FILES = {4096: "gpu_matmul.json", 8192: "gpu_matmul_8192.json"}
#: the measured CPU benchmark (``benchmarks/cpu_matmul.py``) the default model of an ``llvm`` target reads
CPU_RESULT_FILE = "cpu_matmul.json"


# -- coverage -----------------------------------------------------------------------------------
def _as_mask(sample) -> np.ndarray:
    if hasattr(sample, "__dlpack__") and not isinstance(sample, np.ndarray):
        try:
            sample = np.from_dlpack(sample)
        except Exception:  # noqa: BLE001 - a GPU tensor, or bfloat16 (numpy cannot import it)
            try:
                from pit_tvm.runtime.loader import dlpack_to_tvm  # noqa: PLC0415 - TVM only here

                sample = dlpack_to_tvm(sample, "sample").numpy()     # (a copy to the host)
            except Exception as err:  # noqa: BLE001
                raise TypeError(f"sample must be a numpy array or a DLPack tensor; could not read "
                                f"{type(sample).__name__} on the host: {err}") from err
    arr = np.asarray(sample)
    if arr.ndim != 2:
        raise ValueError(f"sample must be 2-D (rows x cols of the sparse operand), got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"sample is empty (shape {arr.shape})")
    return arr.astype(bool) if arr.dtype == bool else (arr != 0)


def _as_tile(t, name: str = "micro-tile") -> MicroTile:
    """``(rows, cols)`` of a pair of positive ints or an ``"RxC"`` string (floats refused, not
    truncated)."""
    return micro_tile_pair(t, name)


def tile_mask(mask: np.ndarray, micro_tile) -> np.ndarray:
    """Which micro-tiles of ``mask`` hold a non-zero: the strided all-ones convolution, as booleans.

    Shape ``(ceil(M/mr), ceil(K/mk))``; edge tiles are padded with zeros.
    """
    mask = _as_mask(mask)
    mr, mk = _as_tile(micro_tile)
    m, k = mask.shape
    tr, tc = -(-m // mr), -(-k // mk)
    if (tr * mr, tc * mk) != (m, k):
        padded = np.zeros((tr * mr, tc * mk), bool)
        padded[:m, :k] = mask
        mask = padded
    return mask.reshape(tr, mr, tc, mk).any(axis=(1, 3))


def coverage(sample, micro_tile) -> float:
    """Density PIT computes with ``micro_tile``: area of the non-zero micro-tiles / area of the sample.

    Always ``>= density(sample)``, and never larger for a micro-tile that divides another.
    """
    mask = _as_mask(sample)
    mr, mk = _as_tile(micro_tile)
    m, k = mask.shape
    if mr > m or mk > k:
        raise ValueError(f"micro-tile {mr}x{mk} is larger than the sample ({m}x{k})")
    tiles = tile_mask(mask, (mr, mk))
    heights = np.minimum(mr, m - mr * np.arange(tiles.shape[0]))
    widths = np.minimum(mk, k - mk * np.arange(tiles.shape[1]))
    covered = int((tiles * heights[:, None] * widths[None, :]).sum())
    return covered / (m * k)


# -- latency models ---------------------------------------------------------------------------------
def interpolate(points: Mapping[float, float], density: float, step: bool = False) -> float:
    """Latency at ``density`` from ``{density: seconds}`` points.

    ``step=False``: linear between the bracketing points; below the smallest density the smallest
    entry's time (a kernel has a floor); above the largest, the last segment extended (or the
    largest entry's time when there is one point). ``step=True``: PIT's rule -- the time of the
    entry at the smallest listed density ``>= density`` (i.e. at lower or equal sparsity);
    above the largest listed density, the largest entry's time.
    """
    if not points:
        raise ValueError("latency table entry is empty")
    xs = np.array(sorted(float(d) for d in points))
    ys = np.array([float(points[d]) for d in sorted(points, key=float)])
    if step:
        at = int(np.searchsorted(xs, density - 1e-12, side="left"))
        return float(ys[min(at, len(xs) - 1)])
    if density <= xs[0]:
        return float(ys[0])
    if density >= xs[-1]:
        if len(xs) == 1:
            return float(ys[-1])
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(ys[-1] + slope * (density - xs[-1]))
    return float(np.interp(density, xs, ys))


@dataclass
class LatencyModel:
    """A tile database: ``table[micro_tile][density] = seconds``, plus the dense time (seconds).

    Calling it interpolates (see :func:`interpolate`); ``source`` says where the numbers came from.
    """

    table: dict
    dense_time: float | None = None
    step: bool = False
    source: str = ""
    #: the K of the table's whole-row entry ``(1, row_k)``: :func:`choose_micro_tile`'s whole-row
    #: candidate of another K (``(1, sample K)``) reads it
    row_k: int | None = None

    def __post_init__(self):
        self.table = {_as_tile(t): {float(d): float(s) for d, s in pts.items()} for t, pts in self.table.items()}

    def __call__(self, micro_tile, density: float) -> float:
        t = _as_tile(micro_tile)
        if t not in self.table:
            known = ", ".join(f"{a}x{b}" for a, b in sorted(self.table))
            raise KeyError(f"no latency entries for micro-tile {t[0]}x{t[1]}"
                           f"{' in ' + self.source if self.source else ''}; known: {known or 'none'}")
        return interpolate(self.table[t], density, self.step)


def _tile_from_kind(kind: str, k: int | None) -> MicroTile:
    m = re.search(r"(\d+)\s*x\s*(\d+|K)\b", kind)
    if not m:
        raise ValueError(f"cannot read a micro-tile from {kind!r}")
    if m.group(2) == "K":
        if k is None:
            raise ValueError(f"{kind!r} names a whole-row micro-tile but the results give no K")
        return int(m.group(1)), int(k)
    return int(m.group(1)), int(m.group(2))


def latency_model_from_results(path_or_data=None, size: int | None = None) -> LatencyModel:
    """A :class:`LatencyModel` from a measured GPU matmul benchmark JSON.

    Accepts both layouts written by ``benchmarks/gpu_matmul.py``: the wide baseline rows
    (``kind``, ``sparsity``, ``pit_total_ms``, ``cublas_ms``; or ``benchmarks/cpu_matmul.py``'s
    ``pit_ms``, ``dense_tvm_ms``: PIT and the dense TVM build on the CPU) and the long rows
    (``size``, ``micro_tile``, ``sparsity``, ``density``, ``method``, ``ms``). The PIT time is
    PIT's end-to-end time (index + kernel); the dense time is the median cuBLAS time.
    ``path_or_data=None`` reads ``docs/results/gpu_matmul.json`` or, if absent,
    ``gpu_matmul_baseline.json``. ``size`` selects one problem size when the file holds several.
    """
    source = "<dict>"
    if path_or_data is None:
        for name in ("gpu_matmul.json", "gpu_matmul_baseline.json"):
            cand = os.path.join(DEFAULT_RESULTS, name)
            if os.path.exists(cand):
                path_or_data = cand
                break
        else:
            raise FileNotFoundError(f"no measured GPU matmul results under {DEFAULT_RESULTS}")
    if isinstance(path_or_data, (str, os.PathLike)):
        source = os.fspath(path_or_data)
        with open(path_or_data) as f:
            data = json.load(f)
    else:
        data = path_or_data
    rows = data["rows"] if isinstance(data, dict) else data
    env = data.get("environment", {}) if isinstance(data, dict) else {}
    table: dict = {}
    dense: list[float] = []
    if rows and "method" in rows[0]:
        sizes = sorted({int(r["size"]) for r in rows if "size" in r})
        want = size if size is not None else (sizes[0] if sizes else None)
        for r in rows:
            if want is not None and "size" in r and int(r["size"]) != want:
                continue
            if r.get("ms") is None:
                continue
            if r["method"] == "cublas":
                dense.append(float(r["ms"]) * 1e-3)
            elif r["method"] == "pit_total":
                d = float(r["density"]) if r.get("density") is not None else 1.0 - float(r["sparsity"])
                table.setdefault(_as_tile(r["micro_tile"]), {})[d] = float(r["ms"]) * 1e-3
    else:
        m = re.search(r"K=(?:N=)?(\d+)", env.get("shape", "")) or re.search(r"=(\d+)", env.get("shape", ""))
        k = int(m.group(1)) if m else size
        for r in rows:
            dense_ms = r.get("cublas_ms", r.get("dense_tvm_ms"))
            if dense_ms is not None:
                dense.append(float(dense_ms) * 1e-3)
            pit_ms = r.get("pit_total_ms", r.get("pit_ms"))
            if pit_ms is not None:
                table.setdefault(_tile_from_kind(r["kind"], k), {})[1.0 - float(r["sparsity"])] = \
                    float(pit_ms) * 1e-3
    if not table:
        raise ValueError(f"no PIT timings found in {source}")
    row_k = max((kk for mr, kk in table if mr == 1), default=None)
    return LatencyModel(table, float(np.median(dense)) if dense else None, source=source, row_k=row_k)


def default_latency_model(k: int, target: str = "cuda") -> LatencyModel:
    """:func:`latency_model_from_results` of the measured benchmark whose M = K = N is nearest
    ``k`` (:data:`DEFAULT_RESULT_FILES`; else the one file there is); for ``target="llvm"`` the
    CPU benchmark (:data:`CPU_RESULT_FILE`: PIT and the dense build on this kind of machine)"""
    if str(target).split()[0].split(":")[0] in ("llvm", "cpu"):
        return latency_model_from_results(os.path.join(DEFAULT_RESULTS, CPU_RESULT_FILE))
    files = {size: os.path.join(DEFAULT_RESULTS, name) for size, name in DEFAULT_RESULT_FILES.items()
             if os.path.exists(os.path.join(DEFAULT_RESULTS, name))}
    if not files:
        return latency_model_from_results()
    size = min(files, key=lambda s: abs(math.log2(s) - math.log2(max(k, 1))))
    return latency_model_from_results(files[size], size=size)


# -- the choice -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TileChoice:
    """Result of :func:`choose_micro_tile`. Times in seconds.

    ``choice``: the chosen micro-tile ``(mr, mk)``, or ``"dense"``. ``coverage[t]``: the density
    computed with ``t`` (``>= density``); ``predicted[t]``: the model's time for ``t`` at that
    coverage; ``dense_time``: the time to beat; ``density``: the sample's element density.
    """

    choice: MicroTile | str
    coverage: dict = field(default_factory=dict)
    predicted: dict = field(default_factory=dict)
    dense_time: float = math.inf
    density: float = 0.0

    @property
    def is_dense(self) -> bool:
        return self.choice == "dense"

    @property
    def predicted_time(self) -> float:
        return self.dense_time if self.is_dense else self.predicted[self.choice]

    def speedup(self) -> float:
        """Predicted speedup of the choice over the dense time."""
        return self.dense_time / self.predicted_time if self.predicted_time > 0 else math.inf


def choose_micro_tile(sample, candidates: Sequence, latency: Latency | None = None,
                      dense_time: float | None = None, *, step: bool = False) -> TileChoice:
    """Pick the micro-tile for a sparse operand from a sample of its pattern (or ``"dense"``).

    ``sample``: 2-D boolean mask or dense array (non-zero = present), numpy or a host DLPack tensor.
    ``candidates``: micro-tiles ``(rows, cols)`` (or ``"RxC"`` strings), none larger than the sample.
    ``latency``: ``latency(micro_tile, covered_density) -> seconds``, a table
    ``{micro_tile: {density: seconds}}`` (interpolated; ``step=True`` uses PIT's lower-or-equal-sparsity
    entry instead), a :class:`LatencyModel`, or None for :func:`default_latency_model` (the measured results nearest the sample's K; a whole-row candidate
    ``(1, K)`` reads their whole-row entry). ``dense_time`` (seconds): defaults to the model's.
    A candidate must be strictly faster than the dense time to be chosen; ties between
    candidates go to the first listed.
    """
    mask = _as_mask(sample)
    if candidates is None or isinstance(candidates, str) or (
            isinstance(candidates, Sequence) and len(candidates) == 2 and all(is_int(x) for x in candidates)):
        raise TypeError(f"candidates must be a list of micro-tiles, e.g. [(32, 64), (1, 64)], got {candidates!r}"
                        + ("" if candidates is None else f" (for the one micro-tile, pass [{candidates!r}])"))
    cands = [_as_tile(t, f"candidates[{i}]") for i, t in enumerate(candidates)]
    if not cands:
        raise ValueError("candidates is empty: give at least one micro-tile (rows, cols)")
    if len(set(cands)) != len(cands):
        raise ValueError(f"candidates repeat a micro-tile: {cands}")
    m, k = mask.shape
    too_big = [t for t in cands if t[0] > m or t[1] > k]
    if too_big:
        raise ValueError(f"micro-tile(s) {', '.join(f'{a}x{b}' for a, b in too_big)} larger than the "
                         f"sample ({m}x{k}); give a larger sample or smaller tiles")
    if latency is None:
        latency = default_latency_model(k)
    if isinstance(latency, Mapping):
        latency = LatencyModel(dict(latency), step=step)
    elif isinstance(latency, LatencyModel) and step != latency.step:
        latency = replace(latency, step=step)
    if not callable(latency):
        raise TypeError(f"latency must be a callable, a {{micro_tile: {{density: seconds}}}} table or None, "
                        f"got {type(latency).__name__}")
    if dense_time is None:
        dense_time = getattr(latency, "dense_time", None)
        if dense_time is None:
            raise ValueError("dense_time is required (seconds) unless the latency model carries one")
    if isinstance(dense_time, (bool, np.bool_)) or not isinstance(dense_time, (int, float, np.integer, np.floating)):
        raise TypeError(f"dense_time must be a number of seconds, got {dense_time!r} ({type(dense_time).__name__})")
    dense_time = float(dense_time)
    if not dense_time > 0 or math.isinf(dense_time):
        raise ValueError(f"dense_time must be a positive finite number of seconds, got {dense_time!r}")

    row_k = getattr(latency, "row_k", None)
    cov, pred = {}, {}
    for t in cands:
        cov[t] = coverage(mask, t)
        # (whole rows of this K read the model's whole-row entry, measured at its K)
        p = float(latency((1, row_k) if t == (1, k) and row_k and t not in latency.table else t, cov[t]))
        if math.isnan(p) or p < 0:
            raise ValueError(f"latency model gave {p!r} s for micro-tile {t[0]}x{t[1]} at density {cov[t]:.4g}")
        pred[t] = p
    best = min(cands, key=lambda t: pred[t])        # min keeps the first of equal values
    choice = best if pred[best] < dense_time else "dense"
    return TileChoice(choice, cov, pred, dense_time, float(mask.mean()))
