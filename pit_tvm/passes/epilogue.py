"""Epilogue chains after a matmul: ``bias add -> ReLU or GELU -> row scale``, found in a Relax
function so that a pass can emit them in the matmul kernel's epilogue.

Recognised, after a head call (a matmul, or a PIT matmul wrapper) whose only use is the add::

    y = add(head, bias)                          bias: a [N] constant
    y = relu(y)                                  or GELU, erf form, as ONNX exporters write it:
    y = mul(mul(y, 0.5), add(1, erf(mul(y, 1/sqrt2))))     (tf / onnx.helper graphs)
    y = mul(mul(y, add(erf(div(y, sqrt2)), 1)), 0.5)       (torch.onnx)
    y = mul(y, row_scale)                        row_scale: [..., 1] over the head's rows (a
                                                 padding mask), optional
    y = add(y, residual)                         residual: the output's shape and dtype, after a
                                                 bias alone (a skip connection), optional

Each intermediate value is used once by the chain only (a GELU input twice, by its two
branches); any operand order of ``add`` / ``mul``.  Why: BERT's FFN-in bias + GELU + padding
mask was an elementwise kernel over the [tokens, 3072] activation, 336 us of ~3 ms on the H100.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import relax

__all__ = ["EpilogueChain", "epilogue_chains"]


@dataclass(frozen=True)
class EpilogueChain:
    head: relax.Call            # the matmul-like call the chain starts from
    bias: relax.Expr            # [N] constant
    activation: str | None      # None, "relu" or "gelu"
    row_scale: relax.Expr | None  # [..., 1] tensor over the head's rows, or None
    residual: relax.Expr | None = None  # a tensor of the output's shape added last (bias only)


def _op_is(expr, name):
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def _scalar(expr):
    if isinstance(expr, tvm.ir.GenericConst) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    return None


def _close(x, target):
    return x is not None and abs(x - target) <= 2e-3 * abs(target)   # fp16-rounded constants


def _same_type(x, y) -> bool:
    """``x`` has ``y``'s dtype and (static or symbolic) shape"""
    import tvm_ffi

    xs, ys = getattr(x.ty, "shape", None), getattr(y.ty, "shape", None)
    return (xs is not None and ys is not None and len(xs) == len(ys) and str(x.ty.dtype) == str(y.ty.dtype)
            and all(tvm_ffi.structural_equal(a, b) for a, b in zip(xs, ys)))


def epilogue_chains(func: relax.Function, is_head) -> dict:
    """``{the chain's last call: EpilogueChain}`` for every chain in ``func`` whose head call
    satisfies ``is_head(call)``."""
    from pit_tvm.ops.matmul import is_row_scale  # noqa: PLC0415 - the op layer's definition

    bound, uses = {}, {}
    for block in func.body.blocks:
        for b in block.bindings:
            bound[b.var] = b.value
            for arg in (b.value.args if isinstance(b.value, relax.Call) else
                        (b.value.fields if isinstance(b.value, relax.Tuple) else [b.value])):
                if isinstance(arg, relax.Var):
                    uses[arg] = uses.get(arg, 0) + 1
    if isinstance(func.body.body, relax.Var):
        uses[func.body.body] = uses.get(func.body.body, 0) + 1
    users = {}
    for var, value in bound.items():
        if isinstance(value, relax.Call):
            for arg in value.args:
                if isinstance(arg, relax.Var):
                    users.setdefault(arg, []).append(var)

    def value_of(var, name, n_uses=1):
        v = bound.get(var) if isinstance(var, relax.Var) else None
        return v if _op_is(v, name) and uses.get(var) == n_uses else None

    def sole_user(var):
        u = users.get(var, [])
        return u[0] if len(u) == 1 and uses.get(var) == 1 else None

    def gelu_end(x):
        """the var ending a GELU of ``x`` (``x`` used exactly by the GELU), or None"""
        if uses.get(x) == 2 and len(users.get(x, [])) == 2:     # form A: x * 0.5, x * 1/sqrt2
            for half, inner in (users[x], users[x][::-1]):
                h, i = bound[half], bound[inner]
                if not (_op_is(h, "relax.multiply") and _op_is(i, "relax.multiply")):
                    continue
                if not (_close(_scalar(h.args[1]), 0.5) or _close(_scalar(h.args[0]), 0.5)):
                    continue
                if not (_close(_scalar(i.args[1]), 1 / math.sqrt(2)) or _close(_scalar(i.args[0]), 1 / math.sqrt(2))):
                    continue
                erf = sole_user(inner)
                one = sole_user(erf) if erf is not None and _op_is(bound[erf], "relax.erf") else None
                if one is None or not _op_is(bound[one], "relax.add") or not any(
                        _close(_scalar(a), 1.0) for a in bound[one].args):
                    continue
                end = sole_user(one)
                if end is not None and end == sole_user(half) and _op_is(bound[end], "relax.multiply"):
                    return end
        if uses.get(x) == 2 and len(users.get(x, [])) == 2:     # form B: x / sqrt2 ... * x * 0.5
            for div, prod in (users[x], users[x][::-1]):
                d = bound[div]
                if not (_op_is(d, "relax.divide") and _close(_scalar(d.args[1]), math.sqrt(2))):
                    continue
                erf = sole_user(div)
                one = sole_user(erf) if erf is not None and _op_is(bound[erf], "relax.erf") else None
                if one is None or not _op_is(bound[one], "relax.add") or not any(
                        _close(_scalar(a), 1.0) for a in bound[one].args):
                    continue
                if sole_user(one) != prod or not _op_is(bound[prod], "relax.multiply"):
                    continue
                end = sole_user(prod)
                if end is not None and _op_is(bound[end], "relax.multiply") and any(
                        _close(_scalar(a), 0.5) for a in bound[end].args):
                    return end
        return None

    chains = {}
    for add_var, add in bound.items():
        if not _op_is(add, "relax.add"):
            continue
        for head_var, bias in (add.args, add.args[::-1]):
            head = bound.get(head_var) if isinstance(head_var, relax.Var) else None
            if (not isinstance(head, relax.Call) or not is_head(head) or uses.get(head_var) != 1
                    or not isinstance(bias, tvm.ir.GenericConst) or len(bias.ty.shape) != 1):
                continue
            end, act = add_var, None
            relu = sole_user(add_var)
            if relu is not None and _op_is(bound[relu], "relax.nn.relu"):
                end, act = relu, "relu"
            else:
                g = gelu_end(add_var)
                if g is not None:
                    end, act = g, "gelu"
            row_scale = None
            scale_var = sole_user(end)
            if scale_var is not None and _op_is(bound[scale_var], "relax.multiply"):
                mul = bound[scale_var]
                other = mul.args[1] if mul.args[0].same_as(end) else mul.args[0]
                if is_row_scale(other, head.ty):
                    end, row_scale = scale_var, other
            residual = None
            res_var = sole_user(end) if act is None and row_scale is None else None
            if res_var is not None and _op_is(bound[res_var], "relax.add"):
                res = bound[res_var]
                other = res.args[1] if res.args[0].same_as(end) else res.args[0]
                if _same_type(other, add):
                    end, residual = res_var, other
            chains[bound[end]] = EpilogueChain(head, bias, act, row_scale, residual)
            break
    return chains
