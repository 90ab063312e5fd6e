"""Model-level benchmark: PIT vs the same TVM build with PIT off, vs PyTorch / onnxruntime.

    python benchmarks/models.py --device cuda      # H100: fp16 TVM builds, torch eager + varlen
    python benchmarks/models.py --device cpu       # small sizes: fp32 TVM builds, onnxruntime

Sizes: cuda uses the full ones below; cpu defaults to FFN d=512, hidden 2048, tokens 4x64 and a
4-layer, 256-wide, 4-head encoder at batch 16, seq 64, lengths in [8, 64] (every size is a flag).

Workloads (pit_tvm/testing.py, weights generated in code, seeded):

* ``opt_ffn``: ``y = x + fc2(relu(fc1(LN(x))))``, d=2048, hidden 8192, ~90% of fc2's input
  *elements* zero; tokens ``--ffn-batch x --ffn-seq`` (32x128 on cuda). The auto annotation's
  (1, 64) micro-tiles are nearly all non-empty (occupancy ~1.0: PIT falls back to dense), so
  ``--ffn-tiles`` (default 8x1) adds PIT rows with an explicit finer micro-tile for ``hidden``.
* ``bert``: BERT-base-style post-LN encoder (12 layers, 768, 12 heads) at batch 32, seq 128,
  lengths uniform in [16, 128] (seeded); padding is the dynamic sparsity.

Methods (each in its own try/except: a failure becomes a row with ``error``, never fatal):

* ``tvm_pit``: ``compile_onnx(model, target)`` (auto annotations, PIT lowering).
* ``tvm_pit_off``: ``compile_onnx(model, target, auto=False)``: no annotations, so the same
  dense kernels (the PIT kernels' dense twin for the 2-D-weight matmuls, ``DenseMatmulToPITKernels``;
  TVM's defaults for the rest: dlight on CUDA, LegalizeOps' unscheduled loops on llvm).
* cuda: ``torch_eager`` fp16 (cuBLAS, SDPA with the additive mask) on the padded batch, the same
  weights read from the ONNX initializers; ``torch_varlen`` (bert): non-padded tokens only, packed
  from the mask every call, attention through ``torch.nn.attention.varlen.varlen_attn`` (falls
  back to nested-jagged SDPA; the row's ``impl`` says which).
* cpu: ``onnxruntime`` (CPUExecutionProvider, fp32).

Every output is checked once against onnxruntime (CPU, fp32 model): ``max_abs_err`` and
``max_rel_err`` = max|out - ref| / max|ref| (bert: non-padded positions only). ``occupancy`` is the
measured fraction of non-zero micro-tiles of each PIT-lowered matmul's sparse operand (from the
onnxruntime activations on the actual inputs, with the annotation's micro-tile); it is repeated
beside every row of the workload. ``speedup_vs_pit_off`` = t(tvm_pit_off) / t(method).
Timings: median ms of ``--repeat`` calls, inputs already on the device, synchronised per call.
Writes models_<device>.json/.png under docs/results/ (or $OUT).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, time_compiled, write_results  # noqa: E402
from pit_tvm.testing import (bert_encoder, bert_inputs, opt_ffn, opt_ffn_inputs, to_float16,  # noqa: E402
                       with_outputs)

DEFAULTS = {
    "cuda": dict(dtype="float16", ffn_d=2048, ffn_hidden=8192, ffn_batch=32, ffn_seq=128,
                 layers=12, hidden=768, heads=12, batch=32, seq=128, min_len=16, repeat=20, warmup=3),
    "cpu": dict(dtype="float32", ffn_d=512, ffn_hidden=2048, ffn_batch=4, ffn_seq=64,
                layers=4, hidden=256, heads=4, batch=16, seq=64, min_len=8, repeat=5, warmup=1),
}
TOLERANCE = {"float32": 1e-3, "float16": 2e-2}  # on max_rel_err (normalised by max|ref|)
TABLE = ["workload", "method", "dtype", "median_ms", "speedup_vs_pit_off", "occupancy_mean",
         "max_rel_err", "correct"]


# ----------------------------------------------------------------------------- workloads

def make_workloads(cfg, names=("ffn", "bert")) -> list[dict]:
    """``[{name, model (fp32 ONNX), inputs (fp32 numpy), valid (bool mask over output rows), shape,
    expected_density (for compile_onnx; None: its default)}]``."""
    out = []
    if "ffn" in names:
        d, h = cfg.ffn_d, cfg.ffn_hidden
        out.append({"name": "opt_ffn", "model": opt_ffn(d, h),
                    "inputs": opt_ffn_inputs(d, batch=cfg.ffn_batch, seq=cfg.ffn_seq, seed=1),
                    "valid": None, "expected_density": None,
                    "shape": f"d={d} hidden={h} tokens={cfg.ffn_batch}x{cfg.ffn_seq}"})
    if "bert" in names:
        rng = np.random.default_rng(cfg.seed)
        lengths = rng.integers(cfg.min_len, cfg.seq + 1, size=cfg.batch)
        inputs = bert_inputs(cfg.hidden, batch=cfg.batch, seq=cfg.seq, lengths=lengths, seed=cfg.seed + 1)
        # the PIT build plans its tile widths for the real-token fraction of another batch of
        # the same distribution (what a user measures on a sample of their traffic)
        sample = rng.integers(cfg.min_len, cfg.seq + 1, size=cfg.batch)
        out.append({"name": "bert", "model": bert_encoder(cfg.layers, cfg.hidden, cfg.heads),
                    "inputs": inputs, "valid": inputs["attention_mask"].astype(bool),
                    "expected_density": round(float(sample.mean()) / cfg.seq, 3),
                    "shape": (f"layers={cfg.layers} hidden={cfg.hidden} heads={cfg.heads} batch={cfg.batch} "
                              f"seq={cfg.seq} lengths~U[{cfg.min_len},{cfg.seq}] "
                              f"real_tokens={float(inputs['attention_mask'].mean()):.3f}")})
    return out


def cast_inputs(inputs: dict, dtype: str) -> dict:
    return {k: (v.astype(dtype) if v.dtype == np.float32 else v) for k, v in inputs.items()}


def initializers(model) -> dict:
    from onnx import numpy_helper  # noqa: PLC0415

    return {t.name: numpy_helper.to_array(t).copy() for t in model.graph.initializer}


# ----------------------------------------------------------------------------- checks

def ort_session(model, threads=None):
    import onnxruntime as ort  # noqa: PLC0415

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def errors(out, ref, valid=None) -> dict:
    out = np.asarray(out, dtype=np.float32)
    ref = np.asarray(ref, dtype=np.float32)
    if valid is not None:
        out, ref = out[valid], ref[valid]
    diff = np.abs(out - ref)
    finite = bool(np.isfinite(out).all())
    abs_err = float(diff.max()) if finite else float("inf")
    return {"max_abs_err": abs_err, "max_rel_err": abs_err / max(float(np.abs(ref).max()), 1e-12)}


def tile_occupancy(act, micro_tile) -> float:
    """Fraction of ``micro_tile`` tiles of ``act`` (flattened to [M, K]) holding a non-zero."""
    a = np.asarray(act)
    a = a.reshape(-1, a.shape[-1]) != 0
    m, k = a.shape
    mr, mk = int(micro_tile[0]), min(int(micro_tile[1]), k)
    pm, pk = -(-m // mr) * mr, -(-k // mk) * mk
    if (pm, pk) != (m, k):
        a = np.pad(a, ((0, pm - m), (0, pk - k)))
    tiles = a.reshape(pm // mr, mr, pk // mk, mk).any(axis=(1, 3))
    return float(tiles.mean())


def occupancies(model, inputs, annotations) -> dict:
    """``{tensor: occupancy}`` for each PIT-lowered matmul's sparse operand (on these inputs)."""
    pit = [a for a in annotations if a.get("status") == "pit"]
    names = list(dict.fromkeys(a["tensor"] for a in pit))
    if not names:
        return {}
    tiles = {a["tensor"]: a["micro_tile"] for a in pit}
    sess = ort_session(with_outputs(model, names))
    acts = sess.run(names, inputs)
    return {n: tile_occupancy(v, tiles[n]) for n, v in zip(names, acts)}


