"""``pit-tvm analyze FILE [--block NAME]``: print the PIT rules of every TensorIR function.

``FILE`` is either a TVMScript ``.py`` file (imported as a module by path; every global
``PrimFunc`` and every ``PrimFunc`` inside a global ``IRModule`` is analysed) or an ONNX
model (``.onnx``: imported with Relax's ONNX frontend and legalised with ``LegalizeOps`` so
that every operator becomes a ``PrimFunc``, named by its global symbol).
"""
from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path

from pit_tvm.errors import UserError

SUPPORTED = (".py", ".onnx")


class AnalyzeError(UserError):
    """A user-facing problem with the input file (reported without a traceback by ``main``)."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="print which block axes are PIT (permutation-invariant) axes",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("file", help="TVMScript .py file or ONNX .onnx model")
    parser.add_argument("--block", default=None, help="analyse only the sblock with this name")
    parser.set_defaults(func=run)


def run(args) -> int:
    print(analyze_file(args.file, block=args.block))   # an AnalyzeError: printed by main, exit 2
    return 0


def analyze_file(path, block: str | None = None) -> str:
    """Return the formatted rules of every PrimFunc in ``path`` (see the module docstring)."""
    from pit_tvm.rules import find_pit_rules, format_rules

    funcs = load_prim_funcs(path)
    if not funcs:
        raise AnalyzeError(f"{path}: no TensorIR PrimFunc found")
    sections = []
    for name, func in funcs:
        if block is not None and block not in _block_names(func):
            continue
        rules = find_pit_rules(func, block=block)
        sections.append(f"== {name} ==\n{format_rules(rules)}")
    if not sections:
        raise AnalyzeError(
            f"no sblock named {block!r} in {path}; the functions are "
            + "; ".join(f"{name}: {_block_names(func)}" for name, func in funcs)
        )
    return "\n\n".join(sections)


def load_prim_funcs(path) -> list[tuple[str, object]]:
    """``[(name, PrimFunc)]`` from a TVMScript ``.py`` file or an ``.onnx`` model."""
    path = Path(path)
    if not path.exists():
        raise AnalyzeError(f"{path}: no such file")
    if not path.is_file():
        raise AnalyzeError(f"{path}: not a regular file")
    suffix = path.suffix.lower()
    if suffix == ".py":
        return _from_tvmscript(path)
    if suffix == ".onnx":
        return _from_onnx(path)
    raise AnalyzeError(
        f"{path}: unsupported extension {path.suffix or '(none)'!r}; expected one of "
        f"{', '.join(SUPPORTED)}"
    )


def _block_names(func) -> list[str]:
    from pit_tvm.rules.analysis import _collect_blocks

    return [r.block.name_hint for r in _collect_blocks(func.body)]


def _module_prim_funcs(prefix: str, mod) -> list[tuple[str, object]]:
    from tvm import tirx

    out = []
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            symbol = func.attrs.get("global_symbol") if func.attrs is not None else None
            out.append((f"{prefix}{symbol or gv.name_hint}", func))
    return sorted(out, key=lambda item: item[0])


def _from_tvmscript(path: Path) -> list[tuple[str, object]]:
    import tvm
    from tvm import tirx

    # A unique module name, registered only while the file runs: the TVMScript parser looks
    # the defining module up in sys.modules to resolve the names a function refers to.
    name = f"_pit_analyze_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - any failure of the user's file is reported
        raise AnalyzeError(f"{path}: failed to import: {type(err).__name__}: {err}") from err
    finally:
        sys.modules.pop(name, None)
    funcs = []
    for name, value in vars(module).items():
        if name.startswith("__"):
            continue
        if isinstance(value, tirx.PrimFunc):
            funcs.append((name, value))
        elif isinstance(value, tvm.IRModule):
            funcs.extend(_module_prim_funcs(f"{name}.", value))
    return funcs


def _from_onnx(path: Path) -> list[tuple[str, object]]:
    import onnx
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    try:
        model = onnx.load(str(path))
    except Exception as err:  # noqa: BLE001 - a corrupt model is a user error
        raise AnalyzeError(f"{path}: not a readable ONNX model: {err}") from err
    try:
        mod = from_onnx(model)
    except Exception as err:  # noqa: BLE001 - unsupported operators etc.
        raise AnalyzeError(f"{path}: Relax ONNX import failed: {type(err).__name__}: {err}") from err
    mod = relax.transform.LegalizeOps()(mod)
    return _module_prim_funcs("", mod)
