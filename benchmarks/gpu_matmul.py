"""PIT matmul vs cuBLAS and dynamic-sparsity peers on a GPU, every call paying its per-call work.

    python3 benchmarks/gpu_matmul.py [--sizes 4096 [8192]] [--sparsities 0 0.5 ...] [--patterns row 1x64 ...]

C = A @ B, fp16 in and out, M=K=N=size, A with whole micro-tiles zero at sparsity s (exactly
round((1-s)·T) of the T micro-tiles non-zero, chosen at random; values N(0,1)). Patterns:
``row`` (PIT micro-tile 1xK: whole rows), ``1x64``, ``32x1`` (along K) and ``32x64`` (blocks).
Methods (the pattern changes every call, so each pays its index/conversion every call):

* PIT: ``op(a, b)`` end to end (index + device-side dense-fallback check + kernel), ``op.index(a)``
  alone, and kernel ≈ total − index (derived, not timed on its own).
* cuBLAS dense ``torch.matmul``; torch gather→cuBLAS→scatter and the Triton gather/scatter GEMM
  (``benchmarks/peers/triton_row_gather.py``, torch-op and Triton index) for row patterns;
  torch BSR (``to_sparse_bsr`` + matmul) and CSR (``to_sparse_csr`` + matmul, cuSPARSE).
* The roofline max((1−s)·t_cuBLAS, (A + B + C bytes) / bandwidth), bandwidth from a
  device-to-device copy timed in the same run.

Every method runs inside try/except (a failure is recorded as "error: …"), is checked once
against a float32 reference (max relative error), and timed between CUDA events (median, L2
swept before each call, by a read unless ``--l2 dirty``: see :func:`make_bench`). Beside the
index: one read of A by a minimal Triton kernel (``benchmarks/peers/read_once.py``), the floor
of any index under the same cache state. Writes gpu_matmul.json, .png and .md under $OUT (or
docs/results/ and docs/gpu_matmul.md).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, write_results  # noqa: E402
from pit_tvm.testing import expand, tile_pattern  # noqa: E402
from render_results import PATTERN_ORDER, PLOTTED, add_speedups, label, render  # noqa: E402

PATTERNS = PATTERN_ORDER                      # row, 1x64, 32x1, 32x64
SPARSITIES = (0.0, 0.5, 0.9, 0.95, 0.99)
ELEM_BYTES = 2                                # fp16


# -- CPU-only helpers (tested in tests/benchmarks/test_bench_utils.py) -----------------------------
def micro_tile_for(pattern: str, k: int) -> tuple[int, int]:
    """PIT micro-tile of a pattern name: ``row`` -> (1, K); ``"RxC"`` -> (R, C)."""
    if pattern == "row":
        return 1, int(k)
    try:
        mr, mk = (int(x) for x in pattern.lower().split("x"))
    except ValueError:
        raise ValueError(f"unknown pattern {pattern!r}: use 'row' or 'RxC' (e.g. 32x64)") from None
    if mr <= 0 or mk <= 0 or mk > k:
        raise ValueError(f"pattern {pattern!r} does not fit K={k}")
    return mr, mk


def copy_bandwidth_GBps(nbytes: int, copy_ms: float) -> float:
    """Bandwidth of a device-to-device copy of ``nbytes`` (each byte read once and written once)."""
    return 2.0 * nbytes / (copy_ms * 1e-3) / 1e9


def roofline(density: float, dense_ms: float, m: int, k: int, n: int, bandwidth_GBps: float,
             elem_bytes: int = ELEM_BYTES) -> dict:
    """The bound for one sparse matmul: max(density·t_dense, bytes / bandwidth).

    bytes = read A once (to find its non-zeros) + read B + write C.
    """
    nbytes = elem_bytes * (m * k + k * n + m * n)
    memory_ms = nbytes / (bandwidth_GBps * 1e9) * 1e3
    compute_ms = density * dense_ms
    return {"ms": max(compute_ms, memory_ms), "compute_ms": compute_ms, "memory_ms": memory_ms, "bytes": nbytes}


def bsr_blocksize(micro_tile, m: int, k: int, n: int) -> int:
    """Square BSR block b for torch's Triton BSR kernel (fp16: b a power of two >= 16, N % b == 0).

    The micro-tile itself when it is such a square; else 64 when the micro-tile's longer side
    is >= 64 (rows, 1x64, 32x64), else 32 (32x1) -- clipped to what divides M, K and N.
    """
    mr, mk = micro_tile
    if mr == mk and mr >= 16 and mr & (mr - 1) == 0 and m % mr == 0 and k % mr == 0 and n % mr == 0:
        return mr
    b = 64 if max(mr, mk) >= 64 else 32
    while b > 16 and (m % b or k % b or n % b):
        b //= 2
    return b


def short_error(err: BaseException) -> str:
    msg = str(err).strip().splitlines()
    first = next((line for line in msg if line.strip()), "")
    return f"error: {type(err).__name__}: {first[:200]}"


def summary(row: dict) -> str:
    """``method=ms`` for the progress log (ERR when it failed)."""
    if row.get("error"):
        return f"{row['method']}=ERR"
    return f"{row['method']}=" + ("-" if row.get("ms") is None else f"{row['ms']:.3f}")


def facet_plot(rows: list[dict], env: dict):
    """plot(ax, rows) for common.write_results: speedup over cuBLAS per method and sparsity,
    one facet per (size, pattern)."""
    def plot(ax, rs):
        fig = ax.figure
        ax.set_visible(False)                    # write_results titles this axes; we draw a grid instead
        sizes = sorted({r["size"] for r in rs})
        patterns = [p for p in PATTERNS if any(r["pattern"] == p for r in rs)]
        patterns += sorted({r["pattern"] for r in rs} - set(patterns))
        nr, nc = len(sizes), max(1, len(patterns))
        fig.set_size_inches(3.6 * nc + 0.6, 3.2 * nr + 1.0)
        markers = "osv^D<>Px*"
        handles, axes = {}, []
        for i, size in enumerate(sizes):
            for j, pattern in enumerate(patterns):
                a = fig.add_subplot(nr, nc, i * nc + j + 1)
                axes.append(a)
                sub = [r for r in rs if r["size"] == size and r["pattern"] == pattern]
                sps = sorted({r["sparsity"] for r in sub})
                for mi, method in enumerate(PLOTTED):
                    pts = [(sps.index(r["sparsity"]), r["speedup_vs_cublas"]) for r in sub
                           if r["method"] == method and r.get("speedup_vs_cublas")]
                    if not pts:
                        continue
                    pts.sort()
                    style = dict(ls="--", color="black", marker="") if method == "roofline" else \
                        dict(ls="-", marker=markers[mi % len(markers)])
                    (h,) = a.plot([p[0] for p in pts], [p[1] for p in pts], label=label(method), **style)
                    handles.setdefault(label(method), h)
                a.axhline(1.0, color="gray", lw=0.8)
                a.set_yscale("log")
                a.set_xticks(range(len(sps)), [f"{s:g}" for s in sps])
                mt = sub[0].get("micro_tile", pattern) if sub else pattern
                a.set_title(f"{pattern} (micro-tile {mt}), {size}³", fontsize=9)
                if i == nr - 1:
                    a.set_xlabel("sparsity")
                if j == 0:
                    a.set_ylabel("speedup over cuBLAS")
        fig.suptitle(f"fp16 C = A·B on {env.get('device', '?')} ({env.get('date', '')}); above 1 = faster than "
                     "cuBLAS dense", fontsize=10)
        if handles and axes:
            axes[0].legend(list(handles.values()), list(handles), fontsize=7, loc="upper left")
    return plot


# -- the GPU run ----------------------------------------------------------------------------------
L2_STATES = ("clean", "dirty")


def l2_sweep(torch, l2: str):
    """``sweep()``: 256 MiB (> L2) through L2, read (``"clean"``) or written (``"dirty"``)."""
    if l2 not in L2_STATES:
        raise ValueError(f"l2 must be one of {L2_STATES}, got {l2!r}")
    sweep_buf = torch.ones(64 * 2**20, device="cuda", dtype=torch.int32)       # 256 MiB
    return (lambda: sweep_buf.amax()) if l2 == "clean" else (lambda: sweep_buf.zero_())


def make_bench(torch, warmup_ms: float, rep_ms: float, l2: str = "clean"):
    """``(bench, description)``: ``bench(fn, rep=rep_ms)`` -> median ms of ``fn()`` between two CUDA
    events, with 256 MiB (> L2) swept through L2 before each call, as triton.testing.do_bench does.

    ``l2="clean"`` sweeps by reading the buffer, ``"dirty"`` by writing it (do_bench's
    ``zero_``): then L2 is full of dirty lines that the timed call's own misses must write back
    (ncu counts 11 MB of DRAM writes in the rows index, a kernel that writes 8 KiB) -- traffic
    that is not the call's, and that costs a short call over a third of its time.
    """
    sweep = l2_sweep(torch, l2)

    def events():
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def bench(fn, rep=rep_ms):
        fn()
        torch.cuda.synchronize()
        start, end = events()
        start.record()
        for _ in range(5):
            sweep()
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)     # one sweep + call
        for _ in range(max(1, int(warmup_ms / estimate_ms))):
            fn()
        pairs = [events() for _ in range(max(1, int(rep / estimate_ms)))]
        for start, end in pairs:
            sweep()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return float(np.median([start.elapsed_time(end) for start, end in pairs]))

    how = "reading" if l2 == "clean" else "writing (triton.testing.do_bench's zero_)"
    return bench, (f"CUDA events around each call, median; warmup {warmup_ms:g} ms, rep {rep_ms:g} ms; "
                   f"L2 swept before each call by {how} 256 MiB (--l2 {l2})")


def run_size(size, args, torch, bench, bandwidth, env, rows):
    import tvm

    import pit_tvm
    from pit_tvm.timing import median_ms

    dev = torch.device("cuda")
    m = k = n = size
    gen = torch.Generator(device="cuda")
    gen.manual_seed(size)
    rng = np.random.default_rng(size)
    b = torch.randn(k, n, device=dev, dtype=torch.float16, generator=gen)
    b_t = tvm.runtime.from_dlpack(b)
    try:
        from peers import triton_row_gather as trg
        trg_err = None
    except Exception as err:  # noqa: BLE001 - no triton: its rows say why
        trg, trg_err = None, short_error(err)
    try:
        from peers.read_once import read_once_fn
        read_err = None
    except Exception as err:  # noqa: BLE001
        read_once_fn, read_err = None, short_error(err)

    for pattern in args.patterns:
        mt = micro_tile_for(pattern, k)
        mt_name = f"{mt[0]}x{mt[1]}"
        bb = bsr_blocksize(mt, m, k, n)
        env.setdefault("bsr_blocksize", {})[f"{size} {pattern}"] = bb
        t0 = time.perf_counter()
        try:
            op, op_err = pit_tvm.sparse_matmul(k, n, "float16", micro_tile=mt, target="cuda"), None
        except Exception as err:  # noqa: BLE001
            op, op_err = None, short_error(err)
            traceback.print_exc()
        env.setdefault("pit_compile_s", {})[f"{size} {pattern}"] = round(time.perf_counter() - t0, 1)
        print(f"[{size} {pattern}] PIT compile {time.perf_counter() - t0:.1f} s, BSR block {bb}", flush=True)

        for s in args.sparsities:
            grid = tile_pattern(m, k, mt, s, rng)
            density = float(grid.mean())
            mask = expand(torch.from_numpy(grid).to(dev), mt, (m, k))
            a = torch.randn(m, k, device=dev, dtype=torch.float16, generator=gen) * mask
            mask = None
            a_t = tvm.runtime.from_dlpack(a)
            ref = a.float() @ b.float()
            ref_max = ref.abs().max().clamp_min(1e-6)
            base = {"size": size, "pattern": pattern, "micro_tile": mt_name, "sparsity": float(s),
                    "density": density}
            here = []

            def record(method, fn=None, *, ms=None, check=True, error=None, note=None, rep=None):
                row = dict(base, method=method, ms=None, max_rel_err=None, error=error)
                if note:
                    row["note"] = note
                if error is None and fn is not None:
                    try:
                        if check:
                            out = fn()
                            torch.cuda.synchronize()
                            row["max_rel_err"] = float((out.float() - ref).abs().max() / ref_max)
                            out = None
                        row["ms"] = bench(fn) if rep is None else bench(fn, rep)
                    except Exception as err:  # noqa: BLE001 - one failing peer must not end the run
                        row["error"] = short_error(err)
                        traceback.print_exc()
                elif error is None:
                    row["ms"] = ms
                here.append(row)
                return row

            # cuBLAS dense
            cub = record("cublas", lambda: torch.matmul(a, b))

            # PIT
            if op is None:
                for meth in ("pit_total", "pit_index"):
                    record(meth, error=op_err)
            else:
                tot = record("pit_total", lambda: torch.from_dlpack(op(a_t, b_t)))
                idx = record("pit_index", lambda: op.index(a_t), check=False)
                if tot["ms"] is not None and idx["ms"] is not None:
                    record("pit_kernel", ms=tot["ms"] - idx["ms"], note="derived: total - index")
                try:
                    wall = median_ms(lambda: op(a_t, b_t), tvm.cuda(0), repeat=10, warmup=2)
                    record("pit_total_wallclock", ms=wall)
                except Exception as err:  # noqa: BLE001
                    record("pit_total_wallclock", error=short_error(err))

            # one read of A: the floor of any index under the same cache state
            if read_once_fn is None:
                record("read_a", error=read_err)
            else:
                record("read_a", read_once_fn(a), check=False)

            # row-pattern peers
            if pattern == "row":
                def gather_mm_scatter():
                    rows_nz = torch.nonzero((a != 0).any(1)).squeeze(1)          # host sync
                    c = torch.zeros(m, n, device=dev, dtype=torch.float16)
                    c[rows_nz] = a[rows_nz] @ b
                    return c

                record("torch_gather_mm_scatter", gather_mm_scatter)
                if trg is None:
                    for meth in ("triton_gather_torch_index", "triton_gather_triton_index", "triton_gather_kernel"):
                        record(meth, error=trg_err)
                else:
                    try:
                        cfg, kern_ms, failed = trg.tune(a, b, lambda f: bench(f, 25))
                        env.setdefault("triton_configs", {})[f"{size} s={s:g}"] = list(cfg)
                        if failed:
                            env.setdefault("triton_config_failures", {})[f"{size} s={s:g}"] = failed
                    except Exception as err:  # noqa: BLE001
                        cfg, tune_err = None, short_error(err)
                        traceback.print_exc()
                    if cfg is None:
                        for meth in ("triton_gather_torch_index", "triton_gather_triton_index",
                                     "triton_gather_kernel"):
                            record(meth, error=tune_err)
                    else:
                        def tri_torch_index(cfg=cfg):
                            i, c_ = trg.index_torch_ops(a)
                            out = torch.zeros(m, n, device=dev, dtype=torch.float16)
                            return trg.gather_mm_into(a, b, out, i, c_, cfg)

                        def tri_triton_index(cfg=cfg):
                            i, c_ = trg.index_triton(a)
                            out = torch.zeros(m, n, device=dev, dtype=torch.float16)
                            return trg.gather_mm_into(a, b, out, i, c_, cfg)

                        record("triton_gather_torch_index", tri_torch_index)
                        record("triton_gather_triton_index", tri_triton_index)
                        pre_i, pre_c = trg.index_torch_ops(a)
                        out_pre = torch.zeros(m, n, device=dev, dtype=torch.float16)
                        record("triton_gather_kernel", lambda: trg.gather_mm_into(a, b, out_pre, pre_i, pre_c, cfg),
                               note=f"config {cfg}")

                        def check_index():
                            i, c_ = trg.index_triton(a)
                            want = torch.nonzero((a != 0).any(1)).squeeze(1).to(torch.int32)
                            if int(c_.item()) != want.numel() or not torch.equal(i[: want.numel()], want):
                                raise AssertionError("Triton row index differs from torch.nonzero")
                            return i

                        try:
                            check_index()
                            record("triton_row_index", lambda: trg.index_triton(a), check=False)
                        except Exception as err:  # noqa: BLE001
                            record("triton_row_index", error=short_error(err))

            # torch BSR (Triton kernel for fp16 square power-of-two blocks) and CSR (cuSPARSE)
            record("torch_bsr", lambda: a.to_sparse_bsr((bb, bb)) @ b, note=f"block {bb}x{bb}")
            try:
                a_bsr = a.to_sparse_bsr((bb, bb))
                record("torch_bsr_matmul_only", lambda: a_bsr @ b, note=f"block {bb}x{bb}")
            except Exception as err:  # noqa: BLE001
                a_bsr = None
                record("torch_bsr_matmul_only", error=short_error(err))
            a_bsr = None
            record("torch_csr", lambda: a.to_sparse_csr() @ b)
            try:
                a_csr = a.to_sparse_csr()
                record("torch_csr_matmul_only", lambda: a_csr @ b)
            except Exception as err:  # noqa: BLE001
                a_csr = None
                record("torch_csr_matmul_only", error=short_error(err))
            a_csr = None

            # roofline
            if cub["ms"] is not None:
                rl = roofline(density, cub["ms"], m, k, n, bandwidth)
                record("roofline", ms=rl["ms"], note=f"compute {rl['compute_ms']:.4f} ms, "
                       f"memory {rl['memory_ms']:.4f} ms ({rl['bytes'] / 2**20:.0f} MiB)")
            else:
                record("roofline", error="error: no cuBLAS time")

            add_speedups(here)
            rows.extend(here)
            print(f"[{size} {pattern} s={s:g}] " + "  ".join(summary(r) for r in here), flush=True)
            a = a_t = ref = None                     # free before the next pattern
            torch.cuda.empty_cache()
        op = None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096], help="M=K=N values (default 4096)")
    p.add_argument("--sparsities", type=float, nargs="+", default=list(SPARSITIES))
    p.add_argument("--patterns", nargs="+", default=list(PATTERNS), help="row, 1x64, 32x1, 32x64 or any RxC")
    p.add_argument("--warmup", type=float, default=25.0, help="warm-up per method, ms")
    p.add_argument("--rep", type=float, default=100.0, help="measuring time per method, ms")
    p.add_argument("--l2", choices=L2_STATES, default="clean",
                   help="L2 state before each call: swept by a read (clean, default) or a write (dirty, "
                        "triton.testing.do_bench's)")
    p.add_argument("--name", default="gpu_matmul", help="output file stem")
    args = p.parse_args(argv)
    for pat in args.patterns:
        micro_tile_for(pat, min(args.sizes))

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_matmul.py needs a CUDA device")
    import warnings

    warnings.filterwarnings("ignore", message=".*non-optimal triton kernel parameters.*")
    warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
    warnings.filterwarnings("ignore", message=".*Sparse BSR tensor support is in beta.*")
    torch.backends.cuda.matmul.allow_tf32 = False        # the float32 reference stays float32

    bench, timing = make_bench(torch, args.warmup, args.rep, args.l2)
    src = torch.empty(128 * 2**20, device="cuda", dtype=torch.float16)    # 256 MiB, > L2
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    bandwidth = copy_bandwidth_GBps(src.numel() * src.element_size(), copy_ms)
    src = dst = None
    print(f"device-to-device copy: {bandwidth:.0f} GB/s", flush=True)

    env = environment(torch.cuda.get_device_name(0))
    env["cuda"] = torch.version.cuda
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    env["command"] = "python3 benchmarks/gpu_matmul.py" + (" " + shlex.join(argv) if argv else "")
    env["shape"] = "M=K=N=" + "/".join(map(str, args.sizes)) + ", float16 in and out, fp32 accumulate"
    env["timing"] = timing
    env["copy_bandwidth_GBps"] = bandwidth
    env["pit_note"] = ("PIT kernel = PIT total - PIT index (derived); PIT total is one call of the op: the index build with the device-side dense fallback (density_threshold 0.9; for micro-tiles under 16 bytes wide the same pass writes the compacted A, so PIT index includes it) and the kernel, the index and C allocated every call from the Relax VM's pooled allocator; PIT is called on TVM tensors wrapping the torch tensors (DLPack, zero copy)")
    rows: list[dict] = []
    t_start = time.perf_counter()
    for size in args.sizes:
        run_size(size, args, torch, bench, bandwidth, env, rows)
    env["wall_s"] = round(time.perf_counter() - t_start, 1)

    json_path, png_path = write_results(args.name, env, rows, facet_plot(rows, env))
    out_dir = os.environ.get("OUT")
    md_path = (os.path.join(out_dir, f"{args.name}.md") if out_dir else
               os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", f"{args.name}.md"))
    with open(md_path, "w") as f:
        f.write(render(env, rows, f"results/{args.name}.json", f"results/{args.name}.png"))
    print("written:", json_path, png_path, md_path)
    print(f"total {env['wall_s']} s")


if __name__ == "__main__":
    main()
