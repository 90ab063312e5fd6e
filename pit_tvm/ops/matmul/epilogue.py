"""The epilogue of a matmul, ``act(a @ b + bias) * row_scale + residual``: as a value
(:class:`Epilogue`), the checks that a kernel can run it, its kernel arguments, and the Relax
ops that run it after a kernel that cannot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tvm
from tvm import tirx

#: the activations an epilogue applies
ACTIVATIONS = (None, "relu", "gelu")


@dataclass(frozen=True)
class Epilogue:
    """``act(a @ b + bias) * row_scale + residual`` of one matmul ``a @ b``: Relax exprs, None
    where absent.  ``bias``: ``[N]``; ``activation``: None, "relu" or "gelu" (GELU in its erf
    form); ``row_scale``: ``a``'s leading shape + ``[1]``; ``residual``: the result's shape."""

    bias: Any = None
    activation: str | None = None
    row_scale: Any = None
    residual: Any = None

    @property
    def tag(self) -> str:
        """the suffix of a kernel's name that says which epilogue it runs"""
        return _epilogue_tag(self.bias, self.activation, self.row_scale, self.residual)

    def bias_and_residual(self) -> "Epilogue | None":
        """this epilogue when it is a bias, then possibly a residual (what the wgmma tiles
        kernels run: an FFN's fc2 and its skip), else None"""
        if self.bias is None or self.activation is not None or self.row_scale is not None:
            return None
        return self

    def runs_in_wgmma(self, k, n, dtype, out_dtype, target, a_ty) -> bool:
        """whether the wgmma kernel for ``[.., k] @ [k, n]`` runs this epilogue (it needs a bias)"""
        return self.bias is not None and wgmma_epilogue_applies(
            k, n, dtype, out_dtype, target, self.bias, self.activation, self.row_scale, self.residual, a_ty)

    def kernel_args(self, bb, m, n, dtype, row_scale=None) -> list:
        """the kernel's epilogue arguments for ``m`` rows: the bias, the ``[M]`` row scale
        (``row_scale`` where given: the scale of A's rows), the ``[M, N]`` residual"""
        return (([] if self.bias is None else [self.bias]) + _row_scale_arg(bb, self.row_scale if row_scale is None else row_scale, m, dtype)
                + _residual_arg(bb, self.residual, m, n))

    def emit_after(self, bb, c):
        """the epilogue as Relax ops after ``c`` (:func:`emit_epilogue`)"""
        return emit_epilogue(bb, c, self.bias, self.activation, self.row_scale, self.residual)


def wgmma_epilogue_applies(k, n, dtype, out_dtype, target, bias, activation, row_scale, residual,
                           a_ty) -> bool:
    """Whether the wgmma kernel runs this epilogue (sm_90a, its shapes and dtypes, a ``[N]``
    bias of the input dtype, a row scale over ``a``'s rows, a residual after a bias alone)."""
    from pit_tvm.schedules.wgmma import wgmma_applies
    from pit_tvm.target import cuda_arch

    b_shape = getattr(bias.ty, "shape", None)
    return (wgmma_applies(k, n, dtype, out_dtype, cuda_arch(target)) and str(bias.ty.dtype) == dtype
            and b_shape is not None and len(b_shape) == 1 and isinstance(b_shape[0], tirx.IntImm)
            and int(b_shape[0]) == n and (row_scale is None or is_row_scale(row_scale, a_ty))
            and (residual is None or (activation is None and row_scale is None
                                      and _is_residual(residual, a_ty, n, out_dtype))))


