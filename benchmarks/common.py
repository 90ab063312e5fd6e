"""Shared benchmark plumbing: random micro-tile patterns, environment record, JSON + PNG output."""
from __future__ import annotations

import datetime
import json
import os
import re
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

    import pit_tvm  # noqa: F401 - sizes TVM's CPU thread pool (pit_tvm/threads.py) before it starts

    env = {"device": device_name, "tvm": tvm.__version__, "numpy": np.__version__,
           "python": platform.python_version(), "date": datetime.date.today().isoformat(),
           "tvm_cpu_threads": tvm.get_global_func("runtime.NumThreads")()}
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


def compiled_call(cm, inputs: dict):
    """A no-argument call of a :class:`pit_tvm.compile.CompiledModel`'s VM ``main`` on ``inputs``
    copied to its device once (no host conversion in the call)."""
    import tvm

    args = [tvm.runtime.tensor(np.ascontiguousarray(inputs[i["name"]], dtype=i["dtype"]), cm.device)
            for i in cm.inputs]
    main = cm._machine()["main"]
    return lambda: main(*args)


def time_compiled(cm, inputs: dict, repeat: int, warmup: int):
    """``(median ms, first output as numpy)`` of a :class:`pit_tvm.compile.CompiledModel` called
    on ``inputs`` already on its device (:func:`compiled_call`)."""
    from pit_tvm.timing import median_ms

    call = compiled_call(cm, inputs)
    out = call()
    out = (out[0] if not hasattr(out, "numpy") else out).numpy()
    return median_ms(call, cm.device, repeat, warmup), out


def print_table(rows: list[dict], columns: list[str]):
    print("  ".join(f"{c:>14s}" for c in columns))
    for r in rows:
        cells = [r.get(c) for c in columns]       # (a method that did not run at a shape: "-")
        print("  ".join(f"{v:>14.3f}" if isinstance(v, float) else f"{'-' if v is None else str(v):>14s}"
                        for v in cells))


# --------------------------------------------------------------------------------------
# CUDA probes (gpu_tc_probe, gpu_tiles_probe, tune_h100): inputs, cuBLAS, TVM timing
# --------------------------------------------------------------------------------------
def row_sparse_inputs(m, k, n, sparsity, rng):
    """fp16 ``A[m, k]`` with whole rows zero at ``sparsity``, ``B[k, n]`` (scaled by 1/sqrt(k))
    and the rows-kind index of A: ``offsets = [0, count]``, ``ids`` (non-zero rows, then the
    zero rows, as :func:`pit_tvm.index.tile_index_func` lays a rows index out)."""
    a = rng.standard_normal((m, k)).astype(np.float32)
    nz = rng.random(m) >= sparsity
    a[~nz] = 0
    b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    ids = np.concatenate([np.nonzero(nz)[0], np.nonzero(~nz)[0]]).astype(np.int32)
    return a.astype(np.float16), b.astype(np.float16), np.array([0, int(nz.sum())], np.int32), ids


def torch_matmul_ms(m, k, n, number):
    """Median ms of a dense fp16 ``torch.matmul`` (cuBLAS), or None without torch/CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16)
    for _ in range(3):
        torch.matmul(a, b)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(number):
            torch.matmul(a, b)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / number)
    return float(np.median(times))


def main_module(executable):
    """The runtime module of a built TVM executable (``jit()`` when it has one)."""
    return executable.jit() if hasattr(executable, "jit") else executable.mod


def main_evaluator(executable, dev, number, repeat):
    """``time_evaluator`` of the executable's ``main``."""
    return main_module(executable).time_evaluator("main", dev, number=number, repeat=repeat)


def evaluator_median_ms(evaluator, args) -> float:
    """Median of a ``time_evaluator`` run in ms (kernel time, no Python per call)."""
    return float(np.median(evaluator(*args).results)) * 1e3


def run_checked(mod, dev, inputs, shape, out_dtype, ref):
    """Run ``mod["main"](*inputs, C)`` once with ``C`` (``shape``, ``out_dtype``) filled with
    NaN; returns the device arguments (inputs + C) and the max relative error against
    ``ref`` (NaN when any element of C was left unwritten)."""
    import tvm

    targs = [tvm.runtime.tensor(x, dev) for x in inputs]
    c = tvm.runtime.tensor(np.full(shape, np.nan, np.float32).astype(out_dtype), dev)
    targs.append(c)
    mod["main"](*targs)
    dev.sync()
    got = c.numpy().astype(np.float32)
    err = float(np.nanmax(np.abs(got - ref)) / max(np.abs(ref).max(), 1e-6))
    if np.isnan(got).any():
        err = float("nan")
    return targs, err


def ffn_fc2_operands(m: int = 4096, k: int = 8192, n: int = 2048, seed: int = 0):
    """``(a, b, on)``: torch CUDA fp16 operands of an OPT FFN's fc2 (``a`` = ``hidden``, [m, k])
    with the model's firing rates (:func:`pit_tvm.testing.ffn_firing_rates`: 10 % of ``a``'s columns
    non-zero for 99 % of the rows, the rest for ~0.1 %; ~22 % of 128-row strips' columns listed
    at 4096 x 8192), ``b`` ~ N(0, 1/k); ``on``: a's non-zero mask."""
    import torch

    from pit_tvm.testing import ffn_firing_rates

    rate = ffn_firing_rates(k, rng=np.random.default_rng(seed))
    on = torch.rand(m, k, device="cuda") < torch.from_numpy(rate).float().cuda()
    a = (torch.rand(m, k, device="cuda", dtype=torch.float16) + 0.1) * on
    b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
    return a, b, on


def kernel_split_us(fn, iters: int = 20) -> dict[str, float]:
    """Mean device time per call of each CUDA kernel ``fn()`` launches, in µs, from
    ``torch.profiler`` (CUPTI sees TVM's launches too); {} without torch."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return {}
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" and ev.count:
            out[ev.key] = ev.device_time_total / iters
    return out


def parse_tc_config(spec: str, cls):
    """``"128x128x32w64x32s3"`` (block m x n x k, warp m x n, stages) -> ``cls(...)``."""
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)x(\d+)s(\d+)", spec)
    if not m:
        raise ValueError(f"config {spec!r}: expected BMxBNxBKwWMxWNsS, e.g. 128x128x32w64x32s3")
    bm, bn, bk, wm, wn, st = (int(x) for x in m.groups())
    return cls(block_m=bm, block_n=bn, block_k=bk, warp_m=wm, warp_n=wn, stages=st)


def write_out_json(filename: str, results) -> None:
    """Write ``results`` to ``$OUT/<filename>`` when OUT is set."""
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, filename), "w") as f:
            json.dump(results, f, indent=1)
        print("wrote", os.path.join(out, filename))
