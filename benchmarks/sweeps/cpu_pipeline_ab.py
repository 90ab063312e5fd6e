"""The CPU Relax pipeline with and without its elementwise stage (``ErfToFastErf`` +
``CPUElementwise``) on the CPU BERT of ``benchmarks/models.py --device cpu`` (4 layers, hidden
256, 16 x 64 tokens, fp32), both builds, calls interleaved (this box is noisy): median ms and
the largest output difference.

    python3 benchmarks/sweeps/cpu_pipeline_ab.py
"""
import argparse
import sys
import time
import warnings

import numpy as np
import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu
from tvm.s_tir import dlight as dl

sys.path.insert(0, "benchmarks")
from pit_tvm import testing as W  # noqa: E402
from pit_tvm import target as T  # noqa: E402
from pit_tvm.compile import compile_onnx  # noqa: E402
from pit_tvm.schedules.cpu_batched_matmul import CPUBatchedMatmul  # noqa: E402

argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

warnings.simplefilter("ignore")
rng = np.random.default_rng(0)
lengths = rng.integers(8, 65, size=16)
model, inputs = W.bert_encoder(4, 256, 4), W.bert_inputs(256, batch=16, seq=64, lengths=lengths, seed=1)
tgt = T.make_target("llvm")
without = tvm.transform.Sequential(cpu.library_dispatch_passes(tgt) + cpu.legalize_passes(tgt)
                                   + [dl.ApplyDefaultSchedule(CPUBatchedMatmul())] + cpu.dataflow_lower_passes(tgt)
                                   + cpu.finalize_passes(tgt) + [T.mark_shape_funcs_noalias])
for pit in (True, False):
    cm = compile_onnx(model, "llvm", auto=pit, shapes={n: list(v.shape) for n, v in inputs.items()})
    vms = {"without": relax.VirtualMachine(tvm.compile(cm.lowered, target=tgt, relax_pipeline=without), tvm.cpu()),
           "with": relax.VirtualMachine(tvm.compile(cm.lowered, target=tgt, relax_pipeline=T.cpu_relax_pipeline(tgt)),
                                        tvm.cpu())}
    args = [tvm.runtime.tensor(np.ascontiguousarray(inputs[i["name"]], dtype=i["dtype"])) for i in cm.inputs]
    out = {k: vm["main"](*args) for k, vm in vms.items()}
    diff = np.abs(out["without"].numpy() - out["with"].numpy()).max()
    times = {k: [] for k in vms}
    for _ in range(15):
        for k, vm in vms.items():
            t = time.perf_counter()
            vm["main"](*args)
            times[k].append((time.perf_counter() - t) * 1e3)
    print(f"{'PIT' if pit else 'PIT-off'}: without {np.median(times['without']):.1f} ms, "
          f"with {np.median(times['with']):.1f} ms, max |diff| {diff:.1e}", flush=True)
