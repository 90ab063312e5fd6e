"""``PropagatePadding`` (pit_tvm/passes/propagate_padding.py): a token-wise matmul whose padded
rows reach only token-wise ops becomes a rows-kind PIT wrapper call taking the padding mask;
one whose padded rows would reach a sum over the sequence stays, with ``dense`` and ``stop``
records.  (Named ``..._pass`` beside tests/test_propagate_padding.py, its model-level tests.)"""
from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from pit_tvm.passes import PropagatePadding

SOURCE = "padding:attention_mask"
PIT_REASON = ("padding propagated from graph input 'attention_mask': the rows of padded tokens reach only "
              "token-wise ops and masked attention; rows index built from the mask, shared by the matmuls it masks")


def test_token_wise_matmul_runs_on_real_tokens():
    """x @ w then GELU: the matmul becomes ``pit_matmul_0(x, w, attention_mask)`` (micro-tile
    (1, K): whole token rows); the output is recorded as not computed at padded positions."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8, 32), "float32"), attention_mask: R.Tensor((2, 8), "float32"),
                 w: R.Tensor((32, 16), "float32")) -> R.Tensor((2, 8, 16), "float32"):
            with R.dataflow():
                y = R.matmul(x, w)
                z = R.nn.gelu(y)
                R.output(z)
            return z

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def pit_matmul_0(a: R.Tensor((2, 8, 32), "float32"), b: R.Tensor((32, 16), "float32"),
                         row_mask: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 8, 16), "float32"):
            R.func_attr({"pit.id": 0, "pit.micro_tile": [1, 32], "pit.reason": PIT_REASON, "pit.row_mask_arg": 1,
                         "pit.rule": "M:SRead+SWrite", "pit.source": SOURCE, "pit.sparse_operand": "lhs",
                         "pit.tensor": "x"})
            gv = R.matmul(a, b)
            return gv

        @R.function
        def main(x: R.Tensor((2, 8, 32), "float32"), attention_mask: R.Tensor((2, 8), "float32"),
                 w: R.Tensor((32, 16), "float32")) -> R.Tensor((2, 8, 16), "float32"):
            R.func_attr({"pit.annotations": [
                {"function": "pit_matmul_0", "micro_tile": [1, 32], "reason": PIT_REASON, "rule": "M:SRead+SWrite",
                 "source": SOURCE, "status": "pit", "tensor": "x"},
                {"reason": "outputs at padded positions are not computed (batch axis 0, sequence axis 1)",
                 "source": SOURCE, "status": "output", "tensor": "z"}]})
            cls = Expected
            with R.dataflow():
                y = cls.pit_matmul_0(x, w, attention_mask)
                z = R.nn.gelu(y)
                R.output(z)
            return z

    tvm.ir.assert_structural_equal(PropagatePadding()(Before), Expected)


def test_matmul_whose_padded_rows_are_summed_stays_dense():
    """A sum over the sequence axis would read the padded rows: the matmul stays, the stop and
    the dense decision are recorded, nothing else changes."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8, 32), "float32"), attention_mask: R.Tensor((2, 8), "float32"),
                 w: R.Tensor((32, 16), "float32")) -> R.Tensor((2, 16), "float32"):
            with R.dataflow():
                y = R.matmul(x, w)
                z = R.sum(y, axis=[1])
                R.output(z)
            return z

    stop = "sum over the sequence axis reads padded positions"
    records = [{"reason": f"padding: its padded rows would reach 'z': {stop}", "source": SOURCE, "status": "dense",
                "tensor": "x"},
               {"reason": stop, "source": SOURCE, "status": "stop", "tensor": "z"}]
    expected = tvm.IRModule({"main": Before["main"].with_attr("pit.annotations", records)})
    tvm.ir.assert_structural_equal(PropagatePadding()(Before), expected)
