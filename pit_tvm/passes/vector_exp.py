"""``ExpToVectorExp``: fp32 ``exp`` in the CPU kernels as a polynomial LLVM can vectorise (a
build pipeline stage, after legalization).

Why: LLVM lowers ``tirx.exp`` to a call of libm's ``expf`` per element, which it can neither
vectorise nor inline: softmax over attention's scores (16 x 12 x 128 x 128 per layer of a
MiniLM batch) was most of the non-matmul time on a 2-core EPYC.  The form here is Cephes'
``expf`` (Cody-Waite reduction by ln 2 in two parts, a degree-5 polynomial on the remainder,
within 2 ulp of ``expf`` in fp32; TOPI's ``fast_exp`` reduces by one rounded ln 2, 3.6e-6 off
in relative terms) with the special cases kept: ``exp(x)`` for ``x`` past fp32's range is
``inf``, below it 0 (gradual underflow through the subnormals), NaN stays NaN.
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import ir, tirx

from .tir_buffers import touches_dtype

_LOG2E = 1.44269504088896341
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4
_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
#: above: overflow to inf; below: the result rounds to 0
_HI, _LO = 88.72283935546875, -103.97208404541016


def _f(v: float):
    return tirx.const(v, "float32")


def _pow2(n):
    """2**n for an integral float ``n`` in [-126, 127], built from its exponent bits."""
    bits = tirx.shift_left(tirx.Cast("int32", n) + tirx.const(127, "int32"), tirx.const(23, "int32"))
    return tirx.reinterpret("float32", bits)


def vector_exp(x):
    """``exp(x)`` of an fp32 expression, as vectorisable arithmetic (see the module docstring)."""
    xv, cv, nv, rv = (tirx.Var(name, "float32") for name in ("exp_x", "exp_xc", "exp_n", "exp_r"))
    p = _f(_POLY[0])
    for c in _POLY[1:]:
        p = p * rv + _f(c)
    y = p * (rv * rv) + rv + _f(1.0)
    half = tirx.floor(nv * _f(0.5))      # 2**n as 2**half * 2**(n - half): n reaches 128 and -150
    value = y * _pow2(half) * _pow2(nv - half)
    value = tirx.Let(rv, cv - nv * _f(_LN2_HI) - nv * _f(_LN2_LO), value)
    value = tirx.Let(nv, tirx.floor(cv * _f(_LOG2E) + _f(0.5)), value)
    value = tirx.Let(cv, tirx.Max(tirx.Min(xv, _f(_HI)), _f(_LO)), value)
    special = tirx.Select(xv > _f(_HI), _f(float("inf")), tirx.Select(xv < _f(_LO), _f(0.0), value))
    return tirx.Let(xv, x, tirx.Select(tirx.isnan(xv), xv, special))


_EXP = ir.Op.get("tirx.exp")


def _rewrite(call):
    if call.op.same_as(_EXP) and str(call.ty.dtype) == "float32":
        return vector_exp(call.args[0])
    return call


@tvm.transform.module_pass(opt_level=0, name="ExpToVectorExp")
def ExpToVectorExp(mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:  # noqa: N802 - a pass, named like TVM's
    """Rewrite every scalar fp32 ``exp`` of the module's PrimFuncs into :func:`vector_exp`.
    PrimFuncs that hold a bf16 buffer keep libm's ``exp``: TVM's bf16 legalisation (later in
    the build) rewrites the ``Let`` bindings of :func:`vector_exp` wrongly (every result inf)."""
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc) and not touches_dtype(func.body, "bfloat16"):
            body = tvm_ffi.structural_map(func.body, (ir.Call, _rewrite))
            if not body.same_as(func.body):
                mod[gv] = func.with_body(body)
    return mod
