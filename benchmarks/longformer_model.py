"""Longformer at model level (issue 36, item 5): the compiled export against the `transformers` model.

    python benchmarks/longformer_model.py                # GPU box: longformer-base's dims, 12 layers, S 4096
    python benchmarks/longformer_model.py --layers 2     # a shorter encoder, same layer

The model is ``LongformerModel`` with longformer-base-4096's dimensions (hidden 768, 12 heads, window
512, random weights; ``scripts/export_longformer_fixtures.py``), exported the way onnxruntime's
Longformer exporter does it: each self-attention one ``com.microsoft.LongformerAttention`` node.
One call of batch 1 x ``--seq`` tokens with ``--globals`` global tokens drawn per seed and the last
``--pad`` tokens padding. Methods, all float16 on one GPU, inputs on the device:

* ``tvm_pit``: ``compile_onnx`` of the float16 export (``pit_tvm.testing.to_float16``), CUDA graph:
  the contrib op becomes block-sparse attention (window + the call's global tokens, index on the
  device), padding propagated;
* ``tvm_dense``: the same build with ``auto=False, sparse_attention=False`` (dense masked attention);
* ``torch_eager`` / ``torch_compile``: the ``transformers`` model in float16 (its own sliding-chunk
  attention), eager and ``torch.compile``.

Each output is checked against the float32 ``transformers`` model on the real tokens (``max_rel_err``
= max |out - ref| / max |ref|, tolerance 5e-3 or twice the float16 eager run's own error, where larger).
Timings: median ms of ``--repeat`` calls, synchronised per call (``pit_tvm.timing.median_ms``).
Writes ``docs/results/longformer_model.json`` / ``.png`` and ``docs/longformer_model.md`` (under
``$OUT`` when set). Needs torch and transformers.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts"))
from common import (compiled_call, environment, kernel_split_us, print_table, time_compiled,  # noqa: E402
                    write_results)
from real_models import TOLERANCE, TorchCuda, errors  # noqa: E402

NAMES = ("input_ids", "attention_mask", "global_attention_mask")
TABLE = ["method", "median_ms", "device_ms", "speedup_vs_eager", "max_rel_err", "correct", "compile_s"]


def draw_call(seq: int, n_global: int, pad: int, seed: int) -> dict:
    """One call's int64 inputs: random ids, the last ``pad`` tokens padding, token 0 and
    ``n_global - 1`` other real tokens global."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 1000, (1, seq)).astype(np.int64)
    mask = np.ones((1, seq), np.int64)
    if pad:
        mask[0, seq - pad:] = 0
        ids[0, seq - pad:] = 1                               # the pad token
    flags = np.zeros((1, seq), np.int64)
    flags[0, 0] = 1
    flags[0, rng.choice(np.arange(1, seq - pad), n_global - 1, replace=False)] = 1
    return dict(zip(NAMES, (ids, mask, flags)))


def tvm_method(path, inputs, cfg, pit: bool):
    from pit_tvm.compile import compile_onnx  # noqa: PLC0415

    shapes = {n: list(v.shape) for n, v in inputs.items()}
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kw = {} if pit else dict(auto=False, sparse_attention=False)
        cm = compile_onnx(path, "cuda", shapes=shapes, cuda_graph=True, **kw)
    compile_s = time.perf_counter() - t0
    ms, out = time_compiled(cm, inputs, cfg.repeat, cfg.warmup)
    lowered = sorted({f"{a.get('status')}:{a.get('source')}" for a in cm.annotations})
    # where the time goes: each kernel's device time a call (torch.profiler), the largest first
    split = kernel_split_us(compiled_call(cm, inputs), iters=5)
    top = dict(sorted(split.items(), key=lambda kv: -kv[1])[:12])
    return ms, out, {"compile_s": compile_s, "annotations": lowered, "device_ms": sum(split.values()) / 1e3,
                     "kernels_us": top, "warnings": sorted({str(w.message)[:300] for w in caught})[:5]}


def torch_method(model, inputs, cfg, compiled: bool):
    import torch  # noqa: PLC0415

    from pit_tvm.timing import median_ms  # noqa: PLC0415

    args = {n: torch.from_numpy(v).cuda() for n, v in inputs.items()}
    fwd = torch.compile(model) if compiled else model

    @torch.no_grad()
    def call():
        return fwd(**args).last_hidden_state

    out = call().float().cpu().numpy()
    return median_ms(call, TorchCuda(), cfg.repeat, cfg.warmup), out, {}


