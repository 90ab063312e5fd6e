"""fc1 of the OPT FFN (M 4096, K 2048, N 8192, fp16, bias + ReLU) as the dense wgmma kernel, and
as the kernel that also lists fc2's strips (``strips_mk``), against the dense kernel followed by
the one-pass strips kernel on its output; device time per kernel, L2 flushed.

    python3 benchmarks/sweeps/strips_producer.py [PATTERN ...]   (ffn, ffn8: the FFN's biases, 128x1 or
                                                            128x8 micro-tiles; none, all: every
                                                            column zero / non-zero)
"""
import argparse
import sys

import numpy as np
import torch
import tvm

from pit_tvm.schedules.wgmma import wgmma_row_gather_func
from pit_tvm.schedules.wgmma_strips import compacts, strip_list_func, strip_state_words
from pit_tvm.target import build

sys.path.insert(0, "benchmarks")
from common import kernel_split_us  # noqa: E402
from pit_tvm.testing import ffn_biases  # noqa: E402

m, k, n = 4096, 2048, 8192
g = strip_state_words(m)
x = torch.randn(m, k, device="cuda", dtype=torch.float16)
w = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
T = tvm.runtime.from_dlpack


def built(func, name):
    return build(tvm.IRModule({name: func.with_attr("global_symbol", name)}), "cuda:sm_90a")[name]


def kernel(mk):
    return built(wgmma_row_gather_func(k, n, "float16", "float16", bias=True, relu=True, dense=True, strips_mk=mk),
                 f"fc1_listing_{mk}" if mk else "fc1_dense")


dense = kernel(0)
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("patterns", nargs="*", default=["ffn", "ffn8", "none", "all"], choices=["ffn", "ffn8", "none", "all"])
for pattern in parser.parse_args().patterns:
    mk = 8 if pattern == "ffn8" else 1
    bias = {"none": np.full(n, -100.0), "all": np.full(n, 100.0)}.get(pattern, None)
    bias = ffn_biases(n) if bias is None else bias
    bias_t = torch.from_numpy(bias.astype("float16")).cuda()
    fused, lister = kernel(mk), built(strip_list_func(n, mk), f"strip_list_{mk}")
    state = torch.zeros(g, dtype=torch.float64, device="cuda")
    c = torch.empty(m, n, dtype=torch.float16, device="cuda")
    cnt = torch.empty(g, dtype=torch.int32, device="cuda")
    sids = torch.empty(g * n // mk, dtype=torch.int32, device="cuda")
    ac = [T(torch.empty(m, n, dtype=torch.float16, device="cuda"))] if compacts(mk) else []
    args = [T(x), T(w), T(bias_t)]
    dense_split = kernel_split_us(lambda: (flush.zero_(), dense(*args, T(c)), lister(T(c), T(state), T(cnt), T(sids), *ac)))
    fused_split = kernel_split_us(lambda: (flush.zero_(), fused(*args, T(state), T(c), T(cnt), T(sids), *ac)))
    listed = cnt.sum().item() / (g * n // mk)
    times = {name.split("_kernel")[0]: us for name, us in list(dense_split.items()) + list(fused_split.items())
             if name.startswith(("fc1_", "strip_"))}
    print(f"{pattern:5s} mk={mk} listed {listed:.3f}: " + "  ".join(f"{nm} {us:.1f}" for nm, us in times.items()),
          flush=True)
