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
mask was an elementwise kernel over the [tokens, 3072] activation, a tenth of the model's time
(docs/design/measurements.md#graph-passes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import relax

from .graph import FuncGraph, op_name, other_operand, scalar_constant

__all__ = ["EpilogueChain", "epilogue_chains"]


@dataclass(frozen=True)
class EpilogueChain:
    head: relax.Call            # the matmul-like call the chain starts from
    bias: relax.Expr            # [N] constant
    activation: str | None      # None, "relu" or "gelu"
    row_scale: relax.Expr | None  # [..., 1] tensor over the head's rows, or None
    residual: relax.Expr | None = None  # a tensor of the output's shape added last (bias only)


def _close(x, value) -> bool:
    return x is not None and abs(x - value) <= 2e-3 * abs(value)   # fp16-rounded constants


def _has_scalar(call, value) -> bool:
    """one of ``call``'s operands is the constant ``value``"""
    return any(_close(scalar_constant(a), value) for a in call.args)


def _same_type(x, y) -> bool:
    """``x`` has ``y``'s dtype and (static or symbolic) shape"""
    from pit_tvm.ops.matmul import same_dims  # noqa: PLC0415 - the op layer's definition

    return (str(getattr(x.ty, "dtype", "")) == str(getattr(y.ty, "dtype", None))
            and same_dims(getattr(x.ty, "shape", None), getattr(y.ty, "shape", None)))


def _gelu_end(g: FuncGraph, x):
    """The var ending a GELU of ``x`` (both its uses are the GELU's), or None."""
    def value(var, name):
        return g.bound[var] if var is not None and op_name(g.bound[var]) == name else None

    def erf_plus_one(var):
        """the var of ``1 + erf(var)`` (each used once), or None"""
        erf = g.sole_user(var)
        one = g.sole_user(erf) if value(erf, "relax.erf") is not None else None
        return one if value(one, "relax.add") is not None and _has_scalar(g.bound[one], 1.0) else None

    users = g.users.get(x, [])
    if g.uses.get(x) != 2 or len(users) != 2:
        return None
    for first, second in (users, users[::-1]):
        a, b = g.bound[first], g.bound[second]
        # form A: mul(mul(x, 0.5), add(1, erf(mul(x, 1/sqrt2))))
        if (op_name(a) == op_name(b) == "relax.multiply" and _has_scalar(a, 0.5)
                and _has_scalar(b, 1 / math.sqrt(2))):
            one = erf_plus_one(second)
            end = g.sole_user(one) if one is not None else None
            if end is not None and end == g.sole_user(first) and value(end, "relax.multiply") is not None:
                return end
        # form B: mul(mul(x, add(erf(div(x, sqrt2)), 1)), 0.5)
        if op_name(a) == "relax.divide" and _close(scalar_constant(a.args[1]), math.sqrt(2)):
            one = erf_plus_one(first)
            if one is not None and g.sole_user(one) == second and value(second, "relax.multiply") is not None:
                end = g.sole_user(second)
                if value(end, "relax.multiply") is not None and _has_scalar(g.bound[end], 0.5):
                    return end
    return None


def epilogue_chains(func: relax.Function, is_head) -> dict:
    """``{the chain's last call: EpilogueChain}`` for every chain in ``func`` whose head call
    satisfies ``is_head(call)``."""
    from pit_tvm.ops.matmul import is_row_scale  # noqa: PLC0415 - the op layer's definition

    g = FuncGraph(func)
    chains = {}
    for add_var, add in g.bound.items():
        if op_name(add) != "relax.add":
            continue
        for head_var, bias in (add.args, add.args[::-1]):
            head = g.bound.get(head_var) if isinstance(head_var, relax.Var) else None
            if (not isinstance(head, relax.Call) or not is_head(head) or g.uses.get(head_var) != 1
                    or not isinstance(bias, tvm.ir.GenericConst) or len(bias.ty.shape) != 1):
                continue
            end, act = add_var, None
            relu = g.sole_user(add_var)
            if relu is not None and op_name(g.bound[relu]) == "relax.nn.relu":
                end, act = relu, "relu"
            elif (gelu := _gelu_end(g, add_var)) is not None:
                end, act = gelu, "gelu"
            row_scale = residual = None
            nxt = g.sole_user(end)
            if nxt is not None and op_name(g.bound[nxt]) == "relax.multiply":
                other = other_operand(g.bound[nxt], end)
                if is_row_scale(other, head.ty):
                    end, row_scale = nxt, other
            elif nxt is not None and act is None and op_name(g.bound[nxt]) == "relax.add":
                other = other_operand(g.bound[nxt], end)
                if _same_type(other, add):
                    end, residual = nxt, other
            chains[g.bound[end]] = EpilogueChain(head, bias, act, row_scale, residual)
            break
    return chains
