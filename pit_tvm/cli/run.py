"""``pit-tvm run MODEL.so --inputs INPUTS.npz [--device cpu|cuda] [--bench]``.

Runs an exported model with the TVM runtime only (``pit_tvm.runtime``; fine under
``TVM_USE_RUNTIME_LIB=1``), prints each output's shape and stats; ``--bench`` prints the median
time per run.
"""
from __future__ import annotations

from pit_tvm.cli.main import positive_int
from pit_tvm.errors import UserError


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="run an exported model (runtime only)", description=__doc__.splitlines()[0])
    p.add_argument("model", help="library written by `pit-tvm compile`")
    p.add_argument("--inputs", required=True, help=".npz with one array per model input")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument("--bench", action="store_true", help="also print the median time per run")
    p.add_argument("--repeat", type=positive_int, default=20, help="timed runs for --bench (default 20)")
    p.set_defaults(func=run)


def read_inputs(path, input_names) -> dict:
    """``{name: array}`` from the ``.npz`` at ``path``; a ``UserError`` when it is not one."""
    import zipfile  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    try:
        data = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        raise UserError(f"cannot read --inputs {path}: {err}") from err
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise UserError(f"--inputs {path} is one array, not an .npz of named inputs "
                        f"(np.savez(path, {'=..., '.join(input_names)}=...))")
    with data:
        try:
            return {k: data[k] for k in data.files}
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:   # a corrupt member
            raise UserError(f"cannot read --inputs {path}: {err}") from err


def run(args) -> int:
    import numpy as np  # noqa: PLC0415

    from pit_tvm.runtime import load  # noqa: PLC0415 - runtime side only
    from pit_tvm.runtime.loader import inputs_by_name  # noqa: PLC0415

    model = load(args.model, device=args.device)     # a bad file or device: UserError, exit 2
    inputs = read_inputs(args.inputs, model.input_names)
    try:
        inputs_by_name(model.input_names, inputs)
    except UserError as err:
        raise UserError(f"--inputs {args.inputs}: {err}") from err
    try:
        outs = model.run(inputs)
    except (ValueError, TypeError) as err:      # a shape or dtype the model does not take
        raise UserError(err) from err
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
