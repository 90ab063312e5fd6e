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


def _error(message) -> int:
    print(f"pit-tvm run: error: {message}", file=sys.stderr)
    return 2


def run(args) -> int:
    import zipfile  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    from pit_tvm.runtime import load  # noqa: PLC0415 - runtime side only

    try:
        model = load(args.model, device=args.device)
    except (ValueError, OSError) as err:
        return _error(err)
    try:
        data = np.load(args.inputs, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile) as err:
        return _error(f"cannot read --inputs {args.inputs}: {err}")
    if not isinstance(data, np.lib.npyio.NpzFile):
        return _error(f"--inputs {args.inputs} is one array, not an .npz of named inputs "
                      f"(np.savez(path, {'=..., '.join(model.input_names)}=...))")
    with data:
        inputs = {k: data[k] for k in data.files}
    missing = [n for n in model.input_names if n not in inputs]
    if missing:
        return _error(f"{args.inputs} lacks inputs {missing} (has {sorted(inputs)})")
    try:
        outs = model.run(inputs)
    except (ValueError, TypeError) as err:      # a shape or dtype the model does not take
        return _error(err)
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
