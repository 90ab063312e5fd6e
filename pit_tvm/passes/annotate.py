"""``AnnotateDynamicSparsity``: find the matmuls whose left operand has dynamic sparsity.

Sources detected on the Relax module imported from ONNX (``R.matmul`` from MatMul/Gemm):

* ``relu``: the left operand is produced by ``R.nn.relu`` (possibly through reshape, permute_dims,
  expand_dims, squeeze, astype): activation sparsity, micro-tile ``(32, 1)`` by default
  (a strip of 32 tokens x one channel: neurons silent for most tokens, as in OPT).
* ``mask:<input>``: the left operand is ``R.multiply(x, m)`` or ``R.where(m, x, 0)`` where ``m`` is
  computed only from runtime graph inputs that look like masks (name contains ``mask``, or an
  integer/bool input). A mask broadcast over the last axis (``[..., 1]``) zeroes whole rows:
  micro-tile ``(1, K)``.
* ``padding:<input>``: as ``mask`` when that input is named like ``attention_mask``, ``*_mask``,
  ``seq_len*`` or ``*lengths``. Such inputs are also recorded (module attr ``pit.padding_inputs``)
  even when no matmul consumes them through a mask (a real export's attention mask only biases
  the scores: :class:`~pit_tvm.passes.PropagatePadding`, run after this pass, then finds the
  token-wise matmuls whose padded rows are not needed).
* ``explicit``: ``sparse={"hidden": (1, 64)}`` or ``sparse=["hidden"]`` names ONNX tensors (resolved
  through the ``pit.onnx_names`` module attr that :func:`~pit_tvm.passes.import_onnx` writes, else
  by Relax var name). The matmuls that read the tensor as left operand (or that produce it) are
  annotated. Unknown names raise ``ValueError`` listing the valid names.

How the annotation is recorded (visible in printed IR): each annotated ``R.matmul(a, b)`` becomes a
call to a private Relax function ``pit_matmul_<i>(a, b)`` whose body is the same matmul and whose
attrs are ``{"pit.sparse_operand": "lhs", "pit.micro_tile": [m, k], "pit.rule": ...,
"pit.source": ..., "pit.tensor": <onnx name of a>, "pit.reason": ...}``. ``LowerToPIT`` replaces
those calls; without it the module still builds (dense). Every decision, including the matmuls
left dense with a ``warnings.warn`` (B not a static 2-D ``[K, N]`` tensor, unsupported dtype, ...),
is also listed in ``main``'s attr ``pit.annotations``; :func:`annotations_of` reads it back.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Mapping

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx

from ..errors import UserError
from .frontend import ONNX_NAMES_ATTR
from .graph import FuncGraph, op_name

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_MICRO_TILE = (32, 1)   # neuron-structured activation sparsity: strips of tokens x one channel
PIT_RULE_ATTR = "pit.rule"
ANNOTATIONS_ATTR = "pit.annotations"
PADDING_INPUTS_ATTR = "pit.padding_inputs"
#: wrapper attr: the wrapper takes a third argument, the row mask its rows index is built from
ROW_MASK_ATTR = "pit.row_mask_arg"

# zero-preserving, shape-only ops between the sparse producer and the matmul
_TRANSPARENT = {
    "relax.reshape", "relax.permute_dims", "relax.expand_dims", "relax.squeeze",
    "relax.astype", "relax.flatten", "relax.broadcast_to",
}
PADDING_RE = re.compile(
    r"(attention_mask|attn_mask|padding_mask|input_mask|key_padding_mask|.*seq_?len.*|.*lengths?)$",
    re.IGNORECASE,
)
_MASK_RE = re.compile(r"mask", re.IGNORECASE)


def rule_for_tile(micro_tile, k) -> str:
    """The PIT rule recorded for a sparse-lhs micro-tile ``(m, k)`` of ``a[M, K]``.

    Whole rows (``k >= K``): the spatial axis M is permuted, SRead gathers the non-zero rows of A
    and SWrite scatters the output rows -> ``"M:SRead+SWrite"``. Narrower tiles: the reduction
    axis K is permuted per strip of ``m`` rows, SRead gathers A's non-zero micro-tiles and the
    matching rows of B -> ``"K:SRead"`` (what ``pit_tvm.ops.matmul`` implements for each).
    """
    return "M:SRead+SWrite" if int(micro_tile[1]) >= int(k) else "K:SRead"


def _static_int(dim):
    return int(dim.value) if isinstance(dim, tirx.IntImm) else None


def _is_zero_const(expr) -> bool:
    if isinstance(expr, tvm.ir.GenericConst):
        try:
            return not np.any(expr.value.numpy())
        except Exception:  # noqa: BLE001
            return False
    return False


def _is_mask_input(param) -> bool:
    ty = param.ty
    # TensorType.dtype is a PrimType in TVM 0.27, not a string.
    dtype = str(ty.dtype) if isinstance(ty, relax.TensorType) else "float32"
    return bool(_MASK_RE.search(param.name) or PADDING_RE.match(param.name)) or not (
        dtype.startswith(("float", "bfloat"))
    )


def sparse_annotations(sparse) -> dict:
    """The ``sparse=`` argument checked and normalised to ``{tensor name: (m, k) or None}``.

    Accepted: ``None``; a list / tuple / set of ONNX tensor names; a dict ``{name: None or
    (m, k)}`` with positive int ``m``, ``k``. Anything else is an error naming the bad value and
    what is expected (a bare string would otherwise be read as a list of one-letter names)."""
    expected = "a dict {tensor name: None or (m, k)} or a list of tensor names"
    if sparse is None:
        return {}
    if isinstance(sparse, (list, tuple, set, frozenset)):
        sparse = {name: None for name in sparse}
    elif not isinstance(sparse, Mapping):
        hint = f" (for one tensor: [{sparse!r}])" if isinstance(sparse, str) else ""
        raise TypeError(f"sparse= must be {expected}, got {type(sparse).__name__} {sparse!r}{hint}")
    out = {}
    for name, tile in sparse.items():
        if not isinstance(name, str) or not name:
            raise UserError(f"sparse=: tensor names are non-empty strings, got {name!r}")
        if tile is not None:
            if isinstance(tile, (str, bytes)) or not hasattr(tile, "__len__") or len(tile) != 2 or not all(
                    isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 1 for x in tile):
                raise UserError(f"sparse[{name!r}]: the micro-tile must be None or two positive ints (m, k), "
                                f"got {tile!r}")
            tile = (int(tile[0]), int(tile[1]))
        out[name] = tile
    return out


def unsupported_reason(call) -> str | None:
    """Why PIT cannot take the matmul ``call`` (its right operand, ranks, dtypes), or None."""
    a, b = call.args
    aty, bty = a.ty, b.ty
    if not isinstance(aty, relax.TensorType) or not isinstance(bty, relax.TensorType):
        return "operands are not tensors of known type"
    if bty.ndim != 2:
        return f"B has rank {bty.ndim}; PIT needs a 2-D [K, N] right operand"
    if bty.shape is None or any(_static_int(d) is None for d in bty.shape.values):
        return "B's shape is not static; PIT needs a static [K, N] right operand"
    if aty.ndim < 2:
        return f"A has rank {aty.ndim}; PIT needs A[..., K] with at least 2 dims"
    if aty.dtype not in SUPPORTED_DTYPES or bty.dtype != aty.dtype:
        return f"dtype {aty.dtype} x {bty.dtype} unsupported (PIT kernels: {', '.join(SUPPORTED_DTYPES)})"
    k_a = _static_int(aty.shape.values[-1]) if aty.shape is not None else None
    if k_a is None:
        return "A's reduction dim K is not static"
    if k_a != _static_int(bty.shape.values[0]):
        return "A's K does not match B's K"
    return None


@tvm.transform.module_pass(opt_level=0, name="AnnotateDynamicSparsity")
class AnnotateDynamicSparsity:
    """Module pass: wrap each matmul with a dynamically sparse left operand (see module doc).

    Parameters
    ----------
    sparse : dict[str, tuple|None] | list[str] | None
        Explicit annotations by ONNX tensor name, with an optional micro-tile ``(m, k)``.
    auto : bool
        Detect relu / mask / padding sources automatically.
    default_micro_tile : tuple
        Micro-tile for activation sparsity and element masks (clipped to a divisor of K).
    """

    def __init__(self, sparse=None, auto: bool = True, default_micro_tile=DEFAULT_MICRO_TILE):
        self.sparse = sparse_annotations(sparse)
        self.auto = auto
        self.default_micro_tile = tuple(default_micro_tile)

    # ------------------------------------------------------------------ analysis
    def _tile(self, k, rows_only):
        if rows_only:
            return (1, k)
        tk = self.default_micro_tile[1]
        while tk > 1 and k % tk:
            tk //= 2
        return (self.default_micro_tile[0], tk)

    def _auto_source(self, g: FuncGraph, lhs):
        """(source, rows_only, reason, row_mask) for the producer of ``lhs`` or None.

        ``row_mask``: the mask var when it zeroes whole rows of ``lhs`` row for row (see
        :func:`_row_mask_of`), else None."""
        _, prod = g.chain(lhs, _TRANSPARENT)
        op = op_name(prod)
        if op == "relax.nn.relu":
            return "relu", False, "left operand is produced by R.nn.relu (activation sparsity)", None
        mask, data = None, None
        if op == "relax.multiply":
            for d, m in ((prod.args[0], prod.args[1]), (prod.args[1], prod.args[0])):
                anc = g.param_ancestors(m)
                if anc and all(_is_mask_input(p) for p in anc) and not (
                    g.param_ancestors(d) <= anc
                ):
                    mask, data = m, d
                    break
        elif op == "relax.where":
            cond, x, y = prod.args
            if _is_zero_const(y) or _is_zero_const(x):
                anc = g.param_ancestors(cond)
                if anc and all(_is_mask_input(p) for p in anc):
                    mask, data = cond, (x if _is_zero_const(y) else y)
        if mask is None:
            return None
        anc = sorted(p.name for p in g.param_ancestors(mask))
        pad = [n for n in anc if PADDING_RE.match(n)]
        kind = "padding" if pad else "mask"
        name = (pad or anc)[0]
        mshape = getattr(mask.ty, "shape", None)
        rows_only = bool(
            mshape is not None and hasattr(mshape, "values") and len(mshape.values) > 0
            and _static_int(mshape.values[-1]) == 1
        )
        src = f"{kind}:{name}"
        row_mask = _row_mask_of(g, lhs, prod, mask) if rows_only else None
        _, dprod = g.chain(data, _TRANSPARENT)
        if op_name(dprod) == "relax.nn.relu":
            src = f"relu+{src}"
        how = "multiply" if op == "relax.multiply" else "where"
        reason = (
            f"left operand is masked ({how}) by graph input {name!r}"
            + (" (padding: whole rows are zero)" if rows_only else "")
        )
        return src, rows_only, reason, row_mask

    def _unsupported(self, call) -> str | None:
        return unsupported_reason(call)

    def _explicit_targets(self, g: FuncGraph, var, matmuls):
        """Matmul binding vars whose left operand is ``var`` (through shape ops and relu)."""
        out = []
        for mv, call in matmuls:
            vars_, _ = g.chain(call.args[0], through=_TRANSPARENT | {"relax.nn.relu"})
            if any(v.same_as(var) for v in vars_):
                out.append(mv)
        return out

    # ------------------------------------------------------------------ pass
    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        names = dict(mod.attrs[ONNX_NAMES_ATTR]) if mod.attrs is not None and ONNX_NAMES_ATTR in mod.attrs else None
        gv_main = mod.get_global_var("main")
        func = mod[gv_main]
        g = FuncGraph(func)
        rev = {str(v): str(k) for k, v in (names or {}).items()}

        def onnx_name(expr):
            return rev.get(expr.name, expr.name) if isinstance(expr, relax.Var) else str(op_name(expr) or "const")

        matmuls = [(b.var, b.value) for b in g.bindings if op_name(b.value) == "relax.matmul"]
        decisions = {}  # matmul var -> dict

        if self.auto:
            for mv, call in matmuls:
                found = self._auto_source(g, call.args[0])
                if found is not None:
                    src, rows_only, reason, row_mask = found
                    decisions[mv] = {"source": src, "rows_only": rows_only, "reason": reason, "tile": None,
                                     "row_mask": row_mask}

        # explicit annotations (override auto)
        if self.sparse:
            valid = sorted(names) if names else sorted({p.name for p in g.params} | {b.var.name for b in g.bindings})
            unknown = [n for n in self.sparse if n not in valid]
            if unknown:
                raise UserError(
                    f"unknown tensor name(s) {unknown} in sparse=; valid tensor names: {', '.join(valid)}"
                )
            for name, tile in self.sparse.items():
                var = g.var_by_name(names[name] if names else name)
                targets = self._explicit_targets(g, var, matmuls) if var is not None else []
                if not targets:
                    warnings.warn(f"sparse tensor {name!r} feeds no matmul as left operand; ignored")
                    continue
                for mv in targets:
                    prev = decisions.get(mv)
                    decisions[mv] = {
                        "tensor": name,
                        "source": "explicit" if prev is None else f"explicit+{prev['source']}",
                        "rows_only": False if prev is None else prev["rows_only"],
                        "reason": f"annotated by name {name!r}" + (f"; {prev['reason']}" if prev else ""),
                        "tile": tile,
                    }

        records, targets = [], []
        for idx, (mv, call) in enumerate([(mv, c) for mv, c in matmuls if mv in decisions]):
            d = decisions[mv]
            lhs_vars = g.chain(call.args[0], _TRANSPARENT)[0]
            lhs_name = d.get("tensor") or onnx_name(lhs_vars[0] if lhs_vars else call.args[0])
            why_not = self._unsupported(call)
            if why_not is not None:
                # a batched product reading a mask (attention's P.V, which the attention passes
                # lower) is recorded without a warning
                attention = call.args[1].ty.ndim != 2 and d["source"].startswith(("padding:", "mask:"))
                if not attention:
                    warnings.warn(f"matmul on {lhs_name!r} ({d['source']}) stays dense: {why_not}")
                records.append({"tensor": lhs_name, "source": d["source"], "status": "dense", "reason": why_not})
                continue
            k = _static_int(call.args[0].ty.shape.values[-1])
            tile = d["tile"] or self._tile(k, d["rows_only"])
            tile = (int(tile[0]), int(tile[1]))
            if k % tile[1]:
                why_not = f"micro-tile k={tile[1]} does not divide K={k}"
                warnings.warn(f"matmul on {lhs_name!r} ({d['source']}) stays dense: {why_not}")
                records.append({"tensor": lhs_name, "source": d["source"], "status": "dense", "reason": why_not})
                continue
            attrs = {
                "pit.sparse_operand": "lhs",
                "pit.micro_tile": [tile[0], tile[1]],
                PIT_RULE_ATTR: rule_for_tile(tile, k),
                "pit.source": d["source"],
                "pit.tensor": lhs_name,
                "pit.reason": d["reason"],
            }
            fname = f"pit_matmul_{len(targets)}"
            attrs["pit.id"] = len(targets)  # keeps same-shape wrappers from being deduplicated
            row_mask = d.get("row_mask") if d["rows_only"] and tile[1] >= k else None
            if row_mask is not None:
                attrs[ROW_MASK_ATTR] = 1
            targets.append((call, fname, attrs, row_mask))
            reason = d["reason"] + ("; rows index built from the mask, shared by the matmuls it masks"
                                    if row_mask is not None else "")
            rec = {"tensor": lhs_name, "source": d["source"], "status": "pit", "function": fname,
                   "micro_tile": [tile[0], tile[1]], "rule": attrs[PIT_RULE_ATTR], "reason": reason}
            records.append(rec)
            del idx

        padding_inputs = [p.name for p in g.params if PADDING_RE.match(p.name)]
        mod = _wrap_matmuls(mod, gv_main, targets)
        main = mod[gv_main].with_attr(ANNOTATIONS_ATTR, records)
        if padding_inputs:
            main = main.with_attr(PADDING_INPUTS_ATTR, padding_inputs)
        mod[gv_main] = main
        return mod


def _row_mask_of(g: FuncGraph, lhs, prod, mask):
    """``mask`` when row ``i`` of the matmul operand ``lhs`` is row ``i`` of ``prod`` (= data *
    mask, or where(mask, data, 0)) and ``mask`` is ``prod``'s leading shape + ``[1]``: then the
    non-zero rows of ``mask`` are a superset of the non-zero rows of ``lhs``, and one row index
    built from ``mask`` serves every matmul it masks. None otherwise (a transpose between them,
    a mask broadcast over rows, ...). Reshapes and casts keep rows in order while they keep K."""
    if not isinstance(mask, relax.Var) or prod.ty.shape is None:
        return None
    passed, producer = g.chain(lhs, through={"relax.reshape", "relax.astype"})
    k = prod.ty.shape.values[-1]
    if not producer.same_as(prod) or any(
            v.ty.shape is None or not tvm_ffi.structural_equal(v.ty.shape.values[-1], k) for v in passed):
        return None
    mshape, pshape = getattr(mask.ty, "shape", None), prod.ty.shape
    if mshape is None or len(mshape.values) != len(pshape.values):
        return None
    if not all(tvm_ffi.structural_equal(a, b) for a, b in zip(mshape.values[:-1], pshape.values[:-1])):
        return None
    return mask


def _fresh_ty(ty: relax.TensorType, prefix: str) -> relax.TensorType:
    dims = []
    for i, d in enumerate(ty.shape.values):
        dims.append(d if isinstance(d, tirx.IntImm) else tirx.Var(f"{prefix}{i}", "int64"))
    return relax.TensorType(dims, ty.dtype)


def _wrap_matmuls(mod, gv_main, targets):
    if not targets:
        return mod
    bb = relax.BlockBuilder(mod)
    gvs = []
    for call, fname, attrs, row_mask in targets:
        a, b = call.args
        pa = relax.Var("a", _fresh_ty(a.ty, "m"))
        pb = relax.Var("b", _fresh_ty(b.ty, "k"))
        params = [pa, pb] + ([] if row_mask is None else [relax.Var("row_mask", _fresh_ty(row_mask.ty, "r"))])
        with bb.function(fname, params, attrs=attrs, private=True):
            out = bb.emit(relax.Call(call.op, [pa, pb], call.attrs))
            bb.emit_func_output(out)
        gvs.append(bb.get().get_global_var(fname))
    new_mod = bb.get()
    mapping = [(call, gv, row_mask) for (call, _, _, row_mask), gv in zip(targets, gvs)]

    @relax.expr_functor.mutator
    class _Wrap(relax.PyExprMutator):
        def visit_call_(self, op):
            for c, gv, row_mask in mapping:
                if op.same_as(c):
                    args = list(op.args) + ([] if row_mask is None else [row_mask])
                    return relax.Call(gv, [self.visit_expr(x) for x in args])
            return self.visit_expr_post_order(op)

    new_main = _Wrap(new_mod).visit_expr(new_mod[gv_main])
    new_mod[gv_main] = new_main
    return new_mod


def annotations_of(mod: tvm.IRModule) -> list[dict]:
    """The decisions ``AnnotateDynamicSparsity`` recorded on ``main`` (plain Python dicts)."""
    main = mod["main"]
    out = []
    if main.attrs is not None and ANNOTATIONS_ATTR in main.attrs:
        for rec in main.attrs[ANNOTATIONS_ATTR]:
            d = {}
            for k, v in dict(rec).items():
                d[str(k)] = [int(x) for x in v] if k == "micro_tile" else str(v)
            out.append(d)
    if main.attrs is not None and PADDING_INPUTS_ATTR in main.attrs:
        used = {r["source"] for r in out}
        for name in main.attrs[PADDING_INPUTS_ATTR]:
            if not any(str(name) in s for s in used):
                out.append({"tensor": str(name), "source": f"padding:{name}", "status": "input",
                            "reason": "graph input looks like a padding mask / sequence lengths; "
                                      "no matmul reads it through a mask (an attention mask: compile with "
                                      f"padding={str(name)!r} to run the token-wise matmuls on its real "
                                      "tokens only)"})
    return out
