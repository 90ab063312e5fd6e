"""``pit-tvm compile MODEL.onnx --target cuda|llvm [--sparse NAME[:MxK]]... [--shape NAME=DxDx..]...
[--padding [MASK]] [--sample-inputs X.npz] [--tuning-log DIR] [--expected-density FRACTION] -o OUT[.so]``.

Imports the ONNX model, annotates its dynamic sparsity (automatically: relu, masks, padding; and
the ``--sparse`` tensors by ONNX name, with an optional micro-tile ``MxK``), lowers the annotated
matmuls to PIT kernels, builds, and exports ``OUT.so`` (+ ``OUT.so.json``; ``.so`` is appended to
an output name without it). Prints what was annotated and why.  ``--padding MASK`` (or
``--padding`` alone: the one input named like an attention mask) runs the token-wise matmuls on
the real tokens of that ``[batch, sequence]`` mask only (``compile_onnx(..., padding=)``): the
outputs at padded positions are not computed.  ``--sample-inputs X.npz`` (arrays named by the
model's inputs): the micro-tile of each activation-sparse matmul is chosen from its pattern on
those inputs (``compile_onnx(..., sample_inputs=)``), the choice printed in the table.
"""
from __future__ import annotations

import re
import sys

from pit_tvm.errors import UserError

_TILE = re.compile(r"^(?P<name>.+):(?P<m>\d+)x(?P<k>\d+)$")
_TILE_LIKE = re.compile(r"^.+:\d*[xX]\d*$")
_SHAPE = re.compile(r"^(?P<name>.+)=(?P<dims>\d+(x\d+)*)$")


def parse_shapes(items) -> dict:
    """``["x=32x128x768", "mask=32x128"]`` -> ``{"x": [32, 128, 768], "mask": [32, 128]}``."""
    out = {}
    for item in items or []:
        mt = _SHAPE.match(item)
        if not mt:
            raise UserError(f"--shape {item!r}: expected NAME=DIMxDIM..., e.g. input_ids=32x128")
        out[mt["name"]] = [int(d) for d in mt["dims"].split("x")]
    return out


def parse_sparse(items) -> dict:
    """``["hidden", "h2:1x64"]`` -> ``{"hidden": None, "h2": (1, 64)}``.  A name may hold a
    colon (``input:0``); a suffix that looks like a micro-tile but is not one (``h:3x``,
    ``h:0x64``) is an error, not part of the name."""
    out = {}
    for item in items or []:
        mt = _TILE.match(item)
        if mt and int(mt["m"]) > 0 and int(mt["k"]) > 0:
            out[mt["name"]] = (int(mt["m"]), int(mt["k"]))
        elif mt or _TILE_LIKE.match(item):
            raise UserError(f"--sparse {item!r}: the micro-tile after ':' must be MxK with positive "
                             "integers, e.g. hidden:1x64")
        else:
            out[item] = None
    return out


def parse_micro_tile(text: str, flag: str = "--micro-tile") -> tuple[int, int]:
    """``"32x64"`` -> ``(32, 64)``; anything else is an error naming ``flag``"""
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise UserError(f"{flag} {text!r}: expected ROWSxCOLS with positive integers, e.g. 32x64")
    return int(parts[0]), int(parts[1])


def register(subparsers) -> None:
    p = subparsers.add_parser("compile", help="compile an ONNX model with PIT", description=__doc__.splitlines()[0])
    p.add_argument("model", help="ONNX model (.onnx)")
    p.add_argument("--target", default="llvm", help="llvm | cuda | cuda:sm_80 (default llvm)")
    p.add_argument("--sparse", action="append", default=[], metavar="NAME[:MxK]",
                   help="annotate ONNX tensor NAME as a sparse matmul operand (repeatable)")
    p.add_argument("--no-auto", action="store_true", help="only the --sparse annotations")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=DxD..",
                   help="compile for this static shape of input NAME (repeatable; default: symbolic dims stay symbolic)")
    p.add_argument("--padding", nargs="?", const=True, default=None, metavar="MASK",
                   help="the [batch, sequence] attention-mask input (1 real token, 0 padding): the token-wise "
                        "matmuls run on the real tokens only, outputs at padded positions are not computed; "
                        "without MASK the one input named like an attention mask (needs its shape static: --shape)")
    p.add_argument("--sample-inputs", default=None, metavar="X.npz",
                   help="typical inputs (an .npz, arrays named by the model's inputs): each activation-sparse "
                        "matmul's micro-tile (or dense) is chosen from its pattern on them")
    p.add_argument("--tuning-log", default=None, metavar="DIR", help="tuning database for the PIT kernels")
    p.add_argument("--expected-density", type=float, default=None, metavar="FRACTION",
                   help="fraction of rows the row-sparse PIT matmuls are expected to list (e.g. a sample "
                        "batch's mean attention mask); CUDA tile widths are planned for it (default: with --padding "
                        "and --sample-inputs, the samples' real-token fraction, else 0.5)")
    p.add_argument("--sparse-attention", default=None, metavar="NAME|off",
                   help="lower the attentions whose mask is computed from graph input NAME to block-sparse "
                        "attention, whatever the mask's shape; 'off': none (default: masks with a query axis)")
    p.add_argument("-o", "--output", required=True,
                   help="output library (.so is appended to a name that does not end in .so)")
    p.set_defaults(func=run)


def format_annotations(notes) -> str:
    if not notes:
        return "no dynamic sparsity annotated (every operator takes the dense path)"
    lines = []
    for n in notes:
        tile = "x".join(str(x) for x in n.get("micro_tile", [])) or "-"
        rule = n.get("rule", "-")
        lines.append(f"  {n['tensor']:<24} {n['status']:<6} source={n['source']:<28} tile={tile:<8} "
                     f"rule={rule:<15} {n['reason']}")
    return "annotated:\n" + "\n".join(lines)


def run(args) -> int:
    import warnings  # noqa: PLC0415

    from pit_tvm.compile import compile_onnx, export_path  # noqa: PLC0415 - compiler side, imported lazily

    output = export_path(args.output)        # a missing directory: an error before compiling
    sparse, shapes = parse_sparse(args.sparse) or None, parse_shapes(args.shape) or None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cm = compile_onnx(args.model, target=args.target, sparse=sparse, tuning_log=args.tuning_log,
                              auto=not args.no_auto, shapes=shapes, expected_density=args.expected_density,
                              padding=args.padding, sample_inputs=args.sample_inputs,
                              sparse_attention=False if args.sparse_attention == "off" else args.sparse_attention)
    except (ValueError, FileNotFoundError) as err:   # the compiler's bad-argument errors
        raise UserError(str(err)) from err
    for w in caught:     # ours (not TVM's or onnx's deprecation notes)
        if "pit_tvm" in w.filename or "pit" in str(w.message).lower() or "dense" in str(w.message):
            print(f"warning: {w.message}", file=sys.stderr)
    print(format_annotations(cm.annotations))
    path = cm.export(output)
    print(f"wrote {path} (+ {path}.json) for {cm.target.kind.name}")
    return 0
