"""MoE layer benchmark (issue 35, item 5): the PIT op against torch peers and the roofline, one GPU.

    python benchmarks/moe.py                 # reduced grid, bf16 (about 2 minutes on an H100 / H200)
    python benchmarks/moe.py --full          # the issue's whole grid, bf16 and fp16
    python benchmarks/moe.py --list          # the cases, without running (no GPU needed)

Each case is one MoE FFN layer (tokens ``T``, hidden ``d``, expert width ``f``, ``E`` experts,
top-k routing, ReLU or SwiGLU), its router logits balanced (random) or Zipf-skewed over the
experts.  Methods, each paying its routing every call:

- ``pit``: :func:`pit_tvm.moe_ffn` built for ``cuda`` (sm_90a: routing, the device index, the
  Hopper grouped GEMMs, the combine), its VM function called on device tensors; ``pit_device``:
  the sum of its kernels' device times (torch.profiler), and ``pit_index`` the device time of
  its expert-index kernels among them (as ``benchmarks/attention.py`` counts its index);
- ``torch_grouped_mm``: softmax / top-k, argsort, per-expert counts, gather, ``torch._grouped_mm``
  for fc1 (and the gate) and fc2, weights, ``index_add_`` (CUDA-graph captured where it can be;
  the counts by ``index_add_`` rather than ``bincount``, whose output size syncs the host);
- ``torch_loop``: a per-expert loop (``torch.where``, gather, two matmuls, ``index_add_``),
  only where ``E <= 64`` (it is slow);
- ``torch_bmm_cf1.25``: capacity factor 1.25 dispatch to ``[E, C, d]``, two ``bmm``, combine
  (drops the tokens past the capacity, so its error is recorded, not checked).

``roofline`` = max(FLOPs at the cuBLAS rate, bytes at the copy bandwidth), both measured in the
same run (bytes: the weights of the experts that receive a token, read once, plus x and y);
``weight_floor`` the weight bytes alone.  Correctness: every method's rows against an fp32
torch reference of the same routing (max over rows of ||y_row - ref_row|| / ||ref_row||).

Writes ``docs/results/moe.json`` / ``.png`` and the page ``docs/moe.md`` (under ``$OUT`` when
set).  torch is only needed to run: the module imports without it (``--list``, the page).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, environment, print_table, write_results  # noqa: E402

#: layer shapes of the issue: (d, f, top_k, routing, activation)
LAYERS = {
    "switch": dict(d=768, f=3072, top_k=1, routing="softmax_topk", activation="relu"),
    "mixtral": dict(d=4096, f=14336, top_k=2, routing="topk_softmax", activation="swiglu"),
    "finegrained": dict(d=2048, f=1408, top_k=6, routing="softmax_topk", activation="swiglu"),
}
#: the reduced default grid: (layer, E, T, skew)
DEFAULT_CASES = [("switch", 64, 4096, False), ("switch", 128, 4096, False), ("switch", 128, 4096, True),
                 ("switch", 64, 256, False), ("switch", 128, 256, False),
                 ("mixtral", 8, 16, False), ("mixtral", 8, 4096, False),
                 ("finegrained", 64, 4096, False)]
#: the issue's grid (each balanced and skewed)
FULL_GRID = {"switch": ((8, 64, 128, 256), (1024, 4096, 16384)), "mixtral": ((8,), (16, 256, 4096)),
             "finegrained": ((64,), (256, 4096))}
#: Zipf exponent of the skewed routing's expert popularity
ZIPF_A = 1.2
#: per-row relative error allowed against the fp32 reference
TOLERANCE = {"bfloat16": 4e-2, "float16": 1e-2}
#: methods whose output is exact up to rounding (the capacity-factor peer drops tokens)
CHECKED = ("pit", "torch_grouped_mm", "torch_loop")
TABLE = ["case", "dtype", "method", "median_ms", "vs_grouped_mm", "vs_roofline", "max_row_rel_err", "correct"]
LOOP_MAX_EXPERTS = 64


def cases(full: bool = False, dtypes=("bfloat16",)) -> list[dict]:
    """The benchmark's cases: the reduced default grid or the issue's whole grid, per dtype."""
    if full:
        grid = [(layer, e, t, skew) for layer, (es, ts) in FULL_GRID.items()
                for e, t, skew in itertools.product(es, ts, (False, True))]
    else:
        grid = DEFAULT_CASES
    out = []
    for dtype in dtypes:
        for layer, e, t, skew in grid:
            shape = LAYERS[layer]
            out.append(dict(layer=layer, E=e, T=t, skew=skew, dtype=dtype, **shape,
                            name=f"{layer} E{e} T{t}{' zipf' if skew else ''}"))
    return out


def layer_flops(case) -> float:
    """FLOPs of the routed FFN: 2 T k d f per weight matrix (3 matrices when gated)."""
    mats = 3 if case["activation"] in ("swiglu", "geglu") else 2
    return 2.0 * case["T"] * case["top_k"] * case["d"] * case["f"] * mats


def floor_bytes(case, active_experts: int) -> tuple[float, float]:
    """(weight bytes of the experts that receive a token, those plus x and y) at the case's dtype."""
    elt = 2
    mats = 3 if case["activation"] in ("swiglu", "geglu") else 2
    weights = float(active_experts) * case["d"] * case["f"] * mats * elt
    return weights, weights + 2.0 * case["T"] * case["d"] * elt