# ----------------------------------------------------------------------------- torch peers

def torch_ffn(model, dtype, device):
    """Eager torch equivalent of :func:`pit_tvm.testing.opt_ffn` (same weights)."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    w = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device=device, dtype=dtype)
         for k, v in initializers(model).items()}
    fc1_t, fc2_t = w["fc1.weight"].t().contiguous(), w["fc2.weight"].t().contiguous()
    d = fc2_t.shape[0]

    @torch.inference_mode()
    def fwd(x):
        ln = F.layer_norm(x, (d,), w["final_layer_norm.gamma"], w["final_layer_norm.beta"], 1e-5)
        h = torch.relu(F.linear(ln, fc1_t, w["fc1.bias"]))
        return x + F.linear(h, fc2_t, w["fc2.bias"])

    return fwd


def _bert_weights(model, layers, dtype, device):
    import torch  # noqa: PLC0415

    init = initializers(model)
    ws = []
    for i in range(layers):
        p = f"l{i}"
        t = {k: torch.from_numpy(np.ascontiguousarray(init[f"{p}.{k}"])).to(device=device, dtype=dtype)
             for k in ("q.b", "k.b", "v.b", "o.b", "fc1.b", "fc2.b", "ln1.gamma", "ln1.beta",
                       "ln2.gamma", "ln2.beta")}
        qkv = np.concatenate([init[f"{p}.q.w"], init[f"{p}.k.w"], init[f"{p}.v.w"]], axis=1)
        t["qkv.w"] = torch.from_numpy(np.ascontiguousarray(qkv.T)).to(device=device, dtype=dtype)
        t["qkv.b"] = torch.cat([t["q.b"], t["k.b"], t["v.b"]])
        for k in ("o", "fc1", "fc2"):
            t[f"{k}.w"] = torch.from_numpy(np.ascontiguousarray(init[f"{p}.{k}.w"].T)).to(device=device, dtype=dtype)
        ws.append(t)
    return ws


def _bert_layer_tail(t, h, ctx, F):
    hidden = h.shape[-1]
    h1 = F.layer_norm(h + F.linear(ctx, t["o.w"], t["o.b"]), (hidden,), t["ln1.gamma"], t["ln1.beta"], 1e-5)
    f = F.gelu(F.linear(h1, t["fc1.w"], t["fc1.b"]))  # erf GELU, as the ONNX graph
    return F.layer_norm(h1 + F.linear(f, t["fc2.w"], t["fc2.b"]), (hidden,), t["ln2.gamma"], t["ln2.beta"], 1e-5)


def torch_bert_padded(model, layers, heads, dtype, device):
    """Eager torch BERT encoder on the padded batch: fused QKV linear, SDPA with the additive mask.

    The ONNX graph's row masks only change padded positions (don't-care), so they are left out."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    ws = _bert_weights(model, layers, dtype, device)

    @torch.inference_mode()
    def fwd(x, mask):
        b, s, hidden = x.shape
        dh = hidden // heads
        add_mask = ((1.0 - mask.to(x.dtype)) * -10000.0)[:, None, None, :]
        h = x
        for t in ws:
            qkv = F.linear(h, t["qkv.w"], t["qkv.b"]).view(b, s, 3, heads, dh).permute(2, 0, 3, 1, 4)
            ctx = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=add_mask)
            h = _bert_layer_tail(t, h, ctx.transpose(1, 2).reshape(b, s, hidden), F)
        return h

    return fwd


