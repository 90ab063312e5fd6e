"""Real `transformers` exports: PIT (padding propagated) vs the same build without PIT vs PyTorch.

    python benchmarks/real_models.py --device cuda   # GPU box: fp16, batch 32 x 128, lengths in [16, 128]
    python benchmarks/real_models.py --device cpu    # this machine: fp32 MiniLM, 16 x 128, lengths in [8, 128]

Each model is built from its architecture's config with random weights (seeded; no weights are
downloaded): BERT-base and all-MiniLM-L6-v2 as ``BertModel``, switch-base-8 as
``SwitchTransformersEncoderModel`` (exported with the static expert loop that ``compile_onnx``
lowers to its MoE op; the peers run transformers' own loop). Each is exported by
``torch.onnx.export`` (TorchScript exporter, opset 17) and compiled with
``compile_onnx(..., shapes=)`` for the padded batch (the MoE layers become the MoE op in both
TVM builds):

* ``tvm_pit``: ``padding="attention_mask"`` -- the token-wise matmuls list the real tokens only
  (``PropagatePadding``), plus the automatic annotations; with ``--expected-density sample`` it
  gets another batch drawn the same way as ``sample_inputs`` (the tile widths are planned for
  that batch's real-token fraction), else compile_onnx's default density;
* ``tvm_pit_off``: ``auto=False`` and no ``padding=``: the same dense kernels, no PIT.

On cuda the TVM builds read a float16 export: switch-base-8's half model exported as it is (its
router and RMS norms keep transformers' explicit float32 upcasts, which the fp32 graph cannot show),
the BERT-family fp32 export converted by ``pit_tvm.testing.to_float16`` (the TorchScript exporter
writes a half BERT's SDPA in float32 and its LayerNormalization with mixed types, an invalid graph);
both TVM builds are CUDA graphs (``cuda_graph=True``), and the peers are the ``transformers`` model itself (SDPA
attention) eager, ``torch.compile`` and ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), on the
padded batch. On cpu the peer is onnxruntime (CPUExecutionProvider) on the fp32 export.

Every output is checked against the fp32 PyTorch model on the real (non-padded) tokens:
``max_rel_err`` = max|out - ref| / max|ref| over those positions. An MoE model is checked by the
fraction of real tokens within the tolerance (``tokens_within_tol``): at least 99 %, or in float16 at
least the fraction of the ``transformers`` model's own float16 eager run (a near-tie top-1 takes
the other expert in float16, and expert capacity turns one flip into others). Timings: median ms of ``--repeat``
calls, inputs on the device, synchronised per call (``pit_tvm.timing.median_ms``).
Writes ``docs/results/real_models_<device>.json`` / ``.png`` (under ``$OUT`` when set).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, time_compiled, write_results  # noqa: E402

# Architectures by their published configs: (model family, config fields); random weights.
ARCHITECTURES = {
    "bert-base": ("bert", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)),
    "minilm-l6": ("bert", dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)),
    # google/switch-base-8's encoder: every other layer's MLP is 8 experts, top-1, capacity 64 a sequence
    "switch-base-8": ("switch", dict(d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_sparse_encoder_layers=6,
                                     num_heads=12, num_experts=8, expert_capacity=64)),
}
DEFAULTS = {
    "cuda": dict(models="bert-base,minilm-l6,switch-base-8", dtype="float16", batch=32, seq=128, min_len=16,
                 repeat=50, warmup=5),
    "cpu": dict(models="minilm-l6", dtype="float32", batch=16, seq=128, min_len=8, repeat=5, warmup=1),
}
TOLERANCE = {"float32": 1e-4, "float16": 5e-3}
#: an MoE model is correct when this fraction of its real tokens is within the tolerance (in float16:
#: or PyTorch's own float16 fraction, where lower)
MOE_TOKENS_WITHIN = 0.99
TABLE = ["model", "method", "dtype", "median_ms", "speedup_vs_pit_off", "speedup_vs_best_peer", "tokens_within_tol",
         "pit_matmuls", "max_rel_err", "correct"]


def build_model(arch: str, seed: int):
    """The ``transformers`` model of ``arch``'s config with seeded random weights (eval mode):
    a ``BertModel`` (SDPA attention) or a ``SwitchTransformersEncoderModel``."""
    import torch  # noqa: PLC0415
    import transformers as tf  # noqa: PLC0415

    family, fields = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    if family == "switch":
        return tf.SwitchTransformersEncoderModel(tf.SwitchTransformersConfig(vocab_size=32128, **fields)).eval()
    cfg = tf.BertConfig(vocab_size=30522, max_position_embeddings=512, attn_implementation="sdpa", **fields)
    return tf.BertModel(cfg, add_pooling_layer=False).eval()


def switch_expert_loop(loop: str) -> None:
    """transformers' SwitchTransformers expert loop: ``"static"`` for the export (HF's own loop
    runs over the experts the traced example hits, which the tracer unrolls into a graph wrong for
    other inputs; scripts/export_moe_fixtures.py), ``"traced"`` (HF's, restored) for the peers"""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    from export_moe_fixtures import patch_switch_experts  # noqa: PLC0415

    patch_switch_experts(loop)


def padded_batch(batch: int, seq: int, min_len: int, seed: int) -> dict:
    """``input_ids`` and a right-padded ``attention_mask`` of lengths uniform in [min_len, seq]."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, seq + 1, size=batch)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    ids = rng.integers(1, 30000, size=(batch, seq)).astype(np.int64) * mask
    return {"input_ids": ids, "attention_mask": mask}


def export(model, inputs: dict, path: str, device: str):
    import torch  # noqa: PLC0415

    class LastHiddenState(torch.nn.Module):   # (input_ids, attention_mask) by keyword, as a user calls it
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    args = tuple(torch.from_numpy(inputs[n]).to(device) for n in ("input_ids", "attention_mask"))
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
            "last_hidden_state": {0: "batch", 1: "sequence"}}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # (eval: the exporter restores the wrapper's mode on the model, train for a new Module)
        torch.onnx.export(LastHiddenState().eval(), args, path, input_names=["input_ids", "attention_mask"],
                          output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=17,
                          dynamo=False)


def errors(out, ref, valid, tolerance: float) -> dict:
    """max abs / rel error over the real tokens, and the fraction of real tokens whose own
    max error is within ``tolerance`` of the output's scale (an MoE model's check: a token whose
    top-1 expert is a near tie may take the other expert in fp16, a discontinuity, not an error)"""
    out = np.asarray(out, np.float32)[valid]
    ref = np.asarray(ref, np.float32)[valid]
    scale = max(np.abs(ref).max(), 1e-30)
    per_token = np.abs(out - ref).max(axis=-1) / scale
    return {"max_abs_err": float(np.abs(out - ref).max()), "max_rel_err": float(per_token.max()),
            "tokens_within_tol": float((per_token <= tolerance).mean())}


class TorchCuda:
    """``pit_tvm.timing.median_ms``'s device: synchronises torch's CUDA stream"""

    def sync(self):
        import torch  # noqa: PLC0415

        torch.cuda.synchronize()


class _Host:
    def sync(self):
        pass


def sample_batch(cfg) -> dict | None:
    """``--expected-density sample``: a batch drawn like the timed one with another seed (what a
    user knows of their traffic), given to compile_onnx as ``sample_inputs`` (it plans the padded
    rows' matmuls for its real-token fraction), else None (compile_onnx's default density)."""
    if cfg.expected_density != "sample":
        return None
    return padded_batch(cfg.batch, cfg.seq, cfg.min_len, cfg.seed + 1)


def tvm_method(path, inputs, target, cfg, pit: bool):
    """Compile the export with or without PIT; returns ``(ms, output, extra)``."""
    from pit_tvm.compile import compile_onnx  # noqa: PLC0415

    shapes = {n: list(v.shape) for n, v in inputs.items()}
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kw = dict(padding="attention_mask", sample_inputs=sample_batch(cfg)) if pit else dict(auto=False)
        cm = compile_onnx(path, target, shapes=shapes, cuda_graph=target == "cuda", **kw)
    compile_s = time.perf_counter() - t0
    ms, out = time_compiled(cm, inputs, cfg.repeat, cfg.warmup)
    statuses = [a.get("status") for a in cm.annotations]
    planned = [a["expected_density"] for a in cm.annotations if "expected_density" in a]
    return ms, out, {"compile_s": compile_s, "pit_matmuls": statuses.count("pit"),
                     "expected_density": planned[0] if planned else None,
                     "warnings": sorted({str(w.message)[:300] for w in caught})[:5]}


def torch_method(model, inputs, cfg, mode: str):
    """The ``transformers`` model on the padded batch: ``eager``, ``compile`` or ``reduce-overhead``."""
    import torch  # noqa: PLC0415

    from pit_tvm.timing import median_ms  # noqa: PLC0415

    ids = torch.from_numpy(inputs["input_ids"]).cuda()
    mask = torch.from_numpy(inputs["attention_mask"]).cuda()
    fwd = model
    if mode == "compile":
        fwd = torch.compile(model)
    elif mode == "reduce-overhead":
        fwd = torch.compile(model, mode="reduce-overhead")

    @torch.no_grad()
    def call():
        return fwd(input_ids=ids, attention_mask=mask).last_hidden_state

    out = call().float().cpu().numpy()
    return median_ms(call, TorchCuda(), cfg.repeat, cfg.warmup), out, {}


def onnxruntime_method(path, inputs, cfg):
    import onnxruntime as ort  # noqa: PLC0415

    from pit_tvm.timing import median_ms  # noqa: PLC0415

    opts = ort.SessionOptions()
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    out = sess.run(None, inputs)[0]
    return median_ms(lambda: sess.run(None, inputs), _Host(), cfg.repeat, cfg.warmup), out, {}


def run_model(arch: str, cfg, tmp: str) -> list[dict]:
    import torch  # noqa: PLC0415

    inputs = padded_batch(cfg.batch, cfg.seq, cfg.min_len, cfg.seed)
    valid = inputs["attention_mask"].astype(bool)
    model = build_model(arch, cfg.seed)
    with torch.no_grad():
        ref = model(**{k: torch.from_numpy(v) for k, v in inputs.items()}).last_hidden_state.numpy()
    rows, device = [], cfg.device
    path = os.path.join(tmp, f"{arch}.onnx")
    switch = ARCHITECTURES[arch][0] == "switch"
    if switch:
        switch_expert_loop("static")
    if device == "cuda" and switch:             # the half model, as a user exports float16
        model = model.half().cuda()
        path = os.path.join(tmp, f"{arch}_fp16.onnx")
    export(model, inputs, path, device if switch else "cpu")
    if switch:
        switch_expert_loop("traced")            # the peers run transformers' own code
    if device == "cuda" and not switch:         # the TVM builds read its float16 copy
        import onnx  # noqa: PLC0415

        from pit_tvm.testing import to_float16  # noqa: PLC0415

        path16 = os.path.join(tmp, f"{arch}_fp16.onnx")
        onnx.save(to_float16(onnx.load(path)), path16)
        path = path16
        model = model.half().cuda()
    shape = f"{cfg.batch}x{cfg.seq}, lengths [{cfg.min_len}, {cfg.seq}], real tokens {valid.mean():.3f}"

    def record(method, fn, dtype=cfg.dtype):
        t = time.perf_counter()
        row = {"model": arch, "method": method, "dtype": dtype, "shape": shape, "median_ms": None,
               "speedup_vs_pit_off": None, "speedup_vs_best_peer": None, "pit_matmuls": None,
               "max_rel_err": None, "correct": None, "error": None}
        try:
            ms, out, extra = fn()
            err = errors(out, ref, valid, TOLERANCE[dtype])
            row.update(median_ms=ms, **err, correct=bool(err["max_rel_err"] <= TOLERANCE[dtype]), **extra)
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            row.update(error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-3000:])
        row["wall_s"] = time.perf_counter() - t
        rows.append(row)
        print(f"[{arch}] {method}: " + (f"{row['median_ms']:.3f} ms, rel err {row['max_rel_err']:.2e}"
                                         if row["error"] is None else row["error"].splitlines()[0][:300])
              + f" ({row['wall_s']:.1f}s)", flush=True)

    target = "cuda" if device == "cuda" else "llvm"
    record("tvm_pit", lambda: tvm_method(path, inputs, target, cfg, pit=True))
    record("tvm_pit_off", lambda: tvm_method(path, inputs, target, cfg, pit=False))
    if device == "cuda":
        for mode in ("eager", "compile", "reduce-overhead"):
            record(f"torch_{mode}", lambda mode=mode: torch_method(model, inputs, cfg, mode))
    else:
        record("onnxruntime", lambda: onnxruntime_method(path, inputs, cfg), "float32")
    if switch:
        moe_token_check(rows)
    base = next((r["median_ms"] for r in rows if r["method"] == "tvm_pit_off" and r["median_ms"]), None)
    peers = [r["median_ms"] for r in rows if not r["method"].startswith("tvm") and r["median_ms"]]
    for r in rows:
        if r["median_ms"]:
            r["speedup_vs_pit_off"] = base / r["median_ms"] if base else None
            r["speedup_vs_best_peer"] = min(peers) / r["median_ms"] if peers else None
    return rows


def moe_token_check(rows: list[dict]) -> None:
    """Set an MoE model's rows' ``correct``: its fraction of real tokens within the tolerance at
    least :data:`MOE_TOKENS_WITHIN`, or (float16) at least that of PyTorch's own eager run"""
    eager = next((r.get("tokens_within_tol") for r in rows if r["method"] == "torch_eager"), None)
    for r in rows:
        if r.get("tokens_within_tol") is None:
            continue
        need = MOE_TOKENS_WITHIN
        if r["dtype"] != "float32" and eager is not None:
            need = min(need, eager)
        r["tokens_needed"] = need
        r["correct"] = bool(r["tokens_within_tol"] >= need)


