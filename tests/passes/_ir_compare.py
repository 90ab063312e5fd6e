"""Structural comparison of a pass's output with a TVMScript ``Expected`` module whose generated
kernels are written as stubs (imported as ``_ir_compare``; pytest puts tests/passes/ on the path).

Passes that emit kernels (LowerToPIT, DenseMatmulToPITKernels, FuseAttention, ...) generate
PrimFuncs of hundreds of lines, impractical to write out by hand and covered by the kernels' own
numeric tests.  Their ``Expected`` modules write such a kernel as a *stub*: a PrimFunc with the
generated kernel's name and buffer signature whose body is ``T.evaluate(0)``.  Then:

* both modules hold the same function names and the same module attrs;
* every Relax function is compared with ``tvm.ir.assert_structural_equal``.  Calls name their
  callee by ``GlobalVar``; two modules' GlobalVars are different objects, so the comparison maps
  them as free variables (``map_free_vars=True``), which still requires equal ``name_hint``\\ s
  (every Relax variable inside is bound by the function, so nothing else is left free);
* a stub is compared with the generated PrimFunc's signature (parameter count, each one's dtype,
  rank and static dims; a symbolic dim or a bare ``T.handle`` of the stub matches anything);
  a PrimFunc written out in full is compared whole.
"""
from __future__ import annotations

import tvm
from tvm import relax, tirx


def is_stub(func) -> bool:
    """``func`` is a PrimFunc whose body is ``T.evaluate(0)``."""
    if not isinstance(func, tirx.PrimFunc) or not isinstance(func.body, tirx.Evaluate):
        return False
    value = func.body.value
    return isinstance(value, tirx.IntImm) and int(value) == 0


def _dims(param) -> list:
    """a buffer parameter's dims: ints where static, None where symbolic"""
    return [int(d) if isinstance(d, tirx.IntImm) else None for d in param.shape]


def _is_buffer(param) -> bool:
    """``param`` is a buffer (a bare ``T.handle`` never matched to a buffer is not)"""
    try:
        param.dtype
    except AttributeError:
        return False
    return True


def assert_signature_matches(name: str, kernel: tirx.PrimFunc, stub: tirx.PrimFunc) -> None:
    """``kernel`` takes as many parameters as ``stub``, each of its dtype and rank, with its
    static dims; a symbolic dim of the stub stands for any dim (the kernels' symbolic dims are
    index arithmetic on the row count, which their own tests cover), and so does a bare
    ``T.handle`` of the stub for any parameter."""
    assert len(kernel.params) == len(stub.params), \
        f"kernel {name}: {len(kernel.params)} parameters, expected {len(stub.params)}"
    for i, (got, want) in enumerate(zip(kernel.params, stub.params)):
        if not _is_buffer(want):
            continue
        assert _is_buffer(got) and str(got.dtype) == str(want.dtype), \
            f"kernel {name} parameter {i}: {got} is not a {want.dtype} buffer"
        g, w = _dims(got), _dims(want)
        assert len(g) == len(w) and all(b is None or a == b for a, b in zip(g, w)), \
            f"kernel {name} parameter {i}: shape {list(got.shape)} != expected {list(want.shape)}"


def assert_ir_equal(after: tvm.IRModule, expected: tvm.IRModule) -> None:
    """``after`` equals ``expected``: Relax functions structurally, stub kernels by signature,
    other PrimFuncs structurally (see the module doc)."""
    got = {gv.name_hint: f for gv, f in after.functions_items()}
    want = {gv.name_hint: f for gv, f in expected.functions_items()}
    assert sorted(got) == sorted(want), f"functions {sorted(got)} != expected {sorted(want)}"
    tvm.ir.assert_structural_equal(after.attrs, expected.attrs)
    for name, exp in want.items():
        act = got[name]
        assert type(act) is type(exp), f"{name}: {type(act).__name__} != expected {type(exp).__name__}"
        if isinstance(exp, relax.Function):
            tvm.ir.assert_structural_equal(act, exp, map_free_vars=True)
        elif is_stub(exp):
            assert_signature_matches(name, act, exp)
        else:
            tvm.ir.assert_structural_equal(act, exp, map_free_vars=True)