def run(cfg, tmp: str) -> list[dict]:
    import onnx  # noqa: PLC0415
    import torch  # noqa: PLC0415

    import export_longformer_fixtures as lf  # noqa: PLC0415

    from pit_tvm.testing import to_float16  # noqa: PLC0415

    t0 = time.perf_counter()
    lf.export_hf_model_contrib(pathlib.Path(tmp), full_size=True, layers=cfg.layers)
    path16 = os.path.join(tmp, "longformer_model_fp16.onnx")
    onnx.save(to_float16(onnx.load(os.path.join(tmp, "longformer_model.onnx"))), path16)
    print(f"exported {cfg.layers} layers in {time.perf_counter() - t0:.1f}s", flush=True)
    inputs = draw_call(cfg.seq, cfg.globals, cfg.pad, cfg.seed)
    valid = inputs["attention_mask"].astype(bool)
    model = lf.random_longformer(full_size=True, layers=cfg.layers).cuda()      # the exported weights (seeded)
    with torch.no_grad():
        ref = model(**{n: torch.from_numpy(v).cuda() for n, v in inputs.items()}).last_hidden_state.cpu().numpy()
    model = model.half()
    shape = f"1x{cfg.seq}, {cfg.globals} global tokens, {cfg.pad} padding, {cfg.layers} layers"
    rows = []

    def record(method, fn):
        t = time.perf_counter()
        row = {"method": method, "dtype": "float16", "shape": shape, "median_ms": None, "max_rel_err": None,
               "correct": None, "error": None}
        try:
            ms, out, extra = fn()
            row.update(median_ms=ms, **errors(out, ref, valid, TOLERANCE["float16"]), **extra)
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            row.update(error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-3000:])
        row["wall_s"] = time.perf_counter() - t
        rows.append(row)
        print(f"{method}: " + (f"{row['median_ms']:.3f} ms, rel err {row['max_rel_err']:.2e}" if row["error"] is None
                               else row["error"].splitlines()[0][:300]) + f" ({row['wall_s']:.1f}s)", flush=True)

    methods = {"torch_eager": lambda: torch_method(model, inputs, cfg, compiled=False),
               "tvm_pit": lambda: tvm_method(path16, inputs, cfg, pit=True),
               "tvm_dense": lambda: tvm_method(path16, inputs, cfg, pit=False),
               "torch_compile": lambda: torch_method(model, inputs, cfg, compiled=True)}
    for method in cfg.methods.split(","):
        record(method, methods[method])
    eager = next((r for r in rows if r["method"] == "torch_eager" and r["median_ms"]), None)
    tolerance = max(TOLERANCE["float16"], 2 * eager["max_rel_err"]) if eager else TOLERANCE["float16"]
    for r in rows:
        if r["median_ms"]:
            r["correct"] = bool(r["max_rel_err"] <= tolerance)
            r["speedup_vs_eager"] = eager["median_ms"] / r["median_ms"] if eager else None
    return rows


def plot(ax, rows):
    rs = [r for r in rows if r.get("median_ms")]
    colors = ["tab:green" if r["method"] == "tvm_pit" else "tab:gray" if r["method"] == "tvm_dense" else "tab:blue"
              for r in rs]
    bars = ax.bar(range(len(rs)), [r["median_ms"] for r in rs], color=colors)
    for b, r in zip(bars, rs):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{r['median_ms']:.2f}", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(range(len(rs)))
    ax.set_xticklabels([r["method"] for r in rs], fontsize=8)
    ax.set_ylabel("median ms per call (lower is better)")


def render(env, rows) -> str:
    """The results page: measured numbers only, and the issue's model-level comparison."""
    def ms(v):
        return "–" if v is None else f"{v:.3f}"

    lines = [f"# Longformer at model level ({env['device']})", "",
             f"Generated by `benchmarks/longformer_model.py` from [results/longformer_model.json]"
             f"(results/longformer_model.json) on {env['date']}: `{env['command']}`; torch {env.get('torch', '?')}, "
             f"TVM {env['tvm']}.  {rows[0]['shape'] if rows else ''}; float16; median ms per call; errors against "
             "the float32 `transformers` model on the real tokens.", "",
             "| method | ms | vs eager | max rel err | correct | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        note = r["error"].splitlines()[0][:120] if r.get("error") else ", ".join(r.get("annotations", [])[:3])
        speed = "–" if not r.get("speedup_vs_eager") else f"{r['speedup_vs_eager']:.2f}x"
        err = "–" if r.get("max_rel_err") is None else f"{r['max_rel_err']:.1e}"
        lines.append(f"| {r['method']} | {ms(r.get('median_ms'))} | {speed} | {err} | {r.get('correct')} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--globals", type=int, default=32, help="global tokens of the call (token 0 among them)")
    p.add_argument("--pad", type=int, default=128, help="padding tokens at the end")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default="torch_eager,tvm_pit,tvm_dense,torch_compile",
                   help="comma list, in order")
    cfg = p.parse_args(argv)
    import torch  # noqa: PLC0415

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(cfg, tmp)
    env = environment(torch.cuda.get_device_name(0))
    env.update(config=vars(cfg), total_wall_s=time.perf_counter() - t0,
               command="python benchmarks/longformer_model.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print_table([{c: r.get(c) if r.get(c) is not None else "-" for c in TABLE} for r in rows], TABLE)
    paths = write_results("longformer_model", env, rows, plot)
    page = os.path.join(os.environ.get("OUT") or os.path.join(os.path.dirname(HERE), "docs"), "longformer_model.md")
    with open(page, "w") as f:
        f.write(render(env, rows))
    print("written:", *paths, page)
    return rows


if __name__ == "__main__":
    main()