def plot(ax, rows):
    rs = [r for r in rows if r.get("median_ms")]
    colors = ["tab:gray" if r["method"] == "tvm_pit_off" else "tab:green" if r["method"] == "tvm_pit"
              else "tab:blue" for r in rs]
    bars = ax.bar(range(len(rs)), [r["median_ms"] for r in rs], color=colors)
    for b, r in zip(bars, rs):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{r['median_ms']:.2f}", ha="center",
                va="bottom", fontsize=7)
    ax.set_xticks(range(len(rs)))
    ax.set_xticklabels([f"{r['model']}\n{r['method']}" for r in rs], fontsize=6)
    ax.set_ylabel("median ms per batch (lower is better)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--models", help=f"comma list of {', '.join(ARCHITECTURES)}")
    for k in ("batch", "seq", "min_len", "repeat", "warmup"):
        p.add_argument("--" + k.replace("_", "-"), type=int, dest=k)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expected-density", choices=["default", "sample"], default="default",
                   help="the PIT build's expected_density: compile_onnx's default, or a sample batch's")
    p.add_argument("--name", help="results name (default real_models_<device>)")
    args = p.parse_args(argv)
    for k, v in DEFAULTS[args.device].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    return args


def main(argv=None):
    cfg = parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in [m.strip() for m in cfg.models.split(",") if m.strip()]:
            rows.extend(run_model(arch, cfg, tmp))
    if cfg.device == "cuda":
        import torch  # noqa: PLC0415

        name = torch.cuda.get_device_name(0)
    else:
        import platform  # noqa: PLC0415

        name = f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"
    env = environment(name)
    env["config"] = vars(cfg)
    env["command"] = "python benchmarks/real_models.py " + " ".join(sys.argv[1:] if argv is None else argv)
    env["total_wall_s"] = time.perf_counter() - t0
    print()
    print_table(rows, TABLE)
    paths = write_results(cfg.name or f"real_models_{cfg.device}", env, rows, plot)
    print("written:", *paths)
    wrong = [f"{r['model']}/{r['method']}" for r in rows if r.get("correct") is False]
    if wrong:
        raise SystemExit(f"outputs differ from the reference beyond tolerance: {', '.join(wrong)}")


if __name__ == "__main__":
    main()
