"""``AnnotateDynamicSparsity`` (pit_tvm/passes/annotate.py): a matmul whose left operand comes
from a ReLU, or is masked by a padding mask, becomes a call of a private wrapper function
carrying the PIT attrs (micro-tile, rule, source); every decision is listed in ``main``'s
``pit.annotations``.  A matmul PIT cannot take stays, with a warning and a ``dense`` record."""
from __future__ import annotations

import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from pit_tvm.passes import AnnotateDynamicSparsity

RELU_REASON = "left operand is produced by R.nn.relu (activation sparsity)"
MASK_REASON = "left operand is masked (multiply) by graph input 'attention_mask' (padding: whole rows are zero)"


def test_relu_fed_matmul_is_wrapped():
    """Activation sparsity: the default 32 x 1 micro-tile, the K:SRead rule."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((64, 64), "float32"), w1: R.Tensor((64, 32), "float32"),
                 w2: R.Tensor((32, 16), "float32")) -> R.Tensor((64, 16), "float32"):
            with R.dataflow():
                h = R.matmul(x, w1)
                r = R.nn.relu(h)
                y = R.matmul(r, w2)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def pit_matmul_0(a: R.Tensor((64, 32), "float32"),
                         b: R.Tensor((32, 16), "float32")) -> R.Tensor((64, 16), "float32"):
            R.func_attr({"pit.id": 0, "pit.micro_tile": [32, 1], "pit.reason": RELU_REASON, "pit.rule": "K:SRead",
                         "pit.source": "relu", "pit.sparse_operand": "lhs", "pit.tensor": "r"})
            gv = R.matmul(a, b)
            return gv

        @R.function
        def main(x: R.Tensor((64, 64), "float32"), w1: R.Tensor((64, 32), "float32"),
                 w2: R.Tensor((32, 16), "float32")) -> R.Tensor((64, 16), "float32"):
            R.func_attr({"pit.annotations": [{"function": "pit_matmul_0", "micro_tile": [32, 1],
                                              "reason": RELU_REASON, "rule": "K:SRead", "source": "relu",
                                              "status": "pit", "tensor": "r"}]})
            cls = Expected
            with R.dataflow():
                h = R.matmul(x, w1)
                r = R.nn.relu(h)
                y = cls.pit_matmul_0(r, w2)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(AnnotateDynamicSparsity()(Before), Expected)


def test_padding_masked_matmul_is_wrapped_with_its_row_mask():
    """A ``[..., 1]`` padding mask zeroes whole rows: micro-tile (1, K), rule M:SRead+SWrite, and
    the wrapper takes the mask as a third argument (the rows index is built from it)."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8, 32), "float32"), attention_mask: R.Tensor((2, 8, 1), "float32"),
                 w: R.Tensor((32, 16), "float32")) -> R.Tensor((2, 8, 16), "float32"):
            with R.dataflow():
                h = R.multiply(x, attention_mask)
                y = R.matmul(h, w)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def pit_matmul_0(a: R.Tensor((2, 8, 32), "float32"), b: R.Tensor((32, 16), "float32"),
                         row_mask: R.Tensor((2, 8, 1), "float32")) -> R.Tensor((2, 8, 16), "float32"):
            R.func_attr({"pit.id": 0, "pit.micro_tile": [1, 32], "pit.reason": MASK_REASON, "pit.row_mask_arg": 1,
                         "pit.rule": "M:SRead+SWrite", "pit.source": "padding:attention_mask",
                         "pit.sparse_operand": "lhs", "pit.tensor": "h"})
            gv = R.matmul(a, b)
            return gv

        @R.function
        def main(x: R.Tensor((2, 8, 32), "float32"), attention_mask: R.Tensor((2, 8, 1), "float32"),
                 w: R.Tensor((32, 16), "float32")) -> R.Tensor((2, 8, 16), "float32"):
            R.func_attr({"pit.annotations": [{
                "function": "pit_matmul_0", "micro_tile": [1, 32],
                "reason": MASK_REASON + "; rows index built from the mask, shared by the matmuls it masks",
                "rule": "M:SRead+SWrite", "source": "padding:attention_mask", "status": "pit", "tensor": "h"}],
                "pit.padding_inputs": ["attention_mask"]})
            cls = Expected
            with R.dataflow():
                h = R.multiply(x, attention_mask)
                y = cls.pit_matmul_0(h, w, attention_mask)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(AnnotateDynamicSparsity()(Before), Expected)


def test_matmul_it_cannot_take_stays_with_a_dense_record():
    """A ReLU-fed matmul on a batched (rank-3) right operand: no wrapper, a warning, and the
    decision recorded as ``dense`` with the reason; the bindings are untouched."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8, 32), "float32"), w: R.Tensor((2, 32, 16), "float32")):
            with R.dataflow():
                r = R.nn.relu(x)
                y = R.matmul(r, w)
                R.output(y)
            return y

    reason = "B has rank 3; PIT needs a 2-D [K, N] right operand"
    with pytest.warns(UserWarning, match="stays dense: B has rank 3"):
        after = AnnotateDynamicSparsity()(Before)
    expected = Before["main"].with_attr("pit.annotations", [{"reason": reason, "source": "relu",
                                                             "status": "dense", "tensor": "r"}])
    tvm.ir.assert_structural_equal(after, tvm.IRModule({"main": expected}))
    # nothing to annotate at all: only the (empty) record is added
    plain = tvm.IRModule({"main": Before["main"].with_attr("pit.annotations", [])})
    tvm.ir.assert_structural_equal(AnnotateDynamicSparsity(auto=False)(Before), plain)