def roofline_ms(case, active_experts: int, tflops: float, gbps: float) -> tuple[float, float]:
    """(roofline ms, weight-read floor ms): max(FLOPs at ``tflops``, bytes at ``gbps``) and the
    weight bytes alone at ``gbps``."""
    weights, total = floor_bytes(case, active_experts)
    return max(layer_flops(case) / (tflops * 1e9), total / (gbps * 1e6)), weights / (gbps * 1e6)


# ---------------------------------------------------------------------------------- torch side
def _torch():
    import torch  # noqa: PLC0415

    return torch


def make_inputs(case, seed: int = 0) -> dict:
    """x[T, d], router logits [T, E] fp32 (Zipf-skewed: expert e's logits shifted by
    -2a log(1 + e)), w1/w3 [E, d, f], w2 [E, f, d] on the GPU in the case's dtype."""
    torch = _torch()
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, case["dtype"])
    T, d, f, E = case["T"], case["d"], case["f"], case["E"]
    x = torch.randn(T, d, device="cuda", generator=g).to(dt)
    router = torch.randn(T, E, device="cuda", generator=g)
    if case["skew"]:
        router = router - ZIPF_A * torch.log1p(torch.arange(E, device="cuda", dtype=torch.float32)) * 2.0
    # (the router in fp32: bf16 logits tie often enough to flip a token's top-1 between two
    # experts with equal probability, where tie-breaking rules differ)
    inputs = {"x": x, "router": router,
              "w1": (torch.randn(E, d, f, device="cuda", generator=g) / math.sqrt(d)).to(dt),
              "w2": (torch.randn(E, f, d, device="cuda", generator=g) / math.sqrt(f)).to(dt)}
    if case["activation"] == "swiglu":
        inputs["w3"] = (torch.randn(E, d, f, device="cuda", generator=g) / math.sqrt(d)).to(dt)
    return inputs


def torch_route(router, case):
    """(expert ids [T, k] int64, weights [T, k] fp32) as MoESpec's routing defines them."""
    torch = _torch()
    r = router.float()
    if case["routing"] == "softmax_topk":
        w, ids = torch.topk(torch.softmax(r, -1), case["top_k"], dim=-1)
    else:
        logits, ids = torch.topk(r, case["top_k"], dim=-1)
        w = torch.softmax(logits, -1)
    return ids, w


def _ffn(xs, w1, w2, w3, activation):
    torch = _torch()
    h = xs @ w1
    h = torch.nn.functional.silu(h) * (xs @ w3) if activation == "swiglu" else torch.relu(h)
    return h @ w2


