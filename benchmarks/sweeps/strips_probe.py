"""The one-pass tiles index (pit_tvm.schedules.wgmma_strips) alone: strips + pack kernel time
against one read of A at the measured copy bandwidth, for the benchmark shapes.

    python3 benchmarks/sweeps/strips_probe.py            # table
    ncu ... python3 benchmarks/sweeps/strips_probe.py --ncu 4096 4096 1 0.9    # a target for ncu
"""
import argparse
import numpy as np, torch, tvm
from triton.testing import do_bench
from pit_tvm.testing import tiles_inputs
from pit_tvm.schedules.wgmma_strips import compacts, strip_list_func, strip_pack_func, strip_state_words
from pit_tvm.target import build

dev = tvm.cuda(0)
T = tvm.runtime.from_dlpack


def kernels(m, k, mk, s):
    a, _, _, _ = tiles_inputs(m, k, 16, (32, mk), s, "float16", seed=0)
    lister = build(tvm.IRModule({"main": strip_list_func(k, mk)}), "cuda:sm_90a")["main"]
    packer = build(tvm.IRModule({"main": strip_pack_func(k, mk, 0.9)}), "cuda:sm_90a")["main"]
    g = strip_state_words(m)
    at = tvm.runtime.tensor(a, dev)
    bufs = [tvm.runtime.tensor(np.zeros(g), dev), tvm.runtime.empty((g,), "int32", dev),
            tvm.runtime.empty((g * (k // mk),), "int32", dev)]
    ac = [tvm.runtime.empty((m, k), "float16", dev)] if compacts(mk) else []
    out = [tvm.runtime.empty((g + 1,), "int32", dev), tvm.runtime.empty((g * (k // mk),), "int32", dev)]
    return (lambda: lister(at, *bufs, *ac)), (lambda: packer(bufs[1], bufs[2], *out))


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--ncu", nargs=4, metavar=("M", "K", "MK", "SPARSITY"), help="run one shape a few times (a target for ncu)")
ARGS = parser.parse_args()
if ARGS.ncu:
    m, k, mk = (int(x) for x in ARGS.ncu[:3])
    s = float(ARGS.ncu[3])
    run, pack = kernels(m, k, mk, s)
    for _ in range(3):
        run(); pack()
    dev.sync()
    sys.exit()
x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
bw = 2 * x.numel() / (do_bench(lambda: y.copy_(x)) * 1e-3) / 1e9
print(f"copy bandwidth {bw:.0f} GB/s")
for m, k, mk, s in [(4096, 4096, 1, 0.5), (4096, 4096, 1, 0.9), (4096, 4096, 1, 0.99), (4096, 4096, 64, 0.5),
                    (4096, 4096, 64, 0.99), (4096, 8192, 1, 0.9)]:
    run, pack = kernels(m, k, mk, s)
    t_list, t_pack = do_bench(run) * 1e3, do_bench(pack) * 1e3
    read = m * k * 2 / bw / 1e3
    print(f"{m}x{k} mk={mk} s={s}: strips {t_list:6.1f} us  pack {t_pack:5.1f} us  one read {read:5.1f} us "
          f"-> {(t_list + t_pack) / read:4.2f}x", flush=True)
