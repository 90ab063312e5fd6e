"""``LowerToPIT`` (pit_tvm/passes/lower.py): each call of an annotated ``pit_matmul_*`` wrapper
becomes the PIT index build and kernel, the wrappers are dropped; what it cannot lower stays
dense.  The generated index and kernel PrimFuncs are stubs in ``Expected``
(:mod:`_ir_compare`); their numerics are tests/ops/test_matmul.py's."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from _ir_compare import assert_ir_equal
from pit_tvm.passes import LowerToPIT


@I.ir_module
class Annotated:
    """relu(x @ w1) @ w2 after AnnotateDynamicSparsity: the second matmul is a call of the
    wrapper ``pit_matmul_0`` (micro-tile 32 x 1, the K:SRead rule)."""

    @R.function(private=True)
    def pit_matmul_0(a: R.Tensor((64, 32), "float32"),
                     b: R.Tensor((32, 16), "float32")) -> R.Tensor((64, 16), "float32"):
        R.func_attr({"pit.id": 0, "pit.micro_tile": [32, 1], "pit.reason": "relu", "pit.rule": "K:SRead",
                     "pit.source": "relu", "pit.sparse_operand": "lhs", "pit.tensor": "r"})
        gv: R.Tensor((64, 16), "float32") = R.matmul(a, b)
        return gv

    @R.function
    def main(x: R.Tensor((64, 64), "float32"), w1: R.Tensor((64, 32), "float32"),
             w2: R.Tensor((32, 16), "float32")) -> R.Tensor((64, 16), "float32"):
        cls = Annotated
        with R.dataflow():
            h = R.matmul(x, w1)
            r = R.nn.relu(h)
            y = cls.pit_matmul_0(r, w2)
            R.output(y)
        return y


@I.ir_module
class Lowered:
    """The index kernel lists r's non-zero 32 x 1 micro-tiles (offsets per strip of 32 rows, and
    the column ids), the PIT kernel reads r, w2 and the index; the wrapper is gone."""

    # (the kernels are generic in the row count m; their index sizes are arithmetic on it)
    @T.prim_func(private=True)
    def pit_index_32x1_k32_n16_float32(a_h: T.handle, offsets_h: T.handle, ids_h: T.handle):
        m, n_offsets, n_ids = T.int64(), T.int64(), T.int64()
        a = T.match_buffer(a_h, (m, 32), "float32")
        offsets = T.match_buffer(offsets_h, (n_offsets,), "int32")
        ids = T.match_buffer(ids_h, (n_ids,), "int32")
        T.evaluate(0)

    @T.prim_func(private=True)
    def pit_kernel_32x1_k32_n16_float32(a_h: T.handle, b: T.Buffer((32, 16), "float32"), offsets_h: T.handle,
                                        ids_h: T.handle, c_h: T.handle):
        m, n_offsets, n_ids = T.int64(), T.int64(), T.int64()
        a = T.match_buffer(a_h, (m, 32), "float32")
        offsets = T.match_buffer(offsets_h, (n_offsets,), "int32")
        ids = T.match_buffer(ids_h, (n_ids,), "int32")
        c = T.match_buffer(c_h, (m, 16), "float32")
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor((64, 64), "float32"), w1: R.Tensor((64, 32), "float32"),
             w2: R.Tensor((32, 16), "float32")) -> R.Tensor((64, 16), "float32"):
        cls = Lowered
        with R.dataflow():
            h = R.matmul(x, w1)
            r = R.nn.relu(h)
            index = R.call_tir(cls.pit_index_32x1_k32_n16_float32, (r,),
                               out_ty=[R.Tensor((3,), "int32"), R.Tensor((64,), "int32")])
            offsets = index[0]
            ids = index[1]
            c = R.call_tir(cls.pit_kernel_32x1_k32_n16_float32, (r, w2, offsets, ids),
                           out_ty=R.Tensor((64, 16), "float32"))
            y = c
            R.output(y)
        return y


def test_wrapper_call_becomes_index_and_kernel():
    assert_ir_equal(LowerToPIT("llvm")(Annotated), Lowered)


def test_failed_lowering_stays_a_dense_matmul():
    """The op layer raising for a matmul (here: a stand-in ``emit`` that always does) leaves that
    matmul dense, with a warning naming it."""
    def failing_emit(bb, a, b, **kw):
        raise ValueError("no kernel for this shape")

    @I.ir_module
    class Dense:
        @R.function
        def main(x: R.Tensor((64, 64), "float32"), w1: R.Tensor((64, 32), "float32"),
                 w2: R.Tensor((32, 16), "float32")) -> R.Tensor((64, 16), "float32"):
            with R.dataflow():
                h = R.matmul(x, w1)
                r = R.nn.relu(h)
                y = R.matmul(r, w2)
                R.output(y)
            return y

    with pytest.warns(UserWarning, match="pit_matmul_0 .*r.* failed, stays dense: no kernel"):
        after = LowerToPIT("llvm", emit=failing_emit)(Annotated)
    tvm.ir.assert_structural_equal(after, Dense)


def test_module_without_wrappers_is_left_alone():
    """A module with no ``pit.rule`` wrapper is returned as it is."""
    @I.ir_module
    class Plain:
        @R.function
        def main(x: R.Tensor((64, 32), "float32"), w: R.Tensor((32, 16), "float32")) -> R.Tensor((64, 16), "float32"):
            with R.dataflow():
                r = R.nn.relu(x)
                y = R.matmul(r, w)
                R.output(y)
            return y

    after = LowerToPIT("llvm")(Plain)
    tvm.ir.assert_structural_equal(after, Plain)


@I.ir_module
class MaskedWithEpilogue:
    """A padding-masked matmul (wrapper with the row mask as third argument, whole-row
    micro-tile) followed by a bias + ReLU chain."""

    @R.function(private=True)
    def pit_matmul_0(a: R.Tensor((2, 8, 32), "float32"), b: R.Tensor((32, 16), "float32"),
                     row_mask: R.Tensor((2, 8, 1), "float32")) -> R.Tensor((2, 8, 16), "float32"):
        R.func_attr({"pit.id": 0, "pit.micro_tile": [1, 32], "pit.reason": "mask", "pit.row_mask_arg": 1,
                     "pit.rule": "M:SRead+SWrite", "pit.source": "padding:attention_mask",
                     "pit.sparse_operand": "lhs", "pit.tensor": "h"})
        gv = R.matmul(a, b)
        return gv

    @R.function
    def main(x: R.Tensor((2, 8, 32), "float32"), attention_mask: R.Tensor((2, 8, 1), "float32"),
             w: R.Tensor((32, 16), "float32"), b: R.Tensor((16,), "float32")) -> R.Tensor((2, 8, 16), "float32"):
        cls = MaskedWithEpilogue
        with R.dataflow():
            h = R.multiply(x, attention_mask)
            y = cls.pit_matmul_0(h, w, attention_mask)
            z = R.add(y, b)
            r = R.nn.relu(z)
            R.output(r)
        return r


@I.ir_module
class MaskedLowered:
    """The rows index is built from the mask (one value per row), not from h; the PIT kernel
    runs on h's rows; on the CPU the chain stays Relax ops after it."""

    @T.prim_func(private=True)
    def pit_row_index_float32(mask_h: T.handle, offsets: T.Buffer((2,), "int32"), ids_h: T.handle):
        m = T.int64()
        mask = T.match_buffer(mask_h, (m, 1), "float32")
        ids = T.match_buffer(ids_h, (m,), "int32")
        T.evaluate(0)

    @T.prim_func(private=True)
    def pit_kernel_1x32_k32_n16_float32(a_h: T.handle, w: T.Buffer((32, 16), "float32"),
                                        offsets: T.Buffer((2,), "int32"), ids_h: T.handle, c_h: T.handle):
        m, n_ids = T.int64(), T.int64()
        a = T.match_buffer(a_h, (m, 32), "float32")
        ids = T.match_buffer(ids_h, (n_ids,), "int32")
        c = T.match_buffer(c_h, (m, 16), "float32")
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor((2, 8, 32), "float32"), attention_mask: R.Tensor((2, 8, 1), "float32"),
             w: R.Tensor((32, 16), "float32"), b: R.Tensor((16,), "float32")) -> R.Tensor((2, 8, 16), "float32"):
        cls = MaskedLowered
        with R.dataflow():
            h = R.multiply(x, attention_mask)
            rows = R.reshape(h, R.shape([16, 32]))
            row_mask = R.reshape(attention_mask, R.shape([16, 1]))
            index = R.call_tir(cls.pit_row_index_float32, (row_mask,),
                               out_ty=[R.Tensor((2,), "int32"), R.Tensor((16,), "int32")])
            offsets = index[0]
            ids = index[1]
            c = R.call_tir(cls.pit_kernel_1x32_k32_n16_float32, (rows, w, offsets, ids),
                           out_ty=R.Tensor((16, 16), "float32"))
            y = R.reshape(c, R.shape([2, 8, 16]))
            z = R.add(y, b)
            r1 = R.nn.relu(z)
            r = r1
            R.output(r)
        return r


