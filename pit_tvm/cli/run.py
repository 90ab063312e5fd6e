"""``pit-tvm run MODEL.so --inputs INPUTS.npz [--device cpu|cuda] [--bench]``.

Runs an exported model with the TVM runtime only (``pit_tvm.runtime``; fine under
``TVM_USE_RUNTIME_LIB=1``), prints each output's shape and stats; ``--bench`` prints the median
time per run.
"""
from __future__ import annotations

import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="run an exported model (runtime only)", description=__doc__.splitlines()[0])
    p.add_argument("model", help="library written by `pit-tvm compile`")
    p.add_argument("--inputs", required=True, help=".npz with one array per model input")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument("--bench", action="store_true", help="also print the median time per run")
    p.add_argument("--repeat", type=int, default=20, help="timed runs for --bench (default 20)")
    p.set_defaults(func=run)


def run(args) -> int:
    import numpy as np  # noqa: PLC0415

    from pit_tvm.runtime import load  # noqa: PLC0415 - runtime side only

    model = load(args.model, device=args.device)
    with np.load(args.inputs) as data:
        inputs = {k: data[k] for k in data.files}
    missing = [n for n in model.input_names if n not in inputs]
    if missing:
        print(f"pit-tvm run: error: {args.inputs} lacks inputs {missing} (has {sorted(inputs)})", file=sys.stderr)
        return 2
    outs = model.run(inputs)
    names = model.output_names or [f"output{i}" for i in range(len(outs))]
    for name, out in zip(names, outs):
        stats = ""
        if out.size and np.issubdtype(out.dtype, np.number):
            f = out.astype("float64")
            stats = (f" mean={f.mean():.6g} std={f.std():.6g} min={f.min():.6g} max={f.max():.6g}"
                     f" zeros={float((out == 0).mean()):.3f}")
        print(f"{name}: shape={tuple(out.shape)} dtype={out.dtype}{stats}")
    if args.bench:
        t = model.benchmark(inputs, repeat=args.repeat)
        print(f"median time: {t * 1e3:.3f} ms over {args.repeat} runs ({model.device})")
    return 0
