"""md5 of the CUDA source of every Hopper (sm_90a) kernel the GPU suite builds, per kernel function.

Builds for target ``cuda:sm_90a`` (codegen only: no GPU, no nvcc needed) the wgmma rows / dense /
tiles kernels with each epilogue and tier, the ops (``sparse_matmul``) that assemble them, the
strips kernels and the fused attention, and prints ``case/function md5`` lines, sorted.  A
refactoring of :mod:`pit_tvm.schedules` that must not change the generated code compares two
runs' output (``--out FILE`` writes it; ``--check FILE`` exits 1 on any difference).
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
import warnings

import tvm

TARGET = "cuda:sm_90a"


def _functions(source: str) -> dict[str, str]:
    """the source of each ``__global__`` function (up to the next one), by name"""
    starts = [m.start() for m in re.finditer(r'extern "C" __global__', source)]
    out = {"<preamble>": source[:starts[0]] if starts else source}
    for i, s in enumerate(starts):
        chunk = source[s:starts[i + 1] if i + 1 < len(starts) else len(source)]
        name = re.search(r"void\s+(?:__launch_bounds__\(\d+\)\s+)?(\w+)\s*\(", chunk).group(1)
        out[name] = chunk
    return out


def _module_hashes(case: str, executable) -> dict[str, str]:
    from pit_tvm.nvcc import cuda_sources
    hashes = {}
    for i, src in enumerate(sorted(cuda_sources(executable))):
        for name, chunk in _functions(src).items():
            hashes[f"{case}#{i}/{name}"] = hashlib.md5(chunk.encode()).hexdigest()
    return hashes


def _func_cases():
    """(case name, PrimFunc factory) of the schedules' kernels built one by one"""
    from pit_tvm.schedules import wgmma as W
    from pit_tvm.schedules.attention import fused_attention_func
    from pit_tvm.schedules.wgmma_strips import strip_list_func, strip_pack_func

    rg = W.wgmma_row_gather_func
    cases = {
        "rows_f16": lambda: rg(256, 512),
        "rows_bf16_f32_bias_relu": lambda: rg(256, 512, "bfloat16", "float32", bias=True, relu=True),
        "dense_f16_bf16_bias": lambda: rg(256, 512, "float16", "bfloat16", bias=True, dense=True),
        "dense_f16_f32_relu": lambda: rg(256, 512, "float16", "float32", relu=True, dense=True),
        "dense_plain": lambda: rg(512, 512, dense=True),
        "dense_raster1": lambda: rg(512, 512, dense=True, config=W.WgmmaConfig(256, 4, raster_m=1)),
        "dense_bias_gelu": lambda: rg(512, 768, bias=True, gelu=True, dense=True),
        "rows_bias_gelu": lambda: rg(512, 768, bias=True, gelu=True),
        "dense_bias_row_scale": lambda: rg(512, 512, bias=True, row_scale=True, dense=True),
        "rows_bias_row_scale_masks": lambda: rg(512, 512, bias=True, row_scale=True, row_scale_masks=True),
        "rows_bias_row_scale": lambda: rg(512, 512, bias=True, row_scale=True),
        "dense_bias_row_scale_a": lambda: rg(512, 512, bias=True, row_scale_a=True, dense=True),
        "rows_bias_gelu_row_scale_a_rs": lambda: rg(512, 512, bias=True, gelu=True, row_scale_a=True,
                                                    row_scale=True),
        "dense_bias_residual": lambda: rg(512, 512, bias=True, residual=True, dense=True),
        "dense_bias_residual_f32": lambda: rg(512, 512, "float16", "float32", bias=True, residual=True, dense=True),
        "rows_bias_residual": lambda: rg(512, 512, bias=True, residual=True),
        "dense_bk32": lambda: rg(512, 512, dense=True, config=W.WgmmaConfig(256, 4, 32)),
        "rows_bk32": lambda: rg(512, 512, config=W.WgmmaConfig(128, 4, 32)),
        "rows_above": lambda: rg(512, 4096, rows_above=1024),
        "tier_128x6": lambda: rg(512, 4096, config=W.WgmmaConfig(128, 6), rows_above=256, rows_upto=1024),
        "tier_64x8": lambda: rg(512, 4096, config=W.WgmmaConfig(64, 8), rows_upto=256),
        "tier_64x8_bias_residual": lambda: rg(512, 4096, bias=True, residual=True, config=W.WgmmaConfig(64, 8),
                                              rows_upto=256),
        "tier_128x6_bias_row_scale": lambda: rg(512, 4096, bias=True, row_scale=True,
                                                config=W.WgmmaConfig(128, 6), rows_upto=1024),
        "dense_strips_32": lambda: rg(512, 512, dense=True, strips_mk=32),
        "dense_strips_1": lambda: rg(512, 512, dense=True, strips_mk=1),
        "dense_strips_64_bias_gelu": lambda: rg(512, 512, bias=True, gelu=True, dense=True, strips_mk=64),
        "tiles_32x64": lambda: W.wgmma_tiles_gather_func(512, 256, 64),
        "tiles_ws_64": lambda: W.wgmma_tiles_gather_func(512, 256, 64, config=W.wgmma_tiles_config(256, 64)),
        "tiles_allthreads_64": lambda: W.wgmma_tiles_gather_func(512, 256, 64, config=W.WgmmaConfig(256, 4)),
        "tiles_mk1_compact": lambda: W.wgmma_tiles_gather_func(512, 256, 1),
        "tiles_mk8": lambda: W.wgmma_tiles_gather_func(512, 256, 8),
        "tiles_bias_residual": lambda: W.wgmma_tiles_gather_func(512, 256, 64, bias=True, residual=True),
        "tiles_bias_residual_f32": lambda: W.wgmma_tiles_gather_func(512, 256, 64, "float16", "float32",
                                                                     bias=True, residual=True),
        "tiles_bf16_f32": lambda: W.wgmma_tiles_gather_func(512, 256, 32, "bfloat16", "float32"),
        "dense_fallback_64": lambda: W.wgmma_dense_fallback_func(512, 256, 64),
        "dense_fallback_1_bias_res": lambda: W.wgmma_dense_fallback_func(512, 256, 1, bias=True, residual=True),
        "compact_a_1": lambda: W.wgmma_compact_a_func(512, 1),
        "compact_a_6": lambda: W.wgmma_compact_a_func(768, 6),
        "strip_list_1": lambda: strip_list_func(512, 1),
        "strip_list_32": lambda: strip_list_func(512, 32),
        "strip_list_64_bf16": lambda: strip_list_func(512, 64, "bfloat16"),
        "strip_pack_32": lambda: strip_pack_func(512, 32),
        "strip_pack_32_thr": lambda: strip_pack_func(512, 32, 0.9),
        "attention_128": lambda: fused_attention_func(2, 3, 128, 64, 0.125),
        "attention_256": lambda: fused_attention_func(2, 3, 256, 64, 0.125),
        "attention_packed": lambda: fused_attention_func(2, 3, 128, 64, 0.125,
                                                         packed=((576, 0), (576, 192), (576, 384)),
                                                         out_packed=True, row_scale=True),
        "attention_bf16_mask": lambda: fused_attention_func(2, 2, 128, 64, 0.125, "bfloat16", "float16", True),
    }
    return cases


