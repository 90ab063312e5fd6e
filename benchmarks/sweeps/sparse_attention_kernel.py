"""Block-sparse attention's Hopper kernel alone (no index build) against dense FlashAttention
(SDPA) on the H100: random block masks of full blocks at several densities, B 1, H 12, S 4096,
head dims 64 / 128, key blocks 64 / 128, each form of the kernel (``FORMS``).  Prints the
kernel's time, its speedup over dense and that speedup as a fraction of the density-ideal one
(issue 36's target: >= 0.7 at <= 25 %, and >= 0.85x dense at 100 %), and the kernel's device
time from torch.profiler (do_bench's time includes the host's per call where that bounds it).

    python3 benchmarks/sweeps/sparse_attention_kernel.py [--seq 4096] [--heads 12] [--forms 64/ws_overlap/4 ...]
    python3 benchmarks/sweeps/sparse_attention_kernel.py --uniform [--partial 0.33] [--seq 16384] [--forms ...]

``--uniform``: the default form only, every query block listing exactly n key blocks (n = 1, 2,
4, ... all), a ``--partial`` fraction of them partial (their element predicate read from an
all-true mask): the kernel's device time against n, and its least-squares fit ``waves x (fixed
+ n x per block)`` (a CTA's cost outside its blocks: launch, Q, the ring's fill, the epilogue).
"""
import argparse
import sys

import numpy as np
import torch
import tvm
from triton.testing import do_bench

sys.path.insert(0, "benchmarks")
from common import kernel_split_us  # noqa: E402
from pit_tvm.index.attention import reference_mask_bits  # noqa: E402
from pit_tvm.ops.sparse_attention import QUERY_BLOCK, AttentionPattern  # noqa: E402
from pit_tvm.schedules.hopper.sparse_attention import block_sparse_attention_func  # noqa: E402
from pit_tvm.target import build  # noqa: E402


#: the kernel's forms: P through shared memory (all threads copy), P in registers, a loader
#: warpgroup filling the ring (P in registers), and that with each block's softmax overlapping
#: the previous block's P V; the warp-specialized forms with the loader's registers handed to the
#: consumers (``register_split``, the default) or not (``_168``: 168 registers a thread); two listed
#: blocks of 64 keys a step (``pair``: the mask's bytes from global memory, ``pair_mt``: staged mask
#: tiles); ``_tma``: K and
#: V by TMA (``tma_kv``, the kernel's default since 2026-11-29; the other warp-specialized forms copy
#: them by cp.async, as they were measured); ``_noturns``: the consumer warpgroups not taking turns;
#: ``_bits``: the predicate from the index's packed mask (``mask_bits``, the kernel's default since
#: 2026-11-29; the other warp-specialized forms stage mask tiles, as they were measured)
_WS = {"p_in_registers": True, "warp_specialized": True}
_PAIR = {"pair_blocks": True, "overlap": True}
# where a boolean mask's predicate reads it: staged mask tiles, its bytes in global memory, the packed mask
_TILES, _BYTES, _BITS = {"mask_bits": False}, {"mask_tiles": False, "mask_bits": False}, {"mask_tiles": False,
                                                                                          "mask_bits": True}
_CP, _TMA = {"tma_kv": False}, {"tma_kv": True}
FORM_ARGS = {"p_smem": {"p_in_registers": False, "warp_specialized": False},
             "p_regs": {"p_in_registers": True, "warp_specialized": False},
             "ws": {**_WS, "overlap": False, **_CP, **_TILES},
             "ws_overlap": {**_WS, "overlap": True, **_CP, **_TILES},
             "ws_overlap_168": {**_WS, "overlap": True, "register_split": False, **_CP, **_TILES},
             "pair": {**_PAIR, **_BYTES, **_CP},
             "pair_mt": {**_PAIR, **_TILES, **_CP},
             "pair_tma": {**_PAIR, **_BYTES, **_TMA},
             "pair_mt_tma": {**_PAIR, **_TILES, **_TMA},
             "pair_mt_noturns": {**_PAIR, "turns": False, **_TILES, **_CP},
             "ws_overlap_tma": {**_WS, "overlap": True, **_TILES, **_TMA},
             "pair_bits": {**_PAIR, **_BITS, **_TMA},
             "ws_overlap_bits": {**_WS, "overlap": True, **_BITS, **_TMA},
             "pair_late": {**_PAIR, "early_predicate": False, **_CP},
             "ws_overlap_late": {**_WS, "overlap": True, "early_predicate": False, **_CP}}
