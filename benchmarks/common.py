"""Shared benchmark plumbing: random micro-tile patterns, environment record, JSON + PNG output."""
from __future__ import annotations

import datetime
import json
import os
import platform

import numpy as np

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results")


def tile_sparse(m, k, micro_tile, sparsity, dtype, rng):
    """A random ``m x k`` matrix whose ``micro_tile``-granular pattern has the given sparsity."""
    mr, mk = micro_tile
    mask = rng.random((-(-m // mr), -(-k // mk))) >= sparsity
    full = np.repeat(np.repeat(mask, mr, axis=0), mk, axis=1)[:m, :k]
    return (rng.standard_normal((m, k)) * full).astype(dtype)


def environment(device_name: str) -> dict:
    import tvm

    env = {"device": device_name, "tvm": tvm.__version__, "numpy": np.__version__,
           "python": platform.python_version(), "date": datetime.date.today().isoformat()}
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:
        pass
    return env


def write_results(name: str, env: dict, rows: list[dict], plot) -> tuple[str, str]:
    """Write ``docs/results/<name>.json`` and ``<name>.png`` (under ``$OUT`` when set)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = os.environ.get("OUT") or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    plot(ax, rows)
    ax.set_title(f"{name} on {env['device']} ({env['date']})", fontsize=9)
    fig.tight_layout()
    png_path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(png_path, dpi=110)
    return json_path, png_path


def print_table(rows: list[dict], columns: list[str]):
    print("  ".join(f"{c:>14s}" for c in columns))
    for r in rows:
        print("  ".join(f"{r[c]:>14.3f}" if isinstance(r[c], float) else f"{str(r[c]):>14s}" for c in columns))