def test_row_mask_builds_the_index_and_the_chain_follows_the_kernel():
    """LowerToPIT lowers the matmul at its own binding and again with its epilogue chain; the
    first is dead code, which DeadCodeElimination (run after it in compile_onnx) removes."""
    bind = tvm.relax.transform.BindParams("main", {"b": np.linspace(-1, 1, 16).astype("float32")})
    after = tvm.relax.transform.DeadCodeElimination()(LowerToPIT("llvm")(bind(MaskedWithEpilogue)))
    assert_ir_equal(after, bind(MaskedLowered))


def test_cuda_dense_fallback_is_recorded_in_the_annotations():
    """On CUDA an fp32 matmul has no tensor-core PIT kernel: LowerToPIT keeps it dense (a
    warning), and its record in main's ``pit.annotations`` (what ``CompiledModel.annotations``
    lists) says ``dense`` with the op layer's reason, not ``pit``; records of other matmuls are
    kept as they were."""
    from pit_tvm.passes import annotations_of
    from pit_tvm.passes.annotate import ANNOTATIONS_ATTR

    records = [{"tensor": "r", "source": "relu", "status": "pit", "function": "pit_matmul_0",
                "micro_tile": [32, 1], "rule": "K:SRead", "reason": "relu output"},
               {"tensor": "q", "source": "mask:m", "status": "dense", "reason": "no weight"}]
    mod = tvm.IRModule(dict(Annotated.functions_items()))
    mod["main"] = Annotated["main"].with_attr(ANNOTATIONS_ATTR, records)
    assert [n["status"] for n in annotations_of(mod)] == ["pit", "dense"]
    with pytest.warns(UserWarning, match="pit_matmul_0 .*stays dense: no tensor-core PIT kernel"):
        after = LowerToPIT("cuda")(mod)
    notes = annotations_of(after)
    assert [n["status"] for n in notes] == ["dense", "dense"]
    assert notes[0]["reason"].startswith("relu output; no PIT kernel, stays dense: no tensor-core PIT kernel for float32")
    assert notes[1] == records[1]
    # where the lowering succeeds the record stays pit
    assert [n["status"] for n in annotations_of(LowerToPIT("llvm")(mod))] == ["pit", "dense"]
