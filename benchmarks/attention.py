"""Dynamic sparse attention (issue 36): pit-tvm's op (the block index built from the mask or the
pattern description every call + the Hopper kernel) against dense FlashAttention (SDPA), SDPA with
the dense boolean mask and FlexAttention (its block mask built every call, and known in advance),
with the roofline (dense time x density; Q, K, V, O bytes at the copy bandwidth measured in the
same run) and each output checked against an fp32 reference on sampled rows.

    python3 benchmarks/attention.py            # reduced grid: S 4096 / 16384, H 12, d 64 / 128
    python3 benchmarks/attention.py --full     # the issue's grid: S 2k-16k, H 12 / 16, d 64 / 128

Writes docs/results/attention.json / .png and docs/attention.md (under $OUT when set).  Needs
torch on a CUDA device (imported inside the functions, so the file imports without it).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, kernel_split_us, print_table, write_results  # noqa: E402

B = 1
QUERY_BLOCK, KEY_BLOCK = 128, 64
PATTERNS = ("longformer", "bigbird", "documents", "random10", "random25", "random100")
METHODS = ("pit", "pit_index", "pit_kernel", "sdpa_dense", "sdpa_mask", "flex_per_call", "flex_known", "roofline_density",
           "roofline_bytes")
TABLE = ["S", "H", "d", "pattern", "density"] + [m + "_ms" for m in METHODS] + ["index_floor_ms", "pit_vs_dense",
                                                                               "max_err"]


def _time_ms(fn, reps):
    """median device-inclusive ms of fn() (triton's do_bench, else CUDA events)"""
    import torch
    try:
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=5, rep=max(reps, 20)))
    except ImportError:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps


def _draw(pattern, S, gen):
    """(AttentionPattern, the op's run-time inputs, the dense bool mask [B, 1, S, S]) of one call"""
    import torch

    from pit_tvm.ops.sparse_attention import AttentionPattern

    dev = "cuda"
    qi = torch.arange(S, device=dev)[:, None]
    ki = torch.arange(S, device=dev)[None, :]
    if pattern == "longformer":
        flags = torch.zeros(B, S, dtype=torch.int32, device=dev)
        flags[:, torch.randperm(S, generator=gen, device="cpu")[:32].to(dev)] = 1
        g = flags.bool()
        dense = ((qi - ki).abs() <= 256)[None] | g[:, None, :] | g[:, :, None]
        return AttentionPattern(window=256, global_tokens=True), {"global_flags": flags}, dense[:, None]
    if pattern == "documents":
        cuts = torch.sort(torch.randperm(S - 1, generator=gen)[:7] + 1).values
        lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([S])]))
        docs = torch.repeat_interleave(torch.arange(8), lengths).to(torch.int32).to(dev)[None].repeat(B, 1)
        dense = (docs[:, :, None] == docs[:, None, :]) & (ki <= qi)[None]
        return AttentionPattern(causal=True, documents=True), {"doc_ids": docs}, dense[:, None]
    qbn, kbn = S // QUERY_BLOCK, S // KEY_BLOCK
    if pattern == "bigbird":      # window 128 + 3 random key blocks per query block + 2 global blocks
        blocks = torch.zeros(qbn, kbn, dtype=torch.bool)
        blocks[torch.arange(qbn)[:, None], torch.randint(0, kbn, (qbn, 3), generator=gen)] = True
        blocks[:, :2] = True
        dense = blocks.to(dev).repeat_interleave(QUERY_BLOCK, 0).repeat_interleave(KEY_BLOCK, 1)
        dense = dense | ((qi - ki).abs() <= 128)
    else:                          # random blocks at the given density, a third of them partial
        density = int(pattern[len("random"):]) / 100
        blocks = (torch.rand(qbn, kbn, generator=gen) < density).to(dev)
        dense = blocks.repeat_interleave(QUERY_BLOCK, 0).repeat_interleave(KEY_BLOCK, 1)
        if density < 1:
            partial = (torch.rand(qbn, kbn, generator=gen) < 1 / 3).to(dev)
            partial = partial.repeat_interleave(QUERY_BLOCK, 0).repeat_interleave(KEY_BLOCK, 1)
            dense = dense & (~partial | (torch.rand(S, S, device=dev) < 0.5))
    mask = dense[None, None].expand(B, 1, S, S).contiguous()
    return AttentionPattern(mask="bool"), {"mask": mask}, mask