def _attn_varlen(q, k, v, cu, max_len):
    from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415

    return varlen_attn(q, k, v, cu, cu, max_len, max_len)  # non-causal by default


def _attn_nested(q, k, v, cu, max_len):
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    offsets = cu.to(torch.int64)
    nq, nk, nv = (torch.nested.nested_tensor_from_jagged(t.contiguous(), offsets).transpose(1, 2)
                  for t in (q, k, v))
    return F.scaled_dot_product_attention(nq, nk, nv).transpose(1, 2).values()


def _attn_per_sequence(q, k, v, cu, max_len):
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    bounds = cu.tolist()
    outs = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
            for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs)


# tried in order; the first that runs is kept for the rest of the run (q, k, v: [tokens, heads, dh])
VARLEN_ATTENTION = [("varlen_attn", _attn_varlen), ("nested_sdpa", _attn_nested),
                    ("per_sequence_sdpa", _attn_per_sequence)]


def torch_bert_varlen(model, layers, heads, dtype, device):
    """Eager torch BERT on the non-padded tokens only: pack from the mask (every call), varlen
    attention (the first of :data:`VARLEN_ATTENTION` that runs), scatter back to [B, S, H].
    Returns ``(fwd, impl)`` where ``impl()`` names the attention used."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    ws = _bert_weights(model, layers, dtype, device)
    state = {"impl": None, "tried": []}

    def attention(q, k, v, cu, max_len):
        if state["impl"] is not None:
            return dict(VARLEN_ATTENTION)[state["impl"]](q, k, v, cu, max_len)
        for name, fn in VARLEN_ATTENTION:
            try:
                out = fn(q, k, v, cu, max_len)
            except Exception as e:  # noqa: BLE001 - not available here: try the next
                state["tried"].append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
                continue
            state["impl"] = name
            return out
        raise RuntimeError("no varlen attention ran: " + " | ".join(state["tried"]))

    @torch.inference_mode()
    def fwd(x, mask):
        b, s, hidden = x.shape
        dh = hidden // heads
        idx = mask.reshape(-1).bool().nonzero().squeeze(1)  # host sync, as any packing needs
        lens = mask.sum(1, dtype=torch.int32)
        cu = torch.zeros(b + 1, dtype=torch.int32, device=x.device)
        cu[1:] = torch.cumsum(lens, 0)
        max_len = int(lens.max())
        h = x.reshape(b * s, hidden).index_select(0, idx)
        for t in ws:
            q, k, v = F.linear(h, t["qkv.w"], t["qkv.b"]).view(-1, 3, heads, dh).unbind(1)
            h = _bert_layer_tail(t, h, attention(q, k, v, cu, max_len).reshape(-1, hidden), F)
        out = torch.zeros(b * s, hidden, dtype=h.dtype, device=h.device)
        out.index_copy_(0, idx, h)
        return out.view(b, s, hidden)

    return fwd, lambda: {"impl": state["impl"], "impl_failures": state["tried"]}


# ----------------------------------------------------------------------------- runner

class _HostDevice:
    def sync(self):
        pass


class _TorchDevice:
    def sync(self):
        import torch  # noqa: PLC0415

        torch.cuda.synchronize()


def _tvm_method(wl, cfg, target, auto, model_t, inputs_t, sparse=None, on_compiled=None):
    from pit_tvm.compile import compile_onnx  # noqa: PLC0415

    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shapes = None if cfg.symbolic else {n: list(np.shape(v)) for n, v in inputs_t.items()}
        cm = compile_onnx(model_t, target, sparse=sparse, auto=auto, shapes=shapes,
                          cuda_graph=cfg.cuda_graph and target == "cuda",
                          expected_density=wl.get("expected_density") if auto else None)
    compile_s = time.perf_counter() - t0
    if on_compiled is not None:
        on_compiled(cm)
    ms, out = time_compiled(cm, inputs_t, cfg.repeat, cfg.warmup)
    extra = {"compile_s": compile_s,
             "pit_matmuls": sum(a.get("status") == "pit" for a in cm.annotations),
             "expected_density": wl.get("expected_density") if auto else None,
             "warnings": sorted({str(w.message)[:300] for w in caught})[:5]}
    return ms, out, extra, cm


def _row(wl, method, dtype, device, **kw):
    r = {"workload": wl["name"], "method": method, "dtype": dtype, "device": device, "shape": wl["shape"],
         "median_ms": None, "speedup_vs_pit_off": None, "occupancy_mean": None, "occupancy": {},
         "max_abs_err": None, "max_rel_err": None, "correct": None, "error": None}
    r.update(kw)
    return r


def run_workload(wl, cfg, device: str) -> list[dict]:
    """All methods on one workload; every method in its own try/except."""
    dtype = cfg.dtype
    target = "cuda" if device == "cuda" else "llvm"
    model, inputs, valid = wl["model"], wl["inputs"], wl["valid"]
    model_t = to_float16(model) if dtype == "float16" else model
    inputs_t = cast_inputs(inputs, dtype)
    rows = []

    t0 = time.perf_counter()
    ref = ort_session(model).run(None, inputs)[0]  # the reference, fp32 on the CPU
    print(f"[{wl['name']}] onnxruntime reference {time.perf_counter() - t0:.1f}s", flush=True)

    def record(method, fn, row_dtype=dtype):
        t = time.perf_counter()
        try:
            ms, out, extra = fn()
            err = errors(out, ref, valid)
            row = _row(wl, method, row_dtype, device, median_ms=ms, **err,
                       correct=bool(err["max_rel_err"] <= TOLERANCE[row_dtype]), **extra)
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            row = _row(wl, method, row_dtype, device, error=f"{type(e).__name__}: {e}"[:2000],
                       traceback=traceback.format_exc()[-3000:])
        row["wall_s"] = time.perf_counter() - t
        rows.append(row)
        print(f"[{wl['name']}] {method}: "
              + (f"{row['median_ms']:.3f} ms, rel err {row['max_rel_err']:.2e}" if row["error"] is None
                 else row["error"].splitlines()[0][:300]) + f" ({row['wall_s']:.1f}s)", flush=True)
        return row

    occ_of = {}  # method -> {tensor: occupancy}

    def pit(method, sparse=None):
        def compiled(cm):  # occupancy even when running the build fails
            try:
                occ_of[method] = occupancies(model, inputs, cm.annotations)
            except Exception as e:  # noqa: BLE001
                print(f"[{wl['name']}] occupancy failed: {e}", flush=True)

        def fn():
            ms, out, extra, cm = _tvm_method(wl, cfg, target, True, model_t, inputs_t, sparse, compiled)
            extra["micro_tiles"] = sorted({"x".join(map(str, a["micro_tile"])) for a in cm.annotations
                                           if a.get("status") == "pit"})
            return ms, out, extra
        return fn

    record("tvm_pit", pit("tvm_pit"))
    if wl["name"] == "opt_ffn":
        for tile in cfg.ffn_tiles:
            mt = tuple(int(x) for x in tile.lower().split("x"))
            record(f"tvm_pit_{tile}", pit(f"tvm_pit_{tile}", {"hidden": mt}))
    record("tvm_pit_off", lambda: _tvm_method(wl, cfg, target, False, model_t, inputs_t)[:3])

    if device == "cpu":
        def onnxrt():
            from pit_tvm.timing import median_ms  # noqa: PLC0415

            sess = ort_session(model)
            out = sess.run(None, inputs)[0]
            return median_ms(lambda: sess.run(None, inputs), _HostDevice(), cfg.repeat, cfg.warmup), out, {}

        record("onnxruntime", onnxrt, "float32")
    else:
        record("torch_eager", lambda: _torch_method(wl, cfg, dtype, padded=True))
        if wl["name"] == "bert":
            record("torch_varlen", lambda: _torch_method(wl, cfg, dtype, padded=False))

    base = next((r["median_ms"] for r in rows if r["method"] == "tvm_pit_off" and r["median_ms"]), None)
    occ = occ_of.get("tvm_pit", {})
    for r in rows:
        r["occupancy"] = occ_of.get(r["method"], occ)
        occ_r = r["occupancy"]
        r["occupancy_mean"] = float(np.mean(list(occ_r.values()))) if occ_r else None
        if base and r["median_ms"]:
            r["speedup_vs_pit_off"] = base / r["median_ms"]
    return rows


def _torch_method(wl, cfg, dtype, padded: bool, dev="cuda"):
    import torch  # noqa: PLC0415

    from pit_tvm.timing import median_ms  # noqa: PLC0415

    tdt = getattr(torch, dtype)
    model, inputs = wl["model"], wl["inputs"]
    extra = {}
    if wl["name"] == "opt_ffn":
        fwd = torch_ffn(model, tdt, dev)
        x = torch.from_numpy(inputs["x"]).to(dev, tdt)
        call = lambda: fwd(x)  # noqa: E731
    else:
        x = torch.from_numpy(inputs["input_embeds"]).to(dev, tdt)
        mask = torch.from_numpy(inputs["attention_mask"]).to(dev)
        if padded:
            fwd = torch_bert_padded(model, cfg.layers, cfg.heads, tdt, dev)
        else:
            fwd, impl = torch_bert_varlen(model, cfg.layers, cfg.heads, tdt, dev)
        call = lambda: fwd(x, mask)  # noqa: E731
    out = call().float().cpu().numpy()
    if wl["name"] == "bert" and not padded:
        extra.update(impl())
    ms = median_ms(call, _TorchDevice() if dev == "cuda" else _HostDevice(), cfg.repeat, cfg.warmup)
    return ms, out, extra


def run(device: str, cfg, names=("ffn", "bert")) -> tuple[dict, list[dict]]:
    """Run every workload in ``names``; returns ``(environment, rows)``."""
    rows = []
    for wl in make_workloads(cfg, names):
        try:
            rows.extend(run_workload(wl, cfg, device))
        except Exception as e:  # noqa: BLE001 - e.g. the reference itself failed
            rows.append(_row(wl, "all", cfg.dtype, device, error=f"{type(e).__name__}: {e}"[:2000]))
    if device == "cuda":
        try:
            import torch  # noqa: PLC0415

            name = torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001
            name = "cuda"
    else:
        name = f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"
    env = environment(name)
    env["config"] = {k: v for k, v in vars(cfg).items()}
    env["notes"] = ("TVM rows: dtype as given (ONNX converted with pit_tvm.testing.to_float16 for float16). "
                    "References: onnxruntime CPU on the fp32 model; bert errors over non-padded positions. "
                    "occupancy: non-zero micro-tile fraction of each PIT matmul's sparse operand. "
                    "Both TVM builds run their 2-D-weight matmuls on the PIT kernels' dense twin "
                    "(DenseMatmulToPITKernels); on llvm the other operators (attention's batched matmuls, "
                    "softmax, layer norm) are LegalizeOps' unscheduled loops (no dlight rules on CPU).")
    return env, rows


def plot(ax, rows):
    rs = [r for r in rows if r.get("median_ms")]
    labels = [f"{r['workload']}\n{r['method']}" for r in rs]
    vals = [r["speedup_vs_pit_off"] or 0.0 for r in rs]
    colors = ["tab:gray" if r["method"] == "tvm_pit_off" else "tab:green" if r["method"].startswith("tvm_pit")
              else "tab:blue" for r in rs]
    bars = ax.bar(range(len(rs)), vals, color=colors)
    for b, r in zip(bars, rs):
        occ = r.get("occupancy_mean")
        txt = f"{r['median_ms']:.2f} ms" + (f"\nocc {occ:.2f}" if occ is not None else "")
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), txt, ha="center", va="bottom", fontsize=6)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(rs)))
    ax.set_xticklabels(labels, fontsize=6)
    ax.set_yscale("log")
    ax.set_ylabel("speedup over TVM with PIT off (higher is better)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--workloads", default="ffn,bert", help="comma list of ffn, bert")
    p.add_argument("--dtype", choices=["float16", "float32"], help="TVM/torch dtype (cuda: float16, cpu: float32)")
    for k in ("ffn_d", "ffn_hidden", "ffn_batch", "ffn_seq", "layers", "hidden", "heads", "batch", "seq",
              "min_len", "repeat", "warmup"):
        p.add_argument("--" + k.replace("_", "-"), type=int, dest=k)
    p.add_argument("--ffn-tiles", default="8x1",
                   help="extra opt_ffn PIT rows with an explicit micro-tile for 'hidden' (comma list, '' for none)")
    p.add_argument("--symbolic", action="store_true",
                   help="keep the ONNX batch/sequence dims symbolic (default: compile for the benchmark's "
                        "padded input shapes, as a deployment with a fixed maximum batch would)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="build the TVM models (both builds) with CUDA graphs (static shapes only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", help="results name (default models_<device>)")
    args = p.parse_args(argv)
    args.ffn_tiles = [t.strip() for t in args.ffn_tiles.split(",") if t.strip()]
    for k, v in DEFAULTS[args.device].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None):
    cfg = parse_args(argv)
    t0 = time.perf_counter()
    names = tuple(w.strip() for w in cfg.workloads.split(",") if w.strip())
    env, rows = run(cfg.device, cfg, names)
    env["total_wall_s"] = time.perf_counter() - t0
    print()
    print_table(rows, TABLE)
    for r in rows:
        if r.get("error"):
            print(f"ERROR {r['workload']}/{r['method']}: {r['error'][:500]}")
    paths = write_results(cfg.name or f"models_{cfg.device}", env, rows, plot)
    print("written:", *paths, f"(total {env['total_wall_s']:.0f}s)")
    return env, rows


def wrong_outputs(rows) -> list[str]:
    """``workload/method`` of every row whose outputs missed the reference's tolerance"""
    return [f"{r['workload']}/{r['method']}" for r in rows if r.get("correct") is False]


if __name__ == "__main__":
    wrong = wrong_outputs(main()[1])
    if wrong:     # the results are written (to look at), but a run with wrong outputs fails
        raise SystemExit(f"outputs differ from the reference beyond tolerance: {', '.join(wrong)}")
