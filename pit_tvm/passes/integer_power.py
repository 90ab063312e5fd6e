"""``IntegerPowerToMultiply``: ``R.power(x, n)`` with ``n`` a small integer constant as
multiplies (a CUDA build pipeline stage).

Why: TVM compiles CUDA with ``--use_fast_math`` (NVRTC and nvcc alike, and pit_tvm's loader),
under which ``powf(x, y)`` (fp16 ``hpow`` goes through it too) is ``exp2(y * log2(x))``: NaN for
every negative ``x``, whatever ``y``.  GPT-2's and ALBERT's ``gelu_new`` compute ``x ** 3`` and
T5's RMS norm ``x ** 2``: their CUDA builds gave NaN everywhere.  ``x * x * x`` is exact in
sign (and cheaper); the CPU build (libm ``powf``) was right and is left as it is.

Rewritten: ``power(x, c)`` with ``c`` a one-element constant of integer value, ``|c| <=``
:data:`MAX_EXPONENT`, ``x`` floating point and of the result's shape (``c`` does not broadcast
it).  ``x ** 0`` is ``ones_like(x)``, a negative ``c`` ``1 / x ** -c``.  Anything else (other
exponents, tensor exponents) keeps ``R.power``.
"""
from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import relax

from .graph import rewrite_functions, scalar_constant

#: the largest |exponent| rewritten (x ** 8: three multiplies, by squaring)
MAX_EXPONENT = 8


def integer_exponent(call: relax.Call) -> int | None:
    """``n`` when ``call`` is ``R.power(x, n)`` that :class:`IntegerPowerToMultiply` rewrites,
    else None."""
    if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.power"):
        return None
    base, exponent = call.args
    value = scalar_constant(exponent)
    if value is None or not math.isfinite(value) or value != int(value) or abs(value) > MAX_EXPONENT:
        return None
    dtype = str(getattr(base.ty, "dtype", ""))
    if not dtype.startswith(("float", "bfloat")):
        return None
    shape, out = getattr(base.ty, "shape", None), getattr(call.ty, "shape", None)
    if shape is None or out is None or len(shape) != len(out) or not all(
            tvm_ffi.structural_equal(a, b) for a, b in zip(shape, out)):
        return None
    return int(value)


@relax.expr_functor.mutator
class _PowerRewriter(relax.PyExprMutator):
    def _power(self, x, n: int) -> relax.Expr:
        """``x ** n`` (n >= 1) by squaring, the last product returned, the others emitted"""
        if n == 1:
            return x
        half = self._power(x, n // 2)
        half = half if n // 2 == 1 else self.builder_.emit(half)
        square = relax.op.multiply(half, half)
        return square if n % 2 == 0 else relax.op.multiply(self.builder_.emit(square), x)

    def visit_call_(self, op: relax.Call) -> relax.Expr:
        call = super().visit_call_(op)
        n = integer_exponent(op)
        if n is None:
            return call
        x = call.args[0]
        if n == 0:
            return relax.op.ones_like(x)
        power = self._power(x, abs(n))
        if n > 0:
            return power
        return relax.op.divide(relax.const(1, x.ty.dtype), power if abs(n) == 1 else self.builder_.emit(power))


@tvm.transform.module_pass(opt_level=0, name="IntegerPowerToMultiply")
def IntegerPowerToMultiply(mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:  # noqa: N802 - a pass, named like TVM's
    """Rewrite the small-integer ``R.power`` calls of the module's Relax functions into multiplies
    (see the module docstring)."""
    return rewrite_functions(mod, _PowerRewriter(mod))