def _reference_rows(q, k, v, dense, rows):
    """fp32 softmax attention of the sampled query rows, 0 for a row with no allowed key"""
    import torch

    s = torch.einsum("bhqd,bhkd->bhqk", q[:, :, rows].float(), k.float()) / math.sqrt(q.shape[-1])
    allowed = dense[:, :, rows].expand_as(s)
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bhqd", p, v.float())


_FLEX = None


def _flex(q, k, v, dense, reps):
    """(per-call ms: create_block_mask + flex_attention, known-in-advance ms), compiled; None
    where FlexAttention is missing"""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None, None
    global _FLEX
    if _FLEX is None:
        torch._dynamo.config.cache_size_limit = 64      # (a recompile past the limit runs eagerly)
        _FLEX = torch.compile(flex_attention)
    flex = _FLEX
    S = q.shape[2]
    mask2d = dense[0, 0]

    def mask_mod(b, h, qi, ki):
        return mask2d[qi, ki]

    def per_call():
        bm = create_block_mask(mask_mod, None, None, S, S, device="cuda", _compile=True)
        return flex(q, k, v, block_mask=bm)

    known = create_block_mask(mask_mod, None, None, S, S, device="cuda", _compile=True)
    flex(q, k, v, block_mask=known)           # compile the fused kernel before timing
    return _time_ms(per_call, reps), _time_ms(lambda: flex(q, k, v, block_mask=known), reps)


def run(cfg):
    import torch

    import pit_tvm

    rows = []
    gen = torch.Generator().manual_seed(cfg.seed)
    # copy bandwidth of this device, for the bytes roofline
    buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    copy_ms = _time_ms(lambda: buf.clone(), cfg.reps)
    bandwidth = 2 * buf.numel() / (copy_ms * 1e-3)
    del buf
    ops = {}
    for S in cfg.seqs:
        for H in cfg.heads:
            for d in cfg.dims:
                q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.float16) for _ in range(3))
                dense_ms = _time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), cfg.reps)
                for pattern in cfg.patterns:
                    t0 = time.perf_counter()
                    pat, inputs, dense = _draw(pattern, S, gen)
                    key = (d, pat)
                    if key not in ops:
                        ops[key] = pit_tvm.sparse_attention(d, pat, dtype="float16", target="cuda")
                    op = ops[key]
                    density = dense.float().mean().item()
                    out = op(q, k, v, **inputs)
                    sample = torch.randperm(S, generator=gen)[:128].to("cuda")
                    ref = _reference_rows(q, k, v, dense, sample)
                    err = (out[:, :, sample].float() - ref).abs().max().item()
                    # device time of the op's kernels (torch.profiler): the index's and the attention's
                    split_us = kernel_split_us(lambda: op(q, k, v, **inputs))
                    mask_bytes = sum(x.numel() * x.element_size() for x in inputs.values())
                    row = {"S": S, "H": H, "d": d, "pattern": pattern, "density": round(density, 4),
                           "kernel": op.kernel_name, "max_err": err, "correct": err < 2e-2,
                           "pit_ms": _time_ms(lambda: op(q, k, v, **inputs), cfg.reps),
                           "pit_index_ms": sum(t for n, t in split_us.items() if "pit_attention_index" in n) / 1e3,
                           "pit_kernel_ms": sum(t for n, t in split_us.items() if "pit_sparse_attention" in n) / 1e3,
                           "index_floor_ms": mask_bytes / bandwidth * 1e3,
                           "sdpa_dense_ms": dense_ms,
                           "roofline_density_ms": dense_ms * density,
                           "roofline_bytes_ms": 4 * q.numel() * 2 / bandwidth * 1e3}
                    row["sdpa_mask_ms"] = None if S > cfg.max_dense_mask else _time_ms(
                        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense),
                        cfg.reps)
                    if cfg.flex and S in cfg.flex_seqs:
                        try:
                            row["flex_per_call_ms"], row["flex_known_ms"] = _flex(q, k, v, dense, cfg.reps)
                        except Exception as exc:  # noqa: BLE001 - a peer's failure is a result, not a crash
                            row["flex_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    row["pit_vs_dense"] = dense_ms / row["pit_ms"]
                    row["wall_s"] = time.perf_counter() - t0
                    rows.append(row)
                    print({c: row.get(c) for c in TABLE}, flush=True)
    return rows, bandwidth


def plot(ax, rows):
    labels = [f"{r['pattern']}\nS{r['S']} d{r['d']}" for r in rows]
    x = np.arange(len(rows))
    for i, m in enumerate(("pit", "sdpa_mask", "flex_per_call", "flex_known", "roofline_density")):
        vals = [r["sdpa_dense_ms"] / r[m + "_ms"] if r.get(m + "_ms") else 0 for r in rows]
        ax.bar(x + (i - 2) * 0.16, vals, 0.16, label=m)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=5, rotation=90)
    ax.set_ylabel("speedup over dense SDPA")
    ax.legend(fontsize=6)


