"""Def-use helpers over one Relax function in ANF, for the passes that match patterns by hand
(annotation sources, epilogue chains, attention): what each var is bound to, how often and by
whom it is used, and scalar constants; and a mutator's run over a module's Relax functions."""
from __future__ import annotations

import tvm
from tvm import relax

__all__ = ["FuncGraph", "call_tir_parts", "op_name", "other_operand", "rewrite_functions", "scalar_constant"]


def rewrite_functions(mod: tvm.IRModule, rewriter: relax.PyExprMutator) -> tvm.IRModule:
    """``mod`` with each of its Relax functions replaced by ``rewriter``'s visit of it (a
    ``PyExprMutator`` built on ``mod``), the functions it emitted added"""
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
    return rewriter.builder_.get()


def op_name(expr) -> str | None:
    """The operator name of a call to a Relax op (``"relax.add"``), else None."""
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def call_tir_parts(expr):
    """``(callee GlobalVar, argument list)`` of a ``call_tir``, else None."""
    if op_name(expr) != "relax.call_tir":
        return None
    return expr.args[0], list(expr.args[1].fields)


def scalar_constant(expr) -> float | None:
    """The value of a one-element constant, else None."""
    if isinstance(expr, tvm.ir.GenericConst) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    return None


def other_operand(call, var):
    """The operand of the binary ``call`` that is not ``var``."""
    return call.args[1] if call.args[0].same_as(var) else call.args[0]


def _operands(value) -> list:
    if isinstance(value, relax.Call):
        return list(value.args)
    if isinstance(value, relax.Tuple):
        return list(value.fields)
    if isinstance(value, relax.TupleGetItem):
        return [value.tuple_value]
    return [value]


class FuncGraph:
    """``bound`` (var -> bound value), ``bindings`` (in order), ``uses`` (var -> number of uses,
    the function's result included) and ``users`` (var -> the vars bound to its uses)."""

    def __init__(self, func: relax.Function):
        self.func = func
        self.params = list(func.params)
        self.bound, self.bindings, self.uses, self.users = {}, [], {}, {}
        for block in func.body.blocks:
            for b in block.bindings:
                self.bound[b.var] = b.value
                self.bindings.append(b)
                for arg in _operands(b.value):
                    if isinstance(arg, relax.Var):
                        self.uses[arg] = self.uses.get(arg, 0) + 1
                        self.users.setdefault(arg, []).append(b.var)
        if isinstance(func.body.body, relax.Var):
            self.uses[func.body.body] = self.uses.get(func.body.body, 0) + 1

    def single(self, var, name: str):
        """The call bound to ``var`` if it is op ``name`` and ``var`` is used once, else None."""
        value = self.bound.get(var) if isinstance(var, relax.Var) else None
        return value if op_name(value) == name and self.uses.get(var) == 1 else None

    def sole_user(self, var):
        """The var bound to ``var``'s only use, or None (no use, several, or the result)."""
        users = self.users.get(var, [])
        return users[0] if len(users) == 1 and self.uses.get(var) == 1 else None

    def var_by_name(self, name):
        for p in self.params:
            if p.name == name:
                return p
        for b in self.bindings:
            if b.var.name == name:
                return b.var
        return None

    def chain(self, expr, through):
        """Follow ``expr`` back through vars and the ops named in ``through``: (vars passed,
        producer)."""
        seen = []
        while True:
            if isinstance(expr, relax.Var) and expr in self.bound:
                seen.append(expr)
                expr = self.bound[expr]
                continue
            if op_name(expr) in through:
                expr = expr.args[0]
                continue
            if isinstance(expr, relax.Var):
                seen.append(expr)
            return seen, expr

    def param_ancestors(self, expr) -> frozenset:
        """The function parameters ``expr`` is computed from."""
        stack, out, seen = [expr], set(), set()
        while stack:
            e = stack.pop()
            if isinstance(e, relax.Var):
                if e in seen:
                    continue
                seen.add(e)
                if e in self.bound:
                    stack.append(self.bound[e])
                elif any(e.same_as(p) for p in self.params):
                    out.add(e)
            elif isinstance(e, (relax.Call, relax.Tuple, relax.TupleGetItem)):
                stack.extend(_operands(e))
        return frozenset(out)