def reference(inputs, case):
    """The layer in fp32 for the routing of :func:`torch_route` (per expert, exact)."""
    torch = _torch()
    x = inputs["x"].float()
    ids, w = torch_route(inputs["router"], case)
    y = torch.zeros_like(x)
    for e in range(case["E"]):
        t, j = torch.where(ids == e)
        if t.numel():
            w3 = inputs["w3"][e].float() if "w3" in inputs else None
            out = _ffn(x[t], inputs["w1"][e].float(), inputs["w2"][e].float(), w3, case["activation"])
            y.index_add_(0, t, out * w[t, j, None])
    return y


def row_rel_err(y, ref) -> float:
    torch = _torch()
    y = y.float().reshape(ref.shape)
    return float(((y - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).max())


def grouped_mm_layer(inputs, case, layouts):
    """The torch._grouped_mm path with its routing: top-k, argsort, counts, gather, two (three)
    grouped GEMMs, weights, index_add_ (no host synchronisation)."""
    torch = _torch()
    x, E, k = inputs["x"], case["E"], case["top_k"]
    ids, w = torch_route(inputs["router"], case)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, device="cuda", dtype=torch.int32).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // k
    xs = x[tok]
    h = torch._grouped_mm(xs, layouts["w1"], offs=offs)
    if case["activation"] == "swiglu":
        h = torch.nn.functional.silu(h) * torch._grouped_mm(xs, layouts["w3"], offs=offs)
    else:
        h = torch.relu(h)
    ys = torch._grouped_mm(h, layouts["w2"], offs=offs)
    ys = ys * w.flatten()[order, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, tok, ys)


def grouped_mm_layouts(inputs):
    """The weights as torch._grouped_mm takes them: as given where it accepts that, else each
    expert's matrix column-major (the layout its kernels want on sm_90)."""
    torch = _torch()
    names = [n for n in ("w1", "w2", "w3") if n in inputs]
    probe_x = torch.zeros(16, inputs["w1"].shape[1], device="cuda", dtype=inputs["w1"].dtype)
    offs = torch.full((inputs["w1"].shape[0],), 16, device="cuda", dtype=torch.int32)
    try:
        torch._grouped_mm(probe_x, inputs["w1"], offs=offs)
        return {n: inputs[n] for n in names}
    except RuntimeError:
        return {n: inputs[n].transpose(-2, -1).contiguous().transpose(-2, -1) for n in names}


def loop_layer(inputs, case):
    """A per-expert loop (the host learns each expert's tokens: torch.where syncs)."""
    torch = _torch()
    x = inputs["x"]
    ids, w = torch_route(inputs["router"], case)
    y = torch.zeros_like(x)
    for e in range(case["E"]):
        t, j = torch.where(ids == e)
        if t.numel():
            out = _ffn(x[t], inputs["w1"][e], inputs["w2"][e], inputs.get("w3", [None] * case["E"])[e],
                       case["activation"])
            y.index_add_(0, t, out * w[t, j, None].to(out.dtype))
    return y


def bmm_layer(inputs, case, factor: float = 1.25):
    """Capacity-factor dispatch: C = ceil(factor T k / E) slots an expert, tokens past it
    dropped; [E, C, d] batched matmuls; combine (no host synchronisation)."""
    torch = _torch()
    x, E, k, T = inputs["x"], case["E"], case["top_k"], case["T"]
    cap = max(1, math.ceil(factor * T * k / E))
    ids, w = torch_route(inputs["router"], case)
    flat = ids.flatten()
    onehot = (flat[:, None] == torch.arange(E, device="cuda")).int()
    pos = ((torch.cumsum(onehot, 0) - 1) * onehot).sum(1)
    slot = torch.where(pos < cap, flat * cap + pos, torch.full_like(flat, E * cap))
    tok = torch.arange(T * k, device="cuda") // k
    buf = torch.zeros(E * cap + 1, x.shape[1], device="cuda", dtype=x.dtype).index_copy_(0, slot, x[tok])
    xs = buf[: E * cap].view(E, cap, -1)
    h = torch.bmm(xs, inputs["w1"])
    h = torch.nn.functional.silu(h) * torch.bmm(xs, inputs["w3"]) if case["activation"] == "swiglu" else torch.relu(h)
    ys = torch.cat([torch.bmm(h, inputs["w2"]).view(E * cap, -1), torch.zeros_like(buf[:1])])
    contrib = ys[slot] * w.flatten()[:, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, tok, contrib)


