"""``PropagatePadding`` (pit_tvm/passes/propagate_padding.py): a token-wise matmul whose padded
rows reach only token-wise ops becomes a rows-kind PIT wrapper call taking the padding mask;
one whose padded rows would reach a sum over the sequence stays, with ``dense`` and ``stop``
records.  (Named ``..._pass`` beside tests/passes/test_propagate_padding.py, its model-level tests.)"""
from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from pit_tvm.passes import PropagatePadding

SOURCE = "padding:attention_mask"
PIT_REASON = ("padding propagated from graph input 'attention_mask': the rows of padded tokens reach only "
              "token-wise ops and masked attention; rows index built from the mask, shared by the matmuls it masks")


def wrapper_attrs(fid: int, k: int, tensor: str) -> dict:
    """the attrs of the rows-kind wrapper ``pit_matmul_<fid>`` of a matmul on ``tensor[..., k]``"""
    return {"pit.id": fid, "pit.micro_tile": [1, k], "pit.reason": PIT_REASON, "pit.row_mask_arg": 1,
            "pit.rule": "M:SRead+SWrite", "pit.source": SOURCE, "pit.sparse_operand": "lhs", "pit.tensor": tensor}


def pit_record(fid: int, k: int, tensor: str) -> dict:
    """the ``pit.annotations`` record of that wrapper"""
    return {"function": f"pit_matmul_{fid}", "micro_tile": [1, k], "reason": PIT_REASON, "rule": "M:SRead+SWrite",
            "source": SOURCE, "status": "pit", "tensor": tensor}


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


def test_masked_attention_keeps_the_projections_on_real_tokens():
    """A one-head attention whose scores get the mask bias ``(1 - mask) * -1e4`` on the padded
    keys: the padded rows of K reach only masked scores (softmax gives them weight 0) and those
    of V only a sum with weight 0, so the Q, K, V and output projections all run on the real
    tokens, each from the mask's rows index."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8, 32), "float32"), attention_mask: R.Tensor((2, 8), "float32"),
                 wq: R.Tensor((32, 16), "float32"), wk: R.Tensor((32, 16), "float32"),
                 wv: R.Tensor((32, 16), "float32"),
                 wo: R.Tensor((16, 32), "float32")) -> R.Tensor((2, 8, 32), "float32"):
            with R.dataflow():
                q = R.matmul(x, wq)
                k = R.matmul(x, wk)
                v = R.matmul(x, wv)
                kt = R.permute_dims(k, [0, 2, 1])
                scores = R.matmul(q, kt)
                m3 = R.reshape(attention_mask, R.shape([2, 1, 8]))
                pad = R.subtract(R.const(1.0, "float32"), m3)
                bias = R.multiply(pad, R.const(-10000.0, "float32"))
                logits = R.add(scores, bias)
                probs = R.nn.softmax(logits, axis=-1)
                o = R.matmul(probs, v)
                out = R.matmul(o, wo)
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def pit_matmul_0(a: R.Tensor((2, 8, 32), "float32"), b: R.Tensor((32, 16), "float32"),
                         row_mask: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 8, 16), "float32"):
            R.func_attr(wrapper_attrs(0, 32, "x"))
            gv = R.matmul(a, b)
            return gv

        @R.function(private=True)
        def pit_matmul_1(a: R.Tensor((2, 8, 32), "float32"), b: R.Tensor((32, 16), "float32"),
                         row_mask: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 8, 16), "float32"):
            R.func_attr(wrapper_attrs(1, 32, "x"))
            gv = R.matmul(a, b)
            return gv

        @R.function(private=True)
        def pit_matmul_2(a: R.Tensor((2, 8, 32), "float32"), b: R.Tensor((32, 16), "float32"),
                         row_mask: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 8, 16), "float32"):
            R.func_attr(wrapper_attrs(2, 32, "x"))
            gv = R.matmul(a, b)
            return gv

        @R.function(private=True)
        def pit_matmul_3(a: R.Tensor((2, 8, 16), "float32"), b: R.Tensor((16, 32), "float32"),
                         row_mask: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 8, 32), "float32"):
            R.func_attr(wrapper_attrs(3, 16, "o"))
            gv = R.matmul(a, b)
            return gv

        @R.function
        def main(x: R.Tensor((2, 8, 32), "float32"), attention_mask: R.Tensor((2, 8), "float32"),
                 wq: R.Tensor((32, 16), "float32"), wk: R.Tensor((32, 16), "float32"),
                 wv: R.Tensor((32, 16), "float32"),
                 wo: R.Tensor((16, 32), "float32")) -> R.Tensor((2, 8, 32), "float32"):
            R.func_attr({"pit.annotations": [
                pit_record(0, 32, "x"), pit_record(1, 32, "x"), pit_record(2, 32, "x"), pit_record(3, 16, "o"),
                {"reason": "outputs at padded positions are not computed (batch axis 0, sequence axis 1)",
                 "source": SOURCE, "status": "output", "tensor": "out"}]})
            cls = Expected
            with R.dataflow():
                q = cls.pit_matmul_0(x, wq, attention_mask)
                k = cls.pit_matmul_1(x, wk, attention_mask)
                v = cls.pit_matmul_2(x, wv, attention_mask)
                kt = R.permute_dims(k, [0, 2, 1])
                scores = R.matmul(q, kt)
                m3 = R.reshape(attention_mask, R.shape([2, 1, 8]))
                pad = R.subtract(R.const(1.0, "float32"), m3)
                bias = R.multiply(pad, R.const(-10000.0, "float32"))
                logits = R.add(scores, bias)
                probs = R.nn.softmax(logits, axis=-1)
                o = R.matmul(probs, v)
                out = cls.pit_matmul_3(o, wo, attention_mask)
                R.output(out)
            return out

    tvm.ir.assert_structural_equal(PropagatePadding()(Before), Expected)
