"""Trial (recorded in pit_tvm/schedules/wgmma_strips.py's docstring): the one-pass strips kernel
alone against variants of it made by substituting its source, device time with L2 flushed
(``common.kernel_split_us``), and a minimal Triton read of A (``peers/read_once.py``) in the
same state; 4096 x 4096 fp16, gpu_matmul.py's random patterns.  Variants: ``noearly`` (mk = 64
reads all 128 rows at once, not rows 0..31 first), ``noatomic0`` (a CTA that lists nothing skips
the atomic add; timing only: a strip whose last CTA lists nothing is never closed), ``both``,
``flat`` (the compacted columns stored as (row, slot) pairs, 256 at a time, instead of a thread
per output slot walking the rows).  For mk < 8 each variant's compacted A is checked
(``ok``: column j of a strip's Ac is A's column strip_ids[j]).

    python3 benchmarks/_strips_variants.py
"""
import sys, types, inspect
import numpy as np, torch, tvm
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "tests")
from common import kernel_split_us
from gpu_matmul import expand, tile_pattern
from peers.read_once import read_once_fn
import pit_tvm.schedules.wgmma_strips as ws
from pit_tvm.target import build

SRC = inspect.getsource(ws)
FLAT_OLD = """\
                if tid % COLS < inf[0] * MK:
                    col[0] = src[tid % COLS]
                    for i in T.serial(BLOCK_M // SLOT_ROWS):
                        if g * BLOCK_M + tid // COLS + SLOT_ROWS * i < m:
                            AC[g * BLOCK_M + tid // COLS + SLOT_ROWS * i, inf[1] * MK + tid % COLS] = BSL
                                tile[(tid // COLS + SLOT_ROWS * i) * COLS + col[0]]""".replace("BSL", chr(92))
FLAT_NEW = """\
                for it in T.serial((BLOCK_M * inf[0] * MK + THREADS - 1) // THREADS):
                    if it * THREADS + tid < BLOCK_M * inf[0] * MK:
                        if g * BLOCK_M + (it * THREADS + tid) // (inf[0] * MK) < m:
                            AC[g * BLOCK_M + (it * THREADS + tid) // (inf[0] * MK),
                               inf[1] * MK + (it * THREADS + tid) % (inf[0] * MK)] = BSL
                                tile[(it * THREADS + tid) // (inf[0] * MK) * COLS + src[(it * THREADS + tid) % (inf[0] * MK)]]""".replace("BSL", chr(92))
SUBS = {
    "base": [],
    "noearly": [("FIRST_LOADS = 1 if NMT == 1 else LOADS", "FIRST_LOADS = LOADS")],
    "noatomic0": [("        if tid == 0:\n            if g < G:\n                inf[0] = n_listed[0]",
                   "        if tid == 0:\n            last[0] = 0\n            base[0] = 0\n            inf[0] = n_listed[0]\n            if g < G and inf[0] > 0:\n                inf[0] = n_listed[0]")],
}
SUBS["both"] = SUBS["noearly"] + SUBS["noatomic0"]
SUBS["flat"] = [(FLAT_OLD, FLAT_NEW)]


def load_variant(name, src):
    """the variant as a module of its own file (TVMScript parses functions from their source)"""
    import importlib.util, tempfile, os
    path = os.path.join(tempfile.mkdtemp(), f"strips_{name}.py")
    with open(path, "w") as fh:
        fh.write(src)
    spec = importlib.util.spec_from_file_location(f"strips_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


dev = tvm.cuda(0)
flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
m = k = 4096
for mk, mt in [(1, (32, 1)), (64, (32, 64))]:
    for s in (0.5, 0.9, 0.99):
        mask = expand(tile_pattern(m, k, mt, s, np.random.default_rng(0)), mt, (m, k))
        a = torch.randn(m, k, device="cuda", dtype=torch.float16) * torch.from_numpy(mask).cuda()
        rd = read_once_fn(a)
        t_read = kernel_split_us(lambda: (flush.zero_(), rd()))
        t_read = [v for n_, v in t_read.items() if "or_words" in n_][0]
        at = tvm.runtime.from_dlpack(a)
        cells = [f"read {t_read:.1f}"]
        for name, subs in SUBS.items():
            src = SRC
            for old, new in subs:
                assert old in src, (name, old)
                src = src.replace(old, new)
            mod = load_variant(name, src)
            f = build(tvm.IRModule({"main": mod.strip_list_func(k, mk)}), "cuda:sm_90a")["main"]
            g = ws.strip_state_words(m)
            bufs = [tvm.runtime.tensor(np.zeros(g), dev), tvm.runtime.empty((g,), "int32", dev),
                    tvm.runtime.empty((g * (k // mk),), "int32", dev)]
            ac = [tvm.runtime.empty((m, k), "float16", dev)] if ws.compacts(mk) else []
            t = kernel_split_us(lambda: (flush.zero_(), f(at, *bufs, *ac)))
            ok = ""
            if ac:   # the compacted columns: Ac[strip rows, j] == A[strip rows, strip_ids[j]]
                bufs[0].copyfrom(np.zeros(g)); f(at, *bufs, *ac)
                cnt, sid, acn, an = bufs[1].numpy(), bufs[2].numpy(), ac[0].numpy(), a.cpu().numpy()
                good = all(np.array_equal(acn[128 * gg:128 * gg + 128, :cnt[gg]],
                                          an[128 * gg:128 * gg + 128, sid[gg * k:gg * k + cnt[gg]]]) for gg in range(g))
                ok = " ok" if good else " WRONG"
            t = sum(v for n_, v in t.items() if "main" in n_ or "kernel" in n_ and "elementwise" not in n_ and "fill" not in n_)
            cells.append(f"{name} {t:.1f}{ok}")
        print(f"mk={mk} s={s}: " + "  ".join(cells), flush=True)