def cuda_ms(fn, repeat: int = 5, target_ms: float = 30.0) -> float:
    """Median ms per call from CUDA events around back-to-back calls (as many a sample as fill
    about ``target_ms``), after a warm-up."""
    torch = _torch()
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    number = int(min(50, max(1, target_ms / max((time.perf_counter() - t) * 1e3, 1e-3))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeat):
        start.record()
        for _ in range(number):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / number)
    return float(np.median(samples))


def graphed(fn):
    """``fn`` replayed from a CUDA graph where it captures (no host sync), else ``fn``; and
    whether it was captured."""
    torch = _torch()
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return (lambda: (graph.replay(), out)[1]), True
    except Exception:  # noqa: BLE001 - not capturable: eager
        torch.cuda.synchronize()
        return fn, False


def measure_rates() -> tuple[float, float]:
    """(cuBLAS bf16 TFLOP/s on 8192^3, device copy GB/s on 1 GiB) in this run."""
    torch = _torch()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    tflops = 2 * 8192 ** 3 / (cuda_ms(lambda: a @ b) * 1e9)
    src = torch.empty(1 << 29, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    gbps = 2 * src.numel() * 2 / (cuda_ms(lambda: dst.copy_(src)) * 1e6)
    del a, b, src, dst
    return tflops, gbps


# ---------------------------------------------------------------------------------- PIT side
def pit_spec(case):
    from pit_tvm.ops.moe import MoESpec  # noqa: PLC0415

    return MoESpec(num_experts=case["E"], top_k=case["top_k"], routing=case["routing"],
                   activation=case["activation"])


@functools.lru_cache(maxsize=None)
def _pit_op(layer: str, num_experts: int, dtype: str, tuning_log: str | None = None):
    """the op of (layer, E, dtype) for ``cuda`` (unbuilt: its builds are :func:`build_pit_ops`'),
    with the tiles of ``tuning_log`` (``pit-tvm tune --op moe``) where it has them"""
    import pit_tvm  # noqa: PLC0415

    case = dict(LAYERS[layer], layer=layer, E=num_experts, dtype=dtype)
    return pit_tvm.moe_ffn(pit_spec(case), case["d"], case["f"], dtype, target="cuda", router_dtype="float32",
                           tuning_log=tuning_log)


def pit_op_key(case, tuning_log: str | None = None) -> tuple:
    """(layer, E, dtype, the grouped GEMMs' tiles a call of the case's T runs): T runs the op's
    variant of its planned or tuned tiles (MoEFFN.tiles)"""
    op = _pit_op(case["layer"], case["E"], case["dtype"], tuning_log)
    return (case["layer"], case["E"], case["dtype"], op.tiles(case["T"]))


def build_pit_ops(all_cases, workers: int = 8, tuning_log: str | None = None) -> dict:
    """The op's build for each :func:`pit_op_key` (the symbolic-T layer, or a variant of other tiles),
    built for ``cuda`` concurrently (nvcc runs as a subprocess); failures recorded as the
    exception."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    variants = {}
    for case in all_cases:
        key = pit_op_key(case, tuning_log)
        if key not in variants:
            op = _pit_op(case["layer"], case["E"], case["dtype"], tuning_log)
            variants[key] = (op, op.variant_tokens(case["T"]))

    def build(item):
        key, (op, tokens) = item
        gated = LAYERS[key[0]]["activation"] == "swiglu"
        try:
            return key, op._build((False, False, gated, False), tokens)
        except Exception as e:  # noqa: BLE001 - recorded per case
            return key, e

    with ThreadPoolExecutor(max_workers=workers) as pool:
        built = dict(pool.map(build, variants.items()))
    # (a build that failed beside others is tried once more alone)
    return {key: build((key, variants[key]))[1] if isinstance(main, Exception) else main
            for key, main in built.items()}


def pit_layer(main, inputs, case):
    """The op's VM function on device tensors (no host conversion in the timed call)."""
    from pit_tvm.runtime.loader import dlpack_to_tvm  # noqa: PLC0415

    T, d, E = case["T"], case["d"], case["E"]
    args = [dlpack_to_tvm(inputs["x"].view(1, T, d), "x"), dlpack_to_tvm(inputs["router"].view(1, T, E), "router"),
            dlpack_to_tvm(inputs["w1"], "w1"), dlpack_to_tvm(inputs["w2"], "w2")]
    if "w3" in inputs:
        args.append(dlpack_to_tvm(inputs["w3"], "w3"))
    torch = _torch()
    return lambda: torch.from_dlpack(main(*args))


def kernel_device_ms(fn) -> tuple[float | None, dict]:
    """(sum of the kernels' device time a call, ms; per kernel µs) from torch.profiler."""
    from common import kernel_split_us  # noqa: PLC0415

    split = kernel_split_us(fn, iters=5)
    return (sum(split.values()) / 1e3 if split else None), split


# ---------------------------------------------------------------------------------- the run
def run_case(case, main, rates, cfg) -> list[dict]:
    torch = _torch()
    rows = []
    inputs = make_inputs(case, cfg.seed)
    ref = reference(inputs, case)
    ids, _ = torch_route(inputs["router"], case)
    active = int(torch.unique(ids).numel())
    roof, weight_floor = roofline_ms(case, active, *rates)
    base = {k: case[k] for k in ("layer", "E", "T", "d", "f", "top_k", "activation", "dtype")}
    base.update(case=case["name"], routing="zipf" if case["skew"] else "balanced", active_experts=active)

    def record(method, make, checked=True):
        row = dict(base, method=method, median_ms=None, max_row_rel_err=None, correct=None, error=None)
        t = time.perf_counter()
        try:
            fn, extra = make()
            out = fn()
            torch.cuda.synchronize()
            err = row_rel_err(out, ref)
            row.update(median_ms=cuda_ms(fn, cfg.repeat), max_row_rel_err=err, **extra)
            if checked:
                row["correct"] = bool(err <= TOLERANCE[case["dtype"]])
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            row.update(error=f"{type(e).__name__}: {e}"[:1500], traceback=traceback.format_exc()[-2000:])
        row["wall_s"] = time.perf_counter() - t
        rows.append(row)
        print(f"[{case['name']} {case['dtype']}] {method}: "
              + (f"{row['median_ms']:.3f} ms, row err {row['max_row_rel_err']:.1e}" if row["error"] is None
                 else row["error"].splitlines()[0][:200]) + f" ({row['wall_s']:.1f}s)", flush=True)
        return row

    def pit():
        if isinstance(main, Exception):
            raise main
        fn = pit_layer(main, inputs, case)
        device_ms, split = kernel_device_ms(fn)
        index_ms = sum(us for name, us in split.items() if "expert_index" in name) / 1e3
        return fn, {"pit_device_ms": device_ms, "kernels_us": split, "pit_index_ms": index_ms}

    record("pit", pit)
    layouts = {}

    def grouped_mm():
        layouts.update(grouped_mm_layouts(inputs))
        fn, captured = graphed(lambda: grouped_mm_layer(inputs, case, layouts))
        return fn, {"cuda_graph": captured}

    record("torch_grouped_mm", grouped_mm)
    if case["E"] <= LOOP_MAX_EXPERTS:
        record("torch_loop", lambda: (lambda: loop_layer(inputs, case), {"cuda_graph": False}))

    def bmm():
        fn, captured = graphed(lambda: bmm_layer(inputs, case))
        return fn, {"cuda_graph": captured}

    record("torch_bmm_cf1.25", bmm, checked=False)
    rows.append(dict(base, method="roofline", median_ms=roof, weight_floor_ms=weight_floor, max_row_rel_err=None,
                     correct=None, error=None))
    peer = next((r["median_ms"] for r in rows if r["method"] == "torch_grouped_mm" and r["median_ms"]), None)
    for r in rows:
        r["weight_floor_ms"] = weight_floor
        r["vs_grouped_mm"] = peer / r["median_ms"] if peer and r["median_ms"] else None
        r["vs_roofline"] = r["median_ms"] / roof if r["median_ms"] else None
    del inputs, ref
    torch.cuda.empty_cache()
    return rows


def plot(ax, rows):
    methods = ["pit", "torch_grouped_mm", "torch_loop", "torch_bmm_cf1.25", "roofline"]
    names = list(dict.fromkeys(f"{r['case']} {r['dtype'][:4]}" for r in rows))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        vals = {f"{r['case']} {r['dtype'][:4]}": r["median_ms"] for r in rows if r["method"] == m}
        ax.bar([j + i * width for j in range(len(names))], [vals.get(n) or 0 for n in names], width, label=m)
    ax.set_yscale("log")
    ax.set_xticks([j + 0.4 for j in range(len(names))])
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize=6)
    ax.set_ylabel("ms per layer call (log)")
    ax.legend(fontsize=6)


