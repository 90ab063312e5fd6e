"""Per-kernel device time of one compiled-model call (torch.profiler), top kernels first.

    python3 benchmarks/sweeps/model_kernels.py ffn|bert [--pit] [--symbolic]
    python3 benchmarks/sweeps/model_kernels.py minilm-l6|bert-base [--pit]   # real_models.py's exports

``minilm-l6`` / ``bert-base``: the ``transformers`` export of benchmarks/real_models.py (fp16,
32 x 128, lengths uniform in [16, 128]); ``--pit`` is its ``padding="attention_mask"`` build.
"""
import argparse
import os
import sys, tempfile, warnings
import numpy as np
import onnx
import tvm
sys.path.insert(0, "benchmarks")
from pit_tvm import testing as W
from common import kernel_split_us
from pit_tvm.compile import compile_onnx

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("model", choices=["ffn", "bert", "minilm-l6", "bert-base"])
parser.add_argument("--pit", action="store_true", help="the PIT build (default: PIT off)")
parser.add_argument("--symbolic", action="store_true", help="symbolic batch / sequence dims")
ARGS = parser.parse_args()
name, pit = ARGS.model, ARGS.pit
density = None         # (as benchmarks/models.py: BERT's from a sample batch of other lengths)
compile_kw = {}
if name in ("minilm-l6", "bert-base"):
    import real_models as RM
    inputs = RM.padded_batch(32, 128, 16, 0)
    path = os.path.join(tempfile.mkdtemp(), f"{name}.onnx")
    RM.export(RM.build_model(name, 0), inputs, path, "cpu")
    model = onnx.load(path)
    compile_kw = dict(padding="attention_mask", auto=True) if pit else dict(auto=False)
elif name == "ffn":
    model, inputs = W.opt_ffn(), W.opt_ffn_inputs(2048, batch=32, seq=128, seed=1)
else:
    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 129, size=32)
    model, inputs = W.bert_encoder(12, 768, 12), W.bert_inputs(768, batch=32, seq=128, lengths=lengths, seed=1)
    density = round(float(rng.integers(16, 129, size=32).mean()) / 128, 3)
model = W.to_float16(model)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    shapes = None if ARGS.symbolic else {n: list(v.shape) for n, v in inputs.items()}
    cm = compile_onnx(model, "cuda", shapes=shapes, expected_density=density if pit else None,
                      **(compile_kw or dict(auto=pit)))
dev = cm.device
args = [tvm.runtime.tensor(np.ascontiguousarray(inputs[i["name"]], dtype=i["dtype"]), dev) for i in cm.inputs]
main = cm._machine()["main"]
split = kernel_split_us(lambda: main(*args), iters=10)
total = sum(split.values())
print(f"{name} pit={pit}: device total {total:.0f} us over {len(split)} kernels")
for k, v in sorted(split.items(), key=lambda kv: -kv[1])[:40]:
    print(f"  {v:8.1f} us  {k[:90]}")