def row_scaled_input(bb, a, a_ty, scale=None):
    """``(x, s)`` when ``a`` is bound to ``multiply(x, s)`` (either order) with ``s`` a row scale
    of ``a`` (:func:`is_row_scale`; ``scale`` itself where given) and ``x`` of ``a``'s shape and
    dtype: a kernel can read x and scale its product's rows instead (``row_scale_a``), so the
    multiply need not run.  Else None."""
    from tvm import relax

    value = bb.lookup_binding(a) if isinstance(a, relax.Var) else None
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.multiply"):
        return None
    for x, s in (value.args, value.args[::-1]):
        if ((s.same_as(scale) if scale is not None else is_row_scale(s, a_ty))
                and isinstance(getattr(x, "ty", None), relax.TensorType) and str(x.ty.dtype) == str(a_ty.dtype)
                and x.ty.shape is not None and same_dims(x.ty.shape, a_ty.shape)):
            return x, s
    return None


def _epilogue_tag(bias, activation, row_scale, residual=None) -> str:
    return (f"{'_bias' if bias is not None else ''}{f'_{activation}' if activation else ''}"
            f"{'_rowscale' if row_scale is not None else ''}{'_residual' if residual is not None else ''}")


def same_dims(xs, ys) -> bool:
    """two (static or symbolic) shapes are the same, dim by dim"""
    import tvm_ffi

    return (xs is not None and ys is not None and len(xs) == len(ys)
            and all(tvm_ffi.structural_equal(x, y) for x, y in zip(xs, ys)))


def _is_residual(residual, a_ty, n, out_dtype) -> bool:
    """``residual`` is the result's shape (``a``'s leading shape + ``[N]``) in ``out_dtype``."""
    shape = getattr(residual.ty, "shape", None)
    return (shape is not None and a_ty.shape is not None and len(shape) == len(a_ty.shape)
            and str(residual.ty.dtype) == out_dtype and isinstance(shape[-1], tirx.IntImm) and int(shape[-1]) == n
            and same_dims(list(shape)[:-1], list(a_ty.shape)[:-1]))


def _residual_arg(bb, residual, m, n) -> list:
    from tvm import relax

    return [] if residual is None else [bb.emit(relax.op.reshape(residual, [m, n]))]


def is_row_scale(row_scale, a_ty) -> bool:
    """``row_scale`` is ``a``'s leading shape + ``[1]`` (one value per row of ``a``)."""
    shape = getattr(row_scale.ty, "shape", None)
    if (shape is None or a_ty.shape is None or len(shape) != len(a_ty.shape)
            or not isinstance(shape[-1], tirx.IntImm) or int(shape[-1]) != 1):
        return False
    return same_dims(list(shape)[:-1], list(a_ty.shape)[:-1])


def _row_scale_arg(bb, row_scale, m, dtype) -> list:
    """The kernel's ``[M]`` row-scale argument (reshaped, and cast to the kernel's input dtype)."""
    from tvm import relax

    if row_scale is None:
        return []
    rs = bb.emit(relax.op.reshape(row_scale, [m]))
    if str(rs.ty.dtype) != dtype:
        rs = bb.emit(relax.op.astype(rs, dtype))
    return [rs]


def emit_epilogue(bb, c, bias=None, activation=None, row_scale=None, residual=None):
    """The epilogue chain as Relax ops after ``c`` (where no kernel runs it): ``c + bias``, the
    activation (GELU in its erf form), ``* row_scale``, ``+ residual``."""
    from tvm import relax

    dtype = str(c.ty.dtype)
    if bias is not None:
        c = bb.emit(relax.op.add(c, bias))
    if activation == "relu":
        c = bb.emit(relax.op.nn.relu(c))
    elif activation == "gelu":
        half, one, inv_sqrt2 = (relax.const(v, dtype) for v in (0.5, 1.0, 0.7071067811865476))
        c = bb.emit(relax.op.multiply(relax.op.multiply(c, half),
                                      relax.op.add(one, relax.op.erf(relax.op.multiply(c, inv_sqrt2)))))
    elif activation is not None:
        raise ValueError(f"unknown activation {activation!r}: use None, 'relu' or 'gelu'")
    if row_scale is not None:
        c = bb.emit(relax.op.multiply(c, row_scale))
    if residual is not None:
        c = bb.emit(relax.op.add(c, residual))
    return c