def _fmt(v, spec=".3f"):
    return "–" if v is None else format(v, spec)


def render_page(env: dict, rows: list[dict], json_rel: str = "results/moe.json") -> str:
    """The results page (markdown): measured numbers only, and the issue's targets checked."""
    lines = [f"# MoE layer: PIT vs grouped GEMM ({env['device']})", "",
             f"Generated by `benchmarks/moe.py` from [{json_rel}]({json_rel}) on {env['date']}: "
             f"`{env.get('command', 'python benchmarks/moe.py')}`; torch {env.get('torch', '?')}, "
             f"TVM {env.get('tvm', '?')}.  ms per layer call (median, CUDA events, every method paying its "
             f"routing); cuBLAS {_fmt(env.get('cublas_tflops'), '.0f')} TFLOP/s and copy "
             f"{_fmt(env.get('copy_gbps'), '.0f')} GB/s measured in the same run.  PIT device: the sum of its "
             f"kernels' device times; index: its expert-index kernels' device time (torch.profiler).", "",
             "| case | dtype | PIT | PIT device | index | grouped_mm | loop | bmm cf1.25 | roofline | weight floor "
             "| PIT vs grouped_mm | PIT / roofline | PIT row err |", "|" + "---|" * 13]
    by_case: dict = {}
    for r in rows:
        by_case.setdefault((r["case"], r["dtype"]), {})[r["method"]] = r
    for (name, dtype), ms in by_case.items():
        pit, peer = ms.get("pit", {}), ms.get("torch_grouped_mm", {})
        cells = [name, dtype, _fmt(pit.get("median_ms")), _fmt(pit.get("pit_device_ms")), _fmt(pit.get("pit_index_ms")),
                 _fmt(peer.get("median_ms")), _fmt(ms.get("torch_loop", {}).get("median_ms")),
                 _fmt(ms.get("torch_bmm_cf1.25", {}).get("median_ms")), _fmt(ms.get("roofline", {}).get("median_ms")),
                 _fmt(pit.get("weight_floor_ms")), _fmt(pit.get("vs_grouped_mm"), ".2f") + "x",
                 _fmt(pit.get("vs_roofline"), ".2f"), _fmt(pit.get("max_row_rel_err"), ".1e")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Targets (issue 35)", ""]
    for (name, dtype), ms in by_case.items():
        pit = ms.get("pit", {})
        if not pit.get("median_ms"):
            lines.append(f"- {name} {dtype}: PIT did not run ({(pit.get('error') or '?').splitlines()[0][:120]})")
            continue
        checks = []
        first = next(iter(ms.values()))
        if first["T"] >= 32 * first["E"]:
            checks.append(f">= 2x grouped_mm: {_met((pit.get('vs_grouped_mm') or 0) >= 2)}")
            checks.append(f"<= 1.5x roofline: {_met((pit.get('vs_roofline') or 1e9) <= 1.5)}")
        if first["T"] <= 256:
            ratio = pit["median_ms"] / pit["weight_floor_ms"] if pit.get("weight_floor_ms") else None
            checks.append(f"<= 1.3x weight floor ({_fmt(ratio, '.2f')}x): {_met(ratio is not None and ratio <= 1.3)}")
        if pit.get("pit_index_ms"):
            share = pit["pit_index_ms"] / pit["median_ms"]
            checks.append(f"index <= 5 % ({share:.1%}): {_met(share <= 0.05)}")
        checks.append(f"correct: {_met(bool(pit.get('correct')))}")
        lines.append(f"- {name} {dtype}: " + "; ".join(checks))
    skew_pairs = [(k, v) for k, v in by_case.items() if k[0].endswith(" zipf")]
    for (name, dtype), ms in skew_pairs:
        bal = by_case.get((name[: -len(" zipf")], dtype), {}).get("pit", {})
        if bal.get("median_ms") and ms.get("pit", {}).get("median_ms"):
            ratio = ms["pit"]["median_ms"] / bal["median_ms"]
            lines.append(f"- {name} {dtype}: skewed within 1.3x of balanced ({ratio:.2f}x): {_met(ratio <= 1.3)}")
    return "\n".join(lines) + "\n"


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="the issue's whole grid, bf16 and fp16")
    p.add_argument("--dtypes", help="comma list (default: bfloat16; --full: bfloat16,float16)")
    p.add_argument("--only", help="only the cases whose name contains this")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument("--tuning-log", help="the grouped GEMMs' tiles from this `pit-tvm tune --op moe` log directory")
    args = p.parse_args(argv)
    args.dtypes = tuple(args.dtypes.split(",")) if args.dtypes else (
        ("bfloat16", "float16") if args.full else ("bfloat16",))
    return args


