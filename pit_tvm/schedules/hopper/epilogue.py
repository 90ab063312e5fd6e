"""The Hopper GEMMs' epilogue: bias, activation (ReLU, SiLU, or GELU in an erf form cheap enough
to run on every element after the K loop, while the tensor cores idle), row scale, residual."""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.schedules.limits import dtype_bytes

#: erfc(z) ~ poly(t) * exp(-z^2), t = 1 / (1 + P z), z >= 0, poly(t) = sum_i A_i t^i for i = 1..5
#: (Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7 in erf): P, then A_1..A_5
_ERFC_P = 0.3275911
_ERFC_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def gelu_erf(v):
    """GELU in its erf form, ``v * Phi(v)`` (fp32, CUDA): within 5e-7 of the exact value (as
    close as fp32 math on CUDA's ``erff`` gets) in about 19 PTX instructions against 33: one fast
    reciprocal, one fast exp, one polynomial, no branch (``erff`` evaluates two polynomials and
    selects).  The epilogue runs it on every element after the K loop while the tensor cores
    idle (docs/design/hopper_kernels.md, "Staged SWrite with the epilogue").

    With z = |v| / sqrt(2): ``Phi(-|v|) = erfc(z) / 2 = q``, ``Phi(v) = 1 - q`` for v >= 0."""
    f32 = T.float32
    x, t = tirx.Var("x", "float32"), tirx.Var("t", "float32")
    half_poly = f32(0.5 * _ERFC_A[-1])           # poly(t) / 2, Horner
    for a in reversed(_ERFC_A[:-1]):
        half_poly = half_poly * t + f32(0.5 * a)
    q = half_poly * t * T.call_pure_extern("float32", "__expf", x * (x * f32(-0.5)))
    one_over = T.call_pure_extern("float32", "__fdividef", f32(1),
                                  f32(1) + f32(_ERFC_P * 0.7071067811865476) * T.fabs(x))
    phi = tirx.Let(t, one_over, T.Select(x >= f32(0), f32(1) - q, q))
    return tirx.Let(x, v, x * phi)


def silu(v):
    """SiLU, ``v * sigmoid(v) = v / (1 + exp(-v))`` (fp32, CUDA's fast exp and division: an
    IEEE division's subroutine made the grouped GEMM's epilogue spill; the fast one gives -0
    where exp(-v) is inf, v below about -88, and 0 for denominators over 2^126, the limits).
    ``v`` appears twice, not bound by a Let: the vectorizer rejected a Let followed by a row
    scale (nvcc computes v once either way)."""
    return T.call_pure_extern("float32", "__fdividef", v, T.float32(1) + T.call_pure_extern("float32", "__expf", -v))



@dataclass(frozen=True)
class Epilogue:
    """A GEMM's epilogue on an fp32 accumulator, in order: A's row scale (``row_scale_a``), the
    bias, the activation (``act``: None, "relu", "gelu" or "silu"), the row scale (``row_scale``), the
    cast to ``out_dtype``, then the residual in the output dtype (as the graph's own add), or the
    gate (``gate``: times a tensor of C's shape, in the output dtype, as the graph's multiply).
    ``row_scale_masks``: the row scale is zero wherever the index skips a row.  ``vec``: output
    elements a 16-byte chunk (the residual's registers are per chunk)."""

    out_dtype: str
    bias: bool = False
    act: str | None = None
    row_scale: bool = False
    row_scale_a: bool = False
    row_scale_masks: bool = False
    residual: bool = False
    gate: bool = False

    @property
    def vec(self) -> int:
        return 16 // dtype_bytes(self.out_dtype)

    def activation(self, v):
        if self.act == "relu":
            return T.max(v, T.float32(0))
        if self.act == "gelu":
            return gelu_erf(v)
        if self.act == "silu":
            return silu(v)
        return v

    def apply(self, v, bias_buf, col, scale):
        """fp32 accumulator -> (A's row scale,) bias, activation, row scale (``scale``: the
        row's, fp32) -> output dtype"""
        if self.row_scale_a and scale is not None:   # (a zero row's product: zero, whatever its scale)
            v = v * scale
        if self.bias:
            v = v + T.Cast("float32", bias_buf[col])
        v = self.activation(v)
        return T.Cast(self.out_dtype, v * scale if self.row_scale else v)

    def glu(self, up, linear, bias_up, bias_linear, col):
        """both halves of a gated FFN from their fp32 accumulators: ``act(up + b1) * (linear +
        b3)``, the product in fp32 and rounded once to the output dtype (not each half rounded
        first, as the graph does: docs/design/moe.md, "One GEMM for both halves", says why)"""
        if self.bias:
            up = up + T.Cast("float32", bias_up[col])
            linear = linear + T.Cast("float32", bias_linear[col])
        return T.Cast(self.out_dtype, self.activation(up) * linear)

    def plus_residual(self, v, res_regs, j, e):
        """the skip connection (chunk j's element e, loaded ahead), added in the output dtype"""
        return v + res_regs[j * self.vec + e] if self.residual else v

    def times_gate(self, v, gate_regs, j, e):
        """the gate's element (chunk j's element e, loaded ahead into the residual's registers)
        times ``v``, in the output dtype"""
        return v * gate_regs[j * self.vec + e] if self.gate else v

    @property
    def unlisted_nonzero(self) -> bool:
        """epilogue(0) is zero but for a bias (unless a masking row scale zeroes it) or a row
        scale that is not the index's mask: only then is it computed for the unlisted rows"""
        return (self.bias and not self.row_scale) or (self.row_scale and not self.row_scale_masks)

    def unlisted(self, bias_buf, rs_buf, row, col):
        """the value of a row of A that the index does not list (a zero row): epilogue(0)"""
        return self.apply(T.float32(0), bias_buf, col, T.Cast("float32", rs_buf[row]) if self.row_scale else None)