def render(env, rows) -> str:
    """the results page: one table row per (S, H, d, pattern), ms and the speedup over dense"""
    def ms(v):
        return "—" if v is None else f"{v:.3f}"

    def err(r):
        return "—" if r.get("max_err") is None else f"{r['max_err']:.1e}"

    lines = ["# Dynamic sparse attention (issue 36)", "",
             f"{env['device']}, {env['date']}, `{env['command']}`; torch {env.get('torch', '?')}, tvm {env['tvm']}.",
             "Times in ms (median); pit = the op (index from the mask or description every call + kernel, wall "
             "time); index and kernel = their device time in that call (torch.profiler); index floor = the pattern "
             "inputs' bytes read once at the copy bandwidth.",
             f"Copy bandwidth measured: {env['copy_bandwidth_GBs']:.0f} GB/s.", "",
             "![attention](results/attention.png)", "",
             "| S | H | d | pattern | density | pit | index | kernel | index floor | dense SDPA | SDPA + mask "
             "| flex per call | flex known | dense × density | bytes | pit vs dense | max err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['S']} | {r['H']} | {r['d']} | {r['pattern']} | {r['density']:.3f} | {ms(r['pit_ms'])} "
                     f"| {ms(r['pit_index_ms'])} | {ms(r.get('pit_kernel_ms'))} | {ms(r.get('index_floor_ms'))} "
                     f"| {ms(r['sdpa_dense_ms'])} | {ms(r.get('sdpa_mask_ms'))} "
                     f"| {ms(r.get('flex_per_call_ms'))} | {ms(r.get('flex_known_ms'))} "
                     f"| {ms(r['roofline_density_ms'])} | {ms(r['roofline_bytes_ms'])} "
                     f"| {r['pit_vs_dense']:.2f}x | {err(r)}{'' if r['correct'] else ' WRONG'} |")
    errors = [r for r in rows if r.get("flex_error")]
    if errors:
        lines += ["", "FlexAttention errors: " + "; ".join(f"{r['pattern']} S{r['S']}: {r['flex_error']}"
                                                         for r in errors)]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="the issue's grid: S 2k/4k/8k/16k, H 12/16, d 64/128")
    p.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 16384])
    p.add_argument("--heads", type=lambda s: [int(x) for x in s.split(",")], default=[12])
    p.add_argument("--dims", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128])
    p.add_argument("--patterns", type=lambda s: s.split(","), default=list(PATTERNS))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-flex", dest="flex", action="store_false", help="leave FlexAttention out")
    p.add_argument("--flex-seqs", type=lambda s: [int(x) for x in s.split(",")], default=[4096],
                   help="the S FlexAttention runs at (each shape compiles; the default keeps the run short)")
    p.add_argument("--max-dense-mask", type=int, default=16384, help="largest S given SDPA a dense mask")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="attention")
    cfg = p.parse_args(argv)
    if cfg.full:
        cfg.seqs, cfg.heads, cfg.dims = [2048, 4096, 8192, 16384], [12, 16], [64, 128]
        cfg.flex_seqs = cfg.seqs
    import torch

    t0 = time.perf_counter()
    rows, bandwidth = run(cfg)
    env = environment(torch.cuda.get_device_name(0))
    env["config"] = vars(cfg)
    env["command"] = "python3 benchmarks/attention.py " + " ".join(sys.argv[1:] if argv is None else argv)
    env["copy_bandwidth_GBs"] = bandwidth / 1e9
    env["total_wall_s"] = time.perf_counter() - t0
    print_table(rows, TABLE)
    paths = write_results(cfg.name, env, rows, plot)
    page = os.path.join(os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "docs"), f"{cfg.name}.md")
    with open(page, "w") as f:
        f.write(render(env, rows))
    print("written:", *paths, page)
    wrong = [f"{r['pattern']} S{r['S']} d{r['d']}" for r in rows if not r["correct"]]
    if wrong:
        raise SystemExit(f"pit's output differs from the fp32 reference: {', '.join(wrong)}")


if __name__ == "__main__":
    main()