def main(argv=None):
    cfg = parse_args(argv)
    todo = [c for c in cases(cfg.full, cfg.dtypes) if not cfg.only or cfg.only in c["name"]]
    if cfg.list:
        for c in todo:
            print(c["name"], c["dtype"])
        return None
    torch = _torch()
    t0 = time.perf_counter()
    mains = build_pit_ops(todo, tuning_log=cfg.tuning_log)
    print(f"built {len(mains)} PIT ops in {time.perf_counter() - t0:.1f}s", flush=True)
    rates = measure_rates()
    print(f"cuBLAS {rates[0]:.0f} TFLOP/s, copy {rates[1]:.0f} GB/s", flush=True)
    rows = []
    for case in todo:
        rows.extend(run_case(case, mains[pit_op_key(case, cfg.tuning_log)], rates, cfg))
    env = environment(torch.cuda.get_device_name(0))
    env.update(cublas_tflops=rates[0], copy_gbps=rates[1], config=vars(cfg), total_wall_s=time.perf_counter() - t0,
               command="python benchmarks/moe.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print()
    print_table([{c: r.get(c) if r.get(c) is not None else "-" for c in TABLE} for r in rows], TABLE)
    paths = write_results("moe", env, rows, plot)
    page = os.path.join(os.environ.get("OUT") or os.path.dirname(RESULTS_DIR), "moe.md")
    with open(page, "w") as f:
        f.write(render_page(env, rows))
    print("written:", *paths, page)
    wrong = [f"{r['case']} {r['dtype']} {r['method']}" for r in rows if r.get("correct") is False]
    if wrong:
        raise SystemExit(f"outputs differ from the fp32 reference beyond tolerance: {', '.join(wrong)}")
    return env, rows


if __name__ == "__main__":
    main()