#: (key block, form, ring stages)
FORMS = ([(kb, form, 2) for kb in (64, 128) for form in ("p_smem", "p_regs", "ws")]
         + [(64, "ws", 4), (128, "ws", 3), (64, "ws_overlap", 3), (64, "ws_overlap", 4), (64, "ws_overlap_168", 4),
            (128, "ws_overlap", 2), (128, "ws_overlap", 3), (64, "pair", 3), (64, "pair", 4), (64, "pair_mt", 4),
            (64, "pair_late", 3), (64, "pair_late", 4), (128, "ws_overlap_late", 3), (64, "pair_tma", 4),
            (64, "pair_tma", 3), (64, "pair_mt_tma", 4), (64, "pair_mt_noturns", 4), (64, "ws_overlap_tma", 4),
            (64, "pair_bits", 3), (64, "pair_bits", 4), (64, "ws_overlap_bits", 4)])


def block_index(rng, batch, seq, key_block, density):
    """the index of a random block mask whose listed blocks are all full (no predicate)"""
    qbn, kbn = -(-seq // QUERY_BLOCK), -(-seq // key_block)
    listed = rng.random((batch, 1, qbn, kbn)) < density
    counts = listed.sum(-1).astype(np.int32)
    ids = np.full((batch, 1, qbn, kbn), -1, np.int32)
    for idx in np.ndindex(batch, 1, qbn):
        n = np.nonzero(listed[idx])[0]
        ids[idx][:len(n)] = n
    return counts, ids, np.zeros_like(ids), listed.mean()


def uniform_index(rng, batch, seq, key_block, listed, partial):
    """the index of exactly ``listed`` random key blocks per query block, a ``partial`` fraction
    of them marked partial"""
    qbn, kbn = -(-seq // QUERY_BLOCK), -(-seq // key_block)
    ids = np.full((batch, 1, qbn, kbn), -1, np.int32)
    for idx in np.ndindex(batch, 1, qbn):
        ids[idx][:listed] = np.sort(rng.choice(kbn, listed, replace=False))
    marks = (rng.random(ids.shape) < partial) & (ids >= 0)
    return np.full((batch, 1, qbn), listed, np.int32), ids, marks.astype(np.int32)


def packed_mask(batch, seq):
    """the index's packed mask (``mask_bits``) of an all-true boolean mask, on the GPU"""
    col = reference_mask_bits(np.ones((1, 1, 1, seq), bool))      # [1, 1, words, 1]
    return torch.from_numpy(np.ascontiguousarray(np.broadcast_to(col, (batch, 1, col.shape[2], seq)))).cuda()


def kernel_args(func, q, k, v, index, mask, o):
    """the kernel's arguments: the mask's packed words too where ``func`` reads them"""
    bits = [packed_mask(q.shape[0], q.shape[2])] if bool(func.attrs["pit.attention.mask_bits"]) else []
    return [tvm.runtime.from_dlpack(x) for x in [q, k, v] + index + [mask] + bits + [o]]


def parse_form(spec):
    """``"64/ws_overlap/4"`` -> ``(64, "ws_overlap", 4)``: key block, form (``FORM_ARGS``), ring stages"""
    kb, form, stages = spec.split("/")
    return int(kb), form, int(stages)


def uniform_sweep(seq, heads, partial, form=None):
    """kernel device time against the listed blocks per query block (module docstring); ``form``
    ``(key block, form, stages)`` (default: the kernel's defaults at key block 64)"""
    B, S = 1, seq
    kb, form_args = (64, {}) if form is None else (form[0], dict(FORM_ARGS[form[1]], stages=form[2]))
    rng = np.random.default_rng(0)
    for d in (64, 128):
        q, k, v = (torch.randn(B, heads, S, d, device="cuda", dtype=torch.float16) for _ in range(3))
        o = torch.empty_like(q)
        mask = torch.ones(B, 1, S, S, dtype=torch.bool, device="cuda")
        try:
            func = block_sparse_attention_func(d, AttentionPattern(mask="bool"), "float16", kb, **form_args)
        except ValueError as err:
            print(f"  d {d} kb {kb} {form_args}: {err}", flush=True)
            continue
        f = build(tvm.IRModule({"main": func}), "cuda:sm_90a")["main"]
        ctas = -(-S // QUERY_BLOCK) * heads * B
        waves = ctas / torch.cuda.get_device_properties(0).multi_processor_count
        points = []
        n = 1
        while n <= S // kb:
            index = [torch.from_numpy(x).cuda() for x in uniform_index(rng, B, S, kb, n, partial)]
            call_args = kernel_args(func, q, k, v, index, mask, o)
            dev_us = sum(t for name, t in kernel_split_us(lambda: f(*call_args)).items() if "sparse_attention" in name)
            points.append((n, dev_us))
            print(f"  d {d} S {S} H {heads} kb {kb} partial {partial:.2f}: {n:4d} blocks per query block: {dev_us:8.1f} us "
                  f"({dev_us / waves:6.2f} us a wave of CTAs)", flush=True)
            n *= 2
        ns, us = np.array(points, float).T
        per_block, fixed = np.polyfit(ns, us / waves, 1)
        print(f"  d {d}: fit per CTA: fixed {fixed:.2f} us + {per_block:.3f} us a block ({ctas} CTAs, "
              f"{waves:.1f} waves)", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--heads", type=int, default=12, help="attention heads (default 12)")
    ap.add_argument("--forms", nargs="*", type=parse_form,
                    help="key block/form/stages of FORMS to run, e.g. 64/ws_overlap/4 (default: all)")
    ap.add_argument("--uniform", action="store_true", help="kernel time against exactly n listed blocks")
    ap.add_argument("--partial", type=float, default=0.0, help="(--uniform) the fraction of listed blocks partial")
    args = ap.parse_args()
    if args.uniform:
        for form in args.forms or [None]:
            uniform_sweep(args.seq, args.heads, args.partial, form)
        return
    B, H, S = 1, args.heads, args.seq
    rng = np.random.default_rng(0)
    pattern = AttentionPattern(mask="bool")
    for d in (64, 128):
        q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.float16) for _ in range(3))
        o = torch.empty_like(q)
        dense_us = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                            warmup=10, rep=100) * 1e3
        dense_dev = sum(kernel_split_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)).values())
        print(f"d {d}: dense SDPA {dense_us:.1f} us (device time {dense_dev:.1f} us)", flush=True)
        mask = torch.ones(B, 1, S, S, dtype=torch.bool, device="cuda")   # read only in partial blocks: never
        for kb, form, stages in FORMS:
            if args.forms and (kb, form, stages) not in args.forms:
                continue
            try:
                func = block_sparse_attention_func(d, pattern, "float16", kb, stages=stages, **FORM_ARGS[form])
            except ValueError as err:        # (a ring too deep for the shared memory)
                print(f"  kb {kb} {form} stages {stages}: {err}")
                continue
            f = build(tvm.IRModule({"main": func}), "cuda:sm_90a")["main"]
            for density in (0.05, 0.10, 0.25, 0.50, 1.0):
                counts, ids, partial, real = block_index(rng, B, S, kb, density)
                index = [torch.from_numpy(x).cuda() for x in (counts, ids, partial)]
                call_args = kernel_args(func, q, k, v, index, mask, o)
                us = do_bench(lambda: f(*call_args), warmup=10, rep=100) * 1e3
                # the kernel's device time (torch.profiler): below ``us`` where the calls' host
                # time bounds the loop (few listed blocks)
                dev_us = sum(t for name, t in kernel_split_us(lambda: f(*call_args)).items()
                             if "sparse_attention" in name)
                speedup = dense_us / us
                check = ""
                if density == 1.0:       # every block listed: the dense result
                    f(*call_args)
                    err = (o - torch.nn.functional.scaled_dot_product_attention(q, k, v)).abs().max().item()
                    check = f", max error against SDPA {err:.1e}" + (" WRONG" if err > 2e-2 else "")
                print(f"  kb {kb:3d} {form:6s} stages {stages} density {real:5.3f}: {us:8.1f} us "
                      f"(device {dev_us:6.1f}), {speedup:5.2f}x dense, {speedup * real:4.2f} of the "
                      f"density-ideal speedup{check}", flush=True)


if __name__ == "__main__":
    main()