def _op_cases():
    """(case name, executable factory) of the ops that assemble the kernels (tiers, fallbacks)"""
    import pit_tvm
    return {
        "op_rows_4096_f16": lambda: pit_tvm.sparse_matmul(4096, 4096, "float16", micro_tile=(1, 4096),
                                                          target="cuda").executable,
        "op_rows_512_bf16": lambda: pit_tvm.sparse_matmul(512, 4096, "bfloat16", micro_tile=(1, 512),
                                                          target="cuda").executable,
        "op_rows_512_f32out": lambda: pit_tvm.sparse_matmul(512, 4096, "float16", micro_tile=(1, 512),
                                                            target="cuda", out_dtype="float32").executable,
        "op_tiles_32x64": lambda: pit_tvm.sparse_matmul(512, 256, "float16", micro_tile=(32, 64),
                                                        target="cuda").executable,
        "op_tiles_1x64": lambda: pit_tvm.sparse_matmul(512, 256, "float16", micro_tile=(1, 64),
                                                       target="cuda").executable,
        "op_tiles_32x1": lambda: pit_tvm.sparse_matmul(512, 256, "float16", micro_tile=(32, 1),
                                                       target="cuda").executable,
        "op_tiles_32x6_f32out": lambda: pit_tvm.sparse_matmul(768, 256, "float16", micro_tile=(32, 6),
                                                              target="cuda", out_dtype="float32").executable,
    }


def fingerprint(only: str | None = None) -> dict[str, str]:
    from pit_tvm.target import build
    hashes = {}
    for case, make in _func_cases().items():
        if only and only not in case:
            continue
        func = make()
        hashes.update(_module_hashes(case, build(tvm.IRModule({"main": func}), TARGET)))
    for case, make in _op_cases().items():
        if only and only not in case:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hashes.update(_module_hashes(case, make()))
    return hashes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the hashes to this file")
    ap.add_argument("--check", help="compare with the hashes in this file; exit 1 on a difference")
    ap.add_argument("--only", help="only the cases whose name contains this")
    args = ap.parse_args(argv)
    hashes = fingerprint(args.only)
    lines = [f"{k} {v}" for k, v in sorted(hashes.items())]
    kernels = sum(1 for k in hashes if not k.endswith("<preamble>"))
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.check:
        with open(args.check) as f:
            want = dict(line.split() for line in f if line.strip())
        bad = sorted(k for k in set(want) | set(hashes) if want.get(k) != hashes.get(k))
        for k in bad:
            print(f"DIFF {k}: {want.get(k)} -> {hashes.get(k)}")
        print(f"{kernels} kernel functions, {len(hashes)} hashes: "
              f"{'IDENTICAL' if not bad else f'{len(bad)} DIFFER'}")
        return 1 if bad else 0
    sys.stdout.write(text)
    print(f"# {kernels} kernel functions", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
